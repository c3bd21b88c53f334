/* The contract between libtandem and a device library (libtandem_cuda.so; a HIP or Metal one
 * would be another row of the device types, library.c), loaded at run time so that one build
 * serves machines with and without it. A library exports one table per layer, each returned by
 * an entry function its row names: the device runtime's (this header: devices, streams, memory,
 * events, and the kernels the device layer offers the layers above), the graph engine's backend
 * (ops/backend.h: td__backend_library) and the collectives on its memory (comm/gpu_comm_api.h).
 * The runtime's entry is called first and takes the host's services (errors go through the
 * host's td__fail, so messages reach td_last_error). Streams and events are the library's own
 * handles, opaque here. C, and included by the libraries' C++ side too. Not installed. */
#ifndef TANDEM_DEVICE_API_H
#define TANDEM_DEVICE_API_H

#include "tandem/device.h"

#include "device/multi_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever the runtime's or the host's table changes: a library of another version is
 * refused by name. */
#define TD__DEVICE_ABI 7

/* What the host lends a library. */
typedef struct {
    int abi;
    td_status (*fail)(td_status status, const char *fmt, ...);
    /* The device's caching allocator (td_device_alloc / td_device_free) and compute stream. */
    td_status (*alloc)(td_device device, size_t bytes, void **out);
    td_status (*free)(td_device device, void *ptr);
    td_status (*stream)(td_device device, void **stream);
} td__device_host;

/* A device runtime. Every call names the device (its index in the library's family) it runs on;
 * failures return the host's td__fail status naming the library's call and its own message. */
typedef struct {
    int abi;
    /* Visible devices; 0 with a reason in why (n bytes) where the driver or a device is
     * missing. */
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
    /* The device whose memory ptr is (the library's, ours or not), or -1 for host memory. */
    int (*pointer_device)(const void *ptr);
    /* A device's UUID, the same in every process whatever CUDA_VISIBLE_DEVICES numbers it. */
    td_status (*device_uuid)(int device, unsigned char uuid[16]);
    /* One multi-tensor launch (multi_tensor.h) over list[0..n) on device's stream. The list is
     * host memory the call rewrites (tensors without work dropped, chunk0 filled); *scratch is a
     * buffer of *scratch_bytes from the device's allocator that the call grows as it needs and
     * the caller frees (td_device_free). SQUARES and UNSCALE wait for their result. */
    td_status (*multi_tensor)(td_device device, void *stream, const td__mt_args *args,
                              td__mt_tensor *list, size_t n, void **scratch, size_t *scratch_bytes,
                              double *result);
    /* Per channel of an f32 (N, C, S) tensor on stream: s (2C doubles, device memory) gets
     * each channel's sum of x and of x * x, or with dy (and mean, C floats) of dy and of
     * dy * (x - mean); and out = (in - mean) a + b (+ k extra) with coef = (mean, a, b, k), C
     * floats each. */
    td_status (*channel_sums)(int device, void *stream, const float *x, const float *dy,
                              const float *mean, int64_t N, int64_t C, int64_t S, double *s);
    td_status (*channel_affine)(int device, void *stream, float *out, const float *in,
                                const float *coef, const float *extra, int64_t N, int64_t C,
                                int64_t S);
} td__device_runtime;

typedef const td__device_runtime *(*td__device_runtime_entry)(const td__device_host *host);

/* ---- the host's side (library.c, device.c) ---- */

/* The compute stream of device d (made with its allocator on first use; device.c). */
td_status td__device_stream(td_device d, void **stream);

/* The device type spelt `name` ("cuda"): 1 and *out, or 0 when no device type is. */
int td__device_type_parse(const char *name, td_device_type *out);

/* The name of a device type ("cuda"), or NULL for the CPU and types tandem does not know. */
const char *td__device_type_name(td_device_type type);

/* The variable that says which devices of the type a process sees ("CUDA_VISIBLE_DEVICES"). */
const char *td__device_type_visible(td_device_type type);

/* The runtime of a device type, its library loaded the first time (thread-safe); NULL where the
 * library cannot be loaded (td__device_unavailable says why). */
const td__device_runtime *td__device_runtime_of(td_device_type type);

/* Devices of the type that can be used here (0 when the library, the driver or a device is
 * missing), and why none can (NULL when some can). Asked once. */
int td__device_count(td_device_type type);
const char *td__device_unavailable(td_device_type type);

#ifdef __cplusplus
}
#endif
#endif
