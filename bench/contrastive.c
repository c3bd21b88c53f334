/* examples/contrastive measured: SimCLR on Fashion-MNIST under tandemrun with negatives from
 * every rank (global) or from the rank's own batch (local), the linear probe on the trained
 * encoder beside the same probe on the encoder as initialised, and the training throughput of
 * both beside PyTorch's. Runs the example itself (build/examples/contrastive next to this
 * program's folder) and reads its closing line. Accuracy: one run per (seed, negatives), the
 * two kinds interleaved, medians over the random seeds (--max-steps and --probe-train shorten it).
 * Throughput: short runs without the probe, interleaved, the median of --repeat runs each;
 * with SyncBatchNorm (the example's default) and with plain batch norm, the like-for-like row
 * for the PyTorch peer (bench/contrastive_torch.py: DDP over gloo, one thread per rank, plain
 * batch norm since its SyncBatchNorm needs CUDA, views made once instead of per step).
 *
 *   build/bench/contrastive [--world 2] [--epochs 5] [--batch 64] [--seeds 3]
 *                           [--max-steps N] [--probe-train N] [--rate-steps 200] [--repeat 3]
 *                           [--no-torch] */
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"

#define MAX_RUNS 16

typedef struct {
    int world, epochs, batch, seeds, rate_steps, repeat, torch;
    long max_steps, probe_train; /* 0: the example's defaults (every step, 60000 images) */
} options;

static char example[PATH_MAX], launcher[PATH_MAX];

/* The number after `name` in text, or -1. */
static double field(const char *text, const char *name) {
    const char *at = strstr(text, name);
    return at ? atof(at + strlen(name)) : -1;
}

/* Runs the example under tandemrun with `args`; returns its closing "final:" line's fields. */
static int run(const options *o, const char *args, double *trained, double *random, double *rate) {
    char cmd[2 * PATH_MAX + 512], line[1024], final[1024] = "";
    snprintf(cmd, sizeof cmd, "%s --nproc-per-node %d %s %s 2>&1", launcher, o->world, example,
             args);
    FILE *p = popen(cmd, "r");
    if (!p) return 1;
    while (fgets(line, sizeof line, p))
        if (strstr(line, "final:")) snprintf(final, sizeof final, "%s", line);
    int status = pclose(p);
    if (status != 0 || !*final) {
        fprintf(stderr, "contrastive: '%s' failed\n", cmd);
        return 1;
    }
    *trained = field(final, "probe_trained ");
    *random = field(final, "probe_random ");
    *rate = field(final, "images_per_s ");
    return 0;
}

/* The PyTorch peer's images/s with `negatives`, or -1 when it could not run. */
static double run_torch(const options *o, const char *negatives) {
    char cmd[512], line[4096];
    snprintf(cmd, sizeof cmd,
             "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 /usr/bin/python3 bench/contrastive_torch.py "
             "--world %d --batch %d --negatives %s 2>/dev/null",
             o->world, o->batch, negatives);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    double rate = -1;
    while (fgets(line, sizeof line, p)) {
        const char *k = strstr(line, "\"images_per_s\":");
        if (k) rate = atof(k + strlen("\"images_per_s\":"));
    }
    return pclose(p) == 0 ? rate : -1;
}

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, int n) {
    double s[MAX_RUNS];
    memcpy(s, v, (size_t)n * sizeof *s);
    qsort(s, (size_t)n, sizeof *s, compare);
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

static void list(char *buf, size_t cap, const double *v, int n, const char *fmt) {
    buf[0] = 0;
    for (int i = 0; i < n; i++) {
        if (i) strncat(buf, " ", cap - strlen(buf) - 1);
        size_t at = strlen(buf);
        snprintf(buf + at, cap - at, fmt, v[i]);
    }
}

int main(int argc, char **argv) {
    bench_one_thread(argv); /* the ranks inherit OMP_NUM_THREADS=1 */
    options o = {.world = 2,
                 .epochs = 5,
                 .batch = 64,
                 .seeds = 3,
                 .rate_steps = 200,
                 .repeat = 3,
                 .torch = 1};
    int no_torch = 0;
    td_args parser;
    td_args_init(&parser, "contrastive", argc, argv);
    while (td_args_next(&parser)) {
        td_args_int(&parser, "--world", 1, 64, &o.world);
        td_args_int(&parser, "--epochs", 1, INT_MAX, &o.epochs);
        td_args_int(&parser, "--batch", 1, INT_MAX, &o.batch);
        td_args_int(&parser, "--seeds", 1, MAX_RUNS, &o.seeds);
        td_args_int(&parser, "--rate-steps", 1, INT_MAX, &o.rate_steps);
        td_args_int(&parser, "--repeat", 1, MAX_RUNS, &o.repeat);
        td_args_long(&parser, "--max-steps", 1, LONG_MAX, &o.max_steps);
        td_args_long(&parser, "--probe-train", 0, LONG_MAX, &o.probe_train);
        td_args_flag(&parser, "--no-torch", &no_torch);
    }
    if (o.batch % o.world)
        td_args_error(&parser, "--batch %d does not split over --world %d", o.batch, o.world);
    bench_args_finish(&parser,
                      "usage: contrastive [--world W (2)] [--epochs E (5)] [--batch B (64)] "
                      "[--seeds S (3)] [--max-steps N] [--probe-train N] [--rate-steps N "
                      "(200)] [--repeat R (3)] [--no-torch]\n");
    o.torch = !no_torch;
    char self[PATH_MAX];
    if (!realpath("/proc/self/exe", self)) return 1;
    char *build = dirname(dirname(self)); /* BUILD/bench/contrastive -> BUILD */
    snprintf(example, sizeof example, "%s/examples/contrastive", build);
    snprintf(launcher, sizeof launcher, "%s/bin/tandemrun", build);
    /* Throughput rows: tandem global and local with SyncBatchNorm, then with plain batch
     * norm (beside PyTorch's, which has no SyncBatchNorm on CPU). */
    enum { ROWS = 4 };
    static const char *const row_kind[ROWS] = {"global", "local", "global", "local"};
    static const int row_sync[ROWS] = {1, 1, 0, 0};
    double trained[2][MAX_RUNS], random[2][MAX_RUNS], rate[ROWS][MAX_RUNS], theirs[2][MAX_RUNS];
    double unused;
    char args[256];
    for (int r = 0; r < o.repeat; r++)
        for (int k = 0; k < ROWS; k++) {
            snprintf(args, sizeof args,
                     "--negatives %s --batch %d --epochs 1 --max-steps %d --probe-train 0%s",
                     row_kind[k], o.batch, o.rate_steps, row_sync[k] ? "" : " --no-sync-bn");
            if (run(&o, args, &unused, &unused, &rate[k][r])) return 1;
            if (k >= 2) theirs[k - 2][r] = o.torch ? run_torch(&o, row_kind[k]) : -1;
        }
    char extra[128] = "";
    if (o.max_steps) snprintf(extra, sizeof extra, " --max-steps %ld", o.max_steps);
    if (o.probe_train)
        snprintf(extra + strlen(extra), sizeof extra - strlen(extra), " --probe-train %ld",
                 o.probe_train);
    for (int s = 0; s < o.seeds; s++)
        for (int k = 0; k < 2; k++) {
            snprintf(args, sizeof args, "--negatives %s --batch %d --epochs %d --seed %d%s",
                     row_kind[k], o.batch, o.epochs, s + 1, extra);
            if (run(&o, args, &trained[k][s], &random[k][s], &unused)) return 1;
            fprintf(stderr, "seed %d, %s negatives: probe %.4f trained, %.4f random\n", s + 1,
                    row_kind[k], trained[k][s], random[k][s]);
        }
    char cpu[256], a[256], b[256];
    printf("\n%s\nexamples/contrastive, %d ranks, global batch %d, %d epochs",
           bench_cpu_name(cpu, sizeof cpu), o.world, o.batch, o.epochs);
    if (o.max_steps) printf(" of %ld steps", o.max_steps);
    printf(", probe on %ld training images, seeds 1..%d\n\n", o.probe_train ? o.probe_train : 60000,
           o.seeds);
    printf("| negatives | per anchor | probe, trained encoder | per seed | probe, random encoder | "
           "per seed |\n|---|---|---|---|---|---|\n");
    for (int k = 0; k < 2; k++) {
        list(a, sizeof a, trained[k], o.seeds, "%.4f");
        list(b, sizeof b, random[k], o.seeds, "%.4f");
        printf("| %s | %d | %.4f | %s | %.4f | %s |\n", row_kind[k],
               2 * (k == 0 ? o.batch : o.batch / o.world) - 2, median(trained[k], o.seeds), a,
               median(random[k], o.seeds), b);
    }
    printf("\nthroughput: %d steps, median of %d interleaved runs (images/s)\n\n"
           "| negatives | batch norm | tandem | pytorch | ratio |\n|---|---|---|---|---|\n",
           o.rate_steps, o.repeat);
    for (int k = 0; k < ROWS; k++) {
        double ours = median(rate[k], o.repeat), peer = -1;
        if (k >= 2) {
            int m = 0;
            double ok[MAX_RUNS];
            for (int r = 0; r < o.repeat; r++)
                if (theirs[k - 2][r] >= 0) ok[m++] = theirs[k - 2][r];
            if (m) peer = median(ok, m);
        }
        if (peer > 0)
            printf("| %s | %s | %.0f | %.0f | %.2f |\n", row_kind[k],
                   row_sync[k] ? "SyncBatchNorm" : "batch norm", ours, peer, ours / peer);
        else
            printf("| %s | %s | %.0f | - | - |\n", row_kind[k],
                   row_sync[k] ? "SyncBatchNorm" : "batch norm", ours);
    }
    return 0;
}
