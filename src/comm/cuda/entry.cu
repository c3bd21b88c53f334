/* libtandem_cuda.so's collectives' table (gpu_comm_api.h), collectives on device memory for the
 * process-group layer (device/library.c names its entry). */
#include "comm/cuda/gpu_comm.cuh"

static const td__gpu_comm_api api = {
    .abi = TD__GPU_COMM_ABI,
    .unique_id = td__nccl_unique_id,
    .create = td__nccl_create,
    .split = td__nccl_split,
    .run = td__nccl_run,
    .abort = td__nccl_abort,
    .destroy = td__nccl_destroy,
    .ipc_create = td__ipc_create,
    .ipc_connect = td__ipc_connect,
    .ipc_run = td__ipc_run,
    .ipc_destroy = td__ipc_destroy,
};

extern "C" __attribute__((visibility("default"))) const td__gpu_comm_api *td_cuda_comm_entry(void) {
    return &api;
}
