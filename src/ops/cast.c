/* The cast op: the same values in another float dtype (f32, bf16, f16), inserted by mixed
 * precision (graph.h's td_amp_params). Kernels: cpu/cast.c, cuda/eltwise.cu. */
#include "ops/op.h"

static td_status cast_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    td_dtype to = (td_dtype)n->variant;
    if (!td__is_float(x->dtype) || !td__is_float(to))
        return td__fail(TD_EDTYPE, "cast: '%s' is %s, to %s; only f32, bf16 and f16 convert",
                        x->name, td_dtype_name(x->dtype), td_dtype_name(to));
    *shape = x->shape;
    *dtype = to;
    return TD_OK;
}

const td__op td__op_cast = {
    .name = "cast",
    .id = TD__OP_CAST,
    .propagates_layout = 1,
    .infer = cast_infer,
};
