/* Element-wise activation nodes (ReLU, exact-erf GELU, and GPT-2's tanh-approximated GELU)
 * through oneDNN's eltwise primitive, in whatever layout the input has. */
#include <stdlib.h>

#include "ops/cpu/onednn.h"

typedef struct {
    dnnl_primitive_t fwd, bwd;
    td__mem x, y, dy, dx;
} elt_state;

static td_status elt_compile(td__op_ctx *ctx, td__node *n) {
    elt_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "eltwise: out of memory");
    n->state = s;
    td_tensor *x = n->in[0], *y = n->out;
    *td__md(y) = *td__md(x);
    y->blocked = x->blocked;
    if (n->alias == TD__FOLDED) return TD_OK;
    /* In place, backward has only the output to go by. */
    dnnl_alg_kind_t alg = n->alias == TD__IN_PLACE          ? dnnl_eltwise_relu_use_dst_for_bwd
                          : n->variant == TD__ELT_GELU      ? dnnl_eltwise_gelu_erf
                          : n->variant == TD__ELT_GELU_TANH ? dnnl_eltwise_gelu_tanh
                                                            : dnnl_eltwise_relu;
    dnnl_eltwise_desc_t d;
    dnnl_primitive_desc_t fpd = NULL, bpd = NULL;
    TD__DNNL(dnnl_eltwise_forward_desc_init(&d, dnnl_forward_training, alg, td__md(x), 0.f, 0.f),
             "eltwise forward");
    TD__TRY(td__pd_create(ctx, &fpd, &d, NULL, "eltwise forward"));
    td_status st = td__prim_create(&s->fwd, fpd, "eltwise forward");
    if (st == TD_OK && y->requires_grad) {
        if (dnnl_eltwise_backward_desc_init(&d, alg, td__md(x), td__md(x), 0.f, 0.f) !=
            dnnl_success)
            st = td__fail(TD_EBACKEND, "eltwise: backward descriptor");
        if (st == TD_OK) st = td__pd_create(ctx, &bpd, &d, fpd, "eltwise backward");
        if (st == TD_OK) st = td__prim_create(&s->bwd, bpd, "eltwise backward");
        if (bpd) dnnl_primitive_desc_destroy(bpd);
    }
    dnnl_primitive_desc_destroy(fpd);
    TD__TRY(st);
    TD__TRY(td__mem_init(ctx, &s->x, td__md(x)));
    TD__TRY(td__mem_init(ctx, &s->y, td__md(x)));
    TD__TRY(td__mem_init(ctx, &s->dy, td__md(x)));
    return td__mem_init(ctx, &s->dx, td__md(x));
}

static td_status elt_forward(td__op_ctx *ctx, td__node *n) {
    elt_state *s = n->state;
    if (n->alias == TD__FOLDED) return TD_OK; /* its producer applied it */
    td__mem_bind(&s->x, n->in[0]->data);
    td__mem_bind(&s->y, n->out->data);
    dnnl_exec_arg_t a[2] = {{DNNL_ARG_SRC, s->x.mem}, {DNNL_ARG_DST, s->y.mem}};
    return td__exec(ctx, s->fwd, 2, a, "eltwise forward");
}

static td_status elt_backward(td__op_ctx *ctx, td__node *n) {
    elt_state *s = n->state;
    td_tensor *x = n->in[0];
    if (n->alias == TD__FOLDED) { /* dy already sits in x's (shared) gradient */
        x->grad_zero = n->out->grad_zero;
        return TD_OK;
    }
    if (n->alias == TD__IN_PLACE) { /* dx = dy * (y > 0), over dy's storage */
        td__mem_bind(&s->y, n->out->data);
        td__mem_bind(&s->dy, n->out->grad);
        td__mem_bind(&s->dx, n->out->grad);
        dnnl_exec_arg_t a[3] = {{DNNL_ARG_DST, s->y.mem},
                                {DNNL_ARG_DIFF_DST, s->dy.mem},
                                {DNNL_ARG_DIFF_SRC, s->dx.mem}};
        TD__TRY(td__exec(ctx, s->bwd, 3, a, "relu backward"));
        x->grad_zero = 0;
        return TD_OK;
    }
    td__mem_bind(&s->x, x->data);
    td__mem_bind(&s->dy, n->out->grad);
    td__mem_bind(&s->dx, td__grad_begin(ctx, x, 0));
    dnnl_exec_arg_t a[3] = {
        {DNNL_ARG_SRC, s->x.mem}, {DNNL_ARG_DIFF_DST, s->dy.mem}, {DNNL_ARG_DIFF_SRC, s->dx.mem}};
    TD__TRY(td__exec(ctx, s->bwd, 3, a, "eltwise backward"));
    td__grad_end(ctx, x);
    return TD_OK;
}

static void elt_destroy(td__node *n) {
    elt_state *s = n->state;
    if (!s) return;
    if (s->fwd) dnnl_primitive_destroy(s->fwd);
    if (s->bwd) dnnl_primitive_destroy(s->bwd);
    td__mem *m[] = {&s->x, &s->y, &s->dy, &s->dx};
    for (size_t i = 0; i < sizeof m / sizeof *m; i++) td__mem_free(m[i]);
    free(s);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_eltwise = {
    .compile = elt_compile,
    .forward = elt_forward,
    .backward = elt_backward,
    .destroy = elt_destroy,
    .supports = td__onednn_supports,
};
