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

/* The CPU backend's kernels. */
const td__kernels td__cpu_nll = {
    .forward = nll_forward,
    .backward = nll_backward,
};
