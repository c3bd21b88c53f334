/* Reference softmax and log_softmax over the last dim, max-shifted for stability, with
 * backwards written in terms of the forward output (as PyTorch saves it). */
#include <math.h>

#include "ops/ref/ref.h"

/* Row maximum and log of the sum of exp(x - max), in double. */
static void row_stats(const float *x, int D, double *max, double *log_sum) {
    double m = -INFINITY, s = 0.0;
    for (int j = 0; j < D; j++)
        if (x[j] > m) m = x[j];
    for (int j = 0; j < D; j++) s += exp(x[j] - m);
    *max = m;
    *log_sum = log(s);
}

void td__ref_softmax_forward(float *y, const float *x, size_t rows, int D) {
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        double m, ls;
        row_stats(xr, D, &m, &ls);
        for (int j = 0; j < D; j++) y[r * D + j] = (float)exp(xr[j] - m - ls);
    }
}

void td__ref_softmax_backward(float *dx, const float *dy, const float *y, size_t rows, int D) {
    for (size_t r = 0; r < rows; r++) {
        double dot = 0.0;
        for (int j = 0; j < D; j++) dot += (double)dy[r * D + j] * y[r * D + j];
        for (int j = 0; j < D; j++) dx[r * D + j] = (float)(y[r * D + j] * (dy[r * D + j] - dot));
    }
}

void td__ref_log_softmax_forward(float *y, const float *x, size_t rows, int D) {
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        double m, ls;
        row_stats(xr, D, &m, &ls);
        for (int j = 0; j < D; j++) y[r * D + j] = (float)(xr[j] - m - ls);
    }
}

void td__ref_log_softmax_backward(float *dx, const float *dy, const float *y, size_t rows, int D) {
    for (size_t r = 0; r < rows; r++) {
        double sum = 0.0;
        for (int j = 0; j < D; j++) sum += dy[r * D + j];
        for (int j = 0; j < D; j++)
            dx[r * D + j] = (float)(dy[r * D + j] - exp((double)y[r * D + j]) * sum);
    }
}
