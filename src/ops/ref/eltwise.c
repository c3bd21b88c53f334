/* Reference element-wise activations: relu, exact (erf) and tanh gelu. */
#include <math.h>

#include "ops/ref/ref.h"

void td__ref_relu_forward(float *y, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

void td__ref_relu_backward(float *dx, const float *dy, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
}

void td__ref_gelu_forward(float *y, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) {
        double v = x[i];
        y[i] = (float)(0.5 * v * (1.0 + erf(v * M_SQRT1_2)));
    }
}

void td__ref_gelu_backward(float *dx, const float *dy, const float *x, size_t n) {
    /* d/dx [x Phi(x)] = Phi(x) + x phi(x), phi the standard normal density. */
    const double inv_sqrt_2pi = 0.5 * M_2_SQRTPI * M_SQRT1_2;
    for (size_t i = 0; i < n; i++) {
        double v = x[i];
        double cdf = 0.5 * (1.0 + erf(v * M_SQRT1_2));
        double pdf = inv_sqrt_2pi * exp(-0.5 * v * v);
        dx[i] = (float)(dy[i] * (cdf + v * pdf));
    }
}

#define GELU_K 0.7978845608028654 /* sqrt(2 / pi) */

void td__ref_gelu_tanh_forward(float *y, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) {
        double v = x[i];
        y[i] = (float)(0.5 * v * (1.0 + tanh(GELU_K * (v + 0.044715 * v * v * v))));
    }
}

void td__ref_gelu_tanh_backward(float *dx, const float *dy, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) {
        double v = x[i], u = GELU_K * (v + 0.044715 * v * v * v), t = tanh(u);
        double du = GELU_K * (1.0 + 3.0 * 0.044715 * v * v);
        dx[i] = (float)(dy[i] * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du));
    }
}
