/* Reference fully connected layer, y = x W^T + b, forward and backward. Plain loops with
 * double accumulation; no blocking, no threads (that is oneDNN's job). */
#include "ops/ref/ref.h"

void td__ref_linear_forward(float *y, const float *x, const float *w, const float *b, int N, int IN,
                            int OUT) {
    for (int n = 0; n < N; n++) {
        for (int o = 0; o < OUT; o++) {
            double s = b ? b[o] : 0.0;
            for (int i = 0; i < IN; i++) s += (double)x[(size_t)n * IN + i] * w[(size_t)o * IN + i];
            y[(size_t)n * OUT + o] = (float)s;
        }
    }
}

void td__ref_linear_backward(float *dx, float *dw, float *db, const float *dy, const float *x,
                             const float *w, int N, int IN, int OUT) {
    if (dx) {
        for (int n = 0; n < N; n++) {
            for (int i = 0; i < IN; i++) {
                double s = 0.0;
                for (int o = 0; o < OUT; o++)
                    s += (double)dy[(size_t)n * OUT + o] * w[(size_t)o * IN + i];
                dx[(size_t)n * IN + i] = (float)s;
            }
        }
    }
    if (dw) {
        for (int o = 0; o < OUT; o++) {
            for (int i = 0; i < IN; i++) {
                double s = 0.0;
                for (int n = 0; n < N; n++)
                    s += (double)dy[(size_t)n * OUT + o] * x[(size_t)n * IN + i];
                dw[(size_t)o * IN + i] = (float)s;
            }
        }
    }
    if (db) {
        for (int o = 0; o < OUT; o++) {
            double s = 0.0;
            for (int n = 0; n < N; n++) s += dy[(size_t)n * OUT + o];
            db[o] = (float)s;
        }
    }
}
