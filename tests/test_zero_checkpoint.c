/* td_zero's sharded checkpoints over real forked ranks.
 *
 * Checks: a checkpoint written at world 4 (stage 3) resumes at worlds 1, 2 and 3 under other
 * stages, and in td_ddp through td_checkpoint_load with no conversion, continuing as the
 * uninterrupted run does (1e-5 with AdamW; in deterministic mode the same SHA-256 as
 * deterministic DDP's uninterrupted run); a td_ddp checkpoint resumes under ZeRO; the
 * consolidated file (tandem-consolidate) loads in PyTorch with strict=True where Debian's
 * python3-torch is installed; kill -9 during sharded saves, at random moments, leaves the last
 * committed checkpoint whole; damaged sets are refused naming the file; so are a tensor of another
 * shape with as many elements, on every load path, a part file of another save under this save's
 * name, an index without its list of parts, and a consolidation onto the checkpoint's own files. */
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
    CHECK_OK(td_checkpoint_read_range(ck, &whole, 8, 4, mid)); /* across both parts */
    CHECK(mid[0] == 8 && mid[1] == 9);
    CHECK_STATUS(td_checkpoint_read_range(ck, &whole, 14, 4, mid), TD_ESHAPE);
    td_param flat = whole; /* as many elements, another shape */
    flat.ndim = 1;
    flat.shape[0] = 16;
    CHECK_STATUS(td_checkpoint_read_range(ck, &flat, 0, 4, mid), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "w: expected shape (16), file has (4, 4)") != NULL);
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

/* ---- a tensor of another shape ------------------------------------------------------------ */

/* Rewrites the checkpoint file `in` as `out`: tensor `name` (NULL: none) with its two dims
 * swapped, and the metadata values of keys[0..n_keys) with every `from` replaced by `to`. */
static void rewrite(const char *in, const char *out, const char *name, const char *const *keys,
                    size_t n_keys, const char *from, const char *to) {
    td_checkpoint *ck = NULL;
    CHECK_OK(td_checkpoint_open(&ck, in));
    if (!ck) return;
    size_t n = td_checkpoint_count(ck);
    td_param *t = calloc(n, sizeof *t);
    td_checkpoint_meta meta[8];
    char values[8][4096];
    for (size_t i = 0; i < n; i++) {
        CHECK_OK(td_checkpoint_tensor(ck, i, &t[i]));
        t[i].data = malloc(t[i].count * td_dtype_size(t[i].dtype) + 1);
        CHECK_OK(td_checkpoint_read(ck, &t[i], 1));
    }
    for (size_t i = 0; i < n; i++)
        if (name && !strcmp(t[i].name, name)) {
            int64_t d0 = t[i].shape[0];
            t[i].shape[0] = t[i].shape[1];
            t[i].shape[1] = d0;
        }
    for (size_t k = 0; k < n_keys; k++) {
        const char *v = td_checkpoint_get_meta(ck, keys[k]), *at;
        CHECK(v != NULL);
        size_t len = 0;
        for (; v && *v && len + (to ? strlen(to) : 0) + 1 < sizeof values[k];)
            if (from && (at = strstr(v, from)) == v) {
                len += (size_t)snprintf(values[k] + len, sizeof values[k] - len, "%s", to);
                v += strlen(from);
            } else {
                values[k][len++] = *v++;
            }
        values[k][len] = 0;
        meta[k] = (td_checkpoint_meta){keys[k], values[k]};
    }
    CHECK_OK(td_checkpoint_save(out, t, n, meta, n_keys));
    for (size_t i = 0; i < n; i++) free(t[i].data);
    free(t);
    td_checkpoint_close(ck);
}

/* The model of test_zero_train.h under every stage, loading sh->path (a checkpoint whose
 * fc1.weight, or the optimizer's state of it, is (7, 13) where the model's is (13, 7)). */
static void swapped_rank(int rank, int size, int port, void *arg) {
    shared *sh = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    for (int stage = 1; stage <= 3; stage++) {
        model m;
        model_init(&m, 11);
        td_zero_params zp = td_zero_default_params();
        zp.stage = stage;
        td_zero *z = NULL;
        td_param *shards = NULL;
        size_t n = 0;
        td_optim *opt = NULL;
        CHECK_OK(td_zero_create(&z, comm, m.p, NP, NULL, 0, &zp));
        if (z) CHECK_OK(td_zero_parameters(z, &shards, &n));
        td_adamw_params ap = td_adamw_default_params();
        if (z) CHECK_OK(td_optim_create_adamw(&opt, shards, n, &ap));
        if (opt) {
            CHECK_STATUS(td_zero_load(z, opt, sh->path, NULL, 0), TD_ESHAPE);
            if (!strstr(td_last_error(), "fc1.weight") ||
                !strstr(td_last_error(), "expected shape (13, 7), file has (7, 13)"))
                TEST_FAIL_AT("stage %d rank %d: %s", stage, rank, td_last_error());
        }
        td_optim_destroy(opt);
        td_zero_destroy(z);
        model_free(&m);
    }
    td_comm_destroy(comm);
}

/* A checkpoint whose fc1.weight is (7, 13) holds as many elements as the model's (13, 7): every
 * load refuses it naming both shapes (it used to load at stages 1 and 3, scrambled), from one
 * file and from a sharded checkpoint, for the parameter and for the optimizer's state of it. */
static void a_tensor_of_another_shape_is_refused_on_every_load_path(void) {
    shared *sh = shared_new();
    CHECK(sh != NULL);
    if (!sh) return;
    char good[160], ddp_bad[160];
    snprintf(good, sizeof good, "%s/good.st", sh->dir);
    snprintf(ddp_bad, sizeof ddp_bad, "%s/swapped.st", sh->dir);
    mlp_run(sh, 2, (run_cfg){.stage = 0, .micro = 1, .last_step = 1, .save = good}, -1);
    const char *swapped[] = {"fc1.weight", "optim.fc1.weight.exp_avg"};
    for (int k = 0; k < 2; k++) {
        rewrite(good, ddp_bad, swapped[k], NULL, 0, NULL, NULL);
        snprintf(sh->path, sizeof sh->path, "%s", ddp_bad);
        CHECK_EQ(test_run_ranks(2, swapped_rank, sh, 120, 0), 0);
    }
    /* td_checkpoint_load (a whole-model run's load) too */
    model m;
    model_init(&m, 11);
    rewrite(good, ddp_bad, "fc1.weight", NULL, 0, NULL, NULL);
    CHECK_STATUS(td_checkpoint_load(ddp_bad, m.p, NP), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "fc1.weight: expected shape (13, 7), file has (7, 13)") != NULL);
    model_free(&m);
    /* A sharded checkpoint whose parts all say (7, 13) for fc1.weight and its state. */
    snprintf(sh->path, sizeof sh->path, "%s/run.st", sh->dir);
    mlp_run(sh, 2, (run_cfg){.stage = 3, .micro = 1, .last_step = 1, .save = sh->path}, -1);
    td_checkpoint *ck = NULL;
    CHECK_OK(td_checkpoint_open(&ck, sh->path));
    char parts[2][200];
    const char *list = ck ? td_checkpoint_get_meta(ck, "tandem.parts") : NULL;
    CHECK(list && sscanf(list, "[\"%199[^\"]\",\"%199[^\"]\"]", parts[0], parts[1]) == 2);
    td_checkpoint_close(ck);
    static const char *keys[] = {"tandem.part", "tandem.save", "tandem.rank", "tandem.world_size"};
    for (int r = 0; r < 2 && list; r++) {
        char part[400];
        snprintf(part, sizeof part, "%s/%.199s", sh->dir, parts[r]);
        rewrite(part, part, NULL, keys, 4, "[13,7]", "[7,13]");
    }
    CHECK_EQ(test_run_ranks(2, swapped_rank, sh, 120, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
    shared_free(sh);
}

/* ---- parts of another save ----------------------------------------------------------------- */

/* `tandem-consolidate args` exits 1 saying `says`. */
static void consolidate_refuses(const char *args, const char *says) {
    char cmd[1200], out[2048] = "";
    snprintf(cmd, sizeof cmd, "tandem-consolidate %s 2>&1", args);
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(out, 1, sizeof out - 1, p) : 0;
    out[n] = 0;
    int status = p ? pclose(p) : -1;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 1 || !strstr(out, says))
        TEST_FAIL_AT("tandem-consolidate %s: status %d, wanted 1 and \"%s\", got:\n%s", args,
                     status, says, out);
}

/* Save `id` of w at `path` by 2 ranks, its elements all `value`. */
static void save_two_parts(const char *path, uint64_t id, float value) {
    float v[16];
    for (int i = 0; i < 16; i++) v[i] = value;
    td_param whole = {.name = "w", .count = 16, .dtype = TD_F32, .ndim = 2, .shape = {4, 4}};
    td_checkpoint_part p0 = {whole, 0, 10, v}, p1 = {whole, 10, 6, v};
    CHECK_OK(td_checkpoint_save_part(path, id, 0, 2, &p0, 1));
    CHECK_OK(td_checkpoint_save_part(path, id, 1, 2, &p1, 1));
    CHECK_OK(td_checkpoint_publish(path, id, 2, NULL, 0));
}

static void copy_file(const char *from, const char *to) {
    size_t n = 0;
    unsigned char *data = test_read_file(from, &n);
    CHECK(data != NULL);
    if (data) test_write_file(to, data, n);
    free(data);
}

/* The elements of w, from the checkpoint at path, are all `value`. */
static void holds(const char *path, float value) {
    float got[16];
    td_param w = {
        .name = "w", .data = got, .count = 16, .dtype = TD_F32, .ndim = 2, .shape = {4, 4}};
    CHECK_OK(td_checkpoint_load(path, &w, 1));
    for (int i = 0; i < 16; i++) CHECK(got[i] == value);
}

/* A part file of another save under this save's name (a later save's, another run's, a whole
 * other save's parts renamed) is refused by name when the index is opened, by resume and by
 * tandem-consolidate alike; so are this save's parts at each other's ranks, an index without its
 * list of parts, and a checkpoint with no tensors. Consolidating a checkpoint onto its own
 * index or part is refused, leaving it whole. */
static void parts_of_another_save_are_refused(void) {
    char dir[128], path[200], other[200], part[2][300], theirs[2][300], keep[2][300], args[800];
    test_temp_dir(dir, sizeof dir, "zero_parts");
    snprintf(path, sizeof path, "%s/ck.st", dir);
    snprintf(other, sizeof other, "%s/other.st", dir);
    save_two_parts(path, 0x1111, 1.0f);
    save_two_parts(other, 0x2222, 2.0f); /* another seed's run, the same tensors */
    for (int r = 0; r < 2; r++) {
        snprintf(part[r], sizeof part[r], "%s.shard-0000000000001111-%05d-of-00002", path, r);
        snprintf(theirs[r], sizeof theirs[r], "%s.shard-0000000000002222-%05d-of-00002", other, r);
        snprintf(keep[r], sizeof keep[r], "%s/kept-%d", dir, r);
        copy_file(part[r], keep[r]);
    }
    holds(path, 1.0f);
    /* one part of the other save under this save's name */
    copy_file(theirs[1], part[1]);
    float got[16];
    td_param w = {
        .name = "w", .data = got, .count = 16, .dtype = TD_F32, .ndim = 2, .shape = {4, 4}};
    CHECK_STATUS(td_checkpoint_load(path, &w, 1), TD_EFORMAT);
    CHECK(strstr(td_last_error(), part[1]) && strstr(td_last_error(), "another save"));
    CHECK(strstr(td_last_error(), "save 0000000000002222") &&
          strstr(td_last_error(), "save 0000000000001111"));
    snprintf(args, sizeof args, "%s %s/out.st", path, dir);
    consolidate_refuses(args, "another save");
    /* all the other save's parts under this save's names */
    copy_file(theirs[0], part[0]);
    CHECK_STATUS(td_checkpoint_load(path, &w, 1), TD_EFORMAT);
    CHECK(strstr(td_last_error(), part[0]) != NULL);
    /* this save's own parts, each under the other's name */
    copy_file(keep[1], part[0]);
    copy_file(keep[0], part[1]);
    CHECK_STATUS(td_checkpoint_load(path, &w, 1), TD_EFORMAT);
    CHECK(strstr(td_last_error(), "rank 1 of 2") && strstr(td_last_error(), "rank 0 of 2"));
    copy_file(keep[0], part[0]);
    copy_file(keep[1], part[1]);
    holds(path, 1.0f);
    /* tandem-consolidate X X, or onto a part: refused, the checkpoint left whole */
    snprintf(args, sizeof args, "%s %s", path, path);
    consolidate_refuses(args, "write the consolidated file elsewhere");
    snprintf(args, sizeof args, "%s %s", path, part[1]);
    consolidate_refuses(args, "is part 1 of the checkpoint");
    holds(path, 1.0f);
    CHECK(access(part[0], F_OK) == 0 && access(part[1], F_OK) == 0);
    /* an index that lost its list of parts, and a file of no tensors at all */
    char bare[200];
    snprintf(bare, sizeof bare, "%s/bare.st", dir);
    td_checkpoint_meta no_list[] = {{"step", "2"}, {"tandem.save", "0000000000001111"}};
    CHECK_OK(td_checkpoint_save(bare, NULL, 0, no_list, 2));
    CHECK_STATUS(td_checkpoint_load(bare, &w, 1), TD_EFORMAT);
    CHECK(strstr(td_last_error(), bare) && strstr(td_last_error(), "tandem.parts"));
    snprintf(args, sizeof args, "%s %s/out.st", bare, dir);
    consolidate_refuses(args, "tandem.parts");
    CHECK_OK(td_checkpoint_save(bare, NULL, 0, no_list, 1));
    consolidate_refuses(args, "holds no tensors");
    snprintf(args, sizeof args, "%s/out.st", dir);
    CHECK(access(args, F_OK) != 0);
    test_remove_dir(dir);
}

int main(void) {
    RUN(world_4_checkpoint_resumes_at_1_2_3_and_in_ddp);
    RUN(deterministic_resume_is_bit_for_bit_and_torch_loads_it);
    RUN(kill_9_during_sharded_saves_leaves_the_last_checkpoint);
    RUN(damaged_sharded_checkpoints_are_refused);
    RUN(a_tensor_of_another_shape_is_refused_on_every_load_path);
    RUN(parts_of_another_save_are_refused);
    TEST_END();
}
