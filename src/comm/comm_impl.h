/* The private contract between the generic process-group layer (comm.c: parameters,
 * environment, request queue, progress thread, sub-groups) and a backend (shm, mpi, ucx, and
 * hier, which composes the others for groups that span hosts). Not installed. A backend fills
 * a td__backend_ops table; the generic layer owns the td_comm and calls the table. Backends
 * run one operation at a time per group for collectives (the generic layer serialises them on
 * the progress thread in call order); point-to-point may run concurrently with a collective. */
#ifndef TANDEM_COMM_IMPL_H
#define TANDEM_COMM_IMPL_H

#include "tandem/comm.h"
#include "tandem/device.h"

/* The collectives, in the words of their error messages. */
typedef enum {
    TD__COLL_ALLREDUCE = 0,
    TD__COLL_REDUCE,
    TD__COLL_BROADCAST,
    TD__COLL_ALLGATHER,
    TD__COLL_GATHER,
    TD__COLL_SCATTER,
    TD__COLL_REDUCE_SCATTER,
    TD__COLL_ALLTOALL,
    TD__COLL_BARRIER,
    TD__COLL_COUNT
} td__coll_kind;

/* One collective call as every rank must agree on it. `count` is the per-rank count for
 * allgather, gather, scatter, reduce_scatter and alltoall, the total otherwise. */
typedef struct td__coll {
    td__coll_kind kind;
    uint64_t seq;     /* 0, 1, 2, ... per group, in call order */
    const void *send; /* == recv for in place */
    void *recv;
    size_t count;
    td_dtype dtype;
    td_reduce_op op; /* reductions only */
    int root;        /* rooted collectives only */
    /* Not TD_OK when this rank's arguments were rejected (error_msg says why): the call still
     * takes its sequence number and the backend's agreement step, so that every rank learns
     * of it and returns the same error, and nothing else happens. */
    td_status error;
    const char *error_msg;
    int error_rank; /* the rank an error names: the caller's rank in the group the user called */
    /* The call every rank must agree on and that messages describe, when this one is a step of
     * a collective of another group (hier.c runs a user's allreduce as steps on its host's and
     * its cross-host groups); NULL: this call itself. Backends compare and describe `sig`'s
     * kind, seq, dtype, count, op and root, and move data as this call says. */
    const struct td__coll *sig;
    /* Where send and recv are: a GPU routes the call through gpu_path.c. */
    td_device device;
} td__coll;

/* The call `c` stands for in agreement checks and messages. */
static inline const td__coll *td__coll_sig(const td__coll *c) { return c->sig ? c->sig : c; }

/* What the backend learned about the job when it was created: the rank's place in the group,
 * among the group's ranks on its host, and which of the group's hosts it is on (hosts are
 * numbered 0 .. nodes-1 in the order of their lowest rank). */
typedef struct {
    int rank, size, local_rank, local_size;
    int node, nodes;
} td__group_shape;

/* How a group's messages name its members (names.c): "rank 3" in the world group, "world rank 3
 * (rank 2 of group {1,2,3})" in any other, so that no one reads a sub-group's rank as a world
 * rank. The generic layer owns one per group and hands the backend a pointer (set_names). */
typedef struct td__names {
    int size;
    int *world;     /* (size) each member's world rank, owned; NULL for the world group itself */
    char label[96]; /* "group {1,2,3}" ("group tp0 = {1,2,3}" once named), "" for the world */
} td__names;

/* Fills `n` for a group of `size` whose members have world ranks `world` (taken over, freed by
 * td__names_free; NULL: the world itself). */
void td__names_init(td__names *n, int size, int *world);
/* Sets the group's label: "group NAME = {1,2,3}", or "group {1,2,3}" when name is NULL; the
 * world group keeps none. */
void td__names_label(td__names *n, const char *name);
void td__names_free(td__names *n);

/* The world rank of group rank `rank` (itself when n is NULL or the world). */
int td__names_world(const td__names *n, int rank);

/* A member's name, returned in a struct so that it can be a printf argument: td__who(n, r).s.
 * n may be NULL ("rank R"); td__who_on adds the member's host (" on HOST") when host is set. */
typedef struct {
    char s[192];
} td__who_text;
td__who_text td__who(const td__names *n, int rank);
td__who_text td__who_on(const td__names *n, int rank, const char *host);

/* A backend: a table of functions over an opaque per-group context. Every function
 * returns a td_status and sets td__fail's message on error; `timeout_s` bounds every wait. */
typedef struct td__backend_ops {
    const char *name;
    /* Runs one collective to completion. Must detect a mismatched peer call (compare kind,
     * seq, dtype, count, op, root) and report both calls and ranks with TD_EMISMATCH. When
     * any rank's call carries an error (this one's or a peer's), every rank returns the error
     * of the lowest such rank, "<call>: rank R: <its message>", with its status (TD_EINVAL or
     * TD_EDTYPE): the group stays usable, so a backend returns those two statuses for nothing
     * else. Receive buffers of the other ranks may have been partly written. A call carrying
     * any other status is a failure met elsewhere (hier.c passes one on): the backend ends the
     * group, telling the other members why as far as it can. */
    td_status (*collective)(void *ctx, const td__coll *coll, double timeout_s);
    /* Starts a point-to-point transfer of `bytes`; *req is the backend's handle. */
    td_status (*isend)(void *ctx, const void *buf, size_t bytes, int dst, int tag, void **req);
    td_status (*irecv)(void *ctx, void *buf, size_t bytes, int src, int tag, void **req);
    /* Completes a p2p handle (and frees it); test sets *done and frees only when done. */
    td_status (*p2p_wait)(void *ctx, void *req, double timeout_s);
    td_status (*p2p_test)(void *ctx, void *req, int *done);
    /* MPI_Comm_split semantics; a negative colour yields *child = NULL. Collective. With a
     * child, members[i] (room for this group's size) is the rank in this group of the child's
     * rank i. */
    td_status (*split)(void *ctx, int color, int key, double timeout_s, void **child,
                       td__group_shape *child_shape, int *members);
    /* Optional (NULL: split by node): the group's ranks on this host, as a group of the
     * backend that serves one host best (*child_ops says which), without talking to other
     * hosts, with `members` as split's. Collective over the host's ranks. */
    td_status (*split_host)(void *ctx, double timeout_s, void **child, td__group_shape *child_shape,
                            const struct td__backend_ops **child_ops, int *members);
    /* Optional (NULL: plain aligned memory). Collective: `bytes` that every rank of the group
     * can reach, for td_comm_alloc; *out is this rank's part. Local failures are TD_ENOMEM on
     * every rank. Never runs concurrently with a collective of the same group. */
    td_status (*alloc)(void *ctx, size_t bytes, double timeout_s, void **out);
    /* Releases what alloc returned; local, and may run while other collectives are in flight. */
    void (*free)(void *ctx, void *ptr);
    /* Optional: td_comm_abort. Ends the group for every rank it can reach, now, `why` being
     * what they report (shm: the segment is poisoned, so every peer's current and next wait
     * fails naming `rank` and `why`). */
    void (*abort)(void *ctx, int rank, const char *why);
    /* Optional: how messages name the members from now on (`names` outlives the context). */
    void (*set_names)(void *ctx, const td__names *names);
    /* Frees the context and everything it holds. */
    void (*destroy)(void *ctx);
} td__backend_ops;

/* Shared-memory backend for the ranks of one host. */
td_status td__shm_create(const td_comm_params *params, void **ctx, td__group_shape *shape,
                         const td__backend_ops **ops);

/* Open MPI backend; returns TD_EUNSUPPORTED when the library was built without MPI. */
td_status td__mpi_create(const td_comm_params *params, void **ctx, td__group_shape *shape,
                         const td__backend_ops **ops);

/* UCX backend (ranks on any hosts, bootstrapped through the store); TD_EUNSUPPORTED when the
 * library was built without UCX. */
td_status td__ucx_create(const td_comm_params *params, void **ctx, td__group_shape *shape,
                         const td__backend_ops **ops);

/* A shm group of this host's ranks whose segment name travels by any means: `share` (unless
 * NULL, for one rank) is called once on every rank, collectively; rank 0 passes the name of the
 * segment it made (empty when it could not make one) and every other rank receives it. */
typedef td_status (*td__shm_share_fn)(void *arg, int rank, char name[96], double timeout_s);
td_status td__shm_create_local(int rank, int size, td__shm_share_fn share, void *arg,
                               double timeout_s, void **ctx, td__group_shape *shape,
                               const td__backend_ops **ops);

/* Wraps a group that spans hosts (`flat`, any backend with collectives and split) into one
 * whose collectives run hierarchically (hier.c): a shm group per host for the steps inside a
 * host and a split of `flat` among the ranks of equal local rank for the steps across hosts.
 * On success the hier group owns `flat_ctx`; on failure the caller still does. */
td_status td__hier_create(const td__backend_ops *flat_ops, void *flat_ctx,
                          const td__group_shape *flat_shape, double timeout_s, void **ctx,
                          td__group_shape *shape, const td__backend_ops **ops);

/* A group's path for collectives on device memory (gpu_path.c): NCCL, CUDA IPC or staging
 * through host memory, picked on the first such call. */
typedef struct td__gpu_path td__gpu_path;

/* Runs `k` (buffers on k->device) on the group of ops/ctx, creating *path on the first call;
 * every step on the host path stands for k, so disagreeing ranks are named as usual. */
td_status td__gpu_collective(const td__backend_ops *ops, void *ctx, const td__group_shape *shape,
                             td__gpu_path **path, const td__coll *k, double timeout_s);
void td__gpu_path_abort(td__gpu_path *p);
void td__gpu_path_destroy(td__gpu_path *p);
/* "nccl", "cuda-ipc", "staged", or "none" before the first call. */
const char *td__gpu_path_name(const td__gpu_path *p);

/* One step of collective `c` on the group of ops/ctx (hier.c and gpu_path.c run a user's call
 * as such steps): it agrees on c's call and carries c's rejected arguments, if any (coll.c). */
td_status td__coll_step(const td__backend_ops *ops, void *ctx, const td__coll *c,
                        td__coll_kind kind, const void *send, void *recv, size_t count,
                        td_dtype dtype, td_reduce_op op, int root, double timeout_s);

/* "allreduce", "broadcast", ... (coll.c) */
const char *td__coll_name(td__coll_kind kind);

/* 1 for allreduce, reduce and reduce_scatter. */
int td__coll_is_reduction(td__coll_kind kind);

/* 1 for reduce, broadcast, gather and scatter. */
int td__coll_is_rooted(td__coll_kind kind);

/* Messages a rank sends to itself (self.c): a mailbox with the calls of a backend's p2p,
 * `rank` only naming the rank in messages. A send completes at once. */
typedef struct td__self_box td__self_box;
td_status td__self_box_create(td__self_box **out);
void td__self_box_destroy(td__self_box *box);
td_status td__self_send(td__self_box *box, const void *buf, size_t bytes, int tag, int rank,
                        void **req);
td_status td__self_recv(td__self_box *box, void *buf, size_t bytes, int tag, int rank, void **req);
td_status td__self_wait(td__self_box *box, void *req, double timeout_s, int rank);
td_status td__self_test(td__self_box *box, void *req, int *done);

/* Fills every defaulted field of `in` from the environment (env.c): rank, sizes, master
 * address and port, token, timeout and a concrete backend. Strings point into `in` or the
 * environment. TD_EINVAL names a missing or malformed variable. */
td_status td__comm_resolve_params(const td_comm_params *in, td_comm_params *out);

/* dst[i] = op over the nsrc sources of src[j][i], folded in source order so every rank that
 * reduces the same sources gets the same bits; bf16/f16 accumulate in f32, AVG divides the
 * sum by `avg_div` (integers: truncated toward zero). dst may be one of the sources. */
void td__reduce(void *dst, const void *const *src, int nsrc, size_t count, td_dtype dtype,
                td_reduce_op op, int avg_div);

/* Writes "allreduce #3 (f32, 1024 elements, sum)" for error messages. */
void td__coll_describe(char *out, size_t cap, td__coll_kind kind, uint64_t seq, td_dtype dtype,
                       size_t count, td_reduce_op op, int root);

/* td__coll_describe of the call `c` stands for (its sig). */
void td__coll_describe_call(char *out, size_t cap, const td__coll *c);

/* The job's trace for a group td_comm_create made, when TANDEM_TRACE names a directory (*dir
 * gets a copy of it), already set on the group; else NULL. Never fails the group: a trace it
 * cannot make is logged. */
td_trace *td__comm_job_trace_open(td_comm *comm, char **dir);

/* At td_comm_destroy: gathers the job's trace to rank 0, which writes DIR/trace.json (where
 * that fails, each rank writes DIR/rank<R>.json), then frees the trace and dir. */
void td__comm_job_trace_close(td_comm *comm, td_trace *trace, char *dir);

#endif
