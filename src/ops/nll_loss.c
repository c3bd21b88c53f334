/* The negative log-likelihood loss op (and cross entropy = log_softmax + nll): a scalar from
 * (N, C) log-probabilities and (N) labels, mean or sum over the batch. Kernels: cpu/nll_loss.c,
 * cuda/nll_loss.cu. */
#include "ops/op.h"

static td_status nll_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *logp = n->in[0], *labels = n->in[1];
    if (!labels) return td__fail(TD_EINVAL, "nll_loss: labels are NULL");
    if (logp->dtype != TD_F32 || logp->shape.ndim != 2)
        return td__fail(TD_ESHAPE, "nll_loss: '%s' must be f32 (N, C)", logp->name);
    if (labels->dtype != TD_I64 || labels->shape.ndim != 1 ||
        labels->shape.dim[0] != logp->shape.dim[0])
        return td__fail(TD_ESHAPE, "nll_loss: labels '%s' must be i64 (%lld)", labels->name,
                        (long long)logp->shape.dim[0]);
    if (n->attr.reduction != TD_REDUCTION_MEAN && n->attr.reduction != TD_REDUCTION_SUM)
        return td__fail(TD_EINVAL, "nll_loss: unknown reduction %d", (int)n->attr.reduction);
    *shape = td_shape_make(0, NULL);
    *dtype = TD_F32;
    return TD_OK;
}

const td__op td__op_nll = {
    .name = "nll_loss",
    .id = TD__OP_NLL,
    .infer = nll_infer,
    .precision = TD__PREC_F32,
};
