/* The shm backend's life cycle and synchronisation: creating and opening a group's shared
 * segment (an anonymous memfd the peers open through /proc, see shm_impl.h), splitting groups,
 * the phase barrier with spin-then-futex waits, dead-peer detection and poisoning. The
 * collective algorithms live in shm_coll.c and the mailboxes in shm_p2p.c; this file moves no
 * user data.
 * A peer is dead when kill(pid, 0) says so or /proc shows
 * it a zombie; any rank that sees a death, a timeout or a mismatch poisons the segment, and
 * every other rank then fails fast with TD_EPEER. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "comm/recorder.h"
#include "comm/shm/shm_impl.h"

#define SHM_COLL_CREATE 101u
#define SHM_LIVENESS_NS 5000000ull /* how often a waiter checks that missing peers live */
#define SHM_SLEEP_NS 10000000ull   /* longest futex sleep between checks */

/* A new anonymous memory file of `bytes`, named for the peers as /proc/<pid>/fd/<fd>; *fd
 * stays open (the peers open it through /proc) until shm_file_sealed. */
static td_status shm_file_create(const char *tag, size_t bytes, char name[96], int *fd) {
    char label[64];
    snprintf(label, sizeof label, "tandem-%s", tag);
    *fd = memfd_create(label, MFD_CLOEXEC);
    if (*fd < 0) return td__fail(TD_EIO, "shm: cannot create a memory file: %s", strerror(errno));
    if (ftruncate(*fd, (off_t)bytes) != 0) {
        int e = errno;
        close(*fd);
        *fd = -1;
        return td__fail(TD_EIO, "shm: cannot size a memory file to %zu bytes: %s", bytes,
                        strerror(e));
    }
    snprintf(name, 96, "/proc/%d/fd/%d", (int)getpid(), *fd);
    return TD_OK;
}

/* Every peer has mapped the creator's file: nobody needs to open it again. */
static void shm_file_sealed(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

void td__shm_futex_wait(_Atomic uint32_t *word, uint32_t expected, uint64_t max_ns) {
    struct timespec ts = {(time_t)(max_ns / 1000000000ull), (long)(max_ns % 1000000000ull)};
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

void td__shm_futex_wake(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void ring_all(shm_ctx *c) {
    for (int r = 0; r < c->size; r++) {
        atomic_fetch_add(&c->ranks[r].bell, 1);
        td__shm_futex_wake(&c->ranks[r].bell);
        atomic_fetch_add(&c->ranks[r].p2p_bell, 1);
        td__shm_futex_wake(&c->ranks[r].p2p_bell);
    }
}

td_status td__shm_poison(shm_ctx *c, td_status status, const char *fmt, ...) {
    char msg[sizeof c->head->poison_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    uint32_t zero = 0;
    if (atomic_compare_exchange_strong(&c->head->poison, &zero, (uint32_t)c->rank + 1)) {
        memcpy(c->head->poison_msg, msg, sizeof msg);
        atomic_store(&c->head->poison_ready, 1);
    }
    ring_all(c);
    return td__fail(status, "%s", msg);
}

td_status td__shm_poisoned(shm_ctx *c, const char *what) {
    uint32_t by = atomic_load(&c->head->poison);
    /* The poisoner writes its message right after winning the flag. */
    for (int i = 0; i < 1000 && !atomic_load(&c->head->poison_ready); i++) sched_yield();
    return td__fail(TD_EPEER, "%s: %s: the group was aborted by %s: %s", what,
                    td__who(c->names, c->rank).s, td__who(c->names, (int)by - 1).s,
                    atomic_load(&c->head->poison_ready) ? c->head->poison_msg : "(no message)");
}

static void describe(char *out, size_t cap, const shm_call *k) {
    if (k->kind == SHM_COLL_ALLOC)
        snprintf(out, cap, "alloc #%llu (%llu bytes)", (unsigned long long)k->seq,
                 (unsigned long long)k->count);
    else if (k->kind == SHM_COLL_SPLIT || k->kind == SHM_COLL_CREATE)
        snprintf(out, cap, "%s #%llu", k->kind == SHM_COLL_SPLIT ? "split" : "create",
                 (unsigned long long)k->seq);
    else
        td__coll_describe(out, cap, (td__coll_kind)k->kind, k->seq, (td_dtype)k->dtype,
                          (size_t)k->count, (td_reduce_op)k->op, k->root);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int first_missing(shm_ctx *c, uint32_t target) {
    for (int r = 0; r < c->size; r++)
        if (r != c->rank &&
            (int32_t)(atomic_load_explicit(&c->ranks[r].phase, memory_order_acquire) - target) < 0)
            return r;
    return -1;
}

/* Waits until every peer has posted phase `target`. */
static td_status wait_peers(shm_ctx *c, uint32_t target, const shm_call *call,
                            uint64_t timeout_ns) {
    uint64_t start = td_time_ns(), next_check = start + SHM_LIVENESS_NS,
             deadline = start + timeout_ns;
    char what[160];
    unsigned spins = 0;
    for (;;) {
        int missing = first_missing(c, target);
        if (missing < 0) return TD_OK;
        if (atomic_load_explicit(&c->head->poison, memory_order_relaxed)) {
            describe(what, sizeof what, call);
            return td__shm_poisoned(c, what);
        }
        uint64_t now = td_time_ns();
        if (now - start < c->spin_ns) {
            /* A peer that shares our core cannot arrive while we spin: let it run now and
             * then. Only then: yielding to some other program on our core would hand it a
             * whole time slice while every peer waits for us. */
            if (c->yield && ++spins % 64 == 0)
                sched_yield();
            else
                cpu_relax();
            continue;
        }
        td__rec_waits(now, missing); /* past the spin: the recorder keeps when and on whom */
        if (now >= next_check) {
            next_check = now + SHM_LIVENESS_NS;
            for (int r = missing; r < c->size; r++) {
                if (r == c->rank || (int32_t)(atomic_load(&c->ranks[r].phase) - target) >= 0)
                    continue;
                int pid = c->ranks[r].pid;
                if (td__pid_dead(pid)) {
                    describe(what, sizeof what, call);
                    return td__shm_poison(c, TD_EPEER, "%s: %s: peer %s (pid %d) died", what,
                                          td__who(c->names, c->rank).s, td__who(c->names, r).s,
                                          pid);
                }
            }
            if (now >= deadline) {
                describe(what, sizeof what, call);
                return td__shm_poison(c, TD_ETIMEOUT, "%s: %s: %s did not arrive within %.1f s",
                                      what, td__who(c->names, c->rank).s,
                                      td__who(c->names, missing).s, (double)timeout_ns / 1e9);
            }
        }
        shm_rank *me = &c->ranks[c->rank];
        atomic_fetch_add(&me->sleeping, 1);
        uint32_t bell = atomic_load(&me->bell);
        if (first_missing(c, target) >= 0 && !atomic_load(&c->head->poison)) {
            uint64_t left = deadline > now ? deadline - now : 0;
            td__shm_futex_wait(&me->bell, bell, left < SHM_SLEEP_NS ? left + 1000 : SHM_SLEEP_NS);
        }
        atomic_fetch_sub(&me->sleeping, 1);
    }
}

static void post(shm_ctx *c) {
    uint32_t ph = ++c->phase;
    atomic_store(&c->ranks[c->rank].phase, ph);
    for (int r = 0; r < c->size; r++) {
        if (r == c->rank || !atomic_load(&c->ranks[r].sleeping)) continue;
        atomic_fetch_add(&c->ranks[r].bell, 1);
        td__shm_futex_wake(&c->ranks[r].bell);
    }
}

static int call_equal(const shm_call *a, const shm_call *b) {
    return a->kind == b->kind && a->seq == b->seq && a->dtype == b->dtype && a->count == b->count &&
           a->op == b->op && a->root == b->root;
}

td_status td__shm_step(shm_ctx *c, const shm_call *call, const char *error_msg,
                       uint64_t timeout_ns) {
    unsigned parity = (c->phase + 1) & 1;
    if (call) {
        c->current = *call; /* what the later phases of this call name in messages */
        shm_rank *me = &c->ranks[c->rank];
        me->call[parity] = *call;
        if (call->error)
            snprintf(me->error_msg[parity], sizeof me->error_msg[parity], "%s",
                     error_msg ? error_msg : "invalid arguments");
    }
    if (c->size > 1) {
        post(c);
        td_status s = wait_peers(c, c->phase, &c->current, timeout_ns);
        if (s) return s;
    } else {
        c->phase++;
    }
    if (!call) return TD_OK;
    /* Rejected arguments first: every rank reports the lowest such rank, and the call is
     * over for all of them without poisoning the group. */
    for (int r = 0; r < c->size; r++) {
        const shm_call *theirs = &c->ranks[r].call[parity];
        if (!theirs->error) continue;
        char what[160];
        describe(what, sizeof what, theirs);
        return td__fail((td_status)theirs->error, "%s: %s: %s",
                        td__who(c->names, (int)theirs->error_rank).s, what,
                        c->ranks[r].error_msg[parity]);
    }
    for (int r = 0; r < c->size; r++) {
        const shm_call *theirs = &c->ranks[r].call[parity];
        if (r == c->rank || call_equal(call, theirs)) continue;
        char a[160], b[160];
        describe(a, sizeof a, call);
        describe(b, sizeof b, theirs);
        return td__shm_poison(c, TD_EMISMATCH, "%s called %s but %s called %s",
                              td__who(c->names, c->rank).s, a, td__who(c->names, r).s, b);
    }
    return TD_OK;
}

/* ---------------------------------------------------------------- segments */

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

typedef struct {
    size_t ranks, rings, staging, result, ring_data, total;
} layout;

static layout layout_for(int n, size_t chunk) {
    layout l;
    l.ranks = align_up(sizeof(shm_head), 4096);
    l.rings = align_up(l.ranks + (size_t)n * sizeof(shm_rank), 64);
    l.staging = align_up(l.rings + (size_t)n * n * sizeof(shm_ring), 4096);
    l.result = l.staging + (size_t)n * 2 * chunk;
    l.ring_data = l.result + 2 * chunk;
    l.total = l.ring_data + (n > 1 ? (size_t)n * n * SHM_RING : 0);
    return l;
}

static void attach(shm_ctx *c, void *base, size_t bytes) {
    layout l = layout_for(c->size, c->chunk);
    c->base = base;
    c->bytes = bytes;
    c->head = base;
    c->ranks = (shm_rank *)((char *)base + l.ranks);
    c->rings = (shm_ring *)((char *)base + l.rings);
    c->staging = (unsigned char *)base + l.staging;
    c->result = (unsigned char *)base + l.result;
    c->ring_data = (unsigned char *)base + l.ring_data;
    shm_rank *me = &c->ranks[c->rank];
    me->pid = (int32_t)getpid();
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0)
        for (int i = 0; i < CPU_SETSIZE; i++) CPU_SET(i, &set);
    for (int i = 0; i < CPU_SETSIZE && i < 1024; i++)
        if (CPU_ISSET(i, &set)) me->cpus[i / 64] |= 1ull << (i % 64);
}

/* Once every rank has published its CPUs: how to wait. Spinning pays when the ranks have at
 * least a CPU each (pinned to their own, or free to spread); with fewer CPUs than ranks a
 * spinning rank holds the core a peer needs, so waits spin briefly and yield. */
static void share_cores(shm_ctx *c) {
    uint64_t all[16] = {0};
    for (int r = 0; r < c->size; r++)
        for (int w = 0; w < 16; w++) all[w] |= c->ranks[r].cpus[w];
    int cpus = 0;
    for (int w = 0; w < 16; w++) cpus += __builtin_popcountll(all[w]);
    c->yield = c->size > cpus;
    c->spin_ns = c->yield ? 2000 : 50000;
}

static shm_ctx *ctx_new(int rank, int size) {
    shm_ctx *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->rank = rank;
    c->size = size;
    /* Until the ranks' CPUs are known (share_cores), wait as if they shared them. */
    c->spin_ns = 2000;
    c->yield = 1;
    /* The chunk trades cache fit against barriers per byte; the creator's choice wins. */
    const char *v = getenv("TANDEM_SHM_CHUNK");
    long long want = v ? atoll(v) : 0;
    const char *nt = getenv("TANDEM_SHM_NT");
    c->stream_min = nt && *nt ? (size_t)atoll(nt) : (size_t)16 << 20;
    c->chunk = want >= 65536 && want <= (64ll << 20) ? (size_t)want / 4096 * 4096 : SHM_CHUNK;
    c->fd = -1;
    pthread_mutex_init(&c->p2p_lock, NULL);
    pthread_mutex_init(&c->reg_lock, NULL);
    return c;
}

static void ctx_free(shm_ctx *c) {
    if (!c) return;
    td__shm_p2p_free(c);
    while (c->regs) {
        shm_reg *g = c->regs;
        c->regs = g->next;
        munmap(g->base, g->bytes);
        free(g);
    }
    pthread_mutex_destroy(&c->reg_lock);
    shm_file_sealed(&c->fd);
    if (c->base) munmap(c->base, c->bytes);
    td_store_destroy(c->store);
    pthread_mutex_destroy(&c->p2p_lock);
    free(c);
}

static td_status segment_create(shm_ctx *c, const char *tag) {
    layout l = layout_for(c->size, c->chunk);
    TD__TRY(shm_file_create(tag, l.total, c->name, &c->fd));
    void *base = mmap(NULL, l.total, PROT_READ | PROT_WRITE, MAP_SHARED, c->fd, 0);
    if (base == MAP_FAILED)
        return td__fail(TD_EIO, "shm: cannot map %zu bytes: %s", l.total, strerror(errno));
    shm_head *h = base;
    h->size = (uint32_t)c->size;
    h->bytes = l.total;
    h->chunk = c->chunk;
    attach(c, base, l.total);
    atomic_thread_fence(memory_order_release);
    h->magic = SHM_MAGIC;
    return TD_OK;
}

static td_status segment_open(shm_ctx *c, const char *name) {
    snprintf(c->name, sizeof c->name, "%s", name);
    int fd = open(name, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return td__fail(TD_EIO, "shm: rank %d cannot open rank 0's segment %s: %s", c->rank, name,
                        strerror(errno));
    struct stat sb;
    void *base = MAP_FAILED;
    size_t bytes = 0;
    if (fstat(fd, &sb) == 0 && (size_t)sb.st_size >= sizeof(shm_head)) {
        bytes = (size_t)sb.st_size;
        base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    close(fd);
    if (base == MAP_FAILED) return td__fail(TD_EIO, "shm: rank %d cannot map %s", c->rank, name);
    shm_head *h = base;
    if (h->magic != SHM_MAGIC || h->size != (uint32_t)c->size || h->chunk == 0 ||
        h->chunk > (64u << 20) || layout_for(c->size, (size_t)h->chunk).total != bytes) {
        uint32_t size = h->size;
        munmap(base, bytes);
        return td__fail(TD_EMISMATCH, "shm: %s holds a group of %u ranks, rank %d expected %d",
                        name, size, c->rank, c->size);
    }
    c->chunk = (size_t)h->chunk;
    attach(c, base, bytes);
    return TD_OK;
}

/* After every rank has passed this barrier, every rank has the segment mapped. */
static td_status mapped_barrier(shm_ctx *c, uint32_t kind, uint64_t seq, uint64_t timeout_ns) {
    shm_call call = {.kind = kind, .seq = seq};
    td_status s = td__shm_step(c, &call, NULL, timeout_ns);
    if (!s) shm_file_sealed(&c->fd);
    return s;
}

static void shm_destroy(void *ctx) { ctx_free(ctx); }

static void shm_abort(void *ctx, int rank, const char *why) {
    shm_ctx *c = ctx;
    td__shm_poison(c, TD_EPEER, "%s aborted the group (%s)", td__who(c->names, rank).s, why);
}

static void shm_set_names(void *ctx, const td__names *names) { ((shm_ctx *)ctx)->names = names; }

static td_status shm_split(void *ctx, int color, int key, double timeout_s, void **child,
                           td__group_shape *shape, int *members);

static const td__backend_ops shm_ops = {
    .name = "shm",
    .collective = td__shm_collective,
    .isend = td__shm_isend,
    .irecv = td__shm_irecv,
    .p2p_wait = td__shm_p2p_wait,
    .p2p_test = td__shm_p2p_test,
    .split = shm_split,
    .alloc = td__shm_alloc,
    .free = td__shm_free,
    .abort = shm_abort,
    .set_names = shm_set_names,
    .destroy = shm_destroy,
};

td_status td__shm_create_local(int rank, int n, td__shm_share_fn share, void *arg,
                               double timeout_s, void **ctx, td__group_shape *shape,
                               const td__backend_ops **ops) {
    if (n < 1 || rank < 0 || rank >= n)
        return td__fail(TD_EINVAL, "shm: rank %d / size %d out of range", rank, n);
    shm_ctx *c = ctx_new(rank, n);
    if (!c) return td__fail(TD_ENOMEM, "shm: out of memory");
    td_status s = TD_OK, made = TD_OK;
    char name[96] = "";
    if (rank == 0) {
        made = segment_create(c, "host");
        if (!made) memcpy(name, c->name, sizeof name);
    }
    if (share) s = share(arg, rank, name, timeout_s);
    if (!s) s = made;
    if (!s && rank > 0)
        s = name[0] ? segment_open(c, name)
                    : td__fail(TD_EIO, "shm: rank %d: rank 0 of this host could not create the "
                                       "group's segment", rank);
    if (!s) s = mapped_barrier(c, SHM_COLL_CREATE, 0, (uint64_t)(timeout_s * 1e9));
    if (s) {
        ctx_free(c);
        return s;
    }
    share_cores(c); /* every rank published its CPUs before the barrier */
    *shape = (td__group_shape){rank, n, rank, n, 0, 1};
    *ctx = c;
    *ops = &shm_ops;
    return TD_OK;
}

/* Rank 0 publishes the segment's name in the store, the others wait for it. */
static td_status share_by_store(void *arg, int rank, char name[96], double timeout_s) {
    td_store *store = arg;
    size_t len = 0;
    (void)timeout_s; /* the store's own */
    if (rank == 0) return td_store_set(store, "tandem/shm/world", name, strlen(name) + 1);
    return td_store_get(store, "tandem/shm/world", name, 95, &len);
}

td_status td__shm_create(const td_comm_params *p, void **ctx, td__group_shape *shape,
                         const td__backend_ops **ops) {
    int n = p->world_size, rank = p->rank;
    if (n < 1 || rank < 0 || rank >= n)
        return td__fail(TD_EINVAL, "shm: rank %d / world_size %d out of range", rank, n);
    if (p->local_world_size != n)
        return td__fail(TD_EUNSUPPORTED,
                        "shm: the shm backend needs every rank on one host (world_size %d, "
                        "local_world_size %d); use the mpi or ucx backend",
                        n, p->local_world_size);
    td_store *store = NULL;
    if (n > 1) {
        td_store_params sp = td_store_default_params();
        sp.host = p->master_addr;
        sp.port = p->master_port;
        sp.is_server = rank == 0 && !p->store_hosted;
        sp.token = p->token;
        sp.timeout_s = p->timeout_s;
        TD__TRY(td_store_create(&store, &sp));
    }
    td_status s = td__shm_create_local(rank, n, store ? share_by_store : NULL, store, p->timeout_s,
                                       ctx, shape, ops);
    if (s) {
        td_store_destroy(store);
        return s;
    }
    ((shm_ctx *)*ctx)->store = store;
    return TD_OK;
}

/* What each rank tells the others during a split. */
typedef struct {
    int32_t color, key, ok;
    char name[96];
} split_rec;

static td_status shm_split(void *ctx, int color, int key, double timeout_s, void **child,
                           td__group_shape *shape, int *child_members) {
    shm_ctx *c = ctx;
    uint64_t timeout_ns = (uint64_t)(timeout_s * 1e9);
    *child = NULL;
    if (atomic_load(&c->head->poison)) return td__shm_poisoned(c, "split");
    int n = c->size;
    split_rec mine = {.color = color < 0 ? -1 : color, .key = key, .ok = 1};
    split_rec *all = calloc((size_t)n, sizeof *all);
    int *members = calloc((size_t)n, sizeof *members);
    if (!all || !members) {
        free(all);
        free(members);
        return td__fail(TD_ENOMEM, "split: out of memory");
    }
    shm_call call = {.kind = SHM_COLL_SPLIT, .seq = c->next_seq++};
    td_status s = td__shm_allgather_bytes(c, &call, &mine, all, sizeof mine, timeout_ns);
    /* Members ordered by (key, old rank), as MPI_Comm_split orders them. */
    int m = 0, me = -1;
    for (int r = 0; !s && mine.color >= 0 && r < n; r++) {
        if (all[r].color != mine.color) continue;
        int i = m++;
        while (i > 0 && all[members[i - 1]].key > all[r].key) {
            members[i] = members[i - 1];
            i--;
        }
        members[i] = r;
    }
    for (int i = 0; i < m; i++)
        if (members[i] == c->rank) me = i;
    shm_ctx *k = NULL;
    td_status local = TD_OK;
    if (!s && me >= 0) {
        k = ctx_new(me, m);
        if (!k) local = td__fail(TD_ENOMEM, "split: out of memory");
        if (!local && me == 0) {
            local = segment_create(k, "g");
            if (!local) snprintf(mine.name, sizeof mine.name, "%s", k->name);
        }
        mine.ok = local == TD_OK;
    }
    /* Second round: leaders publish names; third: members report whether they mapped. */
    call.seq = c->next_seq++;
    if (!s) s = td__shm_allgather_bytes(c, &call, &mine, all, sizeof mine, timeout_ns);
    if (!s && me > 0) {
        const split_rec *leader = &all[members[0]];
        local =
            leader->ok
                ? segment_open(k, leader->name)
                : td__fail(
                      TD_EIO,
                      "split: the new group's rank 0 (rank %d here) could not create its segment",
                      members[0]);
        mine.ok = local == TD_OK;
    }
    call.seq = c->next_seq++;
    if (!s) s = td__shm_allgather_bytes(c, &call, &mine, all, sizeof mine, timeout_ns);
    int group_ok = 1;
    for (int i = 0; !s && i < m; i++) group_ok &= all[members[i]].ok;
    if (!s && me >= 0 && !group_ok && !local)
        local = td__fail(
            TD_EIO, "split: another rank of the new group (colour %d) could not map its segment",
            color);
    if (!s && !local && k) {
        shm_file_sealed(&k->fd); /* every member has mapped it */
        share_cores(k);
    }
    free(all);
    if (k && !s && !local) memcpy(child_members, members, (size_t)m * sizeof *members);
    free(members);
    if (!s) s = local;
    if (s) {
        ctx_free(k);
        return s;
    }
    if (k) {
        /* Every member's phase counter in the new segment starts at 0. */
        *child = k;
        *shape = (td__group_shape){me, m, me, m, 0, 1};
    }
    return TD_OK;
}

/* ---------------------------------------------------------------- registered buffers */

/* What each rank tells the others during an allocation. */
typedef struct {
    int32_t ok;
    char name[96];
} alloc_rec;

/* Rank 0 creates a memory file of size x region bytes, the others map it once they learn its
 * name, and rank 0 closes it as soon as everyone reported (mapped or not): like a group's own
 * segment, it is freed with its last mapping. */
td_status td__shm_alloc(void *ctx, size_t bytes, double timeout_s, void **out) {
    shm_ctx *c = ctx;
    *out = NULL;
    if (atomic_load(&c->head->poison)) return td__shm_poisoned(c, "alloc");
    uint64_t timeout_ns = (uint64_t)(timeout_s * 1e9);
    int n = c->size, me = c->rank;
    size_t region = align_up(bytes ? bytes : 1, 4096);
    if (region < bytes || region > SIZE_MAX / (size_t)n)
        return td__fail(TD_EINVAL, "alloc: %s: %zu bytes x %d ranks overflows",
                        td__who(c->names, me).s, bytes, n);
    size_t total = region * (size_t)n;
    shm_reg *g = calloc(1, sizeof *g);
    alloc_rec *all = calloc((size_t)n, sizeof *all);
    if (!g || !all) {
        free(g);
        free(all);
        return td__fail(TD_ENOMEM, "alloc: %s: out of memory", td__who(c->names, me).s);
    }
    void *base = MAP_FAILED;
    td_status s = TD_OK;
    const char *why = "";
    if (n == 1) {
        base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (base == MAP_FAILED) why = strerror(errno);
    } else {
        alloc_rec mine = {.ok = 0};
        int fd = -1;
        if (me == 0) {
            if (shm_file_create("r", total, mine.name, &fd) == TD_OK)
                base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (base == MAP_FAILED) why = fd < 0 ? td_last_error() : strerror(errno);
            mine.ok = base != MAP_FAILED;
        }
        shm_call call = {.kind = SHM_COLL_ALLOC, .seq = c->next_seq++, .count = bytes};
        s = td__shm_allgather_bytes(c, &call, &mine, all, sizeof mine, timeout_ns);
        if (!s && me > 0 && all[0].ok) {
            char name[sizeof mine.name];
            memcpy(name, all[0].name, sizeof name);
            name[sizeof name - 1] = 0;
            int pfd = open(name, O_RDWR | O_CLOEXEC);
            struct stat sb;
            if (pfd >= 0 && fstat(pfd, &sb) == 0 && (size_t)sb.st_size == total)
                base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
            if (base == MAP_FAILED) why = pfd < 0 ? strerror(errno) : "cannot map it";
            if (pfd >= 0) close(pfd);
            mine.ok = base != MAP_FAILED;
        }
        /* Second round: everyone says whether it mapped; then no one will open it again. */
        call.seq = c->next_seq++;
        if (!s) s = td__shm_allgather_bytes(c, &call, &mine, all, sizeof mine, timeout_ns);
        shm_file_sealed(&fd);
        int bad = -1;
        for (int r = 0; !s && bad < 0 && r < n; r++)
            if (!all[r].ok) bad = r;
        if (!s && bad >= 0) {
            if (base != MAP_FAILED) munmap(base, total);
            base = MAP_FAILED;
            s = td__fail(TD_ENOMEM, "alloc: %s: %s could not %s a %zu-byte segment%s%s",
                         td__who(c->names, me).s, td__who(c->names, bad).s,
                         bad == 0 ? "create" : "map", total, bad == me ? ": " : "",
                         bad == me ? why : "");
        }
    }
    if (!s && base == MAP_FAILED)
        s = td__fail(TD_ENOMEM, "alloc: %s: cannot map %zu bytes: %s", td__who(c->names, me).s,
                     total, why);
    free(all);
    if (s) {
        if (base != MAP_FAILED) munmap(base, total);
        free(g);
        return s;
    }
    g->id = ++c->next_reg;
    g->base = base;
    g->region = region;
    g->bytes = total;
    pthread_mutex_lock(&c->reg_lock);
    g->next = c->regs;
    c->regs = g;
    pthread_mutex_unlock(&c->reg_lock);
    *out = g->base + (size_t)me * region;
    return TD_OK;
}

void td__shm_free(void *ctx, void *ptr) {
    shm_ctx *c = ctx;
    pthread_mutex_lock(&c->reg_lock);
    shm_reg **p = &c->regs;
    while (*p && (void *)((*p)->base + (size_t)c->rank * (*p)->region) != ptr) p = &(*p)->next;
    shm_reg *g = *p;
    if (g) *p = g->next;
    pthread_mutex_unlock(&c->reg_lock);
    if (!g) return;
    munmap(g->base, g->bytes);
    free(g);
}

const shm_reg *td__shm_reg_find(shm_ctx *c, const void *p, size_t bytes, size_t *off) {
    uintptr_t a = (uintptr_t)p;
    const shm_reg *found = NULL;
    pthread_mutex_lock(&c->reg_lock);
    for (const shm_reg *g = c->regs; g && !found; g = g->next) {
        uintptr_t lo = (uintptr_t)g->base + (size_t)c->rank * g->region;
        if (a >= lo && a - lo <= g->region && bytes <= g->region - (a - lo)) {
            found = g;
            *off = a - lo;
        }
    }
    pthread_mutex_unlock(&c->reg_lock);
    return found;
}
