/* End to end through the real programs: examples/mnist trains on the real Fashion-MNIST
 * files, alone and under tandemrun with DDP over shared memory. Checks accuracy, bitwise
 * resume from a checkpoint (f32, O1, O2 in f16, O3 in bf16), N-rank DDP == one process on the
 * same global batch, the trace's overlap of all-reduce and backward, and the refusal of a
 * corrupt checkpoint.
 * Mixed precision in bf16 (O1, O2) stays within half a point of f32's accuracy; the pipeline
 * mode of the example runs (2 stages, and 2 stages x 2 replicas). Deterministic mode: 200 steps
 * of the CNN with dropout at world sizes 1, 2 and 4 give one parameter digest (another seed
 * another, the default mode another per world size; O1 one of its own at worlds 1 and 2), and
 * so do one rank on 2 OpenMP threads and 1, 2 and 4 ranks on one (the CNN, and the MLP in shards
 * of 16 with blocked weights); a 2-rank run cut with
 * --stop-at-step resumes at world sizes 1 and 4 to the uninterrupted run's bytes under the
 * cosine schedule, and a resume under another schedule warns; a rank killed at a random moment
 * under tandemrun --max-restarts ends, after the restart resumes from the last checkpoint, with
 * the undisturbed run's parameters. TD_LONG=1 (make check-long)
 * adds the CNN's 90% within three epochs and its O1/O2 runs, the ResNet's 90% with 1F1B on 2
 * stages, and 20 kill trials. Tests that cross epochs train on the first few hundred or thousand
 * training images (--data), for epochs of a few steps. */
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tandem/tandem.h"

#include "test.h"
#include "test_program.h" /* run, field, checkpoint_difference */

static char example[PATH_MAX], launcher[PATH_MAX], dir[64];
/* Fashion-MNIST with the first 3200 / 768 / 320 / 640 training images: epochs of 25 or 6
 * steps of 128, 20 or 40 of 16, for the tests that train across epochs. */
static char set_25x128[128], set_6x128[128], set_20x16[128], set_40x16[128];
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

/* Trains `args` for two epochs straight, and for `half` (one epoch, or --max-steps inside one)
 * then on to the end of the second from its checkpoint: the two final checkpoints must be the
 * same bytes, and differ from the halfway one. */
static void resume_is_bitwise(const char *args, const char *half) {
    CHECK_EQ(run("%s %s --epochs 2 --checkpoint %s/straight.st", example, args, dir), 0);
    CHECK_EQ(run("%s %s %s --checkpoint %s/half.st", example, args, half, dir), 0);
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
    CHECK(na > 0 && na == nb && nh > 0);
    if (na > 0 && na == nb && nh > 0) {
        if (memcmp(a, b, (size_t)na) != 0) TEST_FAIL_AT("resumed run differs: %s", args);
        /* the second epoch did change something (the metadata's length may change too) */
        CHECK(nh != na || memcmp(a, h, (size_t)na) != 0);
    }
    free(a);
    free(b);
    free(h);
}

static void resume_continues_bit_for_bit(void) {
    char args[256];
    /* The Net has dropout, so this also checks that the RNG state travels. */
    snprintf(args, sizeof args, "--model net --no-eval --data %s", set_25x128);
    resume_is_bitwise(args, "--epochs 1");
    /* stopped by --max-steps 7 steps into the second epoch */
    resume_is_bitwise(args, "--epochs 2 --max-steps 32");
    /* Mixed precision: f16 weights with f32 masters in the optimizer, and a dynamic loss scale
     * whose growth counter is half way to nothing after one epoch: a resume that lost either
     * writes a different final checkpoint. */
    snprintf(args, sizeof args, "--model net --no-eval --amp O2 --amp-dtype f16 --data %s",
             set_25x128);
    resume_is_bitwise(args, "--epochs 1");
    /* (a constant lr: the cosine schedule spans the run, which the halves differ in) */
    snprintf(args, sizeof args, "--model cnn --no-eval --constant-lr --amp O1 --data %s",
             set_6x128);
    resume_is_bitwise(args, "--epochs 1");
    /* O3: bf16 weights (batch norm's too) and bf16 momentum, no master weights, saved and loaded
     * in bf16. */
    snprintf(args, sizeof args, "--model cnn --no-eval --constant-lr --amp O3 --data %s",
             set_6x128);
    resume_is_bitwise(args, "--epochs 1");
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

/* ---- deterministic mode -------------------------------------------------------------- */

/* The CNN (batch norm) with dropout before its classifier, SGD with momentum, global batch 16 in
 * 8 shards of 2: small enough for 200 steps in a few seconds. */
static const char det_args[] =
    "--model cnn --dropout 0.25 --deterministic --batch 16 --shards 8 --no-eval";

/* The params_sha256 of the last run's final line, or "" (the case fails). */
static void digest_of_run(char out[65]) {
    const char *at = strstr(output, "params_sha256 ");
    out[0] = 0;
    if (at) sscanf(at + 14, "%64[0-9a-f]", out);
    CHECK(strlen(out) == 64);
}

/* `world` ranks (1: no launcher) of the example with args, each on `threads` OpenMP threads (0:
 * as this process has it); its digest in out. */
static void det_run_on(int threads, int world, const char *args, char out[65]) {
    char env[32] = "";
    if (threads > 0) snprintf(env, sizeof env, "OMP_NUM_THREADS=%d ", threads);
    if (world == 1)
        CHECK_EQ(run("%s%s %s", env, example, args), 0);
    else
        CHECK_EQ(run("%s%s --nproc-per-node %d %s %s", env, launcher, world, example, args), 0);
    digest_of_run(out);
}

static void det_run(int world, const char *args, char out[65]) { det_run_on(0, world, args, out); }

static void deterministic_same_bits_at_world_1_2_4(void) {
    char args[512], d[4][65];
    snprintf(args, sizeof args, "%s --epochs 1 --max-steps 200", det_args);
    int worlds[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        det_run(worlds[i], args, d[i]);
        printf("    world %d, 200 steps: params sha256 %s\n", worlds[i], d[i]);
    }
    CHECK(!strcmp(d[0], d[1]));
    CHECK(!strcmp(d[0], d[2]));
    snprintf(args, sizeof args, "%s --epochs 1 --max-steps 200 --seed 2", det_args);
    det_run(2, args, d[3]);
    printf("    seed 2, world 2:    params sha256 %s\n", d[3]);
    CHECK(strcmp(d[0], d[3]) != 0);
    /* Mixed precision O1 (bf16 convolutions on f32 weights and gradients) keeps the guarantee. */
    char o1[2][65];
    snprintf(args, sizeof args, "%s --epochs 1 --max-steps 20 --amp O1", det_args);
    det_run(1, args, o1[0]);
    det_run(2, args, o1[1]);
    CHECK(!strcmp(o1[0], o1[1]));
    CHECK(strcmp(o1[0], d[0]) != 0);
    /* Without --deterministic the same runs differ by world size: the check above can fail. */
    char a[65], b[65];
    det_run(1, "--model cnn --dropout 0.25 --batch 16 --no-eval --epochs 1 --max-steps 20", a);
    det_run(2, "--model cnn --dropout 0.25 --batch 16 --no-eval --epochs 1 --max-steps 20", b);
    CHECK(strcmp(a, b) != 0);
}

/* No thread count enters a sum: one rank on 2 OpenMP threads and on 1, and 2 and 4 ranks on one
 * thread each, train `args` to the same bits. */
static void same_bits_at_any_thread_count(const char *model, const char *args, char d[4][65]) {
    const int threads[4] = {2, 1, 1, 1}, worlds[4] = {1, 1, 2, 4};
    for (int i = 0; i < 4; i++) {
        det_run_on(threads[i], worlds[i], args, d[i]);
        printf("    %s, world %d, %d thread(s) per rank: params sha256 %s\n", model, worlds[i],
               threads[i], d[i]);
    }
    for (int i = 1; i < 4; i++)
        if (strcmp(d[0], d[i]) != 0)
            TEST_FAIL_AT("%s: world %d on %d thread(s) per rank differs from world 1 on 2 threads",
                         model, worlds[i], threads[i]);
}

/* The CNN (convolutions' weight gradients and batch norm's statistics, which oneDNN splits over
 * its threads) for 20 steps, and the MLP in shards of 16 (blocked linear weights, kept across a
 * step's shards) for 10; under ZeRO stage 3 too, whose parameter-use hook frees and gathers the
 * weights the kept copies were made from. */
static void deterministic_same_bits_at_any_thread_count(void) {
    char args[512], d[4][65], z[65];
    snprintf(args, sizeof args, "%s --epochs 1 --max-steps 20", det_args);
    same_bits_at_any_thread_count("cnn", args, d);
    const char *mlp = "--model mlp --deterministic --batch 128 --shards 8 --no-eval --epochs 1 "
                      "--max-steps 10";
    same_bits_at_any_thread_count("mlp", mlp, d);
    snprintf(args, sizeof args, "%s --zero 3", mlp);
    det_run_on(2, 2, args, z);
    printf("    mlp, world 2, 2 threads per rank, --zero 3: params sha256 %s\n", z);
    if (strcmp(d[0], z) != 0) TEST_FAIL_AT("mlp: --zero 3 differs from deterministic DDP");
}

static int same_file(const char *pa, const char *pb) {
    char *a = NULL, *b = NULL;
    long na = file_bytes(pa, &a), nb = file_bytes(pb, &b);
    int same = na > 0 && na == nb && memcmp(a, b, (size_t)na) == 0;
    free(a);
    free(b);
    return same;
}

/* The resume recipe of docs/reproducibility.md under the cosine schedule: two epochs at world 2,
 * and the same run stopped 7 steps into its second epoch (--stop-at-step, the schedule left as
 * it is) and resumed at world 1 and 4: the same checkpoint bytes (parameters, buffers, momentum,
 * metadata). Cutting the run with --epochs 1 instead moves the cosine's horizon: the resume says
 * so loudly, and ends elsewhere. A checkpoint of other shards or another global batch is refused
 * by name. */
static void deterministic_resume_at_another_world_size(void) {
    char args[512], p[5][160];
    snprintf(args, sizeof args, "%s --data %s --epochs 2", det_args, set_20x16);
    CHECK_EQ(run("%s --nproc-per-node 2 %s %s --checkpoint %s/det_straight.st", launcher, example,
                 args, dir),
             0);
    CHECK_EQ(run("%s --nproc-per-node 2 %s %s --stop-at-step 27 --checkpoint %s/det_half.st",
                 launcher, example, args, dir),
             0);
    CHECK(strstr(output, "steps 27 ") != NULL);
    snprintf(p[0], sizeof p[0], "%s/det_straight.st", dir);
    int worlds[2] = {1, 4};
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(run("%s --nproc-per-node %d %s %s --resume %s/det_half.st --checkpoint "
                     "%s/det_w%d.st",
                     launcher, worlds[i], example, args, dir, dir, worlds[i]),
                 0);
        CHECK(strstr(output, "resuming from") != NULL);
        CHECK(strstr(output, "WARNING") == NULL);
        snprintf(p[1 + i], sizeof p[1 + i], "%s/det_w%d.st", dir, worlds[i]);
        if (!same_file(p[0], p[1 + i]))
            TEST_FAIL_AT("resumed at world %d: the checkpoint differs from the straight run's",
                         worlds[i]);
    }
    snprintf(p[3], sizeof p[3], "%s/det_half.st", dir);
    CHECK(!same_file(p[0], p[3]));
    /* the recipe before --stop-at-step: a first part of --epochs 1 anneals over 20 steps */
    CHECK_EQ(run("%s --nproc-per-node 2 %s %s --epochs 1 --checkpoint %s/det_one.st", launcher,
                 example, args, dir),
             0);
    CHECK_EQ(run("%s --nproc-per-node 2 %s %s --resume %s/det_one.st --checkpoint %s/det_two.st",
                 launcher, example, args, dir, dir),
             0);
    CHECK(strstr(output, "WARNING: ") != NULL);
    CHECK(strstr(output, "cosine from 0.01 over 20 steps; this run's is cosine from 0.01 over 40 "
                         "steps") != NULL);
    snprintf(p[4], sizeof p[4], "%s/det_two.st", dir);
    CHECK(!same_file(p[0], p[4]));
    CHECK_EQ(run("%s --model cnn --dropout 0.25 --deterministic --batch 16 --shards 4 --no-eval "
                 "--data %s --epochs 2 --resume %s/det_half.st",
                 example, set_20x16, dir),
             1);
    CHECK(strstr(output, "--batch 16 --deterministic --shards 8, this run has --batch 16 "
                         "--deterministic --shards 4") != NULL);
}

/* Bad combinations say what is wrong: a batch the shards do not divide, a world size that does
 * not split them into a power of two per rank, mixed precision. */
static void deterministic_refuses_what_it_cannot_do(void) {
    CHECK_EQ(run("%s --deterministic --batch 100 --shards 8 --epochs 1", example), 2);
    CHECK(strstr(output, "--batch 100 is not a multiple of --shards 8") != NULL);
    CHECK_EQ(run("%s --nproc-per-node 3 %s --model mlp --deterministic --batch 24 --shards 8 "
                 "--epochs 1 --max-steps 1 --no-eval",
                 launcher, example),
             1);
    CHECK(strstr(output, "8 shards at world size 3") != NULL);
    CHECK_EQ(run("%s --deterministic --amp O2 --epochs 1", example), 2);
    CHECK(strstr(output, "takes --amp O0 or O1") != NULL);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void test_sleep(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Kill -9 of a random rank at a random moment under --max-restarts 3: the job finishes, the
 * restart resumes from the last checkpoint (at the same world size, or with the ranks left), and
 * the final parameters are the undisturbed run's. Nothing is left in /dev/shm. */
static void restarts_after_a_killed_rank_end_on_the_same_bits(void) {
    int trials = getenv("TD_LONG") ? 20 : 3;
    char args[512], want[65], got[65];
    snprintf(args, sizeof args, "%s --epochs 2 --data %s --checkpoint-every 8", det_args,
             set_40x16);
    double t_start = now_s();
    det_run(2, args, want);
    /* The kill moments scale with how long an undisturbed run takes on this machine now, so a
     * loaded machine does not turn every trial into a kill after the job ended. */
    double run_s = now_s() - t_start;
    td_rng rng;
    td_rng_init(&rng, (uint64_t)time(NULL));
    int resumed = 0;
    for (int k = 0; k < trials; k++) {
        char ck[160], log[160];
        snprintf(ck, sizeof ck, "%s/kill%d.st", dir, k);
        snprintf(log, sizeof log, "%s/kill%d.log", dir, k);
        /* Every third trial restarts with the ranks that are left (2 -> 1). */
        const char *restart_world = k % 3 == 2 ? "left" : "2";
        char cmd[3 * PATH_MAX];
        snprintf(cmd, sizeof cmd,
                 "%s --max-restarts 3 --restart-nproc-per-node %s "
                 "--nproc-per-node 2 %s %s --checkpoint %s --resume auto",
                 launcher, restart_world, example, args, ck);
        char *argv[32];
        int argc = 0;
        for (char *save = NULL, *w = strtok_r(cmd, " ", &save); w && argc < 31;
             w = strtok_r(NULL, " ", &save))
            argv[argc++] = w;
        argv[argc] = NULL;
        pid_t pid = fork();
        if (pid == 0) {
            int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            dup2(fd, 1);
            dup2(fd, 2);
            execv(argv[0], argv);
            _exit(127);
        }
        /* A random rank (a child of the launcher) at a random moment: two trials in three
         * within the first 70% of what is left of the run after its first checkpoint, the third
         * within the first 90% of the run from the start (loading the data included). */
        int victim = (int)td_rng_below(&rng, 2);
        double t0 = now_s();
        for (int w = 0; k % 3 != 1 && access(ck, F_OK) != 0 && w < 30000; w += 10) test_sleep(10);
        double waited = now_s() - t0, left_s = run_s - waited;
        int span_ms = (int)(1000 * (k % 3 == 1 ? 0.9 * run_s : 0.7 * left_s));
        int ms = (int)td_rng_below(&rng, (uint32_t)(span_ms > 50 ? span_ms : 50));
        test_sleep(ms);
        pid_t ranks[8];
        int killed = children_of(pid, ranks, 8) == 2 && kill(ranks[victim], SIGKILL) == 0;
        int status = 0;
        waitpid(pid, &status, 0);
        char *text = NULL;
        long n = file_bytes(log, &text);
        if (n > 0) {
            text = realloc(text, (size_t)n + 1);
            text[n] = 0;
            size_t keep = (size_t)n < sizeof output - 1 ? (size_t)n : sizeof output - 1;
            memcpy(output, text + n - (long)keep, keep);
            output[keep] = 0;
        }
        digest_of_run(got);
        /* The restart resumes from the last checkpoint the killed start wrote. */
        const char *restart = text ? strstr(text, "restart 1 of 3") : NULL;
        const char *resume_at = restart ? strstr(restart, "resuming from") : NULL;
        long step = resume_at ? atol(strstr(resume_at, "step ") + 5) : -1, last = -1;
        for (const char *c = text;
             c && (c = strstr(c, "checkpoint at step ")) && (!restart || c < restart); c++)
            last = atol(c + 19);
        printf("    trial %2d: killed rank %d %.1f s after %s%s; %s %ld; final %.12s...\n", k,
               victim, ms / 1000.0, k % 3 != 1 ? "the first checkpoint" : "the start",
               killed ? "" : " (it had finished)",
               resume_at ? "resumed at step" : "restarted from step", resume_at ? step : 0, got);
        resumed += resume_at != NULL;
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (killed) CHECK(restart != NULL);
        /* From the last checkpoint announced (-1: none yet, a fresh start), or the next one when
         * the job was stopped after its rename and before rank 0 announced it: the save makes
         * the rename durable (fsync of the directory) before the example prints. */
        long next = last < 0 ? 8 : last + 8;
        if (restart && step != last && step != next)
            TEST_FAIL_AT("trial %d resumed at step %ld, after the last checkpoint (%ld) announced",
                         k, step, last);
        if (strcmp(got, want) != 0) TEST_FAIL_AT("trial %d ended on other parameters", k);
        free(text);
    }
    CHECK(resumed >= 1);
    /* the shm backend names nothing in /dev/shm; any tandem-* file there is a leak */
    DIR *shm = opendir("/dev/shm");
    struct dirent *e;
    while (shm && (e = readdir(shm)))
        if (!strncmp(e->d_name, "tandem-", 7)) TEST_FAIL_AT("left in /dev/shm: %s", e->d_name);
    if (shm) closedir(shm);
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
    if (program_test_start(argv[0], "mnist", "training", example, launcher, dir, NULL)) return 1;
    snprintf(set_25x128, sizeof set_25x128, "%s/25x128", dir);
    snprintf(set_6x128, sizeof set_6x128, "%s/6x128", dir);
    snprintf(set_20x16, sizeof set_20x16, "%s/20x16", dir);
    snprintf(set_40x16, sizeof set_40x16, "%s/40x16", dir);
    if (fashion_mnist_subset(set_25x128, 3200) || fashion_mnist_subset(set_6x128, 768) ||
        fashion_mnist_subset(set_20x16, 320) || fashion_mnist_subset(set_40x16, 640))
        return 1;
    RUN(mlp_reaches_85_percent_in_one_epoch);
    RUN(mlp_in_bf16_within_half_a_point_after_one_epoch);
    RUN(resume_continues_bit_for_bit);
    RUN(ddp_equals_one_process_on_the_global_batch);
    RUN(trace_shows_allreduce_during_backward);
    RUN(corrupt_checkpoint_is_refused_by_name);
    RUN(pipeline_example_runs_under_tandemrun);
    RUN(deterministic_same_bits_at_world_1_2_4);
    RUN(deterministic_same_bits_at_any_thread_count);
    RUN(deterministic_resume_at_another_world_size);
    RUN(deterministic_refuses_what_it_cannot_do);
    RUN(restarts_after_a_killed_rank_end_on_the_same_bits);
    RUN(cnn_reaches_90_percent_in_three_epochs);
    RUN(resnet_1f1b_on_two_stages_reaches_90_percent_in_three_epochs);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) return 1;
    TEST_END();
}
