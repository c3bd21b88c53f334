/* Two hosts x two ranks over emulated Ethernet: all-reduce bus bandwidth and CNN training
 * throughput, flat against hierarchical, with Open MPI's own MPI_Allreduce as the peer, on a
 * 10 Gbit/s + 50 us link and on a 1 Gbit/s + 200 us one, all in one run.
 *
 *   build/bench/multihost [--repeat K (3)] [--max-bytes N (64 MiB)] [--steps S (10)] [--json]
 *
 * For each link, scripts/hosts.sh run brings two network namespaces up (each a "host", shaped
 * with tbf and a propagation delay) and this program, inside, launches mpirun over them
 * (Open MPI's rsh launch through scripts/netns-agent.sh, 2 ranks per host, mpi_yield_when_idle
 * as 4 ranks share this machine's cores):
 *   - all-reduce, f32 sum, 64 KiB to 64 MiB (x4): MPI_Allreduce on MPI_COMM_WORLD, tandem's
 *     flat mpi backend (hierarchical = 0) and its hierarchical one ("mpi+shm": reduce-scatter
 *     over each host's shared memory, all-reduce across, all-gather over shared memory); the
 *     three interleaved call by call, each call's time the slowest rank's, the median over
 *     the calls and then over the K repeats; busbw = bytes / time x 2(n-1)/n;
 *   - the same sweep over the ucx backend, flat and hierarchical ("ucx+shm"), in a job of its
 *     own launched the other way: tandemrun --nnodes 2 started inside each host (the transport
 *     tandemrun --nnodes uses, beside Open MPI's TCP path that the mpi backend takes);
 *   - the CNN (the reference BatchNorm CNN, global batch 128, 32 per rank, one thread per rank):
 *     samples/s of DDP over the flat group, over the hierarchical one, with no communication at all
 *     (the ceiling: what the cores do when the ranks do not talk), and DDP2 (one process per host
 *     running td_dp with two replicas, td_ddp across hosts; a job of its own), medians of the K
 *     repeats, windows interleaved.
 * It prints the CPU, each table and the ratios. Needs root for the namespaces. */
#include <limits.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/tandem.h"

#include "bench.h"

#if defined(TD_HAVE_MPI) && defined(__has_include)
#if __has_include(<mpi.h>)
#include <mpi.h>
#define BENCH_MPI 1
#endif
#endif

#define GLOBAL_BATCH 128
#define MAX_SIZES 16

static char self[PATH_MAX], scripts[PATH_MAX], bin[PATH_MAX];

/* ---------------------------------------------------------------- ranks (under mpirun) */

enum { IMPL_MPI, IMPL_FLAT, IMPL_HIER, IMPL_RANKS = 3, IMPL_UCX_FLAT = 3, IMPL_UCX_HIER, IMPL_COUNT };
static const char *const impl_names[IMPL_COUNT] = {"MPI_Allreduce", "tandem flat", "tandem hier",
                                                   "ucx flat", "ucx hier"};

enum { CNN_FLAT, CNN_HIER, CNN_NOCOMM, CNN_DDP2, CNN_COUNT };

#ifdef BENCH_MPI
static td_comm *world_of(int hierarchical) {
    td_comm_params p = td_comm_default_params();
    p.backend = TD_BACKEND_MPI;
    p.hierarchical = hierarchical;
    td_comm *c = NULL;
    CHECK(td_comm_create(&c, &p));
    return c;
}

/* The all-reduce sweep; rank 0 appends "ar BYTES IMPL SECONDS" lines to `out`. */
static int allreduce_rank(const char *out, size_t max_bytes) {
    int provided, rank, size;
    MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    td_comm *flat = world_of(0), *hier = world_of(1);
    float *buf = malloc(max_bytes), *res = malloc(max_bytes);
    for (size_t i = 0; i < max_bytes / 4; i++) buf[i] = 1.0f;
    FILE *f = rank == 0 ? fopen(out, "a") : NULL;
    for (size_t bytes = 64 << 10; bytes <= max_bytes; bytes *= 4) {
        size_t n = bytes / 4;
        int iters = bytes <= (1u << 20) ? 10 : bytes <= (4u << 20) ? 5 : bytes <= (16u << 20) ? 3 : 2;
        double t[IMPL_RANKS][16], tmax[IMPL_RANKS][16];
        for (int i = -1; i < iters; i++) /* -1: warm-up */
            for (int k = 0; k < IMPL_RANKS; k++) {
                MPI_Barrier(MPI_COMM_WORLD);
                uint64_t t0 = td_time_ns();
                if (k == IMPL_MPI)
                    MPI_Allreduce(buf, res, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                else
                    CHECK(td_comm_allreduce(k == IMPL_FLAT ? flat : hier, buf, res, n, TD_F32,
                                            TD_OP_SUM));
                if (i >= 0) t[k][i] = (double)(td_time_ns() - t0) * 1e-9;
                if (res[0] != (float)size || res[n - 1] != (float)size) {
                    fprintf(stderr, "%s: wrong sum %g\n", impl_names[k], res[0]);
                    return 1;
                }
            }
        MPI_Reduce(t, tmax, IMPL_RANKS * 16, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        for (int k = 0; f && k < IMPL_RANKS; k++)
            fprintf(f, "ar %zu %d %.9f\n", bytes, k, bench_median(tmax[k], iters));
    }
    if (f) fclose(f);
    free(buf);
    free(res);
    td_comm_destroy(hier);
    td_comm_destroy(flat);
    MPI_Finalize();
    return 0;
}

/* Synthetic images and labels: throughput does not depend on what the pixels are. */
static void fill_batch(td_model *m, int64_t batch, int rank) {
    td_rng rng;
    td_rng_init(&rng, 7 + (uint64_t)rank);
    float *x = td_tensor_data(m->input);
    int64_t *y = td_tensor_data(m->labels);
    for (int64_t i = 0; i < batch * 784; i++) x[i] = td_rng_normal(&rng);
    for (int64_t i = 0; i < batch; i++) y[i] = (int64_t)td_rng_below(&rng, 10);
}

/* Samples/s of `steps` steps, the slowest rank's time. */
static double timed_rate(int steps, uint64_t t0) {
    double secs = (double)(td_time_ns() - t0) * 1e-9, most = 0;
    MPI_Allreduce(&secs, &most, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return GLOBAL_BATCH * steps / most;
}

/* DDP over flat, over hier, and no communication, window after window; rank 0 appends
 * "cnn VARIANT SAMPLES_PER_S" lines. */
static int cnn_rank(const char *out, int steps) {
    int provided, rank, size;
    MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    td_comm *comms[2] = {world_of(0), world_of(1)};
    int64_t local = GLOBAL_BATCH / size;
    td_graph *g;
    td_model m;
    CHECK(td_graph_create(&g, NULL));
    CHECK(td_model_build(g, TD_MODEL_CNN, local, 1, &m));
    CHECK(td_graph_compile(g));
    fill_batch(&m, local, rank);
    td_param *params, *buffers;
    size_t np, nb;
    CHECK(td_graph_parameters(g, &params, &np));
    CHECK(td_graph_buffers(g, &buffers, &nb));
    td_sgd_params sp = td_sgd_default_params();
    sp.lr = 0.001;
    td_optim *opt;
    CHECK(td_optim_create_sgd(&opt, params, np, &sp));
    double rate[3];
    for (int v = 0; v < 3; v++) {
        td_ddp *ddp = NULL;
        if (v != CNN_NOCOMM) {
            CHECK(td_ddp_create(&ddp, comms[v], params, np, buffers, nb, NULL));
            td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, ddp);
        }
        uint64_t t0 = 0;
        for (int i = -3; i < steps; i++) { /* three warm-up steps, the bucket rebuild among them */
            if (i == 0) {
                MPI_Barrier(MPI_COMM_WORLD);
                t0 = td_time_ns();
            }
            if (ddp) CHECK(td_ddp_prepare_forward(ddp));
            CHECK(td_graph_forward(g));
            CHECK(td_graph_backward(g, m.loss));
            if (ddp) CHECK(td_ddp_finish_backward(ddp));
            CHECK(td_optim_step(opt));
            CHECK(td_graph_zero_grad(g));
            CHECK(td_loss_check(*(const float *)td_tensor_data(m.loss), i + 4));
        }
        rate[v] = timed_rate(steps, t0);
        td_graph_set_grad_ready_hook(g, NULL, NULL);
        td_ddp_destroy(ddp);
    }
    if (rank == 0) {
        FILE *f = fopen(out, "a");
        for (int v = 0; f && v < 3; v++) fprintf(f, "cnn %d %.1f\n", v, rate[v]);
        if (f) fclose(f);
    }
    td_optim_destroy(opt);
    td_graph_destroy(g);
    td_comm_destroy(comms[1]);
    td_comm_destroy(comms[0]);
    MPI_Finalize();
    return 0;
}

/* One process per host: td_dp with two replicas, DDP across hosts. */
static int ddp2_rank(const char *out, int steps) {
    int provided, rank, size;
    MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    td_comm *comm = world_of(1);
    td_dp_params p = td_dp_default_params();
    p.model = TD_MODEL_CNN;
    p.global_batch = GLOBAL_BATCH / size;
    p.sgd.lr = 0.001;
    p.comm = comm;
    td_dp *dp;
    CHECK(td_dp_create(&dp, &p));
    float *x = malloc((size_t)p.global_batch * 784 * sizeof *x), loss;
    int64_t *y = malloc((size_t)p.global_batch * sizeof *y);
    td_rng rng;
    td_rng_init(&rng, 11 + (uint64_t)rank);
    for (int64_t i = 0; i < p.global_batch * 784; i++) x[i] = td_rng_normal(&rng);
    for (int64_t i = 0; i < p.global_batch; i++) y[i] = (int64_t)td_rng_below(&rng, 10);
    uint64_t t0 = 0;
    for (int i = -3; i < steps; i++) {
        if (i == 0) {
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = td_time_ns();
        }
        CHECK(td_dp_step(dp, x, y, &loss));
        CHECK(td_loss_check(loss, i + 4));
    }
    double r = timed_rate(steps, t0);
    if (rank == 0) {
        FILE *f = fopen(out, "a");
        if (f) fprintf(f, "cnn %d %.1f\n", CNN_DDP2, r);
        if (f) fclose(f);
    }
    td_dp_destroy(dp);
    td_comm_destroy(comm);
    free(x);
    free(y);
    MPI_Finalize();
    return 0;
}
#endif

/* The same sweep over the ucx backend under tandemrun --nnodes (no MPI): flat and hierarchical
 * interleaved, each call's time the slowest rank's; rank 0 appends "ar BYTES IMPL SECONDS". */
static int ucx_allreduce_rank(const char *out, size_t max_bytes) {
    td_comm *c[2] = {NULL, NULL};
    for (int h = 0; h < 2; h++) {
        td_comm_params p = td_comm_default_params();
        p.backend = TD_BACKEND_UCX;
        p.hierarchical = h;
        CHECK(td_comm_create(&c[h], &p));
    }
    int rank = td_comm_rank(c[0]), size = td_comm_size(c[0]);
    float *buf = malloc(max_bytes), *res = malloc(max_bytes);
    for (size_t i = 0; i < max_bytes / 4; i++) buf[i] = 1.0f;
    FILE *f = rank == 0 ? fopen(out, "a") : NULL;
    for (size_t bytes = 64 << 10; bytes <= max_bytes; bytes *= 4) {
        size_t n = bytes / 4;
        int iters = bytes <= (1u << 20) ? 10 : bytes <= (4u << 20) ? 5 : bytes <= (16u << 20) ? 3 : 2;
        double t[2][16];
        for (int i = -1; i < iters; i++)
            for (int h = 0; h < 2; h++) {
                CHECK(td_comm_barrier(c[0]));
                uint64_t t0 = td_time_ns();
                CHECK(td_comm_allreduce(c[h], buf, res, n, TD_F32, TD_OP_SUM));
                if (i >= 0) t[h][i] = (double)(td_time_ns() - t0) * 1e-9;
                if (res[0] != (float)size || res[n - 1] != (float)size) {
                    fprintf(stderr, "%s: wrong sum %g\n", impl_names[IMPL_UCX_FLAT + h], res[0]);
                    return 1;
                }
            }
        CHECK(td_comm_allreduce(c[0], t, t, 2 * 16, TD_F64, TD_OP_MAX));
        for (int h = 0; f && h < 2; h++)
            fprintf(f, "ar %zu %d %.9f\n", bytes, IMPL_UCX_FLAT + h, bench_median(t[h], iters));
    }
    if (f) fclose(f);
    free(buf);
    free(res);
    td_comm_destroy(c[1]);
    td_comm_destroy(c[0]);
    return 0;
}

/* ---------------------------------------------------------------- inside the hosts */

/* mpirun from host 0 over both hosts: np ranks (two per host, or one with --map-by node). */
static int mpirun(int np, const char *args) {
    char cmd[4 * PATH_MAX + 1024];
    snprintf(cmd, sizeof cmd,
             "sh %s/hosts.sh exec 0 env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
             "mpirun --mca plm_rsh_agent %s/netns-agent.sh -H tdhost0:2,tdhost1:2 -np %d %s "
             "--mca btl self,vader,tcp --mca btl_tcp_if_include 10.77.0.0/24 "
             "--mca oob_tcp_if_include 10.77.0.0/24 --mca mpi_yield_when_idle 1 "
             "--mca btl_vader_single_copy_mechanism none --bind-to none -x OMP_NUM_THREADS=1 "
             "%s %s",
             scripts, scripts, np, np == 2 ? "--map-by node" : "", self, args);
    int rc = system(cmd);
    if (rc) fprintf(stderr, "multihost: mpirun exited with %d: %s\n", rc, args);
    return rc;
}

/* tandemrun --nnodes 2 from each host, 2 ranks each, UCX between the hosts. */
static int tandemrun_nodes(int port, const char *args) {
    char cmd[8 * PATH_MAX + 1024];
    snprintf(cmd, sizeof cmd,
             "sh %s/hosts.sh exec 1 %s/bin/tandemrun --nnodes 2 --node-rank 1 --master-addr "
             "10.77.0.10 --master-port %d --token multihost-bench --nproc-per-node 2 "
             "--rdzv-timeout 60 --no-prefix %s %s & "
             "sh %s/hosts.sh exec 0 %s/bin/tandemrun --nnodes 2 --node-rank 0 --master-addr "
             "10.77.0.10 --master-port %d --token multihost-bench --nproc-per-node 2 "
             "--rdzv-timeout 60 --no-prefix %s %s; a=$?; wait $!; b=$?; [ $a = 0 ] && [ $b = 0 ]",
             scripts, bin, port, self, args, scripts, bin, port, self, args);
    int rc = system(cmd);
    if (rc) fprintf(stderr, "multihost: tandemrun --nnodes 2 exited with %d: %s\n", rc, args);
    return rc;
}

/* The measurements of one link, appended to `out`, repeated and interleaved. */
static int inside(const char *out, int repeat, size_t max_bytes, int steps) {
    char args[PATH_MAX + 64];
    for (int r = 0; r < repeat; r++) {
        snprintf(args, sizeof args, "--ucx-allreduce-rank %s %zu", out, max_bytes);
        if (tandemrun_nodes(29650 + r, args)) return 1;
        snprintf(args, sizeof args, "--allreduce-rank %s %zu", out, max_bytes);
        if (mpirun(4, args)) return 1;
        snprintf(args, sizeof args, "--cnn-rank %s %d", out, steps);
        if (mpirun(4, args)) return 1;
        snprintf(args, sizeof args, "--ddp2-rank %s %d", out, steps);
        if (mpirun(2, args)) return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the tables */

#ifdef BENCH_MPI
static const char *const cnn_names[CNN_COUNT] = {"DDP, flat", "DDP, hierarchical",
                                                 "no communication (ceiling)",
                                                 "DDP2 (td_dp x2 per host, DDP across)"};

typedef struct {
    const char *rate, *delay, *label;
    double ar[MAX_SIZES][IMPL_COUNT][16]; /* size, impl, repeat */
    int n_ar[MAX_SIZES][IMPL_COUNT];
    size_t bytes[MAX_SIZES];
    int n_sizes;
    double cnn[CNN_COUNT][16];
    int n_cnn[CNN_COUNT];
} link_result;

static void read_results(const char *path, link_result *L) {
    FILE *f = fopen(path, "r");
    char kind[8];
    while (f && fscanf(f, "%7s", kind) == 1) {
        if (strcmp(kind, "ar") == 0) {
            size_t bytes;
            int k;
            double secs;
            if (fscanf(f, "%zu %d %lf", &bytes, &k, &secs) != 3 || k < 0 || k >= IMPL_COUNT) break;
            int s = 0;
            while (s < L->n_sizes && L->bytes[s] != bytes) s++;
            if (s == L->n_sizes && s < MAX_SIZES) L->bytes[L->n_sizes++] = bytes;
            if (s < MAX_SIZES && L->n_ar[s][k] < 16) L->ar[s][k][L->n_ar[s][k]++] = secs;
        } else {
            int v;
            double rate;
            if (fscanf(f, "%d %lf", &v, &rate) != 2 || v < 0 || v >= CNN_COUNT) break;
            if (L->n_cnn[v] < 16) L->cnn[v][L->n_cnn[v]++] = rate;
        }
    }
    if (f) fclose(f);
}

/* Medians of the repeats: all-reduce seconds per size and implementation, CNN samples/s. */
static void link_medians(link_result *L, double t[][IMPL_COUNT], double r[CNN_COUNT]) {
    for (int z = 0; z < L->n_sizes; z++)
        for (int k = 0; k < IMPL_COUNT; k++)
            t[z][k] = L->n_ar[z][k] ? bench_median(L->ar[z][k], L->n_ar[z][k]) : 0;
    for (int v = 0; v < CNN_COUNT; v++) r[v] = L->n_cnn[v] ? bench_median(L->cnn[v], L->n_cnn[v]) : 0;
}

static double ratio(double a, double b) { return a > 0 && b > 0 ? a / b : 0; }

static void print_link(link_result *L, int json) {
    const double factor = 2.0 * 3 / 4; /* busbw = algbw x 2(n-1)/n, n = 4 */
    double t[MAX_SIZES][IMPL_COUNT], r[CNN_COUNT], bw[MAX_SIZES][IMPL_COUNT];
    link_medians(L, t, r);
    for (int z = 0; z < L->n_sizes; z++)
        for (int k = 0; k < IMPL_COUNT; k++)
            bw[z][k] = t[z][k] > 0 ? (double)L->bytes[z] / t[z][k] / 1e9 * factor : 0;
    if (!json) {
        printf("\n## %s: %s per host, %s each way; 2 hosts x 2 ranks\n\n", L->label, L->rate,
               L->delay);
        printf("busbw in GB/s. mpirun: MPI_Allreduce, the mpi backend flat and hierarchical; "
               "tandemrun --nnodes 2: the ucx backend flat and hierarchical.\n\n");
        printf("| size | MPI_Allreduce | mpi flat | mpi hier | ucx flat | ucx hier | mpi hier / "
               "MPI | mpi flat / MPI | mpi hier / flat | ucx hier / MPI |\n"
               "|---|---|---|---|---|---|---|---|---|---|\n");
    }
    for (int z = 0; z < L->n_sizes; z++) {
        const double *b = bw[z];
        if (json)
            printf("{\"bench\":\"multihost_allreduce\",\"link\":\"%s\",\"bytes\":%zu,"
                   "\"mpi_busbw\":%.4f,\"flat_busbw\":%.4f,\"hier_busbw\":%.4f,"
                   "\"ucx_flat_busbw\":%.4f,\"ucx_hier_busbw\":%.4f}\n",
                   L->label, L->bytes[z], b[IMPL_MPI], b[IMPL_FLAT], b[IMPL_HIER],
                   b[IMPL_UCX_FLAT], b[IMPL_UCX_HIER]);
        else
            printf("| %zu KiB | %.3f | %.3f | %.3f | %.3f | %.3f | %.2fx | %.2fx | %.2fx | %.2fx |\n",
                   L->bytes[z] >> 10, b[IMPL_MPI], b[IMPL_FLAT], b[IMPL_HIER], b[IMPL_UCX_FLAT],
                   b[IMPL_UCX_HIER], ratio(b[IMPL_HIER], b[IMPL_MPI]),
                   ratio(b[IMPL_FLAT], b[IMPL_MPI]), ratio(b[IMPL_HIER], b[IMPL_FLAT]),
                   ratio(b[IMPL_UCX_HIER], b[IMPL_MPI]));
    }
    if (json) {
        printf("{\"bench\":\"multihost_cnn\",\"link\":\"%s\",\"flat\":%.1f,\"hier\":%.1f,"
               "\"nocomm\":%.1f,\"ddp2\":%.1f}\n",
               L->label, r[0], r[1], r[2], r[3]);
        return;
    }
    printf("\n| CNN, global batch 128 | samples/s | vs DDP flat |\n|---|---|---|\n");
    for (int v = 0; v < CNN_COUNT; v++)
        printf("| %s | %.0f | %.2fx |\n", cnn_names[v], r[v], ratio(r[v], r[CNN_FLAT]));
}

/* The bars beside what this run measured: over the slow link hierarchical all-reduce
 * >= 1.4x flat MPI_Allreduce at 16 MiB and CNN DDP hierarchical >= 1.2x flat; over the fast
 * one hierarchical no slower than flat MPI_Allreduce at any size. */
static void print_targets(link_result *fast, link_result *slow) {
    double t[MAX_SIZES][IMPL_COUNT], r[CNN_COUNT], worst = 0;
    link_medians(slow, t, r);
    printf("\n## Targets\n\n");
    for (int z = 0; z < slow->n_sizes; z++)
        if (slow->bytes[z] == (16u << 20))
            printf("- %s, 16 MiB: hierarchical / MPI_Allreduce %.2fx (want >= 1.4x)\n",
                   slow->label, ratio(t[z][IMPL_MPI], t[z][IMPL_HIER]));
    printf("- %s, CNN: DDP hierarchical / flat %.2fx (want >= 1.2x)\n", slow->label,
           ratio(r[CNN_HIER], r[CNN_FLAT]));
    link_medians(fast, t, r);
    size_t at = 0;
    for (int z = 0; z < fast->n_sizes; z++) {
        double q = ratio(t[z][IMPL_MPI], t[z][IMPL_HIER]);
        if (z == 0 || q < worst) worst = q, at = fast->bytes[z];
    }
    printf("- %s: hierarchical / MPI_Allreduce at worst %.2fx, at %zu KiB (want >= 1.0x)\n",
           fast->label, worst, at >> 10);
}
#endif

int main(int argc, char **argv) {
#ifdef BENCH_MPI
    if (argc > 3 && strcmp(argv[1], "--allreduce-rank") == 0)
        return allreduce_rank(argv[2], (size_t)atoll(argv[3]));
    if (argc > 3 && strcmp(argv[1], "--cnn-rank") == 0) return cnn_rank(argv[2], atoi(argv[3]));
    if (argc > 3 && strcmp(argv[1], "--ddp2-rank") == 0) return ddp2_rank(argv[2], atoi(argv[3]));
#endif
    if (argc > 3 && strcmp(argv[1], "--ucx-allreduce-rank") == 0)
        return ucx_allreduce_rank(argv[2], (size_t)atoll(argv[3]));
    if (argc > 5 && strcmp(argv[1], "--inside") == 0) { /* OUT REPEAT MAX_BYTES STEPS */
        if (!realpath(argv[0], self)) return 1;
        char tmp[PATH_MAX + 16];
        snprintf(tmp, sizeof tmp, "%s", self);
        snprintf(bin, sizeof bin, "%s", dirname(dirname(tmp)));
        snprintf(tmp, sizeof tmp, "%s/../scripts", bin);
        if (!realpath(tmp, scripts)) return 1;
        return inside(argv[2], atoi(argv[3]), (size_t)atoll(argv[4]), atoi(argv[5]));
    }
    int repeat = 3, steps = 10, json = 0;
    long max_bytes = 64L << 20;
    td_args a;
    td_args_init(&a, "multihost", argc, argv);
    while (td_args_next(&a)) {
        td_args_int(&a, "--repeat", 1, 15, &repeat);
        td_args_long(&a, "--max-bytes", 64L << 10, LONG_MAX, &max_bytes);
        td_args_int(&a, "--steps", 1, INT_MAX, &steps);
        td_args_flag(&a, "--json", &json);
    }
    bench_args_finish(&a, "usage: multihost [--repeat K] [--max-bytes N] [--steps S] [--json]\n");
#ifndef BENCH_MPI
    (void)json;
    fprintf(stderr, "multihost: needs Open MPI (built without mpi.h)\n");
    return 1;
#else
    if (!realpath(argv[0], self)) return 1;
    char tmp[PATH_MAX + 16];
    snprintf(tmp, sizeof tmp, "%s", self);
    snprintf(bin, sizeof bin, "%s", dirname(dirname(tmp)));
    snprintf(tmp, sizeof tmp, "%s/../scripts", bin);
    if (!realpath(tmp, scripts) || access("/run", W_OK) != 0 || geteuid() != 0) {
        fprintf(stderr, "multihost: needs root and the repository's scripts/ (hosts.sh)\n");
        return 1;
    }
    link_result links[2] = {{.rate = "10gbit", .delay = "50us", .label = "10 Gbit/s + 50 us"},
                            {.rate = "1gbit", .delay = "200us", .label = "1 Gbit/s + 200 us"}};
    char cpu[512];
    if (!json) {
        printf("# tandem multihost: 2 emulated hosts (network namespaces) x 2 ranks, one thread per "
               "rank, on %s\n", bench_cpu_name(cpu, sizeof cpu));
        printf("# medians of %d interleaved repeats; all-reduce f32 sum; CNN global batch %d, %d "
               "timed steps\n", repeat, GLOBAL_BATCH, steps);
        fflush(stdout);
    }
    for (int l = 0; l < 2; l++) {
        char out[] = "/tmp/tandem-multihost-XXXXXX", cmd[4 * PATH_MAX];
        int fd = mkstemp(out);
        if (fd < 0) return 1;
        close(fd);
        snprintf(cmd, sizeof cmd,
                 "sh %s/hosts.sh run 2 --rate %s --delay %s %s --inside %s %d %zu %d >&2",
                 scripts, links[l].rate, links[l].delay, self, out, repeat, (size_t)max_bytes, steps);
        int rc = system(cmd);
        read_results(out, &links[l]);
        unlink(out);
        if (rc) fprintf(stderr, "multihost: the %s run failed (%d)\n", links[l].label, rc);
        print_link(&links[l], json);
        fflush(stdout);
    }
    if (!json) print_targets(&links[0], &links[1]);
    return 0;
#endif
}
