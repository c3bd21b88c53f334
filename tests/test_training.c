/* End to end through the real programs: examples/mnist trains on the real Fashion-MNIST
 * files, alone and under tandemrun with DDP over shared memory. Checks accuracy, bitwise
 * resume from a checkpoint, N-rank DDP == one process on the same global batch, the trace's
 * overlap of all-reduce and backward, and the refusal of a corrupt checkpoint.
 * Mixed precision in bf16 (O1, O2) stays within half a point of f32's accuracy; the pipeline
 * mode of the example runs (2 stages, and 2 stages x 2 replicas). TD_LONG=1 (make check-long)
 * adds the CNN's 90% within three epochs and its O1/O2 runs, and the ResNet's 90% with 1F1B on
 * 2 stages. */
#include <libgen.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tandem/tandem.h"

#include "test.h"
#include "test_checkpoint_diff.h"

static char example[PATH_MAX], launcher[PATH_MAX], dir[64];
static char output[1 << 16];

/* Runs a shell command, keeping its output in `output`; returns its exit status. */
static int run(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int run(const char *fmt, ...) {
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    strcat(cmd, " 2>&1");
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(output, 1, sizeof output - 1, p);
    output[n] = 0;
    int status = pclose(p);
    if (!WIFEXITED(status) || WEXITSTATUS(status)) fprintf(stderr, "$ %s\n%s\n", cmd, output);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

static double field(const char *name) {
    const char *at = strstr(output, name);
    return at ? atof(at + strlen(name)) : -1;
}

static double mlp_f32_accuracy = -1;

static void mlp_reaches_85_percent_in_one_epoch(void) {
    CHECK_EQ(run("%s --model mlp --epochs 1", example), 0);
    mlp_f32_accuracy = field("test_accuracy ");
    printf("    mlp, 1 epoch: test accuracy %.4f\n", mlp_f32_accuracy);
    CHECK(mlp_f32_accuracy >= 0.85);
}

/* Mixed precision in bf16 loses at most half a point of test accuracy against f32 with the
 * same defaults: `prefix` runs the example, `f32` is its f32 accuracy. */
static void amp_within_half_a_point(const char *prefix, const char *model, double f32) {
    static const char *const levels[] = {"O1", "O2"};
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(run("%s --amp %s", prefix, levels[i]), 0);
        double accuracy = field("test_accuracy ");
        printf("    %s %s bf16: test accuracy %.4f (f32 %.4f)\n", model, levels[i], accuracy, f32);
        CHECK(accuracy >= f32 - 0.005);
    }
}

static void mlp_in_bf16_within_half_a_point_after_one_epoch(void) {
    char prefix[PATH_MAX + 64];
    snprintf(prefix, sizeof prefix, "%s --model mlp --epochs 1", example);
    amp_within_half_a_point(prefix, "mlp", mlp_f32_accuracy);
}

static void cnn_reaches_90_percent_in_three_epochs(void) {
    if (!getenv("TD_LONG")) return;
    char prefix[2 * PATH_MAX + 64];
    snprintf(prefix, sizeof prefix, "%s --nproc-per-node 2 %s --model cnn --epochs 3", launcher,
             example);
    CHECK_EQ(run("%s", prefix), 0);
    double accuracy = field("test_accuracy ");
    printf("    cnn, 3 epochs, 2 ranks: test accuracy %.4f\n", accuracy);
    CHECK(accuracy >= 0.90);
    amp_within_half_a_point(prefix, "cnn", accuracy);
}

static void resnet_1f1b_on_two_stages_reaches_90_percent_in_three_epochs(void) {
    if (!getenv("TD_LONG")) return;
    CHECK_EQ(run("%s --nproc-per-node 2 %s --model resnet --pipeline 1f1b --stages 2 "
                 "--micro-batches 4 --epochs 3",
                 launcher, example),
             0);
    double accuracy = field("test_accuracy ");
    printf("    resnet, 3 epochs, 1F1B on 2 stages: test accuracy %.4f\n", accuracy);
    CHECK(accuracy >= 0.90);
}

/* The example's pipeline mode end to end: 2 stages alone and 2 stages x 2 replicas. */
static void pipeline_example_runs_under_tandemrun(void) {
    CHECK_EQ(run("%s --nproc-per-node 2 %s --model resnet --pipeline gpipe --stages 2 "
                 "--micro-batches 2 --epochs 1 --max-steps 3 --no-eval",
                 launcher, example),
             0);
    CHECK(strstr(output, "pipeline gpipe stages 2 micro_batches 2") != NULL);
    CHECK_EQ(run("%s --nproc-per-node 4 %s --model mlp --pipeline 1f1b --stages 2 "
                 "--micro-batches 4 --epochs 1 --max-steps 20 --split fc2",
                 launcher, example),
             0);
    double accuracy = field("test_accuracy ");
    printf("    mlp, 20 steps, 1F1B 2 stages x 2 replicas: test accuracy %.4f\n", accuracy);
    CHECK(accuracy > 0.5);
    CHECK_EQ(run("%s --model mlp --pipeline 1f1b --stages 2 --epochs 1", example), 2);
    CHECK(strstr(output, "needs 2 ranks") != NULL);
}

static long file_bytes(const char *path, char **data) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    *data = malloc((size_t)n);
    if (fread(*data, 1, (size_t)n, f) != (size_t)n) n = -1;
    fclose(f);
    return n;
}

/* Trains `args` for two epochs straight, and for one epoch then one more from its checkpoint:
 * the two final checkpoints must be the same bytes, and differ from the halfway one. */
static void resume_is_bitwise(const char *args) {
    CHECK_EQ(run("%s %s --epochs 2 --checkpoint %s/straight.st", example, args, dir), 0);
    CHECK_EQ(run("%s %s --epochs 1 --checkpoint %s/half.st", example, args, dir), 0);
    CHECK_EQ(run("%s %s --epochs 2 --resume %s/half.st --checkpoint %s/resumed.st", example, args,
                 dir, dir),
             0);
    char path[128], *a = NULL, *b = NULL, *h = NULL;
    snprintf(path, sizeof path, "%s/straight.st", dir);
    long na = file_bytes(path, &a);
    snprintf(path, sizeof path, "%s/resumed.st", dir);
    long nb = file_bytes(path, &b);
    snprintf(path, sizeof path, "%s/half.st", dir);
    long nh = file_bytes(path, &h);
    CHECK(na > 0 && na == nb && nh == na);
    if (na > 0 && na == nb && nh == na) {
        if (memcmp(a, b, (size_t)na) != 0) TEST_FAIL_AT("resumed run differs: %s", args);
        CHECK(memcmp(a, h, (size_t)na) != 0); /* the second epoch did change something */
    }
    free(a);
    free(b);
    free(h);
}

static void resume_continues_bit_for_bit(void) {
    /* The Net has dropout, so this also checks that the RNG state travels. */
    resume_is_bitwise("--model net --max-steps 25 --no-eval");
    /* Mixed precision: f16 weights with f32 masters in the optimizer, and a dynamic loss scale
     * whose growth counter is half way to nothing after one epoch: a resume that lost either
     * writes a different final checkpoint. */
    resume_is_bitwise("--model net --max-steps 25 --no-eval --amp O2 --amp-dtype f16");
    /* (a constant lr: the cosine schedule spans --epochs, which the halves differ in) */
    resume_is_bitwise("--model cnn --max-steps 6 --no-eval --constant-lr --amp O1");
}

static void ddp_equals_one_process_on_the_global_batch(void) {
    const char *args = "--model mlp --epochs 1 --max-steps 4 --no-eval";
    CHECK_EQ(run("%s %s --checkpoint %s/w1.st", example, args, dir), 0);
    /* 3 does not divide the batch of 128: slices of 43, 43 and 42, weighted by size. */
    int worlds[] = {2, 3, 4};
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(run("%s --nproc-per-node %d %s %s --checkpoint %s/w%d.st", launcher, worlds[i],
                     example, args, dir, worlds[i]),
                 0);
        char pa[128], pb[128];
        snprintf(pa, sizeof pa, "%s/w1.st", dir);
        snprintf(pb, sizeof pb, "%s/w%d.st", dir, worlds[i]);
        double diff = checkpoint_difference(pa, pb);
        printf("    world %d vs 1: largest relative difference %.2e\n", worlds[i], diff);
        CHECK(diff <= 1e-5);
    }
}

static void trace_shows_allreduce_during_backward(void) {
    CHECK_EQ(run("%s --nproc-per-node 2 %s --model cnn --epochs 1 --max-steps 3 --no-eval "
                 "--bucket-kb 64 --trace %s/trace",
                 launcher, example, dir),
             0);
    char path[128], *json = NULL;
    snprintf(path, sizeof path, "%s/trace.rank0.json", dir);
    long n = file_bytes(path, &json);
    CHECK(n > 0);
    if (n <= 0) return;
    json = realloc(json, (size_t)n + 1);
    json[n] = 0;
    /* Spans are {"name": ..., "cat": ..., "ph": "X", "ts": us, "dur": us, ...}, in any order. */
    double bw_start[16], bw_end[16], ar_start[256];
    int n_bw = 0, n_ar = 0, overlapping = 0;
    for (char *at = json; (at = strstr(at, "\"name\":")); at++) {
        char name[64] = "";
        sscanf(at, "\"name\": \"%63[^\"]", name);
        char *ts = strstr(at, "\"ts\":"), *dur = strstr(at, "\"dur\":");
        if (!ts || !dur) break;
        double t0 = atof(ts + 5), d = atof(dur + 6);
        if (!strcmp(name, "backward") && n_bw < 16) {
            bw_start[n_bw] = t0;
            bw_end[n_bw++] = t0 + d;
        } else if (strstr(name, "allreduce") && n_ar < 256) {
            ar_start[n_ar++] = t0;
        }
    }
    for (int a = 0; a < n_ar; a++)
        for (int b = 0; b < n_bw; b++)
            if (ar_start[a] >= bw_start[b] && ar_start[a] < bw_end[b]) overlapping++;
    printf("    %d backward spans, %d bucket all-reduces started inside one\n", n_bw, overlapping);
    CHECK(n_bw == 3);
    CHECK(overlapping >= 1);
    free(json);
}

static void corrupt_checkpoint_is_refused_by_name(void) {
    char path[128];
    snprintf(path, sizeof path, "%s/corrupt.st", dir);
    /* A header that promises 64 bytes of JSON and stops in the middle of it. */
    static const char bytes[] = "\x40\0\0\0\0\0\0\0{\"w\": {\"dtype\": \"F32\", \"shape\": [9";
    FILE *f = fopen(path, "wb");
    fwrite(bytes, 1, sizeof bytes - 1, f);
    fclose(f);
    CHECK_EQ(run("%s --model mlp --epochs 1 --resume %s", example, path), 1);
    CHECK(strstr(output, path) != NULL);
}

int main(int argc, char **argv) {
    (void)argc;
    char self[PATH_MAX];
    if (!realpath(argv[0], self)) return 1;
    char *bin = dirname(dirname(self)); /* BUILD/tests/x -> BUILD */
    snprintf(example, sizeof example, "%s/examples/mnist", bin);
    snprintf(launcher, sizeof launcher, "%s/bin/tandemrun", bin);
    snprintf(dir, sizeof dir, "/tmp/tandem-training-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    RUN(mlp_reaches_85_percent_in_one_epoch);
    RUN(mlp_in_bf16_within_half_a_point_after_one_epoch);
    RUN(resume_continues_bit_for_bit);
    RUN(ddp_equals_one_process_on_the_global_batch);
    RUN(trace_shows_allreduce_during_backward);
    RUN(corrupt_checkpoint_is_refused_by_name);
    RUN(pipeline_example_runs_under_tandemrun);
    RUN(cnn_reaches_90_percent_in_three_epochs);
    RUN(resnet_1f1b_on_two_stages_reaches_90_percent_in_three_epochs);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) return 1;
    TEST_END();
}
