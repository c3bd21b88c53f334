/* The memory td_ddp keeps gradients in, on the parameters' device: on the CPU one block from
 * td_comm_alloc (the backend reaches it without staging copies) and plain loops; on a GPU
 * device memory from its caching allocator and work queued on its compute stream, which the
 * collectives on device memory follow (comm/gpu_path.c). Reading an element back waits. */
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "device/device_impl.h"
#include "parallel/ddp_impl.h"

static int on_gpu(const td_ddp *d) { return d->device.type != TD_DEVICE_CPU; }

td_status td__ddp_device(const td_param *params, size_t n_params, const td_param *buffers,
                         size_t n_buffers, td_device *out) {
    td_device on = n_params ? params[0].device : n_buffers ? buffers[0].device : td_device_cpu();
    for (size_t i = 0; i < n_params + n_buffers; i++) {
        const td_param *t = i < n_params ? &params[i] : &buffers[i - n_params];
        if (t->device.type != on.type || t->device.index != on.index) {
            char a[32], b[32];
            td_device_format(t->device, a, sizeof a);
            td_device_format(on, b, sizeof b);
            return td__fail(TD_EINVAL,
                            "td_ddp_create: %s is on %s, the first tensor on %s: one "
                            "device",
                            t->name ? t->name : "a tensor", a, b);
        }
    }
    *out = on;
    return TD_OK;
}

td_status td__ddp_mem_alloc(td_ddp *d, size_t bytes, void **out) {
    *out = NULL;
    if (!on_gpu(d)) {
        TD__TRY(td_comm_alloc(d->comm, bytes, out));
        memset(*out, 0, bytes);
        return TD_OK;
    }
    TD__TRY(td_device_alloc(d->device, bytes ? bytes : 1, out));
    return td__device_memset(d->device, *out, 0, bytes, "ddp");
}

td_status td__ddp_mem_scratch(td_ddp *d, size_t bytes, void **out) {
    if (on_gpu(d)) return td_device_alloc(d->device, bytes ? bytes : 1, out);
    *out = malloc(bytes ? bytes : 1);
    return *out ? TD_OK
                : td__fail(TD_ENOMEM, "ddp rank %d: no memory for %zu bytes", d->rank, bytes);
}

void td__ddp_mem_scratch_free(td_ddp *d, void *p) {
    if (on_gpu(d))
        td_device_free(d->device, p);
    else
        free(p);
}

void td__ddp_mem_free(td_ddp *d, void *p) {
    if (!p) return;
    if (on_gpu(d))
        td_device_free(d->device, p);
    else
        td_comm_free(d->comm, p);
}

td_status td__ddp_mem_zero(td_ddp *d, void *p, size_t bytes) {
    return td__device_memset(d->device, p, 0, bytes, "ddp");
}

td_status td__ddp_mem_copy(td_ddp *d, void *dst, const void *src, size_t bytes) {
    if (!on_gpu(d)) {
        if (bytes) memcpy(dst, src, bytes);
        return TD_OK;
    }
    return td_device_copy(d->device, dst, d->device, src, bytes);
}

td_status td__ddp_mem_convert(td_ddp *d, void *dst, td_dtype dt, const void *src, td_dtype st,
                              size_t n) {
    return td__device_convert(d->device, dst, dt, src, st, n, "ddp");
}

td_status td__ddp_mem_put(td_ddp *d, void *p, td_dtype dt, size_t i, double v) {
    unsigned char e[8];
    td__store(e, dt, 0, (float)v);
    size_t es = td_dtype_size(dt);
    return td__device_upload(d->device, (unsigned char *)p + i * es, e, es, "ddp");
}

double td__ddp_mem_get(td_ddp *d, const void *p, td_dtype dt, size_t i) {
    unsigned char e[8];
    size_t es = td_dtype_size(dt);
    if (td_device_copy(td_device_cpu(), e, d->device, (const unsigned char *)p + i * es, es) !=
        TD_OK)
        return 0; /* the device failed: the collectives report it */
    return td__load(e, dt, 0);
}

td_status td__ddp_mem_scale(td_ddp *d, void *p, td_dtype dt, size_t n, float w) {
    if (!on_gpu(d)) {
        for (size_t e = 0; e < n; e++) td__store(p, dt, e, td__load(p, dt, e) * w);
        return TD_OK;
    }
    td__mt_args a = {.op = TD__MT_SCALE, .factor = w};
    td__mt_tensor t = {.grad = p, .count = n, .dtype = (int32_t)dt};
    void *scratch = NULL;
    size_t bytes = 0;
    td_status s = td__device_multi_tensor(d->device, &a, &t, 1, &scratch, &bytes, NULL, "ddp");
    if (scratch) td_device_free(d->device, scratch);
    return s;
}

td_status td__ddp_mem_fill(td_ddp *d, void *p, uint32_t bits, int size, size_t n) {
    return td__device_fill(d->device, p, bits, size, n, "ddp");
}

int td__ddp_mem_holds(td_ddp *d, const void *p, uint32_t bits, int size, size_t n) {
    const unsigned char *h = p;
    unsigned char *copy = NULL;
    if (on_gpu(d)) {
        copy = malloc(n * (size_t)size + 1);
        if (!copy || td_device_copy(td_device_cpu(), copy, d->device, p, n * (size_t)size)) {
            free(copy);
            return 1; /* nothing to compare with: assume untouched */
        }
        h = copy;
    }
    uint16_t half = (uint16_t)bits;
    const void *want = size == 2 ? (const void *)&half : (const void *)&bits;
    int same = 1;
    for (size_t k = 0; same && k < n; k++) same = !memcmp(h + k * (size_t)size, want, (size_t)size);
    free(copy);
    return same;
}
