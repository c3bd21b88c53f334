/* The layer norm node (nn.LayerNorm over the last dim) through oneDNN's layer normalization:
 * each row of a plain (..., C) tensor is normalised with its own mean and biased variance, then
 * scaled and shifted by (C) weight and bias (either may be NULL: no affine part). The rows'
 * means and variances are kept for backward, 2 floats a row. It computes in f32 at every mixed
 * precision level, as autocast runs layer_norm. With shards (attr.ln.shards > 1) the primitives
 * are made for one shard of the rows and run on each in turn, and the shards' gradients of the
 * weight and bias are added in the pairwise tree: every call has one shape whichever rank holds
 * how many shards. */
#include <stdlib.h>

#include "core/core_impl.h"
#include "ops/cpu/onednn.h"

typedef struct {
    dnnl_primitive_t fwd, bwd;
    float *mean, *var; /* (rows) statistics of the last forward */
    unsigned flags;
    int64_t shards, rows, C; /* rows: of one shard */
    float *leaves;           /* (2, shards - 1, C) the weight's and bias's gradients of shards
                                1.. before the tree adds them to shard 0's */
    td__mem x, y, scale, shift, mean_m, var_m, dy, dx, dscale, dshift;
} ln_state;

static td_status ln_compile(td__op_ctx *ctx, td__node *n) {
    ln_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "layer_norm: out of memory");
    n->state = s;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    int64_t C = x->shape.dim[x->shape.ndim - 1];
    s->shards = n->attr.ln.shards > 1 ? n->attr.ln.shards : 1;
    int64_t rows = td_shape_numel(&x->shape) / C / s->shards;
    s->rows = rows;
    s->C = C;
    /* oneDNN normalises over the last dim of its md: the rows as one dim keeps it 2-d. */
    td_shape xs = td_shape_2d(rows, C), rs = td_shape_1d(rows), cs = td_shape_1d(C);
    dnnl_memory_desc_t xmd, smd, cmd;
    td__md_plain(&xmd, &xs, TD_F32);
    td__md_plain(&smd, &rs, TD_F32);
    td__md_plain(&cmd, &cs, TD_F32);
    s->flags = (w ? dnnl_use_scale : 0) | (b ? dnnl_use_shift : 0);
    float eps = n->attr.ln.eps;
    dnnl_layer_normalization_desc_t d;
    dnnl_primitive_desc_t fpd = NULL, bpd = NULL;
    TD__DNNL(dnnl_layer_normalization_forward_desc_init(&d, dnnl_forward_training, &xmd, &smd, eps,
                                                        s->flags),
             "layer_norm forward");
    TD__TRY(td__pd_create(ctx, &fpd, &d, NULL, "layer_norm forward"));
    td_status st = td__prim_create(&s->fwd, fpd, "layer_norm forward");
    if (st == TD_OK && n->out->requires_grad) {
        if (dnnl_layer_normalization_backward_desc_init(&d, dnnl_backward, &xmd, &xmd, &smd, eps,
                                                        s->flags) != dnnl_success)
            st = td__fail(TD_EBACKEND, "layer_norm: backward descriptor");
        if (st == TD_OK) st = td__pd_create(ctx, &bpd, &d, fpd, "layer_norm backward");
        if (st == TD_OK) st = td__prim_create(&s->bwd, bpd, "layer_norm backward");
        if (bpd) dnnl_primitive_desc_destroy(bpd);
    }
    dnnl_primitive_desc_destroy(fpd);
    TD__TRY(st);
    s->mean = td__op_alloc(ctx, (size_t)(rows * s->shards) * sizeof(float));
    s->var = td__op_alloc(ctx, (size_t)(rows * s->shards) * sizeof(float));
    if (!s->mean || !s->var) return td__fail(TD_ENOMEM, "layer_norm: out of memory");
    if (s->shards > 1 && n->out->requires_grad && (w || b)) {
        s->leaves = td__op_alloc(ctx, (size_t)(2 * (s->shards - 1) * C) * sizeof(float));
        if (!s->leaves) return td__fail(TD_ENOMEM, "layer_norm: out of memory");
    }
    td__mem *act[] = {&s->x, &s->y, &s->dy, &s->dx};
    for (size_t i = 0; i < sizeof act / sizeof *act; i++) TD__TRY(td__mem_init(ctx, act[i], &xmd));
    td__mem *vec[] = {&s->scale, &s->shift, &s->dscale, &s->dshift};
    for (size_t i = 0; i < sizeof vec / sizeof *vec; i++) TD__TRY(td__mem_init(ctx, vec[i], &cmd));
    TD__TRY(td__mem_init(ctx, &s->mean_m, &smd));
    TD__TRY(td__mem_init(ctx, &s->var_m, &smd));
    td__mem_bind(&s->mean_m, s->mean);
    td__mem_bind(&s->var_m, s->var);
    return TD_OK;
}

static td_status ln_forward(td__op_ctx *ctx, td__node *n) {
    ln_state *s = n->state;
    td_tensor *w = n->in[1], *b = n->in[2];
    dnnl_exec_arg_t a[6] = {{DNNL_ARG_SRC, s->x.mem},
                            {DNNL_ARG_DST, s->y.mem},
                            {DNNL_ARG_MEAN, s->mean_m.mem},
                            {DNNL_ARG_VARIANCE, s->var_m.mem}};
    int na = 4;
    if (w) {
        td__mem_bind(&s->scale, w->data);
        a[na++] = (dnnl_exec_arg_t){DNNL_ARG_SCALE, s->scale.mem};
    }
    if (b) {
        td__mem_bind(&s->shift, b->data);
        a[na++] = (dnnl_exec_arg_t){DNNL_ARG_SHIFT, s->shift.mem};
    }
    size_t block = (size_t)(s->rows * s->C);
    for (int64_t k = 0; k < s->shards; k++) {
        td__mem_bind(&s->x, (float *)n->in[0]->data + (size_t)k * block);
        td__mem_bind(&s->y, (float *)n->out->data + (size_t)k * block);
        td__mem_bind(&s->mean_m, s->mean + k * s->rows);
        td__mem_bind(&s->var_m, s->var + k * s->rows);
        TD__TRY(td__exec(ctx, s->fwd, na, a, "layer_norm forward"));
    }
    return TD_OK;
}

static td_status ln_backward(td__op_ctx *ctx, td__node *n) {
    ln_state *s = n->state;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    /* oneDNN writes dx whether or not x takes a gradient: scratch slot 0 then. */
    float *dx = x->requires_grad ? td__grad_begin(ctx, x, 0) : ctx->scratch[0];
    float *dw = w ? td__grad_begin(ctx, w, 1) : NULL, *db = b ? td__grad_begin(ctx, b, 2) : NULL;
    dnnl_exec_arg_t a[9] = {{DNNL_ARG_SRC, s->x.mem},
                            {DNNL_ARG_MEAN, s->mean_m.mem},
                            {DNNL_ARG_VARIANCE, s->var_m.mem},
                            {DNNL_ARG_DIFF_DST, s->dy.mem},
                            {DNNL_ARG_DIFF_SRC, s->dx.mem}};
    int na = 5;
    if (w) {
        td__mem_bind(&s->scale, w->data);
        a[na++] = (dnnl_exec_arg_t){DNNL_ARG_SCALE, s->scale.mem};
        a[na++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_SCALE, s->dscale.mem};
    }
    if (b) {
        td__mem_bind(&s->shift, b->data);
        a[na++] = (dnnl_exec_arg_t){DNNL_ARG_SHIFT, s->shift.mem};
        a[na++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_SHIFT, s->dshift.mem};
    }
    size_t block = (size_t)(s->rows * s->C), C = (size_t)s->C, up = (size_t)(s->shards - 1);
    float *wl[64], *bl[64]; /* each shard's gradients of the weight and the bias */
    for (int64_t k = 0; k < s->shards; k++) {
        wl[k % 64] = k == 0 ? dw : s->leaves + (size_t)(k - 1) * C;
        bl[k % 64] = k == 0 ? db : s->leaves + (up + (size_t)(k - 1)) * C;
        td__mem_bind(&s->x, (float *)x->data + (size_t)k * block);
        td__mem_bind(&s->dy, (float *)n->out->grad + (size_t)k * block);
        td__mem_bind(&s->dx, dx + (size_t)k * block);
        td__mem_bind(&s->mean_m, s->mean + k * s->rows);
        td__mem_bind(&s->var_m, s->var + k * s->rows);
        if (w) td__mem_bind(&s->dscale, wl[k % 64]);
        if (b) td__mem_bind(&s->dshift, bl[k % 64]);
        TD__TRY(td__exec(ctx, s->bwd, na, a, "layer_norm backward"));
    }
    if (w) td__pairwise_sum(wl, (size_t)s->shards, C);
    if (b) td__pairwise_sum(bl, (size_t)s->shards, C);
    if (w) td__grad_end(ctx, w);
    if (b) td__grad_end(ctx, b);
    if (x->requires_grad) td__grad_end(ctx, x);
    return TD_OK;
}

static void ln_destroy(td__node *n) {
    ln_state *s = n->state;
    if (!s) return;
    if (s->fwd) dnnl_primitive_destroy(s->fwd);
    if (s->bwd) dnnl_primitive_destroy(s->bwd);
    td__mem *m[] = {&s->x,     &s->y,  &s->scale, &s->shift,  &s->mean_m,
                    &s->var_m, &s->dy, &s->dx,    &s->dscale, &s->dshift};
    for (size_t i = 0; i < sizeof m / sizeof *m; i++) td__mem_free(m[i]);
    free(s);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_layer_norm = {
    .compile = ln_compile,
    .forward = ln_forward,
    .backward = ln_backward,
    .destroy = ln_destroy,
};
