/* The cast node: the same values in another float dtype (f32, bf16, f16), element by element
 * over storage, so the output keeps the input's layout, blocked or plain. Backward converts
 * the gradient back and adds it to the input's. Mixed precision inserts these (graph.h's
 * td_amp_params); plain C, round to nearest even. */
#include <stdlib.h>

#include "ops/cpu/onednn.h"

static td_status cast_compile(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    td_tensor *x = n->in[0], *y = n->out;
    *td__md(y) = *td__md(x);
    td__md(y)->data_type = td__dnnl_dtype(y->dtype);
    y->blocked = x->blocked;
    return TD_OK;
}

static td_status cast_forward(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    td_tensor *x = n->in[0], *y = n->out;
    td__convert(y->data, y->dtype, x->data, x->dtype, td__nelems(x));
    return TD_OK;
}

static td_status cast_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    size_t count = td__nelems(x);
    if (x->grad_zero) {
        td__convert(x->grad, x->dtype, y->grad, y->dtype, count);
    } else { /* add dy, converted, through scratch */
        void *t = ctx->scratch[0];
        td__convert(t, x->dtype, y->grad, y->dtype, count);
        td__accumulate(x->grad, t, x->dtype, count);
    }
    x->grad_zero = 0;
    return TD_OK;
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_cast = {
    .compile = cast_compile,
    .forward = cast_forward,
    .backward = cast_backward,
};
