/* libtandem_cuda.so's one exported symbol: takes the host's services and returns the table of
 * cuda_api.h: its runtime calls (src/device/cuda/runtime.cu), the multi-tensor kernels
 * (src/optim/cuda/multi_tensor.cu) and the GPU graph backend. */
#include "ops/cuda/cuda_ops.cuh"

static const td__cuda_api api = {
    TD__CUDA_ABI,         td__cu_device_count,       td__cu_properties,    td__cu_synchronize,
    td__cu_stream_create, td__cu_stream_synchronize, td__cu_device_malloc, td__cu_device_free,
    td__cu_event_record,  td__cu_event_done,         td__cu_event_destroy, td__cu_memcpy_async,
    td__cu_memset_async,  td__cu_multi_tensor,       &td__backend_cuda,    sizeof(td_tensor),
    sizeof(td__node),     sizeof(td__op_ctx),
};

extern "C" __attribute__((visibility("default"))) const td__cuda_api *
td_cuda_entry(const td__cuda_host *h) {
    if (h && h->abi == TD__CUDA_ABI) td__host = h; /* else the host compares ABIs and says so */
    return &api;
}
