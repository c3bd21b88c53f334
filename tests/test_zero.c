/* td_zero over real forked ranks on the shm backend.
 *
 * The hand-written MLP of test_zero_train.h trains the same global batch under td_ddp and under
 * each ZeRO stage at world sizes 1 to 4, with AdamW over the full parameters and over the rank's
 * shards: the parameters must agree to 1e-5, also with no_sync accumulation, gradient clipping, a
 * static loss scale and named units. The graph engine's small MLP checks deterministic mode (the
 * parameters' SHA-256 equals deterministic DDP's at worlds 1, 2 and 4), mixed precision O2 and
 * half-width reduce-scatters. A larger model checks that stage 3's memory per rank falls as 1/world
 * (counted, and the freed pages absent from memory per mincore); a pipeline whose stages' replicas
 * are ZeRO groups trains as with DDP's; bad options fail on every rank. */
#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "tandem/pipeline.h"
#include "tandem/zero.h"

#include "test.h"
#include "test_comm_util.h" /* test_run_ranks, test_comm_create, test_shm_leftovers */
#include "test_zero_train.h"

/* ---- the hand-written model: every stage equals DDP ------------------------------------ */

typedef struct {
    run_cfg cfg;
    int stages[3];
} equal_case;

static void equal_rank(int rank, int size, int port, void *arg) {
    const equal_case *ec = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    float want[400], got[400];
    double nw[STEPS] = {0}, ng[STEPS] = {0};
    run_cfg ddp = ec->cfg;
    ddp.stage = 0;
    train(comm, &ddp, want, nw);
    for (int k = 0; k < 3 && ec->stages[k]; k++) {
        run_cfg c = ec->cfg;
        c.stage = ec->stages[k];
        train(comm, &c, got, ng);
        double worst = 0;
        for (int e = 0; e < 294; e++) {
            double d = fabs((double)got[e] - want[e]);
            if (d > worst) worst = d;
        }
        if (worst > 1e-5)
            TEST_FAIL_AT("world %d stage %d: parameters differ from DDP's by %g", size, c.stage,
                         worst);
        for (int st = 0; c.clip > 0 && st < STEPS; st++) CHECK_NEAR(ng[st], nw[st], 1e-9 * nw[st]);
    }
    td_comm_destroy(comm);
}

static void run_equal(const equal_case *ec, int lo, int hi) {
    for (int w = lo; w <= hi; w++) CHECK_EQ(test_run_ranks(w, equal_rank, (void *)ec, 120, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

static void stages_equal_ddp_at_worlds_1_to_4(void) {
    equal_case ec = {.cfg = {.micro = 1}, .stages = {1, 2, 3}};
    run_equal(&ec, 1, 4);
}

static void no_sync_clipping_and_loss_scale_equal_ddp(void) {
    equal_case ec = {.cfg = {.micro = 2, .clip = 0.05, .loss_scale = 1024}, .stages = {1, 2, 3}};
    run_equal(&ec, 2, 3);
}

/* The whole gradients of three units in a ring of two: the third waits for the first's
 * reduce-scatter and writes over its slot, and the no_sync micro-batches accumulate at home. */
static void a_ring_reused_within_backward_equals_ddp(void) {
    equal_case ec = {.cfg = {.micro = 1, .small_ring = 1}, .stages = {2, 3}};
    run_equal(&ec, 2, 3);
    equal_case acc = {.cfg = {.micro = 2, .small_ring = 1, .clip = 0.05}, .stages = {2, 3}};
    run_equal(&acc, 2, 2);
    /* A trainer without the parameter-use calls writes every unit at its home. */
    equal_case home = {.cfg = {.micro = 1, .small_ring = 1, .no_use = 1}, .stages = {1, 2}};
    run_equal(&home, 2, 3);
}

static void named_units_equal_ddp(void) {
    equal_case ec = {.cfg = {.micro = 1, .named_units = 1}, .stages = {2, 3}};
    run_equal(&ec, 3, 3);
}

/* ---- the graph engine: deterministic mode, mixed precision ------------------------------ */

typedef struct {
    char ref[65];  /* deterministic DDP's digest at world 1, set by the parent */
    char seen[65]; /* what world 1's rank 0 computed (the case lives in shared memory) */
    gcfg cfg;
    double tol;
} graph_case;

static void graph_rank(int rank, int size, int port, void *arg) {
    graph_case *gc = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    static float want[GPARAMS], got[GPARAMS];
    char dw[65], dg[65];
    gcfg c = gc->cfg;
    c.stage = 0;
    gtrain(comm, &c, want, dw);
    if (gc->ref[0] && strcmp(dw, gc->ref))
        TEST_FAIL_AT("world %d: deterministic DDP's digest %s is not world 1's %s", size, dw,
                     gc->ref);
    for (int stage = 1; stage <= 3; stage++) {
        c.stage = stage;
        gtrain(comm, &c, got, dg);
        if (c.deterministic && strcmp(dg, dw))
            TEST_FAIL_AT("world %d stage %d: digest %s, deterministic DDP's %s", size, stage, dg,
                         dw);
        double worst = 0;
        for (int e = 0; e < GPARAMS; e++) worst = fmax(worst, fabs((double)got[e] - want[e]));
        if (worst > gc->tol)
            TEST_FAIL_AT("world %d stage %d: parameters differ from DDP's by %g", size, stage,
                         worst);
    }
    if (rank == 0) memcpy(gc->seen, dw, sizeof dw);
    td_comm_destroy(comm);
}

static void deterministic_digest_equals_deterministic_ddp_at_worlds_1_2_4(void) {
    graph_case *gc =
        mmap(NULL, sizeof *gc, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(gc != MAP_FAILED);
    if (gc == MAP_FAILED) return;
    memset(gc, 0, sizeof *gc);
    gc->cfg = (gcfg){.deterministic = 1, .amp = TD_AMP_O0, .comm_dtype = TD_F32};
    CHECK_EQ(test_run_ranks(1, graph_rank, gc, 120, 0), 0);
    memcpy(gc->ref, gc->seen, sizeof gc->ref);
    CHECK(gc->ref[0] != 0);
    CHECK_EQ(test_run_ranks(2, graph_rank, gc, 120, 0), 0);
    CHECK_EQ(test_run_ranks(4, graph_rank, gc, 120, 0), 0);
    CHECK_EQ(strcmp(gc->seen, gc->ref), 0);
    munmap(gc, sizeof *gc);
    CHECK_EQ(test_shm_leftovers(), 0);
}

static void mixed_precision_and_half_width_reductions_equal_ddp(void) {
    graph_case o2 = {.cfg = {.amp = TD_AMP_O2, .comm_dtype = TD_F32}, .tol = 1e-5};
    graph_case narrow = {.cfg = {.amp = TD_AMP_O0, .comm_dtype = TD_BF16}, .tol = 1e-5};
    CHECK_EQ(test_run_ranks(2, graph_rank, &o2, 120, 0), 0);
    CHECK_EQ(test_run_ranks(3, graph_rank, &narrow, 120, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* ---- memory ------------------------------------------------------------------------------ */

enum { MUNITS = 4, MCOUNT = 96 * 1024 }; /* 4 units of 384 KiB of f32 */

/* Pages of [p, p + bytes) that are in memory. */
static size_t resident_pages(const void *p, size_t bytes) {
    size_t ps = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)p / ps * ps, hi = ((uintptr_t)p + bytes + ps - 1) / ps * ps;
    size_t n = (hi - lo) / ps, count = 0;
    unsigned char *vec = malloc(n);
    if (vec && mincore((void *)lo, hi - lo, vec) == 0)
        for (size_t i = 0; i < n; i++) count += vec[i] & 1;
    free(vec);
    return count;
}

static void memory_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    static const char *names[MUNITS] = {"a.weight", "b.weight", "c.weight", "d.weight"};
    td_param p[MUNITS];
    float *mem = calloc((size_t)MUNITS * MCOUNT, sizeof(float));
    for (int u = 0; u < MUNITS; u++) {
        p[u] = (td_param){.name = names[u],
                          .data = mem + (size_t)u * MCOUNT,
                          .count = MCOUNT,
                          .dtype = TD_F32,
                          .ndim = 1,
                          .shape = {MCOUNT}};
        for (size_t e = 0; e < MCOUNT; e++) ((float *)p[u].data)[e] = 0.001f * (float)(e % 97);
    }
    td_zero_params zp = td_zero_default_params();
    zp.stage = 3;
    td_zero *z = NULL;
    CHECK_OK(td_zero_create(&z, comm, p, MUNITS, NULL, 0, &zp));
    if (!z) return;
    td_param *shards;
    size_t n;
    CHECK_OK(td_zero_parameters(z, &shards, &n));
    td_optim *opt = NULL;
    td_adamw_params ap = td_adamw_default_params();
    CHECK_OK(td_optim_create_adamw(&opt, shards, n, &ap));
    for (int step = 0; step < 2; step++) {
        CHECK_OK(td_zero_prepare_forward(z));
        for (int u = 0; u < MUNITS; u++) {
            CHECK_OK(td_zero_param_use(z, (size_t)u, TD_PARAM_BEFORE_FORWARD));
            CHECK_EQ(((float *)p[u].data)[MCOUNT - 1], 0.001f * (float)((MCOUNT - 1) % 97));
            CHECK_OK(td_zero_param_use(z, (size_t)u, TD_PARAM_AFTER_FORWARD));
        }
        for (int u = MUNITS - 1; u >= 0; u--) {
            CHECK_OK(td_zero_param_use(z, (size_t)u, TD_PARAM_BEFORE_BACKWARD));
            float *g = p[u].grad;
            for (size_t e = 0; e < MCOUNT; e++) g[e] += 1e-3f * (float)(rank + 1);
            CHECK_OK(td_zero_grad_ready(z, (size_t)u));
            CHECK_OK(td_zero_param_use(z, (size_t)u, TD_PARAM_AFTER_BACKWARD));
        }
        CHECK_OK(td_zero_finish_backward(z));
        CHECK_OK(td_optim_step(opt));
    }
    td_zero_memory mm = td_zero_memory_stats(z, opt);
    size_t whole = (size_t)MUNITS * MCOUNT * sizeof(float), unit = MCOUNT * sizeof(float);
    size_t slack = (size_t)MUNITS * 64 * (size_t)size; /* each flat's padding */
    CHECK(mm.now.params <= whole / (size_t)size + slack && mm.now.params >= whole / (size_t)size);
    CHECK(mm.now.grads <= whole / (size_t)size + slack && mm.now.grads >= whole / (size_t)size);
    CHECK(mm.now.optim >= 2 * whole / (size_t)size &&
          mm.now.optim <= 2 * (whole / (size_t)size + slack));
    CHECK_EQ(mm.now.gathered, 0);
    CHECK_EQ(mm.now.reducing, 0);
    /* The whole gradients' ring and the parked pages of freed gathered copies stay for the next
     * step: cached, not counted as gradients or gathered copies. */
    size_t parked = mm.now.cached - whole; /* the ring holds every unit's whole gradient */
    CHECK(mm.now.cached >= whole);
    CHECK(size == 1 ? parked == 0 : parked > 0 && parked <= 2 * unit);
    /* At most the unit in use and the prefetched one gathered at once. */
    CHECK(mm.peak.gathered <= 2 * unit * (size_t)(size - 1) / (size_t)size + slack);
    CHECK(size == 1 || mm.peak.gathered > 0);
    /* The pages outside this rank's chunks are out of memory, not just uncounted. */
    size_t ps = (size_t)sysconf(_SC_PAGESIZE), in = 0;
    for (int u = 0; u < MUNITS; u++) in += resident_pages(p[u].data, unit);
    CHECK(in * ps <= whole / (size_t)size + (size_t)MUNITS * 2 * ps);
    if (rank == 0)
        printf("world %d: params %zu grads %zu optim %zu cached %zu bytes now, gathered peak %zu, "
               "resident parameter pages %zu KiB\n",
               size, mm.now.params, mm.now.grads, mm.now.optim, mm.now.cached, mm.peak.gathered,
               in * ps >> 10);
    td_optim_destroy(opt);
    td_zero_destroy(z);
    free(mem);
    td_comm_destroy(comm);
}

static void stage3_memory_falls_as_one_over_world(void) {
    for (int w = 1; w <= 4; w *= 2) CHECK_EQ(test_run_ranks(w, memory_rank, NULL, 120, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* ---- the pipeline: a sharded group per stage ------------------------------------------- */

enum { PP_BATCH = 32, PP_STEPS = 3 };
#define PP_MAX_NORM 0.2 /* below the first steps' norms: the clip scales the shards */

typedef struct {
    float loss[4][PP_STEPS];  /* the last stage's losses under DDP and stages 1-3 */
    double norm[4][PP_STEPS]; /* the whole model's gradient norm before clipping */
} pipe_losses;

static void pipeline_rank(int rank, int size, int port, void *arg) {
    pipe_losses *out = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    td_sequential *seq = NULL;
    CHECK_OK(td_model_sequential(TD_MODEL_MLP, &seq));
    static float x[PP_BATCH * 784];
    int64_t y[PP_BATCH];
    size_t whole = 0;
    for (int way = 0; way < 4 && seq; way++) {
        td_pipeline_params pp = td_pipeline_default_params();
        pp.stages = 2;
        pp.micro_batches = 2;
        pp.batch = PP_BATCH;
        pp.split = "fc2";
        pp.zero_stage = way;
        td_pipeline *pl = NULL;
        CHECK_OK(td_pipeline_create(&pl, comm, seq, &pp));
        if (!pl) break;
        td_param *params;
        size_t n, elements = 0;
        CHECK_OK(td_pipeline_parameters(pl, &params, &n));
        /* With ZeRO the optimizer gets this rank's half of its stage's parameters. */
        for (size_t i = 0; i < n; i++) elements += params[i].count;
        if (way == 0)
            whole = elements;
        else
            CHECK(elements * 2 <= whole + 4096 && elements * 2 + 4096 >= whole);
        td_sgd_params sp = td_sgd_default_params();
        sp.lr = 0.05;
        sp.momentum = 0.9;
        td_optim *opt = NULL;
        CHECK_OK(td_optim_create_sgd(&opt, params, n, &sp));
        td_pipeline_info info = td_pipeline_get_info(pl);
        for (int step = 0; step < PP_STEPS && opt; step++) {
            uint32_t w[4];
            for (int k = 0; k < PP_BATCH * 784; k++) {
                td_philox4x32_stream(31, (uint64_t)(step * 2 + info.replica), (uint64_t)k, w);
                x[k] = (float)(w[0] >> 8) / 16777216.0f;
            }
            for (int k = 0; k < PP_BATCH; k++) y[k] = (k + step + info.replica) % 10;
            float loss = NAN;
            CHECK_OK(td_pipeline_step(pl, x, y, &loss));
            double norm = NAN;
            CHECK_OK(td_pipeline_clip_grad_norm(pl, PP_MAX_NORM, &norm));
            CHECK_OK(td_optim_step(opt));
            if (info.stage == 1 && info.replica == 0) out->loss[way][step] = loss;
            if (rank == 0) out->norm[way][step] = norm;
        }
        td_optim_destroy(opt);
        td_pipeline_destroy(pl);
    }
    td_sequential_destroy(seq);
    td_comm_destroy(comm);
}

static void pipeline_with_a_sharded_group_per_stage_equals_ddp(void) {
    pipe_losses *out =
        mmap(NULL, sizeof *out, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(out != MAP_FAILED);
    if (out == MAP_FAILED) return;
    memset(out, 0, sizeof *out);
    CHECK_EQ(test_run_ranks(4, pipeline_rank, out, 240, 0), 0); /* 2 stages x 2 replicas */
    for (int way = 1; way < 4; way++)
        for (int step = 0; step < PP_STEPS; step++) {
            CHECK_NEAR(out->loss[way][step], out->loss[0][step], 1e-6 * fabs(out->loss[0][step]));
            CHECK_NEAR(out->norm[way][step], out->norm[0][step], 1e-5 * out->norm[0][step]);
        }
    CHECK(out->norm[0][0] > PP_MAX_NORM);
    CHECK(out->loss[0][PP_STEPS - 1] > 0 && out->loss[0][PP_STEPS - 1] < out->loss[0][0]);
    munmap(out, sizeof *out);
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* ---- refusals ----------------------------------------------------------------------------- */

typedef struct {
    int bad_rank; /* the rank that passes the bad option, -1: all */
    int stage;
    const char *unit;
    td_status want;
    const char *words;
} refusal;

static void refusal_rank(int rank, int size, int port, void *arg) {
    const refusal *r = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 30));
    if (!comm) return;
    model m;
    model_init(&m, 3);
    td_zero_params zp = td_zero_default_params();
    const char *units[] = {"fc1", r->unit};
    int bad = r->bad_rank < 0 || r->bad_rank == rank;
    zp.stage = bad ? r->stage : 2;
    if (r->unit && bad) {
        zp.units = units;
        zp.n_units = 2;
    }
    td_zero *z = NULL;
    CHECK_STATUS(td_zero_create(&z, comm, m.p, NP, NULL, 0, &zp), r->want);
    if (!strstr(td_last_error(), r->words))
        TEST_FAIL_AT("rank %d: '%s' does not say '%s'", rank, td_last_error(), r->words);
    /* each layer says who it is once: "zero rank 1: rank 0: stage 4 ...", on the rank that
     * failed "zero rank 0: stage 4 ..." */
    const char *said = td_last_error(), *at = said;
    int layers = 0;
    for (; (at = strstr(at, "zero rank ")) != NULL; at++) layers++;
    if (layers != 1 || strncmp(said, "zero rank ", 10))
        TEST_FAIL_AT("rank %d: '%s' does not name the layer once, first", rank, said);
    CHECK(z == NULL);
    CHECK(m.p[0].data == m.data); /* nothing moved */
    model_free(&m);
    td_comm_destroy(comm);
}

/* A forward with no backward after it (an evaluation) keeps its last units whole for the backward
 * that would reuse them; the next forward gathers them again, so a shard written meanwhile
 * (a load, a hand-made update) is what every rank sees. */
static void stale_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    model m;
    model_init(&m, 3);
    td_zero_params zp = td_zero_default_params();
    zp.stage = 3;
    td_zero *z = NULL;
    CHECK_OK(td_zero_create(&z, comm, m.p, NP, NULL, 0, &zp));
    td_param *shards = NULL;
    size_t n = 0;
    if (z) CHECK_OK(td_zero_parameters(z, &shards, &n));
    for (int pass = 0; z && pass < 2; pass++) {
        CHECK_OK(td_zero_prepare_forward(z));
        for (int i = 0; i < NP; i++) {
            CHECK_OK(td_zero_param_use(z, (size_t)i, TD_PARAM_BEFORE_FORWARD));
            if (pass == 1)
                for (size_t e = 0; e < m.p[i].count; e++)
                    if (((float *)m.p[i].data)[e] != 0.5f) {
                        TEST_FAIL_AT("rank %d: '%s'[%zu] is %g after the shards were set to 0.5",
                                     rank, m.p[i].name, e, ((float *)m.p[i].data)[e]);
                        break;
                    }
            CHECK_OK(td_zero_param_use(z, (size_t)i, TD_PARAM_AFTER_FORWARD));
        }
        for (size_t v = 0; v < n; v++)
            for (size_t e = 0; e < shards[v].count; e++) ((float *)shards[v].data)[e] = 0.5f;
    }
    td_zero_destroy(z);
    model_free(&m);
    td_comm_destroy(comm);
}

static void a_forward_without_backward_leaves_no_stale_copy(void) {
    CHECK_EQ(test_run_ranks(2, stale_rank, NULL, 60, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* Stage 3 without the parameter-use calls would compute on zeros: the step says so. */
static void stage3_without_the_hooks_is_an_error(void) {
    td_comm_params cp = td_comm_default_params();
    cp.rank = cp.local_rank = 0;
    cp.world_size = cp.local_world_size = 1;
    td_comm *comm = NULL;
    CHECK_OK(td_comm_create(&comm, &cp));
    model m;
    model_init(&m, 3);
    td_zero_params zp = td_zero_default_params();
    zp.stage = 3;
    td_zero *z = NULL;
    CHECK_OK(td_zero_create(&z, comm, m.p, NP, NULL, 0, &zp));
    if (z) {
        sync_t s = {.zero = NULL}; /* the trainer forgets to tell ZeRO of its reads */
        CHECK_OK(td_zero_prepare_forward(z));
        forward_backward(&m, 0, 0, 4, 1.0f, &s);
        for (int i = 0; i < NP; i++) CHECK_OK(td_zero_grad_ready(z, (size_t)i));
        CHECK_STATUS(td_zero_finish_backward(z), TD_ESTATE);
        CHECK(strstr(td_last_error(), "td_graph_set_param_use_hook") != NULL);
        td_zero_destroy(z);
    }
    model_free(&m);
    td_comm_destroy(comm);
}

static void bad_options_fail_on_every_rank(void) {
    refusal cases[] = {
        {-1, 4, NULL, TD_EINVAL, "stage 4, expected 1, 2 or 3"},
        {1, 3, NULL, TD_EINVAL, "rank 0 has stage 2"},
        {1, 2, "decoder", TD_ENOTFOUND, "unit 'decoder' begins at no parameter"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        CHECK_EQ(test_run_ranks(2, refusal_rank, &cases[c], 30, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

int main(void) {
    RUN(stages_equal_ddp_at_worlds_1_to_4);
    RUN(no_sync_clipping_and_loss_scale_equal_ddp);
    RUN(named_units_equal_ddp);
    RUN(a_ring_reused_within_backward_equals_ddp);
    RUN(deterministic_digest_equals_deterministic_ddp_at_worlds_1_2_4);
    RUN(mixed_precision_and_half_width_reductions_equal_ddp);
    RUN(stage3_memory_falls_as_one_over_world);
    RUN(pipeline_with_a_sharded_group_per_stage_equals_ddp);
    RUN(a_forward_without_backward_leaves_no_stale_copy);
    RUN(stage3_without_the_hooks_is_an_error);
    RUN(bad_options_fail_on_every_rank);
    TEST_END();
}
