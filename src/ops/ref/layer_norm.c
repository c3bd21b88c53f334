/* Reference layer normalisation over the last dim (nn.LayerNorm): forward and backward per
 * row, statistics two-pass in double. Backward recomputes the statistics from x. */
#include <math.h>

#include "ops/ref/ref.h"

/* Mean and 1/sqrt(biased variance + eps) of one row. */
static void row_stats(const float *row, int C, float eps, double *mean, double *rstd) {
    double s = 0.0, q = 0.0;
    for (int c = 0; c < C; c++) s += row[c];
    *mean = s / C;
    for (int c = 0; c < C; c++) q += (row[c] - *mean) * (row[c] - *mean);
    *rstd = 1.0 / sqrt(q / C + eps);
}

void td__ref_layer_norm_forward(float *y, float *mean, float *rstd, const float *x,
                                const float *weight, const float *bias, size_t rows, int C,
                                float eps) {
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * C;
        double m, rs;
        row_stats(xr, C, eps, &m, &rs);
        if (mean) mean[r] = (float)m;
        if (rstd) rstd[r] = (float)rs;
        for (int c = 0; c < C; c++) {
            double v = (xr[c] - m) * rs;
            y[r * C + c] = (float)(v * (weight ? weight[c] : 1.0) + (bias ? bias[c] : 0.0));
        }
    }
}

void td__ref_layer_norm_backward(float *dx, float *dweight, float *dbias, const float *dy,
                                 const float *x, const float *weight, size_t rows, int C,
                                 float eps) {
    for (int c = 0; c < C; c++) {
        if (dweight) dweight[c] = 0.f;
        if (dbias) dbias[c] = 0.f;
    }
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * C, *g = dy + r * C;
        double m, rs, sum_g = 0.0, sum_gx = 0.0;
        row_stats(xr, C, eps, &m, &rs);
        /* with xhat = (x - m) rs and gw = dy * weight:
         * dx = rs (gw - mean(gw) - xhat mean(gw xhat)) */
        for (int c = 0; c < C; c++) {
            double xh = (xr[c] - m) * rs, gw = g[c] * (weight ? weight[c] : 1.0);
            sum_g += gw;
            sum_gx += gw * xh;
            if (dweight) dweight[c] += (float)(g[c] * xh);
            if (dbias) dbias[c] += g[c];
        }
        if (!dx) continue;
        for (int c = 0; c < C; c++) {
            double xh = (xr[c] - m) * rs, gw = g[c] * (weight ? weight[c] : 1.0);
            dx[r * C + c] = (float)(rs * (gw - sum_g / C - xh * sum_gx / C));
        }
    }
}
