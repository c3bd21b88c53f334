/* The layer norm op (nn.LayerNorm over the last dim), in f32 at every mixed precision level as
 * autocast runs layer_norm. Kernels: cpu/layer_norm.c, cuda/layer_norm.cu. */
#include "ops/op.h"

static td_status ln_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    if (x->dtype != TD_F32 || x->shape.ndim < 1)
        return td__fail(TD_ESHAPE, "layer_norm: input '%s' must be f32 (..., C)", x->name);
    int64_t C = x->shape.dim[x->shape.ndim - 1];
    for (int i = 1; i < 3; i++) {
        const td_tensor *t = n->in[i];
        if (t && (t->shape.ndim != 1 || t->shape.dim[0] != C || t->dtype != TD_F32))
            return td__fail(TD_ESHAPE, "layer_norm: %s '%s' must be f32 (%lld)",
                            i == 1 ? "weight" : "bias", t->name, (long long)C);
    }
    if (!(n->attr.eps > 0.f))
        return td__fail(TD_EINVAL, "layer_norm: eps %g must be > 0", (double)n->attr.eps);
    *shape = x->shape;
    *dtype = TD_F32;
    return TD_OK;
}

/* Weight and bias stay f32 at every level, as the statistics do. */
static td_dtype ln_input_dtype(const td__node *n, int i, td_dtype dtype) {
    (void)n;
    return i == 0 ? dtype : TD_F32;
}

const td__op td__op_layer_norm = {
    .name = "layer_norm",
    .id = TD__OP_LAYER_NORM,
    .infer = ln_infer,
    .precision = TD__PREC_F32,
    .input_dtype = ln_input_dtype,
};
