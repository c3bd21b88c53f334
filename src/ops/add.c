/* The element-wise sum op (residual connections): y = a + b over inputs of one shape and dtype,
 * no broadcasting; the output keeps the first input's layout. Kernels: cpu/add.c, cuda/eltwise.cu. */
#include "ops/op.h"

static td_status add_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *a = n->in[0], *b = n->in[1];
    if (!b) return td__fail(TD_EINVAL, "add: the second input is NULL");
    if (!td__is_float(a->dtype) || a->dtype != b->dtype || !td_shape_equal(&a->shape, &b->shape))
        return td__fail(TD_ESHAPE, "add: '%s' and '%s' must have one shape and one float dtype",
                        a->name, b->name);
    *shape = a->shape;
    *dtype = a->dtype;
    return TD_OK;
}

const td__op td__op_add = {
    .name = "add",
    .id = TD__OP_ADD,
    .propagates_layout = 1,
    .infer = add_infer,
};
