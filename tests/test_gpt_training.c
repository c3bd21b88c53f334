/* examples/gpt end to end on a small text the test writes (so it needs no package) and a small
 * GPT: data parallelism at worlds 2 and 4 ends where one process on the global batch does
 * (<= 1e-5 relative, every parameter), the deterministic mode gives the same parameter bits at
 * worlds 1, 2 and 4 and on 2 OpenMP threads, a run stopped and resumed from its checkpoint ends
 * on the same bits as one that was not, a 2-stage 1F1B pipeline (with and without replicas) ends on
 * one process's losses, mixed precision trains, and --zero 1, 2 and 3 end where DDP does (stage 3's
 * sharded checkpoint resumed at world 4 continuing as the uninterrupted run; deterministic, DDP's
 * bits); DDP and every stage print one process's train loss. The few-minute run on Jane Austen
 * is docs/gpt.md's. */
#include <limits.h>
#include <sys/stat.h>

#include "test.h"
#include "test_program.h" /* run, field, printed_sha256, checkpoint_distance */

static char example[PATH_MAX], launcher[PATH_MAX], dir[64], text[128];
static double one_loss; /* one process's train loss of the last step, as it printed it */

/* The last run printed, as its final train loss, one process's (to the 4 digits of a step's
 * line: it used to be the step before's under DDP and ZeRO stage 1). */
static void train_loss_is_one_processs(const char *way) {
    double loss = field("final: train loss ");
    printf("    %s: final train loss %.6f, one process %.6f\n", way, loss, one_loss);
    if (!(fabs(loss - one_loss) <= 1e-4))
        TEST_FAIL_AT("%s: final train loss %.6f, one process's %.6f", way, loss, one_loss);
}

#define TINY                                                                       \
    "--layers 2 --heads 2 --width 32 --context 32 --batch 8 --steps 4 --warmup 2 " \
    "--eval-every 0 --eval-batches 1 --sample 20"

static void ddp_at_worlds_2_and_4_equals_one_process(void) {
    CHECK_EQ(
        run("OMP_NUM_THREADS=1 %s --data %s " TINY " --checkpoint %s/w1.st", example, text, dir),
        0);
    CHECK(strstr(output, "sample:") != NULL);
    one_loss = field("final: train loss ");
    CHECK(one_loss > 0);
    int worlds[] = {2, 4};
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node %d %s --ddp --data %s " TINY
                     " --checkpoint %s/w%d.st",
                     launcher, worlds[i], example, text, dir, worlds[i]),
                 0);
        train_loss_is_one_processs(worlds[i] == 2 ? "--ddp at world 2" : "--ddp at world 4");
        char pa[128], pb[128];
        snprintf(pa, sizeof pa, "%s/w1.st", dir);
        snprintf(pb, sizeof pb, "%s/w%d.st", dir, worlds[i]);
        /* the whole model's relative distance: the key part of each c_attn.bias has a gradient
         * of exactly 0 in exact arithmetic (softmax ignores what adds to every score of a row),
         * so its float noise is all AdamW normalises, and that tensor alone drifts (~3e-5) */
        double worst;
        char name[96];
        double diff = checkpoint_distance(pa, pb, &worst, name, sizeof name);
        printf("    world %d vs 1: relative distance %.2e (worst tensor %s %.2e)\n", worlds[i],
               diff, name, worst);
        CHECK(diff <= 1e-5);
    }
}

static void deterministic_same_bits_at_world_1_2_4(void) {
    char want[65], got[65];
    CHECK_EQ(
        run("OMP_NUM_THREADS=1 %s --data %s " TINY " --deterministic --shards 4", example, text),
        0);
    printed_sha256(want);
    CHECK(strlen(want) == 64);
    /* one rank of 2 OpenMP threads: no thread count enters a sum */
    CHECK_EQ(
        run("OMP_NUM_THREADS=2 %s --data %s " TINY " --deterministic --shards 4", example, text),
        0);
    printed_sha256(got);
    if (strcmp(want, got)) TEST_FAIL_AT("2 threads: %s, 1 thread: %s", got, want);
    for (int w = 2; w <= 4; w += 2) {
        CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node %d %s --data %s " TINY
                     " --deterministic --shards 4",
                     launcher, w, example, text),
                 0);
        printed_sha256(got);
        if (strcmp(want, got)) TEST_FAIL_AT("world %d: %s, world 1: %s", w, got, want);
    }
    printf("    params_sha256 %.16s... at worlds 1, 2 and 4, and on 2 threads\n", want);
}

static void resume_continues_bit_for_bit(void) {
    char want[65], got[65];
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --data %s " TINY, example, text), 0);
    printed_sha256(want);
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --data %s " TINY " --checkpoint %s/r.st --stop-at-step 2",
                 example, text, dir),
             0);
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --data %s " TINY " --checkpoint %s/r.st --resume auto",
                 example, text, dir),
             0);
    CHECK(strstr(output, "resuming from") != NULL);
    printed_sha256(got);
    if (strcmp(want, got)) TEST_FAIL_AT("resumed %s, straight through %s", got, want);
    /* a checkpoint of another model shape is refused, naming both */
    CHECK_EQ(run("%s --data %s " TINY " --width 64 --resume %s/r.st", example, text, dir), 1);
    CHECK(strstr(output, "width 32") && strstr(output, "width 64"));
}

/* A 2-stage 1F1B pipeline (the embedding on one rank, the head with its copy of the tied
 * embedding on the other), alone and as 2 stages x 2 replicas, ends on one process's train and
 * validation loss (the GPT's parameters themselves are compared in test_pipeline_tied). */
static void pipeline_equals_one_process(void) {
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --data %s " TINY, example, text), 0);
    double train = field("final: train loss "), val = field(", val loss ");
    CHECK(train > 0 && val > 0);
    int worlds[] = {2, 4};
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node %d %s --data %s " TINY
                     " --pipeline 1f1b --micro-batches 2 --split h.1",
                     launcher, worlds[i], example, text),
                 0);
        CHECK(strstr(output, "pipeline 1f1b: 2 stage(s)") != NULL);
        CHECK(strstr(output, "sample:") != NULL);
        double ptrain = field("final: train loss "), pval = field(", val loss ");
        printf("    world %d: train loss %.6f, val loss %.6f (one process %.6f, %.6f)\n", worlds[i],
               ptrain, pval, train, val);
        CHECK_NEAR(ptrain, train, 1e-5 * train);
        CHECK_NEAR(pval, val, 1e-5 * val);
    }
    CHECK_EQ(run("%s --data %s --pipeline 1f1b --zero 2", example, text), 2);
    CHECK(strstr(output, "--pipeline") && strstr(output, "--zero"));
}

static void amp_and_device(void) {
    CHECK_EQ(run("%s --data %s " TINY " --amp", example, text), 0);
    CHECK(strstr(output, "amp bf16") != NULL);
    double loss = field("final: train loss ");
    CHECK(loss > 0 && loss < 6);
    /* --device cuda trains on a GPU where one can be used; where none can, it says why */
    int gpus = 0;
    CHECK_OK(td_cuda_device_count(&gpus));
    int rc = run("%s --data %s " TINY " --device cuda", example, text);
    if (gpus) {
        CHECK_EQ(rc, 0);
        CHECK(strstr(output, ", on cuda:0") && strstr(output, "sample:"));
        double gpu_loss = field("final: train loss ");
        CHECK(gpu_loss > 0 && gpu_loss < 6);
    } else {
        CHECK_EQ(rc, 1);
        CHECK(strstr(output, "device 'cuda': no GPU can be used here: ") != NULL);
    }
    CHECK_EQ(run("%s --data %s/missing.rdb", example, dir), 1);
    CHECK(strstr(output, "r-cran-janeaustenr") != NULL);
}

/* Every stage at world 2 ends within 1e-5 of DDP's checkpoint (w2.st, written above); stage 3's
 * checkpoint at step 2 resumed at world 4 ends where the uninterrupted run does; deterministic,
 * stage 2 at world 2 gives deterministic DDP's digest. */
static void zero_stages_equal_ddp(void) {
    char ddp[128], b[128];
    snprintf(ddp, sizeof ddp, "%s/w2.st", dir);
    for (int stage = 1; stage <= 3; stage++) {
        snprintf(b, sizeof b, "%s/z%d.st", dir, stage);
        CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node 2 %s --zero %d --data %s " TINY
                     " --checkpoint %s",
                     launcher, example, stage, text, b),
                 0);
        CHECK(strstr(output, "sample:") != NULL);
        char way[32];
        snprintf(way, sizeof way, "--zero %d", stage);
        train_loss_is_one_processs(way);
        double worst;
        char name[96] = "none";
        double d = checkpoint_distance(ddp, b, &worst, name, sizeof name);
        printf("    --zero %d vs DDP: relative distance %.2e (worst tensor %s)\n", stage, d, name);
        CHECK(d <= 1e-5);
    }
    snprintf(b, sizeof b, "%s/zr.st", dir);
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node 2 %s --zero 3 --data %s " TINY
                 " --checkpoint %s --stop-at-step 2",
                 launcher, example, text, b),
             0);
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node 4 %s --zero 3 --data %s " TINY
                 " --checkpoint %s --resume auto",
                 launcher, example, text, b),
             0);
    CHECK(strstr(output, "resuming from") && strstr(output, "world size 4"));
    char z3[128];
    snprintf(z3, sizeof z3, "%s/z3.st", dir);
    double worst;
    char name[96] = "none";
    double d = checkpoint_distance(z3, b, &worst, name, sizeof name);
    printf("    --zero 3 resumed at world 4 vs straight through: %.2e\n", d);
    CHECK(d <= 1e-5);

    char want[65], got[65];
    CHECK_EQ(
        run("OMP_NUM_THREADS=1 %s --data %s " TINY " --deterministic --shards 4", example, text),
        0);
    printed_sha256(want);
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node 2 %s --zero 2 --data %s " TINY
                 " --deterministic --shards 4",
                 launcher, example, text),
             0);
    printed_sha256(got);
    CHECK(strlen(want) == 64);
    if (strcmp(want, got)) TEST_FAIL_AT("--zero 2 deterministic %s, DDP %s", got, want);
}

/* `gpt args` exits `status` saying `says`. */
static void expect_exit(int status, const char *args, const char *says) {
    int rc = run("timeout 60 %s %s", example, args);
    if (rc != status || !strstr(output, says))
        TEST_FAIL_AT("gpt %s: exit %d (wanted %d), wanted \"%s\" in:\n%s", args, rc, status, says,
                     output);
}

/* Each bad value names its option and what it wanted (the command lines new users and probes
 * tried), with exit status 2; --help exits 0; a directory, a FIFO or /dev/zero as --data is
 * refused saying what it is (a FIFO blocked, /dev/zero grew without bound). */
static void options_and_data_are_checked_by_name(void) {
    static const char *const bad[][2] = {
        {"--steps 10x", "--steps 10x: expected an integer >= 1"},
        {"--batch 3.5", "--batch 3.5: expected an integer >= 1"},
        {"--warmup -1", "--warmup -1: expected an integer >= 0"},
        {"--eval-every -5", "--eval-every -5: expected an integer >= 0"},
        {"--stop-at-step -1", "--stop-at-step -1: expected an integer >= 1"},
        {"--checkpoint-every -2", "--checkpoint-every -2: expected an integer >= 0"},
        {"--context 0", "--context 0: expected an integer from 1"},
        {"--layers x", "--layers x: expected an integer from 1"},
        {"--lr fast", "--lr fast: expected a number >= 0"},
        {"--lr inf", "--lr inf: expected a number >= 0"},
        {"--seed -3", "--seed -3: expected an unsigned 64-bit integer"},
        {"--zero 4", "--zero 4: expected an integer from 1 to 3"},
        {"--pipeline 2f2b", "--pipeline 2f2b: expected naive, gpipe or 1f1b"},
        {"--device gpu", "--device gpu: expected cpu, cuda or cuda:N"},
        {"--steps", "--steps needs a value"},
        {"--epochs 2", "unknown option --epochs"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        char args[256];
        snprintf(args, sizeof args, "--data %s %s", text, bad[k][0]);
        expect_exit(2, args, bad[k][1]);
    }
    expect_exit(0, "--help", "usage: gpt");
    CHECK(strstr(output, "--stop-at-step") != NULL);
    expect_exit(1, "--data /dev/zero", "/dev/zero is a character device");
    char args[256], fifo[128];
    snprintf(args, sizeof args, "--data %s", dir);
    expect_exit(1, args, "is a directory");
    snprintf(fifo, sizeof fifo, "%s/fifo", dir);
    CHECK(mkfifo(fifo, 0600) == 0);
    snprintf(args, sizeof args, "--data %s", fifo);
    expect_exit(1, args, "is a FIFO");
}

/* A learning rate that sends the loss to NaN or infinity ends the run with status 1 naming
 * the step, in one process and under DDP; a run resumed at its last step says there is
 * nothing left to train (it printed "train loss nan") and exits 0. */
static void a_diverged_or_finished_run_says_so(void) {
    char args[512];
    snprintf(args, sizeof args, "--data %s " TINY " --lr 1e300", text);
    expect_exit(1, args, "step 2: the loss is NaN, not finite");
    CHECK(strstr(output, "final:") == NULL);
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node 2 %s --data %s " TINY " --lr 1e300",
                 launcher, example, text),
             1);
    CHECK(strstr(output, "the loss is NaN, not finite") && !strstr(output, "final:"));
    snprintf(args, sizeof args, "--data %s " TINY " --checkpoint %s/done.st", text, dir);
    expect_exit(0, args, "final:");
    strcat(args, " --resume auto");
    expect_exit(0, args,
                "nothing left to train: the checkpoint is at step 4, the last of "
                "--steps 4");
    CHECK(strstr(output, "nan") == NULL && strstr(output, "final:") == NULL);
}

/* The last "step N: val loss X" line of the run's output, into line (empty when missing). */
static void val_line(char *line, size_t cap) {
    const char *at = NULL, *p = output;
    while ((p = strstr(p, "step 20: val loss "))) at = p++;
    line[0] = 0;
    if (at) snprintf(line, cap, "%.*s", (int)strcspn(at, "\n"), at);
}

#define TP20                                                                        \
    "--layers 2 --heads 2 --width 32 --context 32 --batch 8 --steps 20 --warmup 2 " \
    "--eval-every 0 --eval-batches 1 --sample 20"

/* Tensor parallelism: --tp 2 at 2 ranks and --tp 2 with a 1F1B pipeline of 2 stages at 4 print
 * one process's validation loss after 20 steps to 4 decimals; --tp 2's checkpoint is one
 * process's (the same tensors by name, within 1e-5); runs stopped at step 10 resume under
 * another layout (TP 2 x DP 2 in one process, one process at TP 2, TP 2 x ZeRO-3 at TP 2 x
 * ZeRO-2), each ending where the uninterrupted run does. */
static void tensor_parallel_equals_one_process(void) {
    char want[64], got[64], a[128], b[128];
    snprintf(a, sizeof a, "%s/tp1.st", dir);
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --data %s " TP20 " --checkpoint %s", example, text, a), 0);
    val_line(want, sizeof want);
    CHECK(want[0] != 0);
    const char *layouts[] = {"--nproc-per-node 2 %s --data %s " TP20 " --tp 2 --checkpoint %s",
                             "--nproc-per-node 4 %s --data %s " TP20
                             " --tp 2 --pipeline 1f1b --stages 2"};
    for (int i = 0; i < 2; i++) {
        char cmd[512];
        snprintf(b, sizeof b, "%s/tp2.st", dir);
        snprintf(cmd, sizeof cmd, layouts[i], example, text, b);
        CHECK_EQ(run("OMP_NUM_THREADS=1 %s %s", launcher, cmd), 0);
        CHECK(strstr(output, "sample:") != NULL);
        val_line(got, sizeof got);
        printf("    %s: %s (one process: %s)\n", i ? "--tp 2, 1f1b x 2" : "--tp 2", got, want);
        if (strcmp(got, want)) TEST_FAIL_AT("'%s' vs one process's '%s'", got, want);
    }
    double worst;
    char name[96] = "none";
    double d = checkpoint_distance(a, b, &worst, name, sizeof name);
    printf("    --tp 2's checkpoint vs one process's: %.2e (worst tensor %s)\n", d, name);
    CHECK(d <= 1e-5);
    /* stopped under one layout, resumed under another ("L" runs under the launcher) */
    const char *halves[][2] = {
        {"L--nproc-per-node 4 %s --tp 2 --sequence-parallel", "%s"},
        {"L--nproc-per-node 1 %s", "L--nproc-per-node 2 %s --tp 2"},
        {"L--nproc-per-node 4 %s --tp 2 --zero 3", "L--nproc-per-node 4 %s --tp 2 --zero 2"}};
    for (int i = 0; i < 3; i++) {
        char part[2][2 * PATH_MAX + 8];
        for (int h = 0; h < 2; h++) {
            const char *f = halves[i][h];
            int launched = f[0] == 'L';
            char rest[PATH_MAX];
            snprintf(rest, sizeof rest, f + launched, example);
            snprintf(part[h], sizeof part[h], "%s %s", launched ? launcher : "", rest);
        }
        snprintf(b, sizeof b, "%s/tpr%d.st", dir, i);
        CHECK_EQ(run("OMP_NUM_THREADS=1 %s --data %s " TP20 " --checkpoint %s --stop-at-step 10",
                     part[0], text, b),
                 0);
        CHECK_EQ(run("OMP_NUM_THREADS=1 %s --data %s " TP20 " --checkpoint %s --resume auto",
                     part[1], text, b),
                 0);
        CHECK(strstr(output, "resuming from") != NULL);
        d = checkpoint_distance(a, b, &worst, name, sizeof name);
        char was[2][96];
        for (int h = 0; h < 2; h++) /* as a user would type them */
            snprintf(was[h], sizeof was[h], halves[i][h] + (halves[i][h][0] == 'L'), "gpt");
        printf("    stopped as '%s', resumed as '%s': %.2e from straight through\n", was[0], was[1],
               d);
        CHECK(d <= 1e-5);
    }
}

int main(int argc, char **argv) {
    (void)argc;
    if (program_test_start(argv[0], "gpt", "gpt", example, launcher, dir, text)) return 1;
    RUN(ddp_at_worlds_2_and_4_equals_one_process);
    RUN(deterministic_same_bits_at_world_1_2_4);
    RUN(resume_continues_bit_for_bit);
    RUN(pipeline_equals_one_process);
    RUN(amp_and_device);
    RUN(zero_stages_equal_ddp);
    RUN(tensor_parallel_equals_one_process);
    RUN(options_and_data_are_checked_by_name);
    RUN(a_diverged_or_finished_run_says_so);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) return 1;
    TEST_END();
}
