/* The layer norm op (nn.LayerNorm over the last dim), in f32 at every mixed precision level as
 * autocast runs layer_norm; optionally over fixed shards of its rows (deterministic tensor
 * parallelism: the weight's gradient summed over the shards in the pairwise tree). Kernels:
 * cpu/layer_norm.c, cuda/layer_norm.cu (one shard). */
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
    if (!(n->attr.ln.eps > 0.f))
        return td__fail(TD_EINVAL, "layer_norm: eps %g must be > 0", (double)n->attr.ln.eps);
    int64_t rows = td_shape_numel(&x->shape) / C, shards = n->attr.ln.shards;
    if (shards < 0 || shards > 64 || (shards > 1 && rows % shards))
        return td__fail(TD_ESHAPE,
                        "layer_norm: %lld rows of '%s' do not split into %lld shards (at most 64)",
                        (long long)rows, x->name, (long long)shards);
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
