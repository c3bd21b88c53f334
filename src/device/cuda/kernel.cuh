/* What every kernel of libtandem_cuda.so shares, compiled by nvcc for a GPU and by g++ under
 * the CPU's emulation of CUDA (TD_CUDA_EMULATE: device/cuda/emulate.cuh) alike: the block size
 * every kernel is built and launched for, the launch itself (the one place with <<< >>>), grid
 * sizes with their grid-stride loop, and the block-wide reduction in a fixed tree. Kernel files
 * keep their kernels and launches in a header of their own (X.cuh beside X.cu) that includes
 * this one and nothing of the CUDA libraries, so the emulated tests run them unchanged. Not
 * installed. */
#ifndef TANDEM_CUDA_KERNEL_CUH
#define TANDEM_CUDA_KERNEL_CUH

#include <cstddef>
#include <cstdint>

#ifdef TD_CUDA_EMULATE
#include "device/cuda/emulate.cuh"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

/* Dynamic shared memory (the launch's `shared` bytes) as an array of T named `name`. */
#define TD__DYNAMIC_SHARED(T, name)                                   \
    extern __shared__ __align__(16) unsigned char td__dynamic_smem[]; \
    T *name = reinterpret_cast<T *>(td__dynamic_smem)
#endif

/* Threads of every block: each kernel says __launch_bounds__(TD__THREADS), and td__launch
 * launches no other size, so no launch exceeds its kernel's bounds (the resource gate,
 * scripts/cuda_resources.sh, checks every kernel's bounds in the compiled code). */
#define TD__THREADS 256

/* Launches kernel K over `grid` blocks of TD__THREADS threads with `shared` bytes of dynamic
 * shared memory on stream s (emulated: now, on the CPU). A bad configuration is left for
 * cudaGetLastError (on the CPU: the emulation stops, naming it). */
template <auto K, typename... A>
static inline void td__launch(dim3 grid, size_t shared, cudaStream_t s, A... args) {
#ifdef TD_CUDA_EMULATE
    (void)s;
    td__emu::launch(td__emu::name_of<K>(), K, grid, dim3(TD__THREADS), shared, args...);
#else
    K<<<grid, TD__THREADS, shared, s>>>(args...);
#endif
}

/* Blocks for n elements at TD__THREADS each, capped at 65535: kernels loop with a grid stride
 * past that. */
static inline unsigned td__blocks(size_t n) {
    size_t b = (n + TD__THREADS - 1) / TD__THREADS;
    return (unsigned)(b < 1 ? 1 : b > 65535 ? 65535 : b);
}

#define TD__GRID_STRIDE(i, n)                                               \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)gridDim.x * blockDim.x)

/* Sum (or maximum) of v over a block of TD__THREADS threads, in a fixed tree, so the result
 * does not depend on timing; every thread of the block must call it, and gets the result. */
template <typename A> __device__ __forceinline__ A td__block_reduce(A v, int is_max) {
    __shared__ A buf[TD__THREADS];
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int half = TD__THREADS / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) {
            A o = buf[threadIdx.x + half];
            buf[threadIdx.x] =
                is_max ? (o > buf[threadIdx.x] ? o : buf[threadIdx.x]) : buf[threadIdx.x] + o;
        }
        __syncthreads();
    }
    A r = buf[0];
    __syncthreads();
    return r;
}

#endif
