/* The kernels of conv2d.cu and their launches: the bias added per channel after cuDNN's
 * convolution, and its gradient, one block per channel summed in a fixed tree. Compiles for a
 * GPU and under the CPU's emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_CONV2D_CUH
#define TANDEM_CUDA_CONV2D_CUH

#include "device/cuda/dtype.cuh"

/* y[n, c, :] += b[c]; y (N, C, HW), b (C). */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__conv_bias_add_kernel(T *y, const T *b, size_t n, int64_t C, int64_t HW) {
    TD__GRID_STRIDE(i, n) {
        size_t c = (i / (size_t)HW) % (size_t)C;
        td_st(y, i, td_ld(y, i) + td_ld(b, c));
    }
}

/* db[c] = beta db[c] + the sum of dy[., c, .], one block per channel; dy (N, C, HW). */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__conv_bias_grad_kernel(T *db, const T *dy, int64_t N, int64_t C, int64_t HW, float beta) {
    int64_t c = blockIdx.x, m = N * HW;
    float sum = 0.f;
    for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
        int64_t b = j / HW;
        sum += td_ld(dy, (size_t)((b * C + c) * HW + (j - b * HW)));
    }
    sum = td__block_reduce(sum, 0);
    if (threadIdx.x == 0)
        td_st(db, (size_t)c, beta != 0.f ? beta * td_ld(db, (size_t)c) + sum : sum);
}

/* y (N, C, HW) += b per channel. */
template <typename T>
static inline void td__launch_conv_bias_add(cudaStream_t s, T *y, const T *b, int64_t N, int64_t C,
                                            int64_t HW) {
    size_t n = (size_t)(N * C * HW);
    if (n) td__launch<td__conv_bias_add_kernel<T>>(td__blocks(n), 0, s, y, b, n, C, HW);
}

/* db (C) = beta db + dy (N, C, HW) summed per channel. */
template <typename T>
static inline void td__launch_conv_bias_grad(cudaStream_t s, T *db, const T *dy, int64_t N,
                                             int64_t C, int64_t HW, float beta) {
    if (C) td__launch<td__conv_bias_grad_kernel<T>>((unsigned)C, 0, s, db, dy, N, C, HW, beta);
}

#endif
