/* The generic process-group layer behind tandem/comm.h: argument checks, sequence numbers,
 * the per-group progress thread that runs queued non-blocking collectives in call order,
 * requests, sub-groups, and the poisoning that makes a failed group fail fast. It moves no
 * data itself: every transfer goes through the backend's td__backend_ops table.
 *
 * A blocking collective runs inline on the caller's thread when nothing is queued or
 * running (the low-latency path) and otherwise queues behind the pending ones and waits, so
 * the order of calls is the order of execution on every rank. Integer reductions: SUM and
 * PROD wrap, AVG truncates toward zero (see reduce.c); every op is defined for every dtype.
 *
 * A group with a trace records each collective it runs as a span linked by (group, sequence
 * number); comm_trace.c gathers the ranks' traces and keeps the job's (TANDEM_TRACE). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm_impl.h"
#include "comm/recorder.h"
#include "core/core_impl.h"
#include "device/device_impl.h"

/* The trace key of a group made by td_comm_create; split groups derive theirs from it. */
#define TRACE_WORLD_KEY 0x9e3779b97f4a7c15ull

typedef enum { ITEM_COLL, ITEM_SPLIT, ITEM_SPLIT_HOST, ITEM_P2P, ITEM_SELF, ITEM_ALLOC } item_kind;

/* One td_comm_alloc allocation; `backend` says whether ops->free or free() releases it. */
typedef struct comm_alloc {
    void *ptr;
    int backend;
    struct comm_alloc *next;
} comm_alloc;

struct td_request {
    item_kind kind;
    td_comm *comm;
    td__coll coll;
    int color, key;      /* split */
    td_comm **split_out; /* split */
    size_t bytes;        /* alloc */
    void **alloc_out;    /* alloc */
    void *p2p;           /* backend handle */
    /* A point-to-point buffer in device memory travels through host memory: `staged`
     * (staged_bytes) holds it, copied from `user` before a send, into it after a receive. */
    void *staged, *user;
    size_t staged_bytes;
    td_device device;
    int is_recv;
    int done;
    td__rec_entry *rec; /* the flight recorder's entry of this call, or NULL */
    td_status status;
    char error[1024];
    td_request *next;
};

struct td_comm {
    const td__backend_ops *ops;
    void *ctx;
    td__group_shape shape;
    double timeout_s;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    uint64_t next_seq;
    td_request *head, *tail; /* queued collectives */
    int busy;                /* a collective is running (inline or on the thread) */
    int thread_started, stop;
    pthread_t thread;
    td_status failed; /* the group is poisoned */
    char failed_msg[512];
    comm_alloc *allocs;  /* td_comm_alloc memory not yet freed */
    td__self_box *self;  /* messages to this rank itself */
    td__gpu_path *gpu;   /* collectives on device memory, once there was one */
    td_trace *trace;     /* NULL, or where collectives are recorded (not owned) */
    uint64_t trace_key;  /* the group, the same on each of its ranks: links its calls' spans */
    uint64_t splits;     /* groups split from this one so far: part of their keys */
    int progress_named;  /* the progress thread's row is named in `trace` */
    td_trace *job_trace; /* owned: TANDEM_TRACE's trace of a td_comm_create'd group */
    char *job_trace_dir;
    td__names names; /* how messages name the members (the backend holds a pointer) */
    td__rec rec;     /* the flight recorder's ring of the group's calls (posts under `lock`) */
};

/* ---------------------------------------------------------------- life cycle */

/* A td_comm around a backend's group; `world` (owned, NULL for the world group) holds the
 * members' world ranks. */
static td_status comm_wrap(td_comm **out, const td__backend_ops *ops, void *ctx,
                           td__group_shape shape, double timeout, int *world) {
    td_comm *c = calloc(1, sizeof *c);
    if (!c || td__self_box_create(&c->self) != TD_OK) {
        free(c);
        free(world);
        ops->destroy(ctx);
        return td__fail(TD_ENOMEM, "td_comm: out of memory");
    }
    td__names_init(&c->names, shape.size, world);
    if (ops->set_names) ops->set_names(ctx, &c->names);
    c->ops = ops;
    c->ctx = ctx;
    c->shape = shape;
    c->trace_key = TRACE_WORLD_KEY;
    td__rec_init(&c->rec, c->trace_key, &c->names, shape.rank, shape.size, ops->name);
    c->timeout_s = timeout;
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->cond, NULL);
    *out = c;
    return TD_OK;
}

td_status td_comm_create(td_comm **out, const td_comm_params *params) {
    if (!out) return td__fail(TD_EINVAL, "td_comm_create: out is NULL");
    *out = NULL;
    td_comm_params defaults = td_comm_default_params(), p;
    if (!params) params = &defaults;
    td_status s = td__comm_resolve_params(params, &p);
    if (s) return s;
    /* The recorder names this process after its rank in the first world it joins, and may dump
     * from now on: a rank stuck in its rendezvous says so. */
    td__rec_process(p.rank, p.world_size);
    td__doctor_start();
    void *ctx = NULL;
    td__group_shape shape;
    const td__backend_ops *ops = NULL;
    static const char *const backend_names[] = {"auto", "shm", "mpi", "ucx"};
    td__rec_creating(backend_names[p.backend]);
    s = p.backend == TD_BACKEND_MPI   ? td__mpi_create(&p, &ctx, &shape, &ops)
        : p.backend == TD_BACKEND_UCX ? td__ucx_create(&p, &ctx, &shape, &ops)
                                      : td__shm_create(&p, &ctx, &shape, &ops);
    if (s == TD_ETIMEOUT || s == TD_EPEER) td__doctor_dump("td_comm_create failed", td_last_error());
    td__rec_creating(NULL);
    if (s) return s;
    if (shape.nodes > 1 && p.hierarchical) {
        void *hier = NULL;
        td__group_shape hier_shape;
        const td__backend_ops *hier_ops = NULL;
        s = td__hier_create(ops, ctx, &shape, p.timeout_s, &hier, &hier_shape, &hier_ops);
        if (s) {
            ops->destroy(ctx);
            return s;
        }
        ctx = hier, shape = hier_shape, ops = hier_ops;
    }
    s = comm_wrap(out, ops, ctx, shape, p.timeout_s, NULL);
    if (!s) (*out)->job_trace = td__comm_job_trace_open(*out, &(*out)->job_trace_dir);
    return s;
}

void td_comm_destroy(td_comm *comm) {
    if (!comm) return;
    pthread_mutex_lock(&comm->lock);
    while (comm->head || comm->busy) pthread_cond_wait(&comm->cond, &comm->lock);
    pthread_mutex_unlock(&comm->lock);
    if (comm->job_trace) {
        td_comm_set_trace(comm, NULL);
        td__comm_job_trace_close(comm, comm->job_trace, comm->job_trace_dir);
    }
    pthread_mutex_lock(&comm->lock);
    comm->stop = 1;
    pthread_cond_broadcast(&comm->cond);
    pthread_mutex_unlock(&comm->lock);
    if (comm->thread_started) pthread_join(comm->thread, NULL);
    td__rec_fini(&comm->rec);
    while (comm->allocs) td_comm_free(comm, comm->allocs->ptr);
    td__gpu_path_destroy(comm->gpu);
    comm->ops->destroy(comm->ctx);
    td__self_box_destroy(comm->self);
    td__names_free(&comm->names);
    pthread_cond_destroy(&comm->cond);
    pthread_mutex_destroy(&comm->lock);
    free(comm);
}

int td_comm_rank(const td_comm *comm) { return comm ? comm->shape.rank : -1; }
int td_comm_size(const td_comm *comm) { return comm ? comm->shape.size : 0; }
int td_comm_local_rank(const td_comm *comm) { return comm ? comm->shape.local_rank : -1; }
int td_comm_local_size(const td_comm *comm) { return comm ? comm->shape.local_size : 0; }
int td_comm_node_rank(const td_comm *comm) { return comm ? comm->shape.node : -1; }
int td_comm_num_nodes(const td_comm *comm) { return comm ? comm->shape.nodes : 0; }
const char *td_comm_backend_name(const td_comm *comm) { return comm ? comm->ops->name : "none"; }
const char *td_comm_device_path(const td_comm *comm) {
    return td__gpu_path_name(comm ? comm->gpu : NULL);
}

td_status td_comm_set_trace(td_comm *comm, td_trace *trace) {
    if (!comm) return td__fail(TD_EINVAL, "td_comm_set_trace: the group is NULL");
    pthread_mutex_lock(&comm->lock);
    comm->trace = trace;
    comm->progress_named = 0;
    pthread_mutex_unlock(&comm->lock);
    return TD_OK;
}

td_trace *td_comm_trace(const td_comm *comm) {
    if (!comm) return NULL;
    pthread_mutex_lock((pthread_mutex_t *)&comm->lock);
    td_trace *trace = comm->trace;
    pthread_mutex_unlock((pthread_mutex_t *)&comm->lock);
    return trace;
}

/* splitmix64's finaliser: keys of different groups and calls spread over 64 bits. */
static uint64_t trace_mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* A group split from `parent` records into its trace; its key follows from the parent's, the
 * split's place among the parent's splits (collective, so the same count on every rank) and
 * the colour, so that it is the same on its ranks and differs from its sibling groups'. */
static void trace_inherit(td_comm *parent, td_comm *child, uint64_t split, uint64_t color) {
    pthread_mutex_lock(&parent->lock);
    child->trace = parent->trace;
    pthread_mutex_unlock(&parent->lock);
    child->trace_key = trace_mix(parent->trace_key + trace_mix(split * 0x100000001b3ull + color));
    child->rec.key = child->trace_key;
}

td_status td_comm_set_timeout(td_comm *comm, double seconds) {
    if (!comm || !(seconds > 0))
        return td__fail(TD_EINVAL, "td_comm_set_timeout: need a group and seconds > 0");
    pthread_mutex_lock(&comm->lock);
    comm->timeout_s = seconds;
    pthread_mutex_unlock(&comm->lock);
    return TD_OK;
}

td_status td_comm_set_name(td_comm *comm, const char *name) {
    if (!comm || !name) return td__fail(TD_EINVAL, "td_comm_set_name: comm or name is NULL");
    size_t len = strlen(name);
    if (len < 1 || len > 32)
        return td__fail(TD_EINVAL, "td_comm_set_name: the name has %zu characters, 1 to 32 expected",
                        len);
    pthread_mutex_lock(&comm->lock);
    td__names_label(&comm->names, name);
    pthread_mutex_unlock(&comm->lock);
    return TD_OK;
}

/* ---------------------------------------------------------------- running work */

/* Ends the group for this rank with `s` (td_last_error() says why); the first failure is
 * recorded and dumped (dump.c), as the moment a job stops moving. */
static void poison(td_comm *comm, td_status s) {
    pthread_mutex_lock(&comm->lock);
    int first = !comm->failed;
    if (first) {
        comm->failed = s;
        snprintf(comm->failed_msg, sizeof comm->failed_msg, "%s", td_last_error());
    }
    pthread_mutex_unlock(&comm->lock);
    if (!first) return;
    td__rec_failed(&comm->rec, comm->failed_msg);
    if (s != TD_ESTATE) td__doctor_dump("a group failed", comm->failed_msg);
}

td_status td_comm_abort(td_comm *comm) {
    if (!comm) return td__fail(TD_EINVAL, "td_comm_abort: the group is NULL");
    td__fail(TD_ESTATE, "%s aborted the group (td_comm_abort)",
             td__who(&comm->names, comm->shape.rank).s);
    poison(comm, TD_ESTATE);
    td__gpu_path_abort(comm->gpu);
    if (comm->ops->abort) comm->ops->abort(comm->ctx, comm->shape.rank, "td_comm_abort");
    return TD_OK;
}

static td_status run_item(td_comm *comm, td_request *r) {
    pthread_mutex_lock(&comm->lock);
    td_status failed = comm->failed;
    double timeout = comm->timeout_s;
    td_trace *trace = comm->trace;
    char msg[sizeof comm->failed_msg];
    memcpy(msg, comm->failed_msg, sizeof msg);
    pthread_mutex_unlock(&comm->lock);
    if (failed) {
        td__rec_end(r->rec, failed);
        return td__fail(failed, "%s: the group failed earlier: %s",
                        td__who(&comm->names, comm->shape.rank).s, msg);
    }
    if (r->rec) atomic_store_explicit(&r->rec->state, TD__REC_RUNNING, memory_order_relaxed);
    td__rec_current = r->rec; /* the backend's waits stamp it */
    td_status s;
    if (r->kind == ITEM_SPLIT || r->kind == ITEM_SPLIT_HOST) {
        void *child = NULL;
        td__group_shape shape = {0};
        const td__backend_ops *ops = comm->ops;
        int *members = malloc((size_t)comm->shape.size * sizeof *members);
        if (!members) return td__fail(TD_ENOMEM, "split: out of memory");
        s = r->kind == ITEM_SPLIT
                ? comm->ops->split(comm->ctx, r->color, r->key, timeout, &child, &shape, members)
                : comm->ops->split_host(comm->ctx, timeout, &child, &shape, &ops, members);
        /* The child's members by world rank, for its messages. */
        for (int i = 0; !s && child && i < shape.size; i++)
            members[i] = td__names_world(&comm->names, members[i]);
        if (!s && child)
            s = comm_wrap(r->split_out, ops, child, shape, timeout, members);
        else
            free(members);
        uint64_t split = comm->splits++;
        if (!s && child)
            trace_inherit(comm, *r->split_out, split,
                          (uint64_t)(r->kind == ITEM_SPLIT ? r->color : shape.node) + 1);
    } else if (r->kind == ITEM_ALLOC) {
        s = comm->ops->alloc(comm->ctx, r->bytes, timeout, r->alloc_out);
    } else {
        uint64_t t0 = trace ? td_time_ns() : 0;
        if (r->coll.device.type != TD_DEVICE_CPU && !r->coll.error)
            s = td__gpu_collective(comm->ops, comm->ctx, &comm->shape, &comm->gpu, &r->coll,
                                   timeout);
        else
            s = comm->ops->collective(comm->ctx, &r->coll, timeout);
        if (trace) {
            char name[160];
            td__coll_describe_call(name, sizeof name, &r->coll);
            (void)td_trace_span_linked(trace, name, "comm",
                                       trace_mix(comm->trace_key ^ trace_mix(r->coll.seq)) | 1, t0,
                                       td_time_ns());
        }
    }
    td__rec_current = NULL;
    td__rec_end(r->rec, s);
    /* Rejected arguments (agreed by every rank) and a failed allocation leave the group
     * usable; anything else ends it for this rank (see comm.h). */
    if (s && s != TD_ENOMEM && s != TD_EINVAL && s != TD_EDTYPE) poison(comm, s);
    return s;
}

static void *progress_main(void *arg) {
    td_comm *comm = arg;
    pthread_mutex_lock(&comm->lock);
    for (;;) {
        while (!comm->stop && (!comm->head || comm->busy))
            pthread_cond_wait(&comm->cond, &comm->lock);
        if (!comm->head) break;
        td_request *r = comm->head;
        comm->head = r->next;
        if (!comm->head) comm->tail = NULL;
        comm->busy = 1;
        td_trace *trace = comm->progress_named ? NULL : comm->trace;
        comm->progress_named = comm->trace != NULL;
        pthread_mutex_unlock(&comm->lock);
        if (trace)
            (void)td_trace_name_thread(trace, comm->trace_key == TRACE_WORLD_KEY
                                                  ? "communication"
                                                  : "communication (sub-group)");
        td_status s = run_item(comm, r);
        if (s) snprintf(r->error, sizeof r->error, "%s", td_last_error());
        pthread_mutex_lock(&comm->lock);
        r->status = s;
        r->done = 1;
        comm->busy = 0;
        pthread_cond_broadcast(&comm->cond);
    }
    pthread_mutex_unlock(&comm->lock);
    return NULL;
}

/* Gives `r` its sequence number and either runs it now (blocking, nothing pending) or
 * queues it; a queued blocking call then waits for it. */
static td_status submit(td_comm *comm, td_request *r, int blocking) {
    pthread_mutex_lock(&comm->lock);
    if (comm->failed) {
        td_status f = comm->failed;
        pthread_mutex_unlock(&comm->lock);
        return td__fail(f, "%s: the group failed earlier: %s",
                        td__who(&comm->names, comm->shape.rank).s, comm->failed_msg);
    }
    r->coll.seq = comm->next_seq++;
    int inline_now = blocking && !comm->head && !comm->busy;
    if (r->kind == ITEM_COLL)
        r->rec = td__rec_post(&comm->rec, comm, r->coll.kind, r->coll.seq, r->coll.count,
                              r->coll.dtype, r->coll.op,
                              td__coll_is_rooted(r->coll.kind) ? r->coll.root : -1, -1,
                              TD__REC_QUEUED);
    else
        r->rec = td__rec_post(&comm->rec, comm,
                              r->kind == ITEM_ALLOC ? TD__REC_ALLOC : TD__REC_SPLIT, r->coll.seq,
                              r->bytes, TD_U8, 0, -1, -1, TD__REC_QUEUED);
    if (inline_now) {
        comm->busy = 1;
        pthread_mutex_unlock(&comm->lock);
        td_status s = run_item(comm, r);
        pthread_mutex_lock(&comm->lock);
        comm->busy = 0;
        pthread_cond_broadcast(&comm->cond);
        pthread_mutex_unlock(&comm->lock);
        return s;
    }
    if (!comm->thread_started) {
        if (pthread_create(&comm->thread, NULL, progress_main, comm) != 0) {
            comm->next_seq--;
            td__rec_end(r->rec, TD_ESTATE);
            pthread_mutex_unlock(&comm->lock);
            return td__fail(TD_ESTATE, "rank %d: cannot start the progress thread",
                            comm->shape.rank);
        }
        comm->thread_started = 1;
    }
    r->next = NULL;
    if (comm->tail)
        comm->tail->next = r;
    else
        comm->head = r;
    comm->tail = r;
    pthread_cond_broadcast(&comm->cond);
    if (!blocking) {
        pthread_mutex_unlock(&comm->lock);
        return TD_OK;
    }
    while (!r->done) pthread_cond_wait(&comm->cond, &comm->lock);
    pthread_mutex_unlock(&comm->lock);
    return r->status ? td__fail(r->status, "%s", r->error) : TD_OK;
}

/* ---------------------------------------------------------------- argument checks */

/* What is wrong with this rank's arguments (`why` says it), or TD_OK. */
static td_status check_coll(const td_comm *comm, const td__coll *k, int async, const void *req,
                            char *why, size_t cap) {
    int rank = comm->shape.rank, n = comm->shape.size;
    if (async && !req) {
        snprintf(why, cap, "the request pointer is NULL");
        return TD_EINVAL;
    }
    if (k->kind == TD__COLL_BARRIER) return TD_OK;
    if ((unsigned)k->dtype >= TD_DTYPE_COUNT) {
        snprintf(why, cap, "invalid dtype %d", (int)k->dtype);
        return TD_EDTYPE;
    }
    if (td__coll_is_reduction(k->kind) && (unsigned)k->op >= TD_OP_COUNT) {
        snprintf(why, cap, "invalid reduce op %d", (int)k->op);
        return TD_EINVAL;
    }
    if (td__coll_is_rooted(k->kind) && (k->root < 0 || k->root >= n)) {
        snprintf(why, cap, "root %d is outside the group of %d ranks", k->root, n);
        return TD_EINVAL;
    }
    size_t es = td_dtype_size(k->dtype);
    if (k->count > SIZE_MAX / es / (size_t)n) {
        snprintf(why, cap, "count %zu overflows", k->count);
        return TD_EINVAL;
    }
    if (k->count == 0) return TD_OK;
    int root = rank == k->root;
    int need_send = k->kind != TD__COLL_BROADCAST && (k->kind != TD__COLL_SCATTER || root);
    int need_recv = (k->kind != TD__COLL_REDUCE && k->kind != TD__COLL_GATHER) || root;
    if (need_send && !k->send) {
        snprintf(why, cap, "send is NULL with count %zu", k->count);
        return TD_EINVAL;
    }
    if (need_recv && !k->recv) {
        snprintf(why, cap, "%s is NULL with count %zu",
                 k->kind == TD__COLL_BROADCAST ? "buf" : "recv", k->count);
        return TD_EINVAL;
    }
    return TD_OK;
}

/* Sets k->device from where its buffers are; both on one device, or TD_EINVAL. */
static td_status where(td__coll *k, char *why, size_t cap) {
    td_device s = td__device_of_pointer(k->send), r = td__device_of_pointer(k->recv);
    k->device = r.type != TD_DEVICE_CPU ? r : s;
    if (!k->send || !k->recv || (s.type == r.type && s.index == r.index)) return TD_OK;
    char a[32], b[32];
    td_device_format(s, a, sizeof a);
    td_device_format(r, b, sizeof b);
    snprintf(why, cap, "send is on %s and recv on %s: both on one device", a, b);
    return TD_EINVAL;
}

/* A collective call. Arguments rejected on this rank still make a call, so that every rank
 * learns of them and returns the same error instead of waiting for this one (comm_impl.h). */
static td_status coll(td_comm *comm, td__coll_kind kind, const void *send, void *recv, size_t count,
                      td_dtype dtype, td_reduce_op op, int root, int async, td_request **req) {
    td__coll k = {.kind = kind,
                  .send = send,
                  .recv = recv,
                  .count = count,
                  .dtype = dtype,
                  .op = op,
                  .root = root};
    if (req) *req = NULL;
    if (!comm) return td__fail(TD_EINVAL, "%s: the group is NULL", td__coll_name(kind));
    char why[192];
    k.error = check_coll(comm, &k, async, req, why, sizeof why);
    if (!k.error) k.error = where(&k, why, sizeof why);
    if (k.error) k.error_msg = why;
    k.error_rank = comm->shape.rank;
    if (!async || k.error) {
        td_request r = {.kind = ITEM_COLL, .comm = comm, .coll = k};
        return submit(comm, &r, 1);
    }
    td_request *r = calloc(1, sizeof *r);
    if (!r) return td__fail(TD_ENOMEM, "%s: out of memory", td__coll_name(kind));
    *r = (td_request){.kind = ITEM_COLL, .comm = comm, .coll = k};
    td_status s = submit(comm, r, 0);
    if (s)
        free(r);
    else
        *req = r;
    return s;
}

/* ---------------------------------------------------------------- collectives */

td_status td_comm_allreduce(td_comm *comm, const void *send, void *recv, size_t count,
                            td_dtype dtype, td_reduce_op op) {
    return coll(comm, TD__COLL_ALLREDUCE, send, recv, count, dtype, op, 0, 0, NULL);
}

td_status td_comm_reduce(td_comm *comm, const void *send, void *recv, size_t count, td_dtype dtype,
                         td_reduce_op op, int root) {
    return coll(comm, TD__COLL_REDUCE, send, recv, count, dtype, op, root, 0, NULL);
}

td_status td_comm_broadcast(td_comm *comm, void *buf, size_t count, td_dtype dtype, int root) {
    return coll(comm, TD__COLL_BROADCAST, buf, buf, count, dtype, TD_OP_SUM, root, 0, NULL);
}

td_status td_comm_allgather(td_comm *comm, const void *send, void *recv, size_t count,
                            td_dtype dtype) {
    return coll(comm, TD__COLL_ALLGATHER, send, recv, count, dtype, TD_OP_SUM, 0, 0, NULL);
}

td_status td_comm_gather(td_comm *comm, const void *send, void *recv, size_t count, td_dtype dtype,
                         int root) {
    return coll(comm, TD__COLL_GATHER, send, recv, count, dtype, TD_OP_SUM, root, 0, NULL);
}

td_status td_comm_scatter(td_comm *comm, const void *send, void *recv, size_t count, td_dtype dtype,
                          int root) {
    return coll(comm, TD__COLL_SCATTER, send, recv, count, dtype, TD_OP_SUM, root, 0, NULL);
}

td_status td_comm_reduce_scatter(td_comm *comm, const void *send, void *recv, size_t count,
                                 td_dtype dtype, td_reduce_op op) {
    return coll(comm, TD__COLL_REDUCE_SCATTER, send, recv, count, dtype, op, 0, 0, NULL);
}

td_status td_comm_alltoall(td_comm *comm, const void *send, void *recv, size_t count,
                           td_dtype dtype) {
    return coll(comm, TD__COLL_ALLTOALL, send, recv, count, dtype, TD_OP_SUM, 0, 0, NULL);
}

td_status td_comm_barrier(td_comm *comm) {
    return coll(comm, TD__COLL_BARRIER, NULL, NULL, 0, TD_U8, TD_OP_SUM, 0, 0, NULL);
}

td_status td_comm_iallreduce(td_comm *comm, const void *send, void *recv, size_t count,
                             td_dtype dtype, td_reduce_op op, td_request **req) {
    return coll(comm, TD__COLL_ALLREDUCE, send, recv, count, dtype, op, 0, 1, req);
}

td_status td_comm_ireduce(td_comm *comm, const void *send, void *recv, size_t count, td_dtype dtype,
                          td_reduce_op op, int root, td_request **req) {
    return coll(comm, TD__COLL_REDUCE, send, recv, count, dtype, op, root, 1, req);
}

td_status td_comm_ibroadcast(td_comm *comm, void *buf, size_t count, td_dtype dtype, int root,
                             td_request **req) {
    return coll(comm, TD__COLL_BROADCAST, buf, buf, count, dtype, TD_OP_SUM, root, 1, req);
}

td_status td_comm_iallgather(td_comm *comm, const void *send, void *recv, size_t count,
                             td_dtype dtype, td_request **req) {
    return coll(comm, TD__COLL_ALLGATHER, send, recv, count, dtype, TD_OP_SUM, 0, 1, req);
}

td_status td_comm_igather(td_comm *comm, const void *send, void *recv, size_t count, td_dtype dtype,
                          int root, td_request **req) {
    return coll(comm, TD__COLL_GATHER, send, recv, count, dtype, TD_OP_SUM, root, 1, req);
}

td_status td_comm_iscatter(td_comm *comm, const void *send, void *recv, size_t count,
                           td_dtype dtype, int root, td_request **req) {
    return coll(comm, TD__COLL_SCATTER, send, recv, count, dtype, TD_OP_SUM, root, 1, req);
}

td_status td_comm_ireduce_scatter(td_comm *comm, const void *send, void *recv, size_t count,
                                  td_dtype dtype, td_reduce_op op, td_request **req) {
    return coll(comm, TD__COLL_REDUCE_SCATTER, send, recv, count, dtype, op, 0, 1, req);
}

td_status td_comm_ialltoall(td_comm *comm, const void *send, void *recv, size_t count,
                            td_dtype dtype, td_request **req) {
    return coll(comm, TD__COLL_ALLTOALL, send, recv, count, dtype, TD_OP_SUM, 0, 1, req);
}

td_status td_comm_ibarrier(td_comm *comm, td_request **req) {
    return coll(comm, TD__COLL_BARRIER, NULL, NULL, 0, TD_U8, TD_OP_SUM, 0, 1, req);
}

/* ---------------------------------------------------------------- shared buffers */

td_status td_comm_alloc(td_comm *comm, size_t bytes, void **out) {
    if (out) *out = NULL;
    if (!comm || !out) return td__fail(TD_EINVAL, "td_comm_alloc: NULL group or out");
    comm_alloc *a = calloc(1, sizeof *a);
    if (!a) return td__fail(TD_ENOMEM, "td_comm_alloc: out of memory");
    td_status s = TD_OK;
    if (comm->ops->alloc) {
        /* Queued like a collective, so it runs after every pending one and none runs
         * beside the backend's own rendezvous. */
        td_request r = {.kind = ITEM_ALLOC, .comm = comm, .bytes = bytes, .alloc_out = &a->ptr};
        s = submit(comm, &r, 1);
        a->backend = 1;
    } else {
        /* From a page up, whole pages: a caller may give pages back (madvise) without
         * touching the allocator's neighbouring memory. */
        size_t align = bytes >= 4096 ? 4096 : 64;
        size_t rounded = bytes ? (bytes + align - 1) / align * align : 64;
        a->ptr = rounded >= bytes ? aligned_alloc(align, rounded) : NULL;
        if (!a->ptr)
            s = td__fail(TD_ENOMEM, "td_comm_alloc: rank %d: out of memory for %zu bytes",
                         comm->shape.rank, bytes);
    }
    if (s) {
        free(a);
        return s;
    }
    pthread_mutex_lock(&comm->lock);
    a->next = comm->allocs;
    comm->allocs = a;
    pthread_mutex_unlock(&comm->lock);
    *out = a->ptr;
    return TD_OK;
}

void td_comm_free(td_comm *comm, void *ptr) {
    if (!comm || !ptr) return;
    pthread_mutex_lock(&comm->lock);
    comm_alloc **p = &comm->allocs;
    while (*p && (*p)->ptr != ptr) p = &(*p)->next;
    comm_alloc *a = *p;
    if (a) *p = a->next;
    pthread_mutex_unlock(&comm->lock);
    if (!a) return; /* not from td_comm_alloc on this group */
    if (a->backend)
        comm->ops->free(comm->ctx, ptr);
    else
        free(ptr);
    free(a);
}

/* ---------------------------------------------------------------- sub-groups */

td_status td_comm_split(td_comm *comm, int color, int key, td_comm **out) {
    if (!comm || !out) return td__fail(TD_EINVAL, "td_comm_split: NULL group or out");
    *out = NULL;
    td_request r = {.kind = ITEM_SPLIT, .comm = comm, .color = color, .key = key, .split_out = out};
    return submit(comm, &r, 1);
}

td_status td_comm_split_host(td_comm *comm, td_comm **out) {
    if (!comm || !out) return td__fail(TD_EINVAL, "td_comm_split_host: NULL group or out");
    *out = NULL;
    if (!comm->ops->split_host) return td_comm_split(comm, comm->shape.node, comm->shape.rank, out);
    td_request r = {.kind = ITEM_SPLIT_HOST, .comm = comm, .split_out = out};
    return submit(comm, &r, 1);
}

td_status td_comm_new_group(td_comm *comm, const int *ranks, int n, td_comm **out) {
    if (!comm || !out || (!ranks && n > 0) || n < 0)
        return td__fail(TD_EINVAL, "td_comm_new_group: NULL group, out or ranks, or n < 0");
    *out = NULL;
    int size = comm->shape.size, me = comm->shape.rank, index = -1;
    for (int i = 0; i < n; i++) {
        if (ranks[i] < 0 || ranks[i] >= size)
            return td__fail(TD_EINVAL,
                            "td_comm_new_group: ranks[%d] = %d is outside the group of %d", i,
                            ranks[i], size);
        for (int j = 0; j < i; j++)
            if (ranks[j] == ranks[i])
                return td__fail(TD_EINVAL, "td_comm_new_group: rank %d is listed twice", ranks[i]);
        if (ranks[i] == me) index = i;
    }
    return td_comm_split(comm, index >= 0 ? 0 : -1, index, out);
}

/* ---------------------------------------------------------------- point-to-point */

/* Device memory goes through host memory, on every backend: a send copies its buffer out now
 * (after what the device's compute stream queued before the call), a receive lands in host
 * memory and is copied in when the request completes. *buf becomes the host copy. */
static td_status stage(td_request *r, int is_send, void **buf, size_t bytes, const char *fn,
                       int rank) {
    td_device d = td__device_of_pointer(*buf);
    if (d.type == TD_DEVICE_CPU || !bytes) return TD_OK;
    r->staged = malloc(bytes);
    if (!r->staged)
        return td__fail(TD_ENOMEM, "%s: rank %d: out of memory staging %zu bytes of device memory",
                        fn, rank, bytes);
    r->user = *buf;
    r->staged_bytes = bytes;
    r->device = d;
    r->is_recv = !is_send;
    if (is_send) {
        td_status s = td_device_copy(td_device_cpu(), r->staged, d, *buf, bytes);
        if (s) {
            free(r->staged);
            r->staged = NULL;
            return s;
        }
    }
    *buf = r->staged;
    return TD_OK;
}

static td_status p2p_post(td_comm *comm, int is_send, void *buf, size_t count, td_dtype dtype,
                          int peer, int tag, td_request **req) {
    const char *fn = is_send ? "send" : "recv";
    if (req) *req = NULL;
    if (!comm || !req) return td__fail(TD_EINVAL, "%s: NULL group or request", fn);
    int rank = comm->shape.rank, n = comm->shape.size;
    if ((unsigned)dtype >= TD_DTYPE_COUNT)
        return td__fail(TD_EDTYPE, "%s: rank %d: invalid dtype %d", fn, rank, (int)dtype);
    if (peer < 0 || peer >= n)
        return td__fail(TD_EINVAL, "%s: rank %d: peer %d is not a rank of the group of %d", fn,
                        rank, peer, n);
    if (tag < 0)
        return td__fail(TD_EINVAL, "%s: rank %d: tag %d is negative (tags are 0 to %d)", fn, rank,
                        tag, INT32_MAX);
    if (!buf && count)
        return td__fail(TD_EINVAL, "%s: rank %d: buffer is NULL with count %zu", fn, rank, count);
    size_t es = td_dtype_size(dtype);
    if (count > SIZE_MAX / es)
        return td__fail(TD_EINVAL, "%s: rank %d: count %zu overflows", fn, rank, count);
    td_request *r = calloc(1, sizeof *r);
    if (!r) return td__fail(TD_ENOMEM, "%s: out of memory", fn);
    pthread_mutex_lock(&comm->lock);
    td_status failed = comm->failed;
    if (!failed)
        r->rec = td__rec_post(&comm->rec, comm, is_send ? TD__REC_SEND : TD__REC_RECV,
                              comm->rec.p2p_seq++, count, dtype, 0, peer, tag, TD__REC_RUNNING);
    pthread_mutex_unlock(&comm->lock);
    if (failed) {
        free(r);
        return td__fail(failed, "%s: %s: the group failed earlier: %s", fn,
                        td__who(&comm->names, rank).s, comm->failed_msg);
    }
    r->kind = peer == rank ? ITEM_SELF : ITEM_P2P;
    r->comm = comm;
    td_status s = stage(r, is_send, &buf, count * es, fn, rank);
    if (s) {
        td__rec_end(r->rec, s);
        free(r);
        return s;
    }
    if (peer == rank)
        s = is_send ? td__self_send(comm->self, buf, count * es, tag, rank, &r->p2p)
                    : td__self_recv(comm->self, buf, count * es, tag, rank, &r->p2p);
    else
        s = is_send ? comm->ops->isend(comm->ctx, buf, count * es, peer, tag, &r->p2p)
                    : comm->ops->irecv(comm->ctx, buf, count * es, peer, tag, &r->p2p);
    if (s) {
        td__rec_end(r->rec, s);
        free(r->staged);
        free(r);
        return s;
    }
    *req = r;
    return TD_OK;
}

td_status td_comm_isend(td_comm *comm, const void *buf, size_t count, td_dtype dtype, int dst,
                        int tag, td_request **req) {
    return p2p_post(comm, 1, (void *)buf, count, dtype, dst, tag, req);
}

td_status td_comm_irecv(td_comm *comm, void *buf, size_t count, td_dtype dtype, int src, int tag,
                        td_request **req) {
    return p2p_post(comm, 0, buf, count, dtype, src, tag, req);
}

td_status td_comm_send(td_comm *comm, const void *buf, size_t count, td_dtype dtype, int dst,
                       int tag) {
    td_request *r;
    td_status s = td_comm_isend(comm, buf, count, dtype, dst, tag, &r);
    return s ? s : td_request_wait(r);
}

td_status td_comm_recv(td_comm *comm, void *buf, size_t count, td_dtype dtype, int src, int tag) {
    td_request *r;
    td_status s = td_comm_irecv(comm, buf, count, dtype, src, tag, &r);
    return s ? s : td_request_wait(r);
}

/* ---------------------------------------------------------------- requests */

/* Ends a completed point-to-point request: a received message goes to its device. */
static td_status p2p_done(td_request *req, td_status s) {
    if (req->staged && req->is_recv && s == TD_OK)
        s = td_device_copy(req->device, req->user, td_device_cpu(), req->staged, req->staged_bytes);
    td__rec_end(req->rec, s);
    free(req->staged);
    free(req);
    return s;
}

static td_status p2p_result(td_request *req, td_status s) {
    td_comm *comm = req->comm;
    if (s == TD_EPEER || s == TD_ETIMEOUT) {
        td__rec_end(req->rec, s); /* failed before the dump that poison writes */
        req->rec = NULL;
        poison(comm, s);
    }
    return p2p_done(req, s);
}

td_status td_request_wait(td_request *req) {
    if (!req) return td__fail(TD_EINVAL, "td_request_wait: req is NULL");
    td_comm *comm = req->comm;
    if (req->kind == ITEM_P2P || req->kind == ITEM_SELF) {
        td__rec_current = req->rec; /* the backend's wait stamps it */
        td_status s = req->kind == ITEM_P2P
                          ? comm->ops->p2p_wait(comm->ctx, req->p2p, comm->timeout_s)
                          : td__self_wait(comm->self, req->p2p, comm->timeout_s,
                                          comm->shape.rank);
        td__rec_current = NULL;
        return req->kind == ITEM_P2P ? p2p_result(req, s) : p2p_done(req, s);
    }
    pthread_mutex_lock(&comm->lock);
    while (!req->done) pthread_cond_wait(&comm->cond, &comm->lock);
    pthread_mutex_unlock(&comm->lock);
    td_status s = req->status ? td__fail(req->status, "%s", req->error) : TD_OK;
    free(req);
    return s;
}

td_status td_request_test(td_request *req, int *done) {
    if (!req || !done) return td__fail(TD_EINVAL, "td_request_test: NULL req or done");
    td_comm *comm = req->comm;
    if (req->kind == ITEM_P2P) {
        td_status s = comm->ops->p2p_test(comm->ctx, req->p2p, done);
        if (*done) return p2p_result(req, s);
        return s;
    }
    if (req->kind == ITEM_SELF) {
        td_status s = td__self_test(comm->self, req->p2p, done);
        return *done ? p2p_done(req, s) : s;
    }
    pthread_mutex_lock(&comm->lock);
    *done = req->done;
    pthread_mutex_unlock(&comm->lock);
    if (!*done) return TD_OK;
    td_status s = req->status ? td__fail(req->status, "%s", req->error) : TD_OK;
    free(req);
    return s;
}

td_status td_request_waitall(size_t n, td_request **reqs) {
    if (n && !reqs) return td__fail(TD_EINVAL, "td_request_waitall: reqs is NULL");
    td_status first = TD_OK;
    char msg[1024] = "";
    for (size_t i = 0; i < n; i++) {
        if (!reqs[i]) continue;
        td_status s = td_request_wait(reqs[i]);
        reqs[i] = NULL;
        if (s && !first) {
            first = s;
            snprintf(msg, sizeof msg, "request %zu: %s", i, td_last_error());
        }
    }
    return first ? td__fail(first, "%s", msg) : TD_OK;
}
