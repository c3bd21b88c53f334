/* All-reduce bandwidth and latency, nccl-tests style: for f32 SUM from 4 KB to 256 MB (x4
 * steps), the median time of several timed iterations after warm-up, algbw = bytes / time
 * and busbw = algbw * 2(n-1)/n, for tandem's shm backend and, when launched under mpirun
 * with an MPI build, tandem's mpi backend and Open MPI's own MPI_Allreduce in the same run,
 * with the shm/MPI and mpi-backend/MPI ratios (MPI_Allreduce's time over the other's: above 1
 * is faster) and, at 4 KB, the mpi backend's overhead over MPI_Allreduce in microseconds. The
 * shm-reg column is the shm backend in place on a td_comm_alloc buffer (the zero-copy path
 * DDP's buckets take), with its own reg/MPI ratio. It checks each
 * result once but is not a test.
 *
 *   mpirun --oversubscribe -np 2 build/bench/allreduce [--json] [--max-bytes N]
 *   build/bench/allreduce --np 2 [--json]      (no launcher: forks its own ranks, shm only)
 *   tandemrun --nproc-per-node 2 build/bench/allreduce
 *
 * The MPI columns need <mpi.h> at compile time (the bench is built with $(MPI_CFLAGS)). */
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
    float *reg; /* (max count) from td_comm_alloc on shm, all-reduced in place */
    int rank, size, mpi;
} bench;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

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

static void run_one(bench *b, int impl, const float *send, float *recv, size_t count) {
    switch (impl) {
    case IMPL_SHM:
        CHECK(td_comm_allreduce(b->shm, send, recv, count, TD_F32, TD_OP_SUM));
        break;
    case IMPL_SHM_REG:
        CHECK(td_comm_allreduce(b->shm, b->reg, b->reg, count, TD_F32, TD_OP_SUM));
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

/* Median seconds per call; each iteration's time is the slowest rank's. */
static double time_impl(bench *b, int impl, const float *send, float *recv, size_t count, int warm,
                        int iters) {
    /* In place, a sum of zeros stays zeros (and costs what ones do); the check below refills. */
    if (impl == IMPL_SHM_REG) memset(b->reg, 0, count * sizeof(float));
    for (int i = 0; i < warm; i++) run_one(b, impl, send, recv, count);
    double *t = malloc((size_t)iters * sizeof *t), *tmax = malloc((size_t)iters * sizeof *t);
    for (int i = 0; i < iters; i++) {
        barrier(b, impl);
        uint64_t t0 = td_time_ns();
        run_one(b, impl, send, recv, count);
        t[i] = (double)(td_time_ns() - t0) / 1e9;
    }
    CHECK(td_comm_allreduce(b->shm, t, tmax, (size_t)iters, TD_F64, TD_OP_MAX));
    qsort(tmax, (size_t)iters, sizeof *tmax, cmp_double);
    double med = tmax[iters / 2];
    free(t);
    free(tmax);
    if (impl == IMPL_SHM_REG) {
        for (size_t i = 0; i < count; i++) b->reg[i] = 1.0f;
        run_one(b, impl, send, recv, count);
        recv = b->reg;
    }
    if (recv[0] != (float)b->size || recv[count - 1] != (float)b->size) {
        fprintf(stderr, "%s: wrong result %g (expected %d)\n", impl_names[impl], recv[0], b->size);
        exit(1);
    }
    return med;
}

static void run(bench *b, int json, size_t max_bytes) {
    int have[IMPL_COUNT] = {1, 1, b->tdmpi != NULL, b->mpi};
    size_t max_count = max_bytes / sizeof(float);
    void *reg = NULL;
    CHECK(td_comm_alloc(b->shm, max_count * sizeof(float), &reg));
    b->reg = reg;
    float *send = malloc(max_count * sizeof(float)), *recv = malloc(max_count * sizeof(float));
    if (!send || !recv) {
        fprintf(stderr, "out of memory for %zu-byte buffers\n", max_bytes);
        exit(1);
    }
    for (size_t i = 0; i < max_count; i++) send[i] = 1.0f, recv[i] = 0;
    double factor = 2.0 * (b->size - 1) / b->size;
    if (b->rank == 0 && !json) {
        printf("# tandem allreduce: f32 sum, %d ranks, out of place (shm-reg: in place on "
               "td_comm_alloc memory), median of timed iterations\n",
               b->size);
        printf("# busbw = algbw * 2(n-1)/n\n#\n");
        printf("# %10s %10s", "size(B)", "count");
        for (int k = 0; k < IMPL_COUNT; k++)
            if (have[k])
                printf(" | %-13s %9s %8s %8s", impl_names[k], "time(us)", "algbw", "busbw");
        if (have[IMPL_MPI]) printf(" | shm/MPI reg/MPI%s", have[IMPL_TDMPI] ? " mpi/MPI" : "");
        printf("\n");
    }
    for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
        size_t count = bytes / sizeof(float);
        int iters = bytes <= (1u << 20) ? 200 : bytes <= (16u << 20) ? 30 : 10;
        double t[IMPL_COUNT] = {0};
        for (int k = 0; k < IMPL_COUNT; k++)
            if (have[k])
                t[k] = time_impl(b, k, send, recv, count, bytes <= (1u << 20) ? 20 : 3, iters);
        if (b->rank != 0) continue;
        if (json) {
            printf("{\"bench\":\"allreduce\",\"ranks\":%d,\"bytes\":%zu,\"count\":%zu", b->size,
                   bytes, count);
            for (int k = 0; k < IMPL_COUNT; k++)
                if (have[k])
                    printf(",\"%s_us\":%.2f,\"%s_algbw\":%.3f,\"%s_busbw\":%.3f", impl_names[k],
                           t[k] * 1e6, impl_names[k], bytes / t[k] / 1e9, impl_names[k],
                           bytes / t[k] / 1e9 * factor);
            if (have[IMPL_MPI])
                printf(",\"shm_over_mpi\":%.3f,\"shm_reg_over_mpi\":%.3f",
                       t[IMPL_MPI] / t[IMPL_SHM], t[IMPL_MPI] / t[IMPL_SHM_REG]);
            if (have[IMPL_MPI] && have[IMPL_TDMPI])
                printf(",\"mpi_backend_over_mpi\":%.3f", t[IMPL_MPI] / t[IMPL_TDMPI]);
            printf("}\n");
        } else {
            printf("  %10zu %10zu", bytes, count);
            for (int k = 0; k < IMPL_COUNT; k++)
                if (have[k])
                    printf(" | %-13s %9.2f %8.3f %8.3f", "", t[k] * 1e6, bytes / t[k] / 1e9,
                           bytes / t[k] / 1e9 * factor);
            if (have[IMPL_MPI])
                printf(" | %6.2fx %6.2fx", t[IMPL_MPI] / t[IMPL_SHM],
                       t[IMPL_MPI] / t[IMPL_SHM_REG]);
            if (have[IMPL_MPI] && have[IMPL_TDMPI]) printf(" %6.2fx", t[IMPL_MPI] / t[IMPL_TDMPI]);
            printf("\n");
        }
        fflush(stdout);
    }
    /* The latency line: many 4 KB calls. */
    double lat[IMPL_COUNT] = {0};
    for (int k = 0; k < IMPL_COUNT; k++)
        if (have[k]) lat[k] = time_impl(b, k, send, recv, 1024, 200, 2000);
    if (b->rank == 0) {
        if (json) {
            printf("{\"bench\":\"allreduce_latency\",\"ranks\":%d,\"bytes\":4096", b->size);
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
                printf("; mpi-backend - MPI_Allreduce %+.2f us", (lat[IMPL_TDMPI] - lat[IMPL_MPI]) * 1e6);
            printf("\n");
        }
    }
    free(send);
    free(recv);
    td_comm_free(b->shm, reg);
}

typedef struct {
    int json;
    size_t max_bytes;
} options;

/* A rank started by bench_ranks or a launcher (the env contract): the shm backend. */
static int shm_rank(int rank, int size, void *result, void *arg) {
    const options *o = arg;
    (void)result;
    bench b = {.rank = rank, .size = size, .shm = bench_comm()};
    run(&b, o->json, o->max_bytes);
    td_comm_destroy(b.shm);
    return 0;
}

int main(int argc, char **argv) {
    int json = 0, np = 2;
    size_t max_bytes = 256u << 20;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = 1;
        else if (strcmp(argv[i], "--np") == 0 && i + 1 < argc)
            np = atoi(argv[++i]);
        else if (strcmp(argv[i], "--max-bytes") == 0 && i + 1 < argc)
            max_bytes = (size_t)atoll(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--json] [--np N] [--max-bytes N]\n", argv[0]);
            return 2;
        }
    }
    bench b = {0};
#ifdef BENCH_MPI
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK")) {
        int provided;
        MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
        MPI_Comm_rank(MPI_COMM_WORLD, &b.rank);
        MPI_Comm_size(MPI_COMM_WORLD, &b.size);
        b.mpi = 1;
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
        run(&b, json, max_bytes);
        td_comm_destroy(b.tdmpi);
        td_comm_destroy(b.shm);
        MPI_Finalize();
        return 0;
    }
#endif
    options o = {json, max_bytes};
    if (getenv("RANK") && getenv("WORLD_SIZE")) /* tandemrun / torchrun-style env */
        return shm_rank(atoi(getenv("RANK")), atoi(getenv("WORLD_SIZE")), NULL, &o);
    /* No launcher: start np ranks of our own, each on its own core as tandemrun places them. */
    if (np < 1 || np > 64) {
        fprintf(stderr, "--np must be in 1..64\n");
        return 2;
    }
    return bench_ranks(np, 1, shm_rank, &o, NULL, 0);
}
