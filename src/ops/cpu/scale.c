/* The scaling node: y = alpha * x, element by element over storage, so any shape, layout
 * (blocked stays blocked; padding stays zero) and float dtype; backward dy * alpha. Contrastive
 * losses divide cosine similarities by a temperature with it. Plain C. */
#include "ops/cpu/onednn.h"

/* out = alpha * in over n elements of dtype dt. */
static void scaled(void *out, const void *in, td_dtype dt, size_t count, float alpha) {
    if (dt == TD_F32) {
        const float *a = in;
        float *o = out;
        for (size_t i = 0; i < count; i++) o[i] = alpha * a[i];
        return;
    }
    for (size_t i = 0; i < count; i++) td__store(out, dt, i, alpha * td__load(in, dt, i));
}

static td_status scale_compile(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    *td__md(n->out) = *td__md(n->in[0]);
    n->out->blocked = n->in[0]->blocked;
    return TD_OK;
}

static td_status scale_forward(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    td_tensor *x = n->in[0];
    scaled(n->out->data, x->data, x->dtype, td__nelems(x), n->attr.alpha);
    return TD_OK;
}

static td_status scale_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0];
    scaled(td__grad_begin(ctx, x, 0), n->out->grad, x->dtype, td__nelems(x), n->attr.alpha);
    td__grad_end(ctx, x);
    return TD_OK;
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_scale = {
    .compile = scale_compile,
    .forward = scale_forward,
    .backward = scale_backward,
};
