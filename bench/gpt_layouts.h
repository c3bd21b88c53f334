/* bench/gpt --tp: the GPT trained at world 4 under each layout of the device mesh (td_mesh):
 * DDP over 4, ZeRO stage 3 over 4, tensor parallel over 4, TP 2 x DP 2 and TP 2 x a 1F1B
 * pipeline of 2 stages (tensor-parallel rows with sequence parallelism), beside each rank
 * training alone on its quarter of the batch with no communication at all (the ceiling); one
 * thread per rank, each pinned to its own core, random tokens, AdamW.
 *
 * Step time: the median of --windows windows of --iters steps after --warmup, per layout; rows
 * interleaved --repeat times. Memory: a separate run of the same steps in which each rank
 * samples its proportional share of its memory (bench_pss_bytes: pages the ranks share count
 * once among them) after each forward, backward and optimizer step, and around every parameter
 * use under ZeRO (its gathered copies live only then); the peak over the steps less what the
 * rank held before the model, the largest over the ranks.
 *
 * --deterministic: each layout's step time in the default mode and in the deterministic one, side
 * by side, interleaved, and their ratio: the batch in LT_SHARDS fixed shards (each a forward and
 * backward of its own, a replica running the dp-th part of them) summed in DDP's (or ZeRO's,
 * or the pipeline's) shard tree, every tensor-parallel layer in LT_SHARDS fixed shards
 * (td_graph_params.tp_shards) at tp 1 too, one thread per graph: what examples/gpt
 * --deterministic runs at that layout, every layout ending on one digest (docs/parallelism.md).
 *
 * --cap MiB: the largest GPT of --cap-width (context 1024, global batch 4 sequences) each layout
 * trains within the cap per rank, by doubling and bisecting the number of layers (two steps
 * each); as bench/zero --cap measures it, not a cgroup's limit. Every layout runs without and
 * with activation recompute (td_graph_params.recompute full: each block keeps its input, sliced
 * under sequence parallelism, and runs its forward again in backward).
 *
 *   build/bench/gpt --tp [--layers N --heads N --width C --context T --batch GLOBAL]
 *                        [--iters N --windows N --warmup N --repeat K]
 *                        [--cap MiB [--cap-width C]] [--deterministic] [--no-time] [--json]
 * Included once by bench/gpt.c. */
#ifndef TANDEM_BENCH_GPT_LAYOUTS_H
#define TANDEM_BENCH_GPT_LAYOUTS_H

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/tandem.h"

#include "bench.h"

#define LAYOUT_WORLD 4
#define LAYOUT_WINDOWS 16
#define CAP_CONTEXT 1024
#define CAP_BATCH 4
#define CAP_MAX_LAYERS 1024
#define LT_SHARDS 4 /* deterministic mode's shards of the batch and of every tp layer */

typedef struct {
    const char *name;
    int dp, tp, pp, zero, alone; /* alone: no group, a quarter of the batch */
} lt_layout;

static const lt_layout LT_LAYOUTS[] = {
    {"no comm", 1, 1, 1, 0, 1}, {"ddp 4", 4, 1, 1, 0, 0},       {"zero-3 4", 4, 1, 1, 3, 0},
    {"tp 4", 1, 4, 1, 0, 0},    {"tp 2 x dp 2", 2, 2, 1, 0, 0}, {"tp 2 x pp 2", 1, 2, 2, 0, 0},
};
#define N_LAYOUTS (int)(sizeof LT_LAYOUTS / sizeof *LT_LAYOUTS)
/* --deterministic's rows: the digest table's layouts of 4 ranks (docs/parallelism.md). */
static const lt_layout LT_DET_LAYOUTS[] = {
    {"ddp 4", 4, 1, 1, 0, 0},       {"zero-1 4", 4, 1, 1, 1, 0},    {"zero-2 4", 4, 1, 1, 2, 0},
    {"zero-3 4", 4, 1, 1, 3, 0},    {"tp 4", 1, 4, 1, 0, 0},        {"tp 2 x dp 2", 2, 2, 1, 0, 0},
    {"tp 2 x pp 2", 1, 2, 2, 0, 0}, {"dp 2 x pp 2", 2, 1, 2, 0, 0},
};
#define N_DET_LAYOUTS (int)(sizeof LT_DET_LAYOUTS / sizeof *LT_DET_LAYOUTS)
/* A table row's recompute: the first N_LAYOUTS rows without, the next ones full. */
#define LT_MODE(row) ((row) < N_LAYOUTS ? TD_RECOMPUTE_NONE : TD_RECOMPUTE_FULL)

/* Offers the current argument to the options every GPT table of bench/gpt takes: the model,
 * the global batch and the timing windows (width and context as longs, set into the model by
 * the caller after the parse). */
static void gpt_bench_options(td_args *a, td_gpt_params *model, long *width, long *context,
                              int *batch, int *iters, int *windows, int *warmup, int *repeat,
                              int max_windows, int max_repeat) {
    td_args_int(a, "--layers", 1, 1024, &model->layers);
    td_args_int(a, "--heads", 1, 1024, &model->heads);
    td_args_long(a, "--width", 1, 1L << 20, width);
    td_args_long(a, "--context", 1, 1L << 20, context);
    td_args_int(a, "--batch", 4, INT_MAX, batch);
    td_args_int(a, "--iters", 1, INT_MAX, iters);
    td_args_int(a, "--windows", 1, max_windows, windows);
    td_args_int(a, "--warmup", 0, INT_MAX, warmup);
    td_args_int(a, "--repeat", 1, max_repeat, repeat);
}

typedef struct {
    td_gpt_params model;
    int batch, iters, windows, warmup;
    int memory;        /* 1: sample memory instead of timing */
    int deterministic; /* the layout's deterministic mode (--deterministic) */
    const lt_layout *l;
    td_recompute_mode recompute; /* every block's forward again in backward (docs/recompute.md) */
} lt_setup;

typedef struct {
    double ms;      /* rank 0's median step, ms */
    double cpu_ms;  /* this rank's CPU time per timed step */
    size_t peak;    /* this rank's peak proportional memory over its steps, less its base */
    int64_t params; /* parameters this rank holds (its slices and whole tensors) */
} lt_result;

/* Samples memory into *peak (relative to base). */
typedef struct {
    size_t base, peak;
    td_zero *zero;
} lt_probe;

static void lt_sample(lt_probe *p) {
    size_t now = bench_pss_bytes();
    if (now > p->base && now - p->base > p->peak) p->peak = now - p->base;
}

/* ZeRO's hook, sampling memory after every parameter's first use and last (the gathered copies
 * and whole gradients exist only between them). */
static td_status lt_zero_hook(size_t i, td_param_use use, void *ctx) {
    lt_probe *p = ctx;
    td_status s = td_zero_param_use_hook(i, use, p->zero);
    if (use == TD_PARAM_BEFORE_FORWARD || use == TD_PARAM_BEFORE_BACKWARD) lt_sample(p);
    return s;
}

static int lt_rank(int rank, int world, void *result, void *arg) {
    const lt_setup *su = arg;
    const lt_layout *l = su->l;
    lt_result *out = result;
    lt_probe probe = {bench_pss_bytes(), 0, NULL};
    td_comm *comm = l->alone ? NULL : bench_comm();
    td_mesh *mesh = NULL;
    if (comm) {
        td_mesh_params mp = {
            .ndims = 3, .names = {"pp", "dp", "tp"}, .sizes = {l->pp, l->dp, l->tp}};
        CHECK(td_mesh_create(&mesh, comm, &mp));
    }
    int det = su->deterministic;
    int64_t T = su->model.context, rows = su->batch / (l->alone ? world : l->dp);
    size_t count = 1; /* forward and backward passes per step: the replica's shards */
    if (det) count = LT_SHARDS / (size_t)l->dp, rows = su->batch / LT_SHARDS;
    td_gpt_params gp = su->model;
    gp.tensor_parallel = det || l->tp > 1; /* deterministic: the tp layers' shards at tp 1 too */
    gp.sequence_parallel = l->tp > 1;
    td_sequential *s;
    CHECK(td_gpt_sequential(&gp, &s));
    td_graph_params grp = td_graph_default_params();
    grp.comm = mesh ? td_mesh_group(mesh, "tp") : NULL;
    grp.recompute = su->recompute;
    grp.tp_shards = det ? LT_SHARDS : 0;
    grp.threads = det ? 1 : 0;
    td_ddp_params dpp = td_ddp_default_params();
    dpp.deterministic = det;
    dpp.shards = LT_SHARDS;
    td_graph *g = NULL;
    td_pipeline *pipe = NULL;
    td_model m;
    td_param *p, *stepped;
    size_t n, n_stepped;
    td_ddp *ddp = NULL;
    td_zero *zero = NULL;
    if (l->pp > 1) {
        td_pipeline_params pp = td_pipeline_default_params();
        pp.stages = l->pp;
        pp.micro_batches = det ? (int)count : rows >= 4 ? 4 : (int)rows;
        pp.batch = det ? (int64_t)count * rows : rows;
        char split[16]; /* the blocks halved */
        snprintf(split, sizeof split, gp.layers > 1 ? "h.%d" : "head", gp.layers / 2);
        pp.split = split;
        pp.graph = grp;
        pp.ddp = dpp;
        pp.mesh = mesh;
        CHECK(td_pipeline_create(&pipe, comm, s, &pp));
        CHECK(td_pipeline_parameters(pipe, &p, &n));
        stepped = p, n_stepped = n;
    } else {
        CHECK(td_graph_create(&g, &grp));
        CHECK(td_model_build_sequential(g, s, rows, 1, &m));
        CHECK(td_graph_parameters(g, &p, &n));
        stepped = p, n_stepped = n;
        if (l->zero) {
            td_zero_params zp = td_zero_default_params();
            zp.stage = l->zero;
            zp.ddp = dpp;
            CHECK(td_zero_create(&zero, td_mesh_group(mesh, "dp"), p, n, NULL, 0, &zp));
            CHECK(td_zero_parameters(zero, &stepped, &n_stepped));
            probe.zero = zero;
            td_graph_set_grad_ready_hook(g, td_zero_grad_ready_hook, zero);
            if (su->memory)
                td_graph_set_param_use_hook(g, lt_zero_hook, &probe);
            else
                td_graph_set_param_use_hook(g, td_zero_param_use_hook, zero);
        } else if (l->dp > 1 || (det && !l->alone)) { /* deterministic: the shard tree at dp 1 */
            CHECK(td_ddp_create(&ddp, td_mesh_group(mesh, "dp"), p, n, NULL, 0, &dpp));
            td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, ddp);
        }
    }
    out->params = 0;
    for (size_t i = 0; i < n; i++) out->params += (int64_t)p[i].count;
    td_adamw_params ap = td_adamw_default_params();
    td_optim *opt;
    CHECK(td_optim_create_adamw(&opt, stepped, n_stepped, &ap));
    int64_t pipe_rows = pipe && det ? (int64_t)count * rows : rows; /* a pipeline's whole part */
    float *x = malloc((size_t)(pipe_rows * T) * sizeof *x);
    int64_t *y = malloc((size_t)(pipe_rows * T) * sizeof *y);
    td_rng r;
    td_rng_init(&r, (uint64_t)td_mesh_coord(mesh, "dp") + 1);
    for (int64_t i = 0; i < pipe_rows * T; i++)
        x[i] = (float)td_rng_below(&r, (uint32_t)gp.vocab), y[i] = i % gp.vocab;
    double rates[LAYOUT_WINDOWS], cpu0 = 0;
    int windows = su->memory ? 0 : su->windows;
    for (int w = -1; w < windows; w++) { /* window -1 is the warm-up */
        int iters = w < 0 ? (su->memory ? 2 : su->warmup) : su->iters;
        if (comm) CHECK(td_comm_barrier(comm));
        if (w == 0) cpu0 = bench_cpu_seconds();
        uint64_t t0 = td_time_ns();
        for (int it = 0; it < iters; it++) {
            if (pipe) {
                CHECK(td_pipeline_step(pipe, x, y, NULL));
            } else {
                for (size_t j = 0; j < count; j++) { /* deterministic: shard by shard */
                    if (zero) CHECK(td_zero_prepare_forward(zero));
                    if (ddp) CHECK(td_ddp_prepare_forward(ddp));
                    CHECK(td_tensor_write(m.input, x));
                    CHECK(td_tensor_write(m.labels, y));
                    CHECK(td_graph_forward(g));
                    if (su->memory) lt_sample(&probe);
                    CHECK(td_graph_zero_grad(g));
                    CHECK(td_graph_backward(g, m.loss));
                    if (zero) CHECK(td_zero_finish_backward(zero));
                    if (ddp) CHECK(td_ddp_finish_backward(ddp));
                }
            }
            if (su->memory) lt_sample(&probe);
            CHECK(td_optim_step(opt));
            if (su->memory) lt_sample(&probe);
        }
        if (w >= 0) rates[w] = (double)(td_time_ns() - t0) / 1e6 / iters;
    }
    out->peak = probe.peak;
    out->cpu_ms = windows ? (bench_cpu_seconds() - cpu0) * 1e3 / (windows * su->iters) : 0;
    if (rank == 0 && windows) out->ms = bench_median(rates, windows);
    free(x);
    free(y);
    td_optim_destroy(opt);
    if (g) td_graph_set_param_use_hook(g, NULL, NULL);
    td_pipeline_destroy(pipe);
    td_ddp_destroy(ddp);
    td_zero_destroy(zero);
    td_graph_destroy(g);
    td_sequential_destroy(s);
    td_mesh_destroy(mesh);
    td_comm_destroy(comm);
    return 0;
}

/* Runs one layout; rank 0's step time, the largest peak and the CPU time of all ranks per step
 * in *r. Returns 0 on success. */
static int lt_run(lt_setup *su, const lt_layout *l, td_recompute_mode rc, int memory,
                  lt_result *r) {
    lt_result each[LAYOUT_WORLD];
    memset(each, 0, sizeof each);
    su->l = l;
    su->recompute = rc;
    su->memory = memory;
    if (bench_ranks(LAYOUT_WORLD, 1, lt_rank, su, each, sizeof *each)) return 1;
    *r = each[0];
    r->cpu_ms = 0;
    for (int k = 0; k < LAYOUT_WORLD; k++) {
        r->peak = each[k].peak > r->peak ? each[k].peak : r->peak;
        r->cpu_ms += each[k].cpu_ms;
    }
    return 0;
}

/* The most layers of --cap-width whose two training steps stay within cap_mib per rank. */
static int lt_cap_layers(lt_setup *su, const lt_layout *l, td_recompute_mode rc, int cap_mib,
                         size_t *peak) {
    size_t cap = (size_t)cap_mib << 20;
    int fit = 0, over = 0;
    *peak = 0;
    for (int layers = 1; !over && layers <= CAP_MAX_LAYERS;) {
        su->model.layers = layers;
        lt_result r;
        if (!lt_run(su, l, rc, 1, &r) && r.peak <= cap)
            fit = layers, *peak = r.peak, layers *= 2;
        else
            over = layers;
    }
    while (over && over - fit > 1) {
        int mid = fit + (over - fit) / 2;
        su->model.layers = mid;
        lt_result r;
        if (!lt_run(su, l, rc, 1, &r) && r.peak <= cap)
            fit = mid, *peak = r.peak;
        else
            over = mid;
    }
    return fit;
}

/* The timed tables' first line: the model, the batch, `what`, the windows and the load. */
static void lt_model_line(const lt_setup *su, const char *what, int repeat) {
    char load[64];
    printf("GPT %d layers, %d heads, width %lld, context %lld, global batch %d (%.2f M "
           "parameters); %smedian of %d windows of %d steps after %d, %d interleaved repeat(s); "
           "load average %s\n",
           su->model.layers, su->model.heads, (long long)su->model.width,
           (long long)su->model.context, su->batch, td_gpt_parameter_count(&su->model) / 1e6, what,
           su->windows, su->iters, su->warmup, repeat, bench_load_average(load, sizeof load));
}

/* --deterministic: every layout's step time in both modes, interleaved, and their ratio; the CPU
 * time of all ranks per step too (a rank waiting for a peer on a shared machine spins less
 * than the wall clock drifts). */
static void lt_deterministic_table(lt_setup *su, int repeat, int json) {
    double ms[N_DET_LAYOUTS][2][LAYOUT_WINDOWS], cpu[N_DET_LAYOUTS][2][LAYOUT_WINDOWS];
    double ratio[N_DET_LAYOUTS][LAYOUT_WINDOWS], cpu_ratio[N_DET_LAYOUTS][LAYOUT_WINDOWS];
    for (int k = 0; k < repeat; k++)
        for (int row = 0; row < N_DET_LAYOUTS; row++) {
            for (int det = 0; det < 2; det++) {
                lt_result r;
                su->deterministic = det;
                int bad = lt_run(su, &LT_DET_LAYOUTS[row], TD_RECOMPUTE_NONE, 0, &r);
                ms[row][det][k] = bad ? NAN : r.ms;
                cpu[row][det][k] = bad ? NAN : r.cpu_ms;
            }
            ratio[row][k] = ms[row][0][k] / ms[row][1][k];
            cpu_ratio[row][k] = cpu[row][0][k] / cpu[row][1][k];
        }
    su->deterministic = 0;
    printf("%-12s %12s %12s %9s %14s %14s %9s\n", "layout", "default ms", "determ. ms", "speed",
           "default CPU ms", "determ. CPU ms", "CPU");
    for (int row = 0; row < N_DET_LAYOUTS; row++) {
        double d = bench_median(ms[row][0], repeat), t = bench_median(ms[row][1], repeat);
        double cd = bench_median(cpu[row][0], repeat), ct = bench_median(cpu[row][1], repeat);
        double q = bench_median(ratio[row], repeat), cq = bench_median(cpu_ratio[row], repeat);
        printf("%-12s %12.1f %12.1f %8.2fx %14.1f %14.1f %8.2fx\n", LT_DET_LAYOUTS[row].name, d, t,
               q, cd, ct, cq);
        if (json)
            printf("{\"table\": \"deterministic\", \"layout\": \"%s\", \"default_ms\": %.3f, "
                   "\"deterministic_ms\": %.3f, \"ratio\": %.3f, \"default_cpu_ms\": %.3f, "
                   "\"deterministic_cpu_ms\": %.3f, \"cpu_ratio\": %.3f}\n",
                   LT_DET_LAYOUTS[row].name, d, t, q, cd, ct, cq);
    }
    printf("(speed: the default step time over the deterministic one, the median of the repeats' "
           "ratios; CPU: the same of all ranks' CPU time per step; %d shards of the batch and of "
           "every tensor-parallel layer)\n",
           LT_SHARDS);
}

static int lt_main(int argc, char **argv) {
    lt_setup su = {
        .model = td_gpt_default_params(), .batch = 16, .iters = 3, .windows = 3, .warmup = 1};
    su.model.heads = 8;
    su.model.width = 256;
    int repeat = 1, cap_mib = 0, cap_width = 256, no_time = 0, json = 0, tp = 0, det = 0;
    long width = su.model.width, context = su.model.context;
    td_args a;
    td_args_init(&a, "gpt --tp", argc, argv);
    while (td_args_next(&a)) {
        td_args_flag(&a, "--tp", &tp);
        td_args_flag(&a, "--no-time", &no_time);
        td_args_flag(&a, "--deterministic", &det);
        td_args_flag(&a, "--json", &json);
        td_args_int(&a, "--cap", 1, 1 << 20, &cap_mib);
        td_args_int(&a, "--cap-width", 64, 1 << 16, &cap_width);
        gpt_bench_options(&a, &su.model, &width, &context, &su.batch, &su.iters, &su.windows,
                          &su.warmup, &repeat, LAYOUT_WINDOWS, LAYOUT_WINDOWS);
    }
    if (su.batch % LAYOUT_WORLD)
        td_args_error(&a, "--batch %d is not a multiple of %d", su.batch, LAYOUT_WORLD);
    if (det && (su.model.heads % LT_SHARDS || su.model.vocab % LT_SHARDS))
        td_args_error(&a,
                      "--deterministic: --heads %d and the vocabulary (%lld) split into %d shards",
                      su.model.heads, (long long)su.model.vocab, LT_SHARDS);
    bench_args_finish(&a, "usage: gpt --tp [--layers N --heads N --width C --context T "
                          "--batch GLOBAL]\n"
                          "                [--iters N --windows N --warmup N --repeat K]\n"
                          "                [--cap MiB [--cap-width C]] [--deterministic] "
                          "[--no-time] [--json]\n");
    su.model.width = width;
    su.model.context = context;
    int time = !no_time;
    char cpu[256], load[64];
    printf("GPT layouts at world %d; %s; one thread per rank, each pinned to its own core\n",
           LAYOUT_WORLD, bench_cpu_name(cpu, sizeof cpu));
    if (det) {
        lt_model_line(&su, "default and deterministic mode; ", repeat);
        lt_deterministic_table(&su, repeat, json);
        printf("(load average after: %s)\n", bench_load_average(load, sizeof load));
        return 0;
    }
    if (time) {
        lt_model_line(&su, "", repeat);
        /* rows: each layout without recompute, then with it (full) */
        enum { ROWS = 2 * N_LAYOUTS };
        double ms[ROWS][LAYOUT_WINDOWS], cpu_ms[ROWS][LAYOUT_WINDOWS];
        lt_result mem[ROWS];
        for (int k = 0; k < repeat; k++)
            for (int row = 0; row < ROWS; row++) {
                lt_result r;
                int bad = lt_run(&su, &LT_LAYOUTS[row % N_LAYOUTS], LT_MODE(row), 0, &r);
                ms[row][k] = bad ? NAN : r.ms;
                cpu_ms[row][k] = bad ? NAN : r.cpu_ms;
            }
        for (int row = 0; row < ROWS; row++)
            if (lt_run(&su, &LT_LAYOUTS[row % N_LAYOUTS], LT_MODE(row), 1, &mem[row]))
                mem[row].peak = 0;
        double alone = bench_median(ms[0], repeat);
        printf("%-12s %-9s %10s %9s %14s %14s %16s\n", "layout", "recompute", "ms/step", "vs alone",
               "CPU ms/step", "peak MiB/rank", "params/rank (M)");
        for (int row = 0; row < ROWS; row++) {
            const char *rc = LT_MODE(row) ? "full" : "none";
            double t = bench_median(ms[row], repeat), c = bench_median(cpu_ms[row], repeat);
            printf("%-12s %-9s %10.1f %8.2fx %14.1f %14.1f %16.2f\n",
                   LT_LAYOUTS[row % N_LAYOUTS].name, rc, t, alone / t, c, mem[row].peak / 1048576.0,
                   mem[row].params / 1e6);
            if (json)
                printf("{\"table\": \"layouts\", \"layout\": \"%s\", \"recompute\": \"%s\", "
                       "\"ms\": %.3f, \"cpu_ms\": %.3f, \"peak\": %zu, \"params\": %lld}\n",
                       LT_LAYOUTS[row % N_LAYOUTS].name, rc, t, c, mem[row].peak,
                       (long long)mem[row].params);
        }
        printf("(vs alone: the no-communication run's step time without recompute over the row's; "
               "load average "
               "after: %s)\n",
               bench_load_average(load, sizeof load));
    }
    if (cap_mib > 0) {
        su.model.context = CAP_CONTEXT;
        su.model.width = cap_width;
        su.model.heads = cap_width / 64 >= 4 ? cap_width / 64 : 4;
        su.batch = CAP_BATCH;
        printf("\nthe largest GPT of width %d, context %d, global batch %d whose two training "
               "steps stay within %d MiB per rank at world %d (load average %s)\n",
               cap_width, CAP_CONTEXT, CAP_BATCH, cap_mib, LAYOUT_WORLD,
               bench_load_average(load, sizeof load));
        printf("%-12s %-9s %7s %12s %14s %10s\n", "layout", "recompute", "layers", "parameters",
               "peak MiB/rank", "vs ddp");
        double ddp = 0, best = 0;
        const char *best_name = "", *best_rc = "";
        for (int row = 0; row < 2 * N_LAYOUTS; row++) {
            const lt_layout *l = &LT_LAYOUTS[row % N_LAYOUTS];
            if (l->alone) continue;
            size_t peak;
            int layers = lt_cap_layers(&su, l, LT_MODE(row), cap_mib, &peak);
            su.model.layers = layers;
            double params = layers ? (double)td_gpt_parameter_count(&su.model) : 0;
            const char *rc = LT_MODE(row) ? "full" : "none";
            if (row == 1) ddp = params; /* DDP without recompute: the baseline */
            if (params > best) best = params, best_name = l->name, best_rc = rc;
            printf("%-12s %-9s %7d %10.1f M %14.1f %9.2fx\n", l->name, rc, layers, params / 1e6,
                   peak / 1048576.0, ddp > 0 ? params / ddp : 0);
            if (json)
                printf("{\"table\": \"cap\", \"layout\": \"%s\", \"recompute\": \"%s\", "
                       "\"cap_mib\": %d, \"layers\": %d, \"parameters\": %.0f, \"peak\": %zu}\n",
                       l->name, rc, cap_mib, layers, params, peak);
            fflush(stdout);
        }
        printf("the best: %s, recompute %s, %.2fx the parameters DDP fits without recompute\n",
               best_name, best_rc, ddp > 0 ? best / ddp : 0);
    }
    return 0;
}

#endif
