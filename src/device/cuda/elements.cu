/* The device layer's own element kernels (device_api.h): converting between dtypes and filling
 * with a bit pattern, for callers that hold device memory but no graph (DDP's buckets, a
 * half-width wire copy, the canary in memory a gradient left). Queued on the stream given; the
 * kernels are in elements.cuh. */
#include "device/cuda/elements.cuh"
#include "device/cuda/runtime.cuh"

td_status td__cu_convert_async(int device, void *stream, void *dst, td_dtype dst_dtype,
                               const void *src, td_dtype src_dtype, size_t n) {
    if (n == 0) return TD_OK;
    TD__CU(cudaSetDevice(device));
    td__launch_convert((cudaStream_t)stream, dst, dst_dtype, src, src_dtype, n);
    TD__CU(cudaGetLastError());
    return TD_OK;
}

td_status td__cu_fill_async(int device, void *stream, void *ptr, uint32_t bits, int size,
                            size_t n) {
    if (n == 0) return TD_OK;
    TD__CU(cudaSetDevice(device));
    td__launch_fill((cudaStream_t)stream, ptr, bits, size, n);
    TD__CU(cudaGetLastError());
    return TD_OK;
}
