/* The scaling op: y = alpha * x over any shape and float dtype. Kernels: cpu/scale.c,
 * cuda/eltwise.cu. */
#include <math.h>

#include "ops/op.h"

static td_status scale_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    if (!td__is_float(x->dtype))
        return td__fail(TD_EDTYPE, "scale: input '%s' must be f32, bf16 or f16, not %s", x->name,
                        td_dtype_name(x->dtype));
    if (!isfinite(n->attr.alpha))
        return td__fail(TD_EINVAL, "scale: factor %g is not finite", (double)n->attr.alpha);
    *shape = x->shape;
    *dtype = x->dtype;
    return TD_OK;
}

const td__op td__op_scale = {
    .name = "scale",
    .id = TD__OP_SCALE,
    .propagates_layout = 1,
    .infer = scale_infer,
};
