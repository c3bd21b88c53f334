/* libtandem_cuda.so's one exported symbol: takes the host's services and returns the table of
 * cuda_api.h: its runtime calls (src/device/cuda/runtime.cu), the multi-tensor kernels
 * (src/optim/cuda/multi_tensor.cu), the per-channel kernels (src/device/cuda/channels.cu) and
 * the GPU graph backend. */
#include "ops/cuda/cuda_ops.cuh"

static const td__cuda_api api = {
    .abi = TD__CUDA_ABI,
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
    .backend = &td__backend_cuda,
    .tensor_size = sizeof(td_tensor),
    .node_size = sizeof(td__node),
    .op_ctx_size = sizeof(td__op_ctx),
};

extern "C" __attribute__((visibility("default"))) const td__cuda_api *
td_cuda_entry(const td__cuda_host *h) {
    if (h && h->abi == TD__CUDA_ABI) td__host = h; /* else the host compares ABIs and says so */
    return &api;
}
