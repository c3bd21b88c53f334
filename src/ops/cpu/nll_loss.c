/* The negative log-likelihood loss node (and cross entropy = log_softmax + nll): a scalar
 * from (N, C) log-probabilities and (N) int64 labels, mean or sum over the batch. Plain C;
 * labels out of range are an error naming the sample, not a crash. */
#include <string.h>

#include "ops/cpu/onednn.h"

static td_status nll_forward(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    const td_tensor *lp = n->in[0];
    const float *logp = lp->data;
    const int64_t *lab = n->in[1]->data;
    int64_t N = lp->shape.dim[0], C = lp->shape.dim[1];
    double sum = 0;
    for (int64_t i = 0; i < N; i++) {
        if (lab[i] < 0 || lab[i] >= C)
            return td__fail(TD_EINVAL, "nll_loss: label %lld of sample %lld is outside [0, %lld)",
                            (long long)lab[i], (long long)i, (long long)C);
        sum -= logp[i * C + lab[i]];
    }
    if (n->attr.reduction == TD_REDUCTION_MEAN) sum /= (double)N;
    *(float *)n->out->data = (float)sum;
    return TD_OK;
}

static td_status nll_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *lp = n->in[0];
    const int64_t *lab = n->in[1]->data;
    int64_t N = lp->shape.dim[0], C = lp->shape.dim[1];
    float gy = ((const float *)n->out->grad)[0];
    float scale = n->attr.reduction == TD_REDUCTION_MEAN ? gy / (float)N : gy;
    int acc = !lp->grad_zero;
    float *d = lp->grad;
    if (!acc) memset(d, 0, (size_t)(N * C) * sizeof(float));
    for (int64_t i = 0; i < N; i++) d[i * C + lab[i]] -= scale;
    lp->grad_zero = 0;
    (void)ctx;
    return TD_OK;
}

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

/* The CPU backend's kernels. */
const td__kernels td__cpu_nll = {
    .forward = nll_forward,
    .backward = nll_backward,
};
