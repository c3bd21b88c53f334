/* The models td_zero's tests train, under td_ddp or td_zero, and a training run of each.
 *
 * A hand-written MLP whose parameter counts divide no world size (91, 13, 143, 11, 33, 3
 * elements), with explicit forward and backward in C calling the hooks where a graph would,
 * trained with AdamW on a global batch of B samples split over the ranks; and a small graph MLP
 * trained with SGD and momentum, in deterministic mode on SHARDS shards or plainly. Either run
 * may resume from a checkpoint and write one after its steps (td_zero_save, or for td_ddp
 * td_checkpoint_save of the parameters and the optimizer's state from rank 0). */
#ifndef TANDEM_TEST_ZERO_TRAIN_H
#define TANDEM_TEST_ZERO_TRAIN_H

#include <math.h>
#include <string.h>

#include "tandem/checkpoint.h"
#include "tandem/data.h"
#include "tandem/ddp.h"
#include "tandem/graph.h"
#include "tandem/nn.h"
#include "tandem/optim.h"
#include "tandem/zero.h"

#include "test.h"
#include "test_comm_util.h" /* test_elem_get */

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
    int no_use; /* the trainer makes no td_zero_param_use calls (stages 1 and 2 allow it) */
} sync_t;

static void ready(sync_t *s, int i) {
    if (s->zero)
        CHECK_OK(td_zero_grad_ready(s->zero, (size_t)i));
    else if (s->ddp)
        CHECK_OK(td_ddp_grad_ready(s->ddp, (size_t)i));
}

static void use(sync_t *s, int layer, td_param_use u) {
    if (!s->zero || s->no_use) return;
    CHECK_OK(td_zero_param_use(s->zero, (size_t)(2 * layer), u));
    CHECK_OK(td_zero_param_use(s->zero, (size_t)(2 * layer + 1), u));
}

/* Samples [first, first + n) of step `step`: the mean over them of 0.5 |y - t|^2, times
 * `weight` (the samples' share of the global batch, times the ranks the average divides by),
 * which it returns; backward accumulates (+=). Parameters and gradients are read through the
 * td_param entries, as ZeRO moves them, and the hooks come where a graph would call them. */
static float forward_backward(model *m, int step, int first, int n, float weight, sync_t *s) {
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
    double loss = 0;
    for (int k = 0; k < n * DIM[NL]; k++) {
        dz[k] = weight * (act[NL][k] - t[k]) / (float)n;
        loss += 0.5 * (act[NL][k] - t[k]) * (act[NL][k] - t[k]);
    }
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
        ready(s, 2 * l);
        ready(s, 2 * l + 1);
        use(s, l, TD_PARAM_AFTER_BACKWARD); /* after the data gradient read W */
    }
    return (float)(loss * weight / n);
}

/* The loss DDP or ZeRO reports after a step (`got`) is the step's: `mine`, each rank's, reduced
 * over the ranks here (summed, then times `scale`) independently of them. */
static void check_step_loss(td_comm *comm, float mine, float got, float scale, int stage,
                            int step) {
    float all = mine;
    CHECK_OK(td_comm_allreduce(comm, &all, &all, 1, TD_F32, TD_OP_SUM));
    all *= scale;
    if (!(fabsf(got - all) <= 1e-6f * fabsf(all)))
        TEST_FAIL_AT("world %d %s %d, step %d: reported loss %.9g, the step's is %.9g",
                     td_comm_size(comm), stage ? "stage" : "ddp", stage, step, got, all);
}

/* ---- training runs ---------------------------------------------------------------------- */

typedef struct {
    int stage;                 /* 0: td_ddp, else the ZeRO stage */
    int first_step, last_step; /* the steps trained: [first_step, last_step), 0 0: [0, STEPS) */
    const char *load;          /* a checkpoint to resume from first, or NULL */
    const char *save;          /* where to write a checkpoint after the steps, or NULL */
    int micro;                 /* micro-batches per step, the first ones under no_sync */
    double clip;               /* > 0: clip the gradients' norm to this */
    float loss_scale;          /* > 0: a static td_grad_scaler-like scale, undone before the step */
    int named_units;           /* units {"fc1", "head"}: fc1 and fc2 share one */
    int small_ring;            /* stages 2, 3: a gradient ring of two units, reused in backward */
    int no_use;                /* no td_zero_param_use calls: gradients written at their home */
} run_cfg;

/* What a whole-model run checkpoints: the parameters and the optimizer's state (malloc'd). */
static td_param *ddp_tensors(model *m, td_optim *opt, size_t *n) {
    td_param *state;
    size_t n_state;
    td_optim_state(opt, &state, &n_state);
    td_param *all = calloc(NP + n_state, sizeof *all);
    memcpy(all, m->p, sizeof m->p);
    memcpy(all + NP, state, n_state * sizeof *state);
    *n = NP + n_state;
    return all;
}

/* Trains steps of the global batch B on this rank's slice (resuming from c->load, saving to
 * c->save after) and leaves the parameters, whole, in out (the norms of the clipped steps in
 * norms). */
static void train(td_comm *comm, const run_cfg *c, float *out, double *norms) {
    int rank = td_comm_rank(comm), world = td_comm_size(comm);
    model m;
    model_init(&m, 11 + (uint64_t)rank); /* rank 0's values win at creation */
    sync_t s = {.no_use = c->no_use};
    td_param *opt_params = m.p;
    size_t n_opt = NP;
    if (c->stage == 0) {
        CHECK_OK(td_ddp_create(&s.ddp, comm, m.p, NP, NULL, 0, NULL));
    } else {
        td_zero_params zp = td_zero_default_params();
        static const char *units[] = {"fc1", "head"};
        zp.stage = c->stage;
        if (c->small_ring) zp.ddp.bucket_bytes = 1;
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
    if (c->load) {
        if (s.zero) {
            CHECK_OK(td_zero_load(s.zero, opt, c->load, NULL, 0));
        } else {
            size_t n;
            td_param *all = ddp_tensors(&m, opt, &n);
            CHECK_OK(td_checkpoint_load(c->load, all, n));
            free(all);
        }
    }
    size_t first, count;
    td_split_even(B, world, rank, &first, &count);
    float weight = (float)world * (float)count / (float)B; /* this rank's share of the mean */
    int last_step = c->last_step ? c->last_step : STEPS;
    for (int step = c->first_step; step < last_step; step++) {
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
            float loss = forward_backward(&m, step, (int)lo, (int)(hi - lo),
                                          w * (c->loss_scale > 0 ? c->loss_scale : 1.0f), &s);
            /* after the backward, as the examples hand it over */
            if (s.zero)
                td_zero_set_loss(s.zero, loss);
            else
                td_ddp_set_loss(s.ddp, loss);
            if (s.zero)
                CHECK_OK(td_zero_finish_backward(s.zero));
            else
                CHECK_OK(td_ddp_finish_backward(s.ddp));
            if (last)
                check_step_loss(comm, loss, s.zero ? td_zero_loss(s.zero) : td_ddp_loss(s.ddp),
                                1.0f / (float)world, c->stage, step);
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
    if (c->save && s.zero) {
        td_checkpoint_meta meta = {"step", "2"};
        CHECK_OK(td_zero_save(s.zero, opt, c->save, NULL, 0, &meta, 1));
    } else if (c->save && rank == 0) {
        size_t n;
        td_param *all = ddp_tensors(&m, opt, &n);
        CHECK_OK(td_checkpoint_save(c->save, all, n, NULL, 0));
        free(all);
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

/* ---- a graph model: fc1 (20 -> 96), ReLU, fc2 (-> 48), ReLU, head (-> 5), cross entropy ---- */

/* fc2's weight spans pages of memory that stage 3 frees, and its gradient of fc1's output reads
 * it after its weight gradient is final. */
enum { GIN = 20, GH1 = 96, GH2 = 48, GCLASSES = 5, SHARDS = 8, SHARD_BATCH = 4, GSTEPS = 3 };

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
    CHECK_OK(td_nn_linear(m->g, "fc1", m->x, GH1, 1, &rng, &h));
    CHECK_OK(td_graph_relu(m->g, h, &h));
    CHECK_OK(td_nn_linear(m->g, "fc2", h, GH2, 1, &rng, &h));
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
    int stage;                 /* 0: DDP */
    int first_step, last_step; /* 0 0: [0, GSTEPS) */
    const char *load, *save;   /* as run_cfg's */
    int deterministic;
    td_amp_level amp;
    td_dtype comm_dtype;
} gcfg;

/* Steps of SGD with momentum (resuming from c->load, saving to c->save after); the parameters
 * whole in out (as f32) and their digest. */
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
    td_param *state;
    size_t n_state;
    td_optim_state(opt, &state, &n_state);
    td_param *all = calloc(m.n_params + n_state, sizeof *all);
    memcpy(all, m.params, m.n_params * sizeof *all);
    memcpy(all + m.n_params, state, n_state * sizeof *state);
    if (c->load && zero) CHECK_OK(td_zero_load(zero, opt, c->load, NULL, 0));
    if (c->load && !zero) CHECK_OK(td_checkpoint_load(c->load, all, m.n_params + n_state));
    size_t first = (size_t)rank * SHARD_BATCH * SHARDS / (size_t)world;
    size_t passes = c->deterministic ? SHARDS / (size_t)world : 1;
    int last_step = c->last_step ? c->last_step : GSTEPS;
    for (int step = c->first_step; step < last_step && opt; step++) {
        float mine = 0; /* this rank's losses of the step, summed over its shards */
        for (size_t j = 0; j < passes; j++) {
            CHECK_OK(zero ? td_zero_prepare_forward(zero) : td_ddp_prepare_forward(ddp));
            gmodel_feed(&m, step, first + j * (size_t)batch, (size_t)batch);
            CHECK_OK(td_graph_forward(m.g));
            float loss = *(float *)td_tensor_data(m.loss);
            mine += loss;
            CHECK_OK(td_graph_zero_grad(m.g));
            CHECK_OK(td_graph_backward(m.g, m.loss));
            if (zero) /* after the backward, as the examples hand it over */
                td_zero_set_loss(zero, loss);
            else
                td_ddp_set_loss(ddp, loss);
            CHECK_OK(zero ? td_zero_finish_backward(zero) : td_ddp_finish_backward(ddp));
        }
        /* the mean over every shard of the global batch, or over the ranks */
        check_step_loss(comm, mine, zero ? td_zero_loss(zero) : td_ddp_loss(ddp),
                        1.0f / (float)(c->deterministic ? SHARDS : world), c->stage, step);
        CHECK_OK(td_optim_step(opt));
    }
    if (c->save && zero) CHECK_OK(td_zero_save(zero, opt, c->save, NULL, 0, NULL, 0));
    if (c->save && !zero && rank == 0)
        CHECK_OK(td_checkpoint_save(c->save, all, m.n_params + n_state, NULL, 0));
    free(all);
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

enum { GPARAMS = GIN * GH1 + GH1 + GH1 * GH2 + GH2 + GH2 * GCLASSES + GCLASSES };

#endif
