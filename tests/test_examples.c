/* The examples' command lines and what they print, through the real programs on real data (a
 * short training set cut from Fashion-MNIST where epochs must be short): a bad option value is
 * named, not answered with the usage; --max-steps caps the optimizer steps of the whole run,
 * across epochs and a resume, in every mode; the banner names the precision; progress in a log
 * is whole lines, also under mpirun, which hands ranks a terminal; a training set smaller than
 * one global batch is refused; the pipeline mode prints the whole model's parameter digest;
 * --zero trains what DDP trains and its checkpoints resume at another world size; the loss printed
 * at step 1 under DDP and each ZeRO stage is one process's. */
#include <libgen.h>
#include <limits.h>

#include "tandem/tandem.h"

#include "test.h"
#include "test_program.h" /* run, field, fashion_mnist_subset */

static char mnist[PATH_MAX], contrastive[PATH_MAX], launcher[PATH_MAX], dir[64];
static char short_set[128], tiny_set[128]; /* 640 training images (5 steps of 128), 100 */

/* The params_sha256 of the last run's final line, or "" (the case fails). */
static void digest_of_run(char out[65]) {
    const char *at = strstr(output, "params_sha256 ");
    out[0] = 0;
    if (at) sscanf(at + 14, "%64[0-9a-f]", out);
    CHECK(strlen(out) == 64);
}

/* The number after `name` in the last run's closing "final:" line, or -1. */
static double final_field(const char *name) {
    const char *final = strstr(output, "final:"), *at = final ? strstr(final, name) : NULL;
    return at ? atof(at + strlen(name)) : -1;
}

/* `prog args` exits 2 saying `says`, and does not print the usage instead. */
static void expect_named(const char *prog, const char *args, const char *says) {
    CHECK_EQ(run("%s %s", prog, args), 2);
    if (!strstr(output, says) || strstr(output, "usage:"))
        TEST_FAIL_AT("%s: wanted \"%s\" and no usage, got:\n%s", args, says, output);
}

static void bad_option_values_are_named(void) {
    expect_named(mnist, "--amp O5", "--amp O5: expected O0, O1, O2 or O3");
    expect_named(mnist, "--amp-dtype f64", "--amp-dtype f64: expected bf16 or f16");
    expect_named(mnist, "--comm-dtype f8", "--comm-dtype f8: expected f32, bf16 or f16");
    expect_named(mnist, "--epochs two", "--epochs two: expected an integer >= 1");
    expect_named(mnist, "--max-steps -3", "--max-steps -3: expected an integer >= 1");
    expect_named(mnist, "--batch 0", "--batch 0: expected an integer >= 1");
    expect_named(mnist, "--dropout 1.5", "--dropout 1.5: expected a number in [0, 1)");
    expect_named(mnist, "--loss-scale big", "--loss-scale big: expected dynamic, none or a number");
    expect_named(mnist, "--pipeline gpipe --stages 99",
                 "--stages 99: expected an integer from 1 to 16");
    expect_named(mnist, "--spawn 0", "--spawn 0: expected an integer >= 1");
    expect_named(mnist, "--pipeline gpipe --micro-batches 0",
                 "--micro-batches 0: expected an integer >= 1");
    expect_named(mnist, "--device gpu", "--device gpu: expected cpu, cuda or cuda:N");
    /* an option nobody knows is named, then the usage shows what there is */
    CHECK_EQ(run("%s --epoch 2", mnist), 2);
    CHECK(strstr(output, "unknown option --epoch") && strstr(output, "usage:"));
    expect_named(mnist, "--lr inf", "--lr inf: expected a number >= 0");
    expect_named(mnist, "--momentum 1", "--momentum 1: expected a number in [0, 1)");
    /* --help is the usage, and no error */
    CHECK_EQ(run("%s --help", mnist), 0);
    CHECK(!strncmp(output, "usage: mnist", 12));
}

/* A learning rate that sends the loss to NaN ends the run with status 1 naming the step, in
 * the data-parallel mode and in the pipeline's (it trained on, printing NaN losses). */
static void a_diverged_run_stops_naming_the_step(void) {
    CHECK_EQ(run("%s --model mlp --lr 1e30 --max-steps 4 --no-eval --data %s", mnist, short_set),
             1);
    CHECK(strstr(output, "step 2: the loss is NaN, not finite") && !strstr(output, "final:"));
    CHECK_EQ(run("%s --nproc-per-node 2 %s --model mlp --pipeline gpipe --stages 2 "
                 "--micro-batches 2 --lr 1e30 --max-steps 4 --no-eval --data %s",
                 launcher, mnist, short_set),
             1);
    CHECK(strstr(output, "the loss is NaN, not finite") && !strstr(output, "final:"));
}

/* --max-steps is the run's length in optimizer steps, counted across epochs (the training set
 * here has 5 steps per epoch): 7 steps are the 5 of epoch 1 and 2 of epoch 2. Stopped inside
 * an epoch, the checkpoint says where, and a resume with a longer run ends on the bytes of the
 * run that was never stopped. */
static void max_steps_counts_across_epochs_and_resumes(void) {
    char args[PATH_MAX + 256];
    snprintf(args, sizeof args, "%s --model mlp --constant-lr --no-eval --data %s", mnist,
             short_set);
    CHECK_EQ(run("%s --epochs 3 --max-steps 7 --checkpoint %s/capped.st", args, dir), 0);
    CHECK_EQ(final_field(" steps "), 7);
    CHECK(strstr(output, "epoch 1 step 5/5") && strstr(output, "epoch 2 step 2/5"));
    CHECK(!strstr(output, "epoch 3 "));
    CHECK_EQ(run("%s --epochs 3 --checkpoint %s/straight.st", args, dir), 0);
    CHECK_EQ(final_field(" steps "), 15);
    CHECK_EQ(run("%s --epochs 3 --resume %s/capped.st --checkpoint %s/resumed.st", args, dir, dir),
             0);
    CHECK(strstr(output, "epoch 2, batch 2, step 7") != NULL);
    CHECK_EQ(final_field(" steps "), 15);
    char a[128], b[128];
    snprintf(a, sizeof a, "%s/straight.st", dir);
    snprintf(b, sizeof b, "%s/resumed.st", dir);
    size_t na = 0, nb = 0;
    unsigned char *sa = test_read_file(a, &na), *sb = test_read_file(b, &nb);
    CHECK(sa && sb && na > 0 && na == nb);
    if (sa && sb && na == nb && memcmp(sa, sb, na))
        TEST_FAIL_AT("the resumed run's checkpoint differs from the straight run's");
    free(sa);
    free(sb);
    /* more steps than --epochs holds: --epochs ends the run */
    CHECK_EQ(run("%s --epochs 1 --max-steps 100", args), 0);
    CHECK_EQ(final_field(" steps "), 5);
}

static void max_steps_counts_across_epochs_in_the_pipeline_and_contrastive(void) {
    CHECK_EQ(run("%s --model mlp --pipeline naive --stages 1 --epochs 3 --max-steps 7 --no-eval "
                 "--data %s",
                 mnist, short_set),
             0);
    CHECK_EQ(final_field(" steps "), 7);
    CHECK(strstr(output, "epoch 2 step 2/5") != NULL);
    /* 640 images in global batches of 128: 5 steps an epoch */
    CHECK_EQ(run("%s --epochs 3 --max-steps 7 --batch 128 --probe-train 0 --data %s", contrastive,
                 short_set),
             0);
    CHECK_EQ(final_field(" steps "), 7);
    CHECK(strstr(output, "epoch 2: loss") && !strstr(output, "epoch 3: loss"));
}

/* The banner says f32 for f32 training, and the apex level and type under mixed precision. */
static void banner_names_the_precision(void) {
    CHECK_EQ(run("%s --model mlp --max-steps 1 --no-eval", mnist), 0);
    CHECK(strstr(output, ", f32 on cpu\n") != NULL);
    CHECK(!strstr(output, "bf16") && !strstr(output, "amp O0"));
    CHECK_EQ(run("%s --model mlp --max-steps 1 --no-eval --amp O2", mnist), 0);
    CHECK(strstr(output, ", amp O2 bf16 on cpu\n") != NULL);
}

/* --device cuda trains on a GPU where one can be used (the digest then equals nothing on the
 * CPU's, the GPU summing in its own order, but the run must finish); where none can, the run
 * stops at once saying why. The MNIST example and the contrastive one. */
static void device_cuda_runs_or_says_why_not(void) {
    int gpus = 0;
    CHECK_OK(td_cuda_device_count(&gpus));
    int rc = run("%s --model mlp --max-steps 3 --no-eval --device cuda", mnist);
    if (gpus) {
        CHECK_EQ(rc, 0);
        CHECK(strstr(output, "f32 on cuda:0\n") && strstr(output, "final:"));
    } else {
        CHECK_EQ(rc, 1);
        CHECK(strstr(output, "device 'cuda': no GPU can be used here: ") != NULL);
        CHECK(strstr(output, td_cuda_unavailable()) != NULL);
    }
    /* SimCLR too: SyncBatchNorm, the all-gather and NT-Xent on the GPU, and the probe there */
    rc = run("%s --epochs 1 --max-steps 3 --batch 64 --probe-train 200 --probe-test 100 "
             "--probe-epochs 1 --data %s --device cuda",
             contrastive, short_set);
    if (gpus) {
        CHECK_EQ(rc, 0);
        CHECK(strstr(output, "rank(s) on cuda:0") && strstr(output, "final:"));
    } else {
        CHECK_EQ(rc, 1);
        CHECK(strstr(output, "device 'cuda': no GPU can be used here: ") != NULL);
    }
}

/* Open MPI gives its ranks a pseudo-terminal for stdout, whatever mpirun's own stdout is: the
 * progress must still be whole lines, which a log (here a pipe) keeps readable. */
static void progress_under_mpirun_is_whole_lines(void) {
    if (system("command -v mpirun >/dev/null 2>&1") != 0) {
        SKIP("mpirun not found");
        return;
    }
    /* (Open MPI frees little at exit, from components it has already unloaded: under
     * AddressSanitizer the leak report would name MPI, not us.) */
    CHECK_EQ(run("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
                 "OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl=self,vader "
                 "ASAN_OPTIONS=\"${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0\" "
                 "mpirun --oversubscribe --bind-to none -np 1 %s --model mlp --max-steps 3 "
                 "--no-eval",
                 mnist),
             0);
    CHECK(strstr(output, "epoch 1 step 3/") != NULL);
    if (strchr(output, '\r')) TEST_FAIL_AT("a \\r in the output under mpirun:\n%s", output);
}

/* A training set smaller than one global batch has no step to train: refused, by name, in
 * every mode, instead of a run of zero steps that exits 0. */
static void training_set_smaller_than_a_batch_is_refused(void) {
    CHECK_EQ(run("%s --model mlp --batch 128 --data %s", mnist, tiny_set), 1);
    CHECK(strstr(output, "training set (100 samples)") && strstr(output, "--batch 128"));
    CHECK(strstr(output, "no global batch of 128") != NULL);
    CHECK_EQ(
        run("%s --model mlp --pipeline naive --stages 1 --batch 128 --data %s", mnist, tiny_set),
        1);
    CHECK(strstr(output, "training set (100 samples)") != NULL);
    CHECK_EQ(run("%s --batch 128 --probe-train 0 --data %s", contrastive, tiny_set), 1);
    CHECK(strstr(output, "100 samples make no global batch of 128") != NULL);
    /* one batch's worth trains */
    CHECK_EQ(run("%s --model mlp --batch 100 --epochs 1 --no-eval --data %s", mnist, tiny_set), 0);
    CHECK_EQ(final_field(" steps "), 1);
}

/* The pipeline mode's digest covers every stage's parameters in layer order: the naive schedule
 * on 2 stages trains the bits of 1 stage, and both print the same digest. */
static void pipeline_prints_the_whole_models_digest(void) {
    const char *args = "--model mlp --pipeline naive --epochs 1 --max-steps 5 --no-eval";
    char one[65], two[65];
    CHECK_EQ(run("%s %s --stages 1", mnist, args), 0);
    digest_of_run(one);
    CHECK_EQ(run("%s --nproc-per-node 2 %s %s --stages 2", launcher, mnist, args), 0);
    digest_of_run(two);
    printf("    1 stage %.16s..., 2 stages %.16s...\n", one, two);
    CHECK(!strcmp(one, two));
}

/* --zero 1|2|3 trains what DDP trains (the checkpoints, parameters and momentum, within 1e-5;
 * the evaluation too), under tandemrun and mpirun; a stage 3 checkpoint of world 2 resumes at
 * world 3 under stage 2 as DDP's checkpoint resumes there. */
static void zero_stages_train_as_ddp_and_resume_at_another_world_size(void) {
    char args[PATH_MAX + 256], a[128], b[128];
    snprintf(args, sizeof args, "%s --model cnn --batch 32 --constant-lr --epochs 1 --data %s",
             mnist, short_set);
    snprintf(a, sizeof a, "%s/ddp.st", dir);
    CHECK_EQ(run("%s --nproc-per-node 2 %s --max-steps 6 --checkpoint %s", launcher, args, a), 0);
    double accuracy = final_field(" test_accuracy ");
    for (int stage = 1; stage <= 3; stage++) {
        snprintf(b, sizeof b, "%s/zero%d.st", dir, stage);
        CHECK_EQ(run("%s --nproc-per-node 2 %s --max-steps 6 --zero %d --checkpoint %s", launcher,
                     args, stage, b),
                 0);
        CHECK(strstr(output, "zero stage") && strstr(output, "gathered"));
        CHECK_NEAR(final_field(" test_accuracy "), accuracy, 1e-4);
        double d = checkpoint_difference(a, b);
        if (d > 1e-5) TEST_FAIL_AT("--zero %d: %g from DDP's checkpoint", stage, d);
    }
    /* Halfway checkpoints of DDP and of stage 3, each resumed at world 3 (batch norm makes
     * world 3 train otherwise than world 2: the two resumed runs are what must agree). */
    const char *ways[2] = {"", "--zero 3"}, *resumes[2] = {"", "--zero 2"};
    char ends[2][128];
    for (int k = 0; k < 2; k++) {
        CHECK_EQ(
            run("%s --nproc-per-node 2 %s --no-eval --max-steps 3 %s --checkpoint %s/half%d.st",
                launcher, args, ways[k], dir, k),
            0);
        snprintf(ends[k], sizeof ends[k], "%s/resumed%d.st", dir, k);
        CHECK_EQ(run("%s --nproc-per-node 3 %s --no-eval --max-steps 6 %s --resume %s/half%d.st "
                     "--checkpoint %s",
                     launcher, args, resumes[k], dir, k, ends[k]),
                 0);
        CHECK(strstr(output, "resuming from") && strstr(output, "world size 3"));
    }
    double d = checkpoint_difference(ends[0], ends[1]);
    if (d > 1e-5) TEST_FAIL_AT("resumed at world 3: %g from DDP's resumed run", d);
    if (system("command -v mpirun >/dev/null 2>&1") != 0) {
        SKIP("mpirun not found");
        return;
    }
    snprintf(b, sizeof b, "%s/zero_mpi.st", dir);
    CHECK_EQ(run("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
                 "OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl=self,vader "
                 "ASAN_OPTIONS=\"${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0\" "
                 "mpirun --oversubscribe --bind-to none -np 2 %s --no-eval --max-steps 6 "
                 "--zero 3 --checkpoint %s",
                 args, b),
             0);
    d = checkpoint_difference(a, b);
    if (d > 1e-5) TEST_FAIL_AT("--zero 3 under mpirun: %g from DDP's checkpoint", d);
}

/* The loss of step `step` the last run printed ("... step N/M loss X"), or -1. */
static double step_loss(int step) {
    char at[32];
    snprintf(at, sizeof at, " step %d/", step);
    const char *line = strstr(output, at), *loss = line ? strstr(line, " loss ") : NULL;
    return loss ? atof(loss + 6) : -1;
}

/* The loss printed at step 1 is the step's loss over the global batch: under DDP and each ZeRO
 * stage at world 2 the same, to the 4 digits printed, as one process's on the whole batch (it
 * used to be the step before's, 0 at step 1, under DDP and stage 1). */
static void step_one_loss_under_ddp_and_zero_is_one_processs(void) {
    char args[PATH_MAX + 256];
    snprintf(args, sizeof args, "%s --model mlp --epochs 1 --max-steps 1 --no-eval --data %s",
             mnist, short_set);
    CHECK_EQ(run("%s", args), 0);
    double one = step_loss(1);
    CHECK(one > 0.1);
    const char *ways[4] = {"", "--zero 1", "--zero 2", "--zero 3"};
    for (int k = 0; k < 4; k++) {
        CHECK_EQ(run("%s --nproc-per-node 2 %s %s", launcher, args, ways[k]), 0);
        double two = step_loss(1);
        printf("    %s: step 1 loss %.4f, one process %.4f\n", k ? ways[k] : "ddp", two, one);
        if (!(fabs(two - one) <= 1.01e-4))
            TEST_FAIL_AT("%s at world 2: step 1 loss %.4f, one process %.4f", k ? ways[k] : "ddp",
                         two, one);
    }
}

int main(int argc, char **argv) {
    (void)argc;
    char self[PATH_MAX];
    if (!realpath(argv[0], self)) return 1;
    char *bin = dirname(dirname(self)); /* BUILD/tests/x -> BUILD */
    snprintf(mnist, sizeof mnist, "%s/examples/mnist", bin);
    snprintf(contrastive, sizeof contrastive, "%s/examples/contrastive", bin);
    snprintf(launcher, sizeof launcher, "%s/bin/tandemrun", bin);
    snprintf(dir, sizeof dir, "/tmp/tandem-examples-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    snprintf(short_set, sizeof short_set, "%s/short", dir);
    snprintf(tiny_set, sizeof tiny_set, "%s/tiny", dir);
    if (fashion_mnist_subset(short_set, 640) || fashion_mnist_subset(tiny_set, 100)) return 1;
    RUN(bad_option_values_are_named);
    RUN(a_diverged_run_stops_naming_the_step);
    RUN(max_steps_counts_across_epochs_and_resumes);
    RUN(max_steps_counts_across_epochs_in_the_pipeline_and_contrastive);
    RUN(banner_names_the_precision);
    RUN(device_cuda_runs_or_says_why_not);
    RUN(progress_under_mpirun_is_whole_lines);
    RUN(training_set_smaller_than_a_batch_is_refused);
    RUN(pipeline_prints_the_whole_models_digest);
    RUN(zero_stages_train_as_ddp_and_resume_at_another_world_size);
    RUN(step_one_loss_under_ddp_and_zero_is_one_processs);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) return 1;
    TEST_END();
}
