/* Process groups: point-to-point and collective communication between ranks.
 *
 * A td_comm is an opaque group of `size` ranks. Buffers are typed (`void *`, count, dtype);
 * this layer knows nothing of tensors or graphs. Collectives follow NCCL/MPI: in place when
 * send == recv, size_t counts, and every rank of the group must call the same collectives in
 * the same order. Each collective carries (sequence number, op, dtype, count, root), so ranks
 * that disagree get TD_EMISMATCH naming both calls instead of a hang, and every wait is
 * bounded by the group's timeout: a dead peer becomes TD_EPEER or TD_ETIMEOUT on every
 * surviving rank.
 *
 * Backends: "shm" (one host, POSIX shared memory; the default), "mpi" (Open MPI, chosen
 * automatically under mpirun/srun) and "ucx" (UCX, chosen for ranks on several hosts started
 * by tandemrun --nnodes). The API is the same for all. A group whose ranks span hosts runs its
 * collectives hierarchically by default ("mpi+shm", "ucx+shm"): all-reduce as a reduce-scatter
 * over each host's shared memory, an all-reduce among the ranks of equal local rank across
 * hosts, and an all-gather over shared memory again (as NCCL and Horovod do); broadcast and
 * all-gather likewise. td_comm_params.hierarchical = 0 (or TANDEM_HIERARCHICAL=0) keeps them
 * flat, every rank talking to every other through the inter-host transport.
 *
 * Errors. Which ones leave the group usable:
 *  - usable: arguments rejected on any rank (a NULL buffer, a bad dtype, op or root, a NULL
 *    request pointer): the call still counts on every rank, moves nothing, and every rank gets
 *    the same TD_EINVAL / TD_EDTYPE naming the rank and the call ("rank 1: allreduce #0 (f32, 4
 *    elements, sum): recv is NULL with count 4"), so none waits for the rejected one; receive
 *    buffers of the other ranks may have been partly written. Also TD_ENOMEM from
 *    td_comm_alloc, and p2p argument errors (only the calling rank is involved).
 *  - the group ends: TD_EMISMATCH, TD_EPEER, TD_ETIMEOUT, TD_EBACKEND, and td_comm_abort. From
 *    then on every call on that rank fails fast with the first error; destroy the group.
 *
 * td_comm_alloc gives buffers that every rank's backend can reach: on shm, rank r's buffer is
 * region r of a segment all ranks map (unlinked once mapped, so a crash leaks nothing), and an
 * in-place all-reduce on the same offset of such a buffer on every rank reduces straight from
 * and into the ranks' regions, without the staging copies; so does a reduce-scatter whose send
 * buffer, and an allgather whose receive buffer, lies at the same offset of such a buffer on
 * every rank. Elsewhere (mpi, one rank) it is plain 64-byte aligned memory (page aligned from a
 * page up); other buffers work as before everywhere. */
#ifndef TANDEM_COMM_H
#define TANDEM_COMM_H

#include "tandem/core.h"
#include "tandem/trace.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An opaque process group. */
typedef struct td_comm td_comm;

/* A pending non-blocking operation, completed (and freed) by td_request_wait/test. */
typedef struct td_request td_request;

/* Reduction operators; bf16 and f16 are reduced in f32. AVG is SUM / size. */
typedef enum {
    TD_OP_SUM = 0,
    TD_OP_PROD,
    TD_OP_MIN,
    TD_OP_MAX,
    TD_OP_AVG,
    TD_OP_COUNT
} td_reduce_op;

/* Which transport a group uses. */
typedef enum { TD_BACKEND_AUTO = 0, TD_BACKEND_SHM, TD_BACKEND_MPI, TD_BACKEND_UCX } td_backend;

/* How to create the world group. Fields left at their defaults are read from the environment:
 * torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR,
 * MASTER_PORT, plus TANDEM_TOKEN (the rendezvous store's job token), TANDEM_TIMEOUT (seconds),
 * TANDEM_HIERARCHICAL and TANDEM_STORE_HOSTED; under mpirun or srun, Open MPI's
 * OMPI_COMM_WORLD_* or Slurm's SLURM_* variables. */
typedef struct {
    td_backend backend;      /* TD_BACKEND_AUTO: mpi under an MPI launcher, ucx when the ranks
                                span hosts (local_world_size < world_size), else shm */
    int rank;                /* -1: from the environment */
    int world_size;          /* -1: from the environment */
    int local_rank;          /* -1: from the environment (or rank, on one host) */
    int local_world_size;    /* -1: from the environment (or world_size) */
    const char *master_addr; /* NULL: MASTER_ADDR, else 127.0.0.1 */
    int master_port;         /* 0: MASTER_PORT, else 29500 */
    const char *token;       /* NULL: TANDEM_TOKEN, else no token */
    double timeout_s;        /* 0: TANDEM_TIMEOUT, else 300 */
    int node_rank;           /* ucx: this host's index, -1: NODE_RANK (or GROUP_RANK), else 0 */
    int hierarchical;        /* -1: TANDEM_HIERARCHICAL, else 1; 0: flat collectives across hosts */
    int store_hosted;        /* shm, ucx: -1: TANDEM_STORE_HOSTED, else 0; 1: the store is
                                hosted already (tandemrun --nnodes, the torch backend's rank 0),
                                rank 0 only connects to it */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[68];
} td_comm_params;

/* The defaults described above: everything from the environment. */
td_comm_params td_comm_default_params(void);

/* Creates the world group; collective over all ranks of the job (rank 0 hosts the store). */
td_status td_comm_create(td_comm **out, const td_comm_params *params);

/* Waits for this rank's outstanding work, then frees the group; every member should call it. */
void td_comm_destroy(td_comm *comm);

/* Rank of the caller in the group, 0 .. size-1. */
int td_comm_rank(const td_comm *comm);

/* Number of ranks in the group. */
int td_comm_size(const td_comm *comm);

/* Rank among the group's ranks on this host. */
int td_comm_local_rank(const td_comm *comm);

/* Number of the group's ranks on this host. */
int td_comm_local_size(const td_comm *comm);

/* Which of the group's hosts the caller is on: 0 .. td_comm_num_nodes - 1, hosts numbered in
 * the order of their lowest rank (torchrun's node rank for the world of tandemrun --nnodes). */
int td_comm_node_rank(const td_comm *comm);

/* Number of hosts the group's ranks are on. */
int td_comm_num_nodes(const td_comm *comm);

/* "shm", "mpi", "ucx", or "mpi+shm" / "ucx+shm" for a hierarchical group across hosts. */
const char *td_comm_backend_name(const td_comm *comm);

/* How the group's collectives on device memory run: "nccl" (every rank has a GPU of its own),
 * "cuda-ipc" (the ranks share one GPU), "staged" (through host memory and the backend), or
 * "none" before the group's first collective on a GPU, which picks it. */
const char *td_comm_device_path(const td_comm *comm);

/* Records every collective the group runs, from now on, as a span in `trace` (NULL stops):
 * named as in error messages ("allreduce #12 (f32, 1024 elements, sum)"), category "comm", on
 * the thread that runs it (the caller's, or the group's progress thread, whose row is named
 * "communication"), and linked by the group and the call's sequence number, which are the same
 * on every rank, so that td_trace_write_merged joins the ranks' spans of each call. Groups split
 * from this one afterwards record into the same trace. The trace must outlive every group that
 * records into it. With TANDEM_TRACE=DIR in the environment (tandemrun --trace DIR) every group
 * td_comm_create makes records into a trace of its own, and td_comm_destroy writes the job's
 * trace to DIR/trace.json (docs/tracing.md). */
td_status td_comm_set_trace(td_comm *comm, td_trace *trace);

/* The trace the group records into (td_comm_set_trace, or TANDEM_TRACE's), or NULL: where a
 * program records its own spans to have them in the job's trace. */
td_trace *td_comm_trace(const td_comm *comm);

/* Gathers every rank's `trace` to rank 0, which writes them as one Chrome trace at `path`
 * (td_trace_write_merged: a process row per rank, collectives joined across ranks). Collective;
 * a rank may pass NULL for no spans. Rank 0 returns the outcome of the write; TD_EIO names
 * ranks whose trace did not arrive whole. */
td_status td_comm_trace_write(td_comm *comm, const td_trace *trace, const char *path);

/* Tags the next call this thread makes on `comm` with what it is for, printf-style
 * ("ddp bucket %d", 3; at most 39 bytes are kept): the flight recorder keeps the tag with the
 * call, and dumps and diagnoses name it (tandem/recorder.h). NULL clears a tag not used yet. */
void td_comm_tag(const td_comm *comm, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Sets the bound on every wait of this group, in seconds (> 0). */
td_status td_comm_set_timeout(td_comm *comm, double seconds);

/* Names a sub-group in messages, dumps and the doctor's diagnosis: "group tp0 = {0,1}" instead
 * of "group {0,1}" (1 to 32 characters; give every member the same). The world is not named. */
td_status td_comm_set_name(td_comm *comm, const char *name);

/* Splits the group by colour (MPI_Comm_split): ranks with the same colour >= 0 form a new
 * group ordered by (key, old rank); a negative colour gets *out = NULL. Collective. */
td_status td_comm_split(td_comm *comm, int color, int key, td_comm **out);

/* The group's ranks on the caller's host, in rank order (MPI_Comm_split_type's
 * MPI_COMM_TYPE_SHARED), over shared memory: cheap, as it talks to no other host. Collective
 * over the group. */
td_status td_comm_split_host(td_comm *comm, td_comm **out);

/* A sub-group of the listed ranks, in list order (torch.distributed.new_group). Collective
 * over the parent; ranks not in the list get *out = NULL. */
td_status td_comm_new_group(td_comm *comm, const int *ranks, int n, td_comm **out);

/* Point-to-point, as in MPI: messages between a pair with the same tag arrive in the order
 * sent; the receiver's count and dtype must match the sender's (TD_EMISMATCH otherwise); tags
 * are 0 to INT32_MAX (a negative one is TD_EINVAL); a rank may send to itself (the message is
 * copied, so the send completes at once). When a send returns: on shm once the message is in
 * the pair's 256 KiB mailbox or taken out of it, so at once for a message that fits in its free
 * space and otherwise as the receiver makes progress (inside any tandem call on the group);
 * on mpi when MPI's own send returns (eager for small messages, else on a matching receive).
 * A buffer in GPU memory travels through host memory: a send copies it out when it is posted
 * (after the work the GPU's compute stream queued before), a receive copies it in when it
 * completes; so a GPU buffer of a send may be reused as soon as the call returns. */
td_status td_comm_send(td_comm *comm, const void *buf, size_t count, td_dtype dtype, int dst,
                       int tag);

/* Receives a message sent with td_comm_send / td_comm_isend. */
td_status td_comm_recv(td_comm *comm, void *buf, size_t count, td_dtype dtype, int src, int tag);

/* Non-blocking send; `buf` must stay valid until the request completes. */
td_status td_comm_isend(td_comm *comm, const void *buf, size_t count, td_dtype dtype, int dst,
                        int tag, td_request **req);

/* Non-blocking receive. */
td_status td_comm_irecv(td_comm *comm, void *buf, size_t count, td_dtype dtype, int src, int tag,
                        td_request **req);

/* recv[i] = op over ranks of send[i], on every rank. */
td_status td_comm_allreduce(td_comm *comm, const void *send, void *recv, size_t count,
                            td_dtype dtype, td_reduce_op op);

/* Like allreduce, with the result only on `root` (recv ignored elsewhere). */
td_status td_comm_reduce(td_comm *comm, const void *send, void *recv, size_t count, td_dtype dtype,
                         td_reduce_op op, int root);

/* Copies root's buf to every rank's buf. */
td_status td_comm_broadcast(td_comm *comm, void *buf, size_t count, td_dtype dtype, int root);

/* recv (size * count) = every rank's send (count), in rank order. send is read where it points,
 * inside recv or not, on every backend and device path: at recv + rank * count the call is in
 * place (NCCL's form, no copy); send == recv takes recv's first block as this rank's input. */
td_status td_comm_allgather(td_comm *comm, const void *send, void *recv, size_t count,
                            td_dtype dtype);

/* Like allgather (in place alike), with the result only on `root`. */
td_status td_comm_gather(td_comm *comm, const void *send, void *recv, size_t count, td_dtype dtype,
                         int root);

/* Rank i's recv (count) = root's send[i * count ..]. */
td_status td_comm_scatter(td_comm *comm, const void *send, void *recv, size_t count, td_dtype dtype,
                          int root);

/* Rank i's recv (count) = op over ranks of send[i * count ..] (send holds size * count). */
td_status td_comm_reduce_scatter(td_comm *comm, const void *send, void *recv, size_t count,
                                 td_dtype dtype, td_reduce_op op);

/* td_comm_allreduce's SUM of f32, its additions in one fixed order at any group size and on any
 * backend: the aligned pairwise tree over the ranks in rank order, ((r0 + r1) + (r2 + r3)) + ...,
 * the bits one process gets adding the ranks' buffers pairwise (deterministic mode's levels
 * above the ranks). In place when send == recv. Other dtypes are TD_EDTYPE. */
td_status td_comm_allreduce_tree(td_comm *comm, const void *send, void *recv, size_t count,
                                 td_dtype dtype);

/* td_comm_reduce_scatter's SUM of f32 in td_comm_allreduce_tree's order: rank i's recv (count)
 * = the pairwise tree over the ranks of send[i * count ..]. */
td_status td_comm_reduce_scatter_tree(td_comm *comm, const void *send, void *recv, size_t count,
                                      td_dtype dtype);

/* Rank i's recv[j * count ..] = rank j's send[i * count ..]; send == recv in place. */
td_status td_comm_alltoall(td_comm *comm, const void *send, void *recv, size_t count,
                           td_dtype dtype);

/* Returns once every rank has entered the barrier. */
td_status td_comm_barrier(td_comm *comm);

/* Collective, same bytes on every rank: 64-byte aligned memory in-place all-reduces favour. */
td_status td_comm_alloc(td_comm *comm, size_t bytes, void **out);

/* Frees td_comm_alloc memory (local, before td_comm_destroy, with no request still using it). */
void td_comm_free(td_comm *comm, void *ptr);

/* Non-blocking collectives: the same arguments, queued in call order and run by the group's
 * progress thread; buffers must stay valid until the request completes. */
td_status td_comm_iallreduce(td_comm *comm, const void *send, void *recv, size_t count,
                             td_dtype dtype, td_reduce_op op, td_request **req);

/* Non-blocking td_comm_reduce. */
td_status td_comm_ireduce(td_comm *comm, const void *send, void *recv, size_t count, td_dtype dtype,
                          td_reduce_op op, int root, td_request **req);

/* Non-blocking td_comm_broadcast. */
td_status td_comm_ibroadcast(td_comm *comm, void *buf, size_t count, td_dtype dtype, int root,
                             td_request **req);

/* Non-blocking td_comm_allgather. */
td_status td_comm_iallgather(td_comm *comm, const void *send, void *recv, size_t count,
                             td_dtype dtype, td_request **req);

/* Non-blocking td_comm_gather. */
td_status td_comm_igather(td_comm *comm, const void *send, void *recv, size_t count, td_dtype dtype,
                          int root, td_request **req);

/* Non-blocking td_comm_scatter. */
td_status td_comm_iscatter(td_comm *comm, const void *send, void *recv, size_t count,
                           td_dtype dtype, int root, td_request **req);

/* Non-blocking td_comm_reduce_scatter. */
td_status td_comm_ireduce_scatter(td_comm *comm, const void *send, void *recv, size_t count,
                                  td_dtype dtype, td_reduce_op op, td_request **req);

/* Non-blocking td_comm_alltoall. */
td_status td_comm_ialltoall(td_comm *comm, const void *send, void *recv, size_t count,
                            td_dtype dtype, td_request **req);

/* Non-blocking td_comm_barrier. */
td_status td_comm_ibarrier(td_comm *comm, td_request **req);

/* Blocks until `req` completes, frees it and returns its status. */
td_status td_request_wait(td_request *req);

/* Sets *done; when done, frees `req` and returns its status (otherwise TD_OK). */
td_status td_request_test(td_request *req, int *done);

/* Waits for all n requests (NULL entries are skipped), frees them and sets each to NULL;
 * returns the first failure in array order, its message naming the request's index. */
td_status td_request_waitall(size_t n, td_request **reqs);

/* How td_comm_agree words a difference: writes what `sig` says where it differs from `other`
 * ("micro_batches = 4"), both signatures given to td_comm_agree; ctx is describe_ctx. */
typedef void (*td_comm_describe_fn)(const void *sig, const void *other, char *out, size_t cap,
                                    void *ctx);

/* What the ranks of a group must agree on before they act on it (td_comm_agree). */
typedef struct {
    const char *what;             /* the messages' first words: "pipeline", "ddp rank 2" */
    td_status local;              /* TD_OK, or the error this rank met getting ready: its message
                                     is this thread's td_last_error() at the call */
    const void *sig;              /* (bytes) what this rank is about to do, compared byte for byte
                                     (zero the padding of structs) */
    size_t bytes;                 /* the same on every rank */
    td_status mismatch;           /* what differing signatures return (0: TD_EMISMATCH) */
    td_comm_describe_fn describe; /* words for one side of a difference (NULL when bytes = 0) */
    void *describe_ctx;
    const char *hint; /* NULL, or what a mismatch message ends with ("; every rank
                         must ...") */
} td_comm_agreement;

/* Checks that every rank of the group is about to do the same thing, before anything that would
 * hang or misread if they were not. Collective: one small all-gather (and a broadcast of the
 * message when a rank failed). Every rank returns the same: TD_OK when every rank's `local` is
 * TD_OK and every signature equals rank 0's; else the status of the lowest rank whose `local`
 * failed, with its message ("<what>: rank R: <its message>", less the "<its what>: " the message
 * began with, so no layer's words come twice; that rank keeps its own message); else `mismatch`
 * with "<what>: rank 0 has <A> but rank R has <B><hint>" for the lowest rank R
 * whose signature differs from rank 0's. A failing collective returns the group's own error. */
td_status td_comm_agree(td_comm *comm, const td_comm_agreement *a);

/* Ends the group on purpose (ncclCommAbort): this rank's operations in flight and later fail
 * with TD_ESTATE; on shm every other rank's current and next operation fails at once with
 * TD_EPEER naming this rank, on mpi they learn at their next collective or by its timeout.
 * The handle must still be destroyed. */
td_status td_comm_abort(td_comm *comm);

/* "sum", "prod", "min", "max", "avg". */
const char *td_reduce_op_name(td_reduce_op op);

#ifdef __cplusplus
}
#endif
#endif
