/* What the layers above use of a device beyond the public device.h: work queued on the
 * device's compute stream without waiting for it (filling memory, the multi-tensor kernels of
 * multi_tensor.h), and what a loader needs to upload batches ahead of use: page-locked host
 * memory, a second stream per GPU for copies, and events to order the streams. Each names
 * `what` in its errors; on the CPU they run at once. Not installed. */
#ifndef TANDEM_DEVICE_IMPL_H
#define TANDEM_DEVICE_IMPL_H

#include "tandem/device.h"

#include "device/multi_tensor.h"

/* bytes of ptr set to value (a byte), ordered on d's compute stream. */
td_status td__device_memset(td_device d, void *ptr, int value, size_t bytes, const char *what);

/* One multi-tensor launch on GPU d's compute stream (device_api.h's multi_tensor says what list,
 * scratch and result are). */
td_status td__device_multi_tensor(td_device d, const td__mt_args *args, td__mt_tensor *list,
                                  size_t n, void **scratch, size_t *scratch_bytes, double *result,
                                  const char *what);

/* GPU d's compute stream and its copy stream (made on first use). */
td_status td__device_streams(td_device d, void **compute, void **copy, const char *what);

/* Host memory that copies to and from GPU d are fastest from (page-locked); plain memory for
 * the CPU. Freed with td__device_host_free on the same device. */
td_status td__device_host_alloc(td_device d, size_t bytes, void **out, const char *what);
void td__device_host_free(td_device d, void *ptr);

/* Bytes between host and GPU d memory, queued on `stream` without waiting. */
td_status td__device_copy_async(td_device d, void *dst, const void *src, size_t bytes, void *stream,
                                const char *what);

/* An event recorded on `stream` now; a later wait on another stream, or by the host, orders
 * after it. Freed with td__device_event_free. */
td_status td__device_event_record(td_device d, void *stream, void **event, const char *what);
td_status td__device_event_wait(td_device d, void *stream, void *event, const char *what);
td_status td__device_event_synchronize(td_device d, void *event);
void td__device_event_free(td_device d, void *event);

/* Bytes from host memory the caller may reuse at once (pageable: the driver stages them before
 * returning) to GPU d, queued on its compute stream without waiting; at once on the CPU. */
td_status td__device_upload(td_device d, void *dst, const void *host, size_t bytes,
                            const char *what);

/* n elements of src (src_dtype) into dst (dst_dtype), and n elements of `size` bytes set to
 * `bits`, on device d (the compute stream for a GPU; at once on the CPU). */
td_status td__device_convert(td_device d, void *dst, td_dtype dst_dtype, const void *src,
                             td_dtype src_dtype, size_t n, const char *what);
td_status td__device_fill(td_device d, void *ptr, uint32_t bits, int size, size_t n,
                          const char *what);

/* Per channel of an f32 (N, C, S) tensor on GPU d, queued on its compute stream: s (2C doubles
 * of device memory) gets each channel's sum of x and of x * x, or with dy (and mean, C floats)
 * of dy and of dy * (x - mean), in a fixed order; and out = (in - mean) a + b (+ k extra) with
 * coef = (mean, a, b, k), C floats each. The CPU's ops walk their own layouts instead. */
td_status td__device_channel_sums(td_device d, const float *x, const float *dy, const float *mean,
                                  int64_t N, int64_t C, int64_t S, double *s, const char *what);
td_status td__device_channel_affine(td_device d, float *out, const float *in, const float *coef,
                                    const float *extra, int64_t N, int64_t C, int64_t S,
                                    const char *what);

/* Where ptr points: a GPU this process has used through tandem (its memory, whoever allocated
 * it), or the CPU. Asks CUDA only once a GPU is in use, so host-only programs never start it. */
td_device td__device_of_pointer(const void *ptr);

/* The UUID of GPU d, the same in every process (CUDA_VISIBLE_DEVICES numbers GPUs per
 * process). */
td_status td__device_uuid(td_device d, unsigned char uuid[16], const char *what);

/* The tables a device library exports, one per layer (device_api.h). */
typedef enum {
    TD__DEVICE_RUNTIME, /* device_api.h's td__device_runtime */
    TD__DEVICE_BACKEND, /* the graph engine's: ops/backend.h's td__backend_library */
    TD__DEVICE_COMM,    /* the collectives': comm/gpu_comm_api.h's td__gpu_comm_api */
    TD__DEVICE_TABLES
} td__device_table;

/* The table `which` of the library behind device d (not the CPU), for the layer that owns its
 * type: opaque here, as the device layer knows nothing of graphs or process groups. Fails
 * naming `what`, d and why where d's type is unknown, its library, driver or devices are
 * missing, d does not exist, or the library lacks the table. */
td_status td__device_library(td_device d, td__device_table which, const char *what,
                             const void **out);

#endif
