/* The kernels of normalize.cu and their launches: L2 normalisation of f32 (N, D) rows, one block
 * per row, the squared norm summed in double in a fixed tree; each row's norm is kept (negated
 * where it was clamped to eps) for backward. Compiles for a GPU and under the CPU's emulation
 * (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_NORMALIZE_CUH
#define TANDEM_CUDA_NORMALIZE_CUH

#include "device/cuda/kernel.cuh"

static __global__ void __launch_bounds__(TD__THREADS)
    td__norm_forward_kernel(float *y, double *norms, const float *x, int64_t D, float eps) {
    const float *row = x + (size_t)blockIdx.x * D;
    double sq = 0;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) sq += (double)row[j] * row[j];
    sq = td__block_reduce(sq, 0);
    double norm = sqrt(sq);
    int clamped = norm < eps;
    if (clamped) norm = eps;
    if (threadIdx.x == 0) norms[blockIdx.x] = clamped ? -norm : norm;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
        y[(size_t)blockIdx.x * D + j] = (float)(row[j] / norm);
}

static __global__ void __launch_bounds__(TD__THREADS)
    td__norm_backward_kernel(float *dx, const float *dy, const float *x, const double *norms,
                             int64_t D, float beta) {
    size_t at = (size_t)blockIdx.x * D;
    double norm = norms[blockIdx.x], dot = 0;
    int clamped = norm < 0;
    if (clamped) norm = -norm;
    if (!clamped)
        for (int64_t j = threadIdx.x; j < D; j += blockDim.x) dot += (double)x[at + j] * dy[at + j];
    dot = td__block_reduce(dot, 0);
    double k = dot / (norm * norm * norm);
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        float v = (float)(dy[at + j] / norm - x[at + j] * k);
        dx[at + j] = beta != 0.f ? beta * dx[at + j] + v : v;
    }
}

/* y = the N rows of x over their norms; norms (N doubles) for backward. */
static inline void td__launch_norm_forward(cudaStream_t s, float *y, double *norms, const float *x,
                                           unsigned N, int64_t D, float eps) {
    if (N) td__launch<td__norm_forward_kernel>(N, 0, s, y, norms, x, D, eps);
}

/* dx = beta dx + the gradient through the forward's norms. */
static inline void td__launch_norm_backward(cudaStream_t s, float *dx, const float *dy,
                                            const float *x, const double *norms, unsigned N,
                                            int64_t D, float beta) {
    if (N) td__launch<td__norm_backward_kernel>(N, 0, s, dx, dy, x, norms, D, beta);
}

#endif
