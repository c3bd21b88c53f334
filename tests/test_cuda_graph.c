/* The graph on a GPU against the same graph on the CPU: each case builds twin graphs through
 * the public API, one on the CPU (the oracle: oneDNN and the reference kernels, themselves
 * checked in test_ops) and one on cuda:0, initialises every leaf with the same values, runs
 * forward and backward twice (the second backward adds into the first's gradients, so both
 * the write and the accumulate paths run), and compares the output, every parameter and
 * input gradient and every buffer (batch norm's running statistics). Tolerance, as numpy's
 * allclose: |gpu - cpu| <= tol (|cpu| + max|cpu|/10); f32 1e-5, bf16 and f16 (apex O1 on
 * tensor cores) 2e-2 and 5e-3 (docs/gpu.md); f32 1e-4 where per-channel sums feed a
 * difference of nearly equal terms (batch norm's backward) or rounding compounds through a
 * whole model. The CPU convolves directly (no Winograd), as cuDNN does at f32. Every case
 * skips with one line where no GPU is visible; the first two cases (a refusal, and the
 * transformer kernels' launch arithmetic) run everywhere. */
#include <string.h>

#include "tandem/tandem.h"

#include "ops/cuda/tiling.h"
#include "test.h"

static int gpus;

/* Returns a failed status from a builder (its message is the thread's last error). */
#define TRY(call)                           \
    do {                                    \
        td_status try_s_ = (call);          \
        if (try_s_ != TD_OK) return try_s_; \
    } while (0)

/* ---- twins ------------------------------------------------------------------------------ */

#define TWIN_MAX_LEAVES 16

/* What a case's builder made: the tensor backward starts from (a scalar loss, or an output
 * that gets a random upstream gradient), the leaves whose gradients are compared and which
 * are initialised at random unless the builder wrote them itself (given), and the mode. */
typedef struct {
    td_tensor *y;
    int is_loss;
    int eval; /* run forward and backward in eval mode */
    td_tensor *leaves[TWIN_MAX_LEAVES];
    int given[TWIN_MAX_LEAVES];
    int nleaves;
    int keyed; /* dropout keyed by sample: td_graph_set_rng_key before each forward */
} built;

typedef td_status (*build_fn)(td_graph *g, built *b);

static td_tensor *leaf(built *b, td_tensor *t) {
    if (b->nleaves < TWIN_MAX_LEAVES) b->leaves[b->nleaves++] = t;
    return t;
}

/* A leaf whose values the builder writes (data without ties, positive variances, token ids),
 * in its own dtype. */
static td_tensor *given_leaf(built *b, td_tensor *t, const void *v) {
    CHECK_OK(td_tensor_write(t, v));
    if (b->nleaves < TWIN_MAX_LEAVES) b->given[b->nleaves] = 1;
    return leaf(b, t);
}

/* A tensor's values as f32, whatever its dtype (labels are compared as integers). */
static float *values(const td_tensor *t, int grad) {
    size_t n = (size_t)td_tensor_numel(t);
    td_dtype dt = td_tensor_dtype(t);
    size_t es = td_dtype_size(dt);
    unsigned char *raw = malloc(n * es + 1);
    float *v = malloc((n ? n : 1) * sizeof *v);
    td_status s = grad ? td_tensor_read_grad(t, raw) : td_tensor_read(t, raw);
    if (s != TD_OK) TEST_FAIL_AT("reading '%s': %s", td_tensor_name(t), td_last_error());
    for (size_t i = 0; i < n; i++) {
        if (s != TD_OK)
            v[i] = 0.f;
        else if (dt == TD_F32)
            memcpy(&v[i], raw + 4 * i, 4);
        else if (dt == TD_BF16 || dt == TD_F16) {
            uint16_t h;
            memcpy(&h, raw + 2 * i, 2);
            v[i] = dt == TD_BF16 ? td_bf16_to_f32(h) : td_f16_to_f32(h);
        } else if (dt == TD_I64) {
            int64_t x;
            memcpy(&x, raw + 8 * i, 8);
            v[i] = (float)x;
        } else {
            v[i] = 0.f;
        }
    }
    free(raw);
    return v;
}

/* The least scale an element's tolerance is taken against: a parameter gradient whose values
 * are all rounding noise (a convolution's bias before batch norm, whose true gradient is 0) is
 * compared against the model's gradients, not against its own noise. */
static double compare_floor;

static void compare_values(const char *what, const char *name, const char *kind, const float *want,
                           const float *got, size_t n, double tol) {
    double scale = compare_floor, worst = 0.0;
    for (size_t i = 0; i < n; i++)
        if (fabs(want[i]) > scale) scale = fabs(want[i]);
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        if (d > worst) worst = d;
        if (!(d <= tol * (fabs(want[i]) + scale / 10)) && bad++ < 3)
            TEST_FAIL_AT("%s '%s'%s[%zu]: gpu %.9g, cpu %.9g", what, name, kind, i, (double)got[i],
                         (double)want[i]);
    }
    if (bad)
        TEST_FAIL_AT("%s '%s'%s: %d of %zu differ (worst %.3g, max |cpu| %.3g, tol %g)", what, name,
                     kind, bad, n, worst, scale, tol);
}

static void compare(const char *what, const td_tensor *cpu, const td_tensor *gpu, int grad,
                    double tol) {
    size_t n = (size_t)td_tensor_numel(cpu);
    float *want = values(cpu, grad), *got = values(gpu, grad);
    compare_values(what, td_tensor_name(cpu), grad ? " grad" : "", want, got, n, tol);
    free(want);
    free(got);
}

/* The graphs' buffers (f32; the GPU's in device memory), in registration order. */
static void compare_buffers(const char *what, td_graph *cpu, td_graph *gpu, double tol) {
    td_param *bp[2];
    size_t nb[2];
    CHECK_OK(td_graph_buffers(cpu, &bp[0], &nb[0]));
    CHECK_OK(td_graph_buffers(gpu, &bp[1], &nb[1]));
    CHECK_EQ(nb[0], nb[1]);
    for (size_t i = 0; i < nb[0] && i < nb[1]; i++) {
        const td_param *want = &bp[0][i], *got = &bp[1][i];
        CHECK(got->device.type == TD_DEVICE_CUDA);
        CHECK(want->dtype == TD_F32 && got->dtype == TD_F32 && want->count == got->count);
        float *host = malloc((got->count ? got->count : 1) * sizeof *host);
        td_status s = td_device_copy(td_device_cpu(), host, got->device, got->data,
                                     got->count * sizeof *host);
        if (s != TD_OK)
            TEST_FAIL_AT("reading buffer '%s': %s", got->name, td_last_error());
        else
            compare_values(what, want->name, " buffer", want->data, host, want->count, tol);
        free(host);
    }
}

/* Fills a leaf from rng: labels in [0, classes), everything else normal (parameters stored in
 * the low dtype from O2 on get the same draws rounded). */
static void init_leaf(td_tensor *t, td_rng *rng, int64_t classes) {
    size_t n = (size_t)td_tensor_numel(t);
    td_dtype dt = td_tensor_dtype(t);
    void *v = malloc(n * td_dtype_size(dt) + 1);
    for (size_t i = 0; i < n; i++) {
        float f = dt == TD_I64 ? 0.f : 0.5f * td_rng_normal(rng);
        if (dt == TD_I64)
            ((int64_t *)v)[i] = (int64_t)td_rng_below(rng, (uint32_t)classes);
        else if (dt == TD_BF16)
            ((uint16_t *)v)[i] = td_f32_to_bf16(f);
        else if (dt == TD_F16)
            ((uint16_t *)v)[i] = td_f32_to_f16(f);
        else
            ((float *)v)[i] = f;
    }
    CHECK_OK(td_tensor_write(t, v));
    free(v);
}

#define CLASSES 7

/* Builds the case on both devices, runs two steps, compares. */
static void twin(const char *what, build_fn build, td_amp_level level, td_dtype low, double tol) {
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    td_graph *g[2] = {NULL, NULL};
    built b[2];
    memset(b, 0, sizeof b);
    for (int d = 0; d < 2; d++) {
        td_graph_params p = td_graph_default_params();
        p.seed = 7;
        p.amp.level = level;
        p.amp.dtype = low;
        p.device = d ? td_device_cuda(0) : td_device_cpu();
        p.conv_winograd = 0;
        CHECK_OK(td_graph_create(&g[d], &p));
        if (!g[d]) goto out;
        td_status s = build(g[d], &b[d]);
        if (s != TD_OK) {
            TEST_FAIL_AT("%s on %s: %s", what, d ? "cuda:0" : "cpu", td_last_error());
            goto out;
        }
        td_rng rng;
        td_rng_init(&rng, 1234);
        for (int i = 0; i < b[d].nleaves; i++)
            if (!b[d].given[i]) init_leaf(b[d].leaves[i], &rng, CLASSES);
        CHECK_OK(td_graph_compile(g[d]));
        if (b[d].eval) td_graph_set_training(g[d], 0);
    }
    size_t ny = (size_t)td_tensor_numel(b[0].y);
    float *dy = malloc((ny ? ny : 1) * sizeof *dy);
    td_rng rng;
    td_rng_init(&rng, 99);
    for (size_t i = 0; i < ny; i++) dy[i] = td_rng_normal(&rng);
    for (int step = 0; step < 2; step++) {
        for (int d = 0; d < 2; d++) {
            if (b[d].keyed) CHECK_OK(td_graph_set_rng_key(g[d], (uint64_t)step + 5, 1000));
            CHECK_OK(td_graph_forward(g[d]));
            CHECK_OK(b[d].is_loss ? td_graph_backward(g[d], b[d].y)
                                  : td_graph_backward_from(g[d], b[d].y, dy));
        }
        compare(what, b[0].y, b[1].y, 0, tol);
    }
    free(dy);
    td_param *pp[2];
    size_t np[2];
    CHECK_OK(td_graph_parameters(g[0], &pp[0], &np[0]));
    CHECK_OK(td_graph_parameters(g[1], &pp[1], &np[1]));
    CHECK_EQ(np[0], np[1]);
    for (size_t i = 0; i < np[0]; i++) { /* the largest parameter gradient, on the CPU */
        const float *gr = pp[0][i].grad;
        for (size_t k = 0; gr && pp[0][i].dtype == TD_F32 && k < pp[0][i].count; k++)
            if (fabs(gr[k]) > compare_floor) compare_floor = fabs(gr[k]);
    }
    for (size_t i = 0; i < np[0] && i < np[1]; i++) {
        CHECK(pp[1][i].device.type == TD_DEVICE_CUDA);
        compare(what, td_graph_param_tensor(g[0], i), td_graph_param_tensor(g[1], i), 1, tol);
    }
    compare_floor = 0.0;
    for (int i = 0; i < b[0].nleaves; i++)
        if (td_tensor_grad(b[0].leaves[i]) && td_tensor_dtype(b[0].leaves[i]) != TD_I64)
            compare(what, b[0].leaves[i], b[1].leaves[i], 1, tol);
    compare_buffers(what, g[0], g[1], tol);
out:
    td_graph_destroy(g[0]);
    td_graph_destroy(g[1]);
}

/* ---- cases ------------------------------------------------------------------------------ */

static td_status input(td_graph *g, built *b, const char *name, td_shape s, int grad,
                       td_tensor **out) {
    TRY(td_graph_input(g, name, s, TD_F32, grad, out));
    leaf(b, *out);
    return TD_OK;
}

static td_status param(td_graph *g, built *b, const char *name, td_shape s, td_tensor **out) {
    TRY(td_graph_param(g, name, s, out));
    leaf(b, *out);
    return TD_OK;
}

static td_status build_linear(td_graph *g, built *b) {
    td_tensor *x, *w, *bias;
    TRY(input(g, b, "x", td_shape_2d(33, 70), 1, &x));
    TRY(param(g, b, "w", td_shape_2d(45, 70), &w));
    TRY(param(g, b, "b", td_shape_1d(45), &bias));
    return td_graph_linear(g, x, w, bias, &b->y);
}

static td_status build_relu_gelu_add_scale(td_graph *g, built *b) {
    td_tensor *x, *z, *w, *h1, *h2, *h3, *s;
    TRY(input(g, b, "x", td_shape_2d(17, 40), 1, &x));
    TRY(input(g, b, "z", td_shape_2d(17, 24), 1, &z));
    TRY(param(g, b, "w", td_shape_2d(24, 40), &w));
    TRY(td_graph_linear(g, x, w, NULL, &h1));
    TRY(td_graph_gelu(g, h1, &h2)); /* own output: linear's is read by backward */
    TRY(td_graph_add(g, h2, z, &h3));
    TRY(td_graph_relu(g, h3, &s)); /* in place over add's output */
    return td_graph_scale(g, s, -0.75f, &b->y);
}

static td_status build_gelu_tanh(td_graph *g, built *b) {
    td_tensor *x;
    TRY(input(g, b, "x", td_shape_2d(13, 50), 1, &x));
    return td_graph_gelu_tanh(g, x, &b->y);
}

static td_status build_softmax(td_graph *g, built *b) {
    td_tensor *x;
    TRY(input(g, b, "x", td_shape_2d(9, 1000), 1, &x));
    return td_graph_softmax(g, x, &b->y);
}

static td_status build_cross_entropy(td_graph *g, built *b) {
    td_tensor *x, *w, *labels, *logits, *flat;
    TRY(input(g, b, "x", td_shape_4d(12, 2, 3, 5), 1, &x));
    TRY(td_graph_input(g, "labels", td_shape_1d(12), TD_I64, 0, &labels));
    leaf(b, labels);
    TRY(param(g, b, "w", td_shape_2d(CLASSES, 30), &w));
    TRY(td_graph_flatten(g, x, 1, &flat));
    TRY(td_graph_linear(g, flat, w, NULL, &logits));
    b->is_loss = 1;
    return td_graph_cross_entropy(g, logits, labels, TD_REDUCTION_MEAN, &b->y, NULL);
}

static td_status build_log_softmax_nll_sum(td_graph *g, built *b) {
    td_tensor *x, *labels, *logp;
    TRY(input(g, b, "x", td_shape_2d(20, CLASSES), 1, &x));
    TRY(td_graph_input(g, "labels", td_shape_1d(20), TD_I64, 0, &labels));
    leaf(b, labels);
    TRY(td_graph_log_softmax(g, x, &logp));
    b->is_loss = 1;
    return td_graph_nll_loss(g, logp, labels, TD_REDUCTION_SUM, &b->y);
}

static td_status build_dropout(td_graph *g, built *b) {
    td_tensor *x, *w, *h;
    TRY(input(g, b, "x", td_shape_2d(8, 30), 1, &x));
    TRY(param(g, b, "w", td_shape_2d(301, 30), &w));
    TRY(td_graph_linear(g, x, w, NULL, &h));
    TRY(td_graph_dropout(g, h, 0.3f, &h));
    return td_graph_dropout(g, h, 0.5f, &b->y); /* a second node draws after the first */
}

static td_status build_dropout_keyed(td_graph *g, built *b) {
    b->keyed = 1;
    return build_dropout(g, b);
}

static td_status build_dropout2d(td_graph *g, built *b) {
    td_tensor *x;
    TRY(input(g, b, "x", td_shape_4d(4, 6, 5, 5), 1, &x));
    return td_graph_dropout2d(g, x, 0.5f, &b->y);
}

static td_status build_dropout2d_keyed(td_graph *g, built *b) {
    b->keyed = 1;
    return build_dropout2d(g, b);
}

static td_status build_concat(td_graph *g, built *b) {
    td_tensor *x[3];
    TRY(input(g, b, "x0", td_shape_4d(5, 3, 2, 2), 1, &x[0]));
    TRY(input(g, b, "x1", td_shape_4d(5, 1, 2, 2), 0, &x[1]));
    TRY(input(g, b, "x2", td_shape_4d(5, 2, 2, 2), 1, &x[2]));
    return td_graph_concat(g, x, 3, &b->y);
}

static td_status build_normalize(td_graph *g, built *b) {
    td_tensor *x;
    TRY(input(g, b, "x", td_shape_2d(9, 300), 1, &x));
    return td_graph_normalize(g, x, 1e-12f, &b->y);
}

/* x (5, 3, 11, 13) through a 3x3 convolution with stride (2, 1), padding (1, 2), dilation
 * (1, 2) and a bias: y (5, 8, 6, 13). At O1 it computes in the low dtype. */
static td_status build_conv(td_graph *g, built *b) {
    td_tensor *x, *w, *bias;
    td_conv2d_params p = td_conv2d_default_params();
    p.stride[0] = 2;
    p.padding[0] = 1;
    p.padding[1] = 2;
    p.dilation[1] = 2;
    TRY(input(g, b, "x", td_shape_4d(5, 3, 11, 13), 1, &x));
    TRY(param(g, b, "w", td_shape_4d(8, 3, 3, 3), &w));
    TRY(param(g, b, "b", td_shape_1d(8), &bias));
    return td_graph_conv2d(g, x, w, bias, &p, &b->y);
}

/* x (3, 4, 9, 9), each plane a permutation of (k - 40) / 16 for k < 81: no window holds its
 * maximum twice (where the choice of which takes the gradient is the backend's), and every
 * value is exact in bf16 and f16. */
static td_status pool_input(td_graph *g, built *b, td_tensor **x) {
    enum { N = 3, C = 4, HW = 81 };
    float v[N * C * HW];
    for (int p = 0; p < N * C; p++)
        for (int i = 0; i < HW; i++) v[p * HW + i] = (float)((i * 37 + p * 11) % HW - 40) / 16.f;
    TRY(td_graph_input(g, "x", td_shape_4d(N, C, 9, 9), TD_F32, 1, x));
    given_leaf(b, *x, v);
    return TD_OK;
}

/* Overlapping 3x3 windows, stride 2, padding 1, in `dt` (a cast first where it is not f32). */
static td_status build_pool(td_graph *g, built *b, td_dtype dt, int max) {
    td_tensor *x;
    TRY(pool_input(g, b, &x));
    if (dt != TD_F32) TRY(td_graph_cast(g, x, dt, &x));
    td_pool2d_params p = td_pool2d_default_params();
    p.kernel[0] = p.kernel[1] = 3;
    p.padding[0] = p.padding[1] = 1;
    return max ? td_graph_max_pool2d(g, x, &p, &b->y) : td_graph_avg_pool2d(g, x, &p, &b->y);
}

static td_status build_max_pool(td_graph *g, built *b) { return build_pool(g, b, TD_F32, 1); }
static td_status build_max_pool_bf16(td_graph *g, built *b) { return build_pool(g, b, TD_BF16, 1); }
static td_status build_avg_pool(td_graph *g, built *b) { return build_pool(g, b, TD_F32, 0); }
static td_status build_avg_pool_f16(td_graph *g, built *b) { return build_pool(g, b, TD_F16, 0); }

/* Batch norm of x (6, 5, 7, 9) in `dt` (a cast first where it is not f32), with running
 * statistics away from their initial 0 and 1, then a ReLU (folded into the batch norm) when
 * relu; eval runs it in eval mode. */
static td_status build_bn(td_graph *g, built *b, td_dtype dt, int relu, int eval) {
    enum { C = 5 };
    td_tensor *x, *w, *bias, *mean, *var, *y;
    TRY(input(g, b, "x", td_shape_4d(6, C, 7, 9), 1, &x));
    TRY(param(g, b, "weight", td_shape_1d(C), &w));
    TRY(param(g, b, "bias", td_shape_1d(C), &bias));
    TRY(td_graph_buffer(g, "running_mean", td_shape_1d(C), &mean));
    TRY(td_graph_buffer(g, "running_var", td_shape_1d(C), &var));
    float m[C], v[C];
    for (int c = 0; c < C; c++) {
        m[c] = 0.1f * (float)c - 0.2f;
        v[c] = 0.5f + 0.25f * (float)c;
    }
    CHECK_OK(td_tensor_write(mean, m));
    CHECK_OK(td_tensor_write(var, v));
    if (dt != TD_F32) TRY(td_graph_cast(g, x, dt, &x));
    td_batch_norm_params p = td_batch_norm_default_params();
    TRY(td_graph_batch_norm2d(g, x, w, bias, mean, var, &p, relu ? &y : &b->y));
    b->eval = eval;
    return relu ? td_graph_relu(g, y, &b->y) : TD_OK;
}

static td_status build_bn_relu(td_graph *g, built *b) { return build_bn(g, b, TD_F32, 1, 0); }
static td_status build_bn_plain(td_graph *g, built *b) { return build_bn(g, b, TD_F32, 0, 0); }
static td_status build_bn_relu_eval(td_graph *g, built *b) { return build_bn(g, b, TD_F32, 1, 1); }
static td_status build_bn_plain_eval(td_graph *g, built *b) { return build_bn(g, b, TD_F32, 0, 1); }
static td_status build_bn_relu_bf16(td_graph *g, built *b) { return build_bn(g, b, TD_BF16, 1, 0); }
static td_status build_bn_relu_f16_eval(td_graph *g, built *b) {
    return build_bn(g, b, TD_F16, 1, 1);
}

/* The reference CNN whole (4 conv + batch norm + ReLU, 2 max pools, linear, cross entropy);
 * td_model_build initialises its parameters from the seed and compiles it. */
static td_status build_cnn(td_graph *g, built *b) {
    td_model m;
    TRY(td_model_build(g, TD_MODEL_CNN, 4, 5, &m));
    leaf(b, m.input);
    leaf(b, m.labels);
    b->y = m.loss;
    b->is_loss = 1;
    return TD_OK;
}

/* ---- the transformer's ops ---- */

#define VOCAB 11

/* Token ids (3, 7) in [0, VOCAB), stored as `dt` (the GPT's input holds them as f32): 21 ids
 * over 11 rows, so several positions add into one row of the table's gradient. */
static td_status token_ids(td_graph *g, built *b, td_dtype dt, td_tensor **ids) {
    enum { N = 21 };
    int64_t i64[N];
    int32_t i32[N];
    float f32[N];
    for (int i = 0; i < N; i++) {
        i64[i] = (i * 5 + i / 4) % VOCAB;
        i32[i] = (int32_t)i64[i];
        f32[i] = (float)i64[i];
    }
    TRY(td_graph_input(g, "idx", td_shape_2d(3, 7), dt, 0, ids));
    given_leaf(b, *ids, dt == TD_I64 ? (const void *)i64 : dt == TD_I32 ? (const void *)i32 : f32);
    return TD_OK;
}

/* The GPT's embedding and its tied output projection: h = wte[ids] + wpe[t], then logits =
 * h wte^T, so wte's gradient is the projection's plus every position's row of dh added into its
 * token's row; wpe has more rows (9) than there are positions (7), whose gradient stays 0. */
static td_status build_embeddings(td_graph *g, built *b, td_dtype ids_dtype) {
    td_tensor *ids, *wte, *wpe, *t, *h;
    TRY(token_ids(g, b, ids_dtype, &ids));
    TRY(param(g, b, "wte", td_shape_2d(VOCAB, 6), &wte));
    TRY(param(g, b, "wpe", td_shape_2d(9, 6), &wpe));
    TRY(td_graph_embedding(g, ids, wte, &t));
    TRY(td_graph_position_embedding(g, t, wpe, &t));
    TRY(td_graph_reshape(g, t, td_shape_2d(21, 6), &h));
    return td_graph_linear(g, h, wte, NULL, &b->y);
}

static td_status build_embeddings_i64(td_graph *g, built *b) {
    return build_embeddings(g, b, TD_I64);
}
static td_status build_embeddings_i32(td_graph *g, built *b) {
    return build_embeddings(g, b, TD_I32);
}
static td_status build_embeddings_f32(td_graph *g, built *b) {
    return build_embeddings(g, b, TD_F32);
}

/* Layer norm over the last dim of x (3, 50, 45): 150 rows, so the weight and bias gradients
 * sum three partial sums of rows (tiling.h), and 45 columns, a tile of 32 and a partial one;
 * with weight and bias or without (affine 0); low: x arrives in bf16, as after a linear at O1,
 * and the node still computes in f32 (the op's rule at every level). */
static td_status build_layer_norm(td_graph *g, built *b, int affine, int low) {
    enum { C = 45 };
    td_tensor *x, *w = NULL, *bias = NULL;
    TRY(input(g, b, "x", td_shape_3d(3, 50, C), 1, &x));
    if (affine) {
        TRY(param(g, b, "ln.weight", td_shape_1d(C), &w));
        TRY(param(g, b, "ln.bias", td_shape_1d(C), &bias));
    }
    if (low) TRY(td_graph_cast(g, x, TD_BF16, &x));
    return td_graph_layer_norm(g, x, w, bias, 1e-5f, &b->y);
}

static td_status build_layer_norm_affine(td_graph *g, built *b) {
    return build_layer_norm(g, b, 1, 0);
}
static td_status build_layer_norm_plain(td_graph *g, built *b) {
    return build_layer_norm(g, b, 0, 0);
}
static td_status build_layer_norm_low(td_graph *g, built *b) {
    return build_layer_norm(g, b, 1, 1);
}

/* Causal attention over qkv (B * T, 3C), sequences of T, `heads` heads; then a ReLU, which
 * must not overwrite attention's output in place: the GPU's backward reads it. */
static td_status build_attention(td_graph *g, built *b, int B, int T, int C, int heads) {
    td_tensor *x, *y;
    TRY(input(g, b, "qkv", td_shape_2d((int64_t)B * T, 3 * C), 1, &x));
    TRY(td_graph_causal_attention(g, x, heads, T, &y));
    return td_graph_relu(g, y, &b->y);
}

/* Heads of 4 and T = 5, one tile; T = 70, three tiles of 32 with a partial last one; heads of 5
 * (odd); heads of 64 (GPT-2's), tiles of 16; heads of 200, tiles of 8 (tiling.h). */
static td_status build_attention_small(td_graph *g, built *b) {
    return build_attention(g, b, 2, 5, 8, 2);
}
static td_status build_attention_tiles(td_graph *g, built *b) {
    return build_attention(g, b, 2, 70, 12, 3);
}
static td_status build_attention_odd(td_graph *g, built *b) {
    return build_attention(g, b, 1, 37, 15, 3);
}
static td_status build_attention_gpt2(td_graph *g, built *b) {
    return build_attention(g, b, 2, 45, 128, 2);
}
static td_status build_attention_wide(td_graph *g, built *b) {
    return build_attention(g, b, 1, 19, 400, 2);
}

/* A whole small GPT (td_gpt_sequential: 2 blocks of 2 heads of 12, context 9, a vocabulary of
 * 13, batch 3) with its mean cross-entropy loss, as td_model_build_sequential makes it: every
 * op of the model at once, parameters drawn from the same seed on both devices, the tied table's
 * gradient the sum of its two uses. Tokens (f32 ids, as the model takes them) and labels are
 * given. */
static td_status build_gpt(td_graph *g, built *b) {
    enum { B = 3, T = 9, V = 13 };
    td_gpt_params p = td_gpt_default_params();
    p.layers = 2;
    p.heads = 2;
    p.width = 24;
    p.context = T;
    p.vocab = V;
    td_sequential *s;
    td_model m;
    TRY(td_gpt_sequential(&p, &s));
    td_status st = td_model_build_sequential(g, s, B, 5, &m);
    td_sequential_destroy(s);
    TRY(st);
    float tokens[B * T];
    int64_t labels[B * T];
    for (int i = 0; i < B * T; i++) {
        tokens[i] = (float)((i * 7 + 3) % V);
        labels[i] = (i * 5 + 1) % V;
    }
    given_leaf(b, m.input, tokens);
    given_leaf(b, m.labels, labels);
    b->y = m.loss;
    b->is_loss = 1;
    return TD_OK;
}

static void linear_f32(void) { twin("linear", build_linear, TD_AMP_O0, TD_BF16, 1e-5); }
static void linear_bf16(void) { twin("linear bf16", build_linear, TD_AMP_O1, TD_BF16, 2e-2); }
static void linear_f16(void) { twin("linear f16", build_linear, TD_AMP_O1, TD_F16, 5e-3); }
static void activations_add_scale(void) {
    twin("relu gelu add scale", build_relu_gelu_add_scale, TD_AMP_O0, TD_BF16, 1e-5);
}
static void activations_bf16(void) {
    twin("relu gelu add scale bf16", build_relu_gelu_add_scale, TD_AMP_O1, TD_BF16, 2e-2);
}
static void gelu_tanh(void) { twin("gelu tanh", build_gelu_tanh, TD_AMP_O0, TD_BF16, 1e-5); }
static void softmax_rows(void) { twin("softmax", build_softmax, TD_AMP_O0, TD_BF16, 1e-5); }
static void cross_entropy_mean(void) {
    twin("cross entropy", build_cross_entropy, TD_AMP_O0, TD_BF16, 1e-5);
}
static void cross_entropy_bf16(void) {
    twin("cross entropy bf16", build_cross_entropy, TD_AMP_O1, TD_BF16, 2e-2);
}
static void nll_sum(void) {
    twin("log_softmax nll sum", build_log_softmax_nll_sum, TD_AMP_O0, TD_BF16, 1e-5);
}

/* Masks are the CPU's bits: the outputs and gradients agree exactly (the linear before the
 * dropout feeds both the same values only within 1e-5, hence that tolerance there). */
static void dropout_masks(void) { twin("dropout", build_dropout, TD_AMP_O0, TD_BF16, 1e-5); }
static void dropout_masks_by_sample(void) {
    twin("dropout keyed", build_dropout_keyed, TD_AMP_O0, TD_BF16, 1e-5);
}
static void dropout2d_masks(void) { twin("dropout2d", build_dropout2d, TD_AMP_O0, TD_BF16, 0); }
static void dropout2d_masks_by_sample(void) {
    twin("dropout2d keyed", build_dropout2d_keyed, TD_AMP_O0, TD_BF16, 0);
}
static void dropout2d_bf16(void) { twin("dropout2d bf16", build_dropout2d, TD_AMP_O1, TD_BF16, 0); }
static void concat_channels(void) { twin("concat", build_concat, TD_AMP_O0, TD_BF16, 0); }
static void normalize_rows(void) { twin("normalize", build_normalize, TD_AMP_O0, TD_BF16, 1e-5); }

/* ---- training steps ----------------------------------------------------------------------- */

/* A model trained three steps on both devices from the same initialisation and batches
 * (gradient clipping, then SGD with momentum or AdamW, on the GPU as multi-tensor launches):
 * the losses and the parameters agree within tol. The GPU's parameters then go through a
 * checkpoint into a CPU graph, where they arrive bit for bit (the same digest). */
static void train_twin(const char *what, td_model_kind kind, int adamw, double tol) {
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    enum { B = 16, STEPS = 3 };
    td_graph *g[2] = {NULL, NULL};
    td_model m[2];
    td_optim *opt[2] = {NULL, NULL};
    td_param *pp[2];
    size_t np[2];
    for (int d = 0; d < 2; d++) {
        td_graph_params p = td_graph_default_params();
        p.device = d ? td_device_cuda(0) : td_device_cpu();
        p.conv_winograd = 0; /* direct convolutions on both, as the op cases */
        CHECK_OK(td_graph_create(&g[d], &p));
        CHECK_OK(td_model_build(g[d], kind, B, 3, &m[d]));
        CHECK_OK(td_graph_parameters(g[d], &pp[d], &np[d]));
        if (adamw) {
            td_adamw_params hp = td_adamw_default_params();
            CHECK_OK(td_optim_create_adamw(&opt[d], pp[d], np[d], &hp));
        } else {
            td_sgd_params hp = td_sgd_default_params();
            hp.momentum = 0.9;
            hp.nesterov = 1;
            hp.weight_decay = 1e-4;
            CHECK_OK(td_optim_create_sgd(&opt[d], pp[d], np[d], &hp));
        }
        if (!opt[d]) goto out;
    }
    float *images = malloc(B * 28 * 28 * sizeof *images);
    int64_t labels[B];
    td_rng rng;
    td_rng_init(&rng, 5);
    for (int step = 0; step < STEPS; step++) {
        for (int i = 0; i < B * 28 * 28; i++) images[i] = td_rng_uniform(&rng);
        for (int i = 0; i < B; i++) labels[i] = td_rng_below(&rng, 10);
        float loss[2] = {0, 0};
        double norm[2] = {0, 0};
        for (int d = 0; d < 2; d++) {
            CHECK_OK(td_tensor_write(m[d].input, images));
            CHECK_OK(td_tensor_write(m[d].labels, labels));
            CHECK_OK(td_graph_forward(g[d]));
            CHECK_OK(td_graph_backward(g[d], m[d].loss));
            CHECK_OK(td_tensor_read(m[d].loss, &loss[d]));
            CHECK_OK(td_clip_grad_norm(pp[d], np[d], 1.0, &norm[d]));
            CHECK_OK(td_optim_step(opt[d]));
            CHECK_OK(td_graph_zero_grad(g[d]));
        }
        CHECK_NEAR(loss[1], loss[0], tol * (1 + fabs(loss[0])));
        CHECK_NEAR(norm[1], norm[0], tol * (1 + norm[0]));
    }
    free(images);
    /* Each tensor as a whole (relative L2): AdamW moves every weight by about lr whatever its
     * gradient's size, so a gradient near 0 whose sign the two devices round differently puts
     * that one element 2 lr apart, and nothing is wrong. */
    for (size_t i = 0; i < np[0] && i < np[1]; i++) {
        const td_tensor *a = td_graph_param_tensor(g[0], i), *b = td_graph_param_tensor(g[1], i);
        size_t n = (size_t)td_tensor_numel(a);
        float *want = values(a, 0), *got = values(b, 0);
        double num = 0, den = 0;
        for (size_t k = 0; k < n; k++) {
            num += ((double)got[k] - want[k]) * ((double)got[k] - want[k]);
            den += (double)want[k] * want[k];
        }
        double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        if (!(rel <= tol))
            TEST_FAIL_AT("%s '%s': relative L2 difference %.3g (tol %g)", what, td_tensor_name(a),
                         rel, tol);
        free(want);
        free(got);
    }

    char dir[256], path[300];
    test_temp_dir(dir, sizeof dir, "cuda_graph");
    snprintf(path, sizeof path, "%s/gpu.safetensors", dir);
    CHECK_OK(td_checkpoint_save(path, pp[1], np[1], NULL, 0));
    td_graph *cpu = NULL;
    td_model mc;
    td_param *pc;
    size_t nc;
    CHECK_OK(td_graph_create(&cpu, NULL));
    CHECK_OK(td_model_build(cpu, kind, B, 4, &mc));
    CHECK_OK(td_graph_parameters(cpu, &pc, &nc));
    CHECK_OK(td_checkpoint_load(path, pc, nc));
    char a[65], b[65];
    CHECK_OK(td_params_sha256(pp[1], np[1], a));
    CHECK_OK(td_params_sha256(pc, nc, b));
    CHECK(strcmp(a, b) == 0);
    td_graph_destroy(cpu);
    test_remove_dir(dir);
out:
    for (int d = 0; d < 2; d++) {
        td_optim_destroy(opt[d]);
        td_graph_destroy(g[d]);
    }
}

static void mlp_sgd_steps(void) { train_twin("mlp sgd", TD_MODEL_MLP, 0, 1e-4); }
static void mlp_adamw_steps(void) { train_twin("mlp adamw", TD_MODEL_MLP, 1, 1e-4); }
static void net_sgd_steps(void) { train_twin("net sgd", TD_MODEL_NET, 0, 1e-4); }
static void cnn_sgd_steps(void) { train_twin("cnn sgd", TD_MODEL_CNN, 0, 1e-4); }
static void resnet_adamw_steps(void) { train_twin("resnet adamw", TD_MODEL_RESNET, 1, 1e-4); }

/* ---- CUDA graphs --------------------------------------------------------------------------- */

static td_status build_dropout_classifier(td_graph *g, built *b) {
    td_tensor *x, *w1, *b1, *w2, *labels, *h;
    TRY(input(g, b, "x", td_shape_2d(16, 30), 0, &x));
    TRY(td_graph_input(g, "labels", td_shape_1d(16), TD_I64, 0, &labels));
    leaf(b, labels);
    TRY(param(g, b, "w1", td_shape_2d(64, 30), &w1));
    TRY(param(g, b, "b1", td_shape_1d(64), &b1));
    TRY(param(g, b, "w2", td_shape_2d(CLASSES, 64), &w2));
    TRY(td_graph_linear(g, x, w1, b1, &h));
    TRY(td_graph_relu(g, h, &h));
    TRY(td_graph_dropout(g, h, 0.25f, &h));
    TRY(td_graph_linear(g, h, w2, NULL, &h));
    b->is_loss = 1;
    return td_graph_cross_entropy(g, h, labels, TD_REDUCTION_MEAN, &b->y, NULL);
}

/* The dropout classifier on device d, recording its sweeps or not, its leaves initialised
 * from one seed and compiled; NULL after a failed check. */
static td_graph *classifier_on(td_device d, int cuda_graphs, built *b) {
    td_graph_params p = td_graph_default_params();
    p.seed = 11;
    p.device = d;
    p.cuda_graphs = cuda_graphs;
    td_graph *g = NULL;
    CHECK_OK(td_graph_create(&g, &p));
    if (!g) return NULL;
    td_rng rng;
    td_rng_init(&rng, 1234);
    if (build_dropout_classifier(g, b) == TD_OK) {
        for (int i = 0; i < b->nleaves; i++) init_leaf(b->leaves[i], &rng, CLASSES);
        if (td_graph_compile(g) == TD_OK) return g;
    }
    TEST_FAIL_AT("the classifier on a GPU: %s", td_last_error());
    td_graph_destroy(g);
    return NULL;
}

/* Six SGD steps on two GPU graphs, one launching every op and one recording its sweeps as
 * CUDA graphs and replaying them: the losses and parameters are the same bits, the dropout
 * masks fresh at every replay; the second graph did replay and the first did not. Then two
 * steps in evaluation mode, whose backward must not replay the training one (dropout's masks
 * would come back). */
static void replay_equals_op_by_op(void) {
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    td_graph *g[2] = {NULL, NULL};
    built b[2];
    td_optim *opt[2] = {NULL, NULL};
    memset(b, 0, sizeof b);
    for (int d = 0; d < 2; d++) {
        if (!(g[d] = classifier_on(td_device_cuda(0), d, &b[d]))) goto out;
        td_param *pp;
        size_t np;
        CHECK_OK(td_graph_parameters(g[d], &pp, &np));
        td_sgd_params hp = td_sgd_default_params();
        hp.momentum = 0.9;
        CHECK_OK(td_optim_create_sgd(&opt[d], pp, np, &hp));
        if (!opt[d]) goto out;
    }
    float x[16 * 30];
    int64_t labels[16];
    td_rng rng;
    td_rng_init(&rng, 8);
    for (int step = 0; step < 8; step++) {
        if (step == 6)
            for (int d = 0; d < 2; d++) td_graph_set_training(g[d], 0);
        for (int i = 0; i < 16 * 30; i++) x[i] = td_rng_normal(&rng);
        for (int i = 0; i < 16; i++) labels[i] = td_rng_below(&rng, CLASSES);
        float loss[2];
        for (int d = 0; d < 2; d++) {
            CHECK_OK(td_tensor_write(b[d].leaves[0], x));
            CHECK_OK(td_tensor_write(b[d].leaves[1], labels));
            CHECK_OK(td_graph_forward(g[d]));
            CHECK_OK(td_graph_backward(g[d], b[d].y));
            CHECK_OK(td_tensor_read(b[d].y, &loss[d]));
            CHECK_OK(td_optim_step(opt[d]));
            CHECK_OK(td_graph_zero_grad(g[d]));
        }
        CHECK(memcmp(&loss[0], &loss[1], sizeof(float)) == 0);
    }
    td_param *pp[2];
    size_t np[2];
    char digest[2][65];
    for (int d = 0; d < 2; d++) {
        CHECK_OK(td_graph_parameters(g[d], &pp[d], &np[d]));
        CHECK_OK(td_params_sha256(pp[d], np[d], digest[d]));
    }
    CHECK(strcmp(digest[0], digest[1]) == 0);
    const char *why;
    CHECK_EQ(td_graph_replays(g[0], &why), 0);
    CHECK(td_graph_replays(g[1], &why) >= 6); /* forward and backward from the third step */
    if (why) TEST_FAIL_AT("recording was given up: %s", why);
out:
    for (int d = 0; d < 2; d++) {
        td_optim_destroy(opt[d]);
        td_graph_destroy(g[d]);
    }
}

/* One thread drives graphs on two GPUs, interleaved, op by op, each backward from a dy already
 * on its own GPU: every sweep makes its graph's GPU current (a backward that did not launched
 * on the GPU the other graph's forward had made current). The two compute the same gradients. */
static void two_gpus_one_thread(void) {
    if (gpus < 2) {
        SKIP(gpus ? "one CUDA device (this needs two)" : "no CUDA device");
        return;
    }
    td_graph *g[2] = {NULL, NULL};
    built b[2];
    float *dy[2] = {NULL, NULL}, one = 1.f;
    memset(b, 0, sizeof b);
    for (int d = 0; d < 2; d++) {
        if (!(g[d] = classifier_on(td_device_cuda(d), 0, &b[d]))) goto out;
        CHECK_OK(td_device_alloc(td_device_cuda(d), sizeof one, (void **)&dy[d]));
        CHECK_OK(td_device_copy(td_device_cuda(d), dy[d], td_device_cpu(), &one, sizeof one));
    }
    for (int step = 0; step < 2; step++) {
        for (int d = 0; d < 2; d++) CHECK_OK(td_graph_forward(g[d]));
        for (int d = 0; d < 2; d++) CHECK_OK(td_graph_backward_from(g[d], b[d].y, dy[d]));
    }
    for (int i = 0; i < b[0].nleaves; i++)
        if (td_tensor_grad(b[0].leaves[i]) && td_tensor_dtype(b[0].leaves[i]) != TD_I64)
            compare("two GPUs", b[0].leaves[i], b[1].leaves[i], 1, 1e-5);
out:
    for (int d = 0; d < 2; d++) {
        if (dy[d]) td_device_free(td_device_cuda(d), dy[d]);
        td_graph_destroy(g[d]);
    }
}

static void conv_f32(void) { twin("conv2d", build_conv, TD_AMP_O0, TD_BF16, 1e-5); }
static void conv_bf16(void) { twin("conv2d bf16", build_conv, TD_AMP_O1, TD_BF16, 2e-2); }
static void conv_f16(void) { twin("conv2d f16", build_conv, TD_AMP_O1, TD_F16, 5e-3); }
static void max_pool(void) { twin("max_pool2d", build_max_pool, TD_AMP_O0, TD_BF16, 1e-5); }
static void max_pool_bf16(void) {
    twin("max_pool2d bf16", build_max_pool_bf16, TD_AMP_O0, TD_BF16, 2e-2);
}
static void avg_pool(void) { twin("avg_pool2d", build_avg_pool, TD_AMP_O0, TD_BF16, 1e-5); }
static void avg_pool_f16(void) {
    twin("avg_pool2d f16", build_avg_pool_f16, TD_AMP_O0, TD_BF16, 5e-3);
}
static void batch_norm_relu(void) {
    twin("batch_norm2d relu", build_bn_relu, TD_AMP_O0, TD_BF16, 1e-4);
}
static void batch_norm_plain(void) {
    twin("batch_norm2d", build_bn_plain, TD_AMP_O0, TD_BF16, 1e-4);
}
static void batch_norm_relu_eval(void) {
    twin("batch_norm2d relu eval", build_bn_relu_eval, TD_AMP_O0, TD_BF16, 1e-4);
}
static void batch_norm_plain_eval(void) {
    twin("batch_norm2d eval", build_bn_plain_eval, TD_AMP_O0, TD_BF16, 1e-4);
}
static void batch_norm_relu_bf16(void) {
    twin("batch_norm2d relu bf16", build_bn_relu_bf16, TD_AMP_O0, TD_BF16, 2e-2);
}
static void batch_norm_relu_f16_eval(void) {
    twin("batch_norm2d relu f16 eval", build_bn_relu_f16_eval, TD_AMP_O0, TD_BF16, 5e-3);
}
static void cnn_model(void) { twin("cnn", build_cnn, TD_AMP_O0, TD_BF16, 1e-4); }

/* The embeddings' gradients are sums in the CPU's order (each table element has one owning
 * thread): at f32 and, with the tables stored in bf16 (O2), the same sums rounded as the CPU
 * rounds them; only the tied projection's matmul differs, within its tolerance. */
static void embeddings_i64(void) {
    twin("embeddings i64 ids", build_embeddings_i64, TD_AMP_O0, TD_BF16, 1e-5);
}
static void embeddings_i32(void) {
    twin("embeddings i32 ids", build_embeddings_i32, TD_AMP_O0, TD_BF16, 1e-5);
}
static void embeddings_f32_ids(void) {
    twin("embeddings f32 ids", build_embeddings_f32, TD_AMP_O0, TD_BF16, 1e-5);
}
static void embeddings_bf16(void) {
    twin("embeddings bf16 (O1)", build_embeddings_f32, TD_AMP_O1, TD_BF16, 2e-2);
}
static void embeddings_bf16_tables(void) {
    twin("embeddings bf16 tables (O2)", build_embeddings_f32, TD_AMP_O2, TD_BF16, 2e-2);
}
static void embeddings_f16_tables(void) {
    twin("embeddings f16 tables (O2)", build_embeddings_f32, TD_AMP_O2, TD_F16, 5e-3);
}
static void layer_norm_affine(void) {
    twin("layer_norm", build_layer_norm_affine, TD_AMP_O0, TD_BF16, 1e-5);
}
static void layer_norm_plain(void) {
    twin("layer_norm without weight", build_layer_norm_plain, TD_AMP_O0, TD_BF16, 1e-5);
}
/* The bf16 input's gradient is stored in bf16: an element near a rounding boundary lands a
 * whole bf16 step apart when the two devices' f32 sums differ in the last bit. */
static void layer_norm_bf16_input(void) {
    twin("layer_norm bf16 input", build_layer_norm_low, TD_AMP_O1, TD_BF16, 2e-2);
}
static void attention_small(void) {
    twin("attention", build_attention_small, TD_AMP_O0, TD_BF16, 1e-5);
}
static void attention_tiles(void) {
    twin("attention three tiles", build_attention_tiles, TD_AMP_O0, TD_BF16, 1e-5);
}
static void attention_odd_heads(void) {
    twin("attention heads of 5", build_attention_odd, TD_AMP_O0, TD_BF16, 1e-5);
}
static void attention_gpt2_heads(void) {
    twin("attention heads of 64", build_attention_gpt2, TD_AMP_O0, TD_BF16, 1e-5);
}
static void attention_wide_heads(void) {
    twin("attention heads of 200", build_attention_wide, TD_AMP_O0, TD_BF16, 1e-5);
}
/* At O1 the GPU computes attention from bf16 (f16) inputs to a bf16 (f16) output, in f32
 * inside; the CPU computes in f32 between casts: the same rounding points. */
static void attention_bf16(void) {
    twin("attention bf16", build_attention_tiles, TD_AMP_O1, TD_BF16, 2e-2);
}
static void attention_f16(void) {
    twin("attention f16", build_attention_tiles, TD_AMP_O1, TD_F16, 5e-3);
}
/* f32 within 1e-4 as every whole model; in bf16 rounding compounds through both blocks and the
 * losses' every term, so 5e-2 of each tensor's scale. */
static void gpt_model(void) { twin("gpt", build_gpt, TD_AMP_O0, TD_BF16, 1e-4); }
static void gpt_model_bf16(void) { twin("gpt bf16", build_gpt, TD_AMP_O1, TD_BF16, 5e-2); }

/* ---- refusals --------------------------------------------------------------------------- */

/* Without a GPU a graph on cuda:0 is refused naming the device and why; with one, a device
 * past the visible ones is refused naming how many there are. */
static void unusable_gpu_is_refused_by_name(void) {
    td_graph_params p = td_graph_default_params();
    p.device = td_device_cuda(gpus ? gpus : 0);
    td_graph *g = NULL;
    td_status s = td_graph_create(&g, &p);
    CHECK(g == NULL);
    char name[16];
    td_device_format(p.device, name, sizeof name);
    CHECK(strstr(td_last_error(), name) != NULL);
    if (gpus) {
        CHECK_EQ(s, TD_EINVAL);
        CHECK(strstr(td_last_error(), "visible") != NULL);
    } else {
        CHECK_EQ(s, TD_EUNSUPPORTED);
        CHECK(strstr(td_last_error(), td_cuda_unavailable()) != NULL);
    }
}

/* A token id the GPU finds outside the table fails the next forward, naming its position: the
 * GPU cannot stop mid-step to say so, so the step that met it runs on (its row is zeros and
 * takes no gradient) and the error comes once, before the next step. */
static void bad_token_fails_the_next_forward(void) {
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    td_graph_params p = td_graph_default_params();
    p.device = td_device_cuda(0);
    td_graph *g = NULL;
    td_tensor *ids, *w, *y;
    CHECK_OK(td_graph_create(&g, &p));
    if (!g) return;
    CHECK_OK(td_graph_input(g, "idx", td_shape_1d(4), TD_F32, 0, &ids));
    CHECK_OK(td_graph_param(g, "wte", td_shape_2d(5, 2), &w));
    CHECK_OK(td_graph_embedding(g, ids, w, &y));
    CHECK_OK(td_graph_compile(g));
    const float bad[4] = {0, 1, 7, 2}, good[4] = {4, 3, 2, 1};
    float out[8];
    CHECK_OK(td_tensor_write(ids, bad));
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_tensor_read(y, out)); /* waits for the forward */
    CHECK(out[4] == 0.f && out[5] == 0.f);
    CHECK_OK(td_tensor_write(ids, good));
    CHECK_STATUS(td_graph_forward(g), TD_EINVAL);
    if (!strstr(td_last_error(), "token 2 of 'idx'"))
        TEST_FAIL_AT("error '%s' does not name token 2 of 'idx'", td_last_error());
    CHECK_OK(td_graph_forward(g));
    td_graph_destroy(g);
}

/* Attention heads wider than the GPU kernels' tiles take (253, tiling.h) are refused when the
 * graph is compiled, naming the tensor and the head size. */
static void too_wide_heads_are_refused(void) {
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    td_graph_params p = td_graph_default_params();
    p.device = td_device_cuda(0);
    td_graph *g = NULL;
    td_tensor *x, *y;
    CHECK_OK(td_graph_create(&g, &p));
    if (!g) return;
    CHECK_OK(td_graph_input(g, "qkv", td_shape_2d(4, 3 * 254), TD_F32, 1, &x));
    CHECK_OK(td_graph_causal_attention(g, x, 1, 4, &y));
    CHECK_STATUS(td_graph_compile(g), TD_EUNSUPPORTED);
    if (!strstr(td_last_error(), "'qkv' has heads of 254"))
        TEST_FAIL_AT("error '%s' does not name 'qkv' and its heads of 254", td_last_error());
    td_graph_destroy(g);
}

/* The transformer kernels' launch arithmetic (ops/cuda/tiling.h), on every machine: the token
 * embedding's blocks own every table row exactly once, the layer norm's chunks cover every row
 * exactly once, and the attention's tile is the largest that keeps each of its three kernels'
 * shared memory within 48 KiB, or 0 past heads of 253. */
static void transformer_launch_shapes(void) {
    const int64_t vocabs[] = {1, 2, 7, 256, 1023, 1024, 1025, 2049, 50257, 100003};
    for (size_t i = 0; i < sizeof vocabs / sizeof *vocabs; i++) {
        int64_t V = vocabs[i], r = td__emb_rows_per_block(V), b = td__emb_blocks(V);
        CHECK(r >= 1 && b >= 1 && b <= TD__EMB_BLOCKS);
        CHECK(b * r >= V && (b - 1) * r < V);
    }
    const int64_t rows[] = {1, 2, 63, 64, 65, 150, 65535, 65536, 65537, 1 << 20, 3000001};
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
        int64_t R = rows[i], r = td__partial_rows(R), c = td__partials(R);
        CHECK(r >= TD__PARTIAL_ROWS && c >= 1 && c <= TD__PARTIALS);
        CHECK(c * r >= R && (c - 1) * r < R);
    }
    for (int64_t hs = 1; hs <= 300; hs++) {
        int64_t tile = td__att_tile(hs);
        if (hs > 253) {
            CHECK_EQ(tile, 0);
            continue;
        }
        CHECK(tile == 8 || tile == 16 || tile == 32);
        for (int k = TD__ATT_FORWARD; k <= TD__ATT_DKV; k++)
            CHECK(td__att_shared_floats(k, tile, hs) * 4 <= TD__ATT_SHARED_BYTES);
        if (tile < 32) CHECK(td__att_shared_floats(TD__ATT_DKV, 2 * tile, hs) * 4 > 49152);
    }
    CHECK_EQ(td__att_tile(32), 32);
    CHECK_EQ(td__att_tile(64), 16);
    CHECK_EQ(td__att_tile(128), 8);
}

int main(void) {
    CHECK_OK(td_cuda_device_count(&gpus));
    RUN(unusable_gpu_is_refused_by_name);
    RUN(transformer_launch_shapes);
    RUN(linear_f32);
    RUN(linear_bf16);
    RUN(linear_f16);
    RUN(activations_add_scale);
    RUN(activations_bf16);
    RUN(gelu_tanh);
    RUN(softmax_rows);
    RUN(cross_entropy_mean);
    RUN(cross_entropy_bf16);
    RUN(nll_sum);
    RUN(dropout_masks);
    RUN(dropout_masks_by_sample);
    RUN(dropout2d_masks);
    RUN(dropout2d_masks_by_sample);
    RUN(dropout2d_bf16);
    RUN(concat_channels);
    RUN(normalize_rows);
    RUN(mlp_sgd_steps);
    RUN(mlp_adamw_steps);
    RUN(net_sgd_steps);
    RUN(cnn_sgd_steps);
    RUN(resnet_adamw_steps);
    RUN(replay_equals_op_by_op);
    RUN(two_gpus_one_thread);
    RUN(conv_f32);
    RUN(conv_bf16);
    RUN(conv_f16);
    RUN(max_pool);
    RUN(max_pool_bf16);
    RUN(avg_pool);
    RUN(avg_pool_f16);
    RUN(batch_norm_relu);
    RUN(batch_norm_plain);
    RUN(batch_norm_relu_eval);
    RUN(batch_norm_plain_eval);
    RUN(batch_norm_relu_bf16);
    RUN(batch_norm_relu_f16_eval);
    RUN(cnn_model);
    RUN(embeddings_i64);
    RUN(embeddings_i32);
    RUN(embeddings_f32_ids);
    RUN(embeddings_bf16);
    RUN(embeddings_bf16_tables);
    RUN(embeddings_f16_tables);
    RUN(layer_norm_affine);
    RUN(layer_norm_plain);
    RUN(layer_norm_bf16_input);
    RUN(attention_small);
    RUN(attention_tiles);
    RUN(attention_odd_heads);
    RUN(attention_gpt2_heads);
    RUN(attention_wide_heads);
    RUN(attention_bf16);
    RUN(attention_f16);
    RUN(gpt_model);
    RUN(gpt_model_bf16);
    /* Last: a failure on the device could leave its context unusable for what follows. */
    RUN(bad_token_fails_the_next_forward);
    RUN(too_wide_heads_are_refused);
    TEST_END();
}
