/* Training throughput, tandem vs PyTorch, side by side in one run.
 *
 * For each model (PyTorch's MNIST example Net, the MLP, the CNN) at global batch 128 and one thread
 * per rank (--threads N: N OpenMP threads, the ranks then not pinned): samples/s of forward +
 * backward + SGD step, at world size 1 (one process) and 2 (two processes, DDP over the shm
 * backend, each rank pinned to its own core), as the median of several timed windows after warm-up.
 * The PyTorch peer (bench/train_torch.py under Debian's python3-torch, torch.set_num_threads(1),
 * DDP over gloo for world 2) runs in the same invocation and the table prints the ratios; so does a
 * current PyTorch 2.x from PyPI, a second peer column, where scripts/deps.sh torch2 installed it
 * (.venv/torch2, or the interpreter --torch2 names; one line says so where it is missing).
 *
 * Each world size above 1 also gets a "no comm" row: the same ranks, each on its own core with
 * its share of the batch, but no process group and no DDP. It is the ceiling for that world
 * size on this machine (what the cores do with smaller batches), so DDP's own cost is the gap
 * between the two rows: a line under them gives DDP's efficiency, its samples/s over the
 * ceiling's and the ceiling's CPU time per step over its own (rank 0's, every thread). --repeat K runs the whole sequence K times, interleaved so that slow
 * spells of a shared machine fall on every row alike, and prints medians over the repeats
 * (scaling: the median of each repeat's ratio).
 *
 * --amp O0,O2 adds mixed-precision rows (apex's levels, bf16 unless --amp-dtype f16, which
 * also runs a dynamic loss scale as f16 needs). Their peer is PyTorch's autocast
 * (torch.autocast("cpu", dtype=torch.bfloat16)); "vs f32" is the speed-up over our own O0 row
 * of the same world size.
 *
 * A second table puts deterministic mode (docs/reproducibility.md: the global batch in --shards
 * fixed shards run one by one per rank, their gradients summed in a fixed tree) beside the
 * default DDP at each world size (at world 1, one process of the default mode), f32, same
 * models, interleaved with it. --shards 0 leaves it out. Deterministic mode runs every shard on
 * one thread whatever --threads says (td_graph_params.threads), so with --threads 2 its rows
 * say what the idle threads cost. Beside the samples/s it gives rank 0's CPU time per step (every
 * thread of the process: compute, communication progress), which other jobs on a shared machine
 * disturb far less than the wall clock, and the ratio of the two modes' CPU times.
 *
 * --device cuda:0 trains every rank on that GPU (cuda: each rank on cuda:LOCAL_RANK), DDP's
 * all-reduces taking the group's device path (CUDA IPC for ranks that share a GPU), each window
 * ended by a device synchronisation; the "no comm" row is then DDP's ceiling on that GPU, and a
 * line gives DDP's efficiency (its samples/s over the ceiling's). The PyTorch peer and the
 * deterministic table are CPU-only and left out there (bench/train_gpu compares one GPU with
 * PyTorch).
 *
 *   build/bench/train [--models net,mlp,cnn] [--worlds 1,2] [--amp O0,O2] [--amp-dtype bf16]
 *                     [--iters 20] [--windows 5] [--repeat K] [--shards 8] [--threads 1]
 *                     [--device cpu|cuda|cuda:N] [--no-torch] [--json]
 *
 * A last table puts DDP with the flight recorder off (TANDEM_DOCTOR=0) beside the default, where
 * it records, at each world size above 1, f32, interleaved with it: what the recorder costs a step.
 *
 * Every measurement runs in fresh child processes, so no oneDNN or OpenMP state crosses a
 * fork. */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tandem/tandem.h"

#include "bench.h"

#define GLOBAL_BATCH 128
#define MAX_WORLDS 4
#define MAX_REPEAT 15
#define MAX_LEVELS 4

typedef struct {
    int iters, windows, warmup;
    td_dtype amp_dtype;
    int threads;        /* OpenMP threads per rank */
    const char *device; /* --device as td_device_choose reads it: "cpu", "cuda", "cuda:0" */
} timing;

/* What a rank measured: the median over windows of samples/s (global) and of its process's CPU
 * milliseconds per step. */
typedef struct {
    double rate, cpu_ms;
} measure;

static double cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* One rank of a run. shards > 0: deterministic mode, the graph built for one shard and run for
 * each of this rank's. */
static measure rank_main(td_model_kind kind, td_amp_level amp, int rank, int world, int comm_on,
                         int shards, const timing *tm) {
    td_comm *comm = (world > 1 || shards) && comm_on ? bench_comm() : NULL;
    int64_t local = shards ? GLOBAL_BATCH / shards : GLOBAL_BATCH / world;
    td_graph *g;
    td_model m;
    td_graph_params gp = td_graph_default_params();
    CHECK(td_device_choose(tm->device, &gp.device));
    gp.amp.level = amp;
    gp.amp.dtype = tm->amp_dtype;
    gp.threads = shards ? 1 : 0; /* deterministic: no sum depends on OMP_NUM_THREADS */
    gp.blocked_linear = shards > 0 && local <= 16; /* as examples/mnist chooses */
    CHECK(td_graph_create(&g, &gp));
    CHECK(td_model_build(g, kind, local, 1, &m));
    CHECK(td_graph_compile(g));
    td_dataset *data;
    CHECK(td_dataset_load_fashion_mnist(&data, NULL, TD_SPLIT_TEST));
    CHECK(td_tensor_write(m.input, td_dataset_x(data) + (size_t)(rank * local) * 784));
    CHECK(td_tensor_write(m.labels, td_dataset_y(data) + rank * local));
    td_dataset_destroy(data);
    td_param *params, *buffers;
    size_t n_params, n_buffers;
    CHECK(td_graph_parameters(g, &params, &n_params));
    CHECK(td_graph_buffers(g, &buffers, &n_buffers));
    td_sgd_params sp = td_sgd_default_params();
    sp.lr = 0.01;
    sp.momentum = 0.5;
    td_optim *opt;
    CHECK(td_optim_create_sgd(&opt, params, n_params, &sp));
    td_grad_scaler *scaler = NULL;
    if (amp != TD_AMP_O0 && tm->amp_dtype == TD_F16) {
        td_grad_scaler_params scp = td_grad_scaler_default_params();
        scp.comm = comm;
        CHECK(td_grad_scaler_create(&scaler, &scp));
    }
    td_ddp *ddp = NULL;
    if (comm) {
        td_ddp_params dp = td_ddp_default_params();
        dp.deterministic = shards > 0;
        dp.shards = (size_t)shards;
        CHECK(td_ddp_create(&ddp, comm, params, n_params, buffers, n_buffers, &dp));
        td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, ddp);
    }
    size_t first = 0, count = 1;
    if (shards) td_ddp_shards(ddp, &first, &count);
    double *rates = malloc((size_t)tm->windows * sizeof *rates);
    double *cpu = malloc((size_t)tm->windows * sizeof *cpu);
    int64_t step = 0;
    int skipped = 0; /* the last step, by the loss scaler: not a divergence */
    for (int w = -1; w < tm->windows; w++) { /* window -1 is the warm-up */
        int iters = w < 0 ? tm->warmup : tm->iters;
        if (comm) CHECK(td_comm_barrier(comm));
        uint64_t t0 = td_time_ns();
        double c0 = cpu_s();
        for (int i = 0; i < iters; i++) {
            for (size_t j = 0; j < count; j++) { /* one pass, or this rank's shards */
                if (ddp) CHECK(td_ddp_prepare_forward(ddp));
                if (j > 0) td_graph_keep_weights(g); /* the step's parameters */
                if (shards)
                    CHECK(td_graph_set_rng_key(g, (uint64_t)i, (first + j) * (size_t)local));
                CHECK(td_graph_forward(g));
                float seed = scaler ? td_grad_scaler_scale(scaler) : 1.0f;
                if (shards) CHECK(td_graph_zero_grad(g));
                if (shards) CHECK(td_graph_set_shard(g, j, count)); /* linear layers sum them */
                CHECK(td_graph_backward_from(g, m.loss, &seed));
                if (ddp) CHECK(td_ddp_finish_backward(ddp));
            }
            if (scaler) {
                CHECK(td_grad_scaler_step(scaler, opt, &skipped));
                td_grad_scaler_update(scaler);
            } else {
                CHECK(td_optim_step(opt));
            }
            CHECK(td_graph_zero_grad(g));
            step++;
        }
        if (gp.device.type != TD_DEVICE_CPU) CHECK(td_device_synchronize(gp.device));
        /* the window's last loss (a GPU's read once a window); a NaN stays NaN after it */
        float loss;
        CHECK(td_tensor_read(m.loss, &loss));
        if (!skipped) CHECK(td_loss_check(loss, step));
        if (w >= 0) {
            rates[w] = (double)GLOBAL_BATCH * iters / ((double)(td_time_ns() - t0) * 1e-9);
            cpu[w] = (cpu_s() - c0) * 1e3 / iters;
        }
    }
    qsort(rates, (size_t)tm->windows, sizeof *rates, bench_cmp_double);
    qsort(cpu, (size_t)tm->windows, sizeof *cpu, bench_cmp_double);
    measure median = {rates[tm->windows / 2], cpu[tm->windows / 2]};
    free(rates);
    free(cpu);
    td_ddp_destroy(ddp);
    td_grad_scaler_destroy(scaler);
    td_optim_destroy(opt);
    td_graph_destroy(g);
    td_comm_destroy(comm);
    return median;
}

typedef struct {
    td_model_kind kind;
    td_amp_level amp;
    int comm_on, shards;
    const timing *tm;
} run_job;

static int run_rank(int rank, int world, void *result, void *arg) {
    const run_job *j = arg;
    *(measure *)result = rank_main(j->kind, j->amp, rank, world, j->comm_on, j->shards, j->tm);
    return 0;
}

/* Runs `world` ranks (each on its own core), with DDP (deterministic over `shards` when > 0) or
 * (comm_on 0) each on its own; returns rank 0's samples/s, or -1 on failure, and its CPU
 * milliseconds per step in *cpu_ms when cpu_ms is not NULL. */
static double run_tandem(td_model_kind kind, td_amp_level amp, int world, int comm_on, int shards,
                         const timing *tm, double *cpu_ms) {
    measure m[8];
    run_job j = {kind, amp, comm_on, shards, tm};
    /* one core per rank; ranks of several threads are left to the scheduler */
    int failed = bench_ranks(world, world > 1 && tm->threads == 1, run_rank, &j, m, sizeof *m);
    if (cpu_ms) *cpu_ms = failed ? -1 : m[0].cpu_ms;
    return failed ? -1 : m[0].rate;
}

/* The PyTorch peer's samples/s under `python` (under autocast for a mixed-precision level), or -1
 * when it could not run. */
static double run_torch(const char *python, const char *model, td_amp_level amp, int world,
                        const timing *tm) {
    char cmd[768];
    snprintf(cmd, sizeof cmd,
             "OMP_NUM_THREADS=%d OPENBLAS_NUM_THREADS=%d %s bench/train_torch.py "
             "--model %s --world %d --iters %d --windows %d --warmup %d --threads %d "
             "--autocast %s 2>/dev/null",
             tm->threads, tm->threads, python, model, world, tm->iters, tm->windows, tm->warmup,
             tm->threads, amp == TD_AMP_O0 ? "none" : td_dtype_name(tm->amp_dtype));
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    char line[4096];
    double rate = -1;
    while (fgets(line, sizeof line, p)) {
        const char *k = strstr(line, "\"samples_per_s\":");
        if (k) rate = atof(k + strlen("\"samples_per_s\":"));
    }
    if (pclose(p) != 0) return -1;
    return rate;
}

/* Median of the n values of v that are >= 0 (failed runs are -1); -1 when none are. */
static double median_of(const double *v, int n) {
    double ok[MAX_REPEAT];
    int m = 0;
    for (int i = 0; i < n; i++)
        if (v[i] >= 0) ok[m++] = v[i];
    if (!m) return -1;
    qsort(ok, (size_t)m, sizeof *ok, bench_cmp_double);
    return ok[m / 2];
}

/* Median over repeats of a[r] / b[r]; -1 when no repeat has both. */
static double median_ratio(const double *a, const double *b, int n) {
    double q[MAX_REPEAT];
    for (int r = 0; r < n; r++) q[r] = a[r] > 0 && b[r] > 0 ? a[r] / b[r] : -1;
    return median_of(q, n);
}

typedef struct {
    const char *model;
    int world;
    const char *label;                                            /* "" or ", no comm" */
    const char *amp;                                              /* "f32", "O2 bf16", ... */
    double ours, theirs, ratio, theirs2, ratio2, scaling, vs_f32; /* theirs2: PyTorch 2.x */
} row;

static void print_row(const row *r, int json) {
    char w[24], peer[16] = "-", rt[16] = "-", peer2[16] = "-", rt2[16] = "-", sc[16] = "-",
                vf[16] = "-";
    snprintf(w, sizeof w, "%d%s", r->world, r->label);
    if (r->theirs > 0) snprintf(peer, sizeof peer, "%.0f", r->theirs);
    if (r->ratio > 0) snprintf(rt, sizeof rt, "%.2fx", r->ratio);
    if (r->theirs2 > 0) snprintf(peer2, sizeof peer2, "%.0f", r->theirs2);
    if (r->ratio2 > 0) snprintf(rt2, sizeof rt2, "%.2fx", r->ratio2);
    if (r->scaling > 0) snprintf(sc, sizeof sc, "%.2fx", r->scaling);
    if (r->vs_f32 > 0) snprintf(vf, sizeof vf, "%.2fx", r->vs_f32);
    printf("%-6s %-8s %-11s %10.0f %10s %8s %10s %8s %8s %14s\n", r->model, r->amp, w, r->ours,
           peer, rt, peer2, rt2, vf, sc);
    if (json)
        printf("{\"model\": \"%s\", \"amp\": \"%s\", \"world\": %d, \"comm\": %s, "
               "\"tandem\": %.1f, \"pytorch\": %.1f, \"pytorch2\": %.1f, \"vs_f32\": %.3f, "
               "\"scaling\": %.3f}\n",
               r->model, r->amp, r->world, *r->label ? "false" : "true", r->ours, r->theirs,
               r->theirs2, r->vs_f32, r->scaling);
    fflush(stdout);
}

/* "O0,O2" -> levels; returns how many, or -1 when malformed. */
static int parse_levels(const char *list, td_amp_level *out) {
    char buf[64];
    int n = 0;
    snprintf(buf, sizeof buf, "%s", list);
    for (char *save = NULL, *l = strtok_r(buf, ",", &save); l; l = strtok_r(NULL, ",", &save)) {
        if (n == MAX_LEVELS || l[0] != 'O' || l[1] < '0' || l[1] > '3' || l[2]) return -1;
        out[n++] = (td_amp_level)(l[1] - '0');
    }
    return n;
}

/* What td_graph_amp_fallback says about a graph at `level` (empty: it runs as asked), from a
 * child process, so that this one keeps oneDNN unstarted for the forks that measure. */
typedef struct {
    td_amp_level level;
    td_dtype dtype;
} amp_probe;

static int amp_note_rank(int rank, int world, void *result, void *arg) {
    (void)rank, (void)world;
    const amp_probe *a = arg;
    td_graph_params gp = td_graph_default_params();
    gp.amp.level = a->level;
    gp.amp.dtype = a->dtype;
    td_graph *g;
    CHECK(td_graph_create(&g, &gp));
    const char *why = td_graph_amp_fallback(g);
    snprintf(result, 512, "%s", why ? why : "");
    td_graph_destroy(g);
    return 0;
}

static int model_ok(const char *name) {
    td_model_kind kind;
    return td_model_kind_parse(name, &kind) == TD_OK;
}

int main(int argc, char **argv) {
    const char *models = "net,mlp,cnn", *torch2 = BENCH_TORCH2;
    timing tm = {20, 5, 5, TD_BF16, 1, "cpu"};
    int no_torch = 0, json = 0, repeat = 1, shards = 8, amp_dtype = -1;
    int ws[MAX_WORLDS] = {1, 2}, nw = 2, w1 = -1;
    td_amp_level levels[MAX_LEVELS] = {TD_AMP_O0};
    int nl = 1, l0 = -1;
    td_args a;
    td_args_init(&a, "train", argc, argv);
    while (td_args_next(&a)) {
        bench_list_option(&a, "--models", &models, model_ok,
                          "comma-separated models: net, mlp, cnn, resnet");
        td_args_int_list(&a, "--worlds", 1, 8, ws, MAX_WORLDS, &nw);
        td_args_int(&a, "--iters", 1, INT_MAX, &tm.iters);
        td_args_int(&a, "--windows", 1, INT_MAX, &tm.windows);
        if (td_args_is(&a, "--amp")) {
            const char *v = td_args_value(&a);
            if (v && (nl = parse_levels(v, levels)) < 1)
                td_args_bad_value(&a, v, "levels O0..O3, comma-separated");
        }
        td_args_choice(&a, "--amp-dtype", "bf16|f16", &amp_dtype);
        td_args_int(&a, "--repeat", 1, MAX_REPEAT, &repeat);
        td_args_int(&a, "--shards", 0, GLOBAL_BATCH, &shards);
        td_args_int(&a, "--threads", 1, 64, &tm.threads);
        td_args_string(&a, "--device", &tm.device);
        td_args_string(&a, "--torch2", &torch2);
        td_args_flag(&a, "--no-torch", &no_torch);
        td_args_flag(&a, "--json", &json);
    }
    if (shards && GLOBAL_BATCH % shards)
        td_args_error(&a, "--shards %d: expected 0 or a divisor of %d", shards, GLOBAL_BATCH);
    for (int i = 0; i < nw; i++)
        if (GLOBAL_BATCH % ws[i])
            td_args_error(&a, "--worlds: %d does not divide %d", ws[i], GLOBAL_BATCH);
    td_device device;
    if (td_device_parse(tm.device, &device))
        td_args_error(&a, "--device %s: expected cpu, cuda or cuda:N", tm.device);
    bench_args_finish(&a, "usage: train [--models net,mlp,cnn] [--worlds 1,2] [--amp O0,O2] "
                          "[--amp-dtype bf16|f16] [--iters N] [--windows N] [--repeat K] "
                          "[--shards S] [--threads N] [--device cpu|cuda|cuda:N] [--no-torch] "
                          "[--torch2 PYTHON] [--json]\n");
    if (amp_dtype >= 0) tm.amp_dtype = amp_dtype ? TD_F16 : TD_BF16;
    int torch = !no_torch;
    int gpu = device.type != TD_DEVICE_CPU;
    if (gpu && bench_gpus("bench/train") == 0) return 0;
    if (gpu) {
        /* The peer trains on the CPU, and deterministic mode's shard tree sums there. */
        torch = 0;
        shards = 0;
    }
    for (int l = 0; l < nl; l++)
        if (levels[l] == TD_AMP_O0) l0 = l;
    for (int i = 0; i < nw; i++)
        if (ws[i] == 1) w1 = i;
    bench_threads(argv, tm.threads);
    char v2[64] = "";
    int have2 = torch && bench_torch2(torch2, v2, sizeof v2);
    for (int l = 0; l < nl && !gpu; l++) {
        amp_probe probe = {levels[l], tm.amp_dtype};
        char why[512] = "";
        if (levels[l] != TD_AMP_O0 && !bench_ranks(1, 0, amp_note_rank, &probe, why, sizeof why) &&
            why[0])
            printf("%s\n", why);
    }
    char cpu[256];
    printf("%s\nsamples/s at global batch %d, %d thread(s) per rank, median of %d windows of %d "
           "steps",
           bench_cpu_name(cpu, sizeof cpu), GLOBAL_BATCH, tm.threads, tm.windows, tm.iters);
    if (gpu)
        printf("; every rank on %s (DDP's efficiency: its samples/s over the no-comm row's)",
               tm.device);
    if (repeat > 1) printf("; medians of %d interleaved repeats", repeat);
    if (have2) printf("; PyTorch %s beside Debian's", v2);
    printf("\n%-6s %-8s %-11s %10s %10s %8s %10s %8s %8s %14s\n", "model", "amp", "world", "tandem",
           "pytorch", "ratio", "torch 2.x", "ratio", "vs f32", "scaling vs w1");
    char mlist[64];
    snprintf(mlist, sizeof mlist, "%s", models);
    int failed = 0;
    /* Deterministic mode beside the default f32 DDP of the same repeat (printed at the end). */
    struct {
        const char *model;
        int world;
        double det, def, ratio, det_cpu, def_cpu, cpu_ratio;
    } det_rows[16];
    int n_det = 0;
    /* The flight recorder on (as always) against off (TANDEM_DOCTOR=0), f32 DDP of the same
     * repeat (printed at the end). */
    struct {
        const char *model;
        int world;
        double on, off, ratio, on_cpu, off_cpu, cpu_ratio;
    } rec_rows[16];
    int n_rec = 0;
    for (char *save = NULL, *name = strtok_r(mlist, ",", &save); name;
         name = strtok_r(NULL, ",", &save)) {
        td_model_kind kind;
        CHECK(td_model_kind_parse(name, &kind)); /* checked with the options */
        double ours[MAX_LEVELS][MAX_WORLDS][MAX_REPEAT], alone[MAX_LEVELS][MAX_WORLDS][MAX_REPEAT],
            theirs[MAX_LEVELS][MAX_WORLDS][MAX_REPEAT], theirs2[MAX_LEVELS][MAX_WORLDS][MAX_REPEAT],
            det[MAX_WORLDS][MAX_REPEAT], ours_cpu[MAX_LEVELS][MAX_WORLDS][MAX_REPEAT],
            alone_cpu[MAX_LEVELS][MAX_WORLDS][MAX_REPEAT], det_cpu[MAX_WORLDS][MAX_REPEAT],
            rec_off[MAX_WORLDS][MAX_REPEAT], rec_off_cpu[MAX_WORLDS][MAX_REPEAT];
        /* only the f32 level runs deterministic mode: the others leave it as they find it */
        for (int i = 0; i < nw; i++)
            for (int r = 0; r < repeat; r++) det[i][r] = -1;
        for (int r = 0; r < repeat; r++)
            for (int l = 0; l < nl; l++)
                for (int i = 0; i < nw; i++) {
                    ours[l][i][r] = run_tandem(kind, levels[l], ws[i], 1, 0, &tm, &ours_cpu[l][i][r]);
                    alone_cpu[l][i][r] = -1;
                    alone[l][i][r] = ws[i] > 1 ? run_tandem(kind, levels[l], ws[i], 0, 0, &tm,
                                                            &alone_cpu[l][i][r])
                                               : -1;
                    /* PyTorch's autocast has no levels: one peer row serves them all. */
                    int same = l > 0 && levels[l] != TD_AMP_O0 && levels[l - 1] != TD_AMP_O0;
                    int no_peer = tm.amp_dtype == TD_F16 && levels[l] != TD_AMP_O0; /* bf16 only */
                    theirs[l][i][r] =
                        !torch || no_peer ? -1
                        : same            ? theirs[l - 1][i][r]
                               : run_torch("/usr/bin/python3", name, levels[l], ws[i], &tm);
                    theirs2[l][i][r] = !have2 || no_peer ? -1
                                       : same            ? theirs2[l - 1][i][r]
                                              : run_torch(torch2, name, levels[l], ws[i], &tm);
                    failed |= ours[l][i][r] < 0 || (ws[i] > 1 && alone[l][i][r] < 0);
                    /* S / world must be a power of two for the shard tree. */
                    int per = shards && shards % ws[i] == 0 ? shards / ws[i] : 0;
                    if (levels[l] == TD_AMP_O0 && per && !(per & (per - 1))) {
                        det[i][r] =
                            run_tandem(kind, TD_AMP_O0, ws[i], 1, shards, &tm, &det_cpu[i][r]);
                        failed |= det[i][r] < 0;
                    }
                    if (levels[l] == TD_AMP_O0 && ws[i] > 1) { /* the ranks fork after this */
                        setenv("TANDEM_DOCTOR", "0", 1);
                        rec_off[i][r] =
                            run_tandem(kind, TD_AMP_O0, ws[i], 1, 0, &tm, &rec_off_cpu[i][r]);
                        unsetenv("TANDEM_DOCTOR");
                        failed |= rec_off[i][r] < 0;
                    }
                }
        for (int i = 0; i < nw && l0 >= 0; i++)
            if (det[i][0] >= 0 && n_det < 16) {
                det_rows[n_det].model = name;
                det_rows[n_det].world = ws[i];
                det_rows[n_det].det = median_of(det[i], repeat);
                det_rows[n_det].def = median_of(ours[l0][i], repeat);
                det_rows[n_det].ratio = median_ratio(det[i], ours[l0][i], repeat);
                det_rows[n_det].det_cpu = median_of(det_cpu[i], repeat);
                det_rows[n_det].def_cpu = median_of(ours_cpu[l0][i], repeat);
                /* default / deterministic CPU time: comparable with the samples/s ratio */
                det_rows[n_det++].cpu_ratio = median_ratio(ours_cpu[l0][i], det_cpu[i], repeat);
            }
        for (int i = 0; i < nw && l0 >= 0; i++)
            if (ws[i] > 1 && n_rec < 16) {
                rec_rows[n_rec].model = name;
                rec_rows[n_rec].world = ws[i];
                rec_rows[n_rec].on = median_of(ours[l0][i], repeat);
                rec_rows[n_rec].off = median_of(rec_off[i], repeat);
                rec_rows[n_rec].ratio = median_ratio(ours[l0][i], rec_off[i], repeat);
                rec_rows[n_rec].on_cpu = median_of(ours_cpu[l0][i], repeat);
                rec_rows[n_rec].off_cpu = median_of(rec_off_cpu[i], repeat);
                rec_rows[n_rec++].cpu_ratio = median_ratio(ours_cpu[l0][i], rec_off_cpu[i], repeat);
            }
        for (int l = 0; l < nl; l++)
            for (int i = 0; i < nw; i++) {
                char amp[16] = "f32";
                if (levels[l] != TD_AMP_O0)
                    snprintf(amp, sizeof amp, "O%d %s", (int)levels[l],
                             td_dtype_name(tm.amp_dtype));
                double *base = w1 >= 0 ? ours[l][w1] : NULL;
                row rw = {name,
                          ws[i],
                          "",
                          amp,
                          median_of(ours[l][i], repeat),
                          median_of(theirs[l][i], repeat),
                          median_ratio(ours[l][i], theirs[l][i], repeat),
                          median_of(theirs2[l][i], repeat),
                          median_ratio(ours[l][i], theirs2[l][i], repeat),
                          base && ws[i] > 1 ? median_ratio(ours[l][i], base, repeat) : -1,
                          l0 >= 0 && l != l0 ? median_ratio(ours[l][i], ours[l0][i], repeat) : -1};
                print_row(&rw, json);
                if (ws[i] > 1) {
                    row na = {name,
                              ws[i],
                              ", no comm",
                              amp,
                              median_of(alone[l][i], repeat),
                              -1,
                              -1,
                              -1,
                              -1,
                              base ? median_ratio(alone[l][i], base, repeat) : -1,
                              -1};
                    print_row(&na, json);
                    /* DDP's efficiency: its samples/s over the no-comm row's, and the no-comm
                     * row's CPU time per step over DDP's (rank 0, every thread), which other
                     * jobs on a shared machine disturb far less than the wall clock */
                    double eff = median_ratio(ours[l][i], alone[l][i], repeat);
                    double eff_cpu = median_ratio(alone_cpu[l][i], ours_cpu[l][i], repeat);
                    printf("%-6s %-8s %-11d DDP efficiency %.2f (samples/s), %.2f (CPU time per "
                           "step, %.2f ms / %.2f ms no comm)\n",
                           name, amp, ws[i], eff, eff_cpu, median_of(ours_cpu[l][i], repeat),
                           median_of(alone_cpu[l][i], repeat));
                    if (json)
                        printf("{\"model\": \"%s\", \"amp\": \"%s\", \"world\": %d, "
                               "\"device\": \"%s\", \"ddp_efficiency\": %.3f, "
                               "\"ddp_efficiency_cpu\": %.3f}\n",
                               name, amp, ws[i], tm.device, eff, eff_cpu);
                }
            }
    }
    if (n_det) {
        printf("\ndeterministic mode: %d shards of %d samples, f32, samples/s and rank 0's CPU ms "
               "per step (ratios: medians of each repeat's deterministic / default samples/s,\n"
               "and default / deterministic CPU time)\n%-6s %-6s %10s %14s %8s %12s %12s %10s\n",
               shards, GLOBAL_BATCH / shards, "model", "world", "default", "deterministic", "ratio",
               "cpu default", "cpu determ.", "cpu ratio");
        for (int k = 0; k < n_det; k++) {
            printf("%-6s %-6d %10.0f %14.0f %7.2fx %12.2f %12.2f %9.2fx\n", det_rows[k].model,
                   det_rows[k].world, det_rows[k].def, det_rows[k].det, det_rows[k].ratio,
                   det_rows[k].def_cpu, det_rows[k].det_cpu, det_rows[k].cpu_ratio);
            if (json)
                printf("{\"model\": \"%s\", \"world\": %d, \"shards\": %d, \"default\": %.1f, "
                       "\"deterministic\": %.1f, \"ratio\": %.3f, \"cpu_ms_default\": %.3f, "
                       "\"cpu_ms_deterministic\": %.3f, \"cpu_ratio\": %.3f}\n",
                       det_rows[k].model, det_rows[k].world, shards, det_rows[k].def,
                       det_rows[k].det, det_rows[k].ratio, det_rows[k].def_cpu, det_rows[k].det_cpu,
                       det_rows[k].cpu_ratio);
        }
    }
    if (n_rec) {
        printf("\nflight recorder: f32 DDP with the recorder on (always, by default) and off "
               "(TANDEM_DOCTOR=0), samples/s and rank 0's CPU ms per step\n(ratios: medians of "
               "each repeat's on/off samples/s, and of off/on CPU time: below 1 means the recorder "
               "costs)\n%-6s %-6s %10s %10s %8s %12s %12s %10s\n",
               "model", "world", "on", "off", "ratio", "cpu on", "cpu off", "cpu ratio");
        for (int k = 0; k < n_rec; k++) {
            printf("%-6s %-6d %10.0f %10.0f %7.4fx %12.3f %12.3f %9.4fx\n", rec_rows[k].model,
                   rec_rows[k].world, rec_rows[k].on, rec_rows[k].off, rec_rows[k].ratio,
                   rec_rows[k].on_cpu, rec_rows[k].off_cpu, rec_rows[k].cpu_ratio);
            if (json)
                printf("{\"model\": \"%s\", \"world\": %d, \"recorder_on\": %.1f, "
                       "\"recorder_off\": %.1f, \"ratio\": %.4f, \"cpu_ms_on\": %.3f, "
                       "\"cpu_ms_off\": %.3f, \"cpu_ratio\": %.4f}\n",
                       rec_rows[k].model, rec_rows[k].world, rec_rows[k].on, rec_rows[k].off,
                       rec_rows[k].ratio, rec_rows[k].on_cpu, rec_rows[k].off_cpu,
                       rec_rows[k].cpu_ratio);
        }
    }
    return failed;
}
