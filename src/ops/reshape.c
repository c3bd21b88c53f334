/* The flatten and reshape ops: the same elements in another shape, always plain row-major.
 * Kernels: cpu/reshape.c, cuda/eltwise.cu. */
#include "ops/op.h"

static td_status reshape_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    const td_shape *to = &n->attr.to;
    if (!td__is_float(x->dtype))
        return td__fail(TD_EDTYPE, "%s: input '%s' must be f32, bf16 or f16", n->what, x->name);
    if (to->ndim < 0 || to->ndim > TD_MAX_DIMS || td_shape_numel(to) != td_shape_numel(&x->shape))
        return td__fail(TD_ESHAPE, "%s: '%s' has %lld elements, the new shape %lld", n->what,
                        x->name, (long long)td_shape_numel(&x->shape),
                        (long long)td_shape_numel(to));
    *shape = *to;
    *dtype = x->dtype;
    return TD_OK;
}

const td__op td__op_reshape = {
    .name = "reshape",
    .id = TD__OP_RESHAPE,
    .accepts_blocked = 1,
    .infer = reshape_infer,
};
