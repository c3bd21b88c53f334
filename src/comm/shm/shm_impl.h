/* Private to the shm backend (shm.c: segment, waits, collectives; shm_p2p.c: mailboxes).
 * The layout of one group's shared-memory segment and the per-process context.
 *
 * Segment: [head][rank control x n][ring control x n*n][staging: n ranks x 2 parities x
 * chunk][result: 2 parities x chunk][ring data: n*n x SHM_RING].
 *
 * Collectives advance in phases. A phase is: write into buffers of parity (phase & 1), post
 * (my phase counter = phase), wait until every peer has posted it, then read what peers wrote
 * in that phase. A buffer of parity p is rewritten two phases later, which no rank can reach
 * before every reader has posted the phase in which it read: so one barrier per phase is the
 * only synchronisation. Each collective's first phase carries its call (kind, seq, dtype,
 * count, op, root) for the mismatch check.
 *
 * Segments are anonymous memory files (memfd): the creator names one to its peers as
 * /proc/<pid>/fd/<fd>, each peer opens and maps it, and the creator closes its descriptor once
 * all have mapped. Nothing is ever named in /dev/shm, so no crash at any moment, before or
 * after rendezvous, can leave a segment behind: the kernel frees it with its last mapping.
 * td_comm_alloc memory lives in a segment of its own (n regions, one per rank, see shm_reg).
 *
 * Tuning knobs, read when a group is created (the creator's chunk wins for the whole group):
 * TANDEM_SHM_CHUNK (staging bytes per rank per parity, the largest pipeline chunk; default
 * 2 MiB) and TANDEM_SHM_NT (outputs of at least this many bytes are written with streaming
 * stores on CPUs with AVX-512, default 16 MiB). Pages of the segment cost memory only once a
 * collective has used them. */
#ifndef TANDEM_SHM_IMPL_H
#define TANDEM_SHM_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include "tandem/store.h"

#include "comm/comm_impl.h"
#include "core/core_impl.h"

#define SHM_MAGIC 0x31736474u
/* Default staging bytes per rank per parity (TANDEM_SHM_CHUNK): the largest pipeline chunk. */
#define SHM_CHUNK (2u * 1024u * 1024u)
/* The smallest pipeline chunk, unless the staging slot is smaller (see shm_coll.c). */
#define SHM_PIPE_MIN (512u * 1024u)
/* P2p mailbox bytes per ordered pair. */
#define SHM_RING (256u * 1024u)
/* Internal kind: the rendezvous inside td_comm_split. */
#define SHM_COLL_SPLIT 100u
/* Internal kind: the rendezvous inside td_comm_alloc (count = bytes). */
#define SHM_COLL_ALLOC 102u

/* One call as posted in the segment. `reg`/`reg_off` (not part of the mismatch check): an
 * in-place all-reduce on a registered buffer posts its allocation id and offset there, and
 * when every rank posted the same pair the ranks reduce in each other's regions directly.
 * `error` (not TD_OK: this rank's arguments were rejected) comes with a message in the rank's
 * control block. */
typedef struct {
    uint32_t kind, dtype, op;
    int32_t root;
    uint64_t seq, count;
    uint64_t reg, reg_off;
    int32_t error, error_rank; /* error_rank: the rank the error names */
} shm_call;

/* Per-rank control block. Counters are futex words: waiters sleep on their own `bell`,
 * posters ring the bells of peers whose `sleeping` count is non-zero. */
typedef struct {
    _Alignas(64) _Atomic uint32_t phase;
    _Alignas(64) _Atomic uint32_t sleeping;
    _Atomic uint32_t bell;
    _Atomic uint32_t p2p_sleeping;
    _Atomic uint32_t p2p_bell;
    int32_t pid;
    uint64_t cpus[16]; /* the CPUs this rank may run on (its affinity, CPUs 0-1023) */
    _Alignas(64) shm_call call[2];
    char error_msg[2][192]; /* why call[parity].error, when it is set */
} shm_rank;

/* A single-producer single-consumer byte ring from one rank to another. */
typedef struct {
    _Alignas(64) _Atomic uint64_t head; /* bytes written by the sender */
    _Alignas(64) _Atomic uint64_t tail; /* bytes consumed by the receiver */
} shm_ring;

typedef struct {
    uint32_t magic, size;
    uint64_t bytes, chunk;
    _Atomic uint32_t poison; /* 0, or 1 + the rank that aborted the group */
    _Atomic uint32_t poison_ready;
    char poison_msg[384];
} shm_head;

typedef struct shm_p2p_req shm_p2p_req;

/* One td_comm_alloc allocation: rank r's buffer is base + r * region in this mapping. */
typedef struct shm_reg {
    uint64_t id; /* 1, 2, ... in allocation order, so equal on every rank */
    unsigned char *base;
    size_t region, bytes; /* bytes: the whole mapping, size * region */
    struct shm_reg *next;
} shm_reg;

typedef struct shm_ctx {
    int rank, size;
    char name[96];
    void *base;
    size_t bytes, chunk; /* chunk: staging bytes per rank per parity, fixed by the creator */
    size_t stream_min;   /* outputs this large are written with streaming stores (TANDEM_SHM_NT) */
    shm_head *head;
    shm_rank *ranks;
    shm_ring *rings; /* [src * size + dst] */
    unsigned char *staging, *result, *ring_data;
    int fd;         /* this process created the segment and its peers may still open it, else -1 */
    uint32_t phase; /* phases this rank has posted */
    shm_call current;  /* the call whose phases run now: every phase's messages name it */
    uint64_t next_seq; /* the sequence number a split uses */
    uint64_t spin_ns;  /* how long a wait spins before it sleeps */
    int yield;         /* the ranks have fewer CPUs than ranks: spinning yields to them */
    td_store *store;   /* world group only */
    const td__names *names; /* how messages name the members (NULL: by group rank) */
    pthread_mutex_t p2p_lock;
    shm_p2p_req *sends, *recvs; /* pending, in posting order */
    struct shm_unexpected *unexpected;
    struct shm_incoming *incoming; /* [src]: the message being read from each ring */
    pthread_mutex_t reg_lock;      /* regs: td_comm_free runs on the caller's thread */
    shm_reg *regs;
    uint64_t next_reg; /* allocations made so far */
} shm_ctx;

/* Staging buffer of `rank` for `parity`. */
static inline unsigned char *shm_staging(shm_ctx *c, int rank, unsigned parity) {
    return c->staging + ((size_t)rank * 2 + parity) * c->chunk;
}

/* Futex wrappers over shared (not process-private) words. */
void td__shm_futex_wait(_Atomic uint32_t *word, uint32_t expected, uint64_t max_ns);
void td__shm_futex_wake(_Atomic uint32_t *word);

/* Marks the group failed for every rank (first caller's message wins) and wakes everyone;
 * returns `status` with td__fail's message set. */
td_status td__shm_poison(shm_ctx *c, td_status status, const char *fmt, ...) TD__PRINTF(3, 4);

/* The TD_EPEER error a rank reports after another rank aborted the group. */
td_status td__shm_poisoned(shm_ctx *c, const char *what);

/* One phase: publishes `call` (first phase of a collective, else NULL; `error_msg` with a
 * call whose error is set), posts, waits for every peer to post, then returns the lowest
 * rank's rejected arguments if any rank posted an error, and otherwise checks that every peer
 * published the same call. */
td_status td__shm_step(shm_ctx *c, const shm_call *call, const char *error_msg,
                       uint64_t timeout_ns);

/* Every rank's `bytes` of `mine` into all[rank * bytes], as one internal collective `call`. */
td_status td__shm_allgather_bytes(shm_ctx *c, const shm_call *call, const void *mine, void *all,
                                  size_t bytes, uint64_t timeout_ns);

/* td_comm_alloc / td_comm_free (shm.c). */
td_status td__shm_alloc(void *ctx, size_t bytes, double timeout_s, void **out);
void td__shm_free(void *ctx, void *ptr);

/* The allocation whose region of this rank holds [p, p + bytes), with *off = p's offset in the
 * region; NULL when there is none. */
const shm_reg *td__shm_reg_find(shm_ctx *c, const void *p, size_t bytes, size_t *off);

/* Runs one user collective (shm_coll.c). */
td_status td__shm_collective(void *ctx, const td__coll *coll, double timeout_s);

/* Point-to-point (shm_p2p.c). */
td_status td__shm_isend(void *ctx, const void *buf, size_t bytes, int dst, int tag, void **req);
td_status td__shm_irecv(void *ctx, void *buf, size_t bytes, int src, int tag, void **req);
td_status td__shm_p2p_wait(void *ctx, void *req, double timeout_s);
td_status td__shm_p2p_test(void *ctx, void *req, int *done);
void td__shm_p2p_free(shm_ctx *c);

#endif
