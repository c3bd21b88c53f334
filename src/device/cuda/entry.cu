/* libtandem_cuda.so's runtime entry (device_api.h), the first of its tables the host asks for:
 * takes the host's services and returns the device runtime: its calls (runtime.cu), its element
 * kernels (elements.cu), the multi-tensor kernels (multi_tensor.cu) and the per-channel kernels
 * (channels.cu). The graph engine's table is ops/cuda/backend.cu's, the collectives'
 * comm/cuda/entry.cu's. */
#include "device/cuda/runtime.cuh"

static const td__device_runtime runtime = {
    .abi = TD__DEVICE_ABI,
    .device_count = td__cu_device_count,
    .properties = td__cu_properties,
    .synchronize = td__cu_synchronize,
    .stream_create = td__cu_stream_create,
    .stream_synchronize = td__cu_stream_synchronize,
    .malloc = td__cu_device_malloc,
    .free = td__cu_device_free,
    .event_record = td__cu_event_record,
    .event_done = td__cu_event_done,
    .event_destroy = td__cu_event_destroy,
    .memcpy_async = td__cu_memcpy_async,
    .memset_async = td__cu_memset_async,
    .host_alloc = td__cu_host_alloc,
    .host_free = td__cu_host_free,
    .event_wait = td__cu_event_wait,
    .event_synchronize = td__cu_event_synchronize,
    .convert_async = td__cu_convert_async,
    .fill_async = td__cu_fill_async,
    .pointer_device = td__cu_pointer_device,
    .device_uuid = td__cu_device_uuid,
    .multi_tensor = td__cu_multi_tensor,
    .channel_sums = td__cu_channel_sums,
    .channel_affine = td__cu_channel_affine,
};

extern "C" __attribute__((visibility("default"))) const td__device_runtime *
td_cuda_entry(const td__device_host *h) {
    if (h && h->abi == TD__DEVICE_ABI) td__host = h; /* else the host compares ABIs and says so */
    return &runtime;
}
