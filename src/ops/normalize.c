/* The L2-normalisation op (F.normalize(x, p=2, dim=1)) over a plain (N, D) tensor. Kernels:
 * cpu/normalize.c, cuda/normalize.cu. */
#include "ops/op.h"

static td_status norm_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    if (x->dtype != TD_F32 || x->shape.ndim != 2)
        return td__fail(TD_ESHAPE, "normalize: input '%s' must be f32 (N, D), got %d dims", x->name,
                        x->shape.ndim);
    if (!(n->attr.eps > 0))
        return td__fail(TD_EINVAL, "normalize: eps %g must be > 0", (double)n->attr.eps);
    *shape = x->shape;
    *dtype = TD_F32;
    return TD_OK;
}

const td__op td__op_normalize = {
    .name = "normalize",
    .id = TD__OP_NORMALIZE,
    .infer = norm_infer,
    .precision = TD__PREC_F32,
};
