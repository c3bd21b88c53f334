/* The contract between the process-group layer and the collectives on device memory in a device
 * library: in libtandem_cuda.so, NCCL between GPUs (src/comm/cuda/nccl.cu) and CUDA IPC between
 * ranks that share one GPU (src/comm/cuda/ipc.cu), which NCCL refuses. The library exports this
 * as its collectives' table (device/device_api.h), which the device layer resolves by device
 * knowing nothing of process groups. C, included by the CUDA side too. Not installed. */
#ifndef TANDEM_GPU_COMM_API_H
#define TANDEM_GPU_COMM_API_H

#include <stddef.h>

#include "tandem/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD__GPU_COMM_ABI 3

typedef enum {
    TD__NCCL_ALLREDUCE,
    TD__NCCL_REDUCE,
    TD__NCCL_BROADCAST,
    TD__NCCL_ALLGATHER,
    TD__NCCL_GATHER,
    TD__NCCL_SCATTER,
    TD__NCCL_REDUCE_SCATTER,
    TD__NCCL_ALLTOALL,
    TD__NCCL_SEND, /* to root */
    TD__NCCL_RECV, /* from root */
} td__nccl_kind;

/* One call on device buffers, as td_comm's API gives it: count is per rank for allgather,
 * gather, scatter, reduce_scatter and alltoall, the total otherwise; send == recv in place. */
typedef struct {
    td__nccl_kind kind;
    const void *send;
    void *recv;
    size_t count, elem_size;
    td_dtype dtype;
    td_reduce_op op;
    int root; /* rooted collectives; the peer of send and recv */
    int rank, size;
} td__nccl_call;

typedef struct td__nccl td__nccl;
typedef struct td__ipc td__ipc;

/* What an IPC rank publishes for its peers: its staging buffer's handle. */
#define TD__IPC_HANDLE_BYTES 128
/* Ranks an IPC group may have (kernels take the peers' buffers by value). */
#define TD__IPC_MAX_RANKS 8

/* A host barrier of the group, which orders the ranks' steps (ipc_run calls it); a rank that
 * failed passes its error, which every rank's barrier then returns. */
typedef td_status (*td__host_barrier_fn)(void *arg, td_status error);

typedef struct {
    int abi;
    /* A new communicator's id, made by one rank and passed to the others. */
    td_status (*unique_id)(unsigned char id[128]);
    /* Collective over the nranks: a communicator on GPU `device` whose calls follow `compute`
     * (the device's compute stream). */
    td_status (*create)(int device, void *compute, int nranks, int rank,
                        const unsigned char id[128], double timeout_s, td__nccl **out);
    /* ncclCommSplit; a negative colour gives *out = NULL. Collective. */
    td_status (*split)(td__nccl *parent, int color, int key, double timeout_s, td__nccl **out);
    /* Runs one call to completion (after what the compute stream queued before it, and before
     * what it queues next); past timeout_s, or when a peer failed, the communicator is aborted
     * and the call fails naming `what`. */
    td_status (*run)(td__nccl *c, const td__nccl_call *call, double timeout_s, const char *what);
    void (*abort)(td__nccl *c);
    void (*destroy)(td__nccl *c);

    /* CUDA IPC, in two steps: create makes this rank's staging buffer of `bytes` on `device`
     * and the handles its peers need (handle, TD__IPC_HANDLE_BYTES); connect opens every
     * rank's (size of them, in rank order). */
    td_status (*ipc_create)(int device, void *compute, int rank, int size, size_t bytes,
                            td__ipc **out, unsigned char *handle);
    td_status (*ipc_connect)(td__ipc *c, const unsigned char *handles);
    /* Runs one call through the peers' staging buffers, in steps separated by barrier(arg)
     * (every rank of the group must make the same call), each after this rank's GPU work of the
     * step is done (waited for up to timeout_s); reductions add in rank order, so every rank
     * gets the same bits. */
    td_status (*ipc_run)(td__ipc *c, const td__nccl_call *call, td__host_barrier_fn barrier,
                         void *arg, double timeout_s, const char *what);
    void (*ipc_destroy)(td__ipc *c);
} td__gpu_comm_api;

typedef const td__gpu_comm_api *(*td__gpu_comm_entry_fn)(void);

#ifdef __cplusplus
}
#endif
#endif
