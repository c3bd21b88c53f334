/* The linear (fully connected) node: y = x W^T + b with PyTorch's (OUT, IN) weight layout kept
 * as is, so parameters need no reorder. Inputs are plain (N, IN); flatten has already undone any
 * blocked layout.
 *
 * f32 runs oneDNN's inner product. bf16 (and any other low dtype) runs its matmul primitive,
 * which reads the plain weights through strides (W^T for forward, W for backward data, dy^T x
 * for the weight gradient, and the bias gradient as a row of ones times dy), as PyTorch's bf16
 * linear layers do. oneDNN 2.6's bf16 inner product on plain layouts falls to its GEMM
 * ("x64:gemm:jit"): on an Intel CPU with AVX512_BF16 (family 6 model 207) the MLP's bf16 step
 * ran at half its f32 speed with it, where the matmul ("brg:avx512_core_bf16") ran PyTorch's
 * bf16 Linear at 2.6x its f32; on AMD's Zen 5 the two are within 5% of each other.
 *
 * With blocked_linear, forward and backward data read copies of the weights in the blocked
 * layouts oneDNN's kernels pick (AB16b64a for the f32 inner product on AVX-512): with the plain
 * layout the GEMM packs the weights again at every call, which at 16 samples costs more than the
 * product itself (and a row of 1024 floats, 4 KiB, maps every row to the same cache sets). The
 * copies are made at each forward, or once per step when the graph keeps its weights; the
 * weight gradient stays plain, where a blocked kernel is no faster and the td_param view needs
 * it. Where the forward kernel's layout is one linear_layout.c writes, an optimizer step lays the
 * copy out as it writes the weights (td_param.written), and the next forward takes it. (Backward
 * data as a forward kernel over a blocked W^T, which spares oneDNN's backward-data kernel the
 * transposition it makes of its copy at every call, measured no faster for the MLP: a second copy
 * per step costs what it saves.) */
#include <stdlib.h>
#include <string.h>

#include "ops/cpu/linear_layout.h"
#include "ops/cpu/linear_shards.h"
#include "ops/cpu/onednn.h"

typedef struct {
    int matmul; /* the matmul primitive (low dtypes), else the inner product */
    dnnl_primitive_t fwd, bwd_data, bwd_w, bwd_b; /* bwd_b: the matmul's bias gradient */
    td__adapt w_fwd; /* plain weights -> the forward kernel's layout, where it differs */
    td__adapt w_bd;  /* plain weights -> the matmul's backward-data layout, where it differs */
    void *w_now;     /* the weights of the current pass in the forward kernel's layout */
    void *ones;      /* (1, N) ones in the dtype: the matmul's bias gradient is ones dy */
    td__mem x, w, b, y, dy, dx, dw, db;
    td__mem dyt, wbd, one; /* the matmul's dy^T view, backward-data weights and ones */
    float *kept;           /* (kept_count shards) each shard's x and dy, packed (linear_shards.h) */
    size_t kept_count;
    int lays_out;          /* w_fwd's copy is laid out here as the weights are written */
    td__linear_layout lay; /* its layout then */
    int64_t laid;          /* its row groups laid out since the writing began */
} linear_state;

/* oneDNN 2.6's matmul takes a 2-d bias. */
static void bias_row(dnnl_memory_desc_t *md, int64_t out, dnnl_data_type_t dt) {
    dnnl_dims_t d = {1, out};
    dnnl_memory_desc_init_by_tag(md, 2, d, dt, dnnl_ab);
}

/* A matmul primitive c = a b (+ bias); *b_chosen: the weights' layout it took, when asked. */
static td_status matmul_prim(td__op_ctx *ctx, dnnl_primitive_t *prim, const dnnl_memory_desc_t *a,
                             const dnnl_memory_desc_t *b, const dnnl_memory_desc_t *bias,
                             const dnnl_memory_desc_t *c, dnnl_memory_desc_t *b_chosen,
                             const char *what) {
    dnnl_matmul_desc_t d;
    dnnl_primitive_desc_t pd;
    TD__DNNL(dnnl_matmul_desc_init(&d, a, b, bias, c), what);
    TD__TRY(td__pd_create(ctx, &pd, &d, NULL, what));
    if (b_chosen) *b_chosen = td__pd_md(pd, dnnl_query_weights_md);
    td_status st = td__prim_create(prim, pd, what);
    dnnl_primitive_desc_destroy(pd);
    return st;
}

/* The matmul form: y = x W^T + b, dx = dy W, dW = dy^T x, db = ones dy, each reading the plain
 * tensors through strides (blocked_linear: the weights of forward and backward data through
 * copies in the layouts the kernels pick). */
static td_status matmul_compile(td__op_ctx *ctx, td__node *n, linear_state *s) {
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    int64_t N = x->shape.dim[0], IN = x->shape.dim[1], OUT = w->shape.dim[0];
    dnnl_data_type_t dt = td__dnnl_dtype(x->dtype);
    dnnl_memory_desc_t xmd = *td__md(x), wmd = *td__md(w), ymd = *td__md(n->out), bmd, wt, dyt,
                       ones;
    bias_row(&bmd, OUT, b ? td__dnnl_dtype(b->dtype) : dt);
    dnnl_dims_t wt_d = {IN, OUT}, wt_s = {1, IN}, dyt_d = {OUT, N}, dyt_s = {1, OUT},
                one_d = {1, N};
    TD__DNNL(dnnl_memory_desc_init_by_strides(&wt, 2, wt_d, dt, wt_s), "linear");
    TD__DNNL(dnnl_memory_desc_init_by_strides(&dyt, 2, dyt_d, dt, dyt_s), "linear");
    dnnl_memory_desc_init_by_tag(&ones, 2, one_d, dt, dnnl_ab);
    dnnl_memory_desc_t kw = wt, kbd = wmd; /* the weights as the kernels take them */
    if (ctx->blocked_linear) {
        dnnl_memory_desc_init_by_tag(&kw, 2, wt_d, dt, dnnl_format_tag_any);
        dnnl_memory_desc_init_by_tag(&kbd, 2, wmd.dims, dt, dnnl_format_tag_any);
    }
    TD__TRY(matmul_prim(ctx, &s->fwd, &xmd, &kw, b ? &bmd : NULL, &ymd, &kw, "linear forward"));
    TD__TRY(td__adapt_init(ctx, &s->w_fwd, &wt, &kw));
    if (x->requires_grad) {
        TD__TRY(
            matmul_prim(ctx, &s->bwd_data, &ymd, &kbd, NULL, &xmd, &kbd, "linear backward data"));
        TD__TRY(td__adapt_init(ctx, &s->w_bd, &wmd, &kbd));
    }
    if (w->requires_grad)
        TD__TRY(
            matmul_prim(ctx, &s->bwd_w, &dyt, &xmd, NULL, &wmd, NULL, "linear backward weights"));
    if (b && b->requires_grad) {
        TD__TRY(matmul_prim(ctx, &s->bwd_b, &ones, &ymd, NULL, &bmd, NULL, "linear bias gradient"));
        size_t size = (size_t)N * td_dtype_size(x->dtype);
        s->ones = td__op_alloc(ctx, size);
        if (!s->ones) return td__fail(TD_ENOMEM, "linear: out of memory");
        float one = 1.0f;
        for (int64_t i = 0; i < N; i++)
            td__convert((char *)s->ones + (size_t)i * td_dtype_size(x->dtype), x->dtype, &one,
                        TD_F32, 1);
    }
    TD__TRY(td__mem_init(ctx, &s->x, &xmd));
    TD__TRY(td__mem_init(ctx, &s->w, &kw));
    TD__TRY(td__mem_init(ctx, &s->b, &bmd));
    TD__TRY(td__mem_init(ctx, &s->y, &ymd));
    TD__TRY(td__mem_init(ctx, &s->dy, &ymd));
    TD__TRY(td__mem_init(ctx, &s->dyt, &dyt));
    TD__TRY(td__mem_init(ctx, &s->dx, &xmd));
    TD__TRY(td__mem_init(ctx, &s->dw, &wmd));
    TD__TRY(td__mem_init(ctx, &s->db, &bmd));
    if (s->bwd_data) TD__TRY(td__mem_init(ctx, &s->wbd, &kbd)); /* kbd is chosen by then */
    return td__mem_init(ctx, &s->one, &ones);
}

static td_status linear_compile(td__op_ctx *ctx, td__node *n) {
    linear_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "linear: out of memory");
    n->state = s;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    s->matmul = x->dtype != TD_F32;
    if (s->matmul) return matmul_compile(ctx, n, s);
    dnnl_memory_desc_t xmd = *td__md(x), wmd = *td__md(w), ymd = *td__md(n->out), bmd;
    dnnl_memory_desc_t kwmd = wmd; /* the weights as forward and backward data take them */
    if (ctx->blocked_linear)
        dnnl_memory_desc_init_by_tag(&kwmd, 2, wmd.dims, wmd.data_type, dnnl_format_tag_any);
    td_shape bs = td_shape_1d(w->shape.dim[0]);
    td__md_plain(&bmd, &bs, b ? b->dtype : x->dtype);
    dnnl_inner_product_desc_t d;
    dnnl_primitive_desc_t fpd = NULL, pd = NULL;
    TD__DNNL(dnnl_inner_product_forward_desc_init(&d, dnnl_forward_training, &xmd, &kwmd,
                                                  b ? &bmd : NULL, &ymd),
             "linear forward");
    TD__TRY(td__pd_create(ctx, &fpd, &d, NULL, "linear forward"));
    kwmd = td__pd_md(fpd, dnnl_query_weights_md);
    td_status st = td__prim_create(&s->fwd, fpd, "linear forward");
    if (st == TD_OK) st = td__adapt_init(ctx, &s->w_fwd, &wmd, &kwmd);
    if (st == TD_OK)
        s->lays_out = s->w_fwd.need && w->requires_grad && td__linear_layout_of(&s->lay, &kwmd);
    if (st == TD_OK && x->requires_grad) {
        if (dnnl_inner_product_backward_data_desc_init(&d, &xmd, &kwmd, &ymd) != dnnl_success)
            st = td__fail(TD_EBACKEND, "linear: backward-data descriptor");
        if (st == TD_OK) st = td__pd_create(ctx, &pd, &d, fpd, "linear backward data");
        if (st == TD_OK) st = td__prim_create(&s->bwd_data, pd, "linear backward data");
        if (pd) dnnl_primitive_desc_destroy(pd);
        pd = NULL;
    }
    if (st == TD_OK && w->requires_grad) {
        if (dnnl_inner_product_backward_weights_desc_init(&d, &xmd, &wmd, b ? &bmd : NULL, &ymd) !=
            dnnl_success)
            st = td__fail(TD_EBACKEND, "linear: backward-weights descriptor");
        if (st == TD_OK) st = td__pd_create(ctx, &pd, &d, fpd, "linear backward weights");
        if (st == TD_OK) st = td__prim_create(&s->bwd_w, pd, "linear backward weights");
        if (pd) dnnl_primitive_desc_destroy(pd);
    }
    dnnl_primitive_desc_destroy(fpd);
    TD__TRY(st);
    TD__TRY(td__mem_init(ctx, &s->x, &xmd));
    TD__TRY(td__mem_init(ctx, &s->w, &kwmd));
    TD__TRY(td__mem_init(ctx, &s->b, &bmd));
    TD__TRY(td__mem_init(ctx, &s->y, &ymd));
    TD__TRY(td__mem_init(ctx, &s->dy, &ymd));
    TD__TRY(td__mem_init(ctx, &s->dx, &xmd));
    TD__TRY(td__mem_init(ctx, &s->dw, &wmd));
    return td__mem_init(ctx, &s->db, &bmd);
}

static td_status linear_forward(td__op_ctx *ctx, td__node *n) {
    linear_state *s = n->state;
    s->w_now = td__adapt_weights(ctx, &s->w_fwd, n->in[1]->data);
    if (!s->w_now) return td__fail(TD_EBACKEND, "linear: weight reorder failed");
    td__mem_bind(&s->x, n->in[0]->data);
    td__mem_bind(&s->w, s->w_now);
    td__mem_bind(&s->y, n->out->data);
    dnnl_exec_arg_t a[4] = {{DNNL_ARG_SRC, s->x.mem},
                            {DNNL_ARG_WEIGHTS, s->w.mem},
                            {DNNL_ARG_DST, s->y.mem},
                            {DNNL_ARG_BIAS, s->b.mem}};
    if (n->in[2]) td__mem_bind(&s->b, n->in[2]->data);
    return td__exec(ctx, s->fwd, n->in[2] ? 4 : 3, a, "linear forward");
}

/* The matmul form's gradients: dW = dy^T x, db = ones dy, then dx = dy W. */
static td_status matmul_backward(td__op_ctx *ctx, td__node *n, linear_state *s) {
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    td__mem_bind(&s->dy, n->out->grad);
    if (s->bwd_w) {
        td__mem_bind(&s->dyt, n->out->grad);
        td__mem_bind(&s->x, x->data);
        td__mem_bind(&s->dw, td__grad_begin(ctx, w, 1));
        dnnl_exec_arg_t a[3] = {
            {DNNL_ARG_SRC, s->dyt.mem}, {DNNL_ARG_WEIGHTS, s->x.mem}, {DNNL_ARG_DST, s->dw.mem}};
        TD__TRY(td__exec(ctx, s->bwd_w, 3, a, "linear backward weights"));
        td__grad_end(ctx, w);
    }
    if (s->bwd_b) {
        td__mem_bind(&s->one, s->ones);
        td__mem_bind(&s->db, td__grad_begin(ctx, b, 2));
        dnnl_exec_arg_t a[3] = {
            {DNNL_ARG_SRC, s->one.mem}, {DNNL_ARG_WEIGHTS, s->dy.mem}, {DNNL_ARG_DST, s->db.mem}};
        TD__TRY(td__exec(ctx, s->bwd_b, 3, a, "linear bias gradient"));
        td__grad_end(ctx, b);
    }
    ctx->params_ready(ctx, n, 1);
    if (s->bwd_data) {
        void *wt = td__adapt_weights(ctx, &s->w_bd, w->data);
        if (!wt) return td__fail(TD_EBACKEND, "linear: weight reorder failed");
        td__mem_bind(&s->wbd, wt);
        td__mem_bind(&s->dx, td__grad_begin(ctx, x, 0));
        dnnl_exec_arg_t a[3] = {
            {DNNL_ARG_SRC, s->dy.mem}, {DNNL_ARG_WEIGHTS, s->wbd.mem}, {DNNL_ARG_DST, s->dx.mem}};
        TD__TRY(td__exec(ctx, s->bwd_data, 3, a, "linear backward data"));
        td__grad_end(ctx, x);
    }
    return TD_OK;
}

/* The weight and bias gradients of a sharded step (td_graph_set_shard): each shard packs its x
 * and dy; the last computes every shard's gradients and writes their sum in the shards' tree. */
static td_status shard_weights(td__op_ctx *ctx, td__node *n, linear_state *s) {
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    size_t j = ctx->shard_index, count = ctx->shard_count;
    int64_t N = x->shape.dim[0], IN = x->shape.dim[1], OUT = w->shape.dim[0];
    size_t each = td__linear_shard_floats(N, IN, OUT);
    if (s->kept_count < count) {
        free(s->kept);
        s->kept = aligned_alloc(64, count * each * sizeof *s->kept);
        s->kept_count = s->kept ? count : 0;
        if (!s->kept) return td__fail(TD_ENOMEM, "linear: out of memory keeping %zu shards", count);
    }
    td__linear_shard_pack(s->kept + j * each, x->data, n->out->grad, N, IN, OUT);
    if (j + 1 < count) return TD_OK;
    const float *one[64];
    const float **packed = count <= 64 ? one : malloc(count * sizeof *packed);
    if (!packed) return td__fail(TD_ENOMEM, "linear: out of memory summing %zu shards", count);
    for (size_t k = 0; k < count; k++) packed[k] = s->kept + k * each;
    float *dw = td__grad_begin(ctx, w, 1), *db = b ? td__grad_begin(ctx, b, 2) : NULL;
    td_status st = TD_OK;
    float by_w = w->sum_scale != 0 ? w->sum_scale : 1.0f;
    float by_b = b && b->sum_scale != 0 ? b->sum_scale : 1.0f;
    if (td__linear_shard_grads(dw, db, packed, count, N, IN, OUT, by_w, by_b) != 0)
        st = td__fail(TD_ENOMEM, "linear: out of memory summing %zu shards", count);
    if (st == TD_OK) st = td__grad_end(ctx, w);
    if (st == TD_OK && b) st = td__grad_end(ctx, b);
    if (packed != one) free(packed);
    return st;
}

static td_status linear_backward(td__op_ctx *ctx, td__node *n) {
    linear_state *s = n->state;
    if (s->matmul) return matmul_backward(ctx, n, s);
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    td__mem_bind(&s->dy, n->out->grad);
    if (s->bwd_w && n->sums_shards && ctx->shard_count) {
        TD__TRY(shard_weights(ctx, n, s));
    } else if (s->bwd_w) {
        td__mem_bind(&s->x, x->data);
        td__mem_bind(&s->dw, td__grad_begin(ctx, w, 1));
        if (b) td__mem_bind(&s->db, td__grad_begin(ctx, b, 2));
        dnnl_exec_arg_t a[4] = {{DNNL_ARG_SRC, s->x.mem},
                                {DNNL_ARG_DIFF_DST, s->dy.mem},
                                {DNNL_ARG_DIFF_WEIGHTS, s->dw.mem},
                                {DNNL_ARG_DIFF_BIAS, s->db.mem}};
        TD__TRY(td__exec(ctx, s->bwd_w, b ? 4 : 3, a, "linear backward weights"));
        td__grad_end(ctx, w);
        if (b) td__grad_end(ctx, b);
    }
    /* Final weight gradients go to DDP before the data gradient is computed (a sharded step's
     * only at its last shard: the graph holds them back before). */
    ctx->params_ready(ctx, n, 1);
    if (s->bwd_data) {
        /* forward's copy in the kernels' layout; the plain weights where they are now (a
         * parameter-use hook may have moved them since forward) */
        td__mem_bind(&s->w, s->w_fwd.need ? s->w_now : w->data);
        td__mem_bind(&s->dx, td__grad_begin(ctx, x, 0));
        dnnl_exec_arg_t a[3] = {{DNNL_ARG_DIFF_DST, s->dy.mem},
                                {DNNL_ARG_WEIGHTS, s->w.mem},
                                {DNNL_ARG_DIFF_SRC, s->dx.mem}};
        TD__TRY(td__exec(ctx, s->bwd_data, 3, a, "linear backward data"));
        td__grad_end(ctx, x);
    }
    return TD_OK;
}

static void linear_destroy(td__node *n) {
    linear_state *s = n->state;
    if (!s) return;
    dnnl_primitive_t p[] = {s->fwd, s->bwd_data, s->bwd_w, s->bwd_b};
    for (size_t i = 0; i < sizeof p / sizeof *p; i++)
        if (p[i]) dnnl_primitive_destroy(p[i]);
    td__adapt_free(&s->w_fwd);
    td__adapt_free(&s->w_bd);
    td__mem *m[] = {&s->x,  &s->w,  &s->b,   &s->y,   &s->dy, &s->dx,
                    &s->dw, &s->db, &s->dyt, &s->wbd, &s->one};
    for (size_t i = 0; i < sizeof m / sizeof *m; i++) td__mem_free(m[i]);
    free(s->kept);
    free(s);
}

/* f32 linear layers with a weight gradient sum a step's shards themselves. */
static int linear_sums_shards(const td__op_ctx *ctx, const td__node *n) {
    (void)ctx;
    const linear_state *s = n->state;
    return s && !s->matmul && s->bwd_w;
}

static int linear_lays_out_weights(const td__op_ctx *ctx, const td__node *n) {
    (void)ctx;
    const linear_state *s = n->state;
    return s && s->lays_out ? 1 : -1;
}

/* The row blocks of the forward's copy whose rows are all written, as the writes come. */
static void linear_weights_written(td__op_ctx *ctx, td__node *n, const void *data, size_t begin,
                                   size_t end) {
    (void)ctx;
    linear_state *s = n->state;
    const td__linear_layout *l = &s->lay;
    if (begin == 0) {
        s->laid = 0;
        td__adapt_made(&s->w_fwd, NULL);
    }
    if (data != n->in[1]->data) return;
    int64_t group = td__linear_layout_group(l), rows = (int64_t)(end / (size_t)l->in);
    int64_t groups = (l->out + l->rb - 1) / l->rb * (l->rb / group); /* padding included */
    int64_t ready = rows >= l->out ? groups : rows / group;
    if (ready > s->laid) td__linear_layout_rows(l, s->w_fwd.buf, data, s->laid, ready);
    if (ready > s->laid) s->laid = ready;
    if (s->laid == groups) td__adapt_made(&s->w_fwd, data);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_linear = {
    .compile = linear_compile,
    .forward = linear_forward,
    .backward = linear_backward,
    .destroy = linear_destroy,
    .supports = td__onednn_supports,
    .sums_shards = linear_sums_shards,
    .lays_out_weights = linear_lays_out_weights,
    .weights_written = linear_weights_written,
};
