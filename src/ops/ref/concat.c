/* Reference structural ops: element-wise add, concatenation along dim 1 and flatten. They
 * move values without arithmetic beyond one add, so their gradients are copies. */
#include <string.h>

#include "ops/ref/ref.h"

void td__ref_add_forward(float *y, const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

void td__ref_concat_forward(float *y, const float *const *xs, const int *C, int k, int N,
                            size_t inner) {
    size_t total = 0;
    for (int j = 0; j < k; j++) total += (size_t)C[j];
    for (int n = 0; n < N; n++) {
        size_t off = 0;
        for (int j = 0; j < k; j++) {
            size_t len = (size_t)C[j] * inner;
            memcpy(y + ((size_t)n * total) * inner + off, xs[j] + (size_t)n * len,
                   len * sizeof(float));
            off += len;
        }
    }
}

void td__ref_concat_backward(float *const *dxs, const float *dy, const int *C, int k, int N,
                             size_t inner) {
    size_t total = 0;
    for (int j = 0; j < k; j++) total += (size_t)C[j];
    for (int n = 0; n < N; n++) {
        size_t off = 0;
        for (int j = 0; j < k; j++) {
            size_t len = (size_t)C[j] * inner;
            if (dxs[j])
                memcpy(dxs[j] + (size_t)n * len, dy + ((size_t)n * total) * inner + off,
                       len * sizeof(float));
            off += len;
        }
    }
}

void td__ref_flatten_forward(float *y, const float *x, size_t n) {
    memmove(y, x, n * sizeof(float));
}

void td__ref_flatten_backward(float *dx, const float *dy, size_t n) {
    memmove(dx, dy, n * sizeof(float));
}
