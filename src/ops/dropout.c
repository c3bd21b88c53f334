/* The dropout and channel-wise dropout (dropout2d) ops, PyTorch semantics. Kernels:
 * cpu/dropout.c, cuda/dropout.cu. */
#include "ops/op.h"

static td_status drop_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    float p = n->attr.p;
    if (!(p >= 0.f && p <= 1.f))
        return td__fail(TD_EINVAL, "%s: p = %g, must be in [0, 1]", n->what, (double)p);
    if (!td__is_float(x->dtype))
        return td__fail(TD_EDTYPE, "%s: input '%s' must be f32, bf16 or f16", n->what, x->name);
    if (n->variant == TD__DROP_CHANNEL && x->shape.ndim != 4)
        return td__fail(TD_ESHAPE, "dropout2d: input '%s' must be (N, C, H, W), got %d dims",
                        x->name, x->shape.ndim);
    *shape = x->shape;
    *dtype = x->dtype;
    return TD_OK;
}

const td__op td__op_dropout = {
    .name = "dropout",
    .id = TD__OP_DROPOUT,
    .propagates_layout = 1,
    .infer = drop_infer,
};
