/* The vocabulary-parallel cross-entropy op (Megatron-LM's vocab_parallel_cross_entropy): the
 * mean (or sum) over N rows of log(sum_v exp(z_v)) - z_label, where each rank of the graph's
 * group holds the logits of its own slice of the vocabulary, columns [first, first + V / ranks)
 * of the whole (N, V), so that no rank ever holds the whole logits; the loss is the same on
 * every rank. Kernels: cpu/vocab_parallel_cross_entropy.c. */
#include "ops/op.h"

static td_status vce_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *z = n->in[0], *labels = n->in[1];
    if (!labels) return td__fail(TD_EINVAL, "%s: labels are NULL", n->what);
    if (z->dtype != TD_F32 || z->shape.ndim != 2)
        return td__fail(TD_ESHAPE, "%s: logits '%s' must be f32 (N, V / ranks)", n->what, z->name);
    if (labels->dtype != TD_I64 || labels->shape.ndim != 1 ||
        labels->shape.dim[0] != z->shape.dim[0])
        return td__fail(TD_ESHAPE, "%s: labels '%s' must be i64 (%lld)", n->what, labels->name,
                        (long long)z->shape.dim[0]);
    int shards = n->attr.vocab.shards;
    if (shards < 0 || shards > 64 || (shards && z->shape.dim[1] % shards))
        return td__fail(TD_ESHAPE,
                        "%s: %lld columns of '%s' do not split into %d shards (at most 64)",
                        n->what, (long long)z->shape.dim[1], z->name, shards);
    if (n->attr.vocab.reduction != TD_REDUCTION_MEAN && n->attr.vocab.reduction != TD_REDUCTION_SUM)
        return td__fail(TD_EINVAL, "%s: unknown reduction %d", n->what,
                        (int)n->attr.vocab.reduction);
    *shape = td_shape_make(0, NULL);
    *dtype = TD_F32;
    return TD_OK;
}

const td__op td__op_vocab_parallel_cross_entropy = {
    .name = "vocab_parallel_cross_entropy",
    .id = TD__OP_VOCAB_PARALLEL_CE,
    .infer = vce_infer,
    .precision = TD__PREC_F32,
    .collective = 1,
};
