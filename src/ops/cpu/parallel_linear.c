/* The column- and row-parallel linear in fixed shards (the op: ../parallel_linear.c) through
 * oneDNN's f32 inner product: one forward, one backward-data and one backward-weights primitive
 * of a shard's shape (with and without the bias), run once per shard on pointers into the
 * layer's tensors. A shard's weights are a block of the rank's rows (column, one part: used
 * where they are) or are gathered into a copy of their own at every forward (column, several
 * parts: each part's rows; row: a block of columns), so that every product reads plain dense
 * operands of the same shape at every layout. Sums over shards go up the pairwise tree
 * (td__pairwise_sum): the row layer's outputs, the column layer's input gradients. */
#include <string.h>

#include "core/core_impl.h"
#include "ops/cpu/onednn.h"

typedef struct {
    int64_t L, parts, N, K, Ob, P; /* a shard: N rows of K inputs to P = parts Ob outputs */
    int column, by_shard;
    dnnl_primitive_t fwd, fwd_nb, bwd_data, bwd_w, bwd_w_nb; /* _nb: without the bias */
    float *wl;     /* (L, P, K) each shard's weights gathered, or NULL (column, one part) */
    float *bl;     /* column, several parts: (L, P) each shard's bias gathered */
    float *leaves; /* (L - 1) x column (N, K) input gradients / row (N, P) outputs of shards 1.. */
    float *rows;   /* column not by shard: (N, P) a shard's output or output gradient, dense */
    float *dwl;    /* (P, K) a shard's weight gradient before it goes to its rows or columns */
    float *dbl;    /* column, several parts: (P) a shard's bias gradient */
    td__mem x, w, b, y, dy, dx, dw, db;
} plin_state;

/* The primitives of one shard: (N, K) -> (N, P), with and without a bias. */
static td_status plin_primitives(td__op_ctx *ctx, plin_state *s, int has_bias, int grads) {
    td_shape xs = td_shape_2d(s->N, s->K), ws = td_shape_2d(s->P, s->K),
             ys = td_shape_2d(s->N, s->P), bs = td_shape_1d(s->P);
    dnnl_memory_desc_t xmd, wmd, ymd, bmd;
    td__md_plain(&xmd, &xs, TD_F32);
    td__md_plain(&wmd, &ws, TD_F32);
    td__md_plain(&ymd, &ys, TD_F32);
    td__md_plain(&bmd, &bs, TD_F32);
    dnnl_primitive_t *fwd[2] = {&s->fwd_nb, &s->fwd}, *bw[2] = {&s->bwd_w_nb, &s->bwd_w};
    for (int with = 0; with < 2; with++) {
        if (with && !has_bias) break;
        dnnl_inner_product_desc_t d;
        dnnl_primitive_desc_t fpd = NULL, pd = NULL;
        TD__DNNL(dnnl_inner_product_forward_desc_init(&d, dnnl_forward_training, &xmd, &wmd,
                                                      with ? &bmd : NULL, &ymd),
                 "parallel_linear forward");
        TD__TRY(td__pd_create(ctx, &fpd, &d, NULL, "parallel_linear forward"));
        td_status st = td__prim_create(fwd[with], fpd, "parallel_linear forward");
        if (st == TD_OK && grads && !s->bwd_data) {
            if (dnnl_inner_product_backward_data_desc_init(&d, &xmd, &wmd, &ymd) != dnnl_success)
                st = td__fail(TD_EBACKEND, "parallel_linear: backward-data descriptor");
            if (st == TD_OK) st = td__pd_create(ctx, &pd, &d, fpd, "parallel_linear backward data");
            if (st == TD_OK)
                st = td__prim_create(&s->bwd_data, pd, "parallel_linear backward data");
            if (pd) dnnl_primitive_desc_destroy(pd);
            pd = NULL;
        }
        if (st == TD_OK && grads) {
            if (dnnl_inner_product_backward_weights_desc_init(&d, &xmd, &wmd, with ? &bmd : NULL,
                                                              &ymd) != dnnl_success)
                st = td__fail(TD_EBACKEND, "parallel_linear: backward-weights descriptor");
            if (st == TD_OK)
                st = td__pd_create(ctx, &pd, &d, fpd, "parallel_linear backward weights");
            if (st == TD_OK) st = td__prim_create(bw[with], pd, "parallel_linear backward weights");
            if (pd) dnnl_primitive_desc_destroy(pd);
        }
        dnnl_primitive_desc_destroy(fpd);
        TD__TRY(st);
    }
    td__mem *act[] = {&s->x, &s->dx};
    for (int i = 0; i < 2; i++) TD__TRY(td__mem_init(ctx, act[i], &xmd));
    TD__TRY(td__mem_init(ctx, &s->w, &wmd));
    TD__TRY(td__mem_init(ctx, &s->dw, &wmd));
    TD__TRY(td__mem_init(ctx, &s->y, &ymd));
    TD__TRY(td__mem_init(ctx, &s->dy, &ymd));
    TD__TRY(td__mem_init(ctx, &s->b, &bmd));
    return td__mem_init(ctx, &s->db, &bmd);
}

static float *alloc_floats(td__op_ctx *ctx, int64_t n, int *failed) {
    if (n <= 0) return NULL;
    float *p = td__op_alloc(ctx, (size_t)n * sizeof(float));
    if (!p) *failed = 1;
    return p;
}

static td_status plin_compile(td__op_ctx *ctx, td__node *n) {
    plin_state *s = td__op_alloc(ctx, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "%s: out of memory", n->what);
    n->state = s;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    s->L = n->attr.plin.shards;
    s->column = n->variant == TD__PLIN_COLUMN;
    s->by_shard = n->attr.plin.by_shard;
    s->parts = s->column ? n->attr.plin.parts : 1;
    if (s->column) {
        s->N = x->shape.dim[0];
        s->K = x->shape.dim[1];
        s->Ob = w->shape.dim[0] / (s->parts * s->L);
        s->P = s->parts * s->Ob;
    } else {
        s->N = x->shape.dim[0] / s->L;
        s->K = x->shape.dim[1];
        s->Ob = s->P = w->shape.dim[0];
    }
    int grads = n->out->requires_grad && w->requires_grad, failed = 0;
    if (s->parts > 1 || (!s->column && s->L > 1))
        s->wl = alloc_floats(ctx, s->L * s->P * s->K, &failed);
    if (s->column && s->parts > 1 && b) s->bl = alloc_floats(ctx, s->L * s->P, &failed);
    if (s->column && !s->by_shard) s->rows = alloc_floats(ctx, s->N * s->P, &failed);
    if (s->column && grads && x->requires_grad)
        s->leaves = alloc_floats(ctx, (s->L - 1) * s->N * s->K, &failed);
    if (!s->column) s->leaves = alloc_floats(ctx, (s->L - 1) * s->N * s->P, &failed);
    if (grads && (s->parts > 1 || (!s->column && s->L > 1)))
        s->dwl = alloc_floats(ctx, s->P * s->K, &failed);
    if (grads && s->bl) s->dbl = alloc_floats(ctx, s->P, &failed);
    if (failed) return td__fail(TD_ENOMEM, "%s: out of memory", n->what);
    return plin_primitives(ctx, s, b != NULL, grads);
}

/* Shard l's weights as the products read them: its rows of each part (column), its columns
 * (row), gathered when they are not one block already; and its bias. */
static const float *shard_weights(plin_state *s, const float *w, int64_t l, int gather) {
    if (s->column && s->parts == 1) return w + l * s->Ob * s->K;
    if (!s->column && s->L == 1) return w;
    float *to = s->wl + l * s->P * s->K;
    if (!gather) return to;
    if (s->column) {
        for (int64_t p = 0; p < s->parts; p++)
            memcpy(to + p * s->Ob * s->K, w + (p * s->L + l) * s->Ob * s->K,
                   (size_t)(s->Ob * s->K) * sizeof(float));
    } else {
        for (int64_t o = 0; o < s->P; o++)
            memcpy(to + o * s->K, w + (o * s->L + l) * s->K, (size_t)s->K * sizeof(float));
    }
    return to;
}

static const float *shard_bias(plin_state *s, const float *b, int64_t l) {
    if (!b || !s->column) return b;
    if (s->parts == 1) return b + l * s->Ob;
    float *to = s->bl + l * s->P;
    for (int64_t p = 0; p < s->parts; p++)
        memcpy(to + p * s->Ob, b + (p * s->L + l) * s->Ob, (size_t)s->Ob * sizeof(float));
    return to;
}

/* A column layer's shard l of a (N, parts L Ob) matrix, moved to or from the dense (N, P). */
static void move_rows(plin_state *s, float *whole, float *dense, int64_t l, int to_whole) {
    int64_t O = s->parts * s->L * s->Ob;
    size_t bytes = (size_t)s->Ob * sizeof(float);
    for (int64_t r = 0; r < s->N; r++)
        for (int64_t p = 0; p < s->parts; p++) {
            float *a = whole + r * O + (p * s->L + l) * s->Ob, *d = dense + r * s->P + p * s->Ob;
            if (to_whole)
                memcpy(a, d, bytes);
            else
                memcpy(d, a, bytes);
        }
}

static td_status plin_forward(td__op_ctx *ctx, td__node *n) {
    plin_state *s = n->state;
    const float *x = n->in[0]->data, *w = n->in[1]->data, *b = n->in[2] ? n->in[2]->data : NULL;
    float *y = n->out->data, *out[64];
    for (int64_t l = 0; l < s->L; l++) {
        const float *xl = s->column ? x : x + l * s->N * s->K;
        const float *bias = s->column || l == 0 ? shard_bias(s, b, l) : NULL;
        if (s->column)
            out[l] = s->by_shard ? y + l * s->N * s->P : s->rows;
        else
            out[l] = l == 0 ? y : s->leaves + (l - 1) * s->N * s->P;
        td__mem_bind(&s->x, (void *)xl);
        td__mem_bind(&s->w, (void *)shard_weights(s, w, l, 1));
        td__mem_bind(&s->y, out[l]);
        dnnl_exec_arg_t a[4] = {{DNNL_ARG_SRC, s->x.mem},
                                {DNNL_ARG_WEIGHTS, s->w.mem},
                                {DNNL_ARG_DST, s->y.mem},
                                {DNNL_ARG_BIAS, s->b.mem}};
        if (bias) td__mem_bind(&s->b, (void *)bias);
        TD__TRY(
            td__exec(ctx, bias ? s->fwd : s->fwd_nb, bias ? 4 : 3, a, "parallel_linear forward"));
        if (s->column && !s->by_shard) move_rows(s, y, s->rows, l, 1);
    }
    if (!s->column) td__pairwise_sum(out, (size_t)s->L, (size_t)(s->N * s->P));
    return TD_OK;
}

/* Shard l's weight (and bias) gradient into the layer's: its rows of each part (column) or its
 * columns (row). */
static void put_weight_grad(plin_state *s, float *dw, int64_t l) {
    if (s->column) {
        for (int64_t p = 0; p < s->parts; p++)
            memcpy(dw + (p * s->L + l) * s->Ob * s->K, s->dwl + p * s->Ob * s->K,
                   (size_t)(s->Ob * s->K) * sizeof(float));
    } else {
        for (int64_t o = 0; o < s->P; o++)
            memcpy(dw + (o * s->L + l) * s->K, s->dwl + o * s->K, (size_t)s->K * sizeof(float));
    }
}

static void put_bias_grad(plin_state *s, float *db, int64_t l) {
    for (int64_t p = 0; p < s->parts; p++)
        memcpy(db + (p * s->L + l) * s->Ob, s->dbl + p * s->Ob, (size_t)s->Ob * sizeof(float));
}

static td_status plin_backward(td__op_ctx *ctx, td__node *n) {
    plin_state *s = n->state;
    td_tensor *xt = n->in[0], *wt = n->in[1], *bt = n->in[2];
    const float *x = xt->data, *w = wt->data, *dy = n->out->grad;
    float *dw = wt->requires_grad ? td__grad_begin(ctx, wt, 1) : NULL;
    float *db = bt && dw ? td__grad_begin(ctx, bt, 2) : NULL;
    int in_place = s->dwl == NULL; /* a shard's weight gradient is one block of the layer's */
    for (int64_t l = 0; dw && l < s->L; l++) {
        const float *xl = s->column ? x : x + l * s->N * s->K;
        const float *dyl = dy;
        if (s->column && s->by_shard) dyl = dy + l * s->N * s->P;
        if (s->column && !s->by_shard) {
            move_rows(s, (float *)dy, s->rows, l, 0);
            dyl = s->rows;
        }
        int bias = db && (s->column || l == 0);
        float *dwl = in_place ? dw + l * s->P * s->K : s->dwl;
        float *dbl = !bias ? NULL : s->dbl ? s->dbl : s->column ? db + l * s->Ob : db;
        td__mem_bind(&s->x, (void *)xl);
        td__mem_bind(&s->dy, (void *)dyl);
        td__mem_bind(&s->dw, dwl);
        if (bias) td__mem_bind(&s->db, dbl);
        dnnl_exec_arg_t a[4] = {{DNNL_ARG_SRC, s->x.mem},
                                {DNNL_ARG_DIFF_DST, s->dy.mem},
                                {DNNL_ARG_DIFF_WEIGHTS, s->dw.mem},
                                {DNNL_ARG_DIFF_BIAS, s->db.mem}};
        TD__TRY(td__exec(ctx, bias ? s->bwd_w : s->bwd_w_nb, bias ? 4 : 3, a,
                         "parallel_linear backward weights"));
        if (!in_place) put_weight_grad(s, dw, l);
        if (bias && s->dbl) put_bias_grad(s, db, l);
    }
    if (dw) td__grad_end(ctx, wt);
    if (db) td__grad_end(ctx, bt);
    /* Final weight gradients go to DDP before the data gradient is computed. */
    ctx->params_ready(ctx, n, 1);
    if (!xt->requires_grad) return TD_OK;
    float *dx = td__grad_begin(ctx, xt, 0), *leaf[64];
    for (int64_t l = 0; l < s->L; l++) {
        const float *dyl = dy;
        if (s->column && s->by_shard) dyl = dy + l * s->N * s->P;
        if (s->column && !s->by_shard) {
            move_rows(s, (float *)dy, s->rows, l, 0);
            dyl = s->rows;
        }
        if (s->column)
            leaf[l] = l == 0 ? dx : s->leaves + (l - 1) * s->N * s->K;
        else
            leaf[l] = dx + l * s->N * s->K;
        /* forward's gathered copy: the parameters have not changed since */
        td__mem_bind(&s->w, (void *)shard_weights(s, w, l, 0));
        td__mem_bind(&s->dy, (void *)dyl);
        td__mem_bind(&s->dx, leaf[l]);
        dnnl_exec_arg_t a[3] = {{DNNL_ARG_DIFF_DST, s->dy.mem},
                                {DNNL_ARG_WEIGHTS, s->w.mem},
                                {DNNL_ARG_DIFF_SRC, s->dx.mem}};
        TD__TRY(td__exec(ctx, s->bwd_data, 3, a, "parallel_linear backward data"));
    }
    if (s->column) td__pairwise_sum(leaf, (size_t)s->L, (size_t)(s->N * s->K));
    return td__grad_end(ctx, xt);
}

static void plin_destroy(td__node *n) {
    plin_state *s = n->state;
    if (!s) return;
    dnnl_primitive_t p[] = {s->fwd, s->fwd_nb, s->bwd_data, s->bwd_w, s->bwd_w_nb};
    for (size_t i = 0; i < sizeof p / sizeof *p; i++)
        if (p[i]) dnnl_primitive_destroy(p[i]);
    td__mem *m[] = {&s->x, &s->w, &s->b, &s->y, &s->dy, &s->dx, &s->dw, &s->db};
    for (size_t i = 0; i < sizeof m / sizeof *m; i++) td__mem_free(m[i]);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_parallel_linear = {
    .compile = plin_compile,
    .forward = plin_forward,
    .backward = plin_backward,
    .destroy = plin_destroy,
};
