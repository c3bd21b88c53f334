/* Reference 2-d batch normalisation over (N, H, W) per channel: training forward with the
 * running-statistics update, eval forward, and both backwards. Statistics are two-pass in
 * double. Not SyncBatchNorm (that reduces the sums across ranks) and not layer norm. */
#include <math.h>

#include "ops/ref/ref.h"

void td__ref_batchnorm2d_forward_train(float *y, float *save_mean, float *save_invstd,
                                       float *running_mean, float *running_var, const float *x,
                                       const float *weight, const float *bias, int N, int C, int HW,
                                       float eps, float momentum) {
    size_t m = (size_t)N * HW;
    for (int c = 0; c < C; c++) {
        double sum = 0.0;
        for (int n = 0; n < N; n++)
            for (int i = 0; i < HW; i++) sum += x[((size_t)n * C + c) * HW + i];
        double mean = sum / (double)m, sq = 0.0;
        for (int n = 0; n < N; n++)
            for (int i = 0; i < HW; i++) {
                double t = x[((size_t)n * C + c) * HW + i] - mean;
                sq += t * t;
            }
        double var = sq / (double)m;
        double invstd = 1.0 / sqrt(var + eps);
        double g = weight ? weight[c] : 1.0, b = bias ? bias[c] : 0.0;
        for (int n = 0; n < N; n++)
            for (int i = 0; i < HW; i++) {
                size_t k = ((size_t)n * C + c) * HW + i;
                y[k] = (float)((x[k] - mean) * invstd * g + b);
            }
        save_mean[c] = (float)mean;
        save_invstd[c] = (float)invstd;
        /* PyTorch feeds the unbiased variance to the running estimate (and the biased one
         * to normalisation); with one value per channel the unbiased one is undefined. */
        double unbiased = m > 1 ? sq / (double)(m - 1) : NAN;
        if (running_mean)
            running_mean[c] = (float)((1.0 - momentum) * running_mean[c] + momentum * mean);
        if (running_var)
            running_var[c] = (float)((1.0 - momentum) * running_var[c] + momentum * unbiased);
    }
}

void td__ref_batchnorm2d_forward_eval(float *y, const float *x, const float *running_mean,
                                      const float *running_var, const float *weight,
                                      const float *bias, int N, int C, int HW, float eps) {
    for (int c = 0; c < C; c++) {
        double invstd = 1.0 / sqrt((double)running_var[c] + eps);
        double g = weight ? weight[c] : 1.0, b = bias ? bias[c] : 0.0;
        for (int n = 0; n < N; n++)
            for (int i = 0; i < HW; i++) {
                size_t k = ((size_t)n * C + c) * HW + i;
                y[k] = (float)((x[k] - running_mean[c]) * invstd * g + b);
            }
    }
}

void td__ref_batchnorm2d_backward_train(float *dx, float *dweight, float *dbias, const float *dy,
                                        const float *x, const float *weight, const float *save_mean,
                                        const float *save_invstd, int N, int C, int HW) {
    size_t m = (size_t)N * HW;
    for (int c = 0; c < C; c++) {
        double mean = save_mean[c], invstd = save_invstd[c];
        double sum_dy = 0.0, sum_dy_xhat = 0.0;
        for (int n = 0; n < N; n++)
            for (int i = 0; i < HW; i++) {
                size_t k = ((size_t)n * C + c) * HW + i;
                sum_dy += dy[k];
                sum_dy_xhat += dy[k] * (x[k] - mean) * invstd;
            }
        if (dweight) dweight[c] = (float)sum_dy_xhat;
        if (dbias) dbias[c] = (float)sum_dy;
        if (!dx) continue;
        /* dx = g * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)) */
        double g = weight ? weight[c] : 1.0;
        for (int n = 0; n < N; n++)
            for (int i = 0; i < HW; i++) {
                size_t k = ((size_t)n * C + c) * HW + i;
                double xhat = (x[k] - mean) * invstd;
                dx[k] = (float)(g * invstd *
                                (dy[k] - sum_dy / (double)m - xhat * sum_dy_xhat / (double)m));
            }
    }
}

void td__ref_batchnorm2d_backward_eval(float *dx, float *dweight, float *dbias, const float *dy,
                                       const float *x, const float *running_mean,
                                       const float *running_var, const float *weight, int N, int C,
                                       int HW, float eps) {
    for (int c = 0; c < C; c++) {
        double invstd = 1.0 / sqrt((double)running_var[c] + eps);
        double g = weight ? weight[c] : 1.0;
        double sum_dy = 0.0, sum_dy_xhat = 0.0;
        for (int n = 0; n < N; n++)
            for (int i = 0; i < HW; i++) {
                size_t k = ((size_t)n * C + c) * HW + i;
                sum_dy += dy[k];
                sum_dy_xhat += dy[k] * (x[k] - running_mean[c]) * invstd;
                if (dx) dx[k] = (float)(dy[k] * g * invstd);
            }
        if (dweight) dweight[c] = (float)sum_dy_xhat;
        if (dbias) dbias[c] = (float)sum_dy;
    }
}
