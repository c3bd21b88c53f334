/* The channel the mpi backend's collectives run on (p2p_coll.c builds them): non-blocking
 * MPI_Isend / MPI_Irecv on the group's second communicator, polled with MPI_Test, so that every
 * wait stays bounded by the group's timeout (MPI itself has none). Why not MPI's own
 * collectives: the non-blocking ones (MPI_Iallreduce, ...) that a bounded wait needs are
 * several times slower than the blocking ones in Open MPI, while the same algorithms over
 * point-to-point messages match the blocking ones and carry the call check at no cost. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
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

/* A receive is cancelled; a send cannot be (MPI deprecates it), so it is detached and
 * finishes, or not, in the background. */
static void t_cancel(void *t, void *req) {
    (void)t;
    mpi_msg *m = req;
    td__mpi_lock();
    if (m->req != MPI_REQUEST_NULL) {
        if (m->recv) {
            MPI_Cancel(&m->req);
            MPI_Wait(&m->req, MPI_STATUS_IGNORE);
        } else {
            MPI_Request_free(&m->req);
        }
    }
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

const td__p2p_ops td__mpi_transport = {
    .isend = t_isend,
    .irecv = t_irecv,
    .test = t_test,
    .cancel = t_cancel,
    .idle = t_idle,
    .describe_peer = t_describe,
};
