/* Collectives on device memory: the group picks its path once, on its first call whose buffers
 * are on a GPU, from where its ranks' GPUs are (their UUIDs, gathered over the group's own
 * host path): NCCL when every rank has a GPU of its own, CUDA IPC when all ranks share one GPU
 * (NCCL refuses that), and otherwise staging through host memory into the group's backend.
 *
 * Every call first takes one step on the host path that stands for it (td__coll.sig), so the
 * backend's agreement check compares it with the other ranks' calls: a rank that called
 * something else, or whose arguments were rejected, is named on every rank as for host
 * buffers, before any device work is queued. Device work follows what the compute stream
 * queued before the call and precedes what it queues after (gpu_comm_api.h). */
#include <stdlib.h>
#include <string.h>

#include "comm/comm_impl.h"
#include "comm/gpu_comm_api.h"
#include "core/core_impl.h"
#include "device/device_impl.h"

/* td__coll_kind and td__nccl_kind name the collectives in the same order. */
_Static_assert((int)TD__COLL_ALLTOALL == (int)TD__NCCL_ALLTOALL &&
                   (int)TD__COLL_REDUCE_SCATTER == (int)TD__NCCL_REDUCE_SCATTER &&
                   (int)TD__COLL_ALLREDUCE == (int)TD__NCCL_ALLREDUCE,
               "collective kinds line up");

/* Bytes of each rank's staging buffer on the CUDA IPC path. */
#define IPC_STAGING_BYTES ((size_t)64 << 20)

typedef enum { PATH_NCCL, PATH_IPC, PATH_STAGED } path_kind;

struct td__gpu_path {
    path_kind kind;
    td_device device;
    const td__gpu_comm_api *api;
    td__nccl *nccl;
    td__ipc *ipc;
    unsigned char *host; /* PATH_STAGED: the host copies of send and recv */
    size_t host_bytes;
};

const char *td__gpu_path_name(const td__gpu_path *p) {
    return !p                     ? "none"
           : p->kind == PATH_NCCL ? "nccl"
           : p->kind == PATH_IPC  ? "cuda-ipc"
                                  : "staged";
}

/* A group and the call a step stands for. */
typedef struct {
    const td__backend_ops *ops;
    void *ctx;
    const td__group_shape *shape;
    const td__coll *call;
    double timeout_s;
} group;

/* One collective on the host path standing for the user's call (its sig). */
static td_status step(const group *g, td__coll_kind kind, const void *send, void *recv,
                      size_t count, td_dtype dtype, td_reduce_op op, int root) {
    return td__coll_step(g->ops, g->ctx, g->call, kind, send, recv, count, dtype, op, root,
                         g->timeout_s);
}

static td_status barrier_step(void *arg, td_status error) {
    const group *g = arg;
    if (error == TD_OK) return step(g, TD__COLL_BARRIER, NULL, NULL, 0, TD_U8, TD_OP_SUM, 0);
    /* this rank failed: the step stands for the user's call, carrying why */
    td__coll why = *g->call;
    why.error = error;
    why.error_msg = td_last_error();
    group gw = *g;
    gw.call = &why;
    return step(&gw, TD__COLL_BARRIER, NULL, NULL, 0, TD_U8, TD_OP_SUM, 0);
}

void td__gpu_path_destroy(td__gpu_path *p) {
    if (!p) return;
    if (p->nccl) p->api->destroy(p->nccl);
    if (p->ipc) p->api->ipc_destroy(p->ipc);
    free(p->host);
    free(p);
}

void td__gpu_path_abort(td__gpu_path *p) {
    if (p && p->nccl) p->api->abort(p->nccl);
}

/* The path of this group, from every rank's GPU UUID. Collective. */
static td_status create(const group *g, td_device d, td__gpu_path **out) {
    td__gpu_path *p = calloc(1, sizeof *p);
    if (!p) return td__fail(TD_ENOMEM, "collectives on %s: out of memory", "a GPU");
    p->device = d;
    int size = g->shape->size, rank = g->shape->rank;
    unsigned char *uuids = calloc((size_t)size, 16);
    td_status st =
        uuids ? td__device_uuid(d, uuids + 16 * rank, "collectives on a GPU") : TD_ENOMEM;
    if (st == TD_OK) st = step(g, TD__COLL_ALLGATHER, uuids + 16 * rank, uuids, 16, TD_U8, 0, 0);
    int shared = 1, distinct = 1;
    for (int i = 0; st == TD_OK && i < size; i++)
        for (int j = 0; j < i; j++) {
            int same = !memcmp(uuids + 16 * i, uuids + 16 * j, 16);
            shared &= same;
            distinct &= !same;
        }
    free(uuids);
    const void *table = NULL;
    if (st == TD_OK) st = td__device_library(d, TD__DEVICE_COMM, "collectives on a GPU", &table);
    p->api = table;
    if (st == TD_OK && p->api->abi != TD__GPU_COMM_ABI)
        st = td__fail(TD_EUNSUPPORTED,
                      "collectives on a GPU: the device's library has collectives of ABI %d, "
                      "not %d",
                      p->api->abi, TD__GPU_COMM_ABI);
    void *compute = NULL, *copy = NULL;
    if (st == TD_OK) st = td__device_streams(d, &compute, &copy, "collectives on a GPU");
    p->kind = distinct ? PATH_NCCL : shared && size <= TD__IPC_MAX_RANKS ? PATH_IPC : PATH_STAGED;
    if (st == TD_OK && p->kind == PATH_NCCL) {
        unsigned char id[128] = {0};
        if (rank == 0) st = p->api->unique_id(id);
        /* a rank whose id failed still takes the step, so the others learn of it */
        td__coll why = *g->call;
        if (st != TD_OK) {
            why.error = st;
            why.error_msg = td_last_error();
        }
        group gw = *g;
        gw.call = &why;
        td_status s2 = step(&gw, TD__COLL_BROADCAST, id, id, sizeof id, TD_U8, 0, 0);
        if (st == TD_OK) st = s2;
        if (st == TD_OK)
            st = p->api->create(d.index, compute, size, rank, id, g->timeout_s, &p->nccl);
    } else if (st == TD_OK && p->kind == PATH_IPC) {
        /* A rank whose buffer or whose peers' failed still takes each step, carrying its
         * error, so that every rank fails with it instead of waiting for this one. */
        unsigned char handles[TD__IPC_MAX_RANKS * TD__IPC_HANDLE_BYTES] = {0};
        unsigned char *mine = handles + (size_t)rank * TD__IPC_HANDLE_BYTES;
        td__coll why = *g->call;
        group gw = *g;
        gw.call = &why;
        for (int stage = 0; stage < 2 && st == TD_OK; stage++) {
            td_status local = stage == 0 ? p->api->ipc_create(d.index, compute, rank, size,
                                                              IPC_STAGING_BYTES, &p->ipc, mine)
                                         : p->api->ipc_connect(p->ipc, handles);
            why.error = local;
            why.error_msg = local ? td_last_error() : NULL;
            st = stage == 0 ? step(&gw, TD__COLL_ALLGATHER, mine, handles, TD__IPC_HANDLE_BYTES,
                                   TD_U8, 0, 0)
                            : step(&gw, TD__COLL_BARRIER, NULL, NULL, 0, TD_U8, 0, 0);
            if (local) st = local;
        }
    }
    if (st != TD_OK) {
        td__gpu_path_destroy(p);
        return st;
    }
    td__log(TD_LOG_INFO, "rank %d/%d: collectives on device memory take the %s path", rank, size,
            td__gpu_path_name(p));
    *out = p;
    return TD_OK;
}

/* Elements of send and recv on this rank for a call of `count`. */
static void extents(const td__coll *k, int size, int rank, size_t *ns, size_t *nr) {
    size_t n = k->count, all = n * (size_t)size;
    int root = rank == k->root;
    switch (k->kind) {
    case TD__COLL_ALLGATHER:
        *ns = n, *nr = all;
        break;
    case TD__COLL_GATHER:
        *ns = n, *nr = root ? all : 0;
        break;
    case TD__COLL_SCATTER:
        *ns = root ? all : 0, *nr = n;
        break;
    case TD__COLL_REDUCE_SCATTER:
        *ns = all, *nr = n;
        break;
    case TD__COLL_ALLTOALL:
        *ns = all, *nr = all;
        break;
    case TD__COLL_REDUCE:
        *ns = n, *nr = root ? n : 0;
        break;
    case TD__COLL_BROADCAST:
        *ns = 0, *nr = n;
        break;
    default:
        *ns = n, *nr = n;
        break;
    }
}

/* Through host memory: copies in, the host path's collective, copies out. In place (and for
 * broadcast) one host buffer holds both sides, as large as the larger. */
static td_status staged(td__gpu_path *p, const group *g, const td__coll *k) {
    size_t es = td_dtype_size(k->dtype), ns, nr;
    extents(k, g->shape->size, g->shape->rank, &ns, &nr);
    int in_place = k->send == k->recv || k->kind == TD__COLL_BROADCAST;
    size_t in = in_place ? (ns > nr ? ns : nr) : ns;
    size_t need = (in_place ? in : ns + nr) * es;
    if (need > p->host_bytes) {
        unsigned char *h = realloc(p->host, need ? need : 1);
        if (!h)
            return td__fail(TD_ENOMEM, "%s on a GPU: no host memory for %zu bytes",
                            td__coll_name(k->kind), need);
        p->host = h;
        p->host_bytes = need;
    }
    unsigned char *recv = p->host, *send = in_place ? recv : recv + nr * es;
    const void *from = in_place ? k->recv : k->send;
    if (in) TD__TRY(td_device_copy(td_device_cpu(), send, p->device, from, in * es));
    TD__TRY(step(g, k->kind, send, recv, k->count, k->dtype, k->op, k->root));
    if (nr) TD__TRY(td_device_copy(p->device, k->recv, td_device_cpu(), recv, nr * es));
    return TD_OK;
}

td_status td__gpu_collective(const td__backend_ops *ops, void *ctx, const td__group_shape *shape,
                             td__gpu_path **path, const td__coll *k, double timeout_s) {
    group g = {ops, ctx, shape, k, timeout_s};
    /* The agreement, and any rank's rejected arguments, before device work is queued. */
    TD__TRY(barrier_step(&g, TD_OK));
    if (!*path) TD__TRY(create(&g, k->device, path));
    td__gpu_path *p = *path;
    if (p->device.type != k->device.type || p->device.index != k->device.index) {
        char a[32], b[32];
        td_device_format(k->device, a, sizeof a);
        td_device_format(p->device, b, sizeof b);
        return td__fail(TD_EINVAL, "%s: buffers on %s, but this group's GPU is %s",
                        td__coll_name(k->kind), a, b);
    }
    if (p->kind == PATH_STAGED) return staged(p, &g, k);
    char what[160];
    td__coll_describe_call(what, sizeof what, k);
    td__nccl_call c = {.kind = (td__nccl_kind)k->kind, /* the same order, barrier aside */
                       .send = k->send,
                       .recv = k->recv,
                       .count = k->count,
                       .elem_size = td_dtype_size(k->dtype),
                       .dtype = k->dtype,
                       .op = k->op,
                       .root = k->root,
                       .rank = shape->rank,
                       .size = shape->size};
    if (p->kind == PATH_NCCL) return p->api->run(p->nccl, &c, timeout_s, what);
    return p->api->ipc_run(p->ipc, &c, barrier_step, &g, timeout_s, what);
}
