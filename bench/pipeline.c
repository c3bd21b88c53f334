/* Pipeline parallelism on the ResNet, measured: samples/s of one process, of the naive split
 * (PyTorch's model-parallel tutorial: the batch goes through stage 0, then stage 1) and of GPipe
 * and 1F1B at M = 1, 2, 4, 8 micro-batches, each stage a rank pinned to its own core; beside them
 * each stage's measured idle ("bubble") fraction and the theory (P-1)/(M+P-1), and each stage's
 * peak activation memory. With --trace PREFIX every rank of the GPipe and 1F1B runs at M = 4
 * writes PREFIX.<schedule>.rank<r>.json, a Chrome trace of the schedule (open them together in
 * Perfetto).
 *
 *   build/bench/pipeline [--stages 2] [--batch 128] [--micro 1,2,4,8] [--split layer3|balanced]
 *                        [--steps 8] [--warmup 2] [--repeat 3] [--trace PREFIX] [--json]
 *
 * A run times `steps` steps (pipeline step + SGD step) between two barriers after `warmup`
 * steps. A stage's idle fraction is 1 - (its forward, backward and optimizer time) / (the
 * timed span): what its core did not compute. --repeat K runs every configuration K times,
 * interleaved, and prints medians, so slow spells of a shared machine fall on every row alike.
 * Every run is in fresh processes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/tandem.h"

#include "bench.h"

#define MAX_REPEAT 9
#define MAX_MICRO 6
#define MAX_STAGES 4

typedef struct {
    int stages;
    int64_t batch;
    int steps, warmup;
    const char *split; /* NULL: balanced */
} setup;

/* One configuration: world 1 runs the model whole; otherwise a pipeline. */
typedef struct {
    const setup *su;
    int pipeline; /* 0: one process */
    td_pipeline_schedule schedule;
    int micro;
    const char *trace; /* NULL, or the file prefix for this run */
} run_cfg;

/* What each rank reports. */
typedef struct {
    double samples_per_s;
    double idle;    /* fraction of the timed span not computing */
    double act_mb;  /* one micro-batch graph's activation memory */
    double peak_mb; /* peak activation memory of the stage */
    int graphs, stage;
    size_t first, last;
} rank_result;

static td_dataset *load_data(void) {
    td_dataset *d;
    CHECK(td_dataset_load_fashion_mnist(&d, NULL, TD_SPLIT_TEST));
    return d;
}

static int one_process(const run_cfg *c, rank_result *out) {
    const setup *su = c->su;
    td_graph *g;
    td_model m;
    CHECK(td_graph_create(&g, NULL));
    CHECK(td_model_build(g, TD_MODEL_RESNET, su->batch, 1, &m));
    td_dataset *d = load_data();
    CHECK(td_tensor_write(m.input, td_dataset_x(d)));
    CHECK(td_tensor_write(m.labels, td_dataset_y(d)));
    td_dataset_destroy(d);
    td_param *p;
    size_t n;
    CHECK(td_graph_parameters(g, &p, &n));
    td_sgd_params sp = td_sgd_default_params();
    sp.momentum = 0.9;
    td_optim *opt;
    CHECK(td_optim_create_sgd(&opt, p, n, &sp));
    uint64_t t0 = 0;
    for (int i = -su->warmup; i < su->steps; i++) {
        if (i == 0) t0 = td_time_ns();
        CHECK(td_graph_forward(g));
        CHECK(td_graph_backward(g, m.loss));
        CHECK(td_optim_step(opt));
        CHECK(td_graph_zero_grad(g));
        CHECK(td_loss_check(*(const float *)td_tensor_data(m.loss), i + su->warmup + 1));
    }
    double secs = (double)(td_time_ns() - t0) * 1e-9;
    out->samples_per_s = (double)su->batch * su->steps / secs;
    out->idle = 0;
    out->act_mb = out->peak_mb = (double)td_graph_memory_bytes(g) / 1e6;
    out->graphs = 1;
    td_optim_destroy(opt);
    td_graph_destroy(g);
    return 0;
}

static int pipeline_rank(int rank, int world, void *result, void *arg) {
    const run_cfg *c = arg;
    rank_result *out = result;
    memset(out, 0, sizeof *out);
    if (!c->pipeline) return one_process(c, out);
    const setup *su = c->su;
    td_comm *comm = bench_comm();
    td_sequential *model;
    CHECK(td_model_sequential(TD_MODEL_RESNET, &model));
    td_trace *trace = NULL;
    if (c->trace) CHECK(td_trace_create(&trace, rank));
    td_pipeline_params pp = td_pipeline_default_params();
    pp.schedule = c->schedule;
    pp.stages = su->stages;
    pp.micro_batches = c->micro;
    pp.batch = su->batch;
    pp.split = su->split;
    pp.seed = 1;
    pp.trace = trace;
    td_pipeline *pipe;
    CHECK(td_pipeline_create(&pipe, comm, model, &pp));
    td_dataset *d = load_data();
    td_param *p;
    size_t n;
    CHECK(td_pipeline_parameters(pipe, &p, &n));
    td_sgd_params sp = td_sgd_default_params();
    sp.momentum = 0.9;
    td_optim *opt;
    CHECK(td_optim_create_sgd(&opt, p, n, &sp));
    uint64_t t0 = 0, busy = 0;
    for (int i = -su->warmup; i < su->steps; i++) {
        if (i == 0) {
            CHECK(td_comm_barrier(comm));
            t0 = td_time_ns();
        }
        float loss; /* the last stage's; NaN on the others */
        CHECK(td_pipeline_step(pipe, td_dataset_x(d), td_dataset_y(d), &loss));
        if (td_pipeline_get_info(pipe).stage + 1 == su->stages)
            CHECK(td_loss_check(loss, i + su->warmup + 1));
        uint64_t o0 = td_time_ns();
        CHECK(td_optim_step(opt));
        if (i >= 0) busy += td_pipeline_get_stats(pipe).busy_ns + (td_time_ns() - o0);
    }
    CHECK(td_comm_barrier(comm));
    double span = (double)(td_time_ns() - t0);
    td_pipeline_stats st = td_pipeline_get_stats(pipe);
    td_pipeline_info info = td_pipeline_get_info(pipe);
    out->samples_per_s = (double)su->batch * su->steps / (span * 1e-9);
    out->idle = 1.0 - (double)busy / span;
    out->act_mb = (double)st.activation_bytes / 1e6;
    out->peak_mb = (double)st.peak_activation_bytes / 1e6;
    out->graphs = info.graphs;
    out->stage = info.stage;
    out->first = info.first_layer;
    out->last = info.last_layer;
    if (trace) {
        char path[512];
        snprintf(path, sizeof path, "%s.%s.rank%d.json", c->trace,
                 td_pipeline_schedule_name(c->schedule), rank);
        CHECK(td_trace_write(trace, path));
    }
    td_optim_destroy(opt);
    td_pipeline_destroy(pipe);
    td_trace_destroy(trace);
    td_dataset_destroy(d);
    td_sequential_destroy(model);
    td_comm_destroy(comm);
    (void)world;
    return 0;
}

/* Per-layer forward + backward times at micro-batch `arg` and the cut they balance to. */
typedef struct {
    double ms[32];
    size_t n, first[MAX_STAGES];
} profile_result;

typedef struct {
    int64_t micro;
    int stages;
} profile_job;

static int profile_rank(int rank, int world, void *result, void *arg) {
    const profile_job *j = arg;
    profile_result *out = result;
    td_sequential *model;
    CHECK(td_model_sequential(TD_MODEL_RESNET, &model));
    out->n = td_sequential_count(model);
    double t[32];
    CHECK(td_pipeline_profile_layers(model, j->micro, 9, t));
    CHECK(td_pipeline_balance(t, out->n, j->stages, out->first));
    for (size_t i = 0; i < out->n; i++) out->ms[i] = t[i] * 1e3;
    td_sequential_destroy(model);
    (void)rank, (void)world;
    return 0;
}

static double median(double *v, int n) {
    double c[MAX_REPEAT];
    memcpy(c, v, (size_t)n * sizeof *c);
    qsort(c, (size_t)n, sizeof *c, bench_cmp_double);
    return c[n / 2];
}

/* Every row's measurements over the repeats. */
typedef struct {
    const char *label;
    run_cfg cfg;
    double rate[MAX_REPEAT], idle[MAX_STAGES][MAX_REPEAT];
    rank_result last[MAX_STAGES];
} row;

int main(int argc, char **argv) {
    setup su = {2, 128, 8, 2, "layer3"};
    const char *trace = NULL, *split = NULL;
    int repeat = 3, json = 0, micro[MAX_MICRO] = {1, 2, 4, 8}, nm = 4;
    long batch = (long)su.batch;
    td_args a;
    td_args_init(&a, "pipeline", argc, argv);
    while (td_args_next(&a)) {
        td_args_flag(&a, "--json", &json);
        td_args_int(&a, "--stages", 2, MAX_STAGES, &su.stages);
        td_args_long(&a, "--batch", 1, LONG_MAX, &batch);
        td_args_int_list(&a, "--micro", 1, INT_MAX, micro, MAX_MICRO, &nm);
        td_args_string(&a, "--split", &split);
        td_args_int(&a, "--steps", 1, INT_MAX, &su.steps);
        td_args_int(&a, "--warmup", 0, INT_MAX, &su.warmup);
        td_args_int(&a, "--repeat", 1, MAX_REPEAT, &repeat);
        td_args_string(&a, "--trace", &trace);
    }
    for (int i = 0; i < nm; i++)
        if (batch % micro[i])
            td_args_error(&a, "--micro %d does not divide --batch %ld", micro[i], batch);
    bench_args_finish(&a, "usage: pipeline [--stages P] [--batch N] [--micro 1,2,4,8] [--split "
                          "NAMES|balanced] [--steps N] [--warmup N] [--repeat N] [--trace "
                          "PREFIX] [--json]\n");
    su.batch = batch;
    if (split) su.split = strcmp(split, "balanced") ? split : NULL;
    if (su.stages != 2 && !split) su.split = NULL; /* the tutorial's cut is for two stages */
    bench_one_thread(argv);

    row rows[2 + 2 * MAX_MICRO];
    int nr = 0;
    memset(rows, 0, sizeof rows);
    rows[nr++] = (row){.label = "one process", .cfg = {&su, 0, TD_SCHEDULE_NAIVE, 1, NULL}};
    rows[nr++] = (row){.label = "naive split", .cfg = {&su, 1, TD_SCHEDULE_NAIVE, 1, NULL}};
    td_pipeline_schedule sch[2] = {TD_SCHEDULE_GPIPE, TD_SCHEDULE_1F1B};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < nm; i++)
            rows[nr++] = (row){.label = td_pipeline_schedule_name(sch[k]),
                               .cfg = {&su, 1, sch[k], micro[i], NULL}};

    char cpu[256], load[64];
    bench_load_average(load, sizeof load);
    printf("%s\n", bench_cpu_name(cpu, sizeof cpu));
    printf("ResNet (td_resnet_default_params), batch %lld, %d stages, split %s; load average "
           "before: %s\n",
           (long long)su.batch, su.stages, su.split ? su.split : "balanced", load);
    printf("each rank pinned to its own core, one thread; %d timed steps after %d warm-up, "
           "medians of %d interleaved repeats\n",
           su.steps, su.warmup, repeat);
    /* What the balanced split sees: each layer alone, at the largest M's micro-batch. */
    profile_job pj = {su.batch / micro[nm - 1], su.stages};
    profile_result pr;
    td_sequential *names;
    CHECK(td_model_sequential(TD_MODEL_RESNET, &names));
    if (bench_ranks(1, 1, profile_rank, &pj, &pr, sizeof pr) == 0) {
        printf("layers alone, forward + backward at micro-batch %lld (fastest of 9):",
               (long long)pj.micro);
        for (size_t i = 0; i < pr.n; i++)
            printf(" %s %.2f ms%s", td_sequential_layer_name(names, i), pr.ms[i],
                   i + 1 < pr.n ? "," : "\n");
        printf("balanced split: stages start at");
        for (int k = 0; k < su.stages; k++)
            printf(" %s", td_sequential_layer_name(names, pr.first[k]));
        printf("\n");
    }
    fflush(stdout);
    int failed = 0;
    for (int r = 0; r < repeat; r++)
        for (int i = 0; i < nr; i++) {
            rank_result res[MAX_STAGES];
            run_cfg cfg = rows[i].cfg;
            if (trace && r == 0 && cfg.pipeline && cfg.schedule != TD_SCHEDULE_NAIVE &&
                cfg.micro == 4)
                cfg.trace = trace;
            int world = cfg.pipeline ? su.stages : 1;
            if (bench_ranks(world, 1, pipeline_rank, &cfg, res, sizeof *res)) {
                failed = 1;
                rows[i].rate[r] = -1;
                continue;
            }
            rows[i].rate[r] = res[0].samples_per_s;
            for (int s = 0; s < world; s++) {
                rows[i].idle[s][r] = res[s].idle;
                rows[i].last[s] = res[s];
            }
        }
    if (failed) fprintf(stderr, "bench/pipeline: some runs failed\n");
    double one = median(rows[0].rate, repeat), naive = median(rows[1].rate, repeat);
    printf("stages as run: ");
    for (int s = 0; s < su.stages; s++)
        printf("%s%d = %s .. %s", s ? ", " : "", s,
               td_sequential_layer_name(names, rows[1].last[s].first),
               td_sequential_layer_name(names, rows[1].last[s].last - 1));
    printf("\n\n%-12s %3s %10s %9s %9s", "schedule", "M", "samples/s", "vs 1 proc", "vs naive");
    for (int s = 0; s < su.stages; s++) printf("  idle s%d", s);
    printf("  theory");
    for (int s = 0; s < su.stages; s++) printf("  act MB s%d", s);
    printf("\n");
    for (int i = 0; i < nr; i++) {
        row *w = &rows[i];
        double rate = median(w->rate, repeat);
        int M = w->cfg.micro, P = su.stages;
        char mcol[16] = "-";
        if (w->cfg.pipeline) snprintf(mcol, sizeof mcol, "%d", M);
        printf("%-12s %3s %10.0f %8.2fx %8.2fx", w->label, mcol, rate, rate / one, rate / naive);
        for (int s = 0; s < P; s++) {
            if (w->cfg.pipeline)
                printf("  %7.1f%%", 100 * median(w->idle[s], repeat));
            else
                printf("  %8s", "-");
        }
        if (w->cfg.pipeline)
            printf("  %5.1f%%", 100.0 * (P - 1) / (M + P - 1));
        else
            printf("  %6s", "-");
        for (int s = 0; s < P; s++) {
            if (w->cfg.pipeline || s == 0)
                printf("  %9.1f", w->last[s].peak_mb);
            else
                printf("  %9s", "-");
        }
        printf("\n");
        if (json) {
            printf("{\"schedule\": \"%s\", \"micro_batches\": %d, \"samples_per_s\": %.1f",
                   w->label, M, rate);
            for (int s = 0; w->cfg.pipeline && s < P; s++)
                printf(", \"idle_s%d\": %.4f, \"peak_act_mb_s%d\": %.2f, \"graphs_s%d\": %d", s,
                       median(w->idle[s], repeat), s, w->last[s].peak_mb, s, w->last[s].graphs);
            printf("}\n");
        }
    }
    printf("\nact MB: peak activation memory of the stage (micro-batch graphs alive at once x one "
           "graph's activations, gradients and workspaces); one process: its whole graph\n");
    td_sequential_destroy(names);
    return failed;
}
