/* Private to the Open MPI backend: its per-group context and the helpers that its two files
 * (mpi_backend.c: life cycle, point-to-point, split; mpi_collective.c: collectives) share.
 * Compiled only when the build found mpicc (TD_HAVE_MPI). */
#ifndef TANDEM_MPI_IMPL_H
#define TANDEM_MPI_IMPL_H

#include <mpi.h>
#include <stdatomic.h>

#include "comm/comm_impl.h"

/* One process group: a communicator of our own (a duplicate or a split), never the
 * user's MPI_COMM_WORLD, so our traffic cannot match theirs. */
typedef struct {
    MPI_Comm comm;
    int rank, size;
    int check; /* exchange call headers before every collective (TANDEM_MPI_CHECK, default 1) */
    _Atomic int broken; /* a collective timed out and may still be in flight: unusable */
} td__mpi_ctx;

/* Serialises MPI calls when the library gave us less than MPI_THREAD_MULTIPLE. */
void td__mpi_lock(void);
void td__mpi_unlock(void);

/* An MPI error code turned into TD_EBACKEND with MPI's own words. */
td_status td__mpi_error(int code, const char *call);

/* Completes `req` by polling (spin, then sleep) within timeout_s (<= 0: no bound);
 * TD_ETIMEOUT names `what` and the rank. */
td_status td__mpi_wait(td__mpi_ctx *ctx, MPI_Request *req, MPI_Status *status, double timeout_s,
                       const char *what);

/* The backend's collective entry (mpi_collective.c). */
td_status td__mpi_collective(void *ctx, const td__coll *coll, double timeout_s);

/* Kind code used in the header exchange of a split, so that a split against a collective
 * is reported as a mismatch too. */
#define TD__MPI_KIND_SPLIT 100

/* Fields of a call header: {kind, seq, dtype, count, op, root, error}, with -1 in the fields
 * the kind does not use and error the td_status of rejected arguments (0: none). */
#define TD__MPI_HDR 7

/* Exchanges this rank's call header with every rank. When any rank's arguments were rejected
 * every rank returns the lowest such rank's error (`error_msg` is this rank's reason, sent to
 * the others); otherwise it fails with TD_EMISMATCH naming both calls when any rank disagrees. */
td_status td__mpi_agree(td__mpi_ctx *ctx, const int64_t hdr[TD__MPI_HDR], const char *error_msg,
                        double timeout_s);

#endif
