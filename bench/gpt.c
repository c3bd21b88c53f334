/* Training throughput of the GPT (tokens per second of forward, backward and AdamW) in tandem and
 * in PyTorch on the same model, batch and thread count, in f32 and bf16 (tandem O1 against
 * torch.autocast(bfloat16)), at worlds 1 and 2 (DDP; ranks forked, one OpenMP thread each and
 * each pinned to its own core on both sides, or neither with --no-pin), plus the deterministic
 * mode's cost against the default DDP. Random tokens: throughput does not depend on the text. The
 * PyTorch peer is bench/gpt_torch.py (nanoGPT's model) under Debian's PyTorch and, as a second
 * peer column, under a current PyTorch 2.x from PyPI where scripts/deps.sh torch2 installed it
 * (.venv/torch2, or the interpreter --torch2 names; one line says so where it is missing). Each
 * rate is the median of --windows timed windows of --iters steps after --warmup steps, on both
 * sides; --repeat K runs every row K times, interleaved so that a shared machine's slow spells fall
 * on every row alike, and prints medians (the ratio: the median of each repeat's ratio). The load
 * average before and after is printed: on a busy machine the world-2 rows share their cores with
 * other work, and a rank that waits for its peer gives its core away; so each row also gives tokens
 * per CPU-second (the CPU time of all of every rank's threads over the windows, on both sides),
 * which the load changes little.
 *
 *   build/bench/gpt [--layers N --heads N --width C --context T --batch GLOBAL]
 *                   [--iters N --windows N --warmup N --repeat K] [--no-torch] [--no-pin]
 *                   [--torch2 PYTHON]
 *
 * With --tp it compares the layouts of a device mesh instead, and with --tp --deterministic each
 * layout's deterministic mode against its default (bench/gpt_layouts.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tandem/tandem.h"

#include "bench.h"
#include "gpt_layouts.h"

#define MAX_REPEAT 15
#define MAX_WINDOWS 32

typedef struct {
    td_gpt_params model;
    int batch, iters, windows, warmup, amp, deterministic;
    int pin; /* each rank on its own core, on both sides */
} setup;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of the n values of v that are > 0 (a failed run is NaN or -1); NaN when none are. */
static double median_of(const double *v, int n) {
    double ok[MAX_REPEAT > MAX_WINDOWS ? MAX_REPEAT : MAX_WINDOWS];
    int m = 0;
    for (int i = 0; i < n; i++)
        if (v[i] > 0) ok[m++] = v[i];
    if (!m) return NAN;
    qsort(ok, (size_t)m, sizeof *ok, cmp_double);
    return ok[m / 2];
}

/* What a run measured: rank 0's median window in tokens/s, and every rank's CPU time (all its
 * threads) over the timed windows. */
typedef struct {
    double rate, cpu_s;
} measured;

/* Tokens of the timed windows, over all ranks. */
static double tokens_run(const setup *su) {
    return (double)su->batch * (double)su->model.context * (double)(su->iters * su->windows);
}

/* One rank: warm-up steps, then `windows` windows of `iters` timed steps. */
static int rank_fn(int rank, int world, void *result, void *arg) {
    const setup *su = arg;
    td_comm *comm = world > 1 || su->deterministic ? bench_comm() : NULL;
    int64_t T = su->model.context;
    int64_t local = su->deterministic ? su->batch / 4 : su->batch / world;
    td_graph_params gp = td_graph_default_params();
    if (su->amp) gp.amp.level = TD_AMP_O1;
    gp.threads = su->deterministic ? 1 : 0; /* as examples/gpt: one thread per shard */
    td_graph *g;
    td_model m;
    td_sequential *s;
    CHECK(td_graph_create(&g, &gp));
    CHECK(td_gpt_sequential(&su->model, &s));
    CHECK(td_model_build_sequential(g, s, local, 1, &m));
    td_param *params;
    size_t n;
    CHECK(td_graph_parameters(g, &params, &n));
    td_ddp *ddp = NULL;
    if (comm) {
        td_ddp_params dp = td_ddp_default_params();
        dp.deterministic = su->deterministic;
        dp.shards = 4;
        CHECK(td_ddp_create(&ddp, comm, params, n, NULL, 0, &dp));
        td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, ddp);
    }
    td_adamw_params ap = td_adamw_default_params();
    td_optim *opt;
    CHECK(td_optim_create_adamw(&opt, params, n, &ap));
    float *x = td_tensor_data(m.input);
    int64_t *y = td_tensor_data(m.labels);
    td_rng r;
    td_rng_init(&r, (uint64_t)rank + 1);
    for (int64_t i = 0; i < local * T; i++) x[i] = (float)td_rng_below(&r, 256), y[i] = i % 256;
    size_t shards = 1;
    if (su->deterministic) {
        size_t first;
        td_ddp_shards(ddp, &first, &shards);
    }
    double rates[MAX_WINDOWS], cpu0 = 0;
    int64_t step = 0;
    for (int w = -1; w < su->windows; w++) { /* window -1 is the warm-up */
        int iters = w < 0 ? su->warmup : su->iters;
        if (comm) CHECK(td_comm_barrier(comm));
        if (w == 0) cpu0 = bench_cpu_seconds();
        uint64_t t0 = td_time_ns();
        for (int it = 0; it < iters; it++) {
            for (size_t j = 0; j < shards; j++) {
                if (ddp) CHECK(td_ddp_prepare_forward(ddp));
                CHECK(td_graph_forward(g));
                CHECK(td_graph_zero_grad(g));
                CHECK(td_graph_backward(g, m.loss));
                if (ddp) CHECK(td_ddp_finish_backward(ddp));
            }
            CHECK(td_optim_step(opt));
            float loss;
            CHECK(td_tensor_read(m.loss, &loss));
            CHECK(td_loss_check(loss, ++step));
        }
        double sec = (double)(td_time_ns() - t0) / 1e9;
        if (w >= 0) rates[w] = (double)su->batch * (double)T * iters / sec;
    }
    measured *out = result;
    out->cpu_s = bench_cpu_seconds() - cpu0;
    if (rank == 0) out->rate = median_of(rates, su->windows);
    td_optim_destroy(opt);
    td_ddp_destroy(ddp);
    td_graph_destroy(g);
    td_sequential_destroy(s);
    td_comm_destroy(comm);
    return 0;
}

/* tokens/s, and tokens per CPU-second of all ranks together in *per_cpu. */
static double tandem_rate(const setup *su, int world, double *per_cpu) {
    measured m[2];
    memset(m, 0, sizeof m);
    *per_cpu = NAN;
    if (bench_ranks(world, su->pin, rank_fn, (void *)su, m, sizeof *m)) return NAN;
    *per_cpu = tokens_run(su) / (m[0].cpu_s + (world > 1 ? m[1].cpu_s : 0));
    return m[0].rate;
}

/* The peer's tokens/s under `python`, and tokens per CPU-second in *per_cpu. */
static double torch_rate(const char *python, const setup *su, int world, double *per_cpu) {
    char cmd[768];
    snprintf(cmd, sizeof cmd,
             "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 600 %s bench/gpt_torch.py "
             "--layers %d --heads %d --width %lld --context %lld --batch %d --iters %d "
             "--windows %d --warmup %d --world %d%s%s",
             python, su->model.layers, su->model.heads, (long long)su->model.width,
             (long long)su->model.context, su->batch, su->iters, su->windows, su->warmup, world,
             su->amp ? " --bf16" : "", su->pin ? " --pin" : "");
    FILE *p = popen(cmd, "r");
    double rate = NAN;
    *per_cpu = NAN;
    if (p) {
        char line[256];
        while (fgets(line, sizeof line, p))
            if (!strncmp(line, "tokens_per_s ", 13))
                rate = atof(line + 13);
            else if (!strncmp(line, "cpu_s ", 6))
                *per_cpu = tokens_run(su) / atof(line + 6);
        pclose(p);
    }
    return rate;
}

static void load_average(char *out, size_t cap) {
    snprintf(out, cap, "?");
    FILE *f = fopen("/proc/loadavg", "r");
    if (!f) return;
    double a, b, c;
    if (fscanf(f, "%lf %lf %lf", &a, &b, &c) == 3) snprintf(out, cap, "%.2f %.2f %.2f", a, b, c);
    fclose(f);
}

/* The rows: f32 and bf16 at worlds 1 and 2, then the deterministic mode and its default DDP. */
enum { ROWS = 6 };

static void row_setup(setup *su, int row, int *world) {
    su->amp = row >= 2 && row < 4;
    su->deterministic = row == 5;
    *world = row < 4 ? 1 + row % 2 : 2;
}

int main(int argc, char **argv) {
    bench_one_thread(argv);
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--tp")) return lt_main(argc, argv); /* the layouts' tables */
    const char *torch2 = BENCH_TORCH2;
    setup su = {.model = td_gpt_default_params(),
                .batch = 16,
                .iters = 5,
                .windows = 3,
                .warmup = 2,
                .pin = 1};
    int repeat = 1, no_torch = 0, no_pin = 0;
    long width = su.model.width, context = su.model.context;
    td_args a;
    td_args_init(&a, "gpt", argc, argv);
    while (td_args_next(&a)) {
        td_args_flag(&a, "--no-torch", &no_torch);
        td_args_flag(&a, "--no-pin", &no_pin);
        gpt_bench_options(&a, &su.model, &width, &context, &su.batch, &su.iters, &su.windows,
                          &su.warmup, &repeat, MAX_WINDOWS, MAX_REPEAT);
        td_args_string(&a, "--torch2", &torch2);
    }
    if (su.batch % 4) td_args_error(&a, "--batch %d is not a multiple of 4", su.batch);
    bench_args_finish(&a, "usage: gpt [--layers N] [--heads N] [--width C] [--context T] "
                          "[--batch GLOBAL]\n"
                          "           [--iters N] [--windows N] [--warmup N] [--repeat N] "
                          "[--no-torch]\n"
                          "           [--no-pin] [--torch2 PYTHON] | --tp [bench/gpt_layouts.h's "
                          "options]\n");
    int torch = !no_torch;
    if (no_pin) su.pin = 0;
    su.model.width = width;
    su.model.context = context;
    char cpu[256], load[64], v2[64] = "";
    int have2 = torch && bench_torch2(torch2, v2, sizeof v2);
    load_average(load, sizeof load);
    printf("GPT %d layers, %d heads, width %lld, context %lld, global batch %d; one thread per "
           "rank%s; %s\n",
           su.model.layers, su.model.heads, (long long)su.model.width, (long long)su.model.context,
           su.batch, su.pin ? ", each pinned to its own core" : ", not pinned",
           bench_cpu_name(cpu, sizeof cpu));
    printf("median of %d windows of %d steps after %d; %d interleaved repeat(s); load average "
           "before: %s\n",
           su.windows, su.iters, su.warmup, repeat, load);
    /* [0]: tokens/s, [1]: tokens per CPU-second of all ranks; theirs2: PyTorch 2.x */
    double ours[2][ROWS][MAX_REPEAT], theirs[2][ROWS][MAX_REPEAT], ratio[2][ROWS][MAX_REPEAT];
    double theirs2[2][ROWS][MAX_REPEAT], ratio2[2][ROWS][MAX_REPEAT];
    for (int r = 0; r < repeat; r++)
        for (int row = 0; row < ROWS; row++) {
            int world;
            row_setup(&su, row, &world);
            ours[0][row][r] = tandem_rate(&su, world, &ours[1][row][r]);
            theirs[0][row][r] = theirs[1][row][r] = theirs2[0][row][r] = theirs2[1][row][r] = NAN;
            if (torch && row < 4)
                theirs[0][row][r] = torch_rate("/usr/bin/python3", &su, world, &theirs[1][row][r]);
            if (have2 && row < 4)
                theirs2[0][row][r] = torch_rate(torch2, &su, world, &theirs2[1][row][r]);
        }
    for (int k = 0; k < 2; k++)
        for (int row = 0; row < ROWS; row++)
            for (int r = 0; r < repeat; r++) {
                ratio[k][row][r] = ours[k][row][r] / (row < 4 ? theirs[k][row][r] : ours[k][4][r]);
                ratio2[k][row][r] = ours[k][row][r] / theirs2[k][row][r];
            }
    if (have2) printf("second peer: PyTorch %s\n", v2);
    printf("%-5s %5s %12s %12s %7s   %16s %15s %7s   %13s %7s %16s %7s\n", "dtype", "world",
           "tandem tok/s", "torch tok/s", "ratio", "tandem tok/CPU-s", "torch tok/CPU-s", "ratio",
           "torch2 tok/s", "ratio", "torch2 tok/CPU-s", "ratio");
    for (int row = 0; row < 4; row++) {
        int world;
        row_setup(&su, row, &world);
        printf(
            "%-5s %5d %12.0f %12.0f %6.2fx   %16.0f %15.0f %6.2fx   %13.0f %6.2fx %16.0f %6.2fx\n",
            su.amp ? "bf16" : "f32", world, median_of(ours[0][row], repeat),
            median_of(theirs[0][row], repeat), median_of(ratio[0][row], repeat),
            median_of(ours[1][row], repeat), median_of(theirs[1][row], repeat),
            median_of(ratio[1][row], repeat), median_of(theirs2[0][row], repeat),
            median_of(ratio2[0][row], repeat), median_of(theirs2[1][row], repeat),
            median_of(ratio2[1][row], repeat));
    }
    printf("deterministic mode, f32, world 2, 4 shards: %.0f tok/s, %.2fx the default DDP's %.0f; "
           "per CPU-second %.2fx\n",
           median_of(ours[0][5], repeat), median_of(ratio[0][5], repeat),
           median_of(ours[0][4], repeat), median_of(ratio[1][5], repeat));
    load_average(load, sizeof load);
    printf("load average after: %s\n", load);
    return 0;
}
