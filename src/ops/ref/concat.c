/* Reference concatenation along dim 1: values moved without arithmetic, so the gradient is a
 * copy back into each input's. */
#include <string.h>

#include "ops/ref/ref.h"

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
