/* The channel the mpi backend's collectives run on (p2p_coll.c builds them): non-blocking
 * MPI_Isend / MPI_Irecv on the group's second communicator, polled with MPI_Test, so that every
 * wait stays bounded by the group's timeout (MPI itself has none). Why not MPI's own
 * collectives: the non-blocking ones (MPI_Iallreduce, ...) that a bounded wait needs are
 * several times slower than the blocking ones in Open MPI, while the same algorithms over
 * point-to-point messages match the blocking ones and carry the call check at no cost. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/mpi/mpi_impl.h"
#include "core/core_impl.h"

typedef struct {
    MPI_Request req;
    int recv;
} mpi_msg;

static td_status start(void *vctx, void *buf, size_t bytes, int peer, uint32_t tag, int recv,
                       void **out) {
    td__mpi_ctx *ctx = vctx;
    mpi_msg *m = malloc(sizeof *m);
    if (!m) return td__fail(TD_ENOMEM, "mpi: out of memory for a message");
    m->recv = recv;
    td__mpi_lock();
    int rc = recv ? MPI_Irecv(buf, (int)bytes, MPI_BYTE, peer, (int)tag, ctx->coll, &m->req)
                  : MPI_Isend(buf, (int)bytes, MPI_BYTE, peer, (int)tag, ctx->coll, &m->req);
    td__mpi_unlock();
    if (rc != MPI_SUCCESS) {
        free(m);
        return td__mpi_error(rc, recv ? "MPI_Irecv" : "MPI_Isend");
    }
    *out = m;
    return TD_OK;
}

static td_status t_isend(void *t, const void *buf, size_t bytes, int peer, uint32_t tag,
                         void **req) {
    return start(t, (void *)buf, bytes, peer, tag, 0, req);
}

static td_status t_irecv(void *t, void *buf, size_t cap, int peer, uint32_t tag, void **req) {
    return start(t, buf, cap, peer, tag, 1, req);
}

static td_status t_test(void *t, void *req, int *done, size_t *bytes) {
    (void)t;
    mpi_msg *m = req;
    MPI_Status st;
    td__mpi_lock();
    int rc = MPI_Test(&m->req, done, &st);
    int got = 0;
    if (rc == MPI_SUCCESS && *done && m->recv) MPI_Get_count(&st, MPI_BYTE, &got);
    td__mpi_unlock();
    if (rc != MPI_SUCCESS) {
        *done = 1;
        free(m);
        return td__mpi_error(rc, "MPI_Test");
    }
    if (*done) {
        *bytes = (size_t)got;
        free(m);
    }
    return TD_OK;
}

static void t_cancel(void *t, void *req) {
    (void)t;
    mpi_msg *m = req;
    td__mpi_lock();
    td__mpi_give_up(&m->req, m->recv);
    td__mpi_unlock();
    free(m);
}

static void t_idle(void *t, uint64_t waited_ns) {
    (void)t;
    td__mpi_idle(waited_ns);
}

static void t_describe(void *t, int peer, char *out, size_t cap) {
    td__mpi_describe(t, peer, out, cap);
}

td_status td__mpi_notice_post(td__mpi_ctx *ctx) {
    td__mpi_lock();
    int rc = MPI_Irecv(ctx->notice, (int)sizeof ctx->notice, MPI_CHAR, MPI_ANY_SOURCE,
                       TD__P2P_NOTICE_TAG, ctx->coll, &ctx->notice_req);
    td__mpi_unlock();
    return rc == MPI_SUCCESS ? TD_OK : td__mpi_error(rc, "MPI_Irecv");
}

void td__mpi_notice_cancel(td__mpi_ctx *ctx) {
    if (ctx->notice_req == MPI_REQUEST_NULL) return;
    td__mpi_lock();
    td__mpi_give_up(&ctx->notice_req, 1);
    td__mpi_unlock();
}

/* Sends `why` to every other member and gives the sends 50 ms; those still pending then are
 * detached. */
static void t_notify(void *t, const char *why) {
    td__mpi_ctx *ctx = t;
    int len = (int)(strlen(why) + 1 < TD__P2P_NOTICE_MAX ? strlen(why) + 1 : TD__P2P_NOTICE_MAX);
    MPI_Request *reqs = malloc((size_t)ctx->size * sizeof *reqs);
    if (!reqs) return;
    td__mpi_lock();
    for (int r = 0; r < ctx->size; r++) {
        reqs[r] = MPI_REQUEST_NULL;
        if (r != ctx->rank)
            MPI_Isend(why, len, MPI_CHAR, r, TD__P2P_NOTICE_TAG, ctx->coll, &reqs[r]);
    }
    uint64_t until = td_time_ns() + 50000000u;
    int done = 0;
    while (!done && td_time_ns() < until)
        if (MPI_Testall(ctx->size, reqs, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) break;
    for (int r = 0; !done && r < ctx->size; r++)
        if (reqs[r] != MPI_REQUEST_NULL) MPI_Request_free(&reqs[r]);
    td__mpi_unlock();
    free(reqs);
}

static int t_noticed(void *t, char *why, size_t cap) {
    td__mpi_ctx *ctx = t;
    if (!ctx->noticed && ctx->notice_req != MPI_REQUEST_NULL) {
        int flag = 0;
        td__mpi_lock();
        MPI_Test(&ctx->notice_req, &flag, MPI_STATUS_IGNORE);
        td__mpi_unlock();
        ctx->noticed = flag;
    }
    if (!ctx->noticed) return 0;
    ctx->notice[sizeof ctx->notice - 1] = 0;
    snprintf(why, cap, "%s", ctx->notice);
    return 1;
}

const td__p2p_ops td__mpi_transport = {
    .isend = t_isend,
    .irecv = t_irecv,
    .test = t_test,
    .cancel = t_cancel,
    .idle = t_idle,
    .describe_peer = t_describe,
    .notify = t_notify,
    .noticed = t_noticed,
};
