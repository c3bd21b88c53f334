/* Devices: the CPU and CUDA GPUs, where memory lives and kernels run.
 *
 * A device is a small value ("cpu", "cuda:1"), numbered as CUDA numbers GPUs: within
 * CUDA_VISIBLE_DEVICES. The CUDA parts live in their own library, libtandem_cuda.so, loaded
 * the first time something asks for a GPU, so one build serves machines with and without
 * CUDA: where it, the driver or a GPU is missing, td_cuda_device_count() says 0 and
 * td_cuda_unavailable() says why. Device memory comes from a stream-ordered caching allocator
 * per device (blocks are cached and reused rather than freed; td_device_memory reports its
 * counters, as torch.cuda.memory_stats does). */
#ifndef TANDEM_DEVICE_H
#define TANDEM_DEVICE_H

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The CPU, and the index-th visible GPU. */
td_device td_device_cpu(void);
td_device td_device_cuda(int index);

/* Parses "cpu", "cuda" (cuda:0) or "cuda:N" as PyTorch spells them; TD_EINVAL names the text. */
td_status td_device_parse(const char *text, td_device *out);

/* Writes "cpu" or "cuda:N" into buf (n bytes, at least 16). */
void td_device_format(td_device d, char *buf, size_t n);

/* Visible GPUs: 0 (and TD_OK) where CUDA cannot be used here; td_cuda_unavailable says why. */
td_status td_cuda_device_count(int *count);

/* Why no GPU can be used here ("no NVIDIA driver: libcuda.so.1 not found", ...), or NULL when
 * one can. */
const char *td_cuda_unavailable(void);

/* The device of this rank, as torchrun's recipes pick it: cuda:LOCAL_RANK where GPUs are
 * visible (LOCAL_RANK unset: 0; an index past the visible GPUs is TD_EINVAL naming both),
 * the CPU where none are. */
td_status td_device_local(td_device *out);

/* A program's --device as PyTorch users write it: "cpu"; "cuda", this rank's GPU
 * (td_device_local's cuda:LOCAL_RANK); "cuda:N", that visible GPU. A GPU named where none can
 * be used is TD_EUNSUPPORTED saying why, one past the visible GPUs TD_EINVAL naming both. */
td_status td_device_choose(const char *text, td_device *out);

/* What a GPU is. */
typedef struct {
    char name[256];      /* "NVIDIA H100 80GB HBM3" */
    size_t total_memory; /* bytes */
    int multiprocessors; /* SMs */
    int major, minor;    /* compute capability */
} td_device_properties;

td_status td_device_get_properties(td_device d, td_device_properties *out);

/* Waits until all work queued on the device has finished. */
td_status td_device_synchronize(td_device d);

/* The caching allocator's counters for one device (bytes unless named otherwise). */
typedef struct {
    size_t reserved;      /* held from the driver: in use plus cached */
    size_t in_use;        /* handed out and not yet freed */
    size_t peak_in_use;   /* the most in_use has been */
    size_t peak_reserved; /* the most reserved has been */
    size_t allocations;   /* td_device_alloc calls served */
    size_t cache_hits;    /* of those, served from a cached block */
    size_t driver_allocs; /* blocks asked from the driver */
} td_device_memory_stats;

td_status td_device_memory(td_device d, td_device_memory_stats *out);

/* Device memory from the device's caching allocator (bytes rounded up to its size class),
 * ordered on the device's compute stream; free returns it to the cache. */
td_status td_device_alloc(td_device d, size_t bytes, void **out);
td_status td_device_free(td_device d, void *ptr);

/* Gives every cached block that no stream still uses back to the driver. */
td_status td_device_empty_cache(td_device d);

/* Copies bytes between host and device memory (either side may be the CPU), ordered on the
 * device's compute stream, and waits for the copy. */
td_status td_device_copy(td_device dst_device, void *dst, td_device src_device, const void *src,
                         size_t bytes);

#ifdef __cplusplus
}
#endif
#endif
