/* The contract between libtandem and libtandem_cuda.so, which is loaded at run time
 * (cuda_loader.c) so that one build serves machines with and without CUDA. The library
 * exports one function, TD__CUDA_ENTRY: it takes the host's services (errors go through the
 * host's td__fail, so messages reach td_last_error) and returns the table of what it does.
 * Pointers to streams and events are the CUDA runtime's own handles, opaque here. C, and
 * included by the CUDA C++ side too. Not installed. */
#ifndef TANDEM_CUDA_API_H
#define TANDEM_CUDA_API_H

#include "tandem/device.h"

#include "device/multi_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever either table changes: a library of another version is refused by name. */
#define TD__CUDA_ABI 6
#define TD__CUDA_ENTRY "td_cuda_entry"

/* What the host lends the library. */
typedef struct {
    int abi;
    td_status (*fail)(td_status status, const char *fmt, ...);
    /* The device's caching allocator (td_device_alloc / td_device_free) and compute stream. */
    td_status (*alloc)(td_device device, size_t bytes, void **out);
    td_status (*free)(td_device device, void *ptr);
    td_status (*stream)(td_device device, void **stream);
} td__cuda_host;

/* What the library does. Every call names the device it runs on; failures return the
 * host's td__fail status naming the CUDA call and CUDA's own message. */
typedef struct {
    int abi;
    /* Visible GPUs; 0 with a reason in why (n bytes) where the driver or a GPU is missing. */
    td_status (*device_count)(int *count, char *why, size_t n);
    td_status (*properties)(int device, td_device_properties *out);
    td_status (*synchronize)(int device);
    td_status (*stream_create)(int device, void **stream);
    td_status (*stream_synchronize)(int device, void *stream);
    /* Device memory straight from the driver: TD_ENOMEM (nothing logged) when it has none. */
    td_status (*malloc)(int device, size_t bytes, void **ptr);
    void (*free)(int device, void *ptr);
    /* An event recorded on stream now; done says 1 once the stream has passed it. */
    td_status (*event_record)(int device, void *stream, void **event);
    int (*event_done)(void *event);
    void (*event_destroy)(void *event);
    /* Any direction (unified addressing), queued on stream. */
    td_status (*memcpy_async)(int device, void *dst, const void *src, size_t bytes, void *stream);
    td_status (*memset_async)(int device, void *ptr, int value, size_t bytes, void *stream);
    /* Page-locked host memory (fast, truly asynchronous copies), and its release. */
    td_status (*host_alloc)(size_t bytes, void **ptr);
    void (*host_free)(void *ptr);
    /* Work queued on stream after this waits until the stream of `event` has passed it. */
    td_status (*event_wait)(int device, void *stream, void *event);
    /* Blocks the calling thread until the stream has passed the event. */
    td_status (*event_synchronize)(void *event);
    /* n elements from one dtype to another, and n elements of `size` (2 or 4) bytes set to
     * `bits`, queued on stream. */
    td_status (*convert_async)(int device, void *stream, void *dst, td_dtype dst_dtype,
                               const void *src, td_dtype src_dtype, size_t n);
    td_status (*fill_async)(int device, void *stream, void *ptr, uint32_t bits, int size, size_t n);
    /* The GPU whose memory ptr is (cudaMalloc'd, ours or not), or -1 for host memory. */
    int (*pointer_device)(const void *ptr);
    /* A GPU's UUID, the same in every process whatever CUDA_VISIBLE_DEVICES numbers it. */
    td_status (*device_uuid)(int device, unsigned char uuid[16]);
    /* One multi-tensor launch (multi_tensor.h) over list[0..n) on stream. The list is host
     * memory the call rewrites (tensors without work dropped, chunk0 filled); *scratch is a
     * device buffer of *scratch_bytes from the device's allocator that the call grows as it
     * needs and the caller frees (td_device_free). SQUARES and UNSCALE wait for their result. */
    td_status (*multi_tensor)(int device, void *stream, const td__mt_args *args,
                              td__mt_tensor *list, size_t n, void **scratch, size_t *scratch_bytes,
                              double *result);
    /* Per channel of an f32 (N, C, S) tensor on stream: s (2C doubles, device memory) gets
     * each channel's sum of x and of x * x, or with dy (and mean, C floats) of dy and of
     * dy * (x - mean); and out = (in - mean) a + b (+ k extra) with coef = (mean, a, b, k), C
     * floats each (channels.cu). */
    td_status (*channel_sums)(int device, void *stream, const float *x, const float *dy,
                              const float *mean, int64_t N, int64_t C, int64_t S, double *s);
    td_status (*channel_affine)(int device, void *stream, float *out, const float *in,
                                const float *coef, const float *extra, int64_t N, int64_t C,
                                int64_t S);
    /* The graph engine's backend on a GPU (its kernels are in src/ops/cuda/), and the sizes of
     * the engine's private structs it was compiled with (td_tensor, td__node, td__op_ctx), so
     * that a library built from other sources is refused, not trusted. */
    const struct td__backend *backend;
    size_t tensor_size, node_size, op_ctx_size;
} td__cuda_api;

typedef const td__cuda_api *(*td__cuda_entry_fn)(const td__cuda_host *host);

/* The compute stream of GPU d (made with its allocator on first use; device.c). */
td_status td__device_stream(td_device d, void **stream);

/* The loaded library's table, or NULL; the first call loads it (thread-safe). */
const td__cuda_api *td__cuda(void);

/* Why td__cuda() is NULL or sees no GPU: the library, the driver or the devices, with what
 * was tried; NULL when GPUs can be used. */
const char *td__cuda_unavailable(void);

#ifdef __cplusplus
}
#endif
#endif
