/* DataParallel (td_dp) against single-process training on the same global batch.
 *
 * Per-sample models (the MLP, and a BN-free conv net built through the builder callback)
 * must match one graph trained on the whole batch. The CNN has BatchNorm, whose batch
 * statistics are per replica in DataParallel (as in PyTorch), so it is compared with one
 * graph of the per-replica batch size that runs the replicas' slices one after another and
 * accumulates their gradients: the computation DataParallel is meant to spread over
 * devices. Also: DDP2 (td_dp in each of two processes, their gradients averaged by td_ddp)
 * matches one graph on both processes' batches together; replica 0 holds more memory than the
 * others; bad input is refused; replicas on GPUs match one graph there (skipped without one). */
#include <stdlib.h>
#include <string.h>

#include "tandem/device.h"
#include "tandem/dp.h"
#include "tandem/graph.h"
#include "tandem/nn.h"
#include "tandem/optim.h"
#include "tandem/tensor.h"
#include "tandem/trace.h"

#include "test.h"
#include "test_comm_util.h" /* test_run_ranks, test_comm_create */

#define SAMPLE (28 * 28)
#define STEPS 3

static void make_batch(int64_t B, uint64_t seed, float *x, int64_t *y) {
    td_rng rng;
    td_rng_init(&rng, seed);
    for (int64_t i = 0; i < B * SAMPLE; i++) x[i] = td_rng_normal(&rng);
    for (int64_t i = 0; i < B; i++) y[i] = (int64_t)td_rng_below(&rng, 10);
}

static td_sgd_params sgd(void) {
    td_sgd_params p = td_sgd_default_params();
    p.lr = 0.05;
    p.momentum = 0.9;
    return p;
}

/* A small conv net without BatchNorm or dropout, so that every sample's gradient is
 * independent of the others and DataParallel must match full-batch training exactly. */
static td_status build_small_conv(td_graph *g, int64_t batch, int replica, void *ctx, td_model *m) {
    (void)replica;
    (void)ctx;
    td_rng rng;
    td_rng_init(&rng, 7);
    td_tensor *h, *logits;
    td_conv2d_params cp = td_conv2d_default_params();
    cp.padding[0] = cp.padding[1] = 1;
    td_pool2d_params pp = td_pool2d_default_params();
    memset(m, 0, sizeof *m);
    m->batch = batch;
    td_status s = td_graph_input(g, "input", td_shape_4d(batch, 1, 28, 28), TD_F32, 0, &m->input);
    if (!s) s = td_graph_input(g, "labels", td_shape_1d(batch), TD_I64, 0, &m->labels);
    if (!s) s = td_nn_conv2d(g, "conv", m->input, 4, 3, &cp, 1, &rng, &h);
    if (!s) s = td_graph_relu(g, h, &h);
    if (!s) s = td_graph_max_pool2d(g, h, &pp, &h);
    if (!s) s = td_graph_flatten(g, h, 1, &h);
    if (!s) s = td_nn_linear(g, "fc", h, 10, 1, &rng, &logits);
    if (!s)
        s = td_graph_cross_entropy(g, logits, m->labels, TD_REDUCTION_MEAN, &m->loss, &m->output);
    if (!s) s = td_graph_compile(g);
    return s;
}

/* A reference trainer: one graph of batch `b` and SGD over its parameters. */
typedef struct {
    td_graph *g;
    td_model m;
    td_optim *opt;
    td_param *params;
    size_t n;
} ref_trainer;

static int ref_init(ref_trainer *t, td_model_kind kind, td_dp_build_fn build, int64_t b) {
    memset(t, 0, sizeof *t);
    td_sgd_params hp = sgd();
    if (td_graph_create(&t->g, NULL) != TD_OK) return 0;
    td_status s = build ? build(t->g, b, 0, NULL, &t->m) : td_model_build(t->g, kind, b, 0, &t->m);
    if (s == TD_OK) s = td_graph_parameters(t->g, &t->params, &t->n);
    if (s == TD_OK) s = td_optim_create_sgd(&t->opt, t->params, t->n, &hp);
    CHECK_OK(s);
    return s == TD_OK;
}

static void ref_free(ref_trainer *t) {
    td_optim_destroy(t->opt);
    td_graph_destroy(t->g);
}

/* One full-batch step: the graph's own loss over all B samples. */
static void ref_step_full(ref_trainer *t, const float *x, const int64_t *y, float *loss) {
    CHECK_OK(td_tensor_write(t->m.input, x));
    CHECK_OK(td_tensor_write(t->m.labels, y));
    CHECK_OK(td_graph_zero_grad(t->g));
    CHECK_OK(td_graph_forward(t->g));
    CHECK_OK(td_tensor_read(t->m.loss, loss));
    CHECK_OK(td_graph_backward(t->g, t->m.loss));
    CHECK_OK(td_optim_step(t->opt));
}

/* One step as `n` slices of b samples through one graph, gradients accumulated with the
 * global-batch scale -1/B, so BatchNorm sees exactly the slices DataParallel's replicas see. */
static void ref_step_sliced(ref_trainer *t, int n, int64_t b, const float *x, const int64_t *y,
                            float *loss) {
    int64_t B = b * n;
    float *logp = malloc((size_t)(b * 10) * sizeof(float));
    float *dy = malloc((size_t)(b * 10) * sizeof(float));
    double sum = 0;
    CHECK_OK(td_graph_zero_grad(t->g));
    for (int d = 0; d < n; d++) {
        CHECK_OK(td_tensor_write(t->m.input, x + d * b * SAMPLE));
        CHECK_OK(td_tensor_write(t->m.labels, y + d * b));
        CHECK_OK(td_graph_forward(t->g));
        CHECK_OK(td_tensor_read(t->m.output, logp));
        memset(dy, 0, (size_t)(b * 10) * sizeof(float));
        for (int64_t i = 0; i < b; i++) {
            sum -= logp[i * 10 + y[d * b + i]];
            dy[i * 10 + y[d * b + i]] = -1.0f / (float)B;
        }
        CHECK_OK(td_graph_backward_from(t->g, t->m.output, dy));
    }
    *loss = (float)(sum / (double)B);
    CHECK_OK(td_optim_step(t->opt));
    free(logp);
    free(dy);
}

/* ||a - b|| / ||b|| over every parameter, and ||b - init|| / ||b|| to show training moved. */
static double rel_diff(const td_param *a, const td_param *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        const float *pa = a[i].data, *pb = b[i].data;
        for (size_t k = 0; k < a[i].count; k++) {
            double d = (double)pa[k] - (double)pb[k];
            num += d * d;
            den += (double)pb[k] * (double)pb[k];
        }
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static float *snapshot(const td_param *p, size_t n) {
    size_t total = 0, off = 0;
    for (size_t i = 0; i < n; i++) total += p[i].count;
    float *s = malloc(total * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        memcpy(s + off, p[i].data, p[i].count * sizeof(float));
        off += p[i].count;
    }
    return s;
}

static double moved(const td_param *p, size_t n, const float *before) {
    double num = 0;
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const float *d = p[i].data;
        for (size_t k = 0; k < p[i].count; k++, off++)
            num += ((double)d[k] - before[off]) * ((double)d[k] - before[off]);
    }
    return sqrt(num);
}

/* DP with n replicas vs the reference; sliced = 1 compares with the sliced reference. */
static void compare(td_model_kind kind, td_dp_build_fn build, int n, int64_t B, int sliced) {
    float *x = malloc((size_t)(B * SAMPLE) * sizeof(float));
    int64_t *y = malloc((size_t)B * sizeof(int64_t));
    td_dp_params p = td_dp_default_params();
    p.n_devices = n;
    p.global_batch = B;
    p.model = kind;
    p.build = build;
    p.sgd = sgd();
    td_dp *dp = NULL;
    ref_trainer ref;
    CHECK_OK(td_dp_create(&dp, &p));
    if (!dp || !ref_init(&ref, kind, build, sliced ? B / n : B)) {
        td_dp_destroy(dp);
        free(x);
        free(y);
        return;
    }
    td_param *dparams = NULL;
    size_t dn = 0;
    CHECK_OK(td_graph_parameters(td_dp_graph(dp, 0), &dparams, &dn));
    CHECK_EQ(dn, ref.n);
    CHECK(rel_diff(dparams, ref.params, ref.n) == 0.0); /* same initialisation */
    float *init = snapshot(ref.params, ref.n);
    for (int step = 0; step < STEPS; step++) {
        make_batch(B, 100 + (uint64_t)step, x, y);
        float l_dp = 0, l_ref = 0;
        CHECK_OK(td_dp_step(dp, x, y, &l_dp));
        if (sliced)
            ref_step_sliced(&ref, n, B / n, x, y, &l_ref);
        else
            ref_step_full(&ref, x, y, &l_ref);
        CHECK(l_dp > 0.5f);
        CHECK_NEAR(l_dp, l_ref, 1e-5 * fabs(l_ref));
    }
    double diff = rel_diff(dparams, ref.params, ref.n);
    double move = moved(ref.params, ref.n, init);
    if (!(diff <= 1e-5))
        TEST_FAIL_AT("%s, %d replicas: parameters differ by %.3g (relative)",
                     build ? "small conv" : td_model_name(kind), n, diff);
    CHECK(move > 1e-3); /* the comparison is not between two untrained models */
    /* The other replicas hold what replica 0 had when they were last replicated, so after a
     * step they lag by exactly one update: different from replica 0. */
    td_param *p1 = NULL;
    size_t n1 = 0;
    CHECK_OK(td_graph_parameters(td_dp_graph(dp, 1), &p1, &n1));
    CHECK(rel_diff(p1, dparams, dn) > 0);
    double secs[TD_DP_PHASE_COUNT];
    td_dp_phase_seconds(dp, secs);
    CHECK(secs[TD_DP_FORWARD] > 0 && secs[TD_DP_BACKWARD] > 0 && secs[TD_DP_REDUCE] > 0);
    free(init);
    ref_free(&ref);
    td_dp_destroy(dp);
    free(x);
    free(y);
}

static void test_mlp_2_replicas_equal_single(void) { compare(TD_MODEL_MLP, NULL, 2, 12, 0); }
static void test_mlp_3_replicas_equal_single(void) { compare(TD_MODEL_MLP, NULL, 3, 12, 0); }
static void test_conv_2_replicas_equal_single(void) {
    compare(TD_MODEL_MLP, build_small_conv, 2, 12, 0);
}
static void test_conv_3_replicas_equal_single(void) {
    compare(TD_MODEL_MLP, build_small_conv, 3, 12, 0);
}
static void test_cnn_bn_2_replicas_equal_sliced(void) { compare(TD_MODEL_CNN, NULL, 2, 8, 1); }
static void test_cnn_bn_3_replicas_equal_sliced(void) { compare(TD_MODEL_CNN, NULL, 3, 6, 1); }

/* DDP2: each of two processes runs td_dp with 2 replicas on its half of the global batch, and
 * td_ddp averages across the processes: the same weights as one graph on the whole batch. DDP's
 * options reach it: with 1 KiB buckets the MLP's five tensors take at least four buckets (the
 * default 1 MiB first bucket would hold three of them). */
static void ddp2_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    enum { B = 12 };
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 20));
    if (!comm) return;
    float *x = malloc((size_t)(B * SAMPLE) * sizeof(float));
    int64_t y[B];
    td_dp_params p = td_dp_default_params();
    p.global_batch = B / size;
    p.sgd = sgd();
    p.pin_threads = 0;
    p.comm = comm;
    td_trace *trace = NULL;
    CHECK_OK(td_trace_create(&trace, rank));
    p.ddp.bucket_bytes = 1024;
    p.ddp.trace = trace;
    td_dp *dp = NULL;
    ref_trainer ref;
    CHECK_OK(td_dp_create(&dp, &p));
    if (dp && ref_init(&ref, TD_MODEL_MLP, NULL, B)) {
        td_param *dparams = NULL;
        size_t dn = 0;
        CHECK_OK(td_graph_parameters(td_dp_graph(dp, 0), &dparams, &dn));
        for (int step = 0; step < STEPS; step++) {
            make_batch(B, 100 + (uint64_t)step, x, y);
            float loss;
            int64_t b = B / size;
            CHECK_OK(td_dp_step(dp, x + rank * b * SAMPLE, y + rank * b, &loss));
            ref_step_full(&ref, x, y, &loss);
        }
        double diff = rel_diff(dparams, ref.params, ref.n);
        if (!(diff <= 1e-5))
            TEST_FAIL_AT("rank %d: DDP2 differs from one graph by %.3g", rank, diff);
        ref_free(&ref);
        size_t buckets = 0;
        for (size_t i = 0; i < td_trace_count(trace); i++) {
            td_trace_event e;
            size_t k;
            CHECK_OK(td_trace_event_get(trace, i, &e));
            if (sscanf(e.name, "allreduce bucket %zu", &k) == 1 && k + 1 > buckets) buckets = k + 1;
        }
        if (buckets < 4)
            TEST_FAIL_AT("rank %d: %zu buckets with bucket_bytes 1 KiB", rank, buckets);
    }
    td_dp_destroy(dp);
    td_trace_destroy(trace);
    td_comm_destroy(comm);
    free(x);
}

/* A parameter's element k as f32, whatever float dtype it has. */
static double value(const td_param *p, size_t k) {
    return p->dtype == TD_BF16 ? td_bf16_to_f32(((const uint16_t *)p->data)[k])
                               : ((const float *)p->data)[k];
}

/* Every replica runs at the graph options' mixed-precision level: at O2 the replicas' weights
 * are bf16, and two replicas train as one replica on the whole batch does (their bf16 gradients
 * summed in f32, so to bf16's precision rather than to the bit). */
static void test_replicas_run_at_the_amp_level(void) {
    enum { B = 12 };
    float *x = malloc((size_t)(B * SAMPLE) * sizeof(float));
    int64_t y[B];
    td_dp *dp[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
        td_dp_params p = td_dp_default_params();
        p.n_devices = 2 - k;
        p.global_batch = B;
        p.graph.amp.level = TD_AMP_O2;
        p.sgd = sgd();
        CHECK_OK(td_dp_create(&dp[k], &p));
    }
    td_param *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    if (dp[0] && dp[1]) {
        for (int d = 0; d < 2; d++) {
            CHECK_OK(td_graph_parameters(td_dp_graph(dp[0], d), &a, &na));
            for (size_t i = 0; i < na; i++)
                if (a[i].dtype != TD_BF16)
                    TEST_FAIL_AT("replica %d's '%s' is %s at O2", d, a[i].name,
                                 td_dtype_name(a[i].dtype));
        }
        for (int step = 0; step < STEPS; step++) {
            make_batch(B, 100 + (uint64_t)step, x, y);
            float l2 = 0, l1 = 0;
            CHECK_OK(td_dp_step(dp[0], x, y, &l2));
            CHECK_OK(td_dp_step(dp[1], x, y, &l1));
            CHECK_NEAR(l2, l1, 1e-2 * fabs(l1));
        }
        CHECK_OK(td_graph_parameters(td_dp_graph(dp[0], 0), &a, &na));
        CHECK_OK(td_graph_parameters(td_dp_graph(dp[1], 0), &b, &nb));
        CHECK_EQ(na, nb);
        double num = 0, den = 0, move = 0;
        for (size_t i = 0; i < na && i < nb; i++)
            for (size_t k = 0; k < a[i].count; k++) {
                double d = value(&a[i], k) - value(&b[i], k);
                num += d * d;
                den += value(&b[i], k) * value(&b[i], k);
            }
        move = sqrt(num / (den > 0 ? den : 1));
        if (!(move < 1e-2)) TEST_FAIL_AT("2 replicas differ from 1 at O2 by %.3g", move);
    }
    td_dp_destroy(dp[0]);
    td_dp_destroy(dp[1]);
    free(x);
}

static void test_ddp2_two_processes_equal_single(void) {
    CHECK_EQ(test_run_ranks(2, ddp2_rank, NULL, 60, 0), 0);
}

/* The bench's size: large enough that oneDNN's convolutions use a scratchpad, which lives
 * with the thread that created the primitive; replicas built on another thread crash here. */
static void test_cnn_full_size_runs_on_replica_threads(void) {
    enum { B = 128 };
    td_dp_params p = td_dp_default_params();
    p.model = TD_MODEL_CNN;
    p.global_batch = B;
    p.sgd.lr = 0.001; /* no momentum: on noise this CNN diverges at 0.01, in one process too */
    td_dp *dp = NULL;
    CHECK_OK(td_dp_create(&dp, &p));
    if (!dp) return;
    float *x = malloc((size_t)B * SAMPLE * sizeof(float));
    int64_t y[B];
    make_batch(B, 5, x, y);
    float first = 0, loss = 0;
    CHECK_OK(td_dp_step(dp, x, y, &first));
    for (int i = 0; i < 3; i++) CHECK_OK(td_dp_step(dp, x, y, &loss));
    CHECK(isfinite(first) && isfinite(loss));
    if (!(loss < first))
        TEST_FAIL_AT("loss %g after 4 steps on one batch, %g after 1", loss, first);
    free(x);
    td_dp_destroy(dp);
}

static void test_memory_replica0_holds_more(void) {
    td_dp_params p = td_dp_default_params();
    p.n_devices = 2;
    p.global_batch = 8;
    p.model = TD_MODEL_MLP;
    p.sgd = sgd();
    td_dp *dp = NULL;
    CHECK_OK(td_dp_create(&dp, &p));
    if (!dp) return;
    float x[8 * SAMPLE];
    int64_t y[8];
    make_batch(8, 1, x, y);
    CHECK_OK(td_dp_step(dp, x, y, NULL));
    td_dp_memory m0, m1;
    CHECK_OK(td_dp_memory_stats(dp, 0, &m0));
    CHECK_OK(td_dp_memory_stats(dp, 1, &m1));
    CHECK(m0.total_bytes > m1.total_bytes);
    CHECK_EQ(m0.param_bytes, m1.param_bytes);
    /* 784*1024 + 1024 + 1024*1024 + 1024 + 1024*10 + 10 floats */
    CHECK_EQ(m0.param_bytes, (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 10240 + 10) * 4);
    CHECK_EQ(m0.reduce_bytes, m0.param_bytes);
    CHECK_EQ(m1.reduce_bytes, 0);
    CHECK_EQ(m0.optimizer_bytes >= m0.param_bytes, 1); /* one momentum buffer per parameter */
    CHECK_EQ(m1.optimizer_bytes, 0);
    CHECK(m0.input_bytes > m1.input_bytes && m0.output_bytes > m1.output_bytes);
    CHECK(m1.graph_bytes > 0);
    CHECK_EQ(m0.total_bytes, m0.param_bytes + m0.graph_bytes + m0.input_bytes + m0.output_bytes +
                                 m0.reduce_bytes + m0.optimizer_bytes);
    CHECK_STATUS(td_dp_memory_stats(dp, 2, &m0), TD_EINVAL);
    td_dp_destroy(dp);
}

static td_status build_fails(td_graph *g, int64_t batch, int replica, void *ctx, td_model *m) {
    (void)g;
    (void)batch;
    (void)ctx;
    (void)m;
    return replica == 1 ? TD_ESHAPE : td_model_build(g, TD_MODEL_MLP, batch, 0, m);
}

static void test_bad_input_refused(void) {
    td_dp_params p = td_dp_default_params();
    td_dp *dp = NULL;
    p.n_devices = 0;
    CHECK_STATUS(td_dp_create(&dp, &p), TD_EINVAL);
    p.n_devices = 3;
    p.global_batch = 10;
    CHECK_STATUS(td_dp_create(&dp, &p), TD_EINVAL);
    CHECK(strstr(td_last_error(), "global_batch 10") != NULL);
    CHECK(dp == NULL);
    p.global_batch = 6;
    p.build = build_fails;
    CHECK_STATUS(td_dp_create(&dp, &p), TD_ESHAPE);
    CHECK(dp == NULL);
    p.build = NULL;
    p.n_devices = 2;
    p.global_batch = 4;
    CHECK_OK(td_dp_create(&dp, &p));
    if (!dp) return;
    float x[4 * SAMPLE];
    int64_t y[4];
    make_batch(4, 3, x, y);
    y[2] = 10;
    CHECK_STATUS(td_dp_step(dp, x, y, NULL), TD_EINVAL);
    CHECK(strstr(td_last_error(), "label 10 of sample 2") != NULL);
    y[2] = 1;
    CHECK_OK(td_dp_step(dp, x, y, NULL)); /* a refused step leaves it usable */
    CHECK(td_dp_graph(dp, 2) == NULL && td_dp_model(dp, -1) == NULL);
    CHECK_EQ(td_dp_model(dp, 1)->batch, 2);
    CHECK_EQ(td_dp_replicas(dp), 2);
    td_dp_destroy(dp);
}

/* One f32 array of every parameter's values, wherever they live. */
static float *host_values(const td_param *p, size_t n) {
    size_t total = 0, off = 0;
    for (size_t i = 0; i < n; i++) total += p[i].count;
    float *h = malloc((total ? total : 1) * sizeof *h);
    for (size_t i = 0; i < n; i++) {
        CHECK_OK(td_device_copy(td_device_cpu(), h + off, p[i].device, p[i].data,
                                p[i].count * sizeof *h));
        off += p[i].count;
    }
    return h;
}

/* Replicas on GPUs (two on cuda:0, as DataParallel with one device id twice; on cuda:0 and
 * cuda:1 where two are visible) train the MLP to what one process on cuda:0 reaches on the
 * whole batch. Run last: this process starts CUDA, and the other cases fork. */
static void test_replicas_on_gpus_equal_single(void) {
    int gpus = 0;
    CHECK_OK(td_cuda_device_count(&gpus));
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    const int64_t B = 12;
    td_device devs[2] = {td_device_cuda(0), td_device_cuda(gpus > 1 ? 1 : 0)};
    td_dp_params p = td_dp_default_params();
    p.global_batch = B;
    p.sgd = sgd();
    p.devices = devs;
    td_dp *dp = NULL;
    CHECK_OK(td_dp_create(&dp, &p));
    td_graph_params gp = td_graph_default_params();
    gp.device = devs[0];
    td_graph *g = NULL;
    td_model m;
    td_param *rp = NULL, *dparams = NULL;
    size_t rn = 0, dn = 0;
    td_optim *opt = NULL;
    td_sgd_params hp = sgd();
    CHECK_OK(td_graph_create(&g, &gp));
    if (g) CHECK_OK(td_model_build(g, TD_MODEL_MLP, B, 0, &m));
    if (g) CHECK_OK(td_graph_parameters(g, &rp, &rn));
    if (rp) CHECK_OK(td_optim_create_sgd(&opt, rp, rn, &hp));
    if (dp) CHECK_OK(td_graph_parameters(td_dp_graph(dp, 0), &dparams, &dn));
    float *x = malloc((size_t)(B * SAMPLE) * sizeof(float));
    int64_t y[12];
    for (int step = 0; step < STEPS && dp && opt && dn == rn; step++) {
        make_batch(B, 100 + (uint64_t)step, x, y);
        float l_dp = 0, l_ref = 0;
        CHECK_OK(td_dp_step(dp, x, y, &l_dp));
        CHECK_OK(td_tensor_write(m.input, x));
        CHECK_OK(td_tensor_write(m.labels, y));
        CHECK_OK(td_graph_zero_grad(g));
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_tensor_read(m.loss, &l_ref));
        CHECK_OK(td_graph_backward(g, m.loss));
        CHECK_OK(td_optim_step(opt));
        CHECK_NEAR(l_dp, l_ref, 1e-5 * fabs(l_ref));
    }
    if (dp && opt && dn == rn) {
        float *a = host_values(dparams, dn), *b = host_values(rp, rn);
        double num = 0, den = 0;
        for (size_t i = 0, off = 0; i < rn; off += rp[i].count, i++)
            for (size_t k = 0; k < rp[i].count; k++) {
                double d = (double)a[off + k] - b[off + k];
                num += d * d;
                den += (double)b[off + k] * b[off + k];
            }
        if (!(sqrt(num / den) <= 1e-5))
            TEST_FAIL_AT("replicas on cuda:0 and %s: parameters differ by %.3g (relative)",
                         gpus > 1 ? "cuda:1" : "cuda:0", sqrt(num / den));
        free(a);
        free(b);
    }
    free(x);
    td_optim_destroy(opt);
    td_graph_destroy(g);
    td_dp_destroy(dp);
}

int main(void) {
    RUN(test_mlp_2_replicas_equal_single);
    RUN(test_mlp_3_replicas_equal_single);
    RUN(test_conv_2_replicas_equal_single);
    RUN(test_conv_3_replicas_equal_single);
    RUN(test_cnn_bn_2_replicas_equal_sliced);
    RUN(test_cnn_bn_3_replicas_equal_sliced);
    RUN(test_cnn_full_size_runs_on_replica_threads);
    RUN(test_ddp2_two_processes_equal_single);
    RUN(test_replicas_run_at_the_amp_level);
    RUN(test_memory_replica0_holds_more);
    RUN(test_bad_input_refused);
    RUN(test_replicas_on_gpus_equal_single);
    TEST_END();
}
