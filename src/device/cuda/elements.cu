/* The device layer's own element kernels (cuda_api.h): converting between dtypes and filling
 * with a bit pattern, for callers that hold device memory but no graph (DDP's buckets, a
 * half-width wire copy, the canary in memory a gradient left). Queued on the stream given. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "device/cuda/runtime.cuh"

#define THREADS 256

static unsigned blocks(size_t n) {
    size_t b = (n + THREADS - 1) / THREADS;
    return (unsigned)(b < 1 ? 1 : b > 65535 ? 65535 : b);
}

__device__ __forceinline__ double load(const void *p, int dt, size_t i) {
    switch (dt) {
    case TD_F32:
        return ((const float *)p)[i];
    case TD_F64:
        return ((const double *)p)[i];
    case TD_BF16:
        return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case TD_F16:
        return __half2float(((const __half *)p)[i]);
    case TD_I32:
        return ((const int32_t *)p)[i];
    case TD_I64:
        return (double)((const int64_t *)p)[i];
    default:
        return ((const uint8_t *)p)[i];
    }
}

/* Floats round to nearest even (through f32 for the 16-bit ones, as the host's td__convert). */
__device__ __forceinline__ void store(void *p, int dt, size_t i, double v) {
    switch (dt) {
    case TD_F32:
        ((float *)p)[i] = (float)v;
        break;
    case TD_F64:
        ((double *)p)[i] = v;
        break;
    case TD_BF16:
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn((float)v);
        break;
    case TD_F16:
        ((__half *)p)[i] = __float2half_rn((float)v);
        break;
    case TD_I32:
        ((int32_t *)p)[i] = (int32_t)(int64_t)v;
        break;
    case TD_I64:
        ((int64_t *)p)[i] = (int64_t)v;
        break;
    default:
        ((uint8_t *)p)[i] = (uint8_t)(int64_t)v;
        break;
    }
}

__global__ void convert_kernel(void *dst, int dt, const void *src, int st, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        store(dst, dt, i, load(src, st, i));
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
