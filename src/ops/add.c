/* The element-wise sum node (residual connections): y = a + b on plain tensors of one
 * shape; backward hands dy to both inputs. No broadcasting. */
#include <string.h>

#include "ops/onednn.h"

static td_status add_forward(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    const float *a = n->in[0]->data, *b = n->in[1]->data;
    float *y = n->out->data;
    size_t count = (size_t)td_shape_numel(&n->out->shape);
    for (size_t i = 0; i < count; i++) y[i] = a[i] + b[i];
    return TD_OK;
}

static td_status add_backward(td__op_ctx *ctx, td__node *n) {
    size_t bytes = (size_t)td_shape_numel(&n->out->shape) * sizeof(float);
    for (int i = 0; i < 2; i++) {
        td_tensor *x = n->in[i];
        if (!x->requires_grad) continue;
        memcpy(td__grad_begin(ctx, x, 0), n->out->grad, bytes);
        td__grad_end(ctx, x);
    }
    return TD_OK;
}

static td_status add_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *a = n->in[0], *b = n->in[1];
    if (!b) return td__fail(TD_EINVAL, "add: the second input is NULL");
    if (a->dtype != TD_F32 || b->dtype != TD_F32 || !td_shape_equal(&a->shape, &b->shape))
        return td__fail(TD_ESHAPE, "add: '%s' and '%s' must be f32 of one shape", a->name, b->name);
    *shape = a->shape;
    *dtype = TD_F32;
    return TD_OK;
}

const td__op td__op_add = {
    .name = "add",
    .infer = add_infer,
    .forward = add_forward,
    .backward = add_backward,
};
