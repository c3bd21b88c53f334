/* The 2-d batch norm node through oneDNN, with PyTorch's semantics: training normalises
 * with the batch's mean and biased variance and moves the running stats with momentum,
 * using the unbiased variance; eval normalises with the running stats. The output keeps
 * the input's layout. */
#include <stdlib.h>

#include "ops/cpu/onednn.h"

typedef struct {
    dnnl_primitive_t fwd_train, fwd_eval, bwd_train, bwd_eval;
    float *mean, *var;        /* (C) batch statistics of the last training forward */
    void *ws_train, *ws_eval; /* fused ReLU's masks, from the arena */
    int trained;              /* last forward ran in training mode */
    td__mem ws_train_m, ws_eval_m;
    td__mem x, y, scale, shift, mean_m, var_m, rmean_m, rvar_m, dy, dx, dscale, dshift;
} bn_state;

static td_status make(td__op_ctx *ctx, dnnl_primitive_t *prim, dnnl_primitive_desc_t *pd_out,
                      const dnnl_batch_normalization_desc_t *d, const_dnnl_primitive_desc_t hint,
                      const char *what) {
    dnnl_primitive_desc_t pd;
    TD__TRY(td__pd_create(ctx, &pd, d, hint, what));
    td_status st = td__prim_create(prim, pd, what);
    if (pd_out && st == TD_OK)
        *pd_out = pd;
    else
        dnnl_primitive_desc_destroy(pd);
    return st;
}

static td_status bn_compile(td__op_ctx *ctx, td__node *n) {
    bn_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "batch_norm2d: out of memory");
    n->state = s;
    td_tensor *x = n->in[0], *y = n->out;
    *td__md(y) = *td__md(x);
    y->blocked = x->blocked;
    float eps = n->attr.bn.eps;
    unsigned flags = dnnl_use_scale | dnnl_use_shift;
    if (n->variant == TD__BN_RELU) flags |= dnnl_fuse_norm_relu;
    dnnl_batch_normalization_desc_t d;
    dnnl_primitive_desc_t tpd = NULL, epd = NULL;
    TD__DNNL(dnnl_batch_normalization_forward_desc_init(&d, dnnl_forward_training, td__md(x), eps,
                                                        flags),
             "batch_norm2d forward");
    TD__TRY(make(ctx, &s->fwd_train, &tpd, &d, NULL, "batch_norm2d forward"));
    td_status st = TD_OK;
    if (dnnl_batch_normalization_forward_desc_init(&d, dnnl_forward_training, td__md(x), eps,
                                                   flags | dnnl_use_global_stats) != dnnl_success)
        st = td__fail(TD_EBACKEND, "batch_norm2d: eval descriptor");
    if (st == TD_OK) st = make(ctx, &s->fwd_eval, &epd, &d, NULL, "batch_norm2d eval forward");
    if (st == TD_OK && y->requires_grad) {
        if (dnnl_batch_normalization_backward_desc_init(&d, dnnl_backward, td__md(y), td__md(x),
                                                        eps, flags) != dnnl_success)
            st = td__fail(TD_EBACKEND, "batch_norm2d: backward descriptor");
        if (st == TD_OK) st = make(ctx, &s->bwd_train, NULL, &d, tpd, "batch_norm2d backward");
        if (st == TD_OK && dnnl_batch_normalization_backward_desc_init(
                               &d, dnnl_backward, td__md(y), td__md(x), eps,
                               flags | dnnl_use_global_stats) != dnnl_success)
            st = td__fail(TD_EBACKEND, "batch_norm2d: eval backward descriptor");
        if (st == TD_OK) st = make(ctx, &s->bwd_eval, NULL, &d, epd, "batch_norm2d eval backward");
    }
    dnnl_memory_desc_t wst = td__pd_md(tpd, dnnl_query_workspace_md);
    dnnl_memory_desc_t wse = wst;
    if (epd) wse = td__pd_md(epd, dnnl_query_workspace_md);
    dnnl_primitive_desc_destroy(tpd);
    if (epd) dnnl_primitive_desc_destroy(epd);
    TD__TRY(st);
    if (n->variant == TD__BN_RELU) {
        size_t bt = dnnl_memory_desc_get_size(&wst), be = dnnl_memory_desc_get_size(&wse);
        if (bt) {
            if (!(s->ws_train = td__op_alloc(ctx, bt)))
                return td__fail(TD_ENOMEM, "batch_norm2d: out of memory");
            TD__TRY(td__mem_init(ctx, &s->ws_train_m, &wst));
            td__mem_bind(&s->ws_train_m, s->ws_train);
        }
        if (be) {
            if (!(s->ws_eval = td__op_alloc(ctx, be)))
                return td__fail(TD_ENOMEM, "batch_norm2d: out of memory");
            TD__TRY(td__mem_init(ctx, &s->ws_eval_m, &wse));
            td__mem_bind(&s->ws_eval_m, s->ws_eval);
        }
    }
    int64_t C = x->shape.dim[1];
    s->mean = td__op_alloc(ctx, (size_t)C * sizeof(float));
    s->var = td__op_alloc(ctx, (size_t)C * sizeof(float));
    if (!s->mean || !s->var) return td__fail(TD_ENOMEM, "batch_norm2d: out of memory");
    dnnl_memory_desc_t cmd;
    td_shape cs = td_shape_1d(C);
    td__md_plain(&cmd, &cs, TD_F32);
    td__mem *vec[] = {&s->scale,   &s->shift,  &s->mean_m, &s->var_m,
                      &s->rmean_m, &s->rvar_m, &s->dscale, &s->dshift};
    for (size_t i = 0; i < sizeof vec / sizeof *vec; i++) TD__TRY(td__mem_init(ctx, vec[i], &cmd));
    td__mem *act[] = {&s->x, &s->y, &s->dy, &s->dx};
    for (size_t i = 0; i < sizeof act / sizeof *act; i++)
        TD__TRY(td__mem_init(ctx, act[i], td__md(x)));
    td__mem_bind(&s->mean_m, s->mean);
    td__mem_bind(&s->var_m, s->var);
    return TD_OK;
}

static td_status bn_forward(td__op_ctx *ctx, td__node *n) {
    bn_state *s = n->state;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2], *rm = n->in[3], *rv = n->in[4];
    td__mem_bind(&s->x, x->data);
    td__mem_bind(&s->y, n->out->data);
    td__mem_bind(&s->scale, w->data);
    td__mem_bind(&s->shift, b->data);
    s->trained = ctx->training;
    if (!ctx->training) {
        td__mem_bind(&s->rmean_m, rm->data);
        td__mem_bind(&s->rvar_m, rv->data);
        dnnl_exec_arg_t a[7] = {{DNNL_ARG_SRC, s->x.mem},
                                {DNNL_ARG_DST, s->y.mem},
                                {DNNL_ARG_SCALE, s->scale.mem},
                                {DNNL_ARG_SHIFT, s->shift.mem},
                                {DNNL_ARG_MEAN, s->rmean_m.mem},
                                {DNNL_ARG_VARIANCE, s->rvar_m.mem},
                                {DNNL_ARG_WORKSPACE, s->ws_eval_m.mem}};
        return td__exec(ctx, s->fwd_eval, s->ws_eval ? 7 : 6, a, "batch_norm2d eval forward");
    }
    dnnl_exec_arg_t a[7] = {{DNNL_ARG_SRC, s->x.mem},
                            {DNNL_ARG_DST, s->y.mem},
                            {DNNL_ARG_SCALE, s->scale.mem},
                            {DNNL_ARG_SHIFT, s->shift.mem},
                            {DNNL_ARG_MEAN, s->mean_m.mem},
                            {DNNL_ARG_VARIANCE, s->var_m.mem},
                            {DNNL_ARG_WORKSPACE, s->ws_train_m.mem}};
    TD__TRY(td__exec(ctx, s->fwd_train, s->ws_train ? 7 : 6, a, "batch_norm2d forward"));
    int64_t C = x->shape.dim[1];
    double cnt = (double)(x->shape.dim[0] * x->shape.dim[2] * x->shape.dim[3]);
    float m = n->attr.bn.momentum, unbias = cnt > 1 ? (float)(cnt / (cnt - 1)) : 1.f;
    float *rmean = rm->data, *rvar = rv->data;
    for (int64_t c = 0; c < C; c++) {
        rmean[c] = (1.f - m) * rmean[c] + m * s->mean[c];
        rvar[c] = (1.f - m) * rvar[c] + m * s->var[c] * unbias;
    }
    return TD_OK;
}

static td_status bn_backward(td__op_ctx *ctx, td__node *n) {
    bn_state *s = n->state;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    td__mem_bind(&s->x, x->data);
    td__mem_bind(&s->scale, w->data);
    td__mem_bind(&s->shift, b->data);
    td__mem_bind(&s->dy, n->out->grad);
    td__mem_bind(&s->dx, x->requires_grad ? td__grad_begin(ctx, x, 0) : ctx->scratch[0]);
    td__mem_bind(&s->dscale, w->requires_grad ? td__grad_begin(ctx, w, 1) : ctx->scratch[1]);
    td__mem_bind(&s->dshift, b->requires_grad ? td__grad_begin(ctx, b, 2) : ctx->scratch[2]);
    td__mem *mean = s->trained ? &s->mean_m : &s->rmean_m,
            *var = s->trained ? &s->var_m : &s->rvar_m;
    if (!s->trained) {
        td__mem_bind(&s->rmean_m, n->in[3]->data);
        td__mem_bind(&s->rvar_m, n->in[4]->data);
    }
    void *ws = s->trained ? s->ws_train : s->ws_eval;
    dnnl_exec_arg_t a[10] = {
        {DNNL_ARG_SHIFT, s->shift.mem},
        {DNNL_ARG_SRC, s->x.mem},
        {DNNL_ARG_MEAN, mean->mem},
        {DNNL_ARG_VARIANCE, var->mem},
        {DNNL_ARG_DIFF_DST, s->dy.mem},
        {DNNL_ARG_SCALE, s->scale.mem},
        {DNNL_ARG_DIFF_SRC, s->dx.mem},
        {DNNL_ARG_DIFF_SCALE, s->dscale.mem},
        {DNNL_ARG_DIFF_SHIFT, s->dshift.mem},
        {DNNL_ARG_WORKSPACE, s->trained ? s->ws_train_m.mem : s->ws_eval_m.mem}};
    TD__TRY(td__exec(ctx, s->trained ? s->bwd_train : s->bwd_eval, ws ? 10 : 9, a,
                     "batch_norm2d backward"));
    if (x->requires_grad) td__grad_end(ctx, x);
    if (w->requires_grad) td__grad_end(ctx, w);
    if (b->requires_grad) td__grad_end(ctx, b);
    return TD_OK;
}

static void bn_destroy(td__node *n) {
    bn_state *s = n->state;
    if (!s) return;
    dnnl_primitive_t p[] = {s->fwd_train, s->fwd_eval, s->bwd_train, s->bwd_eval};
    for (int i = 0; i < 4; i++)
        if (p[i]) dnnl_primitive_destroy(p[i]);
    td__mem_free(&s->ws_train_m);
    td__mem_free(&s->ws_eval_m);
    td__mem *m[] = {&s->x,       &s->y,      &s->scale, &s->shift, &s->mean_m, &s->var_m,
                    &s->rmean_m, &s->rvar_m, &s->dy,    &s->dx,    &s->dscale, &s->dshift};
    for (size_t i = 0; i < sizeof m / sizeof *m; i++) td__mem_free(m[i]);
    free(s);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_batch_norm = {
    .compile = bn_compile,
    .forward = bn_forward,
    .backward = bn_backward,
    .destroy = bn_destroy,
    .supports = td__onednn_supports,
};
