/* Softmax and log-softmax nodes over the last dim of a plain (N, C) tensor, through
 * oneDNN; backward uses the saved output, as PyTorch does. */
#include <stdlib.h>

#include "ops/cpu/onednn.h"

typedef struct {
    dnnl_primitive_t fwd, bwd;
    td__mem x, y, dy, dx;
} sm_state;

static td_status sm_compile(td__op_ctx *ctx, td__node *n) {
    sm_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "softmax: out of memory");
    n->state = s;
    td_tensor *x = n->in[0];
    int axis = x->shape.ndim - 1;
    dnnl_primitive_desc_t fpd = NULL, bpd = NULL;
    td_status st;
    if (n->variant == TD__LOG_SOFTMAX) {
        dnnl_logsoftmax_desc_t d;
        TD__DNNL(dnnl_logsoftmax_forward_desc_init(&d, dnnl_forward_training, td__md(x), axis),
                 "log_softmax forward");
        TD__TRY(td__pd_create(ctx, &fpd, &d, NULL, "log_softmax forward"));
        st = td__prim_create(&s->fwd, fpd, "log_softmax forward");
        if (st == TD_OK && n->out->requires_grad) {
            if (dnnl_logsoftmax_backward_desc_init(&d, td__md(x), td__md(x), axis) != dnnl_success)
                st = td__fail(TD_EBACKEND, "log_softmax: backward descriptor");
            if (st == TD_OK) st = td__pd_create(ctx, &bpd, &d, fpd, "log_softmax backward");
        }
    } else {
        dnnl_softmax_desc_t d;
        TD__DNNL(dnnl_softmax_forward_desc_init(&d, dnnl_forward_training, td__md(x), axis),
                 "softmax forward");
        TD__TRY(td__pd_create(ctx, &fpd, &d, NULL, "softmax forward"));
        st = td__prim_create(&s->fwd, fpd, "softmax forward");
        if (st == TD_OK && n->out->requires_grad) {
            if (dnnl_softmax_backward_desc_init(&d, td__md(x), td__md(x), axis) != dnnl_success)
                st = td__fail(TD_EBACKEND, "softmax: backward descriptor");
            if (st == TD_OK) st = td__pd_create(ctx, &bpd, &d, fpd, "softmax backward");
        }
    }
    if (st == TD_OK && bpd) st = td__prim_create(&s->bwd, bpd, "softmax backward");
    if (bpd) dnnl_primitive_desc_destroy(bpd);
    dnnl_primitive_desc_destroy(fpd);
    TD__TRY(st);
    td__mem *m[] = {&s->x, &s->y, &s->dy, &s->dx};
    for (size_t i = 0; i < 4; i++) TD__TRY(td__mem_init(ctx, m[i], td__md(x)));
    return TD_OK;
}

static td_status sm_forward(td__op_ctx *ctx, td__node *n) {
    sm_state *s = n->state;
    td__mem_bind(&s->x, n->in[0]->data);
    td__mem_bind(&s->y, n->out->data);
    dnnl_exec_arg_t a[2] = {{DNNL_ARG_SRC, s->x.mem}, {DNNL_ARG_DST, s->y.mem}};
    return td__exec(ctx, s->fwd, 2, a, "softmax forward");
}

static td_status sm_backward(td__op_ctx *ctx, td__node *n) {
    sm_state *s = n->state;
    td_tensor *x = n->in[0];
    td__mem_bind(&s->y, n->out->data);
    td__mem_bind(&s->dy, n->out->grad);
    td__mem_bind(&s->dx, td__grad_begin(ctx, x, 0));
    dnnl_exec_arg_t a[3] = {
        {DNNL_ARG_DST, s->y.mem}, {DNNL_ARG_DIFF_DST, s->dy.mem}, {DNNL_ARG_DIFF_SRC, s->dx.mem}};
    TD__TRY(td__exec(ctx, s->bwd, 3, a, "softmax backward"));
    td__grad_end(ctx, x);
    return TD_OK;
}

static void sm_destroy(td__node *n) {
    sm_state *s = n->state;
    if (!s) return;
    if (s->fwd) dnnl_primitive_destroy(s->fwd);
    if (s->bwd) dnnl_primitive_destroy(s->bwd);
    td__mem *m[] = {&s->x, &s->y, &s->dy, &s->dx};
    for (size_t i = 0; i < 4; i++) td__mem_free(m[i]);
    free(s);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_softmax = {
    .compile = sm_compile,
    .forward = sm_forward,
    .backward = sm_backward,
    .destroy = sm_destroy,
};
