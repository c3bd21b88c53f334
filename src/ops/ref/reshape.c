/* Reference flatten: it keeps the bytes, so forward and backward are copies. */
#include <string.h>

#include "ops/ref/ref.h"

void td__ref_flatten_forward(float *y, const float *x, size_t n) {
    memmove(y, x, n * sizeof(float));
}

void td__ref_flatten_backward(float *dx, const float *dy, size_t n) {
    memmove(dx, dy, n * sizeof(float));
}
