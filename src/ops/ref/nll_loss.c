/* Reference classification losses: nll_loss on log-probabilities and cross_entropy on
 * logits, mean or sum reduction, with PyTorch's ignore_index. No class weights and no
 * label smoothing. A label out of range is an error naming the sample, never a crash. */
#include <math.h>

#include "core/core_impl.h"
#include "ops/ref/ref.h"

/* Validates the labels and counts the ones that are not ignored. */
static td_status check_labels(const char *op, const int64_t *labels, int N, int C,
                              int64_t ignore_index, int *kept) {
    *kept = 0;
    for (int n = 0; n < N; n++) {
        if (labels[n] == ignore_index) continue;
        if (labels[n] < 0 || labels[n] >= C)
            return td__fail(TD_EINVAL, "%s: label %lld of sample %d is outside [0, %d)", op,
                            (long long)labels[n], n, C);
        (*kept)++;
    }
    return TD_OK;
}

/* The factor that turns a per-sample term into the reduced loss. */
static double reduce_scale(td__ref_reduction reduction, int kept) {
    if (reduction == TD__REF_SUM) return 1.0;
    return kept > 0 ? 1.0 / kept : NAN;
}

td_status td__ref_nll_loss_forward(float *loss, const float *logp, const int64_t *labels, int N,
                                   int C, td__ref_reduction reduction, int64_t ignore_index) {
    int kept;
    td_status st = check_labels("nll_loss", labels, N, C, ignore_index, &kept);
    if (st != TD_OK) return st;
    double s = 0.0;
    for (int n = 0; n < N; n++)
        if (labels[n] != ignore_index) s -= logp[(size_t)n * C + labels[n]];
    *loss = (float)(reduction == TD__REF_SUM ? s : s / kept); /* 0/0 is NaN, as PyTorch */
    return TD_OK;
}

td_status td__ref_nll_loss_backward(float *dlogp, float dloss, const int64_t *labels, int N, int C,
                                    td__ref_reduction reduction, int64_t ignore_index) {
    int kept;
    td_status st = check_labels("nll_loss", labels, N, C, ignore_index, &kept);
    if (st != TD_OK) return st;
    double g = -(double)dloss * reduce_scale(reduction, kept);
    for (size_t i = 0; i < (size_t)N * C; i++) dlogp[i] = 0.0f;
    for (int n = 0; n < N; n++)
        if (labels[n] != ignore_index) dlogp[(size_t)n * C + labels[n]] = (float)g;
    return TD_OK;
}

/* log(sum exp(row)) with the max shifted out, in double. */
static double row_logsumexp(const float *row, int C) {
    double m = -INFINITY, s = 0.0;
    for (int j = 0; j < C; j++)
        if (row[j] > m) m = row[j];
    for (int j = 0; j < C; j++) s += exp(row[j] - m);
    return m + log(s);
}

td_status td__ref_cross_entropy_forward(float *loss, const float *logits, const int64_t *labels,
                                        int N, int C, td__ref_reduction reduction,
                                        int64_t ignore_index) {
    int kept;
    td_status st = check_labels("cross_entropy", labels, N, C, ignore_index, &kept);
    if (st != TD_OK) return st;
    double s = 0.0;
    for (int n = 0; n < N; n++) {
        if (labels[n] == ignore_index) continue;
        const float *row = logits + (size_t)n * C;
        s += row_logsumexp(row, C) - row[labels[n]];
    }
    *loss = (float)(reduction == TD__REF_SUM ? s : s / kept);
    return TD_OK;
}

td_status td__ref_cross_entropy_backward(float *dlogits, float dloss, const float *logits,
                                         const int64_t *labels, int N, int C,
                                         td__ref_reduction reduction, int64_t ignore_index) {
    int kept;
    td_status st = check_labels("cross_entropy", labels, N, C, ignore_index, &kept);
    if (st != TD_OK) return st;
    double g = (double)dloss * reduce_scale(reduction, kept);
    for (int n = 0; n < N; n++) {
        const float *row = logits + (size_t)n * C;
        float *drow = dlogits + (size_t)n * C;
        if (labels[n] == ignore_index) {
            for (int j = 0; j < C; j++) drow[j] = 0.0f;
            continue;
        }
        double lse = row_logsumexp(row, C);
        for (int j = 0; j < C; j++) {
            double p = exp(row[j] - lse) - (j == labels[n] ? 1.0 : 0.0);
            drow[j] = (float)(g * p);
        }
    }
    return TD_OK;
}
