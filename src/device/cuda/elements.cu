/* The device layer's own element kernels (cuda_api.h): converting between dtypes and filling
 * with a bit pattern, for callers that hold device memory but no graph (DDP's buckets, a
 * half-width wire copy, the canary in memory a gradient left). Queued on the stream given. */
#include "device/cuda/dtype.cuh"
#include "device/cuda/runtime.cuh"

#define THREADS 256

static unsigned blocks(size_t n) {
    size_t b = (n + THREADS - 1) / THREADS;
    return (unsigned)(b < 1 ? 1 : b > 65535 ? 65535 : b);
}

__global__ void convert_kernel(void *dst, int dt, const void *src, int st, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        td_st_dt(dst, dt, i, td_ld_dt(src, st, i));
}

__global__ void fill_kernel(unsigned char *p, uint32_t bits, int size, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        if (size == 2)
            ((uint16_t *)p)[i] = (uint16_t)bits;
        else
            ((uint32_t *)p)[i] = bits;
    }
}

td_status td__cu_convert_async(int device, void *stream, void *dst, td_dtype dst_dtype,
                               const void *src, td_dtype src_dtype, size_t n) {
    if (n == 0) return TD_OK;
    TD__CU(cudaSetDevice(device));
    convert_kernel<<<blocks(n), THREADS, 0, (cudaStream_t)stream>>>(dst, dst_dtype, src, src_dtype,
                                                                    n);
    TD__CU(cudaGetLastError());
    return TD_OK;
}

td_status td__cu_fill_async(int device, void *stream, void *ptr, uint32_t bits, int size,
                            size_t n) {
    if (n == 0) return TD_OK;
    TD__CU(cudaSetDevice(device));
    fill_kernel<<<blocks(n), THREADS, 0, (cudaStream_t)stream>>>((unsigned char *)ptr, bits, size,
                                                                 n);
    TD__CU(cudaGetLastError());
    return TD_OK;
}
