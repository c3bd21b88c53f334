/* libtandem_cuda.so's CUDA runtime calls: devices, streams, events and memory (the entries of
 * device_api.h's runtime table that are not kernels). Every call sets its device first (the
 * current device is per thread in CUDA) and turns a CUDA error into the host's td_status
 * naming the call and CUDA's own message. Kernels live beside the ops (src/ops/cuda/). */
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include "device/cuda/runtime.cuh"

const td__device_host *td__host;

td_status td__cu_device_count(int *count, char *why, size_t n) {
    *count = 0;
    cudaError_t e = cudaGetDeviceCount(count);
    void *driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!driver) {
        snprintf(why, n, "no NVIDIA driver on this machine (%s)", dlerror());
        *count = 0;
        cudaGetLastError();
    } else if (e != cudaSuccess) {
        snprintf(why, n, "cudaGetDeviceCount: %s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        *count = 0;
        cudaGetLastError();
    } else if (*count == 0) {
        snprintf(why, n, "the NVIDIA driver sees no GPU (CUDA_VISIBLE_DEVICES=%s)",
                 getenv("CUDA_VISIBLE_DEVICES") ? getenv("CUDA_VISIBLE_DEVICES") : "unset");
    }
    if (driver) dlclose(driver);
    return TD_OK;
}

td_status td__cu_properties(int device, td_device_properties *out) {
    cudaDeviceProp p;
    TD__CU(cudaGetDeviceProperties(&p, device));
    snprintf(out->name, sizeof out->name, "%s", p.name);
    out->total_memory = p.totalGlobalMem;
    out->multiprocessors = p.multiProcessorCount;
    out->major = p.major;
    out->minor = p.minor;
    return TD_OK;
}

td_status td__cu_synchronize(int device) {
    TD__CU(cudaSetDevice(device));
    TD__CU(cudaDeviceSynchronize());
    return TD_OK;
}

td_status td__cu_stream_create(int device, void **stream) {
    TD__CU(cudaSetDevice(device));
    cudaStream_t s;
    TD__CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    *stream = s;
    return TD_OK;
}

td_status td__cu_stream_synchronize(int device, void *stream) {
    TD__CU(cudaSetDevice(device));
    TD__CU(cudaStreamSynchronize((cudaStream_t)stream));
    return TD_OK;
}

td_status td__cu_device_malloc(int device, size_t bytes, void **ptr) {
    TD__CU(cudaSetDevice(device));
    cudaError_t e = cudaMalloc(ptr, bytes);
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError(); /* not sticky: the caller empties its cache and asks again */
        return TD_ENOMEM;
    }
    TD__CU(e);
    return TD_OK;
}

/* A call whose failure nobody can act on leaves no error behind for the next launch check. */
static void forget(cudaError_t e) {
    if (e != cudaSuccess) cudaGetLastError();
}

void td__cu_device_free(int device, void *ptr) {
    forget(cudaSetDevice(device));
    forget(cudaFree(ptr));
}

td_status td__cu_event_record(int device, void *stream, void **event) {
    TD__CU(cudaSetDevice(device));
    cudaEvent_t e;
    TD__CU(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cudaError_t r = cudaEventRecord(e, (cudaStream_t)stream);
    if (r != cudaSuccess) cudaEventDestroy(e);
    TD__CU(r);
    *event = e;
    return TD_OK;
}

/* cudaEventQuery's "not ready" is kept as the last error, which the next launch check would
 * report: it is cleared here. */
int td__cu_event_done(void *event) {
    cudaError_t e = cudaEventQuery((cudaEvent_t)event);
    forget(e);
    return e == cudaSuccess;
}

void td__cu_event_destroy(void *event) { forget(cudaEventDestroy((cudaEvent_t)event)); }

td_status td__cu_memcpy_async(int device, void *dst, const void *src, size_t bytes, void *stream) {
    TD__CU(cudaSetDevice(device));
    TD__CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)stream));
    return TD_OK;
}

td_status td__cu_memset_async(int device, void *ptr, int value, size_t bytes, void *stream) {
    TD__CU(cudaSetDevice(device));
    TD__CU(cudaMemsetAsync(ptr, value, bytes, (cudaStream_t)stream));
    return TD_OK;
}

td_status td__cu_host_alloc(size_t bytes, void **ptr) {
    cudaError_t e = cudaHostAlloc(ptr, bytes ? bytes : 1, cudaHostAllocPortable);
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        return td__host->fail(TD_ENOMEM, "cudaHostAlloc: no page-locked memory for %zu bytes",
                              bytes);
    }
    TD__CU(e);
    return TD_OK;
}

void td__cu_host_free(void *ptr) { forget(cudaFreeHost(ptr)); }

td_status td__cu_event_wait(int device, void *stream, void *event) {
    TD__CU(cudaSetDevice(device));
    TD__CU(cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0));
    return TD_OK;
}

td_status td__cu_event_synchronize(void *event) {
    TD__CU(cudaEventSynchronize((cudaEvent_t)event));
    return TD_OK;
}

int td__cu_pointer_device(const void *ptr) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return a.type == cudaMemoryTypeDevice ? a.device : -1;
}

td_status td__cu_device_uuid(int device, unsigned char uuid[16]) {
    cudaDeviceProp p;
    TD__CU(cudaGetDeviceProperties(&p, device));
    memcpy(uuid, p.uuid.bytes, 16);
    return TD_OK;
}
