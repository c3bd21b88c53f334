/* The channel concatenation op: (N, C_i, ...) inputs of one dtype side by side along dim 1.
 * Kernels: cpu/concat.c, cuda/concat.cu. */
#include "ops/op.h"

static td_status concat_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x0 = n->in[0];
    td_shape s = x0->shape;
    if (s.ndim < 2 || !td__is_float(x0->dtype))
        return td__fail(TD_ESHAPE, "concat: '%s' must be a float tensor with >= 2 dims", x0->name);
    for (int i = 1; i < n->nin; i++) {
        const td_tensor *x = n->in[i];
        if (!x) return td__fail(TD_EINVAL, "concat: input %d is NULL", i);
        int ok = x->shape.ndim == s.ndim && x->dtype == x0->dtype;
        for (int d = 0; ok && d < s.ndim; d++)
            if (d != 1 && x->shape.dim[d] != s.dim[d]) ok = 0;
        if (!ok)
            return td__fail(TD_ESHAPE, "concat: '%s' does not match '%s' outside dim 1", x->name,
                            x0->name);
        s.dim[1] += x->shape.dim[1];
    }
    *shape = s;
    *dtype = x0->dtype;
    return TD_OK;
}

const td__op td__op_concat = {
    .name = "concat",
    .id = TD__OP_CONCAT,
    .infer = concat_infer,
};
