/* examples/gpt end to end on a small text the test writes (so it needs no package) and a small
 * GPT: data parallelism at worlds 2 and 4 ends where one process on the global batch does
 * (<= 1e-5 relative, every parameter), the deterministic mode gives the same parameter bits at
 * worlds 1, 2 and 4, a run stopped and resumed from its checkpoint ends on the same bits as one
 * that was not, mixed precision trains, and --zero is refused by name. The few-minute run on
 * Jane Austen is docs/gpt.md's. */
#include <libgen.h>
#include <limits.h>

#include "test.h"
#include "test_program.h" /* run, field, checkpoint_distance */

static char example[PATH_MAX], launcher[PATH_MAX], dir[64], text[128];

#define TINY                                                                       \
    "--layers 2 --heads 2 --width 32 --context 32 --batch 8 --steps 4 --warmup 2 " \
    "--eval-every 0 --eval-batches 1 --sample 20"

/* The hash the run printed last, into hex (empty when missing). */
static void sha(char hex[65]) {
    const char *at = strstr(output, "params_sha256 ");
    hex[0] = 0;
    if (at) snprintf(hex, 65, "%.64s", at + 14);
}

static void ddp_at_worlds_2_and_4_equals_one_process(void) {
    CHECK_EQ(
        run("OMP_NUM_THREADS=1 %s --data %s " TINY " --checkpoint %s/w1.st", example, text, dir),
        0);
    CHECK(strstr(output, "sample:") != NULL);
    int worlds[] = {2, 4};
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node %d %s --ddp --data %s " TINY
                     " --checkpoint %s/w%d.st",
                     launcher, worlds[i], example, text, dir, worlds[i]),
                 0);
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
    sha(want);
    CHECK(strlen(want) == 64);
    for (int w = 2; w <= 4; w += 2) {
        CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node %d %s --data %s " TINY
                     " --deterministic --shards 4",
                     launcher, w, example, text),
                 0);
        sha(got);
        if (strcmp(want, got)) TEST_FAIL_AT("world %d: %s, world 1: %s", w, got, want);
    }
    printf("    params_sha256 %.16s... at worlds 1, 2 and 4\n", want);
}

static void resume_continues_bit_for_bit(void) {
    char want[65], got[65];
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --data %s " TINY, example, text), 0);
    sha(want);
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --data %s " TINY " --checkpoint %s/r.st --stop-at 2",
                 example, text, dir),
             0);
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --data %s " TINY " --checkpoint %s/r.st --resume auto",
                 example, text, dir),
             0);
    CHECK(strstr(output, "resuming from") != NULL);
    sha(got);
    if (strcmp(want, got)) TEST_FAIL_AT("resumed %s, straight through %s", got, want);
    /* a checkpoint of another model shape is refused, naming both */
    CHECK_EQ(run("%s --data %s " TINY " --width 64 --resume %s/r.st", example, text, dir), 1);
    CHECK(strstr(output, "width 32") && strstr(output, "width 64"));
}

static void amp_trains_and_zero_is_refused(void) {
    CHECK_EQ(run("%s --data %s " TINY " --amp", example, text), 0);
    CHECK(strstr(output, "amp bf16") != NULL);
    double loss = field("final: train loss ");
    CHECK(loss > 0 && loss < 6);
    CHECK_EQ(run("%s --data %s --zero", example, text), 2);
    CHECK(strstr(output, "--zero") != NULL);
    CHECK_EQ(run("%s --data %s/missing.rdb", example, dir), 1);
    CHECK(strstr(output, "r-cran-janeaustenr") != NULL);
}

int main(int argc, char **argv) {
    (void)argc;
    char self[PATH_MAX];
    if (!realpath(argv[0], self)) return 1;
    char *bin = dirname(dirname(self)); /* BUILD/tests/x -> BUILD */
    snprintf(example, sizeof example, "%s/examples/gpt", bin);
    snprintf(launcher, sizeof launcher, "%s/bin/tandemrun", bin);
    snprintf(dir, sizeof dir, "/tmp/tandem-gpt-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    /* 40 KB of English: enough windows of 33 bytes for any rank's batch */
    snprintf(text, sizeof text, "%s/text.txt", dir);
    FILE *f = fopen(text, "w");
    if (!f) return 1;
    for (int i = 0; i < 400; i++)
        fprintf(f,
                "It is a truth universally acknowledged, that a single man in possession of a "
                "good fortune, must be in want of a wife. (%d)\n",
                i);
    fclose(f);
    RUN(ddp_at_worlds_2_and_4_equals_one_process);
    RUN(deterministic_same_bits_at_world_1_2_4);
    RUN(resume_continues_bit_for_bit);
    RUN(amp_trains_and_zero_is_refused);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) return 1;
    TEST_END();
}
