/* Collective ops inside the graph, over real forked ranks and the shm backend: all_gather,
 * all_reduce and SyncBatchNorm forward and backward at world 2 and 4 must equal one process
 * computing the same thing on the concatenated global batch (<= 1e-5 of the largest value);
 * SyncBatchNorm at world 1 must be plain batch norm bit for bit; a CNN with SyncBatchNorm
 * under DDP trains to the weights one process reaches on the global batch; eval mode sends
 * nothing; ranks whose graphs differ get an error naming both, not a hang. */
#include <string.h>

#include "tandem/data.h"
#include "tandem/ddp.h"
#include "tandem/nn.h"
#include "tandem/optim.h"

#include "test.h"
#include "test_comm_util.h" /* test_run_ranks, test_comm_create */

#define TOL 1e-5

/* n normal values from stream `seed`: every rank draws every rank's data the same way. */
static float *randn(size_t n, uint64_t seed) {
    float *a = malloc((n ? n : 1) * sizeof *a);
    td_rng rng;
    td_rng_init(&rng, seed);
    for (size_t i = 0; i < n; i++) a[i] = td_rng_normal(&rng);
    return a;
}

/* Fails the case unless max |got - want| <= TOL * max |want|. */
static void check_rel(int rank, const char *what, const float *got, const float *want, size_t n) {
    double diff = 0, mag = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        if (!(d <= diff)) diff = d; /* NaN counts */
        if (fabs(want[i]) > mag) mag = fabs(want[i]);
    }
    if (!(diff <= TOL * (mag > 0 ? mag : 1)))
        TEST_FAIL_AT("rank %d: %s differs from one process by %g (largest value %g)", rank, what,
                     diff, mag);
}

/* A graph on the given group (NULL: none), optionally converting batch norms. */
static td_graph *graph_on(td_comm *comm, int sync_batch_norm) {
    td_graph_params p = td_graph_default_params();
    p.comm = comm;
    p.sync_batch_norm = sync_batch_norm;
    td_graph *g = NULL;
    CHECK_OK(td_graph_create(&g, &p));
    return g;
}

static float *read_grad(td_tensor *t) {
    float *a = malloc((size_t)td_tensor_numel(t) * sizeof *a);
    CHECK_OK(td_tensor_read_grad(t, a));
    return a;
}

static float *read_data(td_tensor *t) {
    float *a = malloc((size_t)td_tensor_numel(t) * sizeof *a);
    CHECK_OK(td_tensor_read(t, a));
    return a;
}

/* ---- all_gather: x (n, D) per rank -> gathered (world n, D) -> linear -> y -------------- */

enum { AG_N = 3, AG_D = 5, AG_K = 4 };

static void all_gather_rank(int rank, int world, int port, void *arg) {
    (void)arg;
    int N = AG_N * world;
    float *x_all = randn((size_t)N * AG_D, 1), *w = randn(AG_K * AG_D, 2);
    float *dy_sum = calloc((size_t)N * AG_K, sizeof *dy_sum), *dy_mine = NULL;
    for (int r = 0; r < world; r++) { /* rank r's upstream gradient of the gathered output */
        float *dy = randn((size_t)N * AG_K, 100 + (uint64_t)r);
        for (int i = 0; i < N * AG_K; i++) dy_sum[i] += dy[i];
        if (r == rank)
            dy_mine = dy;
        else
            free(dy);
    }
    /* One process: the whole batch, the sum of every rank's upstream gradient. */
    td_graph *ref = graph_on(NULL, 0);
    td_tensor *rx, *rw, *ry;
    CHECK_OK(td_graph_input(ref, "x", td_shape_2d(N, AG_D), TD_F32, 1, &rx));
    CHECK_OK(td_graph_param(ref, "w", td_shape_2d(AG_K, AG_D), &rw));
    CHECK_OK(td_graph_linear(ref, rx, rw, NULL, &ry));
    CHECK_OK(td_graph_compile(ref));
    CHECK_OK(td_tensor_write(rx, x_all));
    CHECK_OK(td_tensor_write(rw, w));
    CHECK_OK(td_graph_forward(ref));
    CHECK_OK(td_graph_backward_from(ref, ry, dy_sum));

    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, world, port, 20));
    if (!comm) return;
    td_graph *g = graph_on(comm, 0);
    td_tensor *x, *wt, *gathered, *y;
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(AG_N, AG_D), TD_F32, 1, &x));
    CHECK_OK(td_graph_param(g, "w", td_shape_2d(AG_K, AG_D), &wt));
    CHECK_OK(td_graph_all_gather(g, x, &gathered));
    CHECK_OK(td_graph_linear(g, gathered, wt, NULL, &y));
    CHECK_OK(td_graph_compile(g));
    CHECK_EQ(td_tensor_shape(gathered).dim[0], N);
    CHECK_OK(td_tensor_write(x, x_all + (size_t)rank * AG_N * AG_D));
    CHECK_OK(td_tensor_write(wt, w));
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_graph_backward_from(g, y, dy_mine));
    float *got_g = read_data(gathered), *got_y = read_data(y), *want_y = read_data(ry);
    check_rel(rank, "all_gather forward", got_g, x_all, (size_t)N * AG_D);
    check_rel(rank, "linear after all_gather", got_y, want_y, (size_t)N * AG_K);
    float *dx = read_grad(x), *want_dx = read_grad(rx);
    check_rel(rank, "all_gather backward (dx)", dx, want_dx + (size_t)rank * AG_N * AG_D,
              AG_N * AG_D);
    /* Each rank's weight gradient is its own loss's; their sum is the one process's. */
    float *dw = read_grad(wt), *want_dw = read_grad(rw);
    CHECK_OK(td_comm_allreduce(comm, dw, dw, AG_K * AG_D, TD_F32, TD_OP_SUM));
    check_rel(rank, "weight gradient summed over ranks", dw, want_dw, AG_K * AG_D);
    free(got_g), free(got_y), free(want_y), free(dx), free(want_dx), free(dw), free(want_dw);
    td_graph_destroy(g);

    /* bf16 goes through as bf16: the gathered values are the ranks' own bits. */
    g = graph_on(comm, 0);
    td_tensor *xb, *yb;
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(AG_N, AG_D), TD_BF16, 1, &xb));
    CHECK_OK(td_graph_all_gather(g, xb, &yb));
    CHECK_OK(td_graph_compile(g));
    CHECK_EQ(td_tensor_dtype(yb), TD_BF16);
    uint16_t mine[AG_N * AG_D], all[4 * AG_N * AG_D];
    for (int i = 0; i < AG_N * AG_D; i++) mine[i] = td_f32_to_bf16((float)(rank * 100 + i));
    CHECK_OK(td_tensor_write(xb, mine));
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_tensor_read(yb, all));
    for (int r = 0; r < world; r++)
        for (int i = 0; i < AG_N * AG_D; i++)
            CHECK_EQ(all[r * AG_N * AG_D + i], td_f32_to_bf16((float)(r * 100 + i)));
    td_graph_destroy(g);
    td_graph_destroy(ref);
    td_comm_destroy(comm);
    free(x_all), free(w), free(dy_sum), free(dy_mine);
}

static void all_gather_equals_one_process_2_ranks(void) {
    CHECK_EQ(test_run_ranks(2, all_gather_rank, NULL, 30, 0), 0);
}

static void all_gather_equals_one_process_4_ranks(void) {
    CHECK_EQ(test_run_ranks(4, all_gather_rank, NULL, 30, 0), 0);
}

/* ---- all_reduce: sum and avg, forward and backward ------------------------------------ */

enum { AR_N = 4, AR_D = 6 };

static void all_reduce_rank(int rank, int world, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, world, port, 20));
    if (!comm) return;
    size_t n = AR_N * AR_D;
    for (int avg = 0; avg < 2; avg++) {
        double *sum_x = calloc(n, sizeof *sum_x), *sum_dy = calloc(n, sizeof *sum_dy);
        float *x = NULL, *dy = NULL;
        for (int r = 0; r < world; r++) {
            float *xr = randn(n, 10 + (uint64_t)r), *dyr = randn(n, 20 + (uint64_t)r);
            for (size_t i = 0; i < n; i++) sum_x[i] += xr[i], sum_dy[i] += dyr[i];
            if (r == rank) {
                x = xr;
                dy = dyr;
            } else {
                free(xr), free(dyr);
            }
        }
        float *want_y = malloc(n * sizeof *want_y), *want_dx = malloc(n * sizeof *want_dx);
        for (size_t i = 0; i < n; i++) {
            want_y[i] = (float)(avg ? sum_x[i] / world : sum_x[i]);
            want_dx[i] = (float)(avg ? sum_dy[i] / world : sum_dy[i]);
        }
        td_graph *g = graph_on(comm, 0);
        td_tensor *tx, *ty;
        CHECK_OK(td_graph_input(g, "x", td_shape_2d(AR_N, AR_D), TD_F32, 1, &tx));
        CHECK_OK(td_graph_all_reduce(g, tx, avg ? TD_OP_AVG : TD_OP_SUM, &ty));
        CHECK_OK(td_graph_compile(g));
        CHECK_OK(td_tensor_write(tx, x));
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_graph_backward_from(g, ty, dy));
        float *y = read_data(ty), *dx = read_grad(tx);
        check_rel(rank, avg ? "all_reduce avg forward" : "all_reduce sum forward", y, want_y, n);
        check_rel(rank, avg ? "all_reduce avg backward" : "all_reduce sum backward", dx, want_dx,
                  n);
        free(y), free(dx), free(x), free(dy), free(want_y), free(want_dx), free(sum_x),
            free(sum_dy);
        td_graph_destroy(g);
    }
    /* Only sum and avg have a gradient. */
    td_graph *g = graph_on(comm, 0);
    td_tensor *tx, *ty;
    CHECK_OK(td_graph_input(g, "x", td_shape_1d(3), TD_F32, 1, &tx));
    CHECK_STATUS(td_graph_all_reduce(g, tx, TD_OP_MAX, &ty), TD_EINVAL);
    CHECK(strstr(td_last_error(), "max") != NULL);
    td_graph_destroy(g);
    td_comm_destroy(comm);
}

static void all_reduce_equals_one_process_2_ranks(void) {
    CHECK_EQ(test_run_ranks(2, all_reduce_rank, NULL, 30, 0), 0);
}

static void all_reduce_equals_one_process_4_ranks(void) {
    CHECK_EQ(test_run_ranks(4, all_reduce_rank, NULL, 30, 0), 0);
}

/* ---- SyncBatchNorm: bn1 on the plain input, conv, bn2 on the conv's (blocked) output ----- */

/* BN_OC 20: the second batch norm's channels fill one and a quarter blocks of 16. */
enum { BN_N = 10, BN_C = 3, BN_H = 6, BN_W = 5, BN_OC = 20, BN_HEAD = 4 };

typedef struct {
    td_graph *g;
    td_tensor *x, *y;
} bn_net;

/* x (n, C, H, W) -> batch norm -> conv 3x3 -> batch norm -> relu -> conv 1x1, parameters
 * random from a fixed seed (the same in every graph). The first batch norm sees the plain
 * input, the second the convolution's channel-blocked output. */
static void bn_net_make(bn_net *m, td_comm *comm, int sync, int64_t n) {
    m->g = graph_on(comm, sync);
    td_rng rng;
    td_rng_init(&rng, 5);
    td_conv2d_params cp = td_conv2d_default_params();
    cp.padding[0] = cp.padding[1] = 1;
    td_tensor *t;
    CHECK_OK(td_graph_input(m->g, "x", td_shape_4d(n, BN_C, BN_H, BN_W), TD_F32, 1, &m->x));
    CHECK_OK(td_nn_batch_norm2d(m->g, "bn1", m->x, &t));
    CHECK_OK(
        td_nn_conv2d(m->g, "conv", t, BN_OC, 3, &cp, 0, &rng, &t)); /* no bias: BN removes it */
    CHECK_OK(td_nn_batch_norm2d(m->g, "bn2", t, &t));
    CHECK_OK(td_graph_relu(m->g, t, &t));
    td_conv2d_params one = td_conv2d_default_params(); /* reads bn2's output blocked */
    CHECK_OK(td_nn_conv2d(m->g, "head", t, BN_HEAD, 1, &one, 0, &rng, &m->y));
    CHECK_OK(td_graph_compile(m->g));
    td_param *p;
    size_t np;
    CHECK_OK(td_graph_parameters(m->g, &p, &np));
    for (size_t i = 0; i < np; i++) { /* batch norm's weights and biases away from 1 and 0 */
        float *v = randn(p[i].count, 50 + i);
        memcpy(p[i].data, v, p[i].count * sizeof *v);
        free(v);
    }
}

/* Largest difference of the rank's gradients of every parameter, summed over ranks, from the
 * reference's, and of the buffers (running statistics) themselves. */
static void check_params(int rank, td_comm *comm, td_graph *g, td_graph *ref) {
    td_param *p, *rp, *b, *rb;
    size_t np, nrp, nb, nrb;
    CHECK_OK(td_graph_parameters(g, &p, &np));
    CHECK_OK(td_graph_parameters(ref, &rp, &nrp));
    CHECK_OK(td_graph_buffers(g, &b, &nb));
    CHECK_OK(td_graph_buffers(ref, &rb, &nrb));
    CHECK_EQ(np, nrp);
    CHECK_EQ(nb, nrb);
    for (size_t i = 0; i < np && i < nrp; i++) {
        float *sum = malloc(p[i].count * sizeof *sum);
        CHECK_OK(td_comm_allreduce(comm, p[i].grad, sum, p[i].count, TD_F32, TD_OP_SUM));
        char what[96];
        snprintf(what, sizeof what, "gradient of %s summed over ranks", p[i].name);
        check_rel(rank, what, sum, rp[i].grad, p[i].count);
        free(sum);
    }
    for (size_t i = 0; i < nb && i < nrb; i++)
        check_rel(rank, b[i].name, b[i].data, rb[i].data, b[i].count);
}

static void sync_batch_norm_rank(int rank, int world, int port, void *arg) {
    (void)arg;
    size_t sample = BN_C * BN_H * BN_W, out_sample = BN_HEAD * BN_H * BN_W;
    size_t first, count; /* 10 over 4 ranks: 3, 3, 2, 2 samples */
    td_split_even(BN_N, world, rank, &first, &count);
    float *x = randn(BN_N * sample, 7), *dy = randn(BN_N * out_sample, 8);
    for (size_t i = 0; i < BN_N * sample; i++) x[i] = 3 * x[i] + 2; /* mean 2, var 9 */
    bn_net ref, m;
    bn_net_make(&ref, NULL, 0, BN_N);
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, world, port, 20));
    if (!comm) return;
    bn_net_make(&m, comm, 1, (int64_t)count);
    CHECK_OK(td_tensor_write(ref.x, x));
    CHECK_OK(td_tensor_write(m.x, x + first * sample));
    for (int step = 0; step < 2; step++) { /* twice: the running stats move twice */
        CHECK_OK(td_graph_forward(ref.g));
        CHECK_OK(td_graph_forward(m.g));
    }
    CHECK_OK(td_graph_zero_grad(ref.g));
    CHECK_OK(td_graph_zero_grad(m.g));
    CHECK_OK(td_graph_backward_from(ref.g, ref.y, dy));
    CHECK_OK(td_graph_backward_from(m.g, m.y, dy + first * out_sample));
    float *y = read_data(m.y), *want_y = read_data(ref.y);
    check_rel(rank, "sync batch norm forward", y, want_y + first * out_sample, count * out_sample);
    float *dx = read_grad(m.x), *want_dx = read_grad(ref.x);
    check_rel(rank, "sync batch norm backward (dx)", dx, want_dx + first * sample, count * sample);
    check_params(rank, comm, m.g, ref.g);
    /* Eval mode normalises with the (equal) running statistics. */
    td_graph_set_training(ref.g, 0);
    td_graph_set_training(m.g, 0);
    CHECK_OK(td_graph_forward(ref.g));
    CHECK_OK(td_graph_forward(m.g));
    free(y), free(want_y);
    y = read_data(m.y);
    want_y = read_data(ref.y);
    check_rel(rank, "sync batch norm eval forward", y, want_y + first * out_sample,
              count * out_sample);
    free(x), free(dy), free(y), free(want_y), free(dx), free(want_dx);
    td_graph_destroy(m.g);
    td_graph_destroy(ref.g);
    td_comm_destroy(comm);
}

static void sync_batch_norm_equals_one_process_2_ranks(void) {
    CHECK_EQ(test_run_ranks(2, sync_batch_norm_rank, NULL, 30, 0), 0);
}

static void sync_batch_norm_equals_one_process_4_ranks(void) {
    CHECK_EQ(test_run_ranks(4, sync_batch_norm_rank, NULL, 30, 0), 0);
}

/* Eval mode sends nothing: rank 0 runs eval steps that rank 1 does not, and the group is still
 * in step afterwards. */
static void eval_rank(int rank, int world, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, world, port, 5));
    if (!comm) return;
    bn_net m;
    bn_net_make(&m, comm, 1, 2);
    float *x = randn(2 * BN_C * BN_H * BN_W, 9), *dy = randn(2 * BN_HEAD * BN_H * BN_W, 10);
    CHECK_OK(td_tensor_write(m.x, x));
    td_graph_set_training(m.g, 0);
    for (int i = 0; i < (rank == 0 ? 3 : 1); i++) {
        CHECK_OK(td_graph_forward(m.g));
        CHECK_OK(td_graph_backward_from(m.g, m.y, dy));
    }
    int32_t one = 1, total = 0;
    CHECK_OK(td_comm_allreduce(comm, &one, &total, 1, TD_I32, TD_OP_SUM));
    CHECK_EQ(total, world);
    free(x), free(dy);
    td_graph_destroy(m.g);
    td_comm_destroy(comm);
}

static void sync_batch_norm_in_eval_mode_communicates_nothing(void) {
    CHECK_EQ(test_run_ranks(2, eval_rank, NULL, 30, 0), 0);
}

/* ---- world 1: plain batch norm, bit for bit ------------------------------------------- */

/* Trains the CNN (four batch norms) for three SGD steps on a group of `comm` (NULL: none) with
 * or without the SyncBatchNorm switch; returns its parameters and buffers, concatenated. */
static float *train_cnn(td_comm *comm, int sync, int64_t batch, int64_t first, int steps,
                        size_t *count) {
    td_graph_params gp = td_graph_default_params();
    gp.comm = comm;
    gp.sync_batch_norm = sync;
    td_graph *g = NULL;
    td_model m;
    CHECK_OK(td_graph_create(&g, &gp));
    CHECK_OK(td_model_build(g, TD_MODEL_CNN, batch, 3, &m));
    td_param *p, *b;
    size_t np, nb;
    CHECK_OK(td_graph_parameters(g, &p, &np));
    CHECK_OK(td_graph_buffers(g, &b, &nb));
    td_ddp *ddp = NULL;
    if (comm && td_comm_size(comm) > 1) {
        CHECK_OK(td_ddp_create(&ddp, comm, p, np, b, nb, NULL));
        td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, ddp);
    }
    td_sgd_params sp = td_sgd_default_params();
    sp.lr = 0.05;
    sp.momentum = 0.9;
    td_optim *opt = NULL;
    CHECK_OK(td_optim_create_sgd(&opt, p, np, &sp));
    int64_t total = batch * (comm ? td_comm_size(comm) : 1);
    float *x = randn((size_t)(total * 784), 11);
    int64_t *labels = malloc((size_t)total * sizeof *labels);
    for (int64_t i = 0; i < total; i++) labels[i] = (i * 7) % 10;
    CHECK_OK(td_tensor_write(m.input, x + first * 784));
    CHECK_OK(td_tensor_write(m.labels, labels + first));
    for (int s = 0; s < steps && opt; s++) {
        if (ddp) CHECK_OK(td_ddp_prepare_forward(ddp));
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_graph_backward(g, m.loss));
        if (ddp) CHECK_OK(td_ddp_finish_backward(ddp));
        CHECK_OK(td_optim_step(opt));
        CHECK_OK(td_graph_zero_grad(g));
    }
    *count = 0;
    for (size_t i = 0; i < np; i++) *count += p[i].count;
    for (size_t i = 0; i < nb; i++) *count += b[i].count;
    float *all = malloc(*count * sizeof *all), *at = all;
    for (size_t i = 0; i < np; i++, at += p[i - 1].count)
        memcpy(at, p[i].data, p[i].count * sizeof *at);
    for (size_t i = 0; i < nb; i++, at += b[i - 1].count)
        memcpy(at, b[i].data, b[i].count * sizeof *at);
    if (ddp) {
        td_graph_set_grad_ready_hook(g, NULL, NULL);
        td_ddp_destroy(ddp);
    }
    td_optim_destroy(opt);
    td_graph_destroy(g);
    free(x), free(labels);
    return all;
}

static void world_1_rank(int rank, int world, int port, void *arg) {
    (void)arg;
    size_t n_plain, n_none, n_one;
    float *plain = train_cnn(NULL, 0, 8, 0, 3, &n_plain);
    float *none = train_cnn(NULL, 1, 8, 0, 3, &n_none); /* the switch, no group */
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, world, port, 20));
    float *one = comm ? train_cnn(comm, 1, 8, 0, 3, &n_one) : NULL; /* a group of one */
    CHECK_EQ(n_none, n_plain);
    CHECK(memcmp(plain, none, n_plain * sizeof *plain) == 0);
    if (one) {
        CHECK_EQ(n_one, n_plain);
        CHECK(memcmp(plain, one, n_plain * sizeof *plain) == 0);
    }
    free(plain), free(none), free(one);
    td_comm_destroy(comm);
}

static void sync_batch_norm_at_world_1_is_batch_norm_bit_for_bit(void) {
    CHECK_EQ(test_run_ranks(1, world_1_rank, NULL, 30, 0), 0);
}

/* ---- DDP + SyncBatchNorm: world 2 trains the CNN as one process on the global batch ------ */

static void cnn_rank(int rank, int world, int port, void *arg) {
    (void)arg;
    size_t n_ref, n;
    float *ref = train_cnn(NULL, 0, 8, 0, 3, &n_ref);
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, world, port, 20));
    if (!comm) return;
    float *got = train_cnn(comm, 1, 8 / world, rank * (8 / world), 3, &n);
    CHECK_EQ(n, n_ref);
    if (n == n_ref) check_rel(rank, "CNN parameters and running stats", got, ref, n);
    free(ref), free(got);
    td_comm_destroy(comm);
}

static void ddp_with_sync_batch_norm_equals_one_process_2_ranks(void) {
    CHECK_EQ(test_run_ranks(2, cnn_rank, NULL, 60, 0), 0);
}

/* ---- mixed precision ----------------------------------------------------------------------- */

/* The CNN's loss at world 2 with SyncBatchNorm at AMP level `level` (bf16), and the dtypes its
 * first batch norm's and first convolution's weights are stored in. */
static float amp_loss(td_comm *comm, td_amp_level level, td_dtype *bn_w, td_dtype *conv_w) {
    td_graph_params gp = td_graph_default_params();
    gp.comm = comm;
    gp.sync_batch_norm = 1;
    gp.amp.level = level;
    td_graph *g = NULL;
    td_model m;
    CHECK_OK(td_graph_create(&g, &gp));
    CHECK_OK(td_model_build(g, TD_MODEL_CNN, 4, 3, &m));
    td_param *p;
    size_t np;
    CHECK_OK(td_graph_parameters(g, &p, &np));
    for (size_t i = 0; i < np; i++) {
        if (!strcmp(p[i].name, "bn1.weight")) *bn_w = p[i].dtype;
        if (!strcmp(p[i].name, "conv1.weight")) *conv_w = p[i].dtype;
    }
    int rank = td_comm_rank(comm);
    float *x = randn(8 * 784, 12);
    int64_t labels[4] = {1, 3, 5, 7};
    CHECK_OK(td_tensor_write(m.input, x + rank * 4 * 784));
    CHECK_OK(td_tensor_write(m.labels, labels));
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_graph_backward(g, m.loss));
    float loss = NAN;
    CHECK_OK(td_tensor_read(m.loss, &loss));
    free(x);
    td_graph_destroy(g);
    return loss;
}

static void amp_rank(int rank, int world, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, world, port, 20));
    if (!comm) return;
    td_dtype bn_w = TD_DTYPE_COUNT, conv_w = TD_DTYPE_COUNT;
    float f32 = amp_loss(comm, TD_AMP_O0, &bn_w, &conv_w);
    float o2 = amp_loss(comm, TD_AMP_O2, &bn_w, &conv_w);
    CHECK_EQ(bn_w, TD_F32); /* batch norm's weights stay f32 at O2, as apex keeps them */
    CHECK_EQ(conv_w, TD_BF16);
    CHECK_NEAR(o2, f32, 0.02 * fabs(f32));
    td_comm_destroy(comm);
}

static void sync_batch_norm_under_amp_o2_computes_in_f32(void) {
    CHECK_EQ(test_run_ranks(2, amp_rank, NULL, 30, 0), 0);
}

/* ---- graphs that differ between ranks ---------------------------------------------------- */

static void mismatch_rank(int rank, int world, int port, void *arg) {
    int kind = *(const int *)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, world, port, 10));
    if (!comm) return;
    td_graph *g = graph_on(comm, 0);
    td_tensor *x, *y, *w, *b, *rm, *rv;
    if (kind == 0 || rank == 0) { /* all_gather of (2, 4) on rank 0, (3, 4) on rank 1 */
        CHECK_OK(td_graph_input(g, "x", td_shape_2d(2 + (kind == 0 ? rank : 0), 4), TD_F32, 0, &x));
        CHECK_OK(td_graph_all_gather(g, x, &y));
    } else { /* rank 1 has a SyncBatchNorm where rank 0 gathers */
        CHECK_OK(td_graph_input(g, "x", td_shape_4d(2, 4, 1, 1), TD_F32, 0, &x));
        CHECK_OK(td_graph_param(g, "w", td_shape_1d(4), &w));
        CHECK_OK(td_graph_param(g, "b", td_shape_1d(4), &b));
        CHECK_OK(td_graph_buffer(g, "rm", td_shape_1d(4), &rm));
        CHECK_OK(td_graph_buffer(g, "rv", td_shape_1d(4), &rv));
        CHECK_OK(td_graph_sync_batch_norm2d(g, x, w, b, rm, rv, NULL, &y));
    }
    CHECK_STATUS(td_graph_compile(g), TD_ESHAPE);
    const char *e = td_last_error();
    CHECK(strstr(e, "rank 0 has all_gather of f32 (2, 4)") != NULL);
    CHECK(strstr(e, kind == 0 ? "rank 1 has all_gather of f32 (3, 4)"
                              : "rank 1 has sync_batch_norm2d of f32 (4)") != NULL);
    if (test_case_failed) fprintf(stderr, "rank %d: %s\n", rank, e);
    /* The group is still usable. */
    CHECK_OK(td_comm_barrier(comm));
    td_graph_destroy(g);
    td_comm_destroy(comm);
}

static void ranks_with_different_graphs_get_an_error_naming_both(void) {
    int kinds[] = {0, 1};
    for (int i = 0; i < 2; i++) CHECK_EQ(test_run_ranks(2, mismatch_rank, &kinds[i], 30, 0), 0);
}

int main(void) {
    RUN(all_gather_equals_one_process_2_ranks);
    RUN(all_gather_equals_one_process_4_ranks);
    RUN(all_reduce_equals_one_process_2_ranks);
    RUN(all_reduce_equals_one_process_4_ranks);
    RUN(sync_batch_norm_equals_one_process_2_ranks);
    RUN(sync_batch_norm_equals_one_process_4_ranks);
    RUN(sync_batch_norm_in_eval_mode_communicates_nothing);
    RUN(sync_batch_norm_at_world_1_is_batch_norm_bit_for_bit);
    RUN(ddp_with_sync_batch_norm_equals_one_process_2_ranks);
    RUN(sync_batch_norm_under_amp_o2_computes_in_f32);
    RUN(ranks_with_different_graphs_get_an_error_naming_both);
    TEST_END();
}
