/* A rank's dump: TANDEM_DOCTOR_DIR/rank<R>.json, written when one of its groups fails, when
 * another rank's dump appears in the directory (inotify: the rank that holds the job up sees
 * nothing wrong itself), when a signal asks (SIGUSR1: the job goes on; SIGTERM: then the rank dies
 * as it would have), or on td_recorder_dump. It holds every live group's recent calls (recorder.c), the progress marks,
 * the first failure the rank met and every thread's stack, as a JSON object whose
 * "traceEvents" are the calls that waited, as spans a trace viewer opens, and whose "doctor"
 * member is what tandem-doctor reads (src/doctor/).
 *
 * A signal handler only writes a byte to a pipe; a thread of the recorder's own writes the dump,
 * so the handler stays async-signal-safe. Each other thread's stack is taken by sending it a
 * real-time signal whose handler calls backtrace() (glibc's unwinder, loaded once beforehand so
 * that the handler does not load it), and named by core's symbols.c. Limits: frames of code
 * without unwind tables may stop the walk; a stripped file gives offsets (addr2line -e finds
 * them); a thread in a system call the signal interrupts sees EINTR (a nanosleep returns early);
 * a thread that never returns from the kernel, or that the handler finds in the middle of the
 * dynamic loader, gives no stack within 100 ms and the dump says so. Handlers are installed only
 * where the program left the signal's default action. */
#include <dirent.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "tandem/recorder.h"

#include "comm/recorder.h"
#include "core/core_impl.h"

#define STACK_FRAMES 48
#define MAX_THREADS 128

/* ---------------------------------------------------------------- stacks */

/* The real-time signal that asks one thread for its stack (0: the program uses it). */
static int probe_signal;

static struct {
    _Atomic int tid; /* the thread asked */
    _Atomic int done;
    int n;
    void *frames[STACK_FRAMES];
} probe;

static void on_probe(int sig) {
    (void)sig;
    int saved = errno;
    if ((int)syscall(SYS_gettid) == atomic_load(&probe.tid)) {
        /* Without this handler and the kernel's signal trampoline: where the thread was. */
        void *frames[STACK_FRAMES + 2];
        int n = backtrace(frames, STACK_FRAMES + 2);
        probe.n = n > 2 ? n - 2 : 0;
        memcpy(probe.frames, frames + 2, (size_t)probe.n * sizeof *frames);
        atomic_store(&probe.done, 1);
    }
    errno = saved;
}

typedef struct {
    int tid;
    char name[32];
    int n; /* frames, or -1 when the thread did not answer */
    void *frames[STACK_FRAMES];
} thread_stack;

/* This process's threads and their stacks; returns how many (at most cap). */
static int take_stacks(thread_stack *out, int cap) {
    DIR *d = opendir("/proc/self/task");
    if (!d) return 0;
    int n = 0, self = (int)syscall(SYS_gettid);
    pid_t pid = getpid();
    struct dirent *e;
    while ((e = readdir(d)) && n < cap) {
        int tid = atoi(e->d_name);
        if (tid <= 0) continue;
        thread_stack *t = &out[n++];
        t->tid = tid;
        t->n = -1;
        char path[64];
        snprintf(path, sizeof path, "/proc/self/task/%d/comm", tid);
        FILE *f = fopen(path, "r");
        if (!f || !fgets(t->name, sizeof t->name, f)) snprintf(t->name, sizeof t->name, "?");
        if (f) fclose(f);
        t->name[strcspn(t->name, "\n")] = 0;
        if (tid == self) {
            t->n = backtrace(t->frames, STACK_FRAMES);
            continue;
        }
        /* A thread that blocks the probe would never answer. */
        if (!probe_signal || td__proc_signal((int)pid, tid, "SigBlk", probe_signal)) continue;
        atomic_store(&probe.done, 0);
        atomic_store(&probe.tid, tid);
        if (syscall(SYS_tgkill, pid, tid, probe_signal) == 0) {
            for (int k = 0; k < 100 && !atomic_load(&probe.done); k++)
                nanosleep(&(struct timespec){0, 1000000}, NULL);
        }
        atomic_store(&probe.tid, 0);
        if (atomic_load(&probe.done)) {
            t->n = probe.n;
            memcpy(t->frames, probe.frames, sizeof t->frames);
        }
    }
    closedir(d);
    return n;
}

/* ---------------------------------------------------------------- JSON */

static void put_str(FILE *f, const char *s) {
    size_t n = strlen(s), len = td__json_escape(NULL, 0, s, n);
    char small[512], *buf = len < sizeof small ? small : malloc(len + 1);
    if (!buf) {
        fputs("\"\"", f);
        return;
    }
    td__json_escape(buf, len + 1, s, n);
    fputc('"', f);
    fputs(buf, f);
    fputc('"', f);
    if (buf != small) free(buf);
}

static const char *state_name(int s) {
    static const char *const names[] = {"empty", "queued", "running", "done", "failed"};
    return s >= 0 && s <= TD__REC_FAILED ? names[s] : "?";
}

/* The words a call goes by in messages: "allreduce #12 (f32, 4 elements, sum)", "send #3 to
 * world rank 2 (tag 5, 400 bytes)". */
static void describe_call(const td__rec *r, const td__rec_entry *e, uint64_t seq, char *out,
                          size_t cap) {
    int kind = td__rec_kind(e);
    if (kind < TD__COLL_COUNT) {
        td__coll_describe(out, cap, (td__coll_kind)kind, seq, (td_dtype)td__rec_dtype(e),
                          (size_t)e->count, (td_reduce_op)td__rec_op(e), e->peer);
    } else if (kind == TD__REC_SEND || kind == TD__REC_RECV) {
        snprintf(out, cap, "%s #%llu %s %.200s (tag %d, %llu elements of %s)", td__rec_kind_name(kind),
                 (unsigned long long)seq, kind == TD__REC_SEND ? "to" : "from",
                 td__who(r->names, e->peer).s, e->p2p_tag, (unsigned long long)e->count,
                 td_dtype_name((td_dtype)td__rec_dtype(e)));
    } else {
        snprintf(out, cap, "%s #%llu", td__rec_kind_name(kind), (unsigned long long)seq);
    }
}

/* An entry copied out of a ring that may be rewritten meanwhile: 0 when it was. */
static int read_entry(const td__rec_entry *src, td__rec_entry *e) {
    int state = atomic_load_explicit(&src->state, memory_order_acquire);
    if (state == TD__REC_EMPTY) return 0;
    uint64_t seq = atomic_load_explicit(&src->seq, memory_order_relaxed);
    memcpy((void *)e, (const void *)src, sizeof *e);
    atomic_thread_fence(memory_order_acquire);
    return atomic_load_explicit(&src->seq, memory_order_relaxed) == seq &&
           atomic_load_explicit(&src->state, memory_order_relaxed) != TD__REC_EMPTY;
}

static void put_group(FILE *f, const td__rec *r, uint64_t now, int first, int pid) {
    fprintf(f, "%s\n  {\"key\": \"%016llx\", \"label\": ", first ? "" : ",",
            (unsigned long long)r->key);
    put_str(f, r->names && r->names->world ? r->names->label : "world");
    fputs(", \"members\": [", f);
    for (int i = 0; i < r->size; i++)
        fprintf(f, "%s%d", i ? ", " : "", td__names_world(r->names, i));
    fprintf(f, "], \"rank\": %d, \"backend\": ", r->rank);
    put_str(f, r->backend ? r->backend : "?");
    fputs(", \"failed\": ", f);
    put_str(f, r->failed);
    fprintf(f, ", \"destroyed\": %s", r->destroyed ? "true" : "false");
    uint64_t posted = r->posted, cap = r->ring ? r->mask + 1 : 0;
    fprintf(f, ", \"recording\": %s, \"calls_posted\": %llu, \"calls\": [",
            r->ring ? "true" : "false", (unsigned long long)posted);
    int any = 0;
    for (uint64_t i = posted > cap ? posted - cap : 0; r->ring && i < posted; i++) {
        td__rec_entry e;
        if (!read_entry(&r->ring[i & r->mask], &e)) continue;
        int waited = td__rec_waited(&e), kind = td__rec_kind(&e);
        int state = atomic_load(&e.state), waiting = waited ? atomic_load(&e.waiting_for) : -1;
        uint64_t seq = atomic_load(&e.seq), wait = waited ? atomic_load(&e.wait_ns) : 0;
        uint64_t end = waited && state >= TD__REC_DONE ? wait + 1000ull * atomic_load(&e.waited_us)
                                                       : 0;
        char desc[256];
        describe_call(r, &e, seq, desc, sizeof desc);
        fprintf(f, "%s\n    {\"seq\": %llu, \"kind\": \"%s\", \"desc\": ", any ? "," : "",
                (unsigned long long)seq, td__rec_kind_name(kind));
        put_str(f, desc);
        fprintf(f, ", \"dtype\": \"%s\", \"count\": %llu, \"op\": %d, \"peer\": %d",
                td_dtype_name((td_dtype)td__rec_dtype(&e)), (unsigned long long)e.count,
                td__rec_op(&e),
                e.peer >= 0 && kind >= TD__REC_SEND ? td__names_world(r->names, e.peer) : e.peer);
        fprintf(f, ", \"p2p_tag\": %d, \"tag\": ", kind >= TD__REC_SEND ? e.p2p_tag : -1);
        char tag[TD__REC_TAG] = "";
        if (td__rec_tagged(&e)) {
            memcpy(tag, r->tags[i & r->mask], sizeof tag);
            tag[sizeof tag - 1] = 0;
        }
        put_str(f, tag);
        fprintf(f,
                ", \"state\": \"%s\", \"status\": \"%s\", \"step\": %lld, "
                "\"waiting_for\": %d, \"wait_s\": %.6f, \"ended_s_ago\": %.6f}",
                state_name(state),
                state == TD__REC_FAILED ? td_status_string((td_status)e.status) : "",
                (long long)e.step,
                waiting >= 0 ? td__names_world(r->names, waiting) : -1,
                wait ? (double)((end ? end : now) - wait) / 1e9 : 0.0,
                end ? (double)(now - end) / 1e9 : -1.0);
        any = 1;
    }
    (void)pid;
    fputs("]}", f);
}

static void put_group_events(FILE *f, const td__rec *r, int rank, uint64_t now) {
    uint64_t posted = r->posted, cap = r->ring ? r->mask + 1 : 0;
    for (uint64_t i = posted > cap ? posted - cap : 0; r->ring && i < posted; i++) {
        td__rec_entry e;
        if (!read_entry(&r->ring[i & r->mask], &e) || !td__rec_waited(&e)) continue;
        uint64_t wait = atomic_load(&e.wait_ns), end = 0;
        if (atomic_load(&e.state) >= TD__REC_DONE) end = wait + 1000ull * atomic_load(&e.waited_us);
        char desc[256];
        describe_call(r, &e, atomic_load(&e.seq), desc, sizeof desc);
        fputs(",\n{\"name\": ", f);
        put_str(f, desc);
        fprintf(f,
                ", \"cat\": \"comm\", \"ph\": \"X\", \"pid\": %d, \"tid\": 0, \"ts\": %.3f, "
                "\"dur\": %.3f, \"args\": {\"state\": \"%s\"}}",
                rank, (double)wait / 1e3, (double)((end ? end : now) - wait) / 1e3,
                state_name(atomic_load(&e.state)));
    }
}

/* The calls that waited, of the live groups and the ones destroyed lately, as spans of a trace
 * viewer: the dump opens in Perfetto too. */
static void put_trace_events(FILE *f, const td__rec *live, const td__rec *old, int rank,
                             uint64_t now) {
    fprintf(f,
            "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": "
            "\"rank %d (dump)\"}}",
            rank, rank);
    for (const td__rec *r = live; r; r = r->next) put_group_events(f, r, rank, now);
    for (const td__rec *r = old; r; r = r->next) put_group_events(f, r, rank, now);
}

/* ---------------------------------------------------------------- writing */

static pthread_mutex_t dump_lock = PTHREAD_MUTEX_INITIALIZER;
static char first_failure[1024];
/* A dump for a failure or SIGTERM keeps one written this recently: that one shows where the
 * rank was when the trouble began, and asking for it (a signal) may have moved the rank on
 * (a sleep cut short, a call into a group that failed meanwhile). */
#define DUMP_KEEP_NS 10000000000ull
static _Atomic uint64_t last_dump_ns; /* when the last dump's calls were out */
static _Atomic int dumping_tid;       /* the thread writing a dump now, or 0 */

static int env_rank(void) {
    const char *vars[] = {"RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"};
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return atoi(v);
    }
    return -1;
}

/* Writes body + tail to path atomically (a temporary file, then rename). */
static td_status put_file(const char *path, int rank, const char *body, size_t len,
                          const char *tail, size_t tail_len) {
    char tmp[PATH_MAX + 32];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f)
        return td__fail(TD_EIO, "rank %d: cannot write its dump %s: %s", rank, tmp,
                        strerror(errno));
    fwrite(body, 1, len, f);
    fwrite(tail, 1, tail_len, f);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return td__fail(TD_EIO, "rank %d: cannot write its dump %s: %s", rank, path, strerror(e));
    }
    return TD_OK;
}

/* The threads' stacks as the dump's "threads" member, closing the document. */
static void put_threads(FILE *f, const thread_stack *stacks, int nthreads) {
    td__symbols *names = td__symbols_open();
    fputs("],\n\"threads\": [", f);
    for (int i = 0; i < nthreads; i++) {
        const thread_stack *t = &stacks[i];
        fprintf(f, "%s\n  {\"tid\": %d, \"main\": %s, \"name\": ", i ? "," : "", t->tid,
                t->tid == (int)getpid() ? "true" : "false");
        put_str(f, t->name);
        fputs(", \"stack\": [", f);
        for (int k = 0; k < t->n; k++) {
            char frame[256];
            td__symbolize(names, t->frames[k], frame, sizeof frame);
            fputs(k ? ", " : "", f);
            put_str(f, frame);
        }
        fputs(t->n < 0 ? "], \"answered\": false}" : "], \"answered\": true}", f);
    }
    fputs("]}}\n", f);
    td__symbols_close(names);
}

/* The dump goes out twice: first the calls and marks, read in one go under the registry's lock
 * (a launcher may stop the rank any moment now), then with the threads' stacks, which take a
 * signal per thread. */
static td_status write_dump(const char *dir, const char *why) {
    char *body = NULL, *tail = NULL;
    size_t len = 0, tail_len = 0;
    FILE *f = open_memstream(&body, &len);
    if (!f) return td__fail(TD_ENOMEM, "the dump: out of memory");
    td__rec_marks m;
    td__rec *old = NULL, *groups = td__rec_lock(&m, &old);
    int rank = m.rank >= 0 ? m.rank : env_rank();
    char path[PATH_MAX];
    if (rank >= 0)
        snprintf(path, sizeof path, "%s/rank%d.json", dir, rank);
    else
        snprintf(path, sizeof path, "%s/pid%d.json", dir, (int)getpid());
    uint64_t now = td_time_ns();
    char host[256] = "";
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "?");
    fputs("{\"traceEvents\": [\n", f);
    put_trace_events(f, groups, old, rank, now);
    fprintf(f,
            "],\n\"doctor\": {\"version\": 1, \"rank\": %d, \"world_size\": %d, \"pid\": %d, "
            "\"host\": ",
            rank, m.world_size, (int)getpid());
    put_str(f, host);
    fprintf(f, ", \"time_ns\": %llu, \"why\": ", (unsigned long long)now);
    put_str(f, why ? why : "");
    fputs(", \"failure\": ", f);
    put_str(f, first_failure);
    fprintf(f,
            ",\n\"marks\": {\"step\": %lld, \"step_for_s\": %.6f, \"micro_batch\": %lld, \"op\": ",
            (long long)m.step, m.step_since ? (double)(now - m.step_since) / 1e9 : -1.0,
            (long long)m.micro_batch);
    put_str(f, m.op);
    fputs(", \"phase\": ", f);
    put_str(f, m.op_phase && m.op[0] ? m.op_phase : "");
    fprintf(f, ", \"op_for_s\": %.6f},\n\"creating\": ",
            m.op[0] && m.op_since ? (double)(now - m.op_since) / 1e9 : -1.0);
    if (m.creating) {
        fputs("{\"backend\": ", f);
        put_str(f, m.creating);
        fprintf(f, ", \"for_s\": %.6f}", (double)(now - m.creating_since) / 1e9);
    } else {
        fputs("null", f);
    }
    fputs(",\n\"groups\": [", f);
    int first = 1;
    for (const td__rec *r = groups; r; r = r->next, first = 0) put_group(f, r, now, first, rank);
    for (const td__rec *r = old; r; r = r->next, first = 0) put_group(f, r, now, first, rank);
    td__rec_unlock();
    int bad = ferror(f);
    fclose(f);
    td_status s = bad ? td__fail(TD_ENOMEM, "the dump: out of memory") : TD_OK;
    static const char no_threads[] = "],\n\"threads\": []}}\n";
    if (!s) s = put_file(path, rank, body, len, no_threads, sizeof no_threads - 1);
    if (!s) atomic_store(&last_dump_ns, now);
    /* The stacks after the calls and marks: the signal that asks a thread for its stack cuts
     * its sleep short, and it may move on at once. */
    thread_stack *stacks = s ? NULL : calloc(MAX_THREADS, sizeof *stacks);
    FILE *t = stacks ? open_memstream(&tail, &tail_len) : NULL;
    if (t) {
        put_threads(t, stacks, take_stacks(stacks, MAX_THREADS));
        if (!ferror(t) && fclose(t) == 0) s = put_file(path, rank, body, len, tail, tail_len);
    }
    free(stacks);
    free(tail);
    free(body);
    return s;
}

/* When a dump is written anyway: always (td_recorder_dump); when asked (SIGUSR1) unless the
 * rank dumped for its own failure lately, which says more than what follows it, or dumped at
 * all in the last half second (what the one who asks takes as fresh); when it follows trouble (a
 * failure, SIGTERM, another rank's dump) unless any dump was written lately. */
enum { DUMP_ALWAYS, DUMP_ASKED, DUMP_FOLLOWS };
#define DUMP_FRESH_NS 500000000ull
static uint64_t failure_dump_ns; /* under dump_lock */

static td_status dump_now(const char *dir, const char *why, int when, int failure) {
    pthread_mutex_lock(&dump_lock);
    uint64_t now = td_time_ns();
    td_status s = TD_OK;
    uint64_t last = when == DUMP_ASKED ? failure_dump_ns : atomic_load(&last_dump_ns),
             any = atomic_load(&last_dump_ns);
    int fresh = when == DUMP_ASKED && any && now - any < DUMP_FRESH_NS;
    if (when == DUMP_ALWAYS || (!fresh && (!last || now - last >= DUMP_KEEP_NS))) {
        atomic_store(&dumping_tid, (int)syscall(SYS_gettid));
        s = write_dump(dir, why);
        atomic_store(&dumping_tid, 0);
        if (!s && failure) failure_dump_ns = now;
    }
    pthread_mutex_unlock(&dump_lock);
    return s;
}

void td__doctor_dump(const char *why, const char *failure) {
    const char *dir = getenv("TANDEM_DOCTOR_DIR");
    if (!dir || !*dir) return;
    pthread_mutex_lock(&dump_lock);
    if (failure && !first_failure[0]) snprintf(first_failure, sizeof first_failure, "%s", failure);
    pthread_mutex_unlock(&dump_lock);
    /* The caller's error message is its thread's last error: keep it through the dump. */
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", td_last_error());
    if (dump_now(dir, why, DUMP_FOLLOWS, failure != NULL) != TD_OK)
        td__log(TD_LOG_WARN, "%s", td_last_error());
    td__fail(TD_OK, "%s", saved);
}

td_status td_recorder_dump(const char *why) {
    const char *dir = getenv("TANDEM_DOCTOR_DIR");
    if (!dir || !*dir)
        return td__fail(TD_ESTATE, "td_recorder_dump: TANDEM_DOCTOR_DIR says nowhere to write");
    return dump_now(dir, why ? why : "td_recorder_dump", DUMP_ALWAYS, 0);
}

/* ---------------------------------------------------------------- the dump thread and signals */

static int wake[2] = {-1, -1};
static _Atomic int started_pid;
static _Atomic int term_dumped; /* the dump SIGTERM asked for is written */

static void on_dump_signal(int sig) {
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    ssize_t unused = write(wake[1], &b, 1);
    (void)unused;
    if (sig == SIGTERM) {
        /* Die as SIGTERM would have, once the dump is out (or after 3 s without it); at once
         * when one is out already (the keep rule of dump_now), or this thread is writing one,
         * which holds the lock the dump thread would need. */
        uint64_t last = atomic_load(&last_dump_ns);
        int self = (int)syscall(SYS_gettid), mine = atomic_load(&dumping_tid) == self;
        int recent = last && td_time_ns() - last < DUMP_KEEP_NS;
        for (int k = 0; k < 3000 && !mine && !recent && !atomic_load(&term_dumped); k++)
            nanosleep(&(struct timespec){0, 1000000}, NULL);
        /* A dump another thread is writing (its stacks, say) is let finish, for a second. */
        for (int k = 0; k < 1000 && !mine && atomic_load(&dumping_tid); k++)
            nanosleep(&(struct timespec){0, 1000000}, NULL);
        signal(SIGTERM, SIG_DFL);
        raise(SIGTERM);
    }
    errno = saved;
}

static int watch = -1; /* inotify on the dump directory, or -1 */

/* Whether another rank's dump was just put in the directory (the events read from `watch`). */
static int another_dumped(void) {
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    td__rec_marks m;
    td__rec_lock(&m, NULL);
    td__rec_unlock();
    char mine[32];
    snprintf(mine, sizeof mine, "rank%d.json", m.rank >= 0 ? m.rank : env_rank());
    int other = 0;
    ssize_t n;
    while ((n = read(watch, buf, sizeof buf)) > 0)
        for (char *p = buf; p < buf + n;) {
            const struct inotify_event *e = (const struct inotify_event *)p;
            size_t len = e->len ? strlen(e->name) : 0;
            if (len > 9 && strncmp(e->name, "rank", 4) == 0 && strcmp(e->name + len - 5, ".json") == 0 &&
                strcmp(e->name, mine) != 0)
                other = 1;
            p += sizeof *e + e->len;
        }
    return other;
}

/* The dump thread: a signal's byte on `wake`, or another rank's dump appearing in the directory
 * (a rank whose group failed dumps at once; the others follow, so that the rank that held the
 * job up is caught where it is, whatever the launcher does next). */
static void *doctor_main(void *arg) {
    (void)arg;
    /* SIGUSR1 sent to this thread (tandemrun does so, finding it by its name) interrupts no
     * one else; SIGTERM goes to a thread that can wait for the dump. */
    sigset_t block;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &block, NULL);
    const char *dir = getenv("TANDEM_DOCTOR_DIR");
    for (;;) {
        struct pollfd fds[2] = {{wake[0], POLLIN, 0}, {watch, POLLIN, 0}};
        if (poll(fds, watch >= 0 ? 2 : 1, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        const char *why = NULL;
        int when = DUMP_FOLLOWS;
        if (fds[0].revents) {
            unsigned char b;
            ssize_t n = read(wake[0], &b, 1);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            /* SIGUSR1 asks for the rank as it is now; SIGTERM ends a job that went wrong. */
            why = b == SIGTERM ? "SIGTERM" : "SIGUSR1";
            when = b == SIGTERM ? DUMP_FOLLOWS : DUMP_ASKED;
        } else if (watch >= 0 && fds[1].revents && another_dumped()) {
            why = "another rank dumped";
        }
        if (why && dump_now(dir, why, when, 0) != TD_OK) td__log(TD_LOG_WARN, "%s", td_last_error());
        if (why && strcmp(why, "SIGTERM") == 0) atomic_store(&term_dumped, 1);
    }
    return NULL;
}

/* Installs `fn` for `sig` where the program left the default action; 1 when it did. */
static int take_signal(int sig, void (*fn)(int)) {
    struct sigaction old, sa;
    if (sigaction(sig, NULL, &old) != 0 || (old.sa_flags & SA_SIGINFO) || old.sa_handler != SIG_DFL)
        return 0;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = fn;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    return sigaction(sig, &sa, NULL) == 0;
}

void td__doctor_start(void) {
    static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
    const char *dir = getenv("TANDEM_DOCTOR_DIR");
    if (!dir || !*dir) return;
    pthread_mutex_lock(&start_lock);
    if (atomic_load(&started_pid) == (int)getpid()) { /* a forked child starts its own */
        pthread_mutex_unlock(&start_lock);
        return;
    }
    atomic_store(&started_pid, (int)getpid());
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        td__log(TD_LOG_WARN, "TANDEM_DOCTOR_DIR=%s: cannot make the directory: %s", dir,
                strerror(errno));
    void *warm[2];
    backtrace(warm, 2); /* loads the unwinder here, not in a signal handler */
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    watch = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    if (watch >= 0 && inotify_add_watch(watch, dir, IN_MOVED_TO) < 0) {
        close(watch);
        watch = -1;
    }
    if (pipe2(wake, O_CLOEXEC) != 0 || pthread_create(&t, &attr, doctor_main, NULL) != 0) {
        td__log(TD_LOG_WARN, "the flight recorder cannot start its dump thread: %s",
                strerror(errno));
    } else {
        pthread_setname_np(t, "tandem-doctor");
        fcntl(wake[1], F_SETFL, fcntl(wake[1], F_GETFL) | O_NONBLOCK);
        take_signal(SIGUSR1, on_dump_signal);
        take_signal(SIGTERM, on_dump_signal);
        /* A real-time signal no one else uses, for the threads' stacks. */
        for (int sig = SIGRTMAX - 2; sig > SIGRTMIN + 2 && !probe_signal; sig--)
            if (take_signal(sig, on_probe)) probe_signal = sig;
    }
    pthread_attr_destroy(&attr);
    pthread_mutex_unlock(&start_lock);
}
