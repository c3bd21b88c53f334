/* td_ddp over real forked ranks on the shm backend, with a hand-written MLP (explicit
 * forward and backward in plain C, gradients written through params[i].grad) and plain SGD.
 *
 * Checks: N-rank DDP equals one process on the whole batch for 1, 2 and 4 ranks and several
 * bucket layouts; rank 0's parameters and buffers win at construction; mismatched
 * registrations and unused parameters fail on every rank without hanging; no_sync
 * accumulation; the one-time bucket rebuild from the ready order; all-reduce overlapping
 * backward (seen in the trace); a dead peer turning into an error. */
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "tandem/ddp.h"

#include "test.h"
#include "test_comm_util.h" /* test_run_ranks, test_comm_create */

/* ---- the model --------------------------------------------------------------------- */

enum { D0 = 8, H1 = 16, H2 = 16, H3 = 12, DO = 4, NP = 9, NP_MAX = 10, B_MAX = 48 };

static const struct {
    const char *name;
    int ndim;
    int64_t s0, s1;
} LAYOUT[NP_MAX] = {
    {"fc1.weight", 2, H1, D0}, {"fc1.bias", 1, H1, 0},     {"gate.scale", 1, H1, 0},
    {"fc2.weight", 2, H2, H1}, {"fc2.bias", 1, H2, 0},     {"fc3.weight", 2, H3, H2},
    {"fc3.bias", 1, H3, 0},    {"head.weight", 2, DO, H3}, {"head.bias", 1, DO, 0},
    {"aux.weight", 1, 5, 0}, /* registered only by the unused-parameter tests */
};

typedef struct {
    td_param p[NP_MAX];
    size_t n;          /* registered parameters: NP, or NP_MAX with aux.weight */
    float *data;       /* every parameter's values, back to back */
    float *grad;       /* the trainer's own gradient memory (DDP moves it into buckets) */
    float bn_mean[H1]; /* a buffer, as BatchNorm's running mean would be */
    int64_t steps;     /* a second buffer of another dtype */
    td_param buffers[2];
} model;

static void model_init(model *m, uint64_t seed, int with_aux) {
    memset(m, 0, sizeof *m);
    m->n = with_aux ? NP_MAX : NP;
    size_t total = 0;
    for (int i = 0; i < NP_MAX; i++)
        total += (size_t)(LAYOUT[i].s0 * (LAYOUT[i].ndim == 2 ? LAYOUT[i].s1 : 1));
    m->data = calloc(total, sizeof(float));
    m->grad = calloc(total, sizeof(float));
    td_rng rng;
    td_rng_init(&rng, seed);
    size_t off = 0;
    for (int i = 0; i < NP_MAX; i++) {
        td_param *p = &m->p[i];
        p->name = LAYOUT[i].name;
        p->ndim = LAYOUT[i].ndim;
        p->shape[0] = LAYOUT[i].s0;
        p->shape[1] = LAYOUT[i].s1;
        p->count = (size_t)(LAYOUT[i].s0 * (p->ndim == 2 ? LAYOUT[i].s1 : 1));
        p->dtype = TD_F32;
        p->data = m->data + off;
        p->grad = m->grad + off;
        float lo = -0.1f, hi = 0.1f;
        if (p->ndim == 2) lo = -0.6f, hi = 0.6f;
        if (i == 2) lo = 0.5f, hi = 1.5f;
        td_rng_fill_uniform(&rng, p->data, p->count, lo, hi);
        off += p->count;
    }
    for (int j = 0; j < H1; j++) m->bn_mean[j] = (float)seed + 0.25f * (float)j;
    m->steps = (int64_t)seed * 1000;
    m->buffers[0] = (td_param){.name = "bn.running_mean",
                               .data = m->bn_mean,
                               .count = H1,
                               .dtype = TD_F32,
                               .ndim = 1,
                               .shape = {H1}};
    m->buffers[1] =
        (td_param){.name = "bn.num_batches", .data = &m->steps, .count = 1, .dtype = TD_I64};
}

static void model_free(model *m) {
    free(m->data);
    free(m->grad);
}

/* Gradients are always read through the param, as DDP relocates them. */
static float *G(model *m, int i) { return (float *)m->p[i].grad; }
static float *W(model *m, int i) { return (float *)m->p[i].data; }

static void zero_grads(model *m) {
    for (size_t i = 0; i < m->n; i++) memset(m->p[i].grad, 0, m->p[i].count * sizeof(float));
}

/* out (B, O) = in (B, I) W^T (O, I) + b (O) */
static void linear_fwd(float *out, const float *in, const float *w, const float *b, int B, int I,
                       int O) {
    for (int s = 0; s < B; s++)
        for (int o = 0; o < O; o++) {
            float acc = b[o];
            for (int i = 0; i < I; i++) acc += w[o * I + i] * in[s * I + i];
            out[s * O + o] = acc;
        }
}

/* dw (O, I) += dout^T in; db (O) += sum of dout; din (B, I) = dout W (when din != NULL) */
static void linear_bwd_w(float *dw, const float *dout, const float *in, int B, int I, int O) {
    for (int o = 0; o < O; o++)
        for (int i = 0; i < I; i++) {
            float acc = 0;
            for (int s = 0; s < B; s++) acc += dout[s * O + o] * in[s * I + i];
            dw[o * I + i] += acc;
        }
}
static void linear_bwd_b(float *db, const float *dout, int B, int O) {
    for (int o = 0; o < O; o++) {
        float acc = 0;
        for (int s = 0; s < B; s++) acc += dout[s * O + o];
        db[o] += acc;
    }
}
static void linear_bwd_in(float *din, const float *dout, const float *w, int B, int I, int O) {
    for (int s = 0; s < B; s++)
        for (int i = 0; i < I; i++) {
            float acc = 0;
            for (int o = 0; o < O; o++) acc += dout[s * O + o] * w[o * I + i];
            din[s * I + i] = acc;
        }
}

/* Called the moment parameter i's gradient is final (or collected for a chosen order). */
typedef struct {
    td_ddp *ddp;         /* NULL: single-process reference, nothing to tell */
    const size_t *order; /* non-NULL: defer, then announce in this order */
    size_t n_order;
    uint64_t t_last_ready; /* td_time_ns just before the last grad_ready */
    int skip;              /* a parameter index never announced, or -1 */
    int via_hook;          /* announce through td_ddp_grad_ready_hook */
} hooks;

static void notify(hooks *h, int i) {
    if (!h->ddp || h->order || i == h->skip) return;
    h->t_last_ready = td_time_ns();
    if (h->via_hook)
        td_ddp_grad_ready_hook((size_t)i, h->ddp); /* as the graph engine calls it */
    else
        CHECK_OK(td_ddp_grad_ready(h->ddp, (size_t)i));
}

/* Mean over the B samples of 0.5 |y - t|^2, times loss_scale; backward accumulates (+=). */
static float forward_backward(model *m, const float *X, const float *T, int B, float loss_scale,
                              hooks *h) {
    static float a1[B_MAX * H1], t1[B_MAX * H1], h1[B_MAX * H1], h2[B_MAX * H2], h3[B_MAX * H3],
        y[B_MAX * DO];
    static float dy[B_MAX * DO], d3[B_MAX * H3], d2[B_MAX * H2], d1[B_MAX * H1];
    float *s1 = W(m, 2);
    linear_fwd(a1, X, W(m, 0), W(m, 1), B, D0, H1);
    for (int k = 0; k < B * H1; k++) t1[k] = tanhf(a1[k]), h1[k] = t1[k] * s1[k % H1];
    linear_fwd(h2, h1, W(m, 3), W(m, 4), B, H1, H2);
    for (int k = 0; k < B * H2; k++) h2[k] = tanhf(h2[k]);
    linear_fwd(h3, h2, W(m, 5), W(m, 6), B, H2, H3);
    for (int k = 0; k < B * H3; k++) h3[k] = tanhf(h3[k]);
    linear_fwd(y, h3, W(m, 7), W(m, 8), B, H3, DO);
    float loss = 0;
    for (int k = 0; k < B * DO; k++) {
        float e = y[k] - T[k];
        loss += 0.5f * e * e;
        dy[k] = loss_scale * e / (float)B;
    }
    /* Backward, last layer first, announcing each gradient as soon as it is complete. */
    linear_bwd_b(G(m, 8), dy, B, DO);
    notify(h, 8);
    linear_bwd_w(G(m, 7), dy, h3, B, H3, DO);
    notify(h, 7);
    linear_bwd_in(d3, dy, W(m, 7), B, H3, DO);
    for (int k = 0; k < B * H3; k++) d3[k] *= 1 - h3[k] * h3[k];
    linear_bwd_b(G(m, 6), d3, B, H3);
    notify(h, 6);
    linear_bwd_w(G(m, 5), d3, h2, B, H2, H3);
    notify(h, 5);
    linear_bwd_in(d2, d3, W(m, 5), B, H2, H3);
    for (int k = 0; k < B * H2; k++) d2[k] *= 1 - h2[k] * h2[k];
    linear_bwd_b(G(m, 4), d2, B, H2);
    notify(h, 4);
    linear_bwd_w(G(m, 3), d2, h1, B, H1, H2);
    notify(h, 3);
    linear_bwd_in(d1, d2, W(m, 3), B, H1, H2);
    float *gs = G(m, 2);
    for (int k = 0; k < B * H1; k++) gs[k % H1] += d1[k] * t1[k];
    notify(h, 2);
    for (int k = 0; k < B * H1; k++) d1[k] *= s1[k % H1] * (1 - t1[k] * t1[k]);
    linear_bwd_b(G(m, 1), d1, B, H1);
    notify(h, 1);
    linear_bwd_w(G(m, 0), d1, X, B, D0, H1);
    notify(h, 0);
    if (h->ddp && h->order)
        for (size_t j = 0; j < h->n_order; j++) {
            h->t_last_ready = td_time_ns();
            CHECK_OK(td_ddp_grad_ready(h->ddp, h->order[j]));
        }
    return loss / (float)B;
}

static void sgd(model *m, float lr) {
    for (size_t i = 0; i < m->n; i++) {
        float *w = W(m, (int)i), *g = G(m, (int)i);
        for (size_t k = 0; k < m->p[i].count; k++) w[k] -= lr * g[k];
    }
}

/* ---- data and the single-process reference ------------------------------------------ */

static float GX[B_MAX * D0], GT[B_MAX * DO]; /* the fixed global batch */

static void make_data(void) {
    td_rng rng;
    td_rng_init(&rng, 1234);
    td_rng_fill_uniform(&rng, GX, B_MAX * D0, -1, 1);
    for (int k = 0; k < B_MAX * DO; k++) GT[k] = td_rng_normal(&rng);
}

#define LR 0.1f
#define STEPS 3

/* One process, `steps` SGD steps on samples [0, B) (rank 0's seed 0 initialisation). */
static void reference_train(model *ref, int B, int steps) {
    model_init(ref, 0, 0);
    hooks none = {NULL, NULL, 0, 0, -1, 0};
    for (int s = 0; s < steps; s++) {
        zero_grads(ref);
        forward_backward(ref, GX, GT, B, 1.0f, &none);
        sgd(ref, LR);
    }
}

/* max |a - b| <= 1e-5 max |b| for every parameter tensor. */
static int params_close(model *a, model *b, int rank, const char *what) {
    int ok = 1;
    for (int i = 0; i < NP; i++) {
        float *x = W(a, i), *y = W(b, i), diff = 0, mag = 0;
        for (size_t k = 0; k < a->p[i].count; k++) {
            diff = fmaxf(diff, fabsf(x[k] - y[k]));
            mag = fmaxf(mag, fabsf(y[k]));
        }
        if (!(diff <= 1e-5f * mag)) {
            TEST_FAIL_AT("rank %d, %s: %s differs from the reference by %g (max |w| %g)", rank,
                         what, a->p[i].name, diff, mag);
            ok = 0;
        }
    }
    return ok;
}

/* ---- the ranks ---------------------------------------------------------------------- */

typedef void (*rank_fn)(td_comm *comm, int rank, int world, void *arg);

typedef struct {
    rank_fn fn;
    void *arg;
} world_job;

/* One rank of run_world: joins the world group and runs the case's function. */
static void world_rank(int rank, int size, int port, void *arg) {
    const world_job *job = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 20));
    if (!comm) return;
    job->fn(comm, rank, size, job->arg);
    td_comm_destroy(comm);
}

/* Runs fn on `world` ranks joined by a fresh shm world group; any rank failing, crashing or
 * running past 25 s fails the case, and no rank may leave a segment behind. */
static void run_world(int world, rank_fn fn, void *arg) {
    world_job job = {fn, arg};
    CHECK_EQ(test_run_ranks(world, world_rank, &job, 25, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* ---- DDP training helpers ------------------------------------------------------------ */

/* `steps` DDP steps; rank r trains on its B/world slice of [0, B). */
static void ddp_train_lr(td_ddp *ddp, model *m, int rank, int world, int B, int steps,
                         const size_t *order, size_t n_order, float lr) {
    int b = B / world;
    for (int s = 0; s < steps; s++) {
        CHECK_OK(td_ddp_prepare_forward(ddp));
        td_ddp_zero_grad(ddp);
        hooks h = {ddp, order, n_order, 0, -1, 0};
        forward_backward(m, GX + rank * b * D0, GT + rank * b * DO, b, 1.0f, &h);
        CHECK_OK(td_ddp_finish_backward(ddp));
        sgd(m, lr);
    }
}

static void ddp_train(td_ddp *ddp, model *m, int rank, int world, int B, int steps,
                      const size_t *order, size_t n_order) {
    ddp_train_lr(ddp, m, rank, world, B, steps, order, n_order, LR);
}

/* A DDP with one parameter per bucket that records its communication in *trace (made here;
 * the caller destroys both); NULL, with the case failed, when the DDP cannot be made. */
static td_ddp *ddp_create_traced(td_comm *comm, model *m, int rank, td_trace **trace) {
    CHECK_OK(td_trace_create(trace, rank));
    td_ddp_params dp = td_ddp_default_params();
    dp.first_bucket_bytes = dp.bucket_bytes = 1;
    dp.trace = *trace;
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, m->p, m->n, NULL, 0, &dp));
    return ddp;
}

typedef struct {
    size_t first, bucket;
    const char *label;
} bucket_cfg;

static const bucket_cfg CONFIGS[] = {
    {1, 1, "one bucket per parameter"},
    {(size_t)1 << 20, (size_t)25 << 20, "default buckets"},
    {512, 1024, "small multi-parameter buckets"},
    {SIZE_MAX / 4, SIZE_MAX / 4, "one huge bucket"},
};

/* ---- (1) equivalence ----------------------------------------------------------------- */

static void equivalence_rank(td_comm *comm, int rank, int world, void *arg) {
    (void)arg;
    enum { B = 16 };
    model ref;
    reference_train(&ref, B, STEPS);
    for (size_t c = 0; c < sizeof CONFIGS / sizeof *CONFIGS; c++) {
        model m;
        model_init(&m, (uint64_t)rank, 0);
        td_ddp_params dp = td_ddp_default_params();
        dp.first_bucket_bytes = CONFIGS[c].first;
        dp.bucket_bytes = CONFIGS[c].bucket;
        td_ddp *ddp = NULL;
        CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, m.buffers, 2, &dp));
        if (!ddp) {
            model_free(&m);
            continue;
        }
        td_ddp_stats st = td_ddp_get_stats(ddp);
        if (c == 0) CHECK_EQ(st.n_buckets, NP);
        if (c == 1 || c == 3) CHECK_EQ(st.n_buckets, 1);
        if (c == 2) CHECK(st.n_buckets > 2 && st.n_buckets < NP);
        /* Reverse registration order: the head's bias is laid out first. */
        size_t first[NP];
        CHECK(td_ddp_bucket_params(ddp, 0, first, NP) >= 1);
        CHECK_EQ(first[0], NP - 1);
        ddp_train(ddp, &m, rank, world, B, STEPS, NULL, 0);
        params_close(&m, &ref, rank, CONFIGS[c].label);
        CHECK_EQ(td_ddp_get_stats(ddp).sync_steps, STEPS);
        td_ddp_destroy(ddp);
        /* The trainer's own gradient memory is back, holding the last averaged gradient. */
        CHECK(m.p[0].grad == (void *)m.grad);
        model_free(&m);
    }
    /* average = 0 sums: the same steps with the learning rate divided by world_size. */
    model m;
    model_init(&m, (uint64_t)rank, 0);
    td_ddp_params dp = td_ddp_default_params();
    dp.average = 0;
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, NULL, 0, &dp));
    if (ddp) {
        ddp_train_lr(ddp, &m, rank, world, B, STEPS, NULL, 0, LR / (float)world);
        params_close(&m, &ref, rank, "summed gradients");
        td_ddp_destroy(ddp);
    }
    model_free(&m);
    model_free(&ref);
}

static void equivalence_1_rank(void) { run_world(1, equivalence_rank, NULL); }
static void equivalence_2_ranks(void) { run_world(2, equivalence_rank, NULL); }
static void equivalence_4_ranks(void) { run_world(4, equivalence_rank, NULL); }

/* ---- (2) construction broadcast ------------------------------------------------------ */

static void broadcast_rank(td_comm *comm, int rank, int world, void *arg) {
    (void)arg;
    (void)world;
    model m, zero;
    model_init(&m, (uint64_t)rank, 0);
    model_init(&zero, 0, 0);
    /* Gradient values present before DDP are carried into the buckets. */
    for (size_t k = 0; k < m.p[3].count; k++) ((float *)m.p[3].grad)[k] = (float)k + (float)rank;
    int differ = memcmp(m.data, zero.data, m.p[0].count * sizeof(float)) != 0;
    CHECK_EQ(differ, rank != 0);
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, m.buffers, 2, NULL));
    for (int i = 0; i < NP; i++)
        CHECK(memcmp(m.p[i].data, zero.p[i].data, m.p[i].count * sizeof(float)) == 0);
    CHECK(memcmp(m.bn_mean, zero.bn_mean, sizeof m.bn_mean) == 0);
    CHECK_EQ(m.steps, 0);
    CHECK(m.p[3].grad != (void *)(m.grad + (W(&m, 3) - m.data)));
    CHECK_NEAR(G(&m, 3)[5], 5.0 + rank, 0);
    /* Buffers are broadcast again before each forward. */
    m.bn_mean[3] = 100.0f + (float)rank;
    m.steps = 7 + rank;
    CHECK_OK(td_ddp_prepare_forward(ddp));
    CHECK_NEAR(m.bn_mean[3], 100.0, 0);
    CHECK_EQ(m.steps, 7);
    td_ddp_destroy(ddp);
    model_free(&m);
    model_free(&zero);
}

static void construction_broadcasts_rank0(void) { run_world(4, broadcast_rank, NULL); }

/* ---- (3) mismatched registrations ---------------------------------------------------- */

static void mismatch_rank(td_comm *comm, int rank, int world, void *arg) {
    (void)arg;
    model m;
    model_init(&m, 0, 0);
    td_ddp *ddp = NULL;
    if (rank == world - 1) { /* same element count, transposed shape */
        m.p[5].shape[0] = H2;
        m.p[5].shape[1] = H3;
    }
    CHECK_STATUS(td_ddp_create(&ddp, comm, m.p, m.n, NULL, 0, NULL), TD_ESHAPE);
    CHECK(ddp == NULL);
    const char *msg = td_last_error();
    CHECK(strstr(msg, "fc3.weight") != NULL);
    CHECK(strstr(msg, "(12, 16)") != NULL);
    CHECK(strstr(msg, "(16, 12)") != NULL);
    char who[32];
    snprintf(who, sizeof who, "rank %d has", world - 1);
    CHECK(strstr(msg, who) != NULL);
    if (rank == 0) fprintf(stderr, "    (expected) %s\n", msg);
    m.p[5].shape[0] = H3;
    m.p[5].shape[1] = H2;
    /* One rank registers a parameter fewer: counted per kind, nothing else compared. */
    CHECK_STATUS(td_ddp_create(&ddp, comm, m.p, rank == 1 ? NP - 1 : NP, NULL, 0, NULL), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "rank 0 has 9 parameters and 0 buffers but rank 1 has 8 "
                                  "parameters and 0 buffers") != NULL);
    /* Buffers are numbered among buffers, and a missing one is counted as a buffer. */
    float bufs[2][3] = {{0}};
    td_param b[2] = {{.name = "bn.running_mean",
                      .data = bufs[0],
                      .count = 3,
                      .dtype = TD_F32,
                      .ndim = 1,
                      .shape = {3}},
                     {.name = "bn.running_var",
                      .data = bufs[1],
                      .count = 3,
                      .dtype = TD_F32,
                      .ndim = 1,
                      .shape = {3}}};
    if (rank == 2) b[1].shape[0] = 1, b[1].count = 1;
    CHECK_STATUS(td_ddp_create(&ddp, comm, m.p, m.n, b, 2, NULL), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "rank 0 has buffer 1 'bn.running_var' f32 (3) but rank 2 has "
                                  "buffer 1 'bn.running_var' f32 (1)") != NULL);
    b[1].shape[0] = 3, b[1].count = 3;
    CHECK_STATUS(td_ddp_create(&ddp, comm, m.p, m.n, b, rank == 3 ? 1 : 2, NULL), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "rank 0 has 9 parameters and 2 buffers but rank 3 has 9 "
                                  "parameters and 1 buffer") != NULL);
    /* The group is still in step: a matching registration now succeeds. */
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, NULL, 0, NULL));
    td_ddp_destroy(ddp);
    model_free(&m);
}

static void mismatched_registration_fails_everywhere(void) { run_world(4, mismatch_rank, NULL); }

/* ---- (4) no_sync --------------------------------------------------------------------- */

static void no_sync_rank(td_comm *comm, int rank, int world, void *arg) {
    (void)arg;
    enum { M = 3, BM = 8 }; /* 3 micro-batches of 8 samples (global) each */
    model ref, m;
    reference_train(&ref, M * BM, 2);
    model_init(&m, (uint64_t)rank, 0);
    td_trace *trace = NULL;
    td_ddp *ddp = ddp_create_traced(comm, &m, rank, &trace);
    if (!ddp) return;
    int b = BM / world;
    for (int step = 0; step < 2; step++) {
        td_ddp_zero_grad(ddp);
        for (int j = 0; j < M; j++) {
            CHECK_OK(td_ddp_set_sync(ddp, j == M - 1));
            CHECK_OK(td_ddp_prepare_forward(ddp));
            size_t spans = td_trace_count(trace);
            hooks h = {ddp, NULL, 0, 0, -1, 0};
            int off = j * BM + rank * b;
            forward_backward(&m, GX + off * D0, GT + off * DO, b, 1.0f / M, &h);
            CHECK_OK(td_ddp_finish_backward(ddp));
            if (j < M - 1)
                CHECK_EQ(td_trace_count(trace), spans); /* nothing communicated */
            else
                CHECK_EQ(td_trace_count(trace), spans + NP);
        }
        sgd(&m, LR);
    }
    params_close(&m, &ref, rank, "no_sync accumulation");
    CHECK_EQ(td_ddp_get_stats(ddp).sync_steps, 2);
    td_ddp_destroy(ddp);
    td_trace_destroy(trace);
    model_free(&m);
    model_free(&ref);
}

static void no_sync_accumulates_micro_batches(void) { run_world(2, no_sync_rank, NULL); }

/* ---- (5) unused parameters ----------------------------------------------------------- */

static void unused_rank(td_comm *comm, int rank, int world, void *arg) {
    (void)arg;
    enum { B = 8 };
    int b = B / world;
    model m;
    model_init(&m, 0, 1); /* aux.weight registered, never used by the model */
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, NULL, 0, NULL));
    if (!ddp) return;
    hooks h = {ddp, NULL, 0, 0, -1, 0};
    td_ddp_zero_grad(ddp);
    CHECK_OK(td_ddp_prepare_forward(ddp));
    forward_backward(&m, GX + rank * b * D0, GT + rank * b * DO, b, 1.0f, &h);
    CHECK_STATUS(td_ddp_finish_backward(ddp), TD_EUNUSED);
    CHECK(strstr(td_last_error(), "'aux.weight'") != NULL);
    CHECK(strstr(td_last_error(), "find_unused_parameters") != NULL);
    if (rank == 0) fprintf(stderr, "    (expected) %s\n", td_last_error());

    /* Unused on one rank only: both ranks still fail, and only that rank names it. */
    td_ddp_zero_grad(ddp);
    CHECK_OK(td_ddp_prepare_forward(ddp));
    forward_backward(&m, GX + rank * b * D0, GT + rank * b * DO, b, 1.0f, &h);
    if (rank == 0) CHECK_OK(td_ddp_grad_ready(ddp, NP));
    CHECK_STATUS(td_ddp_finish_backward(ddp), TD_EUNUSED);
    CHECK_EQ(strstr(td_last_error(), "'aux.weight'") != NULL, rank != 0);
    if (rank == 0) CHECK(strstr(td_last_error(), "other ranks") != NULL);
    td_ddp_destroy(ddp);
    model_free(&m);

    /* find_unused_parameters: the step proceeds, aux.weight's gradient is zero. */
    model ref;
    reference_train(&ref, B, 1);
    model_init(&m, 0, 1);
    td_ddp_params dp = td_ddp_default_params();
    dp.find_unused_parameters = 1;
    dp.first_bucket_bytes = dp.bucket_bytes = 256;
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, NULL, 0, &dp));
    if (!ddp) return;
    td_ddp_zero_grad(ddp);
    h.ddp = ddp;
    for (int k = 0; k < 5; k++) G(&m, NP)[k] = 7.0f; /* written, but never announced */
    CHECK_OK(td_ddp_prepare_forward(ddp));
    forward_backward(&m, GX + rank * b * D0, GT + rank * b * DO, b, 1.0f, &h);
    CHECK_OK(td_ddp_finish_backward(ddp));
    for (int k = 0; k < 5; k++) CHECK_NEAR(G(&m, NP)[k], 0.0, 0);
    sgd(&m, LR);
    params_close(&m, &ref, rank, "find_unused_parameters");
    td_ddp_destroy(ddp);
    model_free(&m);
    model_free(&ref);
}

static void unused_parameter_is_named_on_every_rank(void) { run_world(2, unused_rank, NULL); }

/* ---- (6) bucket rebuild -------------------------------------------------------------- */

/* 1 when all `n` floats at p are NaN (what memory a gradient moved away from holds). */
static int all_nan(const float *p, size_t n) {
    for (size_t k = 0; k < n; k++)
        if (p[k] == p[k]) return 0;
    return 1;
}

static void rebuild_rank(td_comm *comm, int rank, int world, void *arg) {
    (void)arg;
    enum { B = 16 };
    /* Rank 0 announces in registration order, rank 1 in another order; rank 0's wins. */
    static const size_t order0[NP] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    static const size_t order1[NP] = {4, 0, 8, 2, 6, 1, 3, 7, 5};
    const size_t *order = rank == 0 ? order0 : order1;
    model ref, m;
    reference_train(&ref, B, STEPS);
    model_init(&m, (uint64_t)rank, 0);
    void *own[NP];
    for (int i = 0; i < NP; i++) own[i] = m.p[i].grad;
    td_ddp_params dp = td_ddp_default_params();
    dp.first_bucket_bytes = dp.bucket_bytes = 1; /* one bucket per parameter shows the order */
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, NULL, 0, &dp));
    if (!ddp) return;
    /* The gradients moved into the buckets; the trainer's own buffers hold NaN meanwhile. */
    void *at_create[NP];
    for (int i = 0; i < NP; i++) {
        at_create[i] = m.p[i].grad;
        CHECK(m.p[i].grad != own[i]);
        CHECK(all_nan(own[i], m.p[i].count));
    }
    CHECK_EQ(td_ddp_get_stats(ddp).rebuilds, 0);
    ddp_train(ddp, &m, rank, world, B, 1, order, NP);
    CHECK_EQ(td_ddp_get_stats(ddp).rebuilds, 1);
    int moved = 0;
    for (int i = 0; i < NP; i++) moved += m.p[i].grad != at_create[i];
    CHECK(moved > 0);
    for (size_t k = 0; k < NP; k++) {
        size_t idx = 99;
        CHECK_EQ(td_ddp_bucket_params(ddp, k, &idx, 1), 1);
        CHECK_EQ(idx, order0[k]);
    }
    void *g_after_rebuild[NP];
    for (int i = 0; i < NP; i++) g_after_rebuild[i] = m.p[i].grad;
    ddp_train(ddp, &m, rank, world, B, STEPS - 1, order, NP);
    CHECK_EQ(td_ddp_get_stats(ddp).rebuilds, 1);
    for (int i = 0; i < NP; i++) CHECK(m.p[i].grad == g_after_rebuild[i]);
    params_close(&m, &ref, rank, "after the bucket rebuild");
    td_ddp_destroy(ddp);
    for (int i = 0; i < NP; i++) CHECK(m.p[i].grad == own[i]); /* back to the trainer's memory */
    CHECK(!all_nan(own[0], m.p[0].count));
    model_free(&m);

    /* Multi-parameter buckets: values survive the move during the rebuild. */
    model_init(&m, (uint64_t)rank, 0);
    dp.first_bucket_bytes = 512;
    dp.bucket_bytes = 1024;
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, NULL, 0, &dp));
    if (!ddp) return;
    ddp_train(ddp, &m, rank, world, B, STEPS, order, NP);
    CHECK_EQ(td_ddp_get_stats(ddp).rebuilds, 1);
    params_close(&m, &ref, rank, "rebuilt multi-parameter buckets");
    td_ddp_destroy(ddp);
    model_free(&m);
    model_free(&ref);
}

static void buckets_rebuild_once_from_ready_order(void) { run_world(2, rebuild_rank, NULL); }

/* bucket_bytes below the first bucket's 1 MiB default caps the first bucket too: a caller that
 * asks for small buckets gets them from the first. */
static void small_buckets_rank(td_comm *comm, int rank, int world, void *arg) {
    (void)rank, (void)world, (void)arg;
    model m;
    model_init(&m, 0, 0);
    td_ddp_params dp = td_ddp_default_params();
    dp.bucket_bytes = 256;
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, NULL, 0, &dp));
    if (ddp) {
        size_t members[NP];
        size_t n = td_ddp_bucket_params(ddp, 0, members, NP);
        size_t bytes = 0;
        for (size_t j = 0; j < n && j < NP; j++) bytes += m.p[members[j]].count * sizeof(float);
        CHECK(n < NP);
        CHECK(bytes < 256 + 64 * sizeof(float)); /* closed once it reached 256 bytes */
        CHECK(td_ddp_get_stats(ddp).n_buckets >= 4);
    }
    td_ddp_destroy(ddp);
    model_free(&m);
}

static void bucket_bytes_caps_the_first_bucket(void) { run_world(2, small_buckets_rank, NULL); }

/* A trainer that keeps writing through a gradient pointer it read before the rebuild is told
 * so, with the parameter's name, at the next synchronised step. */
static void stale_rank(td_comm *comm, int rank, int world, void *arg) {
    (void)arg;
    enum { B = 16 };
    model m;
    model_init(&m, 0, 0);
    td_ddp_params dp = td_ddp_default_params();
    dp.first_bucket_bytes = dp.bucket_bytes = 1;
    static const size_t order[NP] = {4, 0, 8, 2, 6, 1, 3, 7, 5}; /* not the creation layout */
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, NULL, 0, &dp));
    if (!ddp) return;
    float *cached[NP];
    for (int i = 0; i < NP; i++) cached[i] = m.p[i].grad;
    ddp_train(ddp, &m, rank, world, B, 1, order, NP); /* the rebuild moves gradients */
    int k = -1;
    for (int i = 0; i < NP && k < 0; i++)
        if (m.p[i].grad != cached[i]) k = i;
    CHECK(k >= 0);
    if (k < 0) return;
    int b = B / world;
    CHECK_OK(td_ddp_prepare_forward(ddp));
    td_ddp_zero_grad(ddp);
    hooks h = {ddp, order, NP, 0, -1, 0};
    forward_backward(&m, GX + rank * b * D0, GT + rank * b * DO, b, 1.0f, &h);
    if (rank == 1) cached[k][0] += 1.0f; /* the bug: an update through the old pointer */
    td_status s = td_ddp_finish_backward(ddp);
    if (rank == 1) {
        CHECK_EQ(s, TD_ESTATE);
        CHECK(strstr(td_last_error(), m.p[k].name) != NULL);
        CHECK(strstr(td_last_error(), "old address") != NULL);
    } else {
        CHECK_OK(s);
    }
    td_ddp_destroy(ddp);
    model_free(&m);
}

static void stale_gradient_pointer_is_caught(void) { run_world(2, stale_rank, NULL); }

/* Finishing a backward twice is refused and leaves the averaged gradients as they were. */
static void twice_rank(td_comm *comm, int rank, int world, void *arg) {
    (void)arg;
    enum { B = 16 };
    model m;
    model_init(&m, 0, 0);
    td_ddp *ddp = NULL;
    td_ddp_params dp = td_ddp_default_params();
    dp.find_unused_parameters = 1; /* the message must not blame unused parameters */
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, NULL, 0, &dp));
    if (!ddp) return;
    ddp_train(ddp, &m, rank, world, B, 1, NULL, 0);
    int b = B / world;
    CHECK_OK(td_ddp_prepare_forward(ddp));
    td_ddp_zero_grad(ddp);
    hooks h = {ddp, NULL, 0, 0, -1, 0};
    forward_backward(&m, GX + rank * b * D0, GT + rank * b * DO, b, 1.0f, &h);
    CHECK_OK(td_ddp_finish_backward(ddp));
    float before[H1 * D0];
    memcpy(before, m.p[0].grad, sizeof before);
    CHECK_STATUS(td_ddp_finish_backward(ddp), TD_ESTATE);
    CHECK(strstr(td_last_error(), "without a backward") != NULL);
    CHECK(memcmp(before, m.p[0].grad, sizeof before) == 0);
    td_ddp_destroy(ddp);
    model_free(&m);
}

static void finish_backward_twice_is_refused(void) { run_world(2, twice_rank, NULL); }

/* ---- (7) overlap ----------------------------------------------------------------------- */

static void overlap_rank(td_comm *comm, int rank, int world, void *arg) {
    (void)arg;
    enum { B = 16 };
    int b = B / world;
    model m;
    model_init(&m, 0, 0);
    td_trace *trace = NULL;
    td_ddp *ddp = ddp_create_traced(comm, &m, rank, &trace);
    if (!ddp) return;
    uint64_t t0 = td_trace_begin(trace);
    CHECK_OK(td_ddp_prepare_forward(ddp));
    td_ddp_zero_grad(ddp);
    hooks h = {ddp, NULL, 0, 0, -1, 1};
    forward_backward(&m, GX + rank * b * D0, GT + rank * b * DO, b, 1.0f, &h);
    CHECK_OK(td_trace_end(trace, "forward+backward", "step", t0));
    CHECK_OK(td_ddp_finish_backward(ddp));
    /* every bucket but the last, which carries the loss and leaves in finish_backward */
    CHECK_EQ(td_ddp_get_stats(ddp).buckets_early, NP - 1);
    size_t n = td_trace_count(trace), ddp_spans = 0, early = 0;
    for (size_t i = 0; i < n; i++) {
        td_trace_event ev;
        CHECK_OK(td_trace_event_get(trace, i, &ev));
        if (strcmp(ev.category, "ddp") != 0) continue;
        ddp_spans++;
        if (ev.start_ns < h.t_last_ready) early++;
    }
    CHECK_EQ(ddp_spans, NP);
    CHECK(early >= 1);
    char path[96];
    snprintf(path, sizeof path, "/tmp/td_ddp_trace_%d_%d.json", (int)getpid(), rank);
    CHECK_OK(td_trace_write(trace, path));
    CHECK(access(path, R_OK) == 0);
    remove(path);
    td_ddp_destroy(ddp);
    td_trace_destroy(trace);
    model_free(&m);
}

static void allreduce_overlaps_backward(void) { run_world(2, overlap_rank, NULL); }

/* ---- a dead peer --------------------------------------------------------------------- */

static void dead_peer_rank(td_comm *comm, int rank, int world, void *arg) {
    (void)arg;
    (void)world;
    model m;
    model_init(&m, 0, 0);
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, m.n, NULL, 0, NULL));
    if (rank == 1) _exit(0); /* gone without a word, as a crashed rank would be */
    CHECK_OK(td_comm_set_timeout(comm, 3));
    hooks none = {NULL, NULL, 0, 0, -1, 0};
    td_ddp_zero_grad(ddp);
    forward_backward(&m, GX, GT, 8, 1.0f, &none);
    /* A grad_ready may already see the failure; finish_backward must report it regardless. */
    for (size_t i = NP; i-- > 0;) (void)td_ddp_grad_ready(ddp, i);
    td_status s = td_ddp_finish_backward(ddp);
    CHECK(s == TD_EPEER || s == TD_ETIMEOUT);
    CHECK(strlen(td_last_error()) > 0);
    fprintf(stderr, "    (expected) %s: %s\n", td_status_string(s), td_last_error());
    td_ddp_destroy(ddp);
    model_free(&m);
}

static void dead_peer_is_an_error(void) { run_world(2, dead_peer_rank, NULL); }

int main(void) {
    make_data();
    RUN(equivalence_1_rank);
    RUN(equivalence_2_ranks);
    RUN(equivalence_4_ranks);
    RUN(construction_broadcasts_rank0);
    RUN(mismatched_registration_fails_everywhere);
    RUN(no_sync_accumulates_micro_batches);
    RUN(unused_parameter_is_named_on_every_rank);
    RUN(buckets_rebuild_once_from_ready_order);
    RUN(bucket_bytes_caps_the_first_bucket);
    RUN(stale_gradient_pointer_is_caught);
    RUN(finish_backward_twice_is_refused);
    RUN(allreduce_overlaps_backward);
    RUN(dead_peer_is_an_error);
    TEST_END();
}
