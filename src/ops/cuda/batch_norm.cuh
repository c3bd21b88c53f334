/* The kernels of batch_norm.cu and their launches, what cuDNN's batch norm does not do: a
 * folded ReLU forward and its mask backward, and the backward in eval mode (the running
 * statistics as constants), its per-channel sums one block per channel in a fixed tree.
 * Compiles for a GPU and under the CPU's emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_BATCH_NORM_CUH
#define TANDEM_CUDA_BATCH_NORM_CUH

#include "device/cuda/dtype.cuh"
#include "ops/cuda/eltwise.cuh"

/* y = ReLU(y) in place, as eltwise.cuh's ReLU. */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS) td__bn_relu_kernel(T *y, size_t n) {
    TD__GRID_STRIDE(i, n) td_st(y, i, td__relu(td_ld(y, i)));
}

/* out = dy where the ReLU's output y is positive, else 0. */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__bn_relu_mask_kernel(T *out, const T *dy, const T *y, size_t n) {
    TD__GRID_STRIDE(i, n) td_st(out, i, td_ld(y, i) > 0.f ? td_ld(dy, i) : 0.f);
}

/* Eval backward, data: dx = beta dx + dy * weight[c] / sqrt(running_var[c] + eps). */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__bn_eval_dx_kernel(T *dx, const T *dy, const float *w, const float *rv, float eps, size_t n,
                          int64_t C, int64_t HW, float beta) {
    TD__GRID_STRIDE(i, n) {
        size_t c = (i / (size_t)HW) % (size_t)C;
        float d = td_ld(dy, i) * w[c] / sqrtf(rv[c] + eps);
        td_st(dx, i, beta != 0.f ? beta * td_ld(dx, i) + d : d);
    }
}

/* Eval backward, parameters (one block per channel): dw[c] = beta_w dw[c] + sum of
 * dy * (x - running_mean) / sqrt(running_var + eps), db[c] = beta_b db[c] + sum of dy, over
 * (N, H, W); dw or db NULL when not wanted. */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__bn_eval_params_kernel(float *dw, float *db, float beta_w, float beta_b, const T *dy,
                              const T *x, const float *rm, const float *rv, float eps, int64_t N,
                              int64_t C, int64_t HW) {
    int64_t c = blockIdx.x, m = N * HW;
    float mean = rm[c], invstd = 1.f / sqrtf(rv[c] + eps), sum_dy = 0.f, sum_dy_xhat = 0.f;
    for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
        int64_t b = j / HW;
        size_t k = (size_t)((b * C + c) * HW + (j - b * HW));
        float d = td_ld(dy, k);
        sum_dy += d;
        sum_dy_xhat += d * (td_ld(x, k) - mean) * invstd;
    }
    sum_dy = td__block_reduce(sum_dy, 0);
    sum_dy_xhat = td__block_reduce(sum_dy_xhat, 0);
    if (threadIdx.x != 0) return;
    if (dw) dw[c] = beta_w != 0.f ? beta_w * dw[c] + sum_dy_xhat : sum_dy_xhat;
    if (db) db[c] = beta_b != 0.f ? beta_b * db[c] + sum_dy : sum_dy;
}

/* y = ReLU(y) over n elements. */
template <typename T> static inline void td__launch_bn_relu(cudaStream_t s, T *y, size_t n) {
    if (n) td__launch<td__bn_relu_kernel<T>>(td__blocks(n), 0, s, y, n);
}

/* out = dy where y > 0, else 0. */
template <typename T>
static inline void td__launch_bn_relu_mask(cudaStream_t s, T *out, const T *dy, const T *y,
                                           size_t n) {
    if (n) td__launch<td__bn_relu_mask_kernel<T>>(td__blocks(n), 0, s, out, dy, y, n);
}

/* dx (N, C, HW) = beta dx + dy scaled per channel by w / sqrt(rv + eps). */
template <typename T>
static inline void td__launch_bn_eval_dx(cudaStream_t s, T *dx, const T *dy, const float *w,
                                         const float *rv, float eps, int64_t N, int64_t C,
                                         int64_t HW, float beta) {
    size_t n = (size_t)(N * C * HW);
    if (n)
        td__launch<td__bn_eval_dx_kernel<T>>(td__blocks(n), 0, s, dx, dy, w, rv, eps, n, C, HW,
                                             beta);
}

/* The weight and bias gradients of eval mode per channel (dw or db NULL when not wanted). */
template <typename T>
static inline void td__launch_bn_eval_params(cudaStream_t s, float *dw, float *db, float beta_w,
                                             float beta_b, const T *dy, const T *x, const float *rm,
                                             const float *rv, float eps, int64_t N, int64_t C,
                                             int64_t HW) {
    if (C)
        td__launch<td__bn_eval_params_kernel<T>>((unsigned)C, 0, s, dw, db, beta_w, beta_b, dy, x,
                                                 rm, rv, eps, N, C, HW);
}

#endif
