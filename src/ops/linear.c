/* The linear op (F.linear): y = x W^T + b with PyTorch's (OUT, IN) weight. Kernels:
 * cpu/linear.c, cuda/linear.cu. */
#include "ops/op.h"

static td_status linear_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    if (!w) return td__fail(TD_EINVAL, "linear: the weight is NULL");
    if (!td__is_float(x->dtype) || x->shape.ndim != 2)
        return td__fail(TD_ESHAPE,
                        "linear: input '%s' must be (N, IN) of a float dtype, got %d dims", x->name,
                        x->shape.ndim);
    if (w->dtype != x->dtype || (b && b->dtype != x->dtype))
        return td__fail(TD_EDTYPE, "linear: '%s' is %s, its weight %s and bias %s: one dtype",
                        x->name, td_dtype_name(x->dtype), td_dtype_name(w->dtype),
                        b ? td_dtype_name(b->dtype) : "none");
    if (w->shape.ndim != 2 || w->shape.dim[1] != x->shape.dim[1])
        return td__fail(TD_ESHAPE, "linear: weight '%s' must be (OUT, %lld)", w->name,
                        (long long)x->shape.dim[1]);
    if (b && (b->shape.ndim != 1 || b->shape.dim[0] != w->shape.dim[0]))
        return td__fail(TD_ESHAPE, "linear: bias '%s' must be (%lld)", b->name,
                        (long long)w->shape.dim[0]);
    *shape = td_shape_2d(x->shape.dim[0], w->shape.dim[0]);
    *dtype = x->dtype;
    return TD_OK;
}

const td__op td__op_linear = {
    .name = "linear",
    .id = TD__OP_LINEAR,
    .infer = linear_infer,
    .precision = TD__PREC_LOW,
};
