/* The 2-d batch norm op (nn.BatchNorm2d): batch statistics in training, running statistics in
 * eval; a following ReLU may fold into it. Kernels: cpu/batch_norm.c, cuda/batch_norm.cu. */
#include "ops/op.h"

/* A ReLU right after the batch norm runs inside its kernels: one pass less over the
 * activation, forward and backward. */
static int bn_fold_activation(td__node *n, td__activation act) {
    if (act != TD__ACT_RELU || n->variant != TD__BN_PLAIN) return 0;
    n->variant = TD__BN_RELU;
    return 1;
}

static td_status bn_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    if (!td__is_float(x->dtype) || x->shape.ndim != 4)
        return td__fail(TD_ESHAPE, "%s: input '%s' must be (N, C, H, W) of a float dtype", n->what,
                        x->name);
    for (int i = 1; i < 5; i++) {
        const td_tensor *t = n->in[i];
        if (!t) return td__fail(TD_EINVAL, "%s: input %d is NULL", n->what, i);
        if (t->shape.ndim != 1 || t->shape.dim[0] != x->shape.dim[1] || t->dtype != TD_F32)
            return td__fail(TD_ESHAPE, "%s: '%s' must be f32 (%lld)", n->what, t->name,
                            (long long)x->shape.dim[1]);
    }
    if (n->in[3]->kind == TD__ACT || n->in[4]->kind == TD__ACT)
        return td__fail(TD_EINVAL, "%s: running stats must be graph buffers, not activations",
                        n->what);
    *shape = x->shape;
    *dtype = x->dtype;
    return TD_OK;
}

/* Statistics, weight and bias stay f32 whatever the activations' dtype (apex's rule): the kernels
 * normalise bf16 activations in f32 with them. */
static td_dtype bn_input_dtype(const td__node *n, int i, td_dtype dtype) {
    (void)n;
    return i == 0 ? dtype : TD_F32;
}

const td__op td__op_batch_norm = {
    .name = "batch_norm2d",
    .id = TD__OP_BATCH_NORM,
    .propagates_layout = 1,
    .infer = bn_infer,
    .fold_activation = bn_fold_activation,
    .input_dtype = bn_input_dtype,
};
