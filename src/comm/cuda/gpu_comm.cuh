/* What the files of the GPU collectives share: their entries of gpu_comm_api.h's table (NCCL
 * in nccl.cu, CUDA IPC in ipc.cu; entry.cu exports the table). CUDA C++. Not installed. */
#ifndef TANDEM_GPU_COMM_CUH
#define TANDEM_GPU_COMM_CUH

#include <ctime>

#include "comm/gpu_comm_api.h"
#include "device/cuda/runtime.cuh"

/* Seconds on the monotonic clock, for the calls' timeouts. */
static inline double td__now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

td_status td__nccl_unique_id(unsigned char id[128]);
td_status td__nccl_create(int device, void *compute, int nranks, int rank,
                          const unsigned char id[128], double timeout_s, td__nccl **out);
td_status td__nccl_split(td__nccl *parent, int color, int key, double timeout_s, td__nccl **out);
td_status td__nccl_run(td__nccl *c, const td__nccl_call *k, double timeout_s, const char *what);
void td__nccl_abort(td__nccl *c);
void td__nccl_destroy(td__nccl *c);

td_status td__ipc_create(int device, void *compute, int rank, int size, size_t bytes, td__ipc **out,
                         unsigned char *handle);
td_status td__ipc_connect(td__ipc *c, const unsigned char *handles);
td_status td__ipc_run(td__ipc *c, const td__nccl_call *k, td__host_barrier_fn barrier, void *arg,
                      double timeout_s, const char *what);
void td__ipc_destroy(td__ipc *c);

#endif
