/* The Open MPI backend's life cycle, point-to-point and split: td__mpi_create initialises
 * MPI when nobody has (MPI_THREAD_MULTIPLE, so that the progress thread and the caller may
 * both talk), works on a duplicate of MPI_COMM_WORLD, and reads the group's shape from MPI
 * (local rank and size from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)).
 *
 * MPI has no timeouts, so every wait here is a non-blocking call polled by td__mpi_wait
 * against the group's timeout. MPI can be initialised only once per process, so when we
 * initialised it we finalise it at process exit (atexit), not when the last group is
 * destroyed: a program may create a group again later. A program that initialised MPI
 * itself also finalises it itself, after destroying its groups.
 *
 * It does not launch processes (mpirun/srun do) and does not look at the tandemrun
 * environment: under MPI the ranks are MPI's. The collectives are in mpi_collective.c. */
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/mpi/mpi_impl.h"
#include "core/core_impl.h"

static pthread_mutex_t mpi_mutex = PTHREAD_MUTEX_INITIALIZER;
static int mpi_serialise; /* set once at initialisation, read-only afterwards */

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

td_status td__mpi_wait(td__mpi_ctx *ctx, MPI_Request *req, MPI_Status *status, double timeout_s,
                       const char *what) {
    uint64_t start = td_time_ns();
    uint64_t limit = timeout_s > 0 ? (uint64_t)(timeout_s * 1e9) : UINT64_MAX;
    long nap_ns = 10000;
    MPI_Status ignored;
    for (unsigned spins = 0;; spins++) {
        int done = 0;
        td__mpi_lock();
        int rc = MPI_Test(req, &done, status ? status : &ignored);
        td__mpi_unlock();
        if (rc != MPI_SUCCESS) return td__mpi_error(rc, what);
        if (done) return TD_OK;
        uint64_t elapsed = td_time_ns() - start;
        if (elapsed > limit)
            return td__fail(TD_ETIMEOUT,
                            "%s on rank %d of %d timed out after %.3g s (a peer failed, "
                            "is slow, or did not make the same call)",
                            what, ctx->rank, ctx->size, timeout_s);
        /* MPI moves data only inside our MPI_Test calls, so a sleep between calls stalls a
         * transfer that is under way (a 1 ms nap made large all-reduces 3x slower). Poll,
         * yielding the core so that more ranks than cores still progress; only a wait longer
         * than a second, which is a slow or dead peer rather than a transfer, backs off into
         * sleeps of up to 1 ms. */
        if (spins < 100) continue;
        if (elapsed < 1000000000u) {
            sched_yield();
            continue;
        }
        struct timespec ts = {0, nap_ns};
        nanosleep(&ts, NULL);
        if (nap_ns < 1000000) nap_ns *= 2;
    }
}

/* Finalises MPI at exit when this library initialised it. */
static void finalize_at_exit(void) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
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

/* Rank and size within this host, for the ranks of `comm`. */
static td_status local_shape(MPI_Comm comm, int rank, td__group_shape *shape) {
    MPI_Comm node;
    td__mpi_lock();
    int rc = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    if (rc == MPI_SUCCESS) {
        MPI_Comm_rank(node, &shape->local_rank);
        MPI_Comm_size(node, &shape->local_size);
        MPI_Comm_free(&node);
    }
    td__mpi_unlock();
    return rc == MPI_SUCCESS ? TD_OK : td__mpi_error(rc, "MPI_Comm_split_type");
}

/* Wraps a communicator we own into a context and fills its shape. */
static td_status wrap(MPI_Comm comm, td__mpi_ctx **out, td__group_shape *shape) {
    td__mpi_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) {
        td__mpi_lock();
        MPI_Comm_free(&comm);
        td__mpi_unlock();
        return td__fail(TD_ENOMEM, "mpi backend: out of memory for a group context");
    }
    ctx->comm = comm;
    td__mpi_lock();
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN); /* errors come back to us, not abort() */
    MPI_Comm_rank(comm, &ctx->rank);
    MPI_Comm_size(comm, &ctx->size);
    td__mpi_unlock();
    const char *check = getenv("TANDEM_MPI_CHECK");
    ctx->check = !(check && strcmp(check, "0") == 0);
    shape->rank = ctx->rank;
    shape->size = ctx->size;
    td_status st = local_shape(comm, ctx->rank, shape);
    if (st != TD_OK) {
        td__mpi_lock();
        MPI_Comm_free(&ctx->comm);
        td__mpi_unlock();
        free(ctx);
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
    td_status st = td__mpi_wait(ctx, &p->req, &status, timeout_s, what);
    if (st == TD_OK) return finish_p2p(ctx, p, &status);
    /* Give up on the transfer: a receive can be cancelled; a send cannot (MPI deprecates it),
     * so it is detached and finishes, or not, in the background. */
    td__mpi_lock();
    if (p->req != MPI_REQUEST_NULL) { /* MPI_Test already released a request that failed */
        if (p->recv) {
            MPI_Cancel(&p->req);
            MPI_Wait(&p->req, MPI_STATUS_IGNORE);
        } else {
            MPI_Request_free(&p->req);
        }
    }
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
                           td__group_shape *child_shape) {
    td__mpi_ctx *ctx = vctx;
    *child = NULL;
    if (ctx->broken)
        return td__fail(TD_ESTATE, "mpi split: the group is unusable after an earlier timeout");
    /* MPI_Comm_split blocks without a bound, so first make sure, within the timeout, that
     * every rank is alive and splitting too. */
    int64_t hdr[TD__MPI_HDR] = {TD__MPI_KIND_SPLIT, -1, -1, 0, -1, -1, 0};
    td_status st = td__mpi_agree(ctx, hdr, NULL, timeout_s);
    if (st != TD_OK) return st;
    MPI_Comm sub;
    td__mpi_lock();
    int rc = MPI_Comm_split(ctx->comm, color < 0 ? MPI_UNDEFINED : color, key, &sub);
    td__mpi_unlock();
    if (rc != MPI_SUCCESS) return td__mpi_error(rc, "MPI_Comm_split");
    if (sub == MPI_COMM_NULL) return TD_OK;
    td__mpi_ctx *sub_ctx = NULL;
    st = wrap(sub, &sub_ctx, child_shape);
    if (st == TD_OK) *child = sub_ctx;
    return st;
}

static void mpi_destroy(void *vctx) {
    td__mpi_ctx *ctx = vctx;
    if (!ctx) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
        td__mpi_lock();
        MPI_Comm_free(&ctx->comm);
        td__mpi_unlock();
    }
    free(ctx);
}

/* MPI cannot reach the peers without killing them (MPI_Abort): they learn at their next
 * collective's header check, or by its timeout. */
static void mpi_abort(void *vctx, int rank) {
    (void)rank;
    ((td__mpi_ctx *)vctx)->broken = 1;
}

static const td__backend_ops mpi_ops = {
    .name = "mpi",
    .collective = td__mpi_collective,
    .isend = mpi_isend,
    .irecv = mpi_irecv,
    .p2p_wait = mpi_p2p_wait,
    .p2p_test = mpi_p2p_test,
    .split = mpi_split,
    .abort = mpi_abort,
    .destroy = mpi_destroy,
};

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
    td__mpi_ctx *ctx = NULL;
    st = wrap(comm, &ctx, shape);
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
