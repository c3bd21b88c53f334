/* Deterministic training at every layout: a small GPT trained on a device mesh of (dp, tp, pp)
 * ranks, the batch in fixed shards summed by DDP's shard tree over dp and every tensor-parallel
 * layer in fixed tp shards (td_graph_params.tp_shards) summed in the pairwise tree over tp, the
 * gradient norm clipped over the whole model, ends on the parameter digest of one process
 * training alone, at every layout of 1, 2 and 4 ranks: with and without sequence parallelism,
 * 1F1B pipelines, ZeRO 1-3 over dp and recompute (the library, ranks forked by td_spawn over the
 * shm backend). Then examples/gpt under tandemrun: the digest table of docs/parallelism.md at 4
 * ranks, a checkpoint of one layout resumed at others on its exact bits (deterministic) and
 * within 1e-6 (default mode), and a killed rank under --restart-nproc-per-node left restarting
 * at a layout that fits the ranks left and ending on the undisturbed run's digest. */
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "tandem/tandem.h"

#include "test.h"
#include "test_comm_util.h"
#include "test_mesh_layout.h"
#include "test_program.h" /* run, printed_sha256, checkpoint_distance, children_of */

#define B 8      /* sequences per step (global) */
#define T 16     /* context */
#define SHARDS 4 /* of the batch, and of every tensor-parallel dimension */
#define STEPS 6
#define MAX_NORM 0.5
#define SEED 5

static td_gpt_params tiny(void) {
    td_gpt_params p = {.layers = 2, .heads = 4, .width = 32, .context = T, .vocab = 64};
    return p;
}

/* Step `step`'s batch: B sequences of token ids and their next tokens. */
static void make_batch(int step, float *x, int64_t *y) {
    td_rng r;
    td_rng_init(&r, 1000 + (uint64_t)step);
    for (int64_t i = 0; i < B * T; i++) {
        x[i] = (float)(td_rng_u32(&r) % 64u);
        y[i] = (int64_t)(td_rng_u32(&r) % 64u);
    }
}

typedef struct {
    mesh_layout at;
    char *digest; /* shared with the ranks: rank 0 writes the whole model's SHA-256 */
} layout;

/* Trains the layout's rank: each of its dp replica's shards of the batch a micro-batch, the
 * whole model's SHA-256 to rank 0's digest. */
static void layout_rank(int rank, int size, int port, void *arg) {
    layout *L = arg;
    size_t rows = B / SHARDS, count = SHARDS / (size_t)L->at.dp;
    td_pipeline_params pp = td_pipeline_default_params(); /* at pp > 1 each micro-batch a shard */
    pp.micro_batches = (int)count;
    pp.batch = (int64_t)(count * rows);
    pp.split = "h.1";
    pp.seed = SEED;
    pp.graph.tp_shards = SHARDS;
    pp.graph.threads = 1;
    pp.ddp.deterministic = 1;
    pp.ddp.shards = SHARDS;
    mesh_rank r;
    if (mesh_rank_create(&r, rank, size, port, &L->at, tiny(), pp, (int64_t)rows)) return;
    size_t first = (size_t)td_mesh_coord(r.mesh, "dp") * count;
    td_adamw_params ap = td_adamw_default_params();
    ap.lr = 1e-2;
    ap.weight_decay = 0.1;
    td_optim *opt;
    CHECK_OK(td_optim_create_adamw(&opt, r.stepped, r.n_stepped, &ap));
    float x[B * T], loss;
    int64_t y[B * T];
    for (int step = 0; step < STEPS; step++) {
        make_batch(step, x, y);
        if (r.pipe)
            CHECK_OK(td_pipeline_step(r.pipe, x + first * rows * T, y + first * rows * T, &loss));
        else
            for (size_t j = 0; j < count; j++)
                mesh_rank_forward_backward(&r, x + (first + j) * rows * T,
                                           y + (first + j) * rows * T, &loss);
        mesh_rank_clip_grad_norm(&r, MAX_NORM);
        CHECK_OK(td_optim_step(opt));
    }
    if (r.zero) CHECK_OK(td_zero_full_params(r.zero, 1));
    td_param *whole;
    size_t n_whole;
    CHECK_OK(td_mesh_gather_model(r.mesh, r.p, r.n, &whole, &n_whole));
    if (whole) CHECK_OK(td_params_sha256(whole, n_whole, L->digest));
    td_mesh_model_free(whole, n_whole);
    td_optim_destroy(opt);
    mesh_rank_destroy(&r);
}

/* The layout's digest (64 hex digits) into out. */
static void train(mesh_layout at, char out[65]) {
    layout L = {.at = at};
    L.digest = mmap(NULL, 65, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    memset(L.digest, 0, 65);
    CHECK_EQ(test_run_ranks(at.tp * at.dp * at.pp, layout_rank, &L, 120, 0), 0);
    memcpy(out, L.digest, 65);
    munmap(L.digest, 65);
}

/* Tensor parallelism over 1, 2 and 4 ranks (with sequence parallelism at 2 and 4), with data
 * parallelism beside it: one digest. */
static void tensor_parallel_same_bits_at_every_degree(void) {
    char want[65], got[65];
    train((mesh_layout){.tp = 1, .dp = 1, .pp = 1}, want);
    CHECK(strlen(want) == 64);
    mesh_layout ls[] = {{.tp = 2, .dp = 1, .pp = 1},
                        {.tp = 4, .dp = 1, .pp = 1},
                        {.tp = 2, .dp = 1, .pp = 1, .sp = 1},
                        {.tp = 4, .dp = 1, .pp = 1, .sp = 1},
                        {.tp = 2, .dp = 2, .pp = 1, .sp = 1},
                        {.tp = 1, .dp = 4, .pp = 1},
                        {.tp = 4, .dp = 1, .pp = 1, .sp = 1, .recompute = TD_RECOMPUTE_SELECTIVE},
                        {.tp = 1, .dp = 1, .pp = 1, .recompute = TD_RECOMPUTE_FULL}};
    for (size_t i = 0; i < sizeof ls / sizeof *ls; i++) {
        train(ls[i], got);
        printf("    dp %d x tp %d%s%s: %.16s...\n", ls[i].dp, ls[i].tp,
               ls[i].sp ? ", sequence parallel" : "",
               ls[i].recompute == TD_RECOMPUTE_FULL        ? ", recompute full"
               : ls[i].recompute == TD_RECOMPUTE_SELECTIVE ? ", recompute selective"
                                                           : "",
               got);
        if (strcmp(got, want))
            TEST_FAIL_AT("dp %d x tp %d%s: %s, one process %s", ls[i].dp, ls[i].tp,
                         ls[i].sp ? " sequence parallel" : "", got, want);
    }
}

/* A 1F1B pipeline of 2 stages (the tied embedding on both), alone, with tp 2 and with dp 2: one
 * process's digest. */
static void pipelines_same_bits(void) {
    char want[65], got[65];
    train((mesh_layout){.tp = 1, .dp = 1, .pp = 1}, want);
    mesh_layout ls[] = {{.tp = 1, .dp = 1, .pp = 2},
                        {.tp = 2, .dp = 1, .pp = 2, .sp = 1},
                        {.tp = 1, .dp = 2, .pp = 2},
                        {.tp = 2, .dp = 1, .pp = 2, .sp = 1, .recompute = TD_RECOMPUTE_FULL}};
    for (size_t i = 0; i < sizeof ls / sizeof *ls; i++) {
        train(ls[i], got);
        printf("    dp %d x tp %d x pp %d%s: %.16s...\n", ls[i].dp, ls[i].tp, ls[i].pp,
               ls[i].recompute ? ", recompute full" : "", got);
        if (strcmp(got, want))
            TEST_FAIL_AT("dp %d x tp %d x pp %d: %s, one process %s", ls[i].dp, ls[i].tp, ls[i].pp,
                         got, want);
    }
}

/* ZeRO 1, 2 and 3 over dp 4, and over dp 2 of tp 2: one process's digest. */
static void zero_same_bits(void) {
    char want[65], got[65];
    train((mesh_layout){.tp = 1, .dp = 1, .pp = 1}, want);
    for (int stage = 1; stage <= 3; stage++)
        for (int tp = 1; tp <= 2; tp++) {
            mesh_layout l = {.tp = tp, .dp = 4 / tp, .pp = 1, .sp = tp > 1, .zero = stage};
            train(l, got);
            printf("    ZeRO %d over dp %d x tp %d: %.16s...\n", stage, l.dp, tp, got);
            if (strcmp(got, want))
                TEST_FAIL_AT("ZeRO %d over dp %d x tp %d: %s, one process %s", stage, l.dp, tp, got,
                             want);
        }
}

/* ---- examples/gpt ------------------------------------------------------------------------ */

static char example[PATH_MAX], launcher[PATH_MAX], dir[64], text[128];

#define GPT                                                                                     \
    "--layers 2 --heads 4 --width 32 --context 32 --batch 8 --steps 6 --warmup 2 --eval-every " \
    "0 --eval-batches 1 --sample 0 --shards 4"

/* The layouts of the table: tandemrun's options, then the example's. */
typedef struct {
    const char *name, *launch, *args;
} gpt_layout;

static const gpt_layout table[] = {
    {"1 process", NULL, ""},
    {"dp 4", "--nproc-per-node 4", ""},
    {"dp 2 x tp 2", "--nproc-per-node 4 --tp 2", ""},
    {"tp 4", "--nproc-per-node 4 --tp 4", ""},
    {"tp 4, sequence parallel", "--nproc-per-node 4 --tp 4", "--sequence-parallel"},
    {"tp 2 x pp 2", "--nproc-per-node 4 --tp 2 --pp 2", ""},
    {"dp 2 x pp 2", "--nproc-per-node 4 --pp 2", ""},
    {"ZeRO 1 over dp 4", "--nproc-per-node 4", "--zero 1"},
    {"ZeRO 2 over dp 4", "--nproc-per-node 4", "--zero 2"},
    {"ZeRO 3 over dp 4", "--nproc-per-node 4", "--zero 3"},
    {"ZeRO 3 over dp 2 x tp 2", "--nproc-per-node 4 --tp 2", "--zero 3 --sequence-parallel"},
};

/* examples/gpt at a layout with more options; its exit status (output in `output`). */
static int gpt_at(const gpt_layout *l, const char *more) {
    if (!l->launch)
        return run("OMP_NUM_THREADS=1 %s --data %s " GPT " %s %s", example, text, l->args, more);
    return run("OMP_NUM_THREADS=1 %s %s %s --data %s " GPT " %s %s", launcher, l->launch, example,
               text, l->args, more);
}

static const gpt_layout *layout_named(const char *name) {
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (!strcmp(table[i].name, name)) return &table[i];
    return NULL;
}

/* The digest table: deterministic training at every layout of 4 ranks ends on one process's
 * parameters. */
static void digest_table_at_4_ranks(void) {
    char want[65] = "", got[65];
    printf("    | layout (4 ranks) | params_sha256 |\n");
    for (size_t i = 0; i < sizeof table / sizeof *table; i++) {
        CHECK_EQ(gpt_at(&table[i], "--deterministic"), 0);
        printed_sha256(got);
        printf("    | %s | %.16s... |\n", table[i].name, got);
        CHECK(strlen(got) == 64);
        if (i == 0) memcpy(want, got, sizeof got);
        if (strcmp(got, want)) TEST_FAIL_AT("%s: %s, one process %s", table[i].name, got, want);
    }
}

/* A deterministic run stopped at step 3 at dp 2 x tp 2 and resumed at dp 4, tp 4, tp 2 x pp 2
 * and one process, and one stopped under ZeRO 3 resumed at dp 2 x tp 2, end on the bits of the
 * run nobody stopped; in the default mode a resume at dp 4 ends within 1e-6 of it. */
static void resume_at_another_layout(void) {
    char want[65], got[65], half[160], zhalf[160], full[160], mine[160], more[512];
    snprintf(half, sizeof half, "%s/half.st", dir);
    snprintf(zhalf, sizeof zhalf, "%s/zhalf.st", dir);
    const gpt_layout *from = layout_named("dp 2 x tp 2");
    CHECK_EQ(gpt_at(from, "--deterministic"), 0);
    printed_sha256(want);
    snprintf(more, sizeof more, "--deterministic --stop-at-step 3 --checkpoint %s", half);
    CHECK_EQ(gpt_at(from, more), 0);
    snprintf(more, sizeof more, "--deterministic --stop-at-step 3 --checkpoint %s", zhalf);
    CHECK_EQ(gpt_at(layout_named("ZeRO 3 over dp 4"), more), 0);
    const char *to[] = {"dp 4", "tp 4", "tp 2 x pp 2", "1 process"};
    for (int k = 0; k < 5; k++) {
        snprintf(more, sizeof more, "--deterministic --resume %s", k < 4 ? half : zhalf);
        CHECK_EQ(gpt_at(layout_named(k < 4 ? to[k] : "dp 2 x tp 2"), more), 0);
        CHECK(strstr(output, "resuming from") != NULL);
        printed_sha256(got);
        printf("    %s at step 3 -> %s: %.16s...\n", k < 4 ? from->name : "ZeRO 3 over dp 4",
               k < 4 ? to[k] : "dp 2 x tp 2", got);
        if (strcmp(got, want))
            TEST_FAIL_AT("resumed at %s: %s, straight through %s", to[k], got, want);
    }
    /* the default mode: float noise between layouts, within 1e-6 */
    snprintf(full, sizeof full, "%s/full.st", dir);
    snprintf(mine, sizeof mine, "%s/resumed.st", dir);
    snprintf(more, sizeof more, "--checkpoint %s", full);
    CHECK_EQ(gpt_at(from, more), 0);
    snprintf(more, sizeof more, "--stop-at-step 3 --checkpoint %s", half);
    CHECK_EQ(gpt_at(from, more), 0);
    snprintf(more, sizeof more, "--resume %s --checkpoint %s", half, mine);
    CHECK_EQ(gpt_at(layout_named("dp 4"), more), 0);
    double worst;
    char name[96];
    double d = checkpoint_distance(full, mine, &worst, name, sizeof name);
    printf("    default mode, dp 2 x tp 2 at step 3 -> dp 4: %.2e from straight through\n", d);
    CHECK(d <= 1e-6);
}

/* What deterministic tensor parallelism cannot do is refused by name: its shards with --amp,
 * without --deterministic, in a count no rank can hold evenly, and a checkpoint written with
 * other shards (its sums were another tree's). */
static void refusals_name_the_problem(void) {
    const gpt_layout *one = layout_named("1 process");
    CHECK_EQ(gpt_at(one, "--deterministic --amp --tp 2"), 2);
    CHECK(strstr(output, "--deterministic --tp 2: deterministic tensor parallelism computes in "
                         "f32; leave out --amp") != NULL);
    CHECK_EQ(gpt_at(one, "--tp-shards 4"), 2);
    CHECK(strstr(output, "--tp-shards 4") && strstr(output, "give --deterministic"));
    CHECK(gpt_at(one, "--deterministic --tp-shards 3") != 0);
    CHECK(strstr(output, "tp_shards 3 over a group of 1") != NULL);
    char ck[160], more[256];
    snprintf(ck, sizeof ck, "%s/four.st", dir);
    snprintf(more, sizeof more, "--deterministic --stop-at-step 2 --checkpoint %s", ck);
    CHECK_EQ(gpt_at(one, more), 0);
    snprintf(more, sizeof more, "--deterministic --tp-shards 2 --resume %s", ck);
    CHECK_EQ(gpt_at(one, more), 1);
    CHECK(strstr(output, "tp shards 4; this run has") && strstr(output, "tp shards 2\n"));
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Starts `cmd` (words split at spaces) with its output in `log`, kills rank 1 (a child of the
 * launcher) once `ck` exists and waits for the launcher; returns whether the kill came while
 * all 4 ranks lived (a loaded machine may let the job finish first). */
static int kill_rank_1_after_checkpoint(char *cmd, const char *log, const char *ck, int *status) {
    char *argv[64];
    int argc = 0;
    for (char *save = NULL, *w = strtok_r(cmd, " ", &save); w && argc < 63;
         w = strtok_r(NULL, " ", &save))
        argv[argc++] = w;
    argv[argc] = NULL;
    unlink(ck);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        setenv("OMP_NUM_THREADS", "1", 1);
        execv(argv[0], argv);
        _exit(127);
    }
    double t0 = now_s();
    while (access(ck, F_OK) != 0 && now_s() - t0 < 60) test_sleep_ms(1);
    pid_t ranks[8];
    int killed = children_of(pid, ranks, 8) == 4 && kill(ranks[1], SIGKILL) == 0;
    waitpid(pid, status, 0);
    return killed;
}

/* A rank of a dp 2 x tp 2 job killed after its first checkpoint, under --max-restarts 1
 * --restart-nproc-per-node left: the 3 ranks left hold one tp 2 pair, so the job restarts on 2
 * ranks as tp 2 x dp 1, resumes from the checkpoint and ends on the digest of the run nobody
 * disturbed. */
static void killed_rank_restarts_at_a_layout_that_fits(void) {
    char want[65], got[65], ck[160], log[160], args[512];
    snprintf(ck, sizeof ck, "%s/restart.st", dir);
    snprintf(log, sizeof log, "%s/restart.log", dir);
    snprintf(args, sizeof args,
             "--data %s " GPT " --deterministic --steps 120 --checkpoint-every 4", text);
    CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node 4 --tp 2 %s %s", launcher, example, args),
             0);
    printed_sha256(want);
    /* a loaded machine may let the job end before the kill, or kill a rank that had trained
     * every step: then again, at most 3 times */
    int killed = 0, status = 0;
    char *log_text = NULL;
    size_t n = 0;
    for (int attempt = 0; attempt < 3 && !killed; attempt++) {
        char cmd[3 * PATH_MAX];
        snprintf(cmd, sizeof cmd,
                 "%s --max-restarts 1 --restart-nproc-per-node left --nproc-per-node 4 --tp 2 "
                 "%s %s --checkpoint %s --resume auto",
                 launcher, example, args, ck);
        killed = kill_rank_1_after_checkpoint(cmd, log, ck, &status);
        free(log_text);
        log_text = (char *)test_read_file(log, &n);
        log_text = realloc(log_text, n + 1);
        log_text[n] = 0;
        if (strstr(log_text, "nothing left to train")) killed = 0;
    }
    size_t keep = n < sizeof output - 1 ? n : sizeof output - 1;
    memcpy(output, log_text + n - keep, keep);
    output[keep] = 0;
    printed_sha256(got);
    const char *restart = strstr(log_text, "restart 1 of 1");
    const char *starting = restart ? strstr(restart, "starting") : NULL;
    printf("    rank killed%s; %.*s; final %.16s...\n", killed ? "" : " (after the last step)",
           starting ? (int)strcspn(starting, "\n") : 10, starting ? starting : "no restart", got);
    CHECK(killed);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(restart && strstr(restart, "starting 2 ranks as tp 2 x pp 1 x dp 1"));
    CHECK(restart && strstr(restart, "resuming from"));
    if (strcmp(got, want)) TEST_FAIL_AT("restarted: %s, undisturbed %s", got, want);
    free(log_text);
    CHECK_EQ(test_shm_leftovers(), 0);
}

int main(int argc, char **argv) {
    (void)argc;
    if (program_test_start(argv[0], "gpt", "layouts", example, launcher, dir, text)) return 1;
    RUN(tensor_parallel_same_bits_at_every_degree);
    RUN(pipelines_same_bits);
    RUN(zero_same_bits);
    RUN(digest_table_at_4_ranks);
    RUN(resume_at_another_layout);
    RUN(refusals_name_the_problem);
    RUN(killed_rank_restarts_at_a_layout_that_fits);
    test_remove_dir(dir);
    TEST_END();
}
