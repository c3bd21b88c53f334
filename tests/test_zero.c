/* td_zero over real forked ranks on the shm backend.
 *
 * A hand-written MLP whose parameter counts divide no world size (91, 13, 143, 11, 33, 3
 * elements) trains the same global batch under td_ddp and under each ZeRO stage at world sizes 1
 * to 4, with AdamW over the full parameters and over the rank's shards: the parameters must agree
 * to 1e-5, also with no_sync accumulation, gradient clipping, a static loss scale and named
 * units. The graph engine's small MLP checks deterministic mode (the parameters' SHA-256 equals
 * deterministic DDP's at worlds 1, 2 and 4), mixed precision O2 and half-width reduce-scatters.
 * A larger model checks that stage 3's memory per rank falls as 1/world (counted, and the
 * freed pages absent from memory per mincore), and bad options fail on every rank. */
#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "tandem/data.h"
#include "tandem/ddp.h"
#include "tandem/graph.h"
#include "tandem/nn.h"
#include "tandem/optim.h"
#include "tandem/zero.h"

#include "test.h"
#include "test_comm_util.h" /* test_run_ranks, test_comm_create, test_shm_leftovers */

/* ---- the hand-written model ------------------------------------------------------------ */

enum { NL = 3, NP = 6, B = 24, B_MAX = 24, STEPS = 4 };
static const int DIM[NL + 1] = {7, 13, 11, 3};
static const char *NAMES[NP] = {"fc1.weight", "fc1.bias",    "fc2.weight",
                                "fc2.bias",   "head.weight", "head.bias"};

typedef struct {
    td_param p[NP];
    float *data, *grad;
} model;

static void model_init(model *m, uint64_t seed) {
    memset(m, 0, sizeof *m);
    size_t total = 0;
    for (int l = 0; l < NL; l++) total += (size_t)(DIM[l + 1] * DIM[l] + DIM[l + 1]);
    m->data = calloc(total, sizeof(float));
    m->grad = calloc(total, sizeof(float));
    td_rng rng;
    td_rng_init(&rng, seed);
    size_t off = 0;
    for (int i = 0; i < NP; i++) {
        int l = i / 2, w = i % 2 == 0;
        td_param *p = &m->p[i];
        p->name = NAMES[i];
        p->ndim = w ? 2 : 1;
        p->shape[0] = DIM[l + 1];
        p->shape[1] = w ? DIM[l] : 0;
        p->count = (size_t)(w ? DIM[l + 1] * DIM[l] : DIM[l + 1]);
        p->dtype = TD_F32;
        p->data = m->data + off;
        p->grad = m->grad + off;
        td_rng_fill_uniform(&rng, p->data, p->count, w ? -0.5f : -0.1f, w ? 0.5f : 0.1f);
        off += p->count;
    }
}

static void model_free(model *m) {
    free(m->data);
    free(m->grad);
}

/* The global batch: sample s's inputs and targets, the same whoever computes them. */
static void sample(int step, int s, float *x, float *t) {
    uint32_t w[4];
    for (int j = 0; j < DIM[0]; j++) {
        td_philox4x32_stream(77 + (uint64_t)step, (uint64_t)s, (uint64_t)j, w);
        x[j] = (float)(w[0] >> 8) / 16777216.0f * 2.0f - 1.0f;
    }
    for (int j = 0; j < DIM[NL]; j++) t[j] = sinf((float)(s + j + step));
}

/* Whatever averages the gradients: nothing (one process), td_ddp or td_zero. */
typedef struct {
    td_ddp *ddp;
    td_zero *zero;
} sync_t;

static void ready(sync_t *s, int i) {
    if (s->zero)
        CHECK_OK(td_zero_grad_ready(s->zero, (size_t)i));
    else if (s->ddp)
        CHECK_OK(td_ddp_grad_ready(s->ddp, (size_t)i));
}

static void use(sync_t *s, int layer, td_param_use u) {
    if (!s->zero) return;
    CHECK_OK(td_zero_param_use(s->zero, (size_t)(2 * layer), u));
    CHECK_OK(td_zero_param_use(s->zero, (size_t)(2 * layer + 1), u));
}

/* Samples [first, first + n) of step `step`: the mean over them of 0.5 |y - t|^2, times
 * `weight` (the samples' share of the global batch, times the ranks the average divides by);
 * backward accumulates (+=). Parameters and gradients are read through the td_param entries,
 * as ZeRO moves them, and the hooks come where a graph would call them. */
static void forward_backward(model *m, int step, int first, int n, float weight, sync_t *s) {
    static float act[NL + 1][B_MAX * 16], dz[B_MAX * 16], da[B_MAX * 16], t[B_MAX * 16];
    for (int k = 0; k < n; k++) sample(step, first + k, &act[0][k * DIM[0]], &t[k * DIM[NL]]);
    for (int l = 0; l < NL; l++) {
        use(s, l, TD_PARAM_BEFORE_FORWARD);
        const float *W = m->p[2 * l].data, *b = m->p[2 * l + 1].data;
        for (int k = 0; k < n; k++)
            for (int o = 0; o < DIM[l + 1]; o++) {
                float acc = b[o];
                for (int i = 0; i < DIM[l]; i++) acc += W[o * DIM[l] + i] * act[l][k * DIM[l] + i];
                act[l + 1][k * DIM[l + 1] + o] = l + 1 < NL ? tanhf(acc) : acc;
            }
        use(s, l, TD_PARAM_AFTER_FORWARD);
    }
    for (int k = 0; k < n * DIM[NL]; k++) dz[k] = weight * (act[NL][k] - t[k]) / (float)n;
    for (int l = NL - 1; l >= 0; l--) {
        use(s, l, TD_PARAM_BEFORE_BACKWARD);
        float *gW = m->p[2 * l].grad, *gb = m->p[2 * l + 1].grad;
        const float *W = m->p[2 * l].data;
        int I = DIM[l], O = DIM[l + 1];
        for (int o = 0; o < O; o++) {
            for (int i = 0; i < I; i++) {
                float acc = 0;
                for (int k = 0; k < n; k++) acc += dz[k * O + o] * act[l][k * I + i];
                gW[o * I + i] += acc;
            }
            float acc = 0;
            for (int k = 0; k < n; k++) acc += dz[k * O + o];
            gb[o] += acc;
        }
        if (l > 0) {
            for (int k = 0; k < n; k++)
                for (int i = 0; i < I; i++) {
                    float acc = 0;
                    for (int o = 0; o < O; o++) acc += dz[k * O + o] * W[o * I + i];
                    float a = act[l][k * I + i];
                    da[k * I + i] = acc * (1 - a * a);
                }
            memcpy(dz, da, (size_t)(n * I) * sizeof(float));
        }
        ready(s, 2 * l); /* after the data gradient: stage 3 frees the unit then */
        ready(s, 2 * l + 1);
    }
}

/* ---- training runs ---------------------------------------------------------------------- */

typedef struct {
    int stage;        /* 0: td_ddp, else the ZeRO stage */
    int micro;        /* micro-batches per step, the first ones under no_sync */
    double clip;      /* > 0: clip the gradients' norm to this */
    float loss_scale; /* > 0: a static td_grad_scaler-like scale, undone before the step */
    int named_units;  /* units {"fc1", "head"}: fc1 and fc2 share one */
} run_cfg;

/* Trains STEPS steps of the global batch B on this rank's slice and leaves the parameters,
 * whole, in out (the norms of the clipped steps in norms). */
static void train(td_comm *comm, const run_cfg *c, float *out, double *norms) {
    int rank = td_comm_rank(comm), world = td_comm_size(comm);
    model m;
    model_init(&m, 11 + (uint64_t)rank); /* rank 0's values win at creation */
    sync_t s = {0};
    td_param *opt_params = m.p;
    size_t n_opt = NP;
    if (c->stage == 0) {
        CHECK_OK(td_ddp_create(&s.ddp, comm, m.p, NP, NULL, 0, NULL));
    } else {
        td_zero_params zp = td_zero_default_params();
        static const char *units[] = {"fc1", "head"};
        zp.stage = c->stage;
        if (c->named_units) {
            zp.units = units;
            zp.n_units = 2;
        }
        CHECK_OK(td_zero_create(&s.zero, comm, m.p, NP, NULL, 0, &zp));
        CHECK_OK(td_zero_parameters(s.zero, &opt_params, &n_opt));
    }
    if (!s.ddp && !s.zero) return;
    td_adamw_params ap = td_adamw_default_params();
    ap.lr = 0.01;
    td_optim *opt = NULL;
    CHECK_OK(td_optim_create_adamw(&opt, opt_params, n_opt, &ap));
    size_t first, count;
    td_split_even(B, world, rank, &first, &count);
    float weight = (float)world * (float)count / (float)B; /* this rank's share of the mean */
    for (int step = 0; step < STEPS; step++) {
        if (s.zero)
            CHECK_OK(td_zero_prepare_forward(s.zero));
        else
            CHECK_OK(td_ddp_prepare_forward(s.ddp));
        for (int mb = 0; mb < c->micro; mb++) {
            int last = mb + 1 == c->micro;
            if (s.zero)
                CHECK_OK(td_zero_set_sync(s.zero, last));
            else
                CHECK_OK(td_ddp_set_sync(s.ddp, last));
            size_t lo = first + count * (size_t)mb / (size_t)c->micro;
            size_t hi = first + count * (size_t)(mb + 1) / (size_t)c->micro;
            float w = weight * (float)(hi - lo) / (float)count;
            forward_backward(&m, step, (int)lo, (int)(hi - lo),
                             w * (c->loss_scale > 0 ? c->loss_scale : 1.0f), &s);
            if (s.zero)
                CHECK_OK(td_zero_finish_backward(s.zero));
            else
                CHECK_OK(td_ddp_finish_backward(s.ddp));
        }
        td_param *g;
        size_t ng;
        td_optim_parameters(opt, &g, &ng);
        if (c->loss_scale > 0)
            for (size_t i = 0; i < ng; i++)
                for (size_t e = 0; e < g[i].count; e++) ((float *)g[i].grad)[e] /= c->loss_scale;
        if (c->clip > 0) {
            if (s.zero)
                CHECK_OK(td_zero_clip_grad_norm(s.zero, c->clip, &norms[step]));
            else
                CHECK_OK(td_clip_grad_norm(m.p, NP, c->clip, &norms[step]));
        }
        CHECK_OK(td_optim_step(opt));
        if (s.zero)
            td_zero_zero_grad(s.zero);
        else
            td_ddp_zero_grad(s.ddp);
    }
    if (s.zero) CHECK_OK(td_zero_full_params(s.zero, 1));
    size_t off = 0;
    for (int i = 0; i < NP; i++) {
        memcpy(out + off, m.p[i].data, m.p[i].count * sizeof(float));
        off += m.p[i].count;
    }
    td_optim_destroy(opt);
    td_ddp_destroy(s.ddp);
    td_zero_destroy(s.zero);
    model_free(&m);
}

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

static void named_units_equal_ddp(void) {
    equal_case ec = {.cfg = {.micro = 1, .named_units = 1}, .stages = {2, 3}};
    run_equal(&ec, 3, 3);
}

/* ---- the graph engine: deterministic mode, mixed precision -------------------------------- */

enum { GIN = 20, GCLASSES = 5, SHARDS = 8, SHARD_BATCH = 4, GSTEPS = 3 };

typedef struct {
    td_graph *g;
    td_tensor *x, *labels, *loss;
    td_param *params;
    size_t n_params;
} gmodel;

static void gmodel_build(gmodel *m, int64_t batch, td_amp_level amp) {
    td_graph_params gp = td_graph_default_params();
    gp.amp.level = amp;
    CHECK_OK(td_graph_create(&m->g, &gp));
    td_rng rng;
    td_rng_init(&rng, 5);
    td_tensor *h;
    CHECK_OK(td_graph_input(m->g, "x", td_shape_2d(batch, GIN), TD_F32, 0, &m->x));
    CHECK_OK(td_graph_input(m->g, "labels", td_shape_1d(batch), TD_I64, 0, &m->labels));
    CHECK_OK(td_nn_linear(m->g, "fc1", m->x, 33, 1, &rng, &h));
    CHECK_OK(td_graph_relu(m->g, h, &h));
    CHECK_OK(td_nn_linear(m->g, "fc2", h, 17, 1, &rng, &h));
    CHECK_OK(td_graph_relu(m->g, h, &h));
    CHECK_OK(td_nn_linear(m->g, "head", h, GCLASSES, 1, &rng, &h));
    CHECK_OK(td_graph_cross_entropy(m->g, h, m->labels, TD_REDUCTION_MEAN, &m->loss, NULL));
    CHECK_OK(td_graph_compile(m->g));
    CHECK_OK(td_graph_parameters(m->g, &m->params, &m->n_params));
}

/* Samples [first, first + n) of step `step` into the graph's inputs. */
static void gmodel_feed(gmodel *m, int step, size_t first, size_t n) {
    float x[64 * GIN];
    int64_t y[64];
    uint32_t w[4];
    for (size_t k = 0; k < n; k++) {
        for (int j = 0; j < GIN; j++) {
            td_philox4x32_stream(900 + (uint64_t)step, first + k, (uint64_t)j, w);
            x[k * GIN + (size_t)j] = (float)(w[0] >> 8) / 16777216.0f * 2.0f - 1.0f;
        }
        y[k] = (int64_t)((first + k + (size_t)step) % GCLASSES);
    }
    CHECK_OK(td_tensor_write(m->x, x));
    CHECK_OK(td_tensor_write(m->labels, y));
}

typedef struct {
    int stage; /* 0: DDP */
    int deterministic;
    td_amp_level amp;
    td_dtype comm_dtype;
} gcfg;

/* GSTEPS steps of SGD with momentum; the parameters whole in out (as f32) and their digest. */
static void gtrain(td_comm *comm, const gcfg *c, float *out, char digest[65]) {
    int rank = td_comm_rank(comm), world = td_comm_size(comm);
    gmodel m;
    int64_t batch = c->deterministic ? SHARD_BATCH : SHARD_BATCH * SHARDS / world;
    gmodel_build(&m, batch, c->amp);
    td_ddp_params dp = td_ddp_default_params();
    dp.deterministic = c->deterministic;
    dp.shards = SHARDS;
    dp.comm_dtype = c->comm_dtype;
    td_ddp *ddp = NULL;
    td_zero *zero = NULL;
    td_param *op = m.params;
    size_t nop = m.n_params;
    if (c->stage == 0) {
        CHECK_OK(td_ddp_create(&ddp, comm, m.params, m.n_params, NULL, 0, &dp));
        td_graph_set_grad_ready_hook(m.g, td_ddp_grad_ready_hook, ddp);
    } else {
        td_zero_params zp = td_zero_default_params();
        zp.stage = c->stage;
        zp.ddp = dp;
        CHECK_OK(td_zero_create(&zero, comm, m.params, m.n_params, NULL, 0, &zp));
        td_graph_set_grad_ready_hook(m.g, td_zero_grad_ready_hook, zero);
        td_graph_set_param_use_hook(m.g, td_zero_param_use_hook, zero);
        CHECK_OK(td_zero_parameters(zero, &op, &nop));
    }
    td_sgd_params sp = td_sgd_default_params();
    sp.lr = 0.1;
    sp.momentum = 0.9;
    td_optim *opt = NULL;
    CHECK_OK(td_optim_create_sgd(&opt, op, nop, &sp));
    size_t first = (size_t)rank * SHARD_BATCH * SHARDS / (size_t)world;
    size_t passes = c->deterministic ? SHARDS / (size_t)world : 1;
    for (int step = 0; step < GSTEPS && opt; step++) {
        for (size_t j = 0; j < passes; j++) {
            CHECK_OK(zero ? td_zero_prepare_forward(zero) : td_ddp_prepare_forward(ddp));
            gmodel_feed(&m, step, first + j * (size_t)batch, (size_t)batch);
            CHECK_OK(td_graph_forward(m.g));
            float loss = *(float *)td_tensor_data(m.loss);
            if (zero)
                td_zero_set_loss(zero, loss);
            else
                td_ddp_set_loss(ddp, loss);
            CHECK_OK(td_graph_zero_grad(m.g));
            CHECK_OK(td_graph_backward(m.g, m.loss));
            CHECK_OK(zero ? td_zero_finish_backward(zero) : td_ddp_finish_backward(ddp));
        }
        CHECK_OK(td_optim_step(opt));
    }
    if (zero) CHECK_OK(td_zero_full_params(zero, 1));
    td_params_sha256(m.params, m.n_params, digest);
    size_t off = 0;
    for (size_t i = 0; i < m.n_params; i++) {
        for (size_t e = 0; e < m.params[i].count; e++)
            out[off + e] = m.params[i].dtype == TD_F32
                               ? ((float *)m.params[i].data)[e]
                               : (float)test_elem_get(m.params[i].dtype, m.params[i].data, e);
        off += m.params[i].count;
    }
    td_graph_set_grad_ready_hook(m.g, NULL, NULL);
    td_graph_set_param_use_hook(m.g, NULL, NULL);
    td_optim_destroy(opt);
    td_ddp_destroy(ddp);
    td_zero_destroy(zero);
    td_graph_destroy(m.g);
}

enum { GPARAMS = GIN * 33 + 33 + 33 * 17 + 17 + 17 * GCLASSES + GCLASSES };

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
    /* At most the unit in use and the prefetched one gathered at once. */
    CHECK(mm.peak.gathered <= 2 * unit * (size_t)(size - 1) / (size_t)size + slack);
    CHECK(size == 1 || mm.peak.gathered > 0);
    /* The pages outside this rank's chunks are out of memory, not just uncounted. */
    size_t ps = (size_t)sysconf(_SC_PAGESIZE), in = 0;
    for (int u = 0; u < MUNITS; u++) in += resident_pages(p[u].data, unit);
    CHECK(in * ps <= whole / (size_t)size + (size_t)MUNITS * 2 * ps);
    if (rank == 0)
        printf("world %d: params %zu grads %zu optim %zu bytes now, gathered peak %zu, "
               "resident parameter pages %zu KiB\n",
               size, mm.now.params, mm.now.grads, mm.now.optim, mm.peak.gathered, in * ps >> 10);
    td_optim_destroy(opt);
    td_zero_destroy(z);
    free(mem);
    td_comm_destroy(comm);
}

static void stage3_memory_falls_as_one_over_world(void) {
    for (int w = 1; w <= 4; w *= 2) CHECK_EQ(test_run_ranks(w, memory_rank, NULL, 120, 0), 0);
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
    CHECK(z == NULL);
    CHECK(m.p[0].data == m.data); /* nothing moved */
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
    RUN(deterministic_digest_equals_deterministic_ddp_at_worlds_1_2_4);
    RUN(mixed_precision_and_half_width_reductions_equal_ddp);
    RUN(stage3_memory_falls_as_one_over_world);
    RUN(bad_options_fail_on_every_rank);
    TEST_END();
}
