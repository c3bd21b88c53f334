/* td_zero's sharded checkpoints over real forked ranks.
 *
 * Checks: a checkpoint written at world 4 (stage 3) resumes at worlds 1, 2 and 3 under other
 * stages, and in td_ddp through td_checkpoint_load with no conversion, continuing as the
 * uninterrupted run does (1e-5 with AdamW; in deterministic mode the same SHA-256 as
 * deterministic DDP's uninterrupted run); a td_ddp checkpoint resumes under ZeRO; the
 * consolidated file (tandem-consolidate) loads in PyTorch with strict=True where Debian's
 * python3-torch is installed; kill -9 during sharded saves, at random moments, leaves the last
 * committed checkpoint whole; damaged sets are refused naming the file. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tandem/checkpoint.h"
#include "tandem/zero.h"

#include "test.h"
#include "test_comm_util.h"
#include "test_zero_train.h"

/* What the parent and its forked ranks share (in a MAP_SHARED page). */
typedef struct {
    char dir[128], path[160], ddp_path[160];
    float want[400]; /* the uninterrupted run's parameters */
    char digest[65]; /* the uninterrupted deterministic run's */
    run_cfg cfg;     /* what the ranks of the next run do */
    gcfg gc;
    int compare;        /* 1: check the result against want (or digest) */
    int last_committed; /* kill tests: the last save that returned TD_OK */
} shared;

static shared *shared_new(void) {
    shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) return NULL;
    memset(sh, 0, sizeof *sh);
    test_temp_dir(sh->dir, sizeof sh->dir, "zero_ck");
    snprintf(sh->path, sizeof sh->path, "%s/run.st", sh->dir);
    snprintf(sh->ddp_path, sizeof sh->ddp_path, "%s/ddp.st", sh->dir);
    return sh;
}

static void shared_free(shared *sh) {
    test_remove_dir(sh->dir);
    munmap(sh, sizeof *sh);
}

/* ---- resuming at other world sizes -------------------------------------------------------- */

static void mlp_rank(int rank, int size, int port, void *arg) {
    shared *sh = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    float got[400];
    double norms[STEPS];
    train(comm, &sh->cfg, got, norms);
    if (sh->compare == 1) {
        double worst = 0;
        for (int e = 0; e < 294; e++) worst = fmax(worst, fabs((double)got[e] - sh->want[e]));
        if (worst > 1e-5)
            TEST_FAIL_AT("world %d stage %d resumed: %g from the uninterrupted run", size,
                         sh->cfg.stage, worst);
    } else if (rank == 0 && sh->compare == 0) {
        memcpy(sh->want, got, sizeof got);
    }
    td_comm_destroy(comm);
}

/* Runs cfg at `world`, comparing with the uninterrupted run when compare. */
static void mlp_run(shared *sh, int world, run_cfg cfg, int compare) {
    sh->cfg = cfg;
    sh->compare = compare;
    CHECK_EQ(test_run_ranks(world, mlp_rank, sh, 120, 0), 0);
}

static void world_4_checkpoint_resumes_at_1_2_3_and_in_ddp(void) {
    shared *sh = shared_new();
    CHECK(sh != NULL);
    if (!sh) return;
    mlp_run(sh, 4, (run_cfg){.stage = 0, .micro = 1}, 0); /* uninterrupted, steps 0-3 */
    mlp_run(sh, 4, (run_cfg){.stage = 3, .micro = 1, .last_step = 2, .save = sh->path}, -1);
    run_cfg resume = {.micro = 1, .first_step = 2, .last_step = 4, .load = sh->path};
    resume.stage = 2;
    mlp_run(sh, 2, resume, 1);
    resume.stage = 3;
    mlp_run(sh, 3, resume, 1);
    resume.stage = 1;
    mlp_run(sh, 1, resume, 1);
    resume.stage = 0; /* td_ddp reads the sharded checkpoint as one file */
    mlp_run(sh, 2, resume, 1);
    /* And a td_ddp checkpoint resumes under ZeRO. */
    mlp_run(sh, 2, (run_cfg){.stage = 0, .micro = 1, .last_step = 2, .save = sh->ddp_path}, -1);
    resume.load = sh->ddp_path;
    resume.stage = 3;
    mlp_run(sh, 3, resume, 1);
    CHECK_EQ(test_shm_leftovers(), 0);
    shared_free(sh);
}

/* ---- deterministic mode: bit for bit ----------------------------------------------------- */

static void graph_rank(int rank, int size, int port, void *arg) {
    shared *sh = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    static float params[GPARAMS];
    char digest[65];
    gtrain(comm, &sh->gc, params, digest);
    if (sh->compare == 1 && strcmp(digest, sh->digest))
        TEST_FAIL_AT("world %d stage %d resumed: digest %s, the uninterrupted run's %s", size,
                     sh->gc.stage, digest, sh->digest);
    if (sh->compare == 0 && rank == 0) memcpy(sh->digest, digest, sizeof digest);
    td_comm_destroy(comm);
}

static void graph_run(shared *sh, int world, gcfg c, int compare) {
    c.deterministic = 1;
    sh->gc = c;
    sh->compare = compare;
    CHECK_EQ(test_run_ranks(world, graph_rank, sh, 120, 0), 0);
}

/* Where python3 with torch is: Debian's (the one scripts/deps.sh installs), or NULL. */
static const char *torch_python(void) {
    return system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") == 0 ? "/usr/bin/python3"
                                                                              : NULL;
}

/* The graph model in PyTorch, its state_dict loaded strictly from the consolidated file (read
 * with the safetensors format's own few lines, as the Python package may be absent), printing
 * the sum of every parameter. */
static const char *TORCH_CHECK =
    "import json, struct, sys, torch\n"
    "raw = open(sys.argv[1], 'rb').read()\n"
    "n = struct.unpack('<Q', raw[:8])[0]\n"
    "head = json.loads(raw[8:8 + n])\n"
    "kinds = {'F32': torch.float32, 'BF16': torch.bfloat16, 'F16': torch.float16}\n"
    "sd = {}\n"
    "for k, v in head.items():\n"
    "    if k == '__metadata__': continue\n"
    "    a, b = v['data_offsets']\n"
    "    t = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]), dtype=kinds[v['dtype']])\n"
    "    sd[k] = t.reshape(v['shape'])\n"
    "class Net(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.fc1 = torch.nn.Linear(20, 96)\n"
    "        self.fc2 = torch.nn.Linear(96, 48)\n"
    "        self.head = torch.nn.Linear(48, 5)\n"
    "net = Net()\n"
    "net.load_state_dict(sd, strict=True)\n"
    "print('%.9e' % sum(p.double().sum().item() for p in net.parameters()))\n";

static void consolidated_file_loads_in_torch(const shared *sh) {
    char out[200], cmd[600], script[200];
    snprintf(out, sizeof out, "%s/model.safetensors", sh->dir);
    snprintf(cmd, sizeof cmd, "tandem-consolidate '%s' '%s' --model-only > /dev/null", sh->path,
             out);
    CHECK_EQ(system(cmd), 0);
    td_checkpoint *ck = NULL;
    CHECK_OK(td_checkpoint_open(&ck, out));
    if (!ck) return;
    CHECK_EQ(td_checkpoint_count(ck), 6); /* the parameters alone */
    double sum = 0;
    float buf[GPARAMS];
    for (size_t i = 0; i < td_checkpoint_count(ck); i++) {
        td_param t;
        CHECK_OK(td_checkpoint_tensor(ck, i, &t));
        CHECK(strncmp(t.name, "optim.", 6) != 0);
        t.data = buf;
        CHECK_OK(td_checkpoint_read(ck, &t, 1));
        for (size_t e = 0; e < t.count; e++) sum += buf[e];
    }
    td_checkpoint_close(ck);
    const char *py = torch_python();
    if (!py) {
        SKIP("python3-torch is not installed (sh scripts/deps.sh bench): no PyTorch load");
        return;
    }
    snprintf(script, sizeof script, "%s/check.py", sh->dir);
    test_write_file(script, TORCH_CHECK, strlen(TORCH_CHECK));
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 %s '%s' '%s' 2>&1", py, script, out);
    FILE *p = popen(cmd, "r");
    char line[512] = "";
    double torch_sum = NAN;
    if (p) {
        while (fgets(line, sizeof line, p))
            if (sscanf(line, "%lf", &torch_sum) != 1) fputs(line, stderr);
        CHECK_EQ(pclose(p), 0);
    }
    CHECK_NEAR(torch_sum, sum, 1e-6 * fabs(sum) + 1e-9);
}

static void deterministic_resume_is_bit_for_bit_and_torch_loads_it(void) {
    shared *sh = shared_new();
    CHECK(sh != NULL);
    if (!sh) return;
    graph_run(sh, 1, (gcfg){.stage = 0, .last_step = 4}, 0); /* deterministic DDP, 4 steps */
    graph_run(sh, 4, (gcfg){.stage = 3, .last_step = 2, .save = sh->path}, -1);
    gcfg resume = {.first_step = 2, .last_step = 4, .load = sh->path};
    resume.stage = 2;
    graph_run(sh, 2, resume, 1);
    resume.stage = 1;
    graph_run(sh, 1, resume, 1);
    resume.stage = 0;
    graph_run(sh, 2, resume, 1);
    consolidated_file_loads_in_torch(sh);
    CHECK_EQ(test_shm_leftovers(), 0);
    shared_free(sh);
}

/* ---- kill -9 during a save ----------------------------------------------------------------- */

enum { KILL_COUNT = 256 * 1024 }; /* a 1 MiB parameter, so a save takes a while */

/* Save k of trial t holds the value t * 1000 + k everywhere (and says so in its metadata); a
 * checkpoint must hold one save, whole. With die_after_ms >= 0 this rank dies that long after
 * its first save returned. */
static void saver(td_comm *comm, shared *sh, int trial, int die_after_ms) {
    static const char *names[2] = {"big.weight", "small.bias"};
    static float big[KILL_COUNT], small[37];
    td_param p[2] = {
        {.name = names[0],
         .data = big,
         .count = KILL_COUNT,
         .dtype = TD_F32,
         .ndim = 1,
         .shape = {KILL_COUNT}},
        {.name = names[1], .data = small, .count = 37, .dtype = TD_F32, .ndim = 1, .shape = {37}}};
    td_zero_params zp = td_zero_default_params();
    zp.stage = 3;
    td_zero *z = NULL;
    CHECK_OK(td_zero_create(&z, comm, p, 2, NULL, 0, &zp));
    if (!z) return;
    td_param *v;
    size_t n;
    CHECK_OK(td_zero_parameters(z, &v, &n));
    for (int k = 1; k < 1000; k++) {
        int value = trial * 1000 + k;
        for (size_t i = 0; i < n; i++)
            for (size_t e = 0; e < v[i].count; e++) ((float *)v[i].data)[e] = (float)value;
        char step[16];
        snprintf(step, sizeof step, "%d", value);
        td_checkpoint_meta meta = {"step", step};
        if (td_zero_save(z, NULL, sh->path, NULL, 0, &meta, 1) != TD_OK) break;
        if (td_comm_rank(comm) == 0) sh->last_committed = value;
        if (k == 1 && die_after_ms >= 0) { /* from now on this rank dies at a random moment */
            pid_t me = getpid();
            if (fork() == 0) {
                test_sleep_ms(die_after_ms);
                kill(me, SIGKILL);
                _exit(0);
            }
        }
    }
    td_zero_destroy(z);
}

static void saver_rank(int rank, int size, int port, void *arg) {
    shared *sh = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 10));
    if (!comm) return;
    /* Rank 1 dies; rank 0 sees its saves fail and leaves. */
    saver(comm, sh, sh->compare, rank == 1 ? (int)(td_time_ns() % 150) : -1);
    td_comm_destroy(comm);
}

/* The checkpoint holds one save, whole, no older than the last that returned. */
static void check_whole(const shared *sh) {
    td_checkpoint *ck = NULL;
    CHECK_OK(td_checkpoint_open(&ck, sh->path));
    if (!ck) return;
    int64_t step = -1;
    CHECK_OK(td_checkpoint_get_meta_i64(ck, "step", 1, 100000, &step));
    CHECK(step >= sh->last_committed);
    static float big[KILL_COUNT];
    float small[37];
    td_param p[2] = {{.name = "big.weight",
                      .data = big,
                      .count = KILL_COUNT,
                      .dtype = TD_F32,
                      .ndim = 1,
                      .shape = {KILL_COUNT}},
                     {.name = "small.bias",
                      .data = small,
                      .count = 37,
                      .dtype = TD_F32,
                      .ndim = 1,
                      .shape = {37}}};
    CHECK_OK(td_checkpoint_read(ck, p, 2));
    size_t wrong = 0;
    for (size_t e = 0; e < KILL_COUNT; e++) wrong += big[e] != (float)step;
    for (size_t e = 0; e < 37; e++) wrong += small[e] != (float)step;
    CHECK_EQ(wrong, 0);
    td_checkpoint_close(ck);
}

static void kill_9_during_sharded_saves_leaves_the_last_checkpoint(void) {
    shared *sh = shared_new();
    CHECK(sh != NULL);
    if (!sh) return;
    /* One process killed from outside at a random moment after its first save, six times. */
    for (int trial = 1; trial <= 6; trial++) {
        sh->last_committed = 0;
        pid_t pid = fork();
        if (pid == 0) {
            td_comm_params cp = td_comm_default_params();
            cp.rank = cp.local_rank = 0;
            cp.world_size = cp.local_world_size = 1;
            td_comm *comm = NULL;
            if (td_comm_create(&comm, &cp) != TD_OK) _exit(3);
            saver(comm, sh, trial, -1);
            _exit(0);
        }
        for (int waited = 0; !sh->last_committed && waited < 60000; waited += 5) test_sleep_ms(5);
        CHECK(sh->last_committed > 0);
        test_sleep_ms((int)(td_time_ns() % 150));
        kill(pid, SIGKILL);
        int status;
        waitpid(pid, &status, 0);
        check_whole(sh);
    }
    /* Two ranks, one dying mid-save: the other's save fails, the last commit stays. */
    for (int trial = 7; trial <= 9; trial++) {
        sh->last_committed = 0;
        sh->compare = trial;
        CHECK_EQ(test_run_ranks(2, saver_rank, sh, 60, 1), 0);
        check_whole(sh);
    }
    CHECK_EQ(test_shm_leftovers(), 0);
    shared_free(sh);
}

/* ---- damaged sets --------------------------------------------------------------------------- */

static void damaged_sharded_checkpoints_are_refused(void) {
    char dir[128], path[200], part[260], other[260];
    test_temp_dir(dir, sizeof dir, "zero_damaged");
    snprintf(path, sizeof path, "%s/ck.st", dir);
    float a[10], b[6];
    for (int i = 0; i < 10; i++) a[i] = (float)i;
    td_param whole = {.name = "w", .count = 16, .dtype = TD_F32, .ndim = 2, .shape = {4, 4}};
    td_checkpoint_part p0 = {whole, 0, 10, a}, p1 = {whole, 10, 6, b};
    CHECK_OK(td_checkpoint_save_part(path, 7, 0, 2, &p0, 1));
    /* Rank 1's part is missing: nothing is published, the error names the file. */
    CHECK_STATUS(td_checkpoint_publish(path, 7, 2, NULL, 0), TD_ENOTFOUND);
    CHECK(strstr(td_last_error(), "shard-0000000000000007-00001-of-00002") != NULL);
    CHECK(access(path, F_OK) != 0);
    /* A part that leaves a gap is refused too. */
    p1.offset = 11;
    p1.count = 5;
    CHECK_OK(td_checkpoint_save_part(path, 7, 1, 2, &p1, 1));
    CHECK_STATUS(td_checkpoint_publish(path, 7, 2, NULL, 0), TD_EFORMAT);
    CHECK(strstr(td_last_error(), "elements [10, 11) are in no part") != NULL);
    p1.offset = 10;
    p1.count = 6;
    CHECK_OK(td_checkpoint_save_part(path, 7, 1, 2, &p1, 1));
    td_checkpoint_meta meta = {"epoch", "3"};
    CHECK_OK(td_checkpoint_publish(path, 7, 2, &meta, 1));
    float got[16];
    td_param read = whole;
    read.data = got;
    CHECK_OK(td_checkpoint_load(path, &read, 1));
    CHECK(memcmp(got, a, sizeof a) == 0);
    float mid[4];
    td_checkpoint *ck = NULL;
    CHECK_OK(td_checkpoint_open(&ck, path));
    CHECK_OK(td_checkpoint_read_range(ck, "w", TD_F32, 8, 4, mid)); /* across both parts */
    CHECK(mid[0] == 8 && mid[1] == 9);
    CHECK_STATUS(td_checkpoint_read_range(ck, "w", TD_F32, 14, 4, mid), TD_ESHAPE);
    CHECK(td_checkpoint_get_meta(ck, "epoch") && !strcmp(td_checkpoint_get_meta(ck, "epoch"), "3"));
    td_checkpoint_close(ck);
    /* A later save of another id replaces the set and removes the old parts. */
    CHECK_OK(td_checkpoint_save_part(path, 8, 0, 1, &(td_checkpoint_part){whole, 0, 16, got}, 1));
    CHECK_OK(td_checkpoint_publish(path, 8, 1, NULL, 0));
    snprintf(part, sizeof part, "%s.shard-0000000000000007-00000-of-00002", path);
    CHECK(access(part, F_OK) != 0);
    CHECK_OK(td_checkpoint_load(path, &read, 1));
    /* A part file deleted under a published index: opening names it. */
    snprintf(other, sizeof other, "%s.shard-0000000000000008-00000-of-00001", path);
    CHECK_EQ(unlink(other), 0);
    CHECK_STATUS(td_checkpoint_load(path, &read, 1), TD_ENOTFOUND);
    CHECK(strstr(td_last_error(), "shard-0000000000000008-00000-of-00001") != NULL);
    /* Reserved metadata keys are refused. */
    td_checkpoint_meta bad = {"tandem.parts", "[]"};
    CHECK_STATUS(td_checkpoint_publish(path, 8, 1, &bad, 1), TD_EINVAL);
    test_remove_dir(dir);
}

int main(void) {
    RUN(world_4_checkpoint_resumes_at_1_2_3_and_in_ddp);
    RUN(deterministic_resume_is_bit_for_bit_and_torch_loads_it);
    RUN(kill_9_during_sharded_saves_leaves_the_last_checkpoint);
    RUN(damaged_sharded_checkpoints_are_refused);
    TEST_END();
}
