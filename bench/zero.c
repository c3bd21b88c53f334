/* ZeRO (td_zero) beside DDP, and beside PyTorch's DDP with ZeroRedundancyOptimizer, in one run.
 *
 * Step time: the MLP (784 -> 1024 -> 1024 -> 10, 1.86 M parameters) at global batch 128 with
 * AdamW, one thread per rank, at world sizes 2 and 4: milliseconds per step (forward, backward,
 * the gradients' reduction, the optimizer step and, for ZeRO, the parameters' gathers) under
 * DDP and ZeRO stages 1, 2 and 3, median of timed windows after warm-up; --repeat K interleaves
 * K repeats (each starting with another way) and prints the fastest (on a machine other jobs
 * share, a busy spell only adds time). The PyTorch peer
 * (bench/zero_torch.py, Debian's python3-torch 1.13 over gloo) runs DDP and DDP with
 * torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO stage 1); its FullyShardedDataParallel does
 * not import under that build (docs/zero.md).
 *
 * Memory: a hand-written MLP of --width (2048: four layers of 2048 x 2048, 16.8 M parameters, 64
 * MiB) trained two AdamW steps at world sizes 1, 2 and 4 under DDP and each stage: the bytes
 * td_zero_memory_stats counts per kind, now and at the peak, and the process's own resident
 * memory (VmRSS after the steps, VmHWM reset after creation: what training held at most), less
 * what it held before the model existed. The trainer hands its parameters to DDP or ZeRO and
 * frees its own copy (ZeRO moved them), so the process holds what the strategy holds plus a few
 * activations.
 *
 *   build/bench/zero [--worlds 2,4] [--iters 10] [--windows 3] [--repeat K] [--width 2048]
 *                    [--no-torch] [--no-memory] [--no-time] [--json] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/tandem.h"

#include "bench.h"

#define GLOBAL_BATCH 128
#define MAX_WORLDS 4
#define MAX_REPEAT 9
#define N_WAYS 4 /* DDP, stages 1, 2, 3 */

static const char *WAY_NAMES[N_WAYS] = {"ddp", "zero 1", "zero 2", "zero 3"};

typedef struct {
    int iters, windows, warmup, width;
} timing;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ---- step time -------------------------------------------------------------------------- */

/* One rank: ms per step (median of the windows), under DDP (stage 0) or a ZeRO stage. */
static double time_rank(int stage, int rank, int world, const timing *tm) {
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
    if (stage == 0) {
        CHECK(td_ddp_create(&ddp, comm, params, n_params, NULL, 0, NULL));
        td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, ddp);
    } else {
        td_zero_params zp = td_zero_default_params();
        zp.stage = stage;
        CHECK(td_zero_create(&zero, comm, params, n_params, NULL, 0, &zp));
        CHECK(td_zero_parameters(zero, &stepped, &n_stepped));
        td_graph_set_grad_ready_hook(g, td_zero_grad_ready_hook, zero);
        td_graph_set_param_use_hook(g, td_zero_param_use_hook, zero);
    }
    td_adamw_params ap = td_adamw_default_params();
    td_optim *opt;
    CHECK(td_optim_create_adamw(&opt, stepped, n_stepped, &ap));
    double *ms = malloc((size_t)tm->windows * sizeof *ms);
    for (int w = -1; w < tm->windows; w++) { /* window -1 is the warm-up */
        int iters = w < 0 ? tm->warmup : tm->iters;
        CHECK(td_comm_barrier(comm));
        uint64_t t0 = td_time_ns();
        for (int i = 0; i < iters; i++) {
            CHECK(zero ? td_zero_prepare_forward(zero) : td_ddp_prepare_forward(ddp));
            CHECK(td_graph_forward(g));
            CHECK(td_graph_backward(g, m.loss));
            CHECK(zero ? td_zero_finish_backward(zero) : td_ddp_finish_backward(ddp));
            CHECK(td_optim_step(opt));
            CHECK(td_graph_zero_grad(g));
        }
        if (w >= 0) ms[w] = (double)(td_time_ns() - t0) * 1e-6 / iters;
    }
    qsort(ms, (size_t)tm->windows, sizeof *ms, cmp_double);
    double median = ms[tm->windows / 2];
    free(ms);
    td_graph_set_grad_ready_hook(g, NULL, NULL);
    td_graph_set_param_use_hook(g, NULL, NULL);
    td_optim_destroy(opt);
    td_ddp_destroy(ddp);
    td_zero_destroy(zero);
    td_graph_destroy(g);
    td_comm_destroy(comm);
    return median;
}

typedef struct {
    int stage;
    const timing *tm;
} time_job;

static int time_entry(int rank, int world, void *result, void *arg) {
    const time_job *j = arg;
    *(double *)result = time_rank(j->stage, rank, world, j->tm);
    return 0;
}

/* Pinning only where every rank has a core of its own. */
static int can_pin(int world) { return world > 1 && sysconf(_SC_NPROCESSORS_ONLN) >= world; }

static double run_time(int stage, int world, const timing *tm) {
    double ms[8];
    time_job j = {stage, tm};
    return bench_ranks(world, can_pin(world), time_entry, &j, ms, sizeof *ms) ? -1 : ms[0];
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

/* The fastest of the repeats that ran (a busy machine only adds time), or -1. */
static double fastest_of(const double *v, int n) {
    double best = -1;
    for (int i = 0; i < n; i++)
        if (v[i] >= 0 && (best < 0 || v[i] < best)) best = v[i];
    return best;
}

static void time_table(const int *ws, int nw, const timing *tm, int repeat, int torch, int json) {
    printf("\nms per step, MLP (1.86 M parameters), global batch %d, AdamW, one thread per rank, "
           "median of %d windows of %d steps",
           GLOBAL_BATCH, tm->windows, tm->iters);
    if (repeat > 1) printf("; the fastest of %d interleaved repeats", repeat);
    printf("\n%-6s %9s %9s %9s %9s %11s %13s\n", "world", "ddp", "zero 1", "zero 2", "zero 3",
           "torch ddp", "torch zero 1");
    for (int i = 0; i < nw; i++) {
        double ours[N_WAYS][MAX_REPEAT], theirs[2][MAX_REPEAT];
        for (int r = 0; r < repeat; r++) {
            /* each repeat starts with another way, so no way always follows the same one */
            for (int k = 0; k < N_WAYS; k++) {
                int s = (k + r) % N_WAYS;
                ours[s][r] = run_time(s, ws[i], tm);
            }
            theirs[0][r] = torch ? run_torch("ddp", ws[i], tm) : -1;
            theirs[1][r] = torch ? run_torch("zero1", ws[i], tm) : -1;
        }
        double o[N_WAYS], t[2];
        for (int s = 0; s < N_WAYS; s++) o[s] = fastest_of(ours[s], repeat);
        for (int k = 0; k < 2; k++) t[k] = fastest_of(theirs[k], repeat);
        char tt[2][16];
        for (int k = 0; k < 2; k++) {
            if (t[k] > 0)
                snprintf(tt[k], sizeof tt[k], "%.1f", t[k]);
            else
                snprintf(tt[k], sizeof tt[k], "-");
        }
        printf("%-6d %9.1f %9.1f %9.1f %9.1f %11s %13s\n", ws[i], o[0], o[1], o[2], o[3], tt[0],
               tt[1]);
        if (json)
            printf("{\"table\": \"time\", \"world\": %d, \"ddp\": %.2f, \"zero1\": %.2f, "
                   "\"zero2\": %.2f, \"zero3\": %.2f, \"torch_ddp\": %.2f, \"torch_zero1\": "
                   "%.2f}\n",
                   ws[i], o[0], o[1], o[2], o[3], t[0], t[1]);
        fflush(stdout);
    }
}

/* ---- memory ---------------------------------------------------------------------------- */

enum { MEM_LAYERS = 4, MEM_BATCH = 8 };

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
    td_zero_memory zm;
    size_t rss_after, rss_peak; /* less the process's size before the model */
    size_t param_bytes;
} mem_result;

/* x (B, W) -> y (B, W) = tanh(x W^T) for each layer, hand-written, calling the hooks as a graph
 * would; the loss is half the sum of squares of the last layer's output. */
static void mem_step(td_param *p, int W, float *acts, float *d, float *dn, td_zero *z,
                     td_ddp *ddp) {
    for (int l = 0; l < MEM_LAYERS; l++) {
        if (z) CHECK(td_zero_param_use(z, (size_t)l, TD_PARAM_BEFORE_FORWARD));
        const float *w = p[l].data, *x = acts + (size_t)l * MEM_BATCH * W;
        float *y = acts + (size_t)(l + 1) * MEM_BATCH * W;
        for (int b = 0; b < MEM_BATCH; b++)
            for (int o = 0; o < W; o++) {
                float acc = 0;
                for (int i = 0; i < W; i++) acc += w[(size_t)o * W + i] * x[b * W + i];
                y[b * W + o] = tanhf(acc);
            }
        if (z) CHECK(td_zero_param_use(z, (size_t)l, TD_PARAM_AFTER_FORWARD));
    }
    const float *out = acts + (size_t)MEM_LAYERS * MEM_BATCH * W;
    for (int k = 0; k < MEM_BATCH * W; k++) d[k] = out[k] * (1 - out[k] * out[k]) / MEM_BATCH;
    for (int l = MEM_LAYERS - 1; l >= 0; l--) {
        if (z) CHECK(td_zero_param_use(z, (size_t)l, TD_PARAM_BEFORE_BACKWARD));
        const float *w = p[l].data, *x = acts + (size_t)l * MEM_BATCH * W;
        float *g = p[l].grad;
        for (int o = 0; o < W; o++)
            for (int b = 0; b < MEM_BATCH; b++) {
                float dy = d[b * W + o];
                for (int i = 0; i < W; i++) g[(size_t)o * W + i] += dy * x[b * W + i];
            }
        for (int b = 0; b < MEM_BATCH && l > 0; b++)
            for (int i = 0; i < W; i++) {
                float acc = 0;
                for (int o = 0; o < W; o++) acc += d[b * W + o] * w[(size_t)o * W + i];
                dn[b * W + i] = acc * (1 - x[b * W + i] * x[b * W + i]);
            }
        if (z) CHECK(td_zero_grad_ready(z, (size_t)l));
        if (z) CHECK(td_zero_param_use(z, (size_t)l, TD_PARAM_AFTER_BACKWARD));
        if (ddp) CHECK(td_ddp_grad_ready(ddp, (size_t)l));
        memcpy(d, dn, (size_t)MEM_BATCH * W * sizeof *d);
    }
}

static int mem_entry(int rank, int world, void *result, void *arg) {
    const int *cfg = arg; /* stage, width */
    int stage = cfg[0], W = cfg[1];
    (void)rank, (void)world;
    td_comm *comm = bench_comm();
    size_t base = status_bytes("VmRSS");
    static char names[MEM_LAYERS][32];
    td_param p[MEM_LAYERS];
    size_t count = (size_t)W * W;
    float *init = malloc(MEM_LAYERS * count * sizeof *init);
    td_rng rng;
    td_rng_init(&rng, 7);
    for (int l = 0; l < MEM_LAYERS; l++) {
        snprintf(names[l], sizeof names[l], "layer%d.weight", l);
        p[l] = (td_param){.name = names[l],
                          .data = init + l * count,
                          .count = count,
                          .dtype = TD_F32,
                          .ndim = 2,
                          .shape = {W, W}};
        td_rng_fill_uniform(&rng, p[l].data, count, -1.0f / W, 1.0f / W);
    }
    /* No gradient memory of the trainer's (grad NULL): DDP and ZeRO bring their own. */
    td_ddp *ddp = NULL;
    td_zero *z = NULL;
    td_param *stepped = p;
    size_t n_stepped = MEM_LAYERS;
    if (stage == 0) {
        CHECK(td_ddp_create(&ddp, comm, p, MEM_LAYERS, NULL, 0, NULL));
    } else {
        td_zero_params zp = td_zero_default_params();
        zp.stage = stage;
        CHECK(td_zero_create(&z, comm, p, MEM_LAYERS, NULL, 0, &zp));
        free(init); /* ZeRO moved the parameters */
        init = NULL;
        CHECK(td_zero_parameters(z, &stepped, &n_stepped));
    }
    td_adamw_params ap = td_adamw_default_params();
    td_optim *opt;
    CHECK(td_optim_create_adamw(&opt, stepped, n_stepped, &ap));
    float *acts = calloc((size_t)(MEM_LAYERS + 1) * MEM_BATCH * W, sizeof *acts);
    float *d = calloc((size_t)MEM_BATCH * W, sizeof *d),
          *dn = calloc((size_t)MEM_BATCH * W, sizeof *dn);
    for (int k = 0; k < MEM_BATCH * W; k++) acts[k] = sinf((float)k);
    reset_peak();
    for (int step = 0; step < 2; step++) {
        CHECK(z ? td_zero_prepare_forward(z) : td_ddp_prepare_forward(ddp));
        mem_step(p, W, acts, d, dn, z, ddp);
        CHECK(z ? td_zero_finish_backward(z) : td_ddp_finish_backward(ddp));
        CHECK(td_optim_step(opt));
        if (z)
            td_zero_zero_grad(z);
        else
            td_ddp_zero_grad(ddp);
    }
    mem_result *out = result;
    out->zm = td_zero_memory_stats(z, opt);
    out->rss_after = status_bytes("VmRSS") - base;
    out->rss_peak = status_bytes("VmHWM") - base;
    out->param_bytes = MEM_LAYERS * count * sizeof(float);
    td_optim_destroy(opt);
    td_ddp_destroy(ddp);
    td_zero_destroy(z);
    free(init);
    free(acts);
    free(d);
    free(dn);
    td_comm_destroy(comm);
    return 0;
}

static void memory_table(int width, int json) {
    int worlds[3] = {1, 2, 4};
    size_t whole = (size_t)MEM_LAYERS * width * width * sizeof(float);
    printf("\nmemory of rank 0, MiB: a hand-written MLP of %d layers of %d x %d (%.1f MiB of f32 "
           "parameters), AdamW, 2 steps at batch %d per rank.\ncounted by td_zero_memory_stats "
           "(params, grads, optim, gathered, reducing: now / peak) and the process's resident "
           "memory (after the steps / its peak over them), less its size before the model\n",
           MEM_LAYERS, width, width, whole / 1048576.0, MEM_BATCH);
    printf("%-7s %-6s %8s %8s %8s %15s %15s %17s\n", "way", "world", "params", "grads", "optim",
           "gathered", "reducing", "resident");
    for (int s = 0; s < N_WAYS; s++)
        for (int i = 0; i < 3; i++) {
            mem_result r[4];
            int cfg[2] = {s, width};
            if (bench_ranks(worlds[i], 0, mem_entry, cfg, r, sizeof *r)) continue;
            const td_zero_memory *m = &r[0].zm;
            double mb = 1048576.0;
            if (s == 0) /* DDP: whole parameters and gradients, AdamW's two moments */
                printf("%-7s %-6d %8.1f %8.1f %8.1f %15s %15s %8.1f / %6.1f\n", WAY_NAMES[s],
                       worlds[i], whole / mb, whole / mb, 2 * whole / mb, "-", "-",
                       r[0].rss_after / mb, r[0].rss_peak / mb);
            else
                printf("%-7s %-6d %8.1f %8.1f %8.1f %6.1f / %6.1f %6.1f / %6.1f %8.1f / %6.1f\n",
                       WAY_NAMES[s], worlds[i], m->now.params / mb, m->now.grads / mb,
                       m->now.optim / mb, m->now.gathered / mb, m->peak.gathered / mb,
                       m->now.reducing / mb, m->peak.reducing / mb, r[0].rss_after / mb,
                       r[0].rss_peak / mb);
            if (json)
                printf("{\"table\": \"memory\", \"way\": \"%s\", \"world\": %d, \"params\": %zu, "
                       "\"grads\": %zu, \"optim\": %zu, \"gathered_peak\": %zu, "
                       "\"reducing_peak\": %zu, \"rss_after\": %zu, \"rss_peak\": %zu}\n",
                       WAY_NAMES[s], worlds[i], s ? m->now.params : whole, s ? m->now.grads : whole,
                       s ? m->now.optim : 2 * whole, m->peak.gathered, m->peak.reducing,
                       r[0].rss_after, r[0].rss_peak);
            fflush(stdout);
        }
}

int main(int argc, char **argv) {
    const char *worlds = "2,4";
    timing tm = {10, 3, 3, 2048};
    int torch = 1, json = 0, repeat = 1, memory = 1, timed = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--worlds") && i + 1 < argc)
            worlds = argv[++i];
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            tm.iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--windows") && i + 1 < argc)
            tm.windows = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc)
            repeat = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--width") && i + 1 < argc)
            tm.width = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--no-torch"))
            torch = 0;
        else if (!strcmp(argv[i], "--no-memory"))
            memory = 0;
        else if (!strcmp(argv[i], "--no-time"))
            timed = 0;
        else if (!strcmp(argv[i], "--json"))
            json = 1;
        else {
            fprintf(stderr, "usage: zero [--worlds 2,4] [--iters N] [--windows N] [--repeat K] "
                            "[--width W] [--no-torch] [--no-memory] [--no-time] [--json]\n");
            return 2;
        }
    }
    int ws[MAX_WORLDS], nw = 0;
    char wlist[64];
    snprintf(wlist, sizeof wlist, "%s", worlds);
    for (char *save = NULL, *w = strtok_r(wlist, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
        int world = atoi(w);
        if (nw == MAX_WORLDS || world < 1 || world > 8 || GLOBAL_BATCH % world) {
            fprintf(stderr, "bench/zero: bad --worlds '%s'\n", worlds);
            return 2;
        }
        ws[nw++] = world;
    }
    if (tm.iters < 1 || tm.windows < 1 || repeat < 1 || repeat > MAX_REPEAT || tm.width < 16) {
        fprintf(stderr, "bench/zero: --iters, --windows >= 1, --repeat 1..%d, --width >= 16\n",
                MAX_REPEAT);
        return 2;
    }
    bench_one_thread(argv);
    char cpu[256];
    printf("%s\n", bench_cpu_name(cpu, sizeof cpu));
    if (timed) time_table(ws, nw, &tm, repeat, torch, json);
    if (memory) memory_table(tm.width, json);
    return 0;
}
