/* Reference dropout and dropout2d, applied with a mask the caller supplies. Generating the mask
 * belongs to the graph (it owns the RNG stream); here it is an input so results are
 * reproducible. */
#include "ops/ref/ref.h"

void td__ref_dropout_forward(float *y, const float *x, const uint8_t *mask, float scale, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = mask[i] ? x[i] * scale : 0.0f;
}

void td__ref_dropout_backward(float *dx, const float *dy, const uint8_t *mask, float scale,
                              size_t n) {
    for (size_t i = 0; i < n; i++) dx[i] = mask[i] ? dy[i] * scale : 0.0f;
}

void td__ref_dropout2d_forward(float *y, const float *x, const uint8_t *mask, float scale, int N,
                               int C, size_t plane) {
    for (size_t nc = 0; nc < (size_t)N * C; nc++)
        for (size_t i = 0; i < plane; i++)
            y[nc * plane + i] = mask[nc] ? x[nc * plane + i] * scale : 0.0f;
}

void td__ref_dropout2d_backward(float *dx, const float *dy, const uint8_t *mask, float scale, int N,
                                int C, size_t plane) {
    td__ref_dropout2d_forward(dx, dy, mask, scale, N, C, plane);
}
