/* All-reduce bandwidth and latency, nccl-tests style: for f32 SUM from 4 KB to 64 MB (x4
 * steps; --max-bytes), algbw = bytes / time and busbw = algbw * 2(n-1)/n, for tandem's shm
 * backend and, when launched under mpirun with an MPI build, tandem's mpi backend and Open
 * MPI's own MPI_Allreduce in the same run, with the shm/MPI and mpi-backend/MPI ratios
 * (MPI_Allreduce's time over the other's: above 1 is faster) and, at 4 KB, the mpi backend's
 * overhead over MPI_Allreduce in microseconds. The shm-reg column is the shm backend in place
 * on a td_comm_alloc buffer (the zero-copy path DDP's buckets take), with its own reg/MPI
 * ratio. A last line gives the flight recorder's cost (tandem/recorder.h): the 4 KB latency of
 * two groups split from the world alike, one recording and one not, in turns.
 *
 * The implementations take turns in short bursts of calls (each call after its own barrier,
 * its time the slowest rank's), so that on a machine shared with other work all of them meet
 * the same load; each rewrites its input before every call, as a backward pass rewrites a
 * gradient. A size's time is the median over its calls, and with --repeat K the median of K
 * such sweeps. The heading names the CPU, each rank's CPUs and the load average. It checks
 * each result once but is not a test.
 *
 *   mpirun --oversubscribe -np 2 build/bench/allreduce [--json] [--max-bytes N] [--repeat K]
 *   build/bench/allreduce --np 2 [--json]      (no launcher: forks its own ranks, shm only)
 *   tandemrun --nproc-per-node 2 build/bench/allreduce
 *   build/bench/allreduce --calls N   (N 4 KB all-reduces of a world of one and nothing else:
 *                                      the recorder's instructions under callgrind, see below)
 *
 * The MPI columns need <mpi.h> at compile time (the bench is built with $(MPI_CFLAGS)). */
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/comm.h"

#include "bench.h"

#if defined(TD_HAVE_MPI) && defined(__has_include)
#if __has_include(<mpi.h>)
#include <mpi.h>
#define BENCH_MPI 1
#endif
#endif

enum { IMPL_SHM, IMPL_SHM_REG, IMPL_TDMPI, IMPL_MPI, IMPL_COUNT };
static const char *const impl_names[IMPL_COUNT] = {"shm", "shm-reg", "mpi-backend",
                                                   "MPI_Allreduce"};

typedef struct {
    td_comm *shm, *tdmpi;
    /* (max count) each: every implementation has buffers of its own, so that none finds the
     * caches as another left them (a peer's copy of a line it must now overwrite). shm-reg's
     * are one td_comm_alloc buffer on shm, all-reduced in place. */
    float *send[IMPL_COUNT], *recv[IMPL_COUNT];
    int rank, size, mpi;
    const char *launcher; /* how the ranks were started, for the heading */
} bench;

static void barrier(bench *b, int impl) {
#ifdef BENCH_MPI
    if (impl != IMPL_SHM && impl != IMPL_SHM_REG) {
        MPI_Barrier(MPI_COMM_WORLD);
        return;
    }
#endif
    (void)impl;
    CHECK(td_comm_barrier(b->shm));
}

static void run_one(bench *b, int impl, size_t count) {
    const float *send = b->send[impl];
    float *recv = b->recv[impl];
    switch (impl) {
    case IMPL_SHM:
    case IMPL_SHM_REG:
        CHECK(td_comm_allreduce(b->shm, send, recv, count, TD_F32, TD_OP_SUM));
        break;
    case IMPL_TDMPI:
        CHECK(td_comm_allreduce(b->tdmpi, send, recv, count, TD_F32, TD_OP_SUM));
        break;
#ifdef BENCH_MPI
    case IMPL_MPI:
        MPI_Allreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
#endif
    default:
        break;
    }
}

/* One call of `impl` on fresh output must give world_size in every element. */
static void check_one(bench *b, int impl, size_t count) {
    float *out = b->recv[impl];
    for (size_t i = 0; i < count; i++) out[i] = impl == IMPL_SHM_REG ? 1.0f : 0.0f;
    run_one(b, impl, count);
    for (size_t i = 0; i < count; i++)
        if (out[i] != (float)b->size) {
            fprintf(stderr, "%s: wrong result %g at %zu of %zu (expected %d)\n", impl_names[impl],
                    out[i], i, count, b->size);
            exit(1);
        }
}

/* Rewrites this rank's input, as a backward pass rewrites a gradient before its all-reduce:
 * a peer that reads it must then fetch it from this rank's cache, instead of finding its own
 * copy from the previous call (which flatters whoever reads the peer's buffer directly). */
static void touch(bench *b, int impl, size_t count) {
    if (impl == IMPL_SHM_REG)
        memset(b->send[impl], 0, count * sizeof(float)); /* a sum of zeros stays zeros */
    else
        for (size_t i = 0; i < count; i++) b->send[impl][i] = 1.0f;
}

/* Median seconds per call of each implementation for `count` floats over `iters` timed calls,
 * each after its own barrier, its time the slowest rank's. The implementations take turns in
 * bursts of `burst` calls, so that on a machine shared with other work all of them meet the
 * same load; each burst starts with one untimed call, which meets the caches as the other
 * implementations left them. */
static void time_size(bench *b, const int have[IMPL_COUNT], size_t count, int warm, int iters,
                      int burst, double med[IMPL_COUNT]) {
    /* In place, a sum of zeros stays zeros (and costs what ones do); check_one refills. */
    memset(b->send[IMPL_SHM_REG], 0, count * sizeof(float));
    for (int k = 0; k < IMPL_COUNT; k++)
        for (int i = 0; have[k] && i < warm; i++) run_one(b, k, count);
    size_t n = (size_t)IMPL_COUNT * (size_t)iters;
    double *t = calloc(n, sizeof *t), *tmax = calloc(n, sizeof *t);
    if (!t || !tmax) {
        fprintf(stderr, "out of memory for %zu timings\n", n);
        exit(1);
    }
    for (int i = 0; i < iters; i += burst)
        for (int k = 0; k < IMPL_COUNT; k++)
            for (int j = -1; have[k] && j < burst && i + j < iters; j++) {
                touch(b, k, count);
                barrier(b, k);
                uint64_t t0 = td_time_ns();
                run_one(b, k, count);
                if (j >= 0) t[(size_t)k * iters + i + j] = (double)(td_time_ns() - t0) / 1e9;
            }
    CHECK(td_comm_allreduce(b->shm, t, tmax, n, TD_F64, TD_OP_MAX));
    for (int k = 0; k < IMPL_COUNT; k++) {
        med[k] = have[k] ? bench_median(tmax + (size_t)k * iters, iters) : 0;
        if (have[k]) check_one(b, k, count);
    }
    free(t);
    free(tmax);
}

/* This rank's CPUs as a list ("0", "2-3"). */
static void my_cpus(char *out, size_t cap) {
    cpu_set_t set;
    size_t len = 0;
    out[0] = 0;
    if (sched_getaffinity(0, sizeof set, &set) != 0) {
        snprintf(out, cap, "?");
        return;
    }
    for (int c = 0; c < CPU_SETSIZE && len + 16 < cap; c++) {
        if (!CPU_ISSET(c, &set)) continue;
        int last = c;
        while (last + 1 < CPU_SETSIZE && CPU_ISSET(last + 1, &set)) last++;
        len += (size_t)snprintf(out + len, cap - len, len ? ",%d" : "%d", c);
        if (last > c) len += (size_t)snprintf(out + len, cap - len, "-%d", last);
        c = last;
    }
}

/* One round of the flight recorder's cost: 4 KB all-reduces on g[0] (recording, as every group
 * does) and g[1] (made with TANDEM_DOCTOR=0), in turns of bursts of `calls` back-to-back calls,
 * a burst's time over its calls (a call is a few ticks of this machine's clock, so single
 * calls cannot tell 1% apart); the median burst of each, the slowest rank's, in us[0..1]. */
static void recorder_round(bench *b, td_comm *const g[2], float *send, float *recv, int calls,
                           double us[2]) {
    enum { BURSTS = 200, COUNT = 1024 };
    double t[2 * BURSTS], tmax[2 * BURSTS];
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 200; i++)
            CHECK(td_comm_allreduce(g[k], send + k * COUNT, recv + k * COUNT, COUNT, TD_F32,
                                    TD_OP_SUM));
    for (int i = 0; i < BURSTS; i++)
        for (int k = 0; k < 2; k++) {
            CHECK(td_comm_barrier(g[k]));
            uint64_t t0 = td_time_ns();
            for (int c = 0; c < calls; c++)
                CHECK(td_comm_allreduce(g[k], send + k * COUNT, recv + k * COUNT, COUNT, TD_F32,
                                        TD_OP_SUM));
            t[k * BURSTS + i] = (double)(td_time_ns() - t0) / 1e3 / calls;
        }
    CHECK(td_comm_allreduce(b->shm, t, tmax, 2 * BURSTS, TD_F64, TD_OP_MAX));
    us[0] = bench_median(tmax, BURSTS);
    us[1] = bench_median(tmax + BURSTS, BURSTS);
}

/* The flight recorder's cost (tandem/recorder.h), `rounds` rounds of recorder_round on two pairs
 * of groups split from the world alike, one of each pair recording: the job's ranks, whose
 * latency a call's cost is measured against, and each rank alone, where no peer's arrival
 * hides the recorder's own time per call (on - off). Medians over the rounds, and of each
 * round's on/off ratio. */
static void recorder_cost(bench *b, int json, int rounds) {
    enum { COUNT = 1024, ROUNDS_MAX = 15 };
    td_comm *job[2] = {NULL, NULL}, *alone[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
        if (k) setenv("TANDEM_DOCTOR", "0", 1);
        CHECK(td_comm_split(b->shm, 0, b->rank, &job[k]));
        CHECK(td_comm_split(b->shm, b->rank, 0, &alone[k]));
        unsetenv("TANDEM_DOCTOR");
    }
    float *send = malloc(2 * COUNT * sizeof *send), *recv = malloc(2 * COUNT * sizeof *recv);
    double on[ROUNDS_MAX], off[ROUNDS_MAX], ratio[ROUNDS_MAX], own[ROUNDS_MAX];
    if (rounds > ROUNDS_MAX) rounds = ROUNDS_MAX;
    if (!send || !recv) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (int i = 0; i < 2 * COUNT; i++) send[i] = 1.0f;
    for (int r = 0; r < rounds; r++) {
        double us[2], one[2];
        recorder_round(b, job, send, recv, 50, us);
        recorder_round(b, alone, send, recv, 500, one);
        on[r] = us[0], off[r] = us[1], ratio[r] = us[0] / us[1];
        own[r] = (one[0] - one[1]) * 1e3; /* ns */
    }
    double m_on = bench_median(on, rounds), m_off = bench_median(off, rounds),
           m_ratio = bench_median(ratio, rounds), m_own = bench_median(own, rounds);
    if (b->rank == 0 && json) {
        printf("{\"bench\":\"allreduce_recorder\",\"ranks\":%d,\"bytes\":4096,\"rounds\":%d,"
               "\"on_us\":%.4f,\"off_us\":%.4f,\"on_over_off\":%.4f,\"own_ns\":%.2f,"
               "\"own_over_latency\":%.4f}\n",
               b->size, rounds, m_on, m_off, m_ratio, m_own, m_own / (m_off * 1e3));
    } else if (b->rank == 0) {
        printf("# flight recorder (4 KB allreduce, groups split alike, recording and not, in turns "
               "of bursts; medians over %d rounds):\n",
               rounds);
        printf("#   %d ranks: on %.4f us, off %.4f us a call: on/off %.4fx (rounds:", b->size,
               m_on, m_off, m_ratio);
        for (int r = 0; r < rounds; r++) printf(" %.4f", ratio[r]);
        printf(")\n#   its own time, each rank alone: %.2f ns a call (rounds:", m_own);
        for (int r = 0; r < rounds; r++) printf(" %.2f", own[r]);
        printf("), %.2f%% of the %d-rank call\n", 100 * m_own / (m_off * 1e3), b->size);
    }
    free(send);
    free(recv);
    for (int k = 0; k < 2; k++) {
        td_comm_destroy(alone[k]);
        td_comm_destroy(job[k]);
    }
}

/* `calls` 4 KB all-reduces on a world of one, nothing else: under valgrind --tool=callgrind with
 * TANDEM_DOCTOR=0 and unset, at two values of `calls`, the difference of td_comm_allreduce's
 * inclusive counts over the difference of the calls is a call's instructions, with the recorder
 * and without (docs/doctor.md, Cost). */
static int recorder_calls(int calls) {
    enum { COUNT = 1024 };
    static float send[COUNT], recv[COUNT];
    td_comm_params p = td_comm_default_params();
    p.backend = TD_BACKEND_SHM;
    p.rank = 0;
    p.world_size = 1;
    td_comm *c = NULL;
    CHECK(td_comm_create(&c, &p));
    for (int i = 0; i < calls; i++)
        CHECK(td_comm_allreduce(c, send, recv, COUNT, TD_F32, TD_OP_SUM));
    td_comm_destroy(c);
    return 0;
}

enum { MAX_SIZES = 24 };

static void run(bench *b, int json, size_t max_bytes, int repeat) {
    int have[IMPL_COUNT] = {1, 1, b->tdmpi != NULL, b->mpi};
    size_t max_count = max_bytes / sizeof(float);
    void *reg = NULL;
    CHECK(td_comm_alloc(b->shm, max_count * sizeof(float), &reg));
    for (int k = 0; k < IMPL_COUNT; k++) {
        if (k == IMPL_SHM_REG) {
            b->send[k] = b->recv[k] = reg;
            continue;
        }
        b->send[k] = have[k] ? malloc(max_count * sizeof(float)) : NULL;
        b->recv[k] = have[k] ? malloc(max_count * sizeof(float)) : NULL;
        if (have[k] && (!b->send[k] || !b->recv[k])) {
            fprintf(stderr, "out of memory for %zu-byte buffers\n", max_bytes);
            exit(1);
        }
        for (size_t i = 0; have[k] && i < max_count; i++) b->send[k][i] = 1.0f, b->recv[k][i] = 0;
    }
    char mine[64], *cpus = malloc((size_t)b->size * sizeof mine);
    my_cpus(mine, sizeof mine);
    CHECK(td_comm_allgather(b->shm, mine, cpus, sizeof mine, TD_U8));
    /* (repeat, size, impl) medians; the last size slot holds the 4 KB latency runs. */
    char load_before[64], load_after[64];
    bench_load_average(load_before, sizeof load_before);
    double(*t)[MAX_SIZES + 1][IMPL_COUNT] = calloc((size_t)repeat, sizeof *t);
    int sizes = 0;
    for (size_t bytes = 4096; bytes <= max_bytes && sizes < MAX_SIZES; bytes *= 4) sizes++;
    for (int r = 0; r < repeat; r++) {
        for (int z = 0; z < sizes; z++) {
            size_t bytes = (size_t)4096 << (2 * z), count = bytes / sizeof(float);
            int iters = bytes <= (1u << 20) ? 200 : bytes <= (16u << 20) ? 30 : 10;
            time_size(b, have, count, bytes <= (1u << 20) ? 20 : 3, iters,
                      bytes <= (1u << 20) ? 10 : 2, t[r][z]);
        }
        time_size(b, have, 1024, 200, 2000, 10, t[r][MAX_SIZES]); /* latency */
    }
    bench_load_average(load_after, sizeof load_after);
    double med[MAX_SIZES + 1][IMPL_COUNT] = {{0}}, *v = malloc((size_t)repeat * sizeof *v);
    for (int z = 0; z <= MAX_SIZES; z++)
        for (int k = 0; k < IMPL_COUNT; k++) {
            for (int r = 0; r < repeat; r++) v[r] = t[r][z][k];
            med[z][k] = bench_median(v, repeat);
        }
    free(v);
    free(t);
    double factor = 2.0 * (b->size - 1) / b->size;
    if (b->rank == 0 && !json) {
        char cpu[512];
        printf("# tandem allreduce: f32 sum, %d ranks (%s), out of place (shm-reg: in place on "
               "td_comm_alloc memory)\n",
               b->size, b->launcher);
        printf("# on %s; ranks' CPUs:", bench_cpu_name(cpu, sizeof cpu));
        for (int r = 0; r < b->size; r++)
            printf(" %s%s", r ? "| " : "", cpus + (size_t)r * sizeof mine);
        printf("\n# load average %s before, %s after (%ld CPUs online)", load_before, load_after,
               sysconf(_SC_NPROCESSORS_ONLN));
        printf("\n# implementations in turns of 10 calls (2 from 4 MB), each call's time the "
               "slowest rank's; median over the calls, then over %d repeat%s\n",
               repeat, repeat > 1 ? "s" : "");
        printf("# busbw = algbw * 2(n-1)/n\n#\n");
        printf("# %10s %10s", "size(B)", "count");
        for (int k = 0; k < IMPL_COUNT; k++)
            if (have[k])
                printf(" | %-13s %9s %8s %8s", impl_names[k], "time(us)", "algbw", "busbw");
        if (have[IMPL_MPI]) printf(" | shm/MPI reg/MPI%s", have[IMPL_TDMPI] ? " mpi/MPI" : "");
        printf("\n");
    }
    for (int z = 0; z < sizes && b->rank == 0; z++) {
        size_t bytes = (size_t)4096 << (2 * z), count = bytes / sizeof(float);
        const double *tz = med[z];
        if (json) {
            printf(
                "{\"bench\":\"allreduce\",\"ranks\":%d,\"repeat\":%d,\"bytes\":%zu,\"count\":%zu",
                b->size, repeat, bytes, count);
            for (int k = 0; k < IMPL_COUNT; k++)
                if (have[k])
                    printf(",\"%s_us\":%.2f,\"%s_algbw\":%.3f,\"%s_busbw\":%.3f", impl_names[k],
                           tz[k] * 1e6, impl_names[k], bytes / tz[k] / 1e9, impl_names[k],
                           bytes / tz[k] / 1e9 * factor);
            if (have[IMPL_MPI])
                printf(",\"shm_over_mpi\":%.3f,\"shm_reg_over_mpi\":%.3f",
                       tz[IMPL_MPI] / tz[IMPL_SHM], tz[IMPL_MPI] / tz[IMPL_SHM_REG]);
            if (have[IMPL_MPI] && have[IMPL_TDMPI])
                printf(",\"mpi_backend_over_mpi\":%.3f", tz[IMPL_MPI] / tz[IMPL_TDMPI]);
            printf("}\n");
        } else {
            printf("  %10zu %10zu", bytes, count);
            for (int k = 0; k < IMPL_COUNT; k++)
                if (have[k])
                    printf(" | %-13s %9.2f %8.3f %8.3f", "", tz[k] * 1e6, bytes / tz[k] / 1e9,
                           bytes / tz[k] / 1e9 * factor);
            if (have[IMPL_MPI])
                printf(" | %6.2fx %6.2fx", tz[IMPL_MPI] / tz[IMPL_SHM],
                       tz[IMPL_MPI] / tz[IMPL_SHM_REG]);
            if (have[IMPL_MPI] && have[IMPL_TDMPI])
                printf(" %6.2fx", tz[IMPL_MPI] / tz[IMPL_TDMPI]);
            printf("\n");
        }
    }
    const double *lat = med[MAX_SIZES];
    if (b->rank == 0) {
        if (json) {
            printf("{\"bench\":\"allreduce_latency\",\"ranks\":%d,\"repeat\":%d,\"bytes\":4096,"
                   "\"load_before\":\"%s\",\"load_after\":\"%s\"",
                   b->size, repeat, load_before, load_after);
            for (int k = 0; k < IMPL_COUNT; k++)
                if (have[k]) printf(",\"%s_us\":%.3f", impl_names[k], lat[k] * 1e6);
            printf("}\n");
        } else {
            printf("# 4 KB allreduce latency (median of 2000):");
            for (int k = 0; k < IMPL_COUNT; k++)
                if (have[k])
                    printf(" %s %.2f us%s", impl_names[k], lat[k] * 1e6,
                           k + 1 < IMPL_COUNT && have[k + 1] ? "," : "");
            if (have[IMPL_MPI] && have[IMPL_TDMPI])
                printf("; mpi-backend - MPI_Allreduce %+.2f us",
                       (lat[IMPL_TDMPI] - lat[IMPL_MPI]) * 1e6);
            printf("\n");
        }
        fflush(stdout);
    }
    free(cpus);
    for (int k = 0; k < IMPL_COUNT; k++)
        if (k != IMPL_SHM_REG) free(b->send[k]), free(b->recv[k]);
    td_comm_free(b->shm, reg);
    recorder_cost(b, json, 5 * repeat);
}

typedef struct {
    int json, repeat;
    size_t max_bytes;
    const char *launcher;
} options;

/* A rank started by bench_ranks or a launcher (the env contract): the shm backend. */
static int shm_rank(int rank, int size, void *result, void *arg) {
    const options *o = arg;
    (void)result;
    bench b = {.rank = rank, .size = size, .shm = bench_comm(), .launcher = o->launcher};
    run(&b, o->json, o->max_bytes, o->repeat);
    td_comm_destroy(b.shm);
    return 0;
}

int main(int argc, char **argv) {
    int json = 0, np = 2, repeat = 1, calls = 0;
    long max_bytes = 64L << 20;
    td_args a;
    td_args_init(&a, "allreduce", argc, argv);
    while (td_args_next(&a)) {
        td_args_flag(&a, "--json", &json);
        td_args_int(&a, "--np", 1, 64, &np);
        td_args_long(&a, "--max-bytes", 4096, LONG_MAX, &max_bytes);
        td_args_int(&a, "--repeat", 1, 99, &repeat);
        td_args_int(&a, "--calls", 1, 1 << 30, &calls);
    }
    bench_args_finish(&a, "usage: allreduce [--json] [--np N] [--max-bytes N] [--repeat K] "
                          "[--calls N]\n");
    if (calls) return recorder_calls(calls);
#ifdef BENCH_MPI
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK")) {
        bench b = {0};
        int provided;
        MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
        MPI_Comm_rank(MPI_COMM_WORLD, &b.rank);
        MPI_Comm_size(MPI_COMM_WORLD, &b.size);
        b.mpi = 1;
        b.launcher = "mpirun";
        /* Rank 0 picks the store's port and token; everyone learns them over MPI. */
        int port = 0;
        char token[32] = {0};
        if (b.rank == 0) {
            port = 20000 + (int)(getpid() % 30000);
            snprintf(token, sizeof token, "bench-%d", (int)getpid());
        }
        MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD);
        MPI_Bcast(token, sizeof token, MPI_CHAR, 0, MPI_COMM_WORLD);
        td_comm_params sp = td_comm_default_params();
        sp.backend = TD_BACKEND_SHM;
        sp.master_port = port;
        sp.token = token;
        CHECK(td_comm_create(&b.shm, &sp));
        td_comm_params p = td_comm_default_params();
        p.backend = TD_BACKEND_MPI;
        p.rank = b.rank;
        p.world_size = b.size;
        if (td_comm_create(&b.tdmpi, &p) != TD_OK) {
            if (b.rank == 0) fprintf(stderr, "# mpi backend unavailable: %s\n", td_last_error());
            b.tdmpi = NULL;
        }
        run(&b, json, (size_t)max_bytes, repeat);
        td_comm_destroy(b.tdmpi);
        td_comm_destroy(b.shm);
        MPI_Finalize();
        return 0;
    }
#endif
    options o = {json, repeat, (size_t)max_bytes, "forked, pinned"};
    if (getenv("RANK") && getenv("WORLD_SIZE")) { /* tandemrun / torchrun-style env */
        o.launcher = "tandemrun";
        return shm_rank(atoi(getenv("RANK")), atoi(getenv("WORLD_SIZE")), NULL, &o);
    }
    /* No launcher: start np ranks of our own, each on its own core as tandemrun places them. */
    return bench_ranks(np, 1, shm_rank, &o, NULL, 0);
}
