/* The kernels of softmax.cu and their launches: softmax and log-softmax over the last axis of
 * f32 rows, forward and backward, one block per row, the row's maximum and sum reduced in a
 * fixed tree, so results do not depend on timing. Compiles for a GPU and under the CPU's
 * emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_SOFTMAX_CUH
#define TANDEM_CUDA_SOFTMAX_CUH

#include <cfloat>

#include "device/cuda/kernel.cuh"

static __global__ void __launch_bounds__(TD__THREADS)
    td__softmax_forward_kernel(float *y, const float *x, int64_t C, int log) {
    const float *xr = x + (size_t)blockIdx.x * C;
    float *yr = y + (size_t)blockIdx.x * C;
    float m = -FLT_MAX;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) m = fmaxf(m, xr[c]);
    m = td__block_reduce(m, 1);
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += expf(xr[c] - m);
    s = td__block_reduce(s, 0);
    float ls = logf(s);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        yr[c] = log ? xr[c] - m - ls : expf(xr[c] - m) / s;
}

/* softmax: dx = y (dy - sum(dy y)); log-softmax: dx = dy - exp(y) sum(dy). */
static __global__ void __launch_bounds__(TD__THREADS)
    td__softmax_backward_kernel(float *dx, const float *dy, const float *y, int64_t C, int log,
                                float beta) {
    size_t row = (size_t)blockIdx.x * C;
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        s += log ? dy[row + c] : dy[row + c] * y[row + c];
    s = td__block_reduce(s, 0);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        size_t i = row + c;
        float d = log ? dy[i] - expf(y[i]) * s : y[i] * (dy[i] - s);
        dx[i] = beta != 0.f ? beta * dx[i] + d : d;
    }
}

/* y = softmax (log: log-softmax) of rows (< 2^31) of C, on stream s. */
static inline void td__launch_softmax_forward(cudaStream_t s, float *y, const float *x,
                                              unsigned rows, int64_t C, int log) {
    if (rows) td__launch<td__softmax_forward_kernel>(rows, 0, s, y, x, C, log);
}

/* dx = beta dx + its gradient from dy and the forward's y. */
static inline void td__launch_softmax_backward(cudaStream_t s, float *dx, const float *dy,
                                               const float *y, unsigned rows, int64_t C, int log,
                                               float beta) {
    if (rows) td__launch<td__softmax_backward_kernel>(rows, 0, s, dx, dy, y, C, log, beta);
}

#endif
