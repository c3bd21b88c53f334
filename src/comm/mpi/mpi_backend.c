/* The Open MPI backend's life cycle, point-to-point and split: td__mpi_create initialises
 * MPI when nobody has (MPI_THREAD_MULTIPLE, so that the progress thread and the caller may
 * both talk), works on duplicates of MPI_COMM_WORLD, and reads the group's shape from MPI
 * (local rank and size from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED), the host's index from
 * the lowest rank on each host).
 *
 * MPI has no timeouts, so every wait here is a non-blocking call polled against the group's
 * timeout. MPI can be initialised only once per process, so when we initialised it we finalise
 * it at process exit (atexit), not when the last group is destroyed: a program may create a
 * group again later; but not after a group failed in flight (a peer gone, a link down), as
 * MPI_Finalize would wait for the lost peers forever. A program that initialised MPI itself
 * also finalises it itself, after destroying its groups.
 *
 * It does not launch processes (mpirun/srun do) and does not look at the tandemrun
 * environment: under MPI the ranks are MPI's. The collectives are p2p_coll.c's, over the
 * channel in mpi_transport.c. */
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/mpi/mpi_impl.h"
#include "comm/recorder.h"
#include "core/core_impl.h"

static pthread_mutex_t mpi_mutex = PTHREAD_MUTEX_INITIALIZER;
static int mpi_serialise; /* set once at initialisation, read-only afterwards */
/* A group of this process failed with messages in flight: when a peer is gone or its link is
 * down, MPI_Finalize, which waits for every peer, never returns. */
static _Atomic int mpi_failed;

void td__mpi_lock(void) {
    if (mpi_serialise) pthread_mutex_lock(&mpi_mutex);
}

void td__mpi_unlock(void) {
    if (mpi_serialise) pthread_mutex_unlock(&mpi_mutex);
}

td_status td__mpi_error(int code, const char *call) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0, cls = MPI_ERR_OTHER;
    if (MPI_Error_string(code, text, &len) != MPI_SUCCESS)
        snprintf(text, sizeof text, "code %d", code);
    MPI_Error_class(code, &cls);
    if (cls == MPI_ERR_TRUNCATE) /* a receive shorter than what was sent */
        return td__fail(TD_EMISMATCH, "%s: the sender sent more than the receiver's count (%s)",
                        call, text);
    return td__fail(TD_EBACKEND, "%s failed: %s", call, text);
}

void td__mpi_idle(uint64_t waited_ns) {
    if (waited_ns < 1000000000u) {
        sched_yield();
        return;
    }
    long nap = (long)(waited_ns / 1000u);
    struct timespec ts = {0, nap < 1000000 ? nap : 1000000};
    nanosleep(&ts, NULL);
}

void td__mpi_give_up(MPI_Request *req, int recv) {
    if (*req == MPI_REQUEST_NULL) return; /* MPI_Test already released one that failed */
    int done = 0;
    if (recv) MPI_Cancel(req);
    for (uint64_t until = td_time_ns() + 100000000u; !done && td_time_ns() < until;)
        if (MPI_Test(req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
    if (!done && *req != MPI_REQUEST_NULL) MPI_Request_free(req);
}

void td__mpi_describe(const td__mpi_ctx *ctx, int rank, char *out, size_t cap) {
    int w = rank >= 0 && rank < ctx->size ? ctx->world[rank] : -1;
    const char *host = w >= 0 && w < ctx->job->size ? ctx->job->hosts[w] : NULL;
    if (!ctx->names && w >= 0 && ctx->size != ctx->job->size)
        snprintf(out, cap, "world rank %d on %s", w, host); /* a group the user never sees */
    else
        snprintf(out, cap, "%s", td__who_on(ctx->names, rank, host).s);
}

/* Completes a user point-to-point request by polling within timeout_s; TD_ETIMEOUT names
 * `what` and the rank. */
static td_status wait_request(td__mpi_ctx *ctx, MPI_Request *req, MPI_Status *status,
                              double timeout_s, const char *what) {
    uint64_t start = td_time_ns();
    uint64_t limit = timeout_s > 0 ? (uint64_t)(timeout_s * 1e9) : UINT64_MAX;
    for (unsigned spins = 0;; spins++) {
        int done = 0;
        td__mpi_lock();
        int rc = MPI_Test(req, &done, status);
        td__mpi_unlock();
        if (rc != MPI_SUCCESS) return td__mpi_error(rc, what);
        if (done) return TD_OK;
        uint64_t elapsed = td_time_ns() - start;
        if (elapsed > limit) {
            char me[96];
            td__mpi_describe(ctx, ctx->rank, me, sizeof me);
            return td__fail(TD_ETIMEOUT,
                            "%s on %s of %d timed out after %.3g s (a peer failed, is slow, or "
                            "did not make the same call)",
                            what, me, ctx->size, timeout_s);
        }
        if (spins >= 100) {
            td__rec_waits(start + elapsed, -1); /* the recorder's entry names the peer */
            td__mpi_idle(elapsed);
        }
    }
}

static void *finalize_main(void *done) {
    MPI_Finalize();
    atomic_store((_Atomic int *)done, 1);
    return NULL;
}

/* Finalises MPI at exit when this library initialised it; after a failure in flight, gives
 * MPI_Finalize two seconds (on a separate thread) and lets the process end without it. */
static void finalize_at_exit(void) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (!atomic_load(&mpi_failed)) {
        MPI_Finalize();
        return;
    }
    static _Atomic int done;
    pthread_t t;
    if (pthread_create(&t, NULL, finalize_main, (void *)&done) != 0) return;
    for (int i = 0; i < 200 && !atomic_load(&done); i++) nanosleep(&(struct timespec){0, 10000000}, NULL);
    if (atomic_load(&done)) pthread_join(t, NULL);
}

static td_status ensure_initialised(void) {
    static pthread_mutex_t init_mutex = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&init_mutex);
    int initialised = 0, finalized = 0;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalized);
    td_status st = TD_OK;
    if (finalized) {
        st = td__fail(TD_ESTATE, "MPI was already finalised in this process; the mpi backend needs "
                                 "it running");
    } else if (!initialised) {
        int provided = MPI_THREAD_SINGLE;
        int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
        if (rc != MPI_SUCCESS) {
            st = td__mpi_error(rc, "MPI_Init_thread");
        } else {
            mpi_serialise = provided < MPI_THREAD_MULTIPLE;
            atexit(finalize_at_exit);
        }
    } else {
        int provided = MPI_THREAD_SINGLE;
        MPI_Query_thread(&provided);
        mpi_serialise = provided < MPI_THREAD_MULTIPLE;
    }
    pthread_mutex_unlock(&init_mutex);
    return st;
}

/* Rank and size within this host, and which of the group's hosts this is (hosts in the order
 * of their lowest rank), for the ranks of `comm`. Collective, blocking: only called where
 * every rank is known to be present. */
static td_status host_shape(MPI_Comm comm, int rank, int size, td__group_shape *shape) {
    MPI_Comm node;
    td__mpi_lock();
    int rc = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    int lowest = rank, *all = malloc((size_t)size * sizeof *all);
    if (rc == MPI_SUCCESS) {
        MPI_Comm_rank(node, &shape->local_rank);
        MPI_Comm_size(node, &shape->local_size);
        MPI_Allreduce(MPI_IN_PLACE, &lowest, 1, MPI_INT, MPI_MIN, node);
        MPI_Comm_free(&node);
        if (all) rc = MPI_Allgather(&lowest, 1, MPI_INT, all, 1, MPI_INT, comm);
    }
    td__mpi_unlock();
    if (rc != MPI_SUCCESS || !all) {
        free(all);
        return all ? td__mpi_error(rc, "MPI_Comm_split_type") : td__fail(TD_ENOMEM, "mpi: out of memory");
    }
    shape->nodes = shape->node = 0;
    for (int r = 0; r < size; r++)
        if (all[r] == r) { /* the lowest rank of its host */
            if (r < lowest) shape->node++;
            shape->nodes++;
        }
    free(all);
    return TD_OK;
}

/* Bits of the collectives' tags: as many as MPI_TAG_UB allows, up to TD__P2P_TAG_BITS. */
static int tag_bits(void) {
    void *ub = NULL;
    int flag = 0, bits = 0;
    td__mpi_lock();
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    td__mpi_unlock();
    long max = flag && ub ? *(int *)ub : 32767;
    while (bits < TD__P2P_TAG_BITS && (1l << (bits + 1)) - 1 <= max) bits++;
    return bits;
}

static void job_release(td__mpi_job *job) {
    if (job && atomic_fetch_sub(&job->refs, 1) == 1) {
        free(job->hosts);
        free(job);
    }
}

static void ctx_free(td__mpi_ctx *ctx) {
    if (ctx->p2p.broken || ctx->broken) atomic_store(&mpi_failed, 1);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
        td__mpi_notice_cancel(ctx);
        td__mpi_lock();
        if (ctx->comm != MPI_COMM_NULL) MPI_Comm_free(&ctx->comm);
        if (ctx->coll != MPI_COMM_NULL) MPI_Comm_free(&ctx->coll);
        td__mpi_unlock();
    }
    td__p2p_free(&ctx->p2p);
    free(ctx->world);
    job_release(ctx->job);
    free(ctx);
}

/* Wraps a communicator we own into a context of `job` and fills its shape. Collective. */
static td_status wrap(MPI_Comm comm, td__mpi_job *job, td__mpi_ctx **out, td__group_shape *shape) {
    td__mpi_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) {
        td__mpi_lock();
        MPI_Comm_free(&comm);
        td__mpi_unlock();
        return td__fail(TD_ENOMEM, "mpi backend: out of memory for a group context");
    }
    ctx->comm = comm;
    ctx->coll = MPI_COMM_NULL;
    ctx->notice_req = MPI_REQUEST_NULL;
    ctx->job = job;
    atomic_fetch_add(&job->refs, 1);
    td__mpi_lock();
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN); /* errors come back to us, not abort() */
    MPI_Comm_rank(comm, &ctx->rank);
    MPI_Comm_size(comm, &ctx->size);
    int rc = MPI_Comm_dup(comm, &ctx->coll);
    td__mpi_unlock();
    td_status st = rc == MPI_SUCCESS ? TD_OK : td__mpi_error(rc, "MPI_Comm_dup");
    ctx->world = malloc((size_t)ctx->size * sizeof *ctx->world);
    int *mine = malloc((size_t)ctx->size * sizeof *mine);
    if (st == TD_OK && (!ctx->world || !mine)) st = td__fail(TD_ENOMEM, "mpi: out of memory");
    if (st == TD_OK) {
        MPI_Group group, world;
        td__mpi_lock();
        MPI_Comm_group(comm, &group);
        MPI_Comm_group(MPI_COMM_WORLD, &world);
        for (int r = 0; r < ctx->size; r++) mine[r] = r;
        MPI_Group_translate_ranks(group, ctx->size, mine, world, ctx->world);
        MPI_Group_free(&group);
        MPI_Group_free(&world);
        td__mpi_unlock();
        shape->rank = ctx->rank;
        shape->size = ctx->size;
        st = host_shape(comm, ctx->rank, ctx->size, shape);
    }
    free(mine);
    /* Open MPI's shared-memory transport sends up to 4 KiB (its header included) at once. */
    if (st == TD_OK)
        st = td__p2p_init(&ctx->p2p, &td__mpi_transport, ctx, ctx->rank, ctx->size, tag_bits(),
                          4000);
    if (st != TD_OK) {
        ctx_free(ctx);
        return st;
    }
    td__mpi_lock();
    MPI_Comm_set_errhandler(ctx->coll, MPI_ERRORS_RETURN);
    td__mpi_unlock();
    st = td__mpi_notice_post(ctx);
    if (st != TD_OK) {
        ctx_free(ctx);
        return st;
    }
    *out = ctx;
    return TD_OK;
}

typedef struct {
    MPI_Request req;
    size_t bytes;
    int recv; /* 1 for a receive: its length is checked on completion */
    int peer, tag;
} mpi_p2p;

static td_status check_peer(td__mpi_ctx *ctx, int peer, int tag, size_t bytes, const char *what) {
    if (ctx->broken)
        return td__fail(TD_ESTATE, "mpi %s: the group is unusable after an earlier timeout", what);
    if (peer < 0 || peer >= ctx->size || peer == ctx->rank)
        return td__fail(TD_EINVAL, "mpi %s: peer rank %d is not another rank of this group of %d",
                        what, peer, ctx->size);
    void *tag_ub = NULL;
    int flag = 0;
    td__mpi_lock();
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &flag);
    td__mpi_unlock();
    int max_tag = flag && tag_ub ? *(int *)tag_ub : 32767;
    if (tag < 0 || tag > max_tag)
        return td__fail(TD_EINVAL, "mpi %s: tag %d is outside 0..%d", what, tag, max_tag);
    if (bytes > INT_MAX)
        return td__fail(TD_EUNSUPPORTED,
                        "mpi %s: %zu bytes is more than one MPI message holds (%d)", what, bytes,
                        INT_MAX);
    return TD_OK;
}

static td_status start_p2p(td__mpi_ctx *ctx, void *buf, size_t bytes, int peer, int tag, int recv,
                           void **req) {
    td_status st = check_peer(ctx, peer, tag, bytes, recv ? "irecv" : "isend");
    if (st != TD_OK) return st;
    mpi_p2p *p = calloc(1, sizeof *p);
    if (!p) return td__fail(TD_ENOMEM, "mpi p2p: out of memory");
    p->bytes = bytes;
    p->recv = recv;
    p->peer = peer;
    p->tag = tag;
    td__mpi_lock();
    int rc = recv ? MPI_Irecv(buf, (int)bytes, MPI_BYTE, peer, tag, ctx->comm, &p->req)
                  : MPI_Isend(buf, (int)bytes, MPI_BYTE, peer, tag, ctx->comm, &p->req);
    td__mpi_unlock();
    if (rc != MPI_SUCCESS) {
        free(p);
        return td__mpi_error(rc, recv ? "MPI_Irecv" : "MPI_Isend");
    }
    *req = p;
    return TD_OK;
}

static td_status mpi_isend(void *ctx, const void *buf, size_t bytes, int dst, int tag, void **req) {
    return start_p2p(ctx, (void *)buf, bytes, dst, tag, 0, req);
}

static td_status mpi_irecv(void *ctx, void *buf, size_t bytes, int src, int tag, void **req) {
    return start_p2p(ctx, buf, bytes, src, tag, 1, req);
}

/* A completed transfer: a receive must have got exactly the bytes it asked for. */
static td_status finish_p2p(td__mpi_ctx *ctx, mpi_p2p *p, const MPI_Status *status) {
    td_status st = TD_OK;
    if (p->recv) {
        int got = 0;
        MPI_Get_count(status, MPI_BYTE, &got);
        if ((size_t)got != p->bytes)
            st = td__fail(TD_EMISMATCH,
                          "rank %d received %d bytes from rank %d with tag %d, expected %zu "
                          "(sender and receiver disagree on count or dtype)",
                          ctx->rank, got, p->peer, p->tag, p->bytes);
    }
    free(p);
    return st;
}

static td_status mpi_p2p_wait(void *vctx, void *req, double timeout_s) {
    td__mpi_ctx *ctx = vctx;
    mpi_p2p *p = req;
    MPI_Status status;
    char what[64];
    snprintf(what, sizeof what, "%s with rank %d, tag %d", p->recv ? "recv" : "send", p->peer,
             p->tag);
    td_status st = wait_request(ctx, &p->req, &status, timeout_s, what);
    if (st == TD_OK) return finish_p2p(ctx, p, &status);
    /* Give up on the transfer: a receive can be cancelled; a send cannot (MPI deprecates it),
     * so it is detached and finishes, or not, in the background. */
    td__mpi_lock();
    td__mpi_give_up(&p->req, p->recv);
    td__mpi_unlock();
    free(p);
    return st;
}

static td_status mpi_p2p_test(void *vctx, void *req, int *done) {
    mpi_p2p *p = req;
    MPI_Status status;
    td__mpi_lock();
    int rc = MPI_Test(&p->req, done, &status);
    td__mpi_unlock();
    if (rc != MPI_SUCCESS) {
        *done = 1;
        free(p);
        return td__mpi_error(rc, "MPI_Test");
    }
    return *done ? finish_p2p(vctx, p, &status) : TD_OK;
}

static td_status mpi_split(void *vctx, int color, int key, double timeout_s, void **child,
                           td__group_shape *child_shape, int *members) {
    td__mpi_ctx *ctx = vctx;
    *child = NULL;
    if (ctx->broken)
        return td__fail(TD_ESTATE, "mpi split: the group is unusable after an earlier timeout");
    /* MPI_Comm_split blocks without a bound, so first make sure, within the timeout, that
     * every rank is alive and splitting too. */
    TD__TRY(td__p2p_exchange(&ctx->p2p, NULL, NULL, 0, timeout_s));
    MPI_Comm sub;
    td__mpi_lock();
    int rc = MPI_Comm_split(ctx->comm, color < 0 ? MPI_UNDEFINED : color, key, &sub);
    td__mpi_unlock();
    if (rc != MPI_SUCCESS) return td__mpi_error(rc, "MPI_Comm_split");
    if (sub == MPI_COMM_NULL) return TD_OK;
    td__mpi_ctx *sub_ctx = NULL;
    td_status st = wrap(sub, ctx->job, &sub_ctx, child_shape);
    if (st == TD_OK) *child = sub_ctx;
    /* The child's members as ranks of this group, by their MPI_COMM_WORLD ranks. */
    for (int i = 0; st == TD_OK && i < sub_ctx->size; i++)
        for (int j = 0; j < ctx->size; j++)
            if (ctx->world[j] == sub_ctx->world[i]) members[i] = j;
    return st;
}

static td_status mpi_collective(void *vctx, const td__coll *c, double timeout_s) {
    td__mpi_ctx *ctx = vctx;
    if (ctx->broken) {
        char what[160];
        td__coll_describe_call(what, sizeof what, c);
        return td__fail(TD_ESTATE, "mpi %s: the group is unusable after an earlier failure", what);
    }
    return td__p2p_collective(&ctx->p2p, c, timeout_s);
}

static void mpi_destroy(void *vctx) {
    if (vctx) ctx_free(vctx);
}

/* MPI cannot reach the peers without killing them (MPI_Abort): they learn by the timeout of
 * their next collective with this rank. */
static void mpi_abort(void *vctx, int rank, const char *why) {
    (void)rank, (void)why;
    ((td__mpi_ctx *)vctx)->broken = 1;
}

static void mpi_set_names(void *vctx, const td__names *names) {
    ((td__mpi_ctx *)vctx)->names = names;
}

static const td__backend_ops mpi_ops = {
    .name = "mpi",
    .collective = mpi_collective,
    .isend = mpi_isend,
    .irecv = mpi_irecv,
    .p2p_wait = mpi_p2p_wait,
    .p2p_test = mpi_p2p_test,
    .split = mpi_split,
    .abort = mpi_abort,
    .set_names = mpi_set_names,
    .destroy = mpi_destroy,
};

/* The world's host names, gathered once (blocking: every rank is creating the world). */
static td_status job_create(MPI_Comm comm, td__mpi_job **out) {
    td__mpi_job *job = calloc(1, sizeof *job);
    if (!job) return td__fail(TD_ENOMEM, "mpi: out of memory");
    char name[MPI_MAX_PROCESSOR_NAME] = "", mine[64] = "";
    int len = 0;
    td__mpi_lock();
    MPI_Comm_size(comm, &job->size);
    MPI_Get_processor_name(name, &len);
    job->hosts = calloc((size_t)job->size, sizeof *job->hosts);
    snprintf(mine, sizeof mine, "%.63s", name); /* host names beyond 63 bytes are cut */
    int rc = job->hosts ? MPI_Allgather(mine, 64, MPI_CHAR, job->hosts, 64, MPI_CHAR, comm)
                        : MPI_SUCCESS;
    td__mpi_unlock();
    if (!job->hosts || rc != MPI_SUCCESS) {
        td_status st = job->hosts ? td__mpi_error(rc, "MPI_Allgather")
                                  : td__fail(TD_ENOMEM, "mpi: out of memory");
        free(job->hosts);
        free(job);
        return st;
    }
    job->refs = 1;
    *out = job;
    return TD_OK;
}

td_status td__mpi_create(const td_comm_params *params, void **out, td__group_shape *shape,
                         const td__backend_ops **ops) {
    *out = NULL;
    td_status st = ensure_initialised();
    if (st != TD_OK) return st;
    MPI_Comm comm;
    td__mpi_lock();
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm);
    td__mpi_unlock();
    if (rc != MPI_SUCCESS) return td__mpi_error(rc, "MPI_Comm_dup(MPI_COMM_WORLD)");
    td__mpi_job *job = NULL;
    st = job_create(comm, &job);
    if (st != TD_OK) {
        td__mpi_lock();
        MPI_Comm_free(&comm);
        td__mpi_unlock();
        return st;
    }
    td__mpi_ctx *ctx = NULL;
    st = wrap(comm, job, &ctx, shape);
    job_release(job); /* the context holds its own reference */
    if (st != TD_OK) return st;
    /* Explicit values in params must agree with what MPI says, or the caller is confused
     * about which job it is in. */
    if (params && ((params->rank >= 0 && params->rank != ctx->rank) ||
                   (params->world_size >= 0 && params->world_size != ctx->size))) {
        st = td__fail(TD_EINVAL,
                      "mpi backend: params ask for rank %d of %d but MPI says rank %d of %d",
                      params->rank, params->world_size, ctx->rank, ctx->size);
        mpi_destroy(ctx);
        return st;
    }
    *out = ctx;
    *ops = &mpi_ops;
    return TD_OK;
}
