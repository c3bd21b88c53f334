/* The kernels of eltwise.cu and their launches: y = beta y + alpha x between any float dtypes
 * (every gradient accumulation and dtype change), ReLU and the two GELUs forward and backward,
 * and add. Each element is computed in f32, as the CPU kernels do. Compiles for a GPU and under
 * the CPU's emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_ELTWISE_CUH
#define TANDEM_CUDA_ELTWISE_CUH

#include "device/cuda/dtype.cuh"
#include "ops/op.h"

template <typename Y, typename X>
__global__ void __launch_bounds__(TD__THREADS)
    td__add_into_kernel(Y *y, const X *x, size_t n, float alpha, float beta) {
    TD__GRID_STRIDE(i, n) {
        float v = alpha * td_ld(x, i);
        td_st(y, i, beta != 0.f ? beta * td_ld(y, i) + v : v);
    }
}

#define TD__GELU_K 0.7978845608028654f /* sqrt(2 / pi) */

/* ReLU as the CPU op (oneDNN's max(x, 0)) computes it: a NaN becomes 0 on both devices, where
 * PyTorch keeps it (test_kernels_emulated checks the two devices agree). */
__device__ __forceinline__ float td__relu(float x) { return fmaxf(x, 0.f); }

__device__ __forceinline__ float td__act(float x, int variant) {
    switch (variant) {
    case TD__ELT_GELU:
        return 0.5f * x * (1.f + erff(x * 0.70710678f));
    case TD__ELT_GELU_TANH:
        return 0.5f * x * (1.f + tanhf(TD__GELU_K * (x + 0.044715f * x * x * x)));
    default:
        return td__relu(x);
    }
}

/* f'(x) dy */
__device__ __forceinline__ float td__act_grad(float x, float dy, int variant) {
    switch (variant) {
    case TD__ELT_GELU: {
        float cdf = 0.5f * (1.f + erff(x * 0.70710678f));
        return (cdf + x * 0.39894228f * expf(-0.5f * x * x)) * dy;
    }
    case TD__ELT_GELU_TANH: {
        float t = tanhf(TD__GELU_K * (x + 0.044715f * x * x * x));
        float du = TD__GELU_K * (1.f + 3.f * 0.044715f * x * x);
        return dy * (0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du);
    }
    default:
        return x > 0.f ? dy : 0.f;
    }
}

template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__act_forward_kernel(T *y, const T *x, size_t n, int variant) {
    TD__GRID_STRIDE(i, n) td_st(y, i, td__act(td_ld(x, i), variant));
}

/* dx = beta dx + f'(x) dy; in place (x gone), ReLU's f' is read off y over dy's storage. */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__act_backward_kernel(T *dx, const T *dy, const T *x, size_t n, int variant, float beta) {
    TD__GRID_STRIDE(i, n) {
        float d = td__act_grad(td_ld(x, i), td_ld(dy, i), variant);
        td_st(dx, i, beta != 0.f ? beta * td_ld(dx, i) + d : d);
    }
}

template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__add_kernel(T *y, const T *a, const T *b, size_t n) {
    TD__GRID_STRIDE(i, n) td_st(y, i, td_ld(a, i) + td_ld(b, i));
}

/* y[i] = beta y[i] + alpha x[i] over n elements, on stream s. */
template <typename Y, typename X>
static inline void td__launch_add_into(cudaStream_t s, Y *y, const X *x, size_t n, float alpha,
                                       float beta) {
    if (n) td__launch<td__add_into_kernel<Y, X>>(td__blocks(n), 0, s, y, x, n, alpha, beta);
}

/* y = act(x) (variant TD__ELT_RELU, _GELU, _GELU_TANH) over n elements. */
template <typename T>
static inline void td__launch_act_forward(cudaStream_t s, T *y, const T *x, size_t n, int variant) {
    if (n) td__launch<td__act_forward_kernel<T>>(td__blocks(n), 0, s, y, x, n, variant);
}

/* dx = beta dx + act'(x) dy over n elements. */
template <typename T>
static inline void td__launch_act_backward(cudaStream_t s, T *dx, const T *dy, const T *x, size_t n,
                                           int variant, float beta) {
    if (n) td__launch<td__act_backward_kernel<T>>(td__blocks(n), 0, s, dx, dy, x, n, variant, beta);
}

/* y = a + b over n elements. */
template <typename T>
static inline void td__launch_add(cudaStream_t s, T *y, const T *a, const T *b, size_t n) {
    if (n) td__launch<td__add_kernel<T>>(td__blocks(n), 0, s, y, a, b, n);
}

#endif
