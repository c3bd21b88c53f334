/* The reduction kernels of ipc.cu and their launch: n elements reduced over the ranks' staging
 * buffers in rank order, so that every rank computes the same bits. Compiles for a GPU and under
 * the CPU's emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_IPC_CUH
#define TANDEM_CUDA_IPC_CUH

#include <type_traits>

#include "comm/gpu_comm_api.h"
#include "device/cuda/dtype.cuh"

/* Every rank's staging buffer, by value (kernels take it as an argument). */
typedef struct {
    const char *p[TD__IPC_MAX_RANKS];
} td__ipc_peers;

/* a op b; integers add and multiply modulo 2^bits (as the host's td__reduce, MPI and NCCL
 * do), through their unsigned type, where signed overflow would be undefined. */
template <typename A> __device__ __forceinline__ A td__ipc_combine(A a, A b, int op) {
    typedef typename std::conditional<std::is_integral<A>::value, std::make_unsigned<A>,
                                      std::enable_if<true, A>>::type::type U;
    switch (op) {
    case TD_OP_PROD:
        return (A)((U)a * (U)b);
    case TD_OP_MIN:
        return b < a ? b : a;
    case TD_OP_MAX:
        return b > a ? b : a;
    default:
        return (A)((U)a + (U)b); /* SUM, AVG */
    }
}

/* dst[i] = op over the ranks of src.p[r][at + i] (element offset `at`), in rank order,
 * accumulated in A; AVG divides by the ranks at the end (integers toward zero). */
template <typename T, typename A>
__global__ void __launch_bounds__(TD__THREADS)
    td__ipc_reduce_kernel(T *dst, td__ipc_peers src, int ranks, size_t at, size_t n, int op) {
    TD__GRID_STRIDE(i, n) {
        A acc = (A)((const T *)src.p[0])[at + i];
        for (int r = 1; r < ranks; r++)
            acc = td__ipc_combine<A>(acc, (A)((const T *)src.p[r])[at + i], op);
        if (op == TD_OP_AVG) acc = acc / (A)ranks;
        dst[i] = (T)acc;
    }
}

/* The same for 16-bit floats, accumulated in f32. */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__ipc_reduce_half_kernel(T *dst, td__ipc_peers src, int ranks, size_t at, size_t n, int op) {
    TD__GRID_STRIDE(i, n) {
        float acc = td_ld((const T *)src.p[0], at + i);
        for (int r = 1; r < ranks; r++)
            acc = td__ipc_combine<float>(acc, td_ld((const T *)src.p[r], at + i), op);
        if (op == TD_OP_AVG) acc = acc / (float)ranks;
        td_st(dst, i, acc);
    }
}

/* dst (n elements of dtype) = the reduction by op of elements [at, at + n) of the ranks'
 * buffers, on stream s; -1 for a dtype it has no kernel for. */
static inline int td__launch_ipc_reduce(cudaStream_t s, void *dst, const td__ipc_peers &src,
                                        int ranks, size_t at, size_t n, td_dtype dtype, int op) {
    if (n == 0) return 0;
    unsigned b = td__blocks(n);
    switch (dtype) {
    case TD_F32:
        td__launch<td__ipc_reduce_kernel<float, float>>(b, 0, s, (float *)dst, src, ranks, at, n,
                                                        op);
        return 0;
    case TD_F64:
        td__launch<td__ipc_reduce_kernel<double, double>>(b, 0, s, (double *)dst, src, ranks, at, n,
                                                          op);
        return 0;
    case TD_I32:
        td__launch<td__ipc_reduce_kernel<int32_t, int64_t>>(b, 0, s, (int32_t *)dst, src, ranks, at,
                                                            n, op);
        return 0;
    case TD_I64:
        td__launch<td__ipc_reduce_kernel<int64_t, int64_t>>(b, 0, s, (int64_t *)dst, src, ranks, at,
                                                            n, op);
        return 0;
    case TD_U8:
        td__launch<td__ipc_reduce_kernel<uint8_t, uint32_t>>(b, 0, s, (uint8_t *)dst, src, ranks,
                                                             at, n, op);
        return 0;
    case TD_BF16:
        td__launch<td__ipc_reduce_half_kernel<__nv_bfloat16>>(b, 0, s, (__nv_bfloat16 *)dst, src,
                                                              ranks, at, n, op);
        return 0;
    case TD_F16:
        td__launch<td__ipc_reduce_half_kernel<__half>>(b, 0, s, (__half *)dst, src, ranks, at, n,
                                                       op);
        return 0;
    default:
        return -1;
    }
}

#endif
