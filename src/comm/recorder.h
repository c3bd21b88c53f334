/* The flight recorder's private side (recorder.c: the rings, tags, progress marks and the
 * registry of live groups; dump.c: writing a rank's dump and the thread and signals that ask
 * for one). Not installed.
 *
 * Every group keeps a ring of its last calls. Posting one is a handful of stores into a
 * 64-byte entry under the group's lock, which the caller holds anyway: no clock is read, as a
 * small all-reduce takes well under a microsecond and the recorder must cost about 1% of it. A
 * call that has to wait longer than the backend spins is stamped by the backend (td__rec_waits)
 * with when it began waiting and on whom, and then also with when it ended: a hang, and where
 * the time of a slow job goes, are in the waits that last. */
#ifndef TANDEM_COMM_RECORDER_H
#define TANDEM_COMM_RECORDER_H

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "comm/comm_impl.h"

/* What a ring entry records, beside the collectives (td__coll_kind). */
enum {
    TD__REC_SEND = 16,
    TD__REC_RECV,
    TD__REC_SPLIT,
    TD__REC_ALLOC,
};

/* Where a call is. */
enum { TD__REC_EMPTY = 0, TD__REC_QUEUED, TD__REC_RUNNING, TD__REC_DONE, TD__REC_FAILED };

/* Bytes of a strategy's tag kept per call ("ddp bucket 3"). */
#define TD__REC_TAG 40

/* One call, 64 bytes. The poster fills the first 40 with a few stores; the thread that runs the
 * call moves its state, and stamps the last 24 only when the call waits past the backend's
 * spin (valid while wait_seq holds the entry's key, so they are never cleared). A dump reads
 * entries without a lock and skips one whose seq changed meanwhile. */
typedef struct {
    _Atomic uint64_t seq; /* collectives: the group's sequence number; p2p: the group's
                             point-to-point count */
    uint64_t count;       /* elements (bytes for alloc) */
    uint8_t kind, dtype, op;
    uint8_t tagged;       /* the tags' slot of the same index holds its tag */
    _Atomic uint8_t state;
    int8_t status;        /* the td_status a failed call returned */
    int16_t pad;
    int32_t peer;         /* root of a rooted collective, peer of a send or receive, else -1 */
    int32_t p2p_tag;      /* a send's or receive's tag (not written for collectives) */
    int64_t step;         /* the step mark when it was posted */
    _Atomic uint64_t wait_seq;   /* td__rec_key once this call waited past the spin */
    _Atomic uint64_t wait_ns;    /* td_time_ns when it began waiting */
    _Atomic uint32_t waited_us;  /* how long it waited, once it ended */
    _Atomic int32_t waiting_for; /* the group rank it last waited for, or -1 */
} td__rec_entry;

static inline int td__rec_kind(const td__rec_entry *e) { return e->kind; }
static inline int td__rec_dtype(const td__rec_entry *e) { return e->dtype; }
static inline int td__rec_op(const td__rec_entry *e) { return e->op; }
static inline int td__rec_tagged(const td__rec_entry *e) { return e->tagged; }
/* The key that ties an entry's wait fields to its call: the seq and the kind (a send's count
 * and a collective's sequence number may be equal), never 0, which a fresh ring holds. */
static inline uint64_t td__rec_key(const td__rec_entry *e) {
    return (atomic_load_explicit(&e->seq, memory_order_relaxed) + 1) ^ (uint64_t)e->kind << 56;
}

/* Whether the entry's wait fields belong to its call. */
static inline int td__rec_waited(const td__rec_entry *e) {
    return atomic_load_explicit(&e->wait_seq, memory_order_relaxed) == td__rec_key(e);
}

/* A group's recorder. `lock` is the group's: posts happen under it. */
typedef struct td__rec {
    td__rec_entry *ring; /* (mask + 1), NULL when recording is off (TANDEM_DOCTOR=0) */
    char (*tags)[TD__REC_TAG];
    uint64_t mask;
    uint64_t posted;  /* entries written so far */
    uint64_t p2p_seq; /* sends and receives posted so far */
    /* Who the group is, for dumps: the same key on every member (the trace's), its members,
     * this rank in it and its backend; `failed`, once it failed, why. */
    uint64_t key;
    const td__names *names;
    int rank, size;
    const char *backend;
    char failed[512];
    int destroyed;        /* a group destroyed lately, kept for dumps (recorder.c) */
    td__names own_names;  /* a destroyed group's copy of its names */
    struct td__rec *prev, *next; /* the registry of live groups (recorder.c) */
} td__rec;

/* The entry of the call that runs on this thread now (set around a backend's wait), for the
 * backend to stamp; NULL when none. */
extern _Thread_local td__rec_entry *td__rec_current __attribute__((tls_model("initial-exec")));

/* The entry this thread's waits stamped last (td__rec_waits), so that ending any other call
 * reads neither its wait fields nor a clock. */
extern _Thread_local td__rec_entry *td__rec_stamped __attribute__((tls_model("initial-exec")));

/* Sets up `r` and lists it among the live groups; recording stays off when that fails (a dump
 * then says so) or TANDEM_DOCTOR=0. */
void td__rec_init(td__rec *r, uint64_t key, const td__names *names, int rank, int size,
                  const char *backend);

/* Takes the group off the list; its calls stay in later dumps among the last few groups
 * destroyed (a careful program destroys its groups before it leaves on an error). */
void td__rec_fini(td__rec *r);

/* The step mark every post copies (recorder.c), and the tag td_comm_tag left for this thread's
 * next call on `td__rec_tag_comm`. */
extern _Atomic int64_t td__rec_step;
extern _Thread_local const void *td__rec_tag_comm __attribute__((tls_model("initial-exec")));
extern _Thread_local char td__rec_tag_text[TD__REC_TAG] __attribute__((tls_model("initial-exec")));

/* A new entry for a call of `comm` (the group td_comm_tag names), under the group's lock; NULL
 * when recording is off. Inline: it is on the path of every call. */
static inline td__rec_entry *td__rec_post(td__rec *r, const void *comm, int kind, uint64_t seq,
                                          size_t count, int dtype, int op, int peer, int p2p_tag,
                                          int state) {
    if (!r->ring) return NULL;
    uint64_t slot = r->posted++ & r->mask;
    td__rec_entry *e = &r->ring[slot];
    /* Empty while rewritten: a dump that reads it meanwhile skips it (see dump.c). */
    atomic_store_explicit(&e->state, TD__REC_EMPTY, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&e->seq, seq, memory_order_relaxed);
    e->count = count;
    e->kind = (uint8_t)kind;
    e->dtype = (uint8_t)dtype;
    e->op = (uint8_t)op;
    e->tagged = 0;
    if (__builtin_expect(td__rec_tag_comm == comm, 0)) {
        e->tagged = 1;
        memcpy(r->tags[slot], td__rec_tag_text, TD__REC_TAG);
        td__rec_tag_comm = NULL;
    }
    e->peer = peer;
    if (p2p_tag >= 0) e->p2p_tag = p2p_tag;
    e->step = atomic_load_explicit(&td__rec_step, memory_order_relaxed);
    atomic_store_explicit(&e->state, (uint8_t)state, memory_order_release);
    return e;
}

/* Ends a call: its state, and how long it waited when it did (so that a fast call reads no
 * clock, nor its wait fields). */
static inline void td__rec_end(td__rec_entry *e, td_status s) {
    if (!e) return;
    e->status = (int8_t)s;
    if (__builtin_expect(td__rec_stamped == e, 0)) {
        td__rec_stamped = NULL;
        if (td__rec_waited(e)) {
            uint64_t us =
                (td_time_ns() - atomic_load_explicit(&e->wait_ns, memory_order_relaxed)) / 1000;
            atomic_store_explicit(&e->waited_us, us > UINT32_MAX ? UINT32_MAX : (uint32_t)us,
                                  memory_order_relaxed);
        }
    }
    atomic_store_explicit(&e->state, s ? TD__REC_FAILED : TD__REC_DONE, memory_order_release);
}

/* A backend's wait outlasted its spin at `now_ns`, waiting for group rank `peer` (-1: not one
 * in particular): stamps the current call, once, and keeps the peer up to date. */
static inline void td__rec_waits(uint64_t now_ns, int peer) {
    td__rec_entry *e = td__rec_current;
    if (!e) return;
    if (!td__rec_waited(e)) {
        atomic_store_explicit(&e->wait_ns, now_ns, memory_order_relaxed);
        atomic_store_explicit(&e->waited_us, 0, memory_order_relaxed);
        atomic_store_explicit(&e->wait_seq, td__rec_key(e), memory_order_release);
        td__rec_stamped = e;
    }
    atomic_store_explicit(&e->waiting_for, peer, memory_order_relaxed);
}

/* Records why the group failed, for dumps. */
void td__rec_failed(td__rec *r, const char *why);

/* This process's place in the job, once its first group is being created (dump file names). */
void td__rec_process(int rank, int world_size);

/* A group is being created (backend named) since now, or (NULL) no more. */
void td__rec_creating(const char *backend);

/* "allreduce", "send", "split", ... */
const char *td__rec_kind_name(int kind);

/* ---------------------------------------------------------------- dumps (dump.c) */

/* Starts the dump thread and the signal handlers (SIGUSR1: dump; SIGTERM: dump, then die as
 * before) once per process, when TANDEM_DOCTOR_DIR names where dumps go. */
void td__doctor_start(void);

/* Writes this rank's dump now if a dump directory is set: `why` says what asked for it, and a
 * failure's message is kept for every later dump. Never fails the caller. */
void td__doctor_dump(const char *why, const char *failure);

/* What dump.c reads of the recorder (recorder.c), under the registry's lock. */
typedef struct {
    int rank, world_size;
    const char *creating; /* a backend's name while td_comm_create runs, else NULL */
    uint64_t creating_since;
    int64_t step, micro_batch;
    uint64_t step_since;
    char op[48];
    const char *op_phase;
    uint64_t op_since;
} td__rec_marks;

/* Locks the registry and returns its first group (then r->next) and the marks; *retired gets
 * the groups destroyed lately, listed the same way. */
td__rec *td__rec_lock(td__rec_marks *marks, td__rec **retired);
void td__rec_unlock(void);

#endif
