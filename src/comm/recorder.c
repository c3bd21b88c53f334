/* The flight recorder's memory: each group's ring of its last calls (posted by comm.c, stamped
 * by the backends' waits, see recorder.h), the strategy's tag for a thread's next call
 * (td_comm_tag), the rank's progress marks (step, micro-batch, the op it computes) and the
 * registry of the process's live groups that a dump walks. The registry and the marks are the
 * process's own, like the log hook: a dump asked for by a signal must find every group. It
 * writes nothing out; dump.c does. */
#include "tandem/recorder.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/recorder.h"
#include "core/core_impl.h"

_Thread_local td__rec_entry *td__rec_current __attribute__((tls_model("initial-exec")));
_Thread_local td__rec_entry *td__rec_stamped __attribute__((tls_model("initial-exec")));
_Thread_local const void *td__rec_tag_comm __attribute__((tls_model("initial-exec")));
_Thread_local char td__rec_tag_text[TD__REC_TAG] __attribute__((tls_model("initial-exec")));
_Atomic int64_t td__rec_step = -1;
static _Atomic int32_t micro_batch_mark = -1;

/* Calls each group remembers unless TANDEM_DOCTOR_CALLS says otherwise (a power of two). */
#define REC_CALLS 2048

/* Groups destroyed lately whose calls dumps still show, newest first. */
#define REC_RETIRED 4

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static td__rec *registry, *retired;

/* The marks a dump reports; the op's name is copied under a sequence count (odd while it is
 * written) so that a dump never reads half of two names. */
static struct {
    _Atomic uint32_t gen;
    char op[48];
    const char *phase;
    _Atomic uint64_t op_since, step_since;
    _Atomic int rank, world_size;
    const char *creating;
    uint64_t creating_since;
} marks = {.rank = -1};

/* TANDEM_DOCTOR=0 turns the recorder off: read when a group is created. */
static int recording(void) {
    const char *v = getenv("TANDEM_DOCTOR");
    return !(v && strcmp(v, "0") == 0);
}

/* The op marks, read once: a graph marks every op, and its sweeps must not read the
 * environment each time. 1 on, 0 off, -1 not read yet. */
static _Atomic int op_marks = -1;

static size_t ring_calls(void) {
    const char *v = getenv("TANDEM_DOCTOR_CALLS");
    long n = v && *v ? atol(v) : REC_CALLS;
    size_t calls = 16;
    while (calls < (size_t)n && calls < ((size_t)1 << 20)) calls *= 2;
    return calls;
}

void td__rec_init(td__rec *r, uint64_t key, const td__names *names, int rank, int size,
                  const char *backend) {
    memset(r, 0, sizeof *r);
    r->key = key;
    r->names = names;
    r->rank = rank;
    r->size = size;
    r->backend = backend;
    if (recording()) {
        size_t n = ring_calls();
        r->ring = calloc(n, sizeof *r->ring);
        r->tags = calloc(n, sizeof *r->tags);
        if (!r->ring || !r->tags) {
            free(r->ring);
            free(r->tags);
            r->ring = NULL;
            r->tags = NULL;
            td__log(TD_LOG_WARN, "rank %d: the flight recorder is off: out of memory", rank);
        }
        r->mask = n - 1;
    }
    pthread_mutex_lock(&registry_lock);
    r->next = registry;
    if (registry) registry->prev = r;
    registry = r;
    pthread_mutex_unlock(&registry_lock);
}

static void rec_free(td__rec *r) {
    free(r->ring);
    free(r->tags);
    td__names_free(&r->own_names);
    free(r);
}

void td__rec_fini(td__rec *r) {
    /* A copy that owns the ring and the members' names outlives the group. */
    td__rec *keep = r->ring ? malloc(sizeof *keep) : NULL;
    int *world = keep && r->names && r->names->world ? malloc((size_t)r->size * sizeof *world)
                                                     : NULL;
    if (keep) {
        *keep = *r;
        keep->destroyed = 1;
        if (world) memcpy(world, r->names->world, (size_t)r->size * sizeof *world);
        td__names_init(&keep->own_names, r->size, world);
        keep->names = &keep->own_names;
    }
    pthread_mutex_lock(&registry_lock);
    if (r->prev) r->prev->next = r->next;
    if (r->next) r->next->prev = r->prev;
    if (registry == r) registry = r->next;
    td__rec *old = NULL;
    if (keep) {
        keep->prev = NULL;
        keep->next = retired;
        retired = keep;
        int n = 0;
        for (td__rec *k = retired; k; k = k->next)
            if (++n == REC_RETIRED && k->next) {
                old = k->next;
                k->next = NULL;
            }
    }
    pthread_mutex_unlock(&registry_lock);
    while (old) {
        td__rec *next = old->next;
        rec_free(old);
        old = next;
    }
    if (!keep) {
        free(r->ring);
        free(r->tags);
    }
    r->ring = NULL;
    r->tags = NULL;
}

void td__rec_failed(td__rec *r, const char *why) {
    pthread_mutex_lock(&registry_lock);
    if (!r->failed[0]) snprintf(r->failed, sizeof r->failed, "%s", why);
    pthread_mutex_unlock(&registry_lock);
}

void td__rec_process(int rank, int world_size) {
    int none = -1;
    if (atomic_compare_exchange_strong(&marks.rank, &none, rank))
        atomic_store(&marks.world_size, world_size);
}

void td__rec_creating(const char *backend) {
    pthread_mutex_lock(&registry_lock);
    marks.creating = backend;
    marks.creating_since = backend ? td_time_ns() : 0;
    pthread_mutex_unlock(&registry_lock);
}

td__rec *td__rec_lock(td__rec_marks *m, td__rec **old) {
    pthread_mutex_lock(&registry_lock);
    if (old) *old = retired;
    memset(m, 0, sizeof *m);
    m->rank = atomic_load(&marks.rank);
    m->world_size = atomic_load(&marks.world_size);
    m->creating = marks.creating;
    m->creating_since = marks.creating_since;
    m->step = atomic_load(&td__rec_step);
    m->step_since = atomic_load(&marks.step_since);
    m->micro_batch = atomic_load(&micro_batch_mark);
    for (int tries = 0; tries < 100; tries++) {
        uint32_t g = atomic_load_explicit(&marks.gen, memory_order_acquire);
        if (g & 1) continue;
        memcpy(m->op, marks.op, sizeof m->op);
        m->op_phase = marks.phase;
        m->op_since = atomic_load(&marks.op_since);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&marks.gen, memory_order_relaxed) == g) break;
    }
    m->op[sizeof m->op - 1] = 0;
    return registry;
}

void td__rec_unlock(void) { pthread_mutex_unlock(&registry_lock); }

const char *td__rec_kind_name(int kind) {
    switch (kind) {
    case TD__REC_SEND:
        return "send";
    case TD__REC_RECV:
        return "recv";
    case TD__REC_SPLIT:
        return "split";
    case TD__REC_ALLOC:
        return "alloc";
    default:
        return kind >= 0 && kind < TD__COLL_COUNT ? td__coll_name((td__coll_kind)kind) : "?";
    }
}

/* ---------------------------------------------------------------- the public marks */

/* Set once the program numbers its steps itself: the strategies' own count then stops. */
static _Atomic int steps_numbered;

void td_recorder_step(int64_t step) {
    if (step >= 0) {
        atomic_store_explicit(&steps_numbered, 1, memory_order_relaxed);
        atomic_store_explicit(&td__rec_step, step, memory_order_relaxed);
    } else if (atomic_load_explicit(&steps_numbered, memory_order_relaxed)) {
        return;
    } else {
        atomic_fetch_add_explicit(&td__rec_step, 1, memory_order_relaxed);
    }
    atomic_store_explicit(&marks.step_since, td_time_ns(), memory_order_relaxed);
}

void td_recorder_micro_batch(int micro_batch) {
    atomic_store_explicit(&micro_batch_mark, micro_batch, memory_order_relaxed);
}

void td_recorder_op(const char *name, const char *phase) {
    int on = atomic_load_explicit(&op_marks, memory_order_relaxed);
    if (on < 0) atomic_store(&op_marks, on = recording());
    if (!on) return;
    uint32_t g = atomic_load_explicit(&marks.gen, memory_order_relaxed);
    /* One writer at a time (td_dp's replicas compute on several threads): a mark that finds
     * another being written leaves it be. */
    if ((g & 1) || !atomic_compare_exchange_strong(&marks.gen, &g, g + 1)) return;
    if (name) {
        size_t n = strnlen(name, sizeof marks.op - 1);
        memcpy(marks.op, name, n);
        marks.op[n] = 0;
    } else {
        marks.op[0] = 0;
    }
    marks.phase = phase;
    /* The coarse clock (a tick of 1-4 ms, at a seventh of the cost): a graph marks every op, and
     * a dump says how long one has run in tenths of a second. */
    struct timespec ts = {0, 0};
    if (name) clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    atomic_store_explicit(&marks.op_since,
                          (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec,
                          memory_order_relaxed);
    atomic_store_explicit(&marks.gen, g + 2, memory_order_release);
}

void td_comm_tag(const td_comm *comm, const char *fmt, ...) {
    if (!comm || !fmt) {
        td__rec_tag_comm = NULL;
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(td__rec_tag_text, sizeof td__rec_tag_text, fmt, ap);
    va_end(ap);
    td__rec_tag_comm = comm;
}
