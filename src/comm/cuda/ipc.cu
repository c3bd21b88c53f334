/* Collectives between ranks that share one GPU, through CUDA IPC: NCCL refuses two ranks on
 * one device, and a one-GPU machine is where this project's multi-rank GPU tests run.
 *
 * Each rank owns a staging buffer and opens every peer's. A call runs in steps: each rank
 * writes what it contributes into its own staging buffer on its compute stream, waits (on the
 * host, up to the group's timeout) until its GPU has done so, and meets the others at a host
 * barrier; its kernels then read the peers' buffers. No stream ever waits for another
 * process's event: a rank killed between its record and its work would leave such a wait
 * pending for good, and the survivors' streams (and their teardown) with it, where a host
 * barrier turns the death into an error naming the rank. A rank whose own work fails still
 * takes the next step, carrying the error, so that every rank stops there with it. Reductions are
 * split by owner: rank r reduces part r of the data from every staging buffer in rank order into
 * its own buffer, and every rank then copies each part from its owner, so all ranks get the same
 * bits, the bits a fixed order gives. A last step keeps a rank from overwriting its staging buffer
 * while a peer still reads it. Data larger than the staging buffer goes through in pieces. */
#include <cstdlib>
#include <cstring>
#include <sched.h>

#include "comm/cuda/gpu_comm.cuh"
#include "comm/cuda/ipc.cuh"

struct td__ipc {
    int device, rank, size;
    cudaStream_t compute;
    char *staging; /* this rank's, `bytes` */
    size_t bytes;
    cudaEvent_t event;             /* this rank's work of the step, done */
    char *peer[TD__IPC_MAX_RANKS]; /* every rank's staging buffer (peer[rank] = staging) */
    int opened[TD__IPC_MAX_RANKS];
};

static td_status reduce(td__ipc *c, void *dst, size_t at, size_t n, const td__nccl_call *k,
                        const char *what) {
    td__ipc_peers src;
    for (int r = 0; r < c->size; r++) src.p[r] = c->peer[r];
    if (td__launch_ipc_reduce(c->compute, dst, src, c->size, at, n, k->dtype, k->op) != 0)
        return td__host->fail(TD_EDTYPE, "%s: dtype %d", what, (int)k->dtype);
    TD__CU(cudaGetLastError());
    return TD_OK;
}

/* A call's steps: st holds this rank's first failure, told says every rank has seen one. */
typedef struct {
    td__ipc *c;
    td__host_barrier_fn barrier;
    void *arg;
    double timeout_s;
    const char *what;
    td_status st;
    int told;
} steps;

/* This rank's GPU work so far, done: polled, as a wait on the event could outlast the
 * timeout. */
static td_status local_done(td__ipc *c, double timeout_s, const char *what) {
    TD__CU(cudaEventRecord(c->event, c->compute));
    double end = td__now_s() + timeout_s;
    cudaError_t e;
    for (long spins = 0; (e = cudaEventQuery(c->event)) == cudaErrorNotReady; spins++) {
        cudaGetLastError(); /* "not ready" is kept as the last error: the next launch check
                             * would report it */
        if (td__now_s() > end)
            return td__host->fail(TD_ETIMEOUT, "%s: this rank's GPU work not done after %.0f s",
                                  what, timeout_s);
        if (spins > 1000) sched_yield();
    }
    if (e != cudaSuccess) return td__host->fail(TD_EBACKEND, "%s: %s", what, cudaGetErrorString(e));
    return TD_OK;
}

/* One step boundary: this rank's work done (unless it failed already), then the ranks meet on
 * the host, this rank's failure going to every rank with the barrier. Nonzero when the call
 * stops, which every rank then does at this same step. */
static int step(steps *s) {
    if (s->st == TD_OK) s->st = local_done(s->c, s->timeout_s, s->what);
    td_status b = s->barrier(s->arg, s->st);
    if (s->st == TD_OK) s->st = b;
    s->told = s->st != TD_OK;
    return s->told;
}

/* A local operation of the call, skipped once this rank has failed. */
#define LOCAL(s, call)                        \
    do {                                      \
        if ((s).st == TD_OK) (s).st = (call); \
    } while (0)

static td_status copy(td__ipc *c, void *dst, const void *src, size_t bytes) {
    if (bytes) TD__CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->compute));
    return TD_OK;
}

td_status td__ipc_create(int device, void *compute, int rank, int size, size_t bytes, td__ipc **out,
                         unsigned char *handle) {
    *out = NULL;
    if (size > TD__IPC_MAX_RANKS || rank < 0 || rank >= size)
        return td__host->fail(TD_EINVAL, "cuda-ipc: rank %d of %d (at most %d ranks share a GPU)",
                              rank, size, TD__IPC_MAX_RANKS);
    td__ipc *c = (td__ipc *)calloc(1, sizeof *c);
    if (!c) return td__host->fail(TD_ENOMEM, "cuda-ipc: out of memory");
    c->device = device;
    c->rank = rank;
    c->size = size;
    c->compute = (cudaStream_t)compute;
    c->bytes = bytes;
    *out = c;
    /* cudaMalloc, not the caching allocator: an exported block must be its own allocation. */
    TD__CU(cudaSetDevice(device));
    TD__CU(cudaMalloc((void **)&c->staging, bytes));
    TD__CU(cudaEventCreateWithFlags(&c->event, cudaEventDisableTiming));
    cudaIpcMemHandle_t mh;
    TD__CU(cudaIpcGetMemHandle(&mh, c->staging));
    static_assert(sizeof mh <= TD__IPC_HANDLE_BYTES, "an IPC handle fits");
    memset(handle, 0, TD__IPC_HANDLE_BYTES);
    memcpy(handle, &mh, sizeof mh);
    return TD_OK;
}

td_status td__ipc_connect(td__ipc *c, const unsigned char *handles) {
    TD__CU(cudaSetDevice(c->device));
    for (int r = 0; r < c->size; r++) {
        if (r == c->rank) {
            c->peer[r] = c->staging;
            continue;
        }
        cudaIpcMemHandle_t mh;
        memcpy(&mh, handles + (size_t)r * TD__IPC_HANDLE_BYTES, sizeof mh);
        cudaError_t e =
            cudaIpcOpenMemHandle((void **)&c->peer[r], mh, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess)
            return td__host->fail(TD_EBACKEND, "cuda-ipc: rank %d cannot open rank %d's buffer: %s",
                                  c->rank, r, cudaGetErrorString(e));
        c->opened[r] = 1;
    }
    return TD_OK;
}

void td__ipc_destroy(td__ipc *c) {
    if (!c) return;
    cudaSetDevice(c->device);
    cudaStreamSynchronize(c->compute);
    for (int r = 0; r < c->size; r++) {
        if (r == c->rank) continue;
        if (c->opened[r]) cudaIpcCloseMemHandle(c->peer[r]);
    }
    if (c->event) cudaEventDestroy(c->event);
    if (c->staging) cudaFree(c->staging);
    free(c);
}

/* The part of n elements that rank r reduces: [lo, hi). */
static void part(size_t n, int size, int r, size_t *lo, size_t *hi) {
    *lo = n * (size_t)r / (size_t)size;
    *hi = n * (size_t)(r + 1) / (size_t)size;
}

td_status td__ipc_run(td__ipc *c, const td__nccl_call *k, td__host_barrier_fn barrier, void *arg,
                      double timeout_s, const char *what) {
    TD__CU(cudaSetDevice(c->device));
    const char *send = (const char *)k->send;
    char *recv = (char *)k->recv;
    size_t es = k->elem_size, n = k->count, size = (size_t)c->size;
    int me = c->rank;
    /* Per-rank blocks (allgather, gather, scatter, reduce_scatter, alltoall) go through the
     * staging buffer `size` blocks at a time; the others one piece of the whole at a time. */
    int blocked = k->kind == TD__NCCL_ALLGATHER || k->kind == TD__NCCL_GATHER ||
                  k->kind == TD__NCCL_SCATTER || k->kind == TD__NCCL_REDUCE_SCATTER ||
                  k->kind == TD__NCCL_ALLTOALL;
    size_t cap = c->bytes / es / (blocked ? size : 1); /* elements per piece (per block) */
    if (cap == 0) return td__host->fail(TD_EINVAL, "%s: staging buffer too small", what);
    if (k->kind == TD__NCCL_SEND || k->kind == TD__NCCL_RECV)
        return td__host->fail(TD_EINVAL, "%s: point-to-point does not go through cuda-ipc", what);
    steps s = {c, barrier, arg, timeout_s, what, TD_OK, 0};
    for (size_t at = 0; !s.told && at < n; at += cap) {
        size_t m = n - at < cap ? n - at : cap, lo, hi;
        switch (k->kind) {
        case TD__NCCL_ALLREDUCE:
        case TD__NCCL_REDUCE:
            /* in: the piece; each rank reduces its part into its own buffer; out: copies */
            LOCAL(s, copy(c, c->staging, send + at * es, m * es));
            if (step(&s)) break;
            part(m, c->size, me, &lo, &hi);
            LOCAL(s, reduce(c, c->staging + lo * es, lo, hi - lo, k, what));
            if (step(&s)) break;
            if (k->kind == TD__NCCL_ALLREDUCE || me == k->root)
                for (int r = 0; r < c->size; r++) {
                    part(m, c->size, r, &lo, &hi);
                    LOCAL(s, copy(c, recv + (at + lo) * es, c->peer[r] + lo * es, (hi - lo) * es));
                }
            break;
        case TD__NCCL_BROADCAST:
            if (me == k->root) LOCAL(s, copy(c, c->staging, send + at * es, m * es));
            if (step(&s)) break;
            LOCAL(s, copy(c, recv + at * es, c->peer[k->root], m * es));
            break;
        case TD__NCCL_ALLGATHER:
        case TD__NCCL_GATHER:
            /* The input is where send points, inside recv or not (comm.h): each piece is
             * staged before any rank writes recv. */
            LOCAL(s, copy(c, c->staging, send + at * es, m * es));
            if (step(&s)) break;
            if (k->kind == TD__NCCL_ALLGATHER || me == k->root)
                for (int r = 0; r < c->size; r++)
                    LOCAL(s, copy(c, recv + ((size_t)r * n + at) * es, c->peer[r], m * es));
            break;
        case TD__NCCL_SCATTER:
            if (me == k->root)
                for (int r = 0; r < c->size; r++)
                    LOCAL(s, copy(c, c->staging + (size_t)r * m * es,
                                  send + ((size_t)r * n + at) * es, m * es));
            if (step(&s)) break;
            LOCAL(s, copy(c, recv + at * es, c->peer[k->root] + (size_t)me * m * es, m * es));
            break;
        default: /* REDUCE_SCATTER, ALLTOALL */
            for (int r = 0; r < c->size; r++)
                LOCAL(s, copy(c, c->staging + (size_t)r * m * es, send + ((size_t)r * n + at) * es,
                              m * es));
            if (step(&s)) break;
            if (k->kind == TD__NCCL_REDUCE_SCATTER) {
                /* In place too the result lands at the front (comm.h): the input is staged. */
                LOCAL(s, reduce(c, recv + at * es, (size_t)me * m, m, k, what));
            } else {
                for (int r = 0; r < c->size; r++)
                    LOCAL(s, copy(c, recv + ((size_t)r * n + at) * es,
                                  c->peer[r] + (size_t)me * m * es, m * es));
            }
            break;
        }
        /* Nobody refills a staging buffer a peer still reads. */
        if (!s.told) step(&s);
    }
    return s.st;
}
