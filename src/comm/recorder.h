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

/* Bytes of a strategy's tag kept per call ("zero gather unit 5"). */
#define TD__REC_TAG 40

/* One call. The poster fills it; the thread that runs the call moves its state and stamps its
 * waits; a dump reads it without a lock and skips an entry whose seq changed meanwhile. */
typedef struct {
    _Atomic uint64_t seq; /* collectives: the group's sequence number; p2p: the group's
                             point-to-point count */
    uint64_t count;       /* elements (bytes for alloc) */
    uint8_t kind, dtype, op, tagged;
    _Atomic uint8_t state;
    uint8_t pad[3];
    int32_t peer;        /* root of a rooted collective, peer of a send or receive, else -1 */
    int32_t p2p_tag;     /* a send's or receive's tag */
    int32_t status;      /* the td_status a failed call returned */
    int32_t micro_batch; /* the progress marks when it was posted */
    int64_t step;
    _Atomic int32_t waiting_for; /* the group rank a waiting call last waited for, or -1 */
    _Atomic uint64_t wait_ns;    /* td_time_ns when it began waiting past the spin, or 0 */
    _Atomic uint64_t end_ns;     /* td_time_ns when such a call ended, or 0 */
} td__rec_entry;

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

/* Sets up `r` and lists it among the live groups; recording stays off when that fails (a dump
 * then says so) or TANDEM_DOCTOR=0. */
void td__rec_init(td__rec *r, uint64_t key, const td__names *names, int rank, int size,
                  const char *backend);

/* Takes the group off the list; its calls stay in later dumps among the last few groups
 * destroyed (a careful program destroys its groups before it leaves on an error). */
void td__rec_fini(td__rec *r);

/* The progress marks every post copies (recorder.c), and the tag td_comm_tag left for this
 * thread's next call on `td__rec_tag_comm`. */
extern _Atomic int64_t td__rec_step;
extern _Atomic int32_t td__rec_micro_batch;
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
    e->tagged = td__rec_tag_comm == comm;
    if (e->tagged) {
        memcpy(r->tags[slot], td__rec_tag_text, TD__REC_TAG);
        td__rec_tag_comm = NULL;
    }
    e->peer = peer;
    e->p2p_tag = p2p_tag;
    e->status = 0;
    e->step = atomic_load_explicit(&td__rec_step, memory_order_relaxed);
    e->micro_batch = atomic_load_explicit(&td__rec_micro_batch, memory_order_relaxed);
    atomic_store_explicit(&e->waiting_for, -1, memory_order_relaxed);
    atomic_store_explicit(&e->wait_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&e->end_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&e->state, (uint8_t)state, memory_order_release);
    return e;
}

/* Ends a call: its state, and its end time when it waited (so that a fast call reads no
 * clock). */
static inline void td__rec_end(td__rec_entry *e, td_status s) {
    if (!e) return;
    if (s) e->status = (int32_t)s;
    if (atomic_load_explicit(&e->wait_ns, memory_order_relaxed))
        atomic_store_explicit(&e->end_ns, td_time_ns(), memory_order_relaxed);
    atomic_store_explicit(&e->state, s ? TD__REC_FAILED : TD__REC_DONE, memory_order_release);
}

/* A backend's wait outlasted its spin at `now_ns`, waiting for group rank `peer` (-1: not one
 * in particular): stamps the current call, once, and keeps the peer up to date. */
static inline void td__rec_waits(uint64_t now_ns, int peer) {
    td__rec_entry *e = td__rec_current;
    if (!e) return;
    if (!atomic_load_explicit(&e->wait_ns, memory_order_relaxed))
        atomic_store_explicit(&e->wait_ns, now_ns, memory_order_relaxed);
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
