/* What the files of libtandem_cuda.so share: the host's services (td__host, set by the runtime's
 * entry, entry.cu), the macro that turns a CUDA error into a td_status, and the calls the device
 * runtime's table (device_api.h) is made of, from runtime.cu, elements.cu, multi_tensor.cu and
 * channels.cu. CUDA C++, for .cu files only. Not installed. */
#ifndef TANDEM_CUDA_RUNTIME_CUH
#define TANDEM_CUDA_RUNTIME_CUH

#include <cuda_runtime.h>

#include "device/device_api.h"

extern const td__device_host *td__host;

/* Returns the host's td_status naming the call and CUDA's message when a CUDA call fails. */
#define TD__CU(call)                                                                   \
    do {                                                                               \
        cudaError_t td_e_ = (call);                                                    \
        if (td_e_ != cudaSuccess)                                                      \
            return td__host->fail(TD_EBACKEND, "%s failed: %s (%s)", #call,            \
                                  cudaGetErrorString(td_e_), cudaGetErrorName(td_e_)); \
    } while (0)

td_status td__cu_device_count(int *count, char *why, size_t n);
td_status td__cu_properties(int device, td_device_properties *out);
td_status td__cu_synchronize(int device);
td_status td__cu_stream_create(int device, void **stream);
td_status td__cu_stream_synchronize(int device, void *stream);
td_status td__cu_device_malloc(int device, size_t bytes, void **ptr);
void td__cu_device_free(int device, void *ptr);
td_status td__cu_event_record(int device, void *stream, void **event);
int td__cu_event_done(void *event);
void td__cu_event_destroy(void *event);
td_status td__cu_memcpy_async(int device, void *dst, const void *src, size_t bytes, void *stream);
td_status td__cu_memset_async(int device, void *ptr, int value, size_t bytes, void *stream);
td_status td__cu_host_alloc(size_t bytes, void **ptr);
void td__cu_host_free(void *ptr);
td_status td__cu_event_wait(int device, void *stream, void *event);
td_status td__cu_event_synchronize(void *event);
int td__cu_pointer_device(const void *ptr);
td_status td__cu_convert_async(int device, void *stream, void *dst, td_dtype dst_dtype,
                               const void *src, td_dtype src_dtype, size_t n);
td_status td__cu_fill_async(int device, void *stream, void *ptr, uint32_t bits, int size, size_t n);
td_status td__cu_device_uuid(int device, unsigned char uuid[16]);
td_status td__cu_channel_sums(int device, void *stream, const float *x, const float *dy,
                              const float *mean, int64_t N, int64_t C, int64_t S, double *s);
td_status td__cu_channel_affine(int device, void *stream, float *out, const float *in,
                                const float *coef, const float *extra, int64_t N, int64_t C,
                                int64_t S);
td_status td__cu_multi_tensor(td_device device, void *stream, const td__mt_args *args,
                              td__mt_tensor *list, size_t n, void **scratch, size_t *scratch_bytes,
                              double *result);

#endif
