/* Private to the Open MPI backend: its per-group context and what its two files share
 * (mpi_backend.c: life cycle, point-to-point, split, the group's place on its hosts;
 * mpi_transport.c: the channel its collectives run on). Compiled only when the build found
 * mpicc (TD_HAVE_MPI). */
#ifndef TANDEM_MPI_IMPL_H
#define TANDEM_MPI_IMPL_H

#include <mpi.h>
#include <stdatomic.h>

#include "comm/comm_impl.h"
#include "comm/p2p_coll.h"

/* What every group of one world shares: the world's host names, for messages. */
typedef struct {
    _Atomic int refs;
    int size;
    char (*hosts)[64]; /* (size) MPI_Get_processor_name of each world rank */
} td__mpi_job;

/* One process group: two communicators of our own (duplicates or splits), never the user's
 * MPI_COMM_WORLD: `comm` for the user's point-to-point, `coll` for the collectives' messages,
 * so that neither can match the other's. */
typedef struct {
    MPI_Comm comm, coll;
    int rank, size;
    int *world; /* (size) each member's rank in MPI_COMM_WORLD */
    const td__names *names; /* how messages name the members (NULL: by world rank) */
    td__mpi_job *job;
    td__p2p p2p; /* the collectives (p2p_coll.c) over mpi_transport.c */
    MPI_Request notice_req;           /* the receive of a failure notice from any member */
    char notice[TD__P2P_NOTICE_MAX];  /* its text */
    int noticed;
    _Atomic int broken; /* a wait timed out and MPI may still deliver into it: unusable */
} td__mpi_ctx;

/* Serialises MPI calls when the library gave us less than MPI_THREAD_MULTIPLE. */
void td__mpi_lock(void);
void td__mpi_unlock(void);

/* An MPI error code turned into TD_EBACKEND with MPI's own words (TD_EMISMATCH for a message
 * longer than its receive). */
td_status td__mpi_error(int code, const char *call);

/* What a wait that made no progress for `waited_ns` does: poll on (MPI moves data only inside
 * our MPI_Test calls) while yielding the core, and back off into sleeps of up to 1 ms only after
 * a second, which is a slow or dead peer rather than a transfer. */
void td__mpi_idle(uint64_t waited_ns);

/* Gives up on an unfinished request (called with the MPI lock held): a receive is cancelled,
 * and anything still not done 100 ms later (a send, or a receive whose message has begun to
 * arrive over a link that went down) is detached to finish, or not, in the background. */
void td__mpi_give_up(MPI_Request *req, int recv);

/* "rank 3 (host tdhost1)" for member `rank` of the group. */
void td__mpi_describe(const td__mpi_ctx *ctx, int rank, char *out, size_t cap);

/* The transport the collectives run on: messages on ctx->coll. */
extern const td__p2p_ops td__mpi_transport;

/* Posts the group's receive of failure notices; td__mpi_notice_cancel takes it back. */
td_status td__mpi_notice_post(td__mpi_ctx *ctx);
void td__mpi_notice_cancel(td__mpi_ctx *ctx);

#endif
