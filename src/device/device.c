/* The public device API (tandem/device.h): naming devices, finding this rank's device, and each
 * device's compute stream and caching allocator, made the first time the device is used. Work
 * on a device goes through the runtime table of its type's library (device_api.h, library.c):
 * nothing here names a type but the CPU. The table of devices is per process, as a driver's own
 * context is. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core_impl.h"
#include "device/caching_allocator.h"
#include "device/device_api.h"
#include "device/device_impl.h"

#define MAX_GPUS 64
#define MAX_TYPES 4 /* device types beside the CPU (td_device_type values 1..MAX_TYPES) */

typedef struct {
    td_device device;
    const td__device_runtime *rt; /* its type's runtime */
    int ready;
    void *stream; /* compute stream: copies and kernels of this process on this device */
    void *copy;   /* copy stream: uploads ahead of use (loaders), made on first use */
    td__caching_allocator alloc;
} gpu;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static gpu gpus[MAX_TYPES][MAX_GPUS];
static int gpus_used[MAX_TYPES]; /* some device of the type has its stream: its runtime runs */

td_device td_device_cpu(void) { return (td_device){TD_DEVICE_CPU, 0}; }

td_device td_device_cuda(int index) { return (td_device){TD_DEVICE_CUDA, index}; }

td_status td_device_parse(const char *text, td_device *out) {
    if (!text || !out) return td__fail(TD_EINVAL, "td_device_parse: NULL argument");
    if (strcmp(text, "cpu") == 0) {
        *out = td_device_cpu();
        return TD_OK;
    }
    char name[16];
    size_t len = strcspn(text, ":");
    td_device_type type;
    if (len < sizeof name) {
        memcpy(name, text, len);
        name[len] = 0;
        if (td__device_type_parse(name, &type)) {
            const char *at = text + len;
            if (!*at) {
                *out = (td_device){type, 0};
                return TD_OK;
            }
            char *end;
            long i = at[1] >= '0' && at[1] <= '9' ? strtol(at + 1, &end, 10) : -1;
            if (i >= 0 && *end == 0 && i < MAX_GPUS) {
                *out = (td_device){type, (int)i};
                return TD_OK;
            }
        }
    }
    return td__fail(TD_EINVAL, "device '%s': expected cpu, cuda or cuda:N (N from 0 to %d)", text,
                    MAX_GPUS - 1);
}

void td_device_format(td_device d, char *buf, size_t n) {
    const char *name = td__device_type_name(d.type);
    if (name)
        snprintf(buf, n, "%s:%d", name, d.index);
    else
        snprintf(buf, n, "cpu");
}

/* Device LOCAL_RANK of the type, which has n devices here (one rank per device). */
static td_status local_of(td_device_type type, int n, const char *what, td_device *out) {
    const char *lr = getenv("LOCAL_RANK");
    long r = 0;
    if (lr && *lr) {
        char *end;
        r = strtol(lr, &end, 10);
        if (*end || r < 0)
            return td__fail(TD_EINVAL, "%s: LOCAL_RANK='%s' is not a rank", what, lr);
    }
    if (r >= n) {
        const char *env = td__device_type_visible(type), *vis = getenv(env);
        return td__fail(TD_EINVAL,
                        "%s: LOCAL_RANK=%ld but %d %s device%s visible (%s=%s): one rank per "
                        "device",
                        what, r, n, td__device_type_name(type), n == 1 ? " is" : "s are", env,
                        vis ? vis : "unset");
    }
    *out = (td_device){type, (int)r};
    return TD_OK;
}

td_status td_device_local(td_device *out) {
    if (!out) return td__fail(TD_EINVAL, "td_device_local: out is NULL");
    for (int t = 1; t <= MAX_TYPES; t++) {
        int n = td__device_type_name((td_device_type)t) ? td__device_count((td_device_type)t) : 0;
        if (n > 0) return local_of((td_device_type)t, n, "td_device_local", out);
    }
    *out = td_device_cpu();
    return TD_OK;
}

td_status td_device_choose(const char *text, td_device *out) {
    if (!out) return td__fail(TD_EINVAL, "td_device_choose: out is NULL");
    td_device d;
    TD__TRY(td_device_parse(text, &d));
    if (d.type == TD_DEVICE_CPU) {
        *out = d;
        return TD_OK;
    }
    int n = td__device_count(d.type);
    if (n == 0)
        return td__fail(TD_EUNSUPPORTED, "device '%s': no GPU can be used here: %s", text,
                        td__device_unavailable(d.type));
    if (!strchr(text, ':')) return local_of(d.type, n, "td_device_local", out);
    if (d.index >= n) {
        const char *env = td__device_type_visible(d.type), *vis = getenv(env);
        return td__fail(TD_EINVAL, "device '%s': %d %s device%s visible (%s=%s)", text, n,
                        td__device_type_name(d.type), n == 1 ? " is" : "s are", env,
                        vis ? vis : "unset");
    }
    *out = d;
    return TD_OK;
}

/* The raw memory of one device, for its caching allocator. */
static td_status raw_alloc(void *ctx, size_t bytes, void **ptr) {
    gpu *g = ctx;
    return g->rt->malloc(g->device.index, bytes, ptr);
}
static void raw_free(void *ctx, void *ptr) {
    gpu *g = ctx;
    g->rt->free(g->device.index, ptr);
}
static td_status raw_event(void *ctx, void *stream, void **event) {
    gpu *g = ctx;
    return g->rt->event_record(g->device.index, stream, event);
}
static int raw_done(void *ctx, void *event) { return ((gpu *)ctx)->rt->event_done(event); }
static void raw_event_destroy(void *ctx, void *event) { ((gpu *)ctx)->rt->event_destroy(event); }

/* Device d, its stream and allocator made on first use; errors name `what` and why. */
static td_status gpu_of(td_device d, const char *what, gpu **out) {
    char name[32];
    td_device_format(d, name, sizeof name);
    if (d.type == TD_DEVICE_CPU) return td__fail(TD_EINVAL, "%s: %s is not a GPU", what, name);
    const void *rt;
    TD__TRY(td__device_library(d, TD__DEVICE_RUNTIME, what, &rt));
    if (d.index >= MAX_GPUS || (int)d.type > MAX_TYPES)
        return td__fail(TD_EUNSUPPORTED, "%s: %s: tandem drives at most %d devices a process", what,
                        name, MAX_GPUS);
    gpu *g = &gpus[d.type - 1][d.index];
    td_status s = TD_OK;
    pthread_mutex_lock(&lock);
    if (!g->ready) {
        g->device = d;
        g->rt = rt;
        s = g->rt->stream_create(d.index, &g->stream);
        if (s == TD_OK) {
            td__raw_memory raw = {g, raw_alloc, raw_free, raw_event, raw_done, raw_event_destroy};
            td__allocator_init(&g->alloc, name, raw);
            g->ready = 1;
            gpus_used[d.type - 1] = 1;
        }
    }
    pthread_mutex_unlock(&lock);
    *out = g;
    return s;
}

td_status td__device_stream(td_device d, void **stream) {
    gpu *g;
    TD__TRY(gpu_of(d, "stream", &g));
    *stream = g->stream;
    return TD_OK;
}

td_status td_device_get_properties(td_device d, td_device_properties *out) {
    if (!out) return td__fail(TD_EINVAL, "td_device_get_properties: out is NULL");
    memset(out, 0, sizeof *out);
    if (d.type == TD_DEVICE_CPU) {
        FILE *f = fopen("/proc/cpuinfo", "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) {
            char *colon = strchr(line, ':');
            if (strncmp(line, "model name", 10) == 0 && colon) {
                snprintf(out->name, sizeof out->name, "%s", colon + 2);
                out->name[strcspn(out->name, "\n")] = 0;
                break;
            }
        }
        if (f) fclose(f);
        out->total_memory = (size_t)sysconf(_SC_PHYS_PAGES) * (size_t)sysconf(_SC_PAGESIZE);
        out->multiprocessors = (int)sysconf(_SC_NPROCESSORS_ONLN);
        return TD_OK;
    }
    gpu *g;
    TD__TRY(gpu_of(d, "td_device_get_properties", &g));
    return g->rt->properties(g->device.index, out);
}

td_status td_device_synchronize(td_device d) {
    if (d.type == TD_DEVICE_CPU) return TD_OK;
    gpu *g;
    TD__TRY(gpu_of(d, "td_device_synchronize", &g));
    return g->rt->synchronize(g->device.index);
}

td_status td_device_memory(td_device d, td_device_memory_stats *out) {
    if (!out) return td__fail(TD_EINVAL, "td_device_memory: out is NULL");
    gpu *g;
    TD__TRY(gpu_of(d, "td_device_memory", &g));
    *out = td__allocator_stats(&g->alloc);
    return TD_OK;
}

td_status td_device_alloc(td_device d, size_t bytes, void **out) {
    if (!out) return td__fail(TD_EINVAL, "td_device_alloc: out is NULL");
    if (d.type == TD_DEVICE_CPU) {
        *out = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        return *out ? TD_OK : td__fail(TD_ENOMEM, "td_device_alloc: cpu: %zu bytes", bytes);
    }
    gpu *g;
    TD__TRY(gpu_of(d, "td_device_alloc", &g));
    return td__allocator_alloc(&g->alloc, bytes, g->stream, out);
}

td_status td_device_free(td_device d, void *ptr) {
    if (d.type == TD_DEVICE_CPU) {
        free(ptr);
        return TD_OK;
    }
    gpu *g;
    TD__TRY(gpu_of(d, "td_device_free", &g));
    return td__allocator_free(&g->alloc, ptr);
}

td_status td_device_empty_cache(td_device d) {
    if (d.type == TD_DEVICE_CPU) return TD_OK;
    gpu *g;
    TD__TRY(gpu_of(d, "td_device_empty_cache", &g));
    td__allocator_empty_cache(&g->alloc);
    return TD_OK;
}

td_status td_device_copy(td_device dst_device, void *dst, td_device src_device, const void *src,
                         size_t bytes) {
    if ((!dst || !src) && bytes) return td__fail(TD_EINVAL, "td_device_copy: NULL buffer");
    if (dst_device.type == TD_DEVICE_CPU && src_device.type == TD_DEVICE_CPU) {
        if (bytes) memcpy(dst, src, bytes);
        return TD_OK;
    }
    gpu *g;
    TD__TRY(
        gpu_of(dst_device.type != TD_DEVICE_CPU ? dst_device : src_device, "td_device_copy", &g));
    if (dst_device.type != TD_DEVICE_CPU && src_device.type != TD_DEVICE_CPU) {
        gpu *other;
        TD__TRY(gpu_of(src_device, "td_device_copy", &other));
    }
    TD__TRY(g->rt->memcpy_async(g->device.index, dst, src, bytes, g->stream));
    return g->rt->stream_synchronize(g->device.index, g->stream);
}

td_status td__device_memset(td_device d, void *ptr, int value, size_t bytes, const char *what) {
    if (d.type == TD_DEVICE_CPU) {
        if (bytes) memset(ptr, value, bytes);
        return TD_OK;
    }
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->memset_async(g->device.index, ptr, value, bytes, g->stream);
}

td_status td__device_multi_tensor(td_device d, const td__mt_args *args, td__mt_tensor *list,
                                  size_t n, void **scratch, size_t *scratch_bytes, double *result,
                                  const char *what) {
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->multi_tensor(g->device, g->stream, args, list, n, scratch, scratch_bytes, result);
}

td_status td__device_streams(td_device d, void **compute, void **copy, const char *what) {
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    td_status s = TD_OK;
    pthread_mutex_lock(&lock);
    if (!g->copy) s = g->rt->stream_create(g->device.index, &g->copy);
    pthread_mutex_unlock(&lock);
    *compute = g->stream;
    *copy = g->copy;
    return s;
}

td_status td__device_host_alloc(td_device d, size_t bytes, void **out, const char *what) {
    if (d.type == TD_DEVICE_CPU) {
        *out = malloc(bytes ? bytes : 1);
        return *out ? TD_OK : td__fail(TD_ENOMEM, "%s: out of memory for %zu bytes", what, bytes);
    }
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->host_alloc(bytes, out);
}

void td__device_host_free(td_device d, void *ptr) {
    if (d.type == TD_DEVICE_CPU)
        free(ptr);
    else if (ptr)
        td__device_runtime_of(d.type)->host_free(ptr);
}

td_status td__device_copy_async(td_device d, void *dst, const void *src, size_t bytes, void *stream,
                                const char *what) {
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->memcpy_async(g->device.index, dst, src, bytes, stream);
}

td_status td__device_event_record(td_device d, void *stream, void **event, const char *what) {
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->event_record(g->device.index, stream, event);
}

td_status td__device_event_wait(td_device d, void *stream, void *event, const char *what) {
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->event_wait(g->device.index, stream, event);
}

td_status td__device_event_synchronize(td_device d, void *event) {
    return td__device_runtime_of(d.type)->event_synchronize(event);
}

void td__device_event_free(td_device d, void *event) {
    if (event) td__device_runtime_of(d.type)->event_destroy(event);
}

td_device td__device_of_pointer(const void *ptr) {
    for (int t = 0; t < MAX_TYPES && ptr; t++) {
        pthread_mutex_lock(&lock);
        int used = gpus_used[t];
        pthread_mutex_unlock(&lock);
        td_device_type type = (td_device_type)(t + 1);
        int d = used ? td__device_runtime_of(type)->pointer_device(ptr) : -1;
        if (d >= 0) return (td_device){type, d};
    }
    return td_device_cpu();
}

td_status td__device_uuid(td_device d, unsigned char uuid[16], const char *what) {
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->device_uuid(g->device.index, uuid);
}

td_status td__device_convert(td_device d, void *dst, td_dtype dst_dtype, const void *src,
                             td_dtype src_dtype, size_t n, const char *what) {
    if (d.type == TD_DEVICE_CPU) {
        td__convert(dst, dst_dtype, src, src_dtype, n);
        return TD_OK;
    }
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->convert_async(g->device.index, g->stream, dst, dst_dtype, src, src_dtype, n);
}

td_status td__device_channel_sums(td_device d, const float *x, const float *dy, const float *mean,
                                  int64_t N, int64_t C, int64_t S, double *s, const char *what) {
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->channel_sums(g->device.index, g->stream, x, dy, mean, N, C, S, s);
}

td_status td__device_channel_affine(td_device d, float *out, const float *in, const float *coef,
                                    const float *extra, int64_t N, int64_t C, int64_t S,
                                    const char *what) {
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->channel_affine(g->device.index, g->stream, out, in, coef, extra, N, C, S);
}

td_status td__device_fill(td_device d, void *ptr, uint32_t bits, int size, size_t n,
                          const char *what) {
    if (d.type == TD_DEVICE_CPU) {
        uint16_t half = (uint16_t)bits;
        for (size_t i = 0; i < n; i++)
            memcpy((unsigned char *)ptr + i * (size_t)size,
                   size == 2 ? (void *)&half : (void *)&bits, (size_t)size);
        return TD_OK;
    }
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->fill_async(g->device.index, g->stream, ptr, bits, size, n);
}

td_status td__device_upload(td_device d, void *dst, const void *host, size_t bytes,
                            const char *what) {
    if (d.type == TD_DEVICE_CPU) {
        if (bytes) memcpy(dst, host, bytes);
        return TD_OK;
    }
    gpu *g;
    TD__TRY(gpu_of(d, what, &g));
    return g->rt->memcpy_async(g->device.index, dst, host, bytes, g->stream);
}
