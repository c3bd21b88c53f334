/* td_ddp with uneven inputs (PyTorch's Join) over real forked ranks.
 *
 * Rank 0 has 10 batches and rank 1 has 13 (the last one short): rank 0 joins after its tenth
 * step and shadows the other three, both leave the loop together, and
 *  - with a hand-written trainer whose gradient is the mean of its samples' values, every
 *    step's reduced gradient is the mean over every sample of that step, short batch included
 *    (td_ddp_set_samples), on the rank that trains and the one that shadows, and the buffers
 *    follow the lowest rank that still has data;
 *  - with a graph MLP trained by SGD on both ranks (10 and 13 full batches; the joined one
 *    steps on what it receives), the final weights equal one process trained on the same
 *    samples step by step (both ranks' batches together, then rank 1's alone), and the two
 *    ranks end with the same bits.
 * Also: a rank whose peer is not in join mode is refused, and set_samples outside join mode. */
#include <math.h>
#include <string.h>

#include "tandem/ddp.h"
#include "tandem/nn.h"

#include "test.h"
#include "test_comm_util.h" /* test_run_ranks, test_comm_create, test_shm_leftovers */

enum { B = 4, N0 = 10, N1 = 13, LAST1 = 3, D = 24 };

/* Batches rank r has, and the samples in its batch k. */
static int batches_of(int r) { return r == 0 ? N0 : N1; }
static int samples_in(int r, int k) {
    return r == 1 && k == N1 - 1 ? LAST1 : k < batches_of(r) ? B : 0;
}

/* Element e of sample i of rank r's batch k. */
static float value(int r, int k, int i, int e) {
    uint32_t w[4];
    td_philox4x32_stream(5, (uint64_t)(r * 1000 + k), (uint64_t)(i * D + e), w);
    return (float)(w[0] >> 8) * (1.0f / 16777216.0f) - 0.5f;
}

static void weighted_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    (void)size;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, 2, port, 30));
    if (!comm) return;
    float data[D] = {0}, grad[D] = {0}, buf[2] = {0};
    td_param p = {.name = "w", .data = data, .grad = grad, .count = D, .dtype = TD_F32,
                  .ndim = 1, .shape = {D}};
    td_param b = {.name = "stat", .data = buf, .count = 2, .dtype = TD_F32, .ndim = 1,
                  .shape = {2}};
    td_ddp_params dp = td_ddp_default_params();
    dp.join = 1;
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, &p, 1, &b, 1, &dp));
    if (!ddp) return;
    int steps = 0, done = 0;
    double worst = 0;
    while (!done) {
        int k = steps, n = samples_in(rank, k);
        if (n > 0) {
            CHECK_OK(td_ddp_set_samples(ddp, n));
            CHECK_OK(td_ddp_prepare_forward(ddp));
            td_ddp_zero_grad(ddp);
            buf[0] = (float)(rank * 100 + k); /* what this rank's forward would leave */
            float *g = p.grad;
            for (int e = 0; e < D; e++) {
                for (int i = 0; i < n; i++) g[e] += value(rank, k, i, e);
                g[e] /= (float)n;
            }
            CHECK_OK(td_ddp_grad_ready(ddp, 0));
            CHECK_OK(td_ddp_finish_backward(ddp));
        } else {
            CHECK_OK(td_ddp_join(ddp, &done));
            if (done) break;
            /* The buffers came from rank 1, the lowest rank with data this step. */
            CHECK_EQ((int)buf[0], 100 + k - 1);
        }
        /* The mean over every sample of this step, whichever rank holds it. */
        const float *g = p.grad;
        for (int e = 0; e < D; e++) {
            double sum = 0;
            int total = 0;
            for (int r = 0; r < 2; r++)
                for (int i = 0; i < samples_in(r, k); i++, total++) sum += value(r, k, i, e);
            worst = fmax(worst, fabs(g[e] - sum / total));
        }
        steps++;
    }
    CHECK(worst < 1e-6);
    CHECK_EQ(steps, N1); /* both ranks left the loop after rank 1's last batch */
    CHECK_EQ((int)buf[0], 100 + N1 - 1); /* the last rank with data handed out its buffers */
    td_ddp_destroy(ddp);
    td_comm_destroy(comm);
}

static void uneven_batches_average_over_the_samples_that_took_part(void) {
    CHECK_EQ(test_run_ranks(2, weighted_rank, NULL, 30, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* ---- a graph model: equals one process on the same samples ------------------------------ */

enum { IN = 6, HID = 10, OUT = 3 };
#define LR 0.3f

typedef struct {
    td_graph *g;
    td_tensor *x, *y, *loss;
    int n;
} mlp;

static void mlp_make(mlp *m, int n) {
    memset(m, 0, sizeof *m);
    m->n = n;
    td_rng rng;
    td_rng_init(&rng, 42);
    td_tensor *h;
    CHECK_OK(td_graph_create(&m->g, NULL));
    CHECK_OK(td_graph_input(m->g, "x", td_shape_2d(n, IN), TD_F32, 0, &m->x));
    CHECK_OK(td_graph_input(m->g, "y", td_shape_1d(n), TD_I64, 0, &m->y));
    CHECK_OK(td_nn_linear(m->g, "fc1", m->x, HID, 1, &rng, &h));
    CHECK_OK(td_graph_relu(m->g, h, &h));
    CHECK_OK(td_nn_linear(m->g, "fc2", h, OUT, 1, &rng, &h));
    CHECK_OK(td_graph_cross_entropy(m->g, h, m->y, TD_REDUCTION_MEAN, &m->loss, NULL));
    CHECK_OK(td_graph_compile(m->g));
}

/* Rows [at, at + B) of mlp m's input from rank r's batch k (all B samples: here rank 1's last
 * batch is full too). */
static void load(mlp *m, int at, int r, int k) {
    float *x = td_tensor_data(m->x);
    int64_t *y = td_tensor_data(m->y);
    for (int i = 0; i < B; i++) {
        for (int e = 0; e < IN; e++) x[(at + i) * IN + e] = value(r, k, i, e) * 4.0f;
        y[at + i] = (r + k + i) % OUT;
    }
}

static void sgd(td_param *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float *w = p[i].data;
        const float *g = p[i].grad;
        for (size_t k = 0; k < p[i].count; k++) w[k] -= LR * g[k];
    }
}

static void step(mlp *m) {
    CHECK_OK(td_graph_zero_grad(m->g));
    CHECK_OK(td_graph_forward(m->g));
    CHECK_OK(td_graph_backward(m->g, m->loss));
}

static void graph_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    (void)size;
    /* One process on the same samples: both ranks' batches together while both have data, then
     * rank 1's alone; the two graphs share their weights. */
    mlp both, one;
    mlp_make(&both, 2 * B);
    mlp_make(&one, B);
    CHECK_OK(td_graph_share_params(one.g, both.g));
    td_param *rp, *rp1;
    size_t rn, rn1;
    CHECK_OK(td_graph_parameters(both.g, &rp, &rn));
    CHECK_OK(td_graph_parameters(one.g, &rp1, &rn1));
    for (int k = 0; k < N1; k++) {
        if (k < N0) {
            load(&both, 0, 0, k);
            load(&both, B, 1, k);
            step(&both);
            sgd(rp, rn);
        } else {
            load(&one, 0, 1, k);
            step(&one);
            sgd(rp1, rn1);
        }
    }

    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, 2, port, 30));
    if (!comm) return;
    mlp m;
    mlp_make(&m, B);
    td_param *p, *bufs;
    size_t np, nb;
    CHECK_OK(td_graph_parameters(m.g, &p, &np));
    CHECK_OK(td_graph_buffers(m.g, &bufs, &nb));
    td_ddp_params dp = td_ddp_default_params();
    dp.join = 1;
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, p, np, bufs, nb, &dp));
    if (!ddp) return;
    td_graph_set_grad_ready_hook(m.g, td_ddp_grad_ready_hook, ddp);
    int batches = rank == 0 ? N0 : N1, steps = 0;
    for (int k = 0; k < batches; k++, steps++) {
        load(&m, 0, rank, k);
        CHECK_OK(td_ddp_prepare_forward(ddp));
        step(&m);
        CHECK_OK(td_ddp_finish_backward(ddp));
        sgd(p, np);
    }
    for (int done = 0;;) {
        CHECK_OK(td_ddp_join(ddp, &done));
        if (done) break;
        sgd(p, np); /* the same update the others make */
        steps++;
    }
    CHECK_EQ(steps, N1);
    double worst = 0;
    char digest[65], ref_digest[65];
    for (size_t i = 0; i < np && i < rn; i++) {
        const float *a = p[i].data, *r = rp[i].data;
        for (size_t e = 0; e < p[i].count; e++) worst = fmax(worst, fabs(a[e] - r[e]));
    }
    if (!(worst < 1e-5)) TEST_FAIL_AT("rank %d differs from one process by %g", rank, worst);
    /* Both ranks hold the same bits: rank 0 checks rank 1's digest. */
    td_params_sha256(p, np, digest);
    if (rank == 1) memcpy(ref_digest, digest, sizeof digest);
    CHECK_OK(td_comm_broadcast(comm, ref_digest, sizeof ref_digest, TD_U8, 1));
    CHECK(strcmp(digest, ref_digest) == 0);
    td_graph_set_grad_ready_hook(m.g, NULL, NULL);
    td_ddp_destroy(ddp);
    td_graph_destroy(m.g);
    td_graph_destroy(one.g);
    td_graph_destroy(both.g);
    td_comm_destroy(comm);
}

static void ten_and_thirteen_batches_equal_one_process(void) {
    CHECK_EQ(test_run_ranks(2, graph_rank, NULL, 30, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* ---- refusals ------------------------------------------------------------------------- */

static void mixed_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    (void)size;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, 2, port, 30));
    if (!comm) return;
    float data[4] = {0}, grad[4] = {0};
    td_param p = {.name = "w", .data = data, .grad = grad, .count = 4, .dtype = TD_F32,
                  .ndim = 1, .shape = {4}};
    td_ddp_params dp = td_ddp_default_params();
    dp.join = rank == 0; /* rank 1 forgot */
    td_ddp *ddp = NULL;
    CHECK_STATUS(td_ddp_create(&ddp, comm, &p, 1, NULL, 0, &dp), TD_EINVAL);
    CHECK(strstr(td_last_error(), "join") != NULL);
    dp.join = 0;
    CHECK_OK(td_ddp_create(&ddp, comm, &p, 1, NULL, 0, &dp));
    CHECK_STATUS(td_ddp_set_samples(ddp, 3), TD_ESTATE);
    int done;
    CHECK_STATUS(td_ddp_join(ddp, &done), TD_ESTATE);
    td_ddp_destroy(ddp);
    td_comm_destroy(comm);
}

static void join_must_be_asked_for_on_every_rank(void) {
    CHECK_EQ(test_run_ranks(2, mixed_rank, NULL, 30, 0), 0);
}

int main(void) {
    RUN(uneven_batches_average_over_the_samples_that_took_part);
    RUN(ten_and_thirteen_batches_equal_one_process);
    RUN(join_must_be_asked_for_on_every_rank);
    TEST_END();
}
