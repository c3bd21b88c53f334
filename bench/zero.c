/* ZeRO (td_zero) beside DDP, and beside PyTorch's DDP with ZeroRedundancyOptimizer, in one run.
 *
 * Step time: the MLP (784 -> 1024 -> 1024 -> 10, 1.86 M parameters) at global batch 128 with
 * AdamW, one thread per rank, at world sizes 2 and 4: milliseconds per step (forward, backward,
 * the gradients' reduction, the optimizer step and, for ZeRO, the parameters' gathers) under
 * DDP and ZeRO stages 1, 2 and 3, and with no communication at all (each rank training alone on
 * its slice: the ceiling), median of timed windows after warm-up; beside each, the CPU time of
 * every thread of every rank per step, which a machine shared with other work changes less than
 * the wall time (a rank that waits gives its core away). --repeat K interleaves K repeats, each
 * starting with another way, and prints their medians; --phases splits rank 0's step into the
 * gather before the forward, forward, backward, finishing the reduction and the optimizer;
 * --ways picks some. The PyTorch peer (bench/zero_torch.py, Debian's python3-torch 1.13 over
 * gloo) runs DDP and DDP with torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO stage 1);
 * its FullyShardedDataParallel does not import under that build (docs/zero.md).
 *
 * Memory: a hand-written MLP of --width (2048: four layers of 2048 x 2048, 16.8 M parameters, 64
 * MiB) trained two AdamW steps at world sizes 1, 2 and 4 under DDP and each stage: the bytes
 * td_zero_memory_stats counts per kind, now and at the peak, the process's own resident memory
 * (VmRSS after the steps, VmHWM reset after creation: what training held at most) and the peak
 * of its proportional share of its anonymous and shared memory (Pss, sampled around every
 * layer's use: the ranks map each other's regions of the group's memory, which the resident
 * size counts once per rank), less what it held before the model existed. The trainer hands
 * its parameters to DDP or ZeRO and frees its own copy (ZeRO moved them), so the process holds
 * what the strategy holds plus a few activations.
 *
 * --cap MiB: the largest model of layers of 1024 x 1024 that DDP and each stage train at world
 * --cap-world (4) with every rank's peak proportional share within the cap, by doubling and
 * bisecting the number of layers. The cap is measured, not enforced: a cgroup's memory.max per
 * rank would be the real thing, but a benchmark cannot count on making cgroups (the machine of
 * docs/zero.md has its memory controller in cgroup v1, under its job manager, and none in v2),
 * and RLIMIT_DATA or RLIMIT_AS count address space (ZeRO reserves whole flats and every rank
 * maps the others' regions) while RLIMIT_DATA misses shared memory altogether.
 *
 *   build/bench/zero [--worlds 2,4] [--iters 10] [--windows 3] [--repeat K] [--phases]
 *                    [--ways ddp,1,2,3,none] [--width 2048] [--cap MiB] [--cap-world N]
 *                    [--no-torch] [--no-memory] [--no-time] [--json] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "tandem/tandem.h"

#include "bench.h"

#define GLOBAL_BATCH 128
#define MAX_WORLDS 4
#define MAX_REPEAT 9
#define MAX_WINDOWS 15
#define N_WAYS 5 /* DDP, stages 1, 2, 3, and each rank alone with no communication */
#define SOLO 4

static const char *WAY_NAMES[N_WAYS] = {"ddp", "zero 1", "zero 2", "zero 3", "no comm"};

/* The parts of a step timed apart (--phases): ZeRO's gather before the forward (DDP's buffer
 * broadcast), the forward, the backward (with the reductions it overlaps), finishing the
 * reduction, the optimizer step. */
enum { PH_PREPARE, PH_FORWARD, PH_BACKWARD, PH_FINISH, PH_OPTIM, N_PHASES };
static const char *PHASE_NAMES[N_PHASES] = {"gather", "forward", "backward", "finish", "optimizer"};

typedef struct {
    int iters, windows, warmup, width;
    unsigned ways; /* bit w: way w is timed (--ways) */
} timing;

/* What one rank measured: ms per step (median of the windows), its CPU ms per step (every
 * thread of the process, over the timed windows) and the phases' ms per step (medians). */
typedef struct {
    double ms, cpu_ms, phase[N_PHASES];
} step_time;

static double cpu_ms_now(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 +
           (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-3;
}

/* ---- step time -------------------------------------------------------------------------- */

/* One rank under DDP (way 0), a ZeRO stage (1-3) or alone (SOLO: its local batch, no group). */
static step_time time_rank(int way, int rank, int world, const timing *tm) {
    td_comm *comm = bench_comm();
    int64_t local = GLOBAL_BATCH / world;
    td_graph *g;
    td_model m;
    CHECK(td_graph_create(&g, NULL));
    CHECK(td_model_build(g, TD_MODEL_MLP, local, 1, &m));
    td_dataset *data;
    CHECK(td_dataset_load_fashion_mnist(&data, NULL, TD_SPLIT_TEST));
    CHECK(td_tensor_write(m.input, td_dataset_x(data) + (size_t)(rank * local) * 784));
    CHECK(td_tensor_write(m.labels, td_dataset_y(data) + rank * local));
    td_dataset_destroy(data);
    td_param *params, *stepped;
    size_t n_params, n_stepped;
    CHECK(td_graph_parameters(g, &params, &n_params));
    td_ddp *ddp = NULL;
    td_zero *zero = NULL;
    stepped = params;
    n_stepped = n_params;
    if (way == 0) {
        CHECK(td_ddp_create(&ddp, comm, params, n_params, NULL, 0, NULL));
        td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, ddp);
    } else if (way != SOLO) {
        td_zero_params zp = td_zero_default_params();
        zp.stage = way;
        CHECK(td_zero_create(&zero, comm, params, n_params, NULL, 0, &zp));
        CHECK(td_zero_parameters(zero, &stepped, &n_stepped));
        td_graph_set_grad_ready_hook(g, td_zero_grad_ready_hook, zero);
        td_graph_set_param_use_hook(g, td_zero_param_use_hook, zero);
    }
    td_adamw_params ap = td_adamw_default_params();
    td_optim *opt;
    CHECK(td_optim_create_adamw(&opt, stepped, n_stepped, &ap));
    double ms[MAX_WINDOWS], phase[N_PHASES][MAX_WINDOWS], cpu0 = 0;
    int64_t step = 0;
    for (int w = -1; w < tm->windows; w++) { /* window -1 is the warm-up */
        int iters = w < 0 ? tm->warmup : tm->iters;
        CHECK(td_comm_barrier(comm));
        if (w == 0) cpu0 = cpu_ms_now();
        uint64_t t0 = td_time_ns(), ph[N_PHASES] = {0};
        for (int i = 0; i < iters; i++) {
            uint64_t t[N_PHASES + 1];
            t[0] = td_time_ns();
            if (zero) CHECK(td_zero_prepare_forward(zero));
            if (ddp) CHECK(td_ddp_prepare_forward(ddp));
            t[1] = td_time_ns();
            CHECK(td_graph_forward(g));
            t[2] = td_time_ns();
            CHECK(td_graph_backward(g, m.loss));
            t[3] = td_time_ns();
            if (zero) CHECK(td_zero_finish_backward(zero));
            if (ddp) CHECK(td_ddp_finish_backward(ddp));
            t[4] = td_time_ns();
            CHECK(td_optim_step(opt));
            CHECK(td_graph_zero_grad(g));
            t[5] = td_time_ns();
            CHECK(td_loss_check(*(const float *)td_tensor_data(m.loss), ++step));
            for (int k = 0; k < N_PHASES; k++) ph[k] += t[k + 1] - t[k];
        }
        if (w < 0) continue;
        ms[w] = (double)(td_time_ns() - t0) * 1e-6 / iters;
        for (int k = 0; k < N_PHASES; k++) phase[k][w] = (double)ph[k] * 1e-6 / iters;
    }
    step_time out = {.cpu_ms = (cpu_ms_now() - cpu0) / ((double)tm->iters * tm->windows)};
    out.ms = bench_median(ms, tm->windows);
    for (int k = 0; k < N_PHASES; k++) out.phase[k] = bench_median(phase[k], tm->windows);
    td_graph_set_grad_ready_hook(g, NULL, NULL);
    td_graph_set_param_use_hook(g, NULL, NULL);
    td_optim_destroy(opt);
    td_ddp_destroy(ddp);
    td_zero_destroy(zero);
    td_graph_destroy(g);
    td_comm_destroy(comm);
    return out;
}

typedef struct {
    int way;
    const timing *tm;
} time_job;

static int time_entry(int rank, int world, void *result, void *arg) {
    const time_job *j = arg;
    *(step_time *)result = time_rank(j->way, rank, world, j->tm);
    return 0;
}

/* Pinning only where every rank has a core of its own. */
static int can_pin(int world) { return world > 1 && sysconf(_SC_NPROCESSORS_ONLN) >= world; }

/* Rank 0's times, with cpu_ms the sum over the ranks; ms < 0 when a rank failed. */
static step_time run_time(int way, int world, const timing *tm) {
    step_time r[MAX_WORLDS * 2], out = {.ms = -1};
    time_job j = {way, tm};
    if (bench_ranks(world, can_pin(world), time_entry, &j, r, sizeof *r)) return out;
    out = r[0];
    for (int k = 1; k < world; k++) out.cpu_ms += r[k].cpu_ms;
    return out;
}

/* PyTorch's ms per step for `way` ("ddp" or "zero1"), or -1. */
static double run_torch(const char *way, int world, const timing *tm) {
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 /usr/bin/python3 bench/zero_torch.py "
             "--way %s --world %d --iters %d --windows %d --warmup %d 2>/dev/null",
             way, world, tm->iters, tm->windows, tm->warmup);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    char line[4096];
    double ms = -1;
    while (fgets(line, sizeof line, p)) {
        const char *k = strstr(line, "\"ms_per_step\":");
        if (k) ms = atof(k + strlen("\"ms_per_step\":"));
    }
    return pclose(p) == 0 ? ms : -1;
}

/* The median of the repeats that ran, or -1. */
static double median_ran(const double *v, int n) {
    double ok[MAX_REPEAT];
    int m = 0;
    for (int i = 0; i < n; i++)
        if (v[i] >= 0) ok[m++] = v[i];
    return m ? bench_median(ok, m) : -1;
}

static void print_ms(double v, int width) {
    if (v > 0)
        printf(" %*.1f", width, v);
    else
        printf(" %*s", width, "-");
}

static void time_table(const int *ws, int nw, const timing *tm, int repeat, int torch, int phases,
                       int json) {
    char load[64];
    printf("\nms per step, MLP (1.86 M parameters), global batch %d, AdamW, one thread per rank, "
           "median of %d windows of %d steps; the median of %d interleaved repeats (load "
           "average %s)\n",
           GLOBAL_BATCH, tm->windows, tm->iters, repeat, bench_load_average(load, sizeof load));
    printf("wall ms per step (samples/s against DDP's), then CPU ms per step of all ranks\n");
    printf("%-6s %9s %15s %15s %15s %9s %11s %13s\n", "world", "ddp", "zero 1", "zero 2", "zero 3",
           "no comm", "torch ddp", "torch zero 1");
    for (int i = 0; i < nw; i++) {
        double ours[N_WAYS][MAX_REPEAT], cpu[N_WAYS][MAX_REPEAT], theirs[2][MAX_REPEAT];
        double ph[N_WAYS][N_PHASES][MAX_REPEAT];
        for (int r = 0; r < repeat; r++) {
            /* each repeat starts with another way, so no way always follows the same one */
            for (int k = 0; k < N_WAYS; k++) {
                int s = (k + r) % N_WAYS;
                step_time st = {.ms = -1};
                if (tm->ways >> s & 1) st = run_time(s, ws[i], tm);
                ours[s][r] = st.ms;
                cpu[s][r] = st.ms < 0 ? -1 : st.cpu_ms;
                for (int p = 0; p < N_PHASES; p++) ph[s][p][r] = st.ms < 0 ? -1 : st.phase[p];
            }
            theirs[0][r] = torch ? run_torch("ddp", ws[i], tm) : -1;
            theirs[1][r] = torch ? run_torch("zero1", ws[i], tm) : -1;
        }
        double o[N_WAYS], c[N_WAYS], t[2];
        for (int s = 0; s < N_WAYS; s++) o[s] = median_ran(ours[s], repeat);
        for (int s = 0; s < N_WAYS; s++) c[s] = median_ran(cpu[s], repeat);
        for (int k = 0; k < 2; k++) t[k] = median_ran(theirs[k], repeat);
        printf("%-6d %9.1f", ws[i], o[0]);
        for (int s = 1; s <= 3; s++) printf(" %7.1f (%.2fx)", o[s], o[s] > 0 ? o[0] / o[s] : 0);
        print_ms(o[SOLO], 9);
        print_ms(t[0], 11);
        print_ms(t[1], 13);
        printf("\n%-6s %9.1f", "  cpu", c[0]);
        for (int s = 1; s <= 3; s++) printf(" %7.1f (%.2fx)", c[s], c[s] > 0 ? c[0] / c[s] : 0);
        print_ms(c[SOLO], 9);
        printf("\n");
        if (json)
            printf("{\"table\": \"time\", \"world\": %d, \"ddp\": %.2f, \"zero1\": %.2f, "
                   "\"zero2\": %.2f, \"zero3\": %.2f, \"no_comm\": %.2f, \"cpu_ddp\": %.2f, "
                   "\"cpu_zero1\": %.2f, \"cpu_zero2\": %.2f, \"cpu_zero3\": %.2f, "
                   "\"cpu_no_comm\": %.2f, \"torch_ddp\": %.2f, \"torch_zero1\": %.2f}\n",
                   ws[i], o[0], o[1], o[2], o[3], o[SOLO], c[0], c[1], c[2], c[3], c[SOLO], t[0],
                   t[1]);
        if (phases) {
            printf("  rank 0's ms per step by phase (medians):\n  %-8s", "way");
            for (int p = 0; p < N_PHASES; p++) printf(" %9s", PHASE_NAMES[p]);
            printf("\n");
            for (int s = 0; s < N_WAYS; s++) {
                printf("  %-8s", WAY_NAMES[s]);
                for (int p = 0; p < N_PHASES; p++) print_ms(median_ran(ph[s][p], repeat), 9);
                printf("\n");
            }
        }
        fflush(stdout);
    }
    printf("(load average after: %s)\n", bench_load_average(load, sizeof load));
}

/* ---- memory ---------------------------------------------------------------------------- */

enum { MEM_LAYERS = 4, MEM_BATCH = 8, CAP_WIDTH = 1024, CAP_MAX_LAYERS = 4096 };

/* VmRSS or VmHWM of this process, in bytes. */
static size_t status_bytes(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    size_t kb = 0, len = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, len) && line[len] == ':') kb = (size_t)atol(line + len + 1);
    if (f) fclose(f);
    return kb << 10;
}

/* Resets VmHWM to the current resident size (Linux's clear_refs 5). */
static void reset_peak(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f) fputs("5", f), fclose(f);
}

typedef struct {
    int way, width, layers;
} mem_cfg;

typedef struct {
    td_zero_memory zm;
    size_t rss_after, rss_peak; /* less the process's size before the model */
    size_t pss_peak;            /* the largest proportional size seen in the steps, less before */
} mem_result;

/* The proportional size now, kept in *peak when larger. */
static void sample(size_t *peak) {
    size_t now = bench_pss_bytes();
    if (now > *peak) *peak = now;
}

/* sum of a[i] * b[i] over n (a multiple of 16), in 16 lanes so that it vectorises. */
static float dot(const float *a, const float *b, int n) {
    float lane[16] = {0};
    for (int i = 0; i < n; i += 16)
        for (int k = 0; k < 16; k++) lane[k] += a[i + k] * b[i + k];
    float sum = 0;
    for (int k = 0; k < 16; k++) sum += lane[k];
    return sum;
}

/* x (B, W) -> y (B, W) = tanh(x W^T) for each of L layers, hand-written, calling the hooks as a
 * graph would; the loss is half the sum of squares of the last layer's output. The proportional
 * size is sampled around every layer's use, where gathered copies and whole gradients peak. */
static void mem_step(td_param *p, int L, int W, float *acts, float *d, float *dn, td_zero *z,
                     td_ddp *ddp, size_t *peak) {
    for (int l = 0; l < L; l++) {
        if (z) CHECK(td_zero_param_use(z, (size_t)l, TD_PARAM_BEFORE_FORWARD));
        sample(peak);
        const float *w = p[l].data, *x = acts + (size_t)l * MEM_BATCH * W;
        float *y = acts + (size_t)(l + 1) * MEM_BATCH * W;
        for (int b = 0; b < MEM_BATCH; b++)
            for (int o = 0; o < W; o++) y[b * W + o] = tanhf(dot(w + (size_t)o * W, x + b * W, W));
        if (z) CHECK(td_zero_param_use(z, (size_t)l, TD_PARAM_AFTER_FORWARD));
    }
    const float *out = acts + (size_t)L * MEM_BATCH * W;
    for (int k = 0; k < MEM_BATCH * W; k++) d[k] = out[k] * (1 - out[k] * out[k]) / MEM_BATCH;
    for (int l = L - 1; l >= 0; l--) {
        if (z) CHECK(td_zero_param_use(z, (size_t)l, TD_PARAM_BEFORE_BACKWARD));
        const float *w = p[l].data, *x = acts + (size_t)l * MEM_BATCH * W;
        float *g = p[l].grad;
        for (int o = 0; o < W; o++)
            for (int b = 0; b < MEM_BATCH; b++) {
                float dy = d[b * W + o];
                for (int i = 0; i < W; i++) g[(size_t)o * W + i] += dy * x[b * W + i];
            }
        memset(dn, 0, (size_t)MEM_BATCH * W * sizeof *dn);
        for (int b = 0; b < MEM_BATCH && l > 0; b++) {
            for (int o = 0; o < W; o++) {
                float dy = d[b * W + o];
                for (int i = 0; i < W; i++) dn[b * W + i] += dy * w[(size_t)o * W + i];
            }
            for (int i = 0; i < W; i++) dn[b * W + i] *= 1 - x[b * W + i] * x[b * W + i];
        }
        sample(peak);
        if (z) CHECK(td_zero_grad_ready(z, (size_t)l));
        if (z) CHECK(td_zero_param_use(z, (size_t)l, TD_PARAM_AFTER_BACKWARD));
        if (ddp) CHECK(td_ddp_grad_ready(ddp, (size_t)l));
        memcpy(d, dn, (size_t)MEM_BATCH * W * sizeof *d);
    }
}

static int mem_entry(int rank, int world, void *result, void *arg) {
    const mem_cfg *cfg = arg;
    int L = cfg->layers, W = cfg->width;
    (void)rank, (void)world;
    td_comm *comm = bench_comm();
    size_t base = status_bytes("VmRSS"), base_pss = bench_pss_bytes();
    char(*names)[32] = calloc((size_t)L, sizeof *names);
    td_param *p = calloc((size_t)L, sizeof *p);
    size_t count = (size_t)W * W;
    float *init = malloc((size_t)L * count * sizeof *init);
    if (!names || !p || !init) return 1;
    for (int l = 0; l < L; l++) {
        snprintf(names[l], sizeof names[l], "layer%d.weight", l);
        p[l] = (td_param){.name = names[l],
                          .data = init + l * count,
                          .count = count,
                          .dtype = TD_F32,
                          .ndim = 2,
                          .shape = {W, W}};
        /* A cheap spread of values in (-1/W, 1/W): only their memory is measured. */
        for (size_t e = 0; e < count; e++)
            init[l * count + e] =
                ((float)((e * 2654435761u + (size_t)l) >> 8 & 0xffff) / 32768.0f - 1.0f) / (float)W;
    }
    /* No gradient memory of the trainer's (grad NULL): DDP and ZeRO bring their own. */
    td_ddp *ddp = NULL;
    td_zero *z = NULL;
    td_param *stepped = p;
    size_t n_stepped = (size_t)L;
    if (cfg->way == 0) {
        CHECK(td_ddp_create(&ddp, comm, p, (size_t)L, NULL, 0, NULL));
    } else {
        td_zero_params zp = td_zero_default_params();
        zp.stage = cfg->way;
        CHECK(td_zero_create(&z, comm, p, (size_t)L, NULL, 0, &zp));
        free(init); /* ZeRO moved the parameters */
        init = NULL;
        CHECK(td_zero_parameters(z, &stepped, &n_stepped));
    }
    td_adamw_params ap = td_adamw_default_params();
    td_optim *opt;
    CHECK(td_optim_create_adamw(&opt, stepped, n_stepped, &ap));
    float *acts = calloc((size_t)(L + 1) * MEM_BATCH * W, sizeof *acts);
    float *d = calloc((size_t)MEM_BATCH * W, sizeof *d),
          *dn = calloc((size_t)MEM_BATCH * W, sizeof *dn);
    for (int k = 0; k < MEM_BATCH * W; k++) acts[k] = sinf((float)k);
    reset_peak();
    size_t peak = 0;
    for (int step = 0; step < 2; step++) {
        CHECK(z ? td_zero_prepare_forward(z) : td_ddp_prepare_forward(ddp));
        sample(&peak);
        mem_step(p, L, W, acts, d, dn, z, ddp, &peak);
        CHECK(z ? td_zero_finish_backward(z) : td_ddp_finish_backward(ddp));
        sample(&peak);
        CHECK(td_optim_step(opt));
        sample(&peak);
        if (z)
            td_zero_zero_grad(z);
        else
            td_ddp_zero_grad(ddp);
    }
    mem_result *out = result;
    out->zm = td_zero_memory_stats(z, opt);
    out->rss_after = status_bytes("VmRSS") - base;
    out->rss_peak = status_bytes("VmHWM") - base;
    out->pss_peak = peak - base_pss;
    td_optim_destroy(opt);
    td_ddp_destroy(ddp);
    td_zero_destroy(z);
    free(init);
    free(acts);
    free(d);
    free(dn);
    free(p);
    free(names);
    td_comm_destroy(comm);
    return 0;
}

static void memory_table(int width, int json) {
    int worlds[3] = {1, 2, 4};
    size_t whole = (size_t)MEM_LAYERS * width * width * sizeof(float);
    printf("\nmemory of rank 0, MiB: a hand-written MLP of %d layers of %d x %d (%.1f MiB of f32 "
           "parameters), AdamW, 2 steps at batch %d per rank.\ncounted by td_zero_memory_stats "
           "(params, grads, optim, gathered, reducing, cached: now / peak), the process's "
           "resident memory (after the steps / its peak over them) and its proportional share of "
           "what it maps at the peak, less their size before the model\n",
           MEM_LAYERS, width, width, whole / 1048576.0, MEM_BATCH);
    printf("%-7s %-6s %7s %7s %7s %13s %13s %13s %15s %7s\n", "way", "world", "params", "grads",
           "optim", "gathered", "reducing", "cached", "resident", "pss");
    for (int s = 0; s < SOLO; s++)
        for (int i = 0; i < 3; i++) {
            mem_result r[4];
            mem_cfg cfg = {s, width, MEM_LAYERS};
            if (bench_ranks(worlds[i], 0, mem_entry, &cfg, r, sizeof *r)) continue;
            const td_zero_memory *m = &r[0].zm;
            double mb = 1048576.0;
            if (s == 0) /* DDP: whole parameters and gradients, AdamW's two moments */
                printf("%-7s %-6d %7.1f %7.1f %7.1f %13s %13s %13s %6.1f / %6.1f %7.1f\n",
                       WAY_NAMES[s], worlds[i], whole / mb, whole / mb, 2 * whole / mb, "-", "-",
                       "-", r[0].rss_after / mb, r[0].rss_peak / mb, r[0].pss_peak / mb);
            else
                printf("%-7s %-6d %7.1f %7.1f %7.1f %5.1f / %5.1f %5.1f / %5.1f %5.1f / %5.1f "
                       "%6.1f / %6.1f %7.1f\n",
                       WAY_NAMES[s], worlds[i], m->now.params / mb, m->now.grads / mb,
                       m->now.optim / mb, m->now.gathered / mb, m->peak.gathered / mb,
                       m->now.reducing / mb, m->peak.reducing / mb, m->now.cached / mb,
                       m->peak.cached / mb, r[0].rss_after / mb, r[0].rss_peak / mb,
                       r[0].pss_peak / mb);
            if (json)
                printf("{\"table\": \"memory\", \"way\": \"%s\", \"world\": %d, \"params\": %zu, "
                       "\"grads\": %zu, \"optim\": %zu, \"gathered_peak\": %zu, "
                       "\"reducing_peak\": %zu, \"cached_peak\": %zu, \"rss_after\": %zu, "
                       "\"rss_peak\": %zu, \"pss_peak\": %zu}\n",
                       WAY_NAMES[s], worlds[i], s ? m->now.params : whole, s ? m->now.grads : whole,
                       s ? m->now.optim : 2 * whole, m->peak.gathered, m->peak.reducing,
                       m->peak.cached, r[0].rss_after, r[0].rss_peak, r[0].pss_peak);
            fflush(stdout);
        }
}

/* ---- the largest model under a memory cap ----------------------------------------------- */

/* The largest proportional size any rank reached training `layers` layers, or 0 on failure. */
static size_t cap_probe(int way, int world, int layers) {
    mem_result r[MAX_WORLDS * 2];
    mem_cfg cfg = {way, CAP_WIDTH, layers};
    if (bench_ranks(world, 0, mem_entry, &cfg, r, sizeof *r)) return 0;
    size_t most = 0;
    for (int k = 0; k < world; k++) most = r[k].pss_peak > most ? r[k].pss_peak : most;
    return most;
}

/* For DDP and each stage at `world`: the most layers of CAP_WIDTH x CAP_WIDTH whose training
 * steps stay within `cap_mib` per rank, by doubling and then bisection (memory grows with the
 * layers). */
static void cap_table(int cap_mib, int world, int json) {
    size_t cap = (size_t)cap_mib << 20, layer = (size_t)CAP_WIDTH * CAP_WIDTH;
    char load[64];
    printf("\nthe largest model whose training steps stay within %d MiB per rank at world %d: "
           "layers of %d x %d (%.1f M parameters each) of the hand-written MLP, AdamW, 2 steps "
           "at batch %d per rank; a rank's memory is the peak of its proportional share of what it "
           "maps (Pss), less its size before the model (load average %s)\n",
           cap_mib, world, CAP_WIDTH, CAP_WIDTH, layer / 1e6, MEM_BATCH,
           bench_load_average(load, sizeof load));
    printf("%-7s %7s %12s %14s\n", "way", "layers", "parameters", "peak MiB");
    double params[N_WAYS] = {0};
    for (int s = 0; s < SOLO; s++) {
        int fit = 0, over = 0;
        size_t fit_peak = 0;
        for (int l = 1; l <= CAP_MAX_LAYERS && !over; l *= 2) {
            size_t peak = cap_probe(s, world, l);
            if (peak && peak <= cap)
                fit = l, fit_peak = peak;
            else
                over = l;
        }
        while (over && over - fit > 1) {
            int mid = fit + (over - fit) / 2;
            size_t peak = cap_probe(s, world, mid);
            if (peak && peak <= cap)
                fit = mid, fit_peak = peak;
            else
                over = mid;
        }
        params[s] = (double)fit * (double)layer;
        printf("%-7s %7d %10.1f M %14.1f\n", WAY_NAMES[s], fit, params[s] / 1e6,
               fit_peak / 1048576.0);
        if (json)
            printf("{\"table\": \"cap\", \"way\": \"%s\", \"world\": %d, \"cap_mib\": %d, "
                   "\"layers\": %d, \"parameters\": %.0f, \"peak\": %zu}\n",
                   WAY_NAMES[s], world, cap_mib, fit, params[s], fit_peak);
        fflush(stdout);
    }
    printf("zero 3 / ddp: %.2fx the parameters\n", params[0] > 0 ? params[3] / params[0] : 0);
}

/* "ddp,1,2,3,none" as a mask of ways, or 0 when a name is unknown. */
static unsigned parse_ways(const char *list) {
    static const char *const names[N_WAYS] = {"ddp", "1", "2", "3", "none"};
    char buf[64];
    unsigned mask = 0;
    snprintf(buf, sizeof buf, "%s", list);
    for (char *save = NULL, *w = strtok_r(buf, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
        int found = -1;
        for (int k = 0; k < N_WAYS; k++)
            if (!strcmp(w, names[k])) found = k;
        if (found < 0) return 0;
        mask |= 1u << found;
    }
    return mask;
}

static int way_ok(const char *name) { return parse_ways(name) != 0; }

int main(int argc, char **argv) {
    timing tm = {10, 3, 3, 2048, (1u << N_WAYS) - 1};
    int no_torch = 0, json = 0, repeat = 1, no_memory = 0, no_time = 0, phases = 0, cap_mib = 0;
    int cap_world = 4, ws[MAX_WORLDS] = {2, 4}, nw = 2;
    const char *ways = NULL;
    td_args a;
    td_args_init(&a, "zero", argc, argv);
    while (td_args_next(&a)) {
        td_args_int_list(&a, "--worlds", 1, 8, ws, MAX_WORLDS, &nw);
        td_args_int(&a, "--iters", 1, INT_MAX, &tm.iters);
        td_args_int(&a, "--windows", 1, MAX_WINDOWS, &tm.windows);
        td_args_int(&a, "--repeat", 1, MAX_REPEAT, &repeat);
        td_args_int(&a, "--width", 16, INT_MAX, &tm.width);
        td_args_flag(&a, "--no-torch", &no_torch);
        td_args_flag(&a, "--no-memory", &no_memory);
        td_args_flag(&a, "--no-time", &no_time);
        td_args_flag(&a, "--json", &json);
        td_args_flag(&a, "--phases", &phases);
        td_args_int(&a, "--cap", 0, INT_MAX, &cap_mib);
        td_args_int(&a, "--cap-world", 1, 2 * MAX_WORLDS, &cap_world);
        bench_list_option(&a, "--ways", &ways, way_ok, "comma-separated ways: ddp, 1, 2, 3, none");
    }
    for (int i = 0; i < nw; i++)
        if (GLOBAL_BATCH % ws[i])
            td_args_error(&a, "--worlds: %d does not divide %d", ws[i], GLOBAL_BATCH);
    if (tm.width % 16) td_args_error(&a, "--width %d is not a multiple of 16", tm.width);
    bench_args_finish(&a, "usage: zero [--worlds 2,4] [--iters N] [--windows N] [--repeat K] "
                          "[--ways ddp,1,2,3,none] [--phases] [--width W] [--cap MiB] "
                          "[--cap-world N] [--no-torch] [--no-memory] [--no-time] [--json]\n");
    if (ways) tm.ways = parse_ways(ways);
    int torch = !no_torch, memory = !no_memory, timed = !no_time;
    bench_one_thread(argv);
    char cpu[256];
    printf("%s\n", bench_cpu_name(cpu, sizeof cpu));
    if (timed) time_table(ws, nw, &tm, repeat, torch, phases, json);
    if (memory) memory_table(tm.width, json);
    if (cap_mib > 0) cap_table(cap_mib, cap_world, json);
    return 0;
}
