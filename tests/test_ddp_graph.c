/* td_ddp driven by the graph engine: the grad-ready hook is td_ddp_grad_ready_hook and the
 * graph writes its gradients wherever params[i].grad points (DDP's buckets). Two forked
 * ranks, each on half of the batch, must train to the same weights as one graph on all of
 * it. The hand-written-model tests live in test_ddp.c. */
#include <string.h>

#include "tandem/ddp.h"
#include "tandem/nn.h"

#include "test.h"
#include "test_comm_util.h" /* test_free_port, test_comm_create, test_run_ranks */

enum { GN = 8, GIN = 6, GHID = 12, GOUT = 4, GSTEPS = 3 };
#define GLR 0.5f

typedef struct {
    td_graph *g;
    td_tensor *x, *y, *loss;
} mlp;

/* x (n, GIN) -> fc1 -> relu -> fc2 -> cross entropy (mean), on rows [first, first + n). */
static int mlp_make(mlp *m, int n, int first, uint64_t seed) {
    memset(m, 0, sizeof *m);
    if (td_graph_create(&m->g, NULL) != TD_OK) return 0;
    td_rng rng;
    td_rng_init(&rng, seed);
    td_tensor *h;
    if (td_graph_input(m->g, "x", td_shape_2d(n, GIN), TD_F32, 0, &m->x) ||
        td_graph_input(m->g, "y", td_shape_1d(n), TD_I64, 0, &m->y) ||
        td_nn_linear(m->g, "fc1", m->x, GHID, 1, &rng, &h) || td_graph_relu(m->g, h, &h) ||
        td_nn_linear(m->g, "fc2", h, GOUT, 1, &rng, &h) ||
        td_graph_cross_entropy(m->g, h, m->y, TD_REDUCTION_MEAN, &m->loss, NULL) ||
        td_graph_compile(m->g))
        return 0;
    float all_x[GN * GIN];
    td_rng data;
    td_rng_init(&data, 99);
    for (int i = 0; i < GN * GIN; i++) all_x[i] = td_rng_normal(&data);
    float *x = td_tensor_data(m->x);
    int64_t *y = td_tensor_data(m->y);
    memcpy(x, all_x + first * GIN, (size_t)n * GIN * sizeof(float));
    for (int i = 0; i < n; i++) y[i] = (first + i) % GOUT;
    return 1;
}

static void sgd(td_param *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float *w = p[i].data, *g = p[i].grad;
        for (size_t k = 0; k < p[i].count; k++) w[k] -= GLR * g[k];
    }
}

static void graph_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    /* The single-process reference: rank 0's seed, the whole batch. */
    mlp ref;
    CHECK(mlp_make(&ref, GN, 0, 100));
    td_param *rp;
    size_t rn;
    CHECK_OK(td_graph_parameters(ref.g, &rp, &rn));
    for (int s = 0; s < GSTEPS; s++) {
        CHECK_OK(td_graph_zero_grad(ref.g));
        CHECK_OK(td_graph_forward(ref.g));
        CHECK_OK(td_graph_backward(ref.g, ref.loss));
        sgd(rp, rn);
    }

    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 20));
    if (!comm) return;
    int n = GN / size;
    mlp m;
    CHECK(mlp_make(&m, n, rank * n, 100 + (uint64_t)rank)); /* every rank starts elsewhere */
    td_param *p, *b;
    size_t np, nb;
    CHECK_OK(td_graph_parameters(m.g, &p, &np));
    CHECK_OK(td_graph_buffers(m.g, &b, &nb));
    td_ddp_params dp = td_ddp_default_params();
    dp.first_bucket_bytes = dp.bucket_bytes = 128; /* a few buckets */
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, p, np, b, nb, &dp));
    if (ddp) {
        td_graph_set_grad_ready_hook(m.g, td_ddp_grad_ready_hook, ddp);
        for (int s = 0; s < GSTEPS; s++) {
            CHECK_OK(td_ddp_prepare_forward(ddp));
            CHECK_OK(td_graph_zero_grad(m.g));
            CHECK_OK(td_graph_forward(m.g));
            CHECK_OK(td_graph_backward(m.g, m.loss));
            CHECK_OK(td_ddp_finish_backward(ddp));
            sgd(p, np);
        }
        td_ddp_stats st = td_ddp_get_stats(ddp);
        CHECK_EQ(st.rebuilds, 1);
        CHECK(st.n_buckets > 1);
        CHECK(st.buckets_early > 0); /* the hook launched buckets during backward */
        CHECK_EQ(np, rn);
        for (size_t i = 0; i < np && i < rn; i++) {
            const float *a = p[i].data, *r = rp[i].data;
            float diff = 0, mag = 0;
            for (size_t k = 0; k < p[i].count; k++) {
                diff = fmaxf(diff, fabsf(a[k] - r[k]));
                mag = fmaxf(mag, fabsf(r[k]));
            }
            if (!(diff <= 1e-5f * mag))
                TEST_FAIL_AT("rank %d: %s differs from one process by %g (max |w| %g)", rank,
                             p[i].name, diff, mag);
        }
        td_graph_set_grad_ready_hook(m.g, NULL, NULL);
        td_ddp_destroy(ddp);
    }
    td_graph_destroy(m.g);
    td_graph_destroy(ref.g);
    td_comm_destroy(comm);
}

static void graph_ddp_equals_one_process_2_ranks(void) {
    CHECK_EQ(test_run_ranks(2, graph_rank, NULL, 25, 0), 0);
}
static void graph_ddp_equals_one_process_4_ranks(void) {
    CHECK_EQ(test_run_ranks(4, graph_rank, NULL, 25, 0), 0);
}

int main(void) {
    RUN(graph_ddp_equals_one_process_2_ranks);
    RUN(graph_ddp_equals_one_process_4_ranks);
    TEST_END();
}
