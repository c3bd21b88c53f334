/* NCCL for collectives on device memory (gpu_comm_api.h's entries): one communicator per
 * process group, created from a unique id the group passes through its own host path, with
 * its own stream. A collective waits for what the device's compute stream has queued (an
 * event), runs on the communicator's stream, and is waited for by polling, so that a peer that
 * died or called something else ends in an error after the timeout (the communicator is then
 * aborted) instead of a hang: the communicators are non-blocking (config.blocking = 0) for
 * that reason. Errors name the call and NCCL's message. */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nccl.h>
#include <pthread.h>
#include <sched.h>

#include "comm/cuda/gpu_comm.cuh"
#include "comm/gpu_comm_api.h"
#include "device/cuda/runtime.cuh"

struct td__nccl {
    ncclComm_t comm;
    int device;
    cudaStream_t stream;     /* the communicator's */
    cudaStream_t compute;    /* the device's compute stream, which collectives follow */
    cudaEvent_t ready, done; /* compute stream passed the call; the collective finished */
    /* td_comm_abort may end the communicator from another thread while a call polls it. */
    pthread_mutex_t lock;
    int aborted;
    void *scratch; /* a send buffer copied aside (stage_send), on this device */
    size_t scratch_bytes;
};

#define TD__NCCL(call, what)                                                       \
    do {                                                                           \
        ncclResult_t td_n_ = (call);                                               \
        if (td_n_ != ncclSuccess && td_n_ != ncclInProgress)                       \
            return td__host->fail(TD_EBACKEND, "%s: %s failed: %s", (what), #call, \
                                  ncclGetErrorString(td_n_));                      \
    } while (0)

/* Polls until the communicator's pending call is set up (ncclInProgress clears) or, with
 * `event`, until the stream has also passed c->done; a failure the communicator reports, or
 * timeout_s passing, aborts it (so no rank hangs) and fails naming `what`. */
static td_status watch(td__nccl *c, double timeout_s, const char *what, int event) {
    double end = td__now_s() + timeout_s;
    for (long spins = 0;; spins++) {
        if (spins > 1000) sched_yield(); /* a peer's progress may need this core */
        ncclResult_t r;
        pthread_mutex_lock(&c->lock);
        if (c->aborted) {
            pthread_mutex_unlock(&c->lock);
            return td__host->fail(TD_EPEER, "%s: the NCCL communicator was aborted", what);
        }
        ncclResult_t q = ncclCommGetAsyncError(c->comm, &r);
        pthread_mutex_unlock(&c->lock);
        if (q != ncclSuccess) r = q;
        td_status st = TD_OK;
        char why[160] = "";
        if (r != ncclSuccess && r != ncclInProgress) {
            st = TD_EPEER;
            snprintf(why, sizeof why, "NCCL failed: %s", ncclGetErrorString(r));
        } else if (r == ncclSuccess) {
            cudaError_t e = event ? cudaEventQuery(c->done) : cudaSuccess;
            if (e == cudaSuccess) return TD_OK;
            if (e == cudaErrorNotReady) cudaGetLastError(); /* kept as the last error else */
            if (e != cudaErrorNotReady)
                return td__host->fail(TD_EBACKEND, "%s: %s", what, cudaGetErrorString(e));
        }
        if (st == TD_OK && td__now_s() > end) {
            st = TD_ETIMEOUT;
            snprintf(why, sizeof why,
                     "not finished after %.0f s (a peer died or called another collective)",
                     timeout_s);
        }
        if (st != TD_OK) {
            pthread_mutex_lock(&c->lock);
            if (!c->aborted) ncclCommAbort(c->comm);
            c->aborted = 1;
            pthread_mutex_unlock(&c->lock);
            return td__host->fail(st, "%s: %s; the NCCL communicator was aborted", what, why);
        }
    }
}

td_status td__nccl_unique_id(unsigned char id[128]) {
    ncclUniqueId u;
    TD__NCCL(ncclGetUniqueId(&u), "nccl");
    static_assert(sizeof u == 128, "an NCCL unique id is 128 bytes");
    memcpy(id, &u, sizeof u);
    return TD_OK;
}

static td_status make(td__nccl **out, int device, void *compute) {
    td__nccl *c = (td__nccl *)calloc(1, sizeof *c);
    if (!c) return td__host->fail(TD_ENOMEM, "nccl: out of memory");
    *out = c;
    pthread_mutex_init(&c->lock, NULL);
    c->device = device;
    c->compute = (cudaStream_t)compute;
    TD__CU(cudaSetDevice(device));
    TD__CU(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    TD__CU(cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming));
    TD__CU(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming));
    return TD_OK;
}

void td__nccl_destroy(td__nccl *c) {
    if (!c) return;
    cudaSetDevice(c->device);
    if (c->comm && !c->aborted) { /* ncclCommAbort freed an aborted one */
        /* A non-blocking communicator finalizes in the background: poll, for a while. */
        ncclResult_t r = ncclCommFinalize(c->comm), a = ncclInProgress;
        double end = td__now_s() + 10.0;
        while (r == ncclInProgress || (r == ncclSuccess && a == ncclInProgress)) {
            if (td__now_s() > end) break;
            r = ncclCommGetAsyncError(c->comm, &a);
            if (r == ncclSuccess && a != ncclInProgress) r = a;
        }
        if (r != ncclSuccess || a != ncclSuccess || ncclCommDestroy(c->comm) != ncclSuccess)
            ncclCommAbort(c->comm);
    }
    if (c->scratch) cudaFree(c->scratch);
    if (c->ready) cudaEventDestroy(c->ready);
    if (c->done) cudaEventDestroy(c->done);
    if (c->stream) cudaStreamDestroy(c->stream);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

td_status td__nccl_create(int device, void *compute, int nranks, int rank,
                          const unsigned char id[128], double timeout_s, td__nccl **out) {
    *out = NULL;
    td__nccl *c = NULL;
    td_status st = make(&c, device, compute);
    if (st == TD_OK) {
        ncclUniqueId u;
        memcpy(&u, id, sizeof u);
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        ncclResult_t r = ncclCommInitRankConfig(&c->comm, nranks, u, rank, &config);
        if (r != ncclSuccess && r != ncclInProgress)
            st = td__host->fail(TD_EBACKEND, "nccl: rank %d of %d: ncclCommInitRankConfig: %s",
                                rank, nranks, ncclGetErrorString(r));
        else
            st = watch(c, timeout_s, "nccl: creating the communicator", 0);
    }
    if (st != TD_OK) {
        td__nccl_destroy(c);
        return st;
    }
    *out = c;
    return TD_OK;
}

td_status td__nccl_split(td__nccl *parent, int color, int key, double timeout_s, td__nccl **out) {
    *out = NULL;
    td__nccl *c = NULL;
    td_status st = make(&c, parent->device, parent->compute);
    if (st == TD_OK) {
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        ncclResult_t r = ncclCommSplit(parent->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key,
                                       &c->comm, &config);
        if (r != ncclSuccess && r != ncclInProgress)
            st = td__host->fail(TD_EBACKEND, "nccl: ncclCommSplit: %s", ncclGetErrorString(r));
        else
            st = watch(parent, timeout_s, "nccl: splitting the communicator", 0);
        if (st == TD_OK && c->comm) st = watch(c, timeout_s, "nccl: splitting the communicator", 0);
    }
    if (st != TD_OK || !c->comm) {
        td__nccl_destroy(c);
        return st;
    }
    *out = c;
    return TD_OK;
}

void td__nccl_abort(td__nccl *c) {
    if (!c) return;
    pthread_mutex_lock(&c->lock);
    if (c->comm && !c->aborted) {
        ncclCommAbort(c->comm);
        c->aborted = 1;
    }
    pthread_mutex_unlock(&c->lock);
}

/* NCCL's name for dt; a dtype it has none for fails naming `what`. */
static td_status nccl_type(td_dtype dt, ncclDataType_t *out, const char *what) {
    switch (dt) {
    case TD_F32:
        *out = ncclFloat32;
        return TD_OK;
    case TD_F64:
        *out = ncclFloat64;
        return TD_OK;
    case TD_BF16:
        *out = ncclBfloat16;
        return TD_OK;
    case TD_F16:
        *out = ncclFloat16;
        return TD_OK;
    case TD_I32:
        *out = ncclInt32;
        return TD_OK;
    case TD_I64:
        *out = ncclInt64;
        return TD_OK;
    case TD_U8:
        *out = ncclUint8;
        return TD_OK;
    default:
        return td__host->fail(TD_EDTYPE, "%s: dtype %d has no NCCL type", what, (int)dt);
    }
}

static ncclRedOp_t nccl_op(td_reduce_op op) {
    switch (op) {
    case TD_OP_PROD:
        return ncclProd;
    case TD_OP_MIN:
        return ncclMin;
    case TD_OP_MAX:
        return ncclMax;
    case TD_OP_AVG:
        return ncclAvg;
    default:
        return ncclSum;
    }
}

static int overlaps(const char *a, size_t an, const char *b, size_t bn) {
    return an && bn && a < b + bn && b < a + an;
}

/* Where the call reads this rank's input from. In place means what it means on every path
 * (comm.h): send is where the input is, wherever it lies. NCCL's own in-place forms run as they
 * are (send == recv for the element-wise collectives; this rank's block of recv for all-gather
 * and gather; this rank's block of send, or its front, for reduce-scatter); any other overlap of
 * send with what the call writes (send == recv for all-gather, gather at the root, all-to-all) is
 * copied aside first, into the communicator's scratch on its stream, so NCCL never reads what it
 * is writing. */
static td_status stage_send(td__nccl *c, const td__nccl_call *k, const char **out) {
    size_t es = k->elem_size, n = k->count, all = (size_t)k->size * n * es;
    const char *send = (const char *)k->send, *recv = (const char *)k->recv;
    size_t sbytes = n * es, rbytes = n * es;
    int native = 0;
    switch (k->kind) {
    case TD__NCCL_ALLREDUCE:
    case TD__NCCL_REDUCE:
    case TD__NCCL_BROADCAST:
        native = send == recv;
        break;
    case TD__NCCL_ALLGATHER:
    case TD__NCCL_GATHER:
        rbytes = k->kind == TD__NCCL_GATHER && k->rank != k->root ? 0 : all;
        native = send == recv + (size_t)k->rank * n * es;
        break;
    case TD__NCCL_REDUCE_SCATTER:
        sbytes = all;
        native = recv == send || recv == send + (size_t)k->rank * n * es;
        break;
    case TD__NCCL_SCATTER:
        sbytes = k->rank == k->root ? all : 0;
        break;
    case TD__NCCL_ALLTOALL:
        sbytes = rbytes = all;
        break;
    default: /* point-to-point */
        rbytes = 0;
        break;
    }
    *out = send;
    if (native || !overlaps(send, sbytes, recv, rbytes)) return TD_OK;
    if (c->scratch_bytes < sbytes) {
        if (c->scratch) TD__CU(cudaFree(c->scratch));
        c->scratch = NULL;
        c->scratch_bytes = 0;
        TD__CU(cudaMalloc(&c->scratch, sbytes));
        c->scratch_bytes = sbytes;
    }
    TD__CU(cudaMemcpyAsync(c->scratch, send, sbytes, cudaMemcpyDeviceToDevice, c->stream));
    *out = (const char *)c->scratch;
    return TD_OK;
}

/* Where NCCL writes a reduce-scatter's result: recv, or in tandem's in place (recv == send,
 * the result at the front) this rank's block of send, NCCL's in place. */
static char *front_of(const td__nccl_call *k, const char *send) {
    char *recv = (char *)k->recv;
    return recv == send ? recv + (size_t)k->rank * k->count * k->elem_size : recv;
}

/* Queues the collective on the communicator's stream (grouped sends and receives for the
 * collectives NCCL has no call for), reading this rank's input from send. */
static td_status enqueue(td__nccl *c, const td__nccl_call *k, const char *send, const char *what) {
    ncclDataType_t t = ncclUint8;
    td_status typed = nccl_type(k->dtype, &t, what);
    if (typed != TD_OK) return typed;
    size_t es = k->elem_size, n = k->count;
    char *recv = (char *)k->recv;
    int size = k->size, rank = k->rank;
    switch (k->kind) {
    case TD__NCCL_ALLREDUCE:
        TD__NCCL(ncclAllReduce(send, recv, n, t, nccl_op(k->op), c->comm, c->stream), what);
        return TD_OK;
    case TD__NCCL_REDUCE:
        TD__NCCL(ncclReduce(send, recv, n, t, nccl_op(k->op), k->root, c->comm, c->stream), what);
        return TD_OK;
    case TD__NCCL_BROADCAST:
        TD__NCCL(ncclBroadcast(send, recv, n, t, k->root, c->comm, c->stream), what);
        return TD_OK;
    case TD__NCCL_ALLGATHER:
        TD__NCCL(ncclAllGather(send, recv, n, t, c->comm, c->stream), what);
        return TD_OK;
    case TD__NCCL_REDUCE_SCATTER:
        /* In place, tandem's result lands at the front (comm.h); NCCL's in place is this rank's
         * block, so the result moves to the front once NCCL has queued its kernel (run). */
        TD__NCCL(
            ncclReduceScatter(send, front_of(k, send), n, t, nccl_op(k->op), c->comm, c->stream),
            what);
        return TD_OK;
    case TD__NCCL_GATHER:
    case TD__NCCL_SCATTER:
    case TD__NCCL_ALLTOALL: {
        TD__NCCL(ncclGroupStart(), what);
        /* The group is ended whatever a call in it said, or it would take in later calls. */
        ncclResult_t r = ncclSuccess;
        for (int q = 0; q < size && (r == ncclSuccess || r == ncclInProgress); q++) {
            size_t at = (size_t)q * n * es;
            if (k->kind == TD__NCCL_ALLTOALL) {
                r = ncclSend(send + at, n, t, q, c->comm, c->stream);
                if (r == ncclSuccess || r == ncclInProgress)
                    r = ncclRecv(recv + at, n, t, q, c->comm, c->stream);
            } else if (k->kind == TD__NCCL_GATHER) {
                /* In place at the root, its own block is where it belongs already. */
                int own = rank == k->root && send == recv + (size_t)rank * n * es;
                if (q == 0 && !own) r = ncclSend(send, n, t, k->root, c->comm, c->stream);
                if (rank == k->root && !(own && q == rank) &&
                    (r == ncclSuccess || r == ncclInProgress))
                    r = ncclRecv(recv + at, n, t, q, c->comm, c->stream);
            } else {
                if (rank == k->root) r = ncclSend(send + at, n, t, q, c->comm, c->stream);
                if (q == 0 && (r == ncclSuccess || r == ncclInProgress))
                    r = ncclRecv(recv, n, t, k->root, c->comm, c->stream);
            }
        }
        ncclResult_t e = ncclGroupEnd();
        if (r != ncclSuccess && r != ncclInProgress)
            return td__host->fail(TD_EBACKEND, "%s: a send or receive of the group failed: %s",
                                  what, ncclGetErrorString(r));
        TD__NCCL(e, what);
        return TD_OK;
    }
    case TD__NCCL_SEND:
        TD__NCCL(ncclSend(send, n, t, k->root, c->comm, c->stream), what);
        return TD_OK;
    case TD__NCCL_RECV:
        TD__NCCL(ncclRecv(recv, n, t, k->root, c->comm, c->stream), what);
        return TD_OK;
    }
    return td__host->fail(TD_EINVAL, "%s: unknown collective %d", what, (int)k->kind);
}

td_status td__nccl_run(td__nccl *c, const td__nccl_call *k, double timeout_s, const char *what) {
    if (c->aborted) return td__host->fail(TD_EPEER, "%s: the NCCL communicator was aborted", what);
    TD__CU(cudaSetDevice(c->device));
    TD__CU(cudaEventRecord(c->ready, c->compute));
    TD__CU(cudaStreamWaitEvent(c->stream, c->ready, 0));
    const char *send;
    td_status staged = stage_send(c, k, &send);
    if (staged != TD_OK) return staged;
    pthread_mutex_lock(&c->lock);
    td_status st = c->aborted
                       ? td__host->fail(TD_EPEER, "%s: the NCCL communicator was aborted", what)
                       : enqueue(c, k, send, what);
    pthread_mutex_unlock(&c->lock);
    if (st == TD_OK) st = watch(c, timeout_s, what, 0);
    if (st != TD_OK) return st;
    /* Only now has a non-blocking communicator queued the collective's kernel on the stream
     * (its group ends in a background thread): what follows it on the stream goes here. */
    char *front = k->kind == TD__NCCL_REDUCE_SCATTER ? front_of(k, send) : NULL;
    if (front && front != (char *)k->recv)
        TD__CU(cudaMemcpyAsync(k->recv, front, k->count * k->elem_size, cudaMemcpyDeviceToDevice,
                               c->stream));
    TD__CU(cudaEventRecord(c->done, c->stream));
    if ((st = watch(c, timeout_s, what, 1)) != TD_OK) return st;
    /* Later work on the compute stream sees the result. */
    TD__CU(cudaStreamWaitEvent(c->compute, c->done, 0));
    return TD_OK;
}
