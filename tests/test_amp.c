/* Mixed precision: every op in bf16 and f16 against the same op in f32 (forward, and the
 * gradients of its input and parameters), on oneDNN's bf16 kernels and on the emulated path
 * (f32 between casts) that O3 takes where the low dtype has no kernels (f16 on CPUs); where
 * each level keeps its parameters; dynamic loss scaling with a forced overflow on one rank of two
 * (every rank skips, the scale halves, parameters stay) and growth after 2000 clean steps; O3
 * against O2 on the MLP (no master weights: other bits, half the bytes, still training; its bf16
 * checkpoint loads back); DDP at world 2 against one process with O2, and with O3 in bf16 and f16;
 * half-width gradient communication moving half the bytes; and, in a copy of the program that
 * oneDNN sees as a CPU without bf16 instructions (ONEDNN_MAX_CPU_ISA=AVX2), O2 saying so when
 * the graph is created and training exactly as O0.
 *
 * Tolerances are the dtype's: |low - f32| <= TOL (1 + max |f32|) per tensor, with TOL 3e-2 for
 * bf16 (8 significant bits) and 4e-3 for f16 (11), loose enough for rounding the inputs,
 * weights and every output of a chain, tight enough that a wrong kernel or a lost cast fails. */
#include <math.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tandem/tandem.h"

#include "test.h"
#include "test_comm_util.h"

/* ---- one op in every precision ------------------------------------------------------- */

enum { MAXT = 6 };

/* What a case builds: its leaves are made here, with values, before the op is added. */
typedef struct {
    td_graph *g;
    td_tensor *x[MAXT]; /* inputs that take a gradient, then parameters */
    int nx;
    td_rng *rng;
} build_ctx;

typedef td_status (*op_builder)(build_ctx *b, td_tensor **y);

static td_tensor *input(build_ctx *b, const char *name, td_shape s) {
    td_tensor *t = NULL;
    CHECK_OK(td_graph_input(b->g, name, s, TD_F32, 1, &t));
    if (!t) return NULL;
    size_t n = (size_t)td_shape_numel(&s);
    float *v = malloc(n * sizeof *v);
    for (size_t i = 0; i < n; i++) v[i] = td_rng_normal(b->rng);
    CHECK_OK(td_tensor_write(t, v));
    free(v);
    b->x[b->nx++] = t;
    return t;
}

static td_tensor *param(build_ctx *b, const char *name, td_shape s, float lo, float hi) {
    td_tensor *t = NULL;
    CHECK_OK(td_graph_param(b->g, name, s, &t));
    if (!t) return NULL;
    td_rng_fill_uniform(b->rng, td_tensor_data(t), (size_t)td_shape_numel(&s), lo, hi);
    b->x[b->nx++] = t;
    return t;
}

static td_status b_linear(build_ctx *b, td_tensor **y) {
    td_tensor *x = input(b, "x", td_shape_2d(8, 12));
    td_tensor *w = param(b, "fc.weight", td_shape_2d(10, 12), -0.3f, 0.3f);
    td_tensor *bias = param(b, "fc.bias", td_shape_1d(10), -0.3f, 0.3f);
    return td_graph_linear(b->g, x, w, bias, y);
}

static td_status b_conv(build_ctx *b, td_tensor **y) {
    td_tensor *x = input(b, "x", td_shape_4d(4, 16, 9, 9));
    td_tensor *w = param(b, "conv.weight", td_shape_4d(16, 16, 3, 3), -0.1f, 0.1f);
    td_tensor *bias = param(b, "conv.bias", td_shape_1d(16), -0.1f, 0.1f);
    td_conv2d_params p = td_conv2d_default_params();
    p.padding[0] = p.padding[1] = 1;
    return td_graph_conv2d(b->g, x, w, bias, &p, y);
}

static td_status b_max_pool(build_ctx *b, td_tensor **y) {
    td_pool2d_params p = td_pool2d_default_params();
    return td_graph_max_pool2d(b->g, input(b, "x", td_shape_4d(3, 16, 8, 8)), &p, y);
}

static td_status b_avg_pool(build_ctx *b, td_tensor **y) {
    td_pool2d_params p = td_pool2d_default_params();
    return td_graph_avg_pool2d(b->g, input(b, "x", td_shape_4d(3, 16, 8, 8)), &p, y);
}

static td_status b_relu(build_ctx *b, td_tensor **y) {
    return td_graph_relu(b->g, input(b, "x", td_shape_2d(6, 40)), y);
}

static td_status b_gelu(build_ctx *b, td_tensor **y) {
    return td_graph_gelu(b->g, input(b, "x", td_shape_2d(6, 40)), y);
}

static td_status b_dropout(build_ctx *b, td_tensor **y) {
    return td_graph_dropout(b->g, input(b, "x", td_shape_2d(6, 40)), 0.3f, y);
}

static td_status b_dropout2d(build_ctx *b, td_tensor **y) {
    return td_graph_dropout2d(b->g, input(b, "x", td_shape_4d(4, 16, 5, 5)), 0.3f, y);
}

static td_status b_batch_norm(build_ctx *b, td_tensor **y) {
    td_tensor *x = input(b, "x", td_shape_4d(4, 16, 6, 6));
    td_tensor *w = param(b, "bn.weight", td_shape_1d(16), 0.5f, 1.5f);
    td_tensor *bias = param(b, "bn.bias", td_shape_1d(16), -0.5f, 0.5f);
    td_tensor *rm, *rv;
    CHECK_OK(td_graph_buffer(b->g, "bn.running_mean", td_shape_1d(16), &rm));
    CHECK_OK(td_graph_buffer(b->g, "bn.running_var", td_shape_1d(16), &rv));
    return td_graph_batch_norm2d(b->g, x, w, bias, rm, rv, NULL, y);
}

static td_status b_add(build_ctx *b, td_tensor **y) {
    td_tensor *a = input(b, "a", td_shape_2d(6, 40)), *c = input(b, "c", td_shape_2d(6, 40));
    return td_graph_add(b->g, a, c, y);
}

static td_status b_concat(build_ctx *b, td_tensor **y) {
    td_tensor *xs[2] = {input(b, "a", td_shape_4d(2, 3, 4, 4)),
                        input(b, "c", td_shape_4d(2, 5, 4, 4))};
    return td_graph_concat(b->g, xs, 2, y);
}

static td_status b_flatten(build_ctx *b, td_tensor **y) {
    return td_graph_flatten(b->g, input(b, "x", td_shape_4d(3, 4, 5, 5)), 1, y);
}

static td_status b_softmax(build_ctx *b, td_tensor **y) {
    return td_graph_softmax(b->g, input(b, "x", td_shape_2d(6, 10)), y);
}

static td_status b_log_softmax(build_ctx *b, td_tensor **y) {
    return td_graph_log_softmax(b->g, input(b, "x", td_shape_2d(6, 10)), y);
}

static td_status b_cross_entropy(build_ctx *b, td_tensor **y) {
    td_tensor *x = input(b, "x", td_shape_2d(6, 10)), *labels;
    CHECK_OK(td_graph_input(b->g, "labels", td_shape_1d(6), TD_I64, 0, &labels));
    int64_t l[6] = {0, 3, 9, 2, 2, 7};
    CHECK_OK(td_tensor_write(labels, l));
    return td_graph_cross_entropy(b->g, x, labels, TD_REDUCTION_MEAN, y, NULL);
}

#define TRY(call)                           \
    do {                                    \
        td_status try_s_ = (call);          \
        if (try_s_ != TD_OK) return try_s_; \
    } while (0)

/* Batch norm with the ReLU the graph folds into it. The bias keeps every pre-activation far
 * from zero: rounding would otherwise flip the sign of a few near zero, and each flip moves a
 * whole gradient element (a property of low precision, not an error). */
static td_status b_bn_relu(build_ctx *b, td_tensor **y) {
    td_tensor *x = input(b, "x", td_shape_4d(4, 16, 6, 6)), *t;
    td_tensor *w = param(b, "bn.weight", td_shape_1d(16), 0.5f, 1.0f);
    td_tensor *bias = param(b, "bn.bias", td_shape_1d(16), 5.0f, 6.0f);
    td_tensor *rm, *rv;
    CHECK_OK(td_graph_buffer(b->g, "bn.running_mean", td_shape_1d(16), &rm));
    CHECK_OK(td_graph_buffer(b->g, "bn.running_var", td_shape_1d(16), &rv));
    td_status st = td_graph_batch_norm2d(b->g, x, w, bias, rm, rv, NULL, &t);
    return st ? st : td_graph_relu(b->g, t, y);
}

/* A small chain: conv, batch norm, gelu, avg pool, flatten, linear, cross entropy, so that
 * activations cross primitives in the engine's own layouts. Smooth ops only, for the reason
 * above (ties in a max-pool window move whole elements just as ReLU's signs do); those ops
 * alone are checked above. */
static td_status b_chain(build_ctx *b, td_tensor **y) {
    td_tensor *t, *x = input(b, "x", td_shape_4d(4, 16, 8, 8));
    td_conv2d_params cp = td_conv2d_default_params();
    cp.padding[0] = cp.padding[1] = 1;
    td_tensor *w = param(b, "conv.weight", td_shape_4d(16, 16, 3, 3), -0.1f, 0.1f);
    TRY(td_graph_conv2d(b->g, x, w, NULL, &cp, &t));
    td_tensor *bw = param(b, "bn.weight", td_shape_1d(16), 0.5f, 1.5f);
    td_tensor *bb = param(b, "bn.bias", td_shape_1d(16), -0.5f, 0.5f), *rm, *rv;
    CHECK_OK(td_graph_buffer(b->g, "bn.running_mean", td_shape_1d(16), &rm));
    CHECK_OK(td_graph_buffer(b->g, "bn.running_var", td_shape_1d(16), &rv));
    TRY(td_graph_batch_norm2d(b->g, t, bw, bb, rm, rv, NULL, &t));
    TRY(td_graph_gelu(b->g, t, &t));
    td_pool2d_params pp = td_pool2d_default_params();
    TRY(td_graph_avg_pool2d(b->g, t, &pp, &t));
    TRY(td_graph_flatten(b->g, t, 1, &t));
    td_tensor *fw = param(b, "fc.weight", td_shape_2d(10, 256), -0.06f, 0.06f);
    TRY(td_graph_linear(b->g, t, fw, NULL, &t));
    td_tensor *labels;
    CHECK_OK(td_graph_input(b->g, "labels", td_shape_1d(4), TD_I64, 0, &labels));
    int64_t l[4] = {1, 7, 3, 3};
    CHECK_OK(td_tensor_write(labels, l));
    return td_graph_cross_entropy(b->g, t, labels, TD_REDUCTION_SUM, y, NULL);
}

/* A tensor's values (or gradient) as f32, whatever its dtype; malloc'd. */
static float *as_f32(td_tensor *t, int grad) {
    size_t n = (size_t)td_tensor_numel(t);
    td_dtype dt = td_tensor_dtype(t);
    void *raw = malloc(n * td_dtype_size(dt));
    float *out = malloc(n * sizeof *out);
    CHECK_OK(grad ? td_tensor_read_grad(t, raw) : td_tensor_read(t, raw));
    for (size_t i = 0; i < n; i++)
        out[i] = dt == TD_F32    ? ((float *)raw)[i]
                 : dt == TD_BF16 ? td_bf16_to_f32(((uint16_t *)raw)[i])
                                 : td_f16_to_f32(((uint16_t *)raw)[i]);
    free(raw);
    return out;
}

/* Everything a run produces: the output and each leaf's gradient, as f32. */
typedef struct {
    float *v[1 + MAXT];
    size_t n[1 + MAXT];
    int count;
    td_dtype out_dtype, param_dtype, master_dtype; /* the first parameter's */
} results;

static void results_free(results *r) {
    for (int i = 0; i < r->count; i++) free(r->v[i]);
}

static int run_case(op_builder build, td_amp_level level, td_dtype dtype, int emulate,
                    results *out) {
    memset(out, 0, sizeof *out);
    td_graph_params gp = td_graph_default_params();
    gp.amp.level = level;
    gp.amp.dtype = dtype;
    gp.amp.emulate = emulate;
    gp.seed = 5;
    td_rng rng;
    td_rng_init(&rng, 77); /* the same values at every precision */
    build_ctx b = {.rng = &rng};
    td_tensor *y = NULL;
    CHECK_OK(td_graph_create(&b.g, &gp));
    if (!b.g) return 0;
    td_status st = build(&b, &y);
    CHECK_OK(st);
    if (st == TD_OK) st = td_graph_compile(b.g);
    CHECK_OK(st);
    if (st == TD_OK) st = td_graph_forward(b.g);
    CHECK_OK(st);
    size_t ny = y ? (size_t)td_tensor_numel(y) : 0;
    float *dy = malloc((ny ? ny : 1) * sizeof *dy);
    for (size_t i = 0; i < ny; i++) dy[i] = td_rng_normal(&rng);
    if (st == TD_OK) st = td_graph_backward_from(b.g, y, dy);
    CHECK_OK(st);
    free(dy);
    if (st == TD_OK) {
        out->out_dtype = td_tensor_dtype(y);
        out->v[0] = as_f32(y, 0);
        out->n[0] = ny;
        out->count = 1;
        for (int i = 0; i < b.nx; i++) {
            out->v[out->count] = as_f32(b.x[i], 1);
            out->n[out->count++] = (size_t)td_tensor_numel(b.x[i]);
        }
        td_param *p;
        size_t np;
        CHECK_OK(td_graph_parameters(b.g, &p, &np));
        out->param_dtype = np ? p[0].dtype : TD_F32;
        out->master_dtype = np ? p[0].master_dtype : TD_F32;
    }
    td_graph_destroy(b.g);
    return st == TD_OK;
}

/* Element by element for one op; for a chain, the relative L2 norm of the difference, since
 * rounding may move a max-pool's argmax and so a whole gradient element. */
static void compare(const char *what, const results *got, const results *want, double tol,
                    int by_norm) {
    CHECK_EQ(got->count, want->count);
    for (int k = 0; k < got->count && k < want->count; k++) {
        double scale = 0, worst = 0, num = 0, den = 0;
        for (size_t i = 0; i < want->n[k]; i++) {
            double w = want->v[k][i], d = fabs((double)got->v[k][i] - w);
            if (fabs(w) > scale) scale = fabs(w);
            if (d > worst || d != d) worst = d;
            num += d * d;
            den += w * w;
        }
        double rel = sqrt(num / (den > 0 ? den : 1));
        if (by_norm ? !(rel <= tol) : !(worst <= tol * (1 + scale)))
            TEST_FAIL_AT("%s, %s %d: largest difference %.3g (relative norm %.3g), allowed %.3g",
                         what, k == 0 ? "output" : "gradient", k, worst, rel,
                         by_norm ? tol : tol * (1 + scale));
    }
}

static const struct {
    const char *name;
    op_builder build;
} OPS[] = {
    {"linear", b_linear},
    {"conv2d", b_conv},
    {"max_pool2d", b_max_pool},
    {"avg_pool2d", b_avg_pool},
    {"relu", b_relu},
    {"gelu", b_gelu},
    {"dropout", b_dropout},
    {"dropout2d", b_dropout2d},
    {"batch_norm2d", b_batch_norm},
    {"add", b_add},
    {"concat", b_concat},
    {"flatten", b_flatten},
    {"softmax", b_softmax},
    {"log_softmax", b_log_softmax},
    {"cross_entropy", b_cross_entropy},
    {"batch_norm2d + relu", b_bn_relu},
    {"chain", b_chain},
};

/* O3 puts every op and parameter in the low dtype; each path against plain f32. */
static void every_op_in_bf16_and_f16_matches_f32(void) {
    const struct {
        td_dtype dtype;
        int emulate;
        double tol;
        const char *path;
    } paths[] = {{TD_BF16, 0, 3e-2, "bf16 (oneDNN)"},
                 {TD_BF16, 1, 3e-2, "bf16 (emulated)"},
                 {TD_F16, 0, 4e-3, "f16 (emulated)"}};
    for (size_t o = 0; o < sizeof OPS / sizeof *OPS; o++) {
        results want;
        if (!run_case(OPS[o].build, TD_AMP_O0, TD_BF16, 0, &want)) continue;
        for (size_t p = 0; p < sizeof paths / sizeof *paths; p++) {
            results got;
            char what[96];
            snprintf(what, sizeof what, "%s in %s", OPS[o].name, paths[p].path);
            if (run_case(OPS[o].build, TD_AMP_O3, paths[p].dtype, paths[p].emulate, &got))
                compare(what, &got, &want, paths[p].tol, OPS[o].build == b_chain);
            results_free(&got);
        }
        results_free(&want);
    }
}

/* The low dtype really is used: a bf16 result differs from f32 in the last bits, and so do the
 * two paths from each other only by rounding. */
static void low_precision_is_not_f32_in_disguise(void) {
    results f32, bf16;
    if (!run_case(b_linear, TD_AMP_O0, TD_BF16, 0, &f32)) return;
    if (run_case(b_linear, TD_AMP_O3, TD_BF16, 0, &bf16)) {
        CHECK_EQ(bf16.out_dtype, TD_BF16);
        int differ = 0;
        for (size_t i = 0; i < f32.n[0]; i++) differ += f32.v[0][i] != bf16.v[0][i];
        CHECK(differ > 0);
        for (size_t i = 0; i < bf16.n[0]; i++) /* exactly representable in bf16 */
            CHECK(td_bf16_to_f32(td_f32_to_bf16(bf16.v[0][i])) == bf16.v[0][i]);
    }
    results_free(&f32);
    results_free(&bf16);
}

/* Where each level keeps parameters, what their optimizer updates them in (master_dtype) and
 * what the output dtype is. */
static void levels_place_parameters_like_apex(void) {
    struct {
        td_amp_level level;
        op_builder build;
        td_dtype param, master, out;
    } cases[] = {
        {TD_AMP_O1, b_linear, TD_F32, TD_F32, TD_BF16},      /* f32 weights, cast copies */
        {TD_AMP_O2, b_linear, TD_BF16, TD_F32, TD_BF16},     /* low weights, f32 masters */
        {TD_AMP_O2, b_batch_norm, TD_F32, TD_F32, TD_F32},   /* batch norm's stay f32 ... */
        {TD_AMP_O3, b_batch_norm, TD_BF16, TD_BF16, TD_F32}, /* ... but not at O3 */
        {TD_AMP_O3, b_linear, TD_BF16, TD_BF16, TD_BF16},    /* no masters at O3 */
        {TD_AMP_O1, b_log_softmax, TD_F32, TD_F32, TD_F32},  /* the loss side stays f32 */
        {TD_AMP_O3, b_cross_entropy, TD_F32, TD_F32, TD_F32},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        results r;
        if (run_case(cases[i].build, cases[i].level, TD_BF16, 0, &r)) {
            if (cases[i].build == b_linear || cases[i].build == b_batch_norm) {
                CHECK_EQ(r.param_dtype, cases[i].param);
                CHECK_EQ(r.master_dtype, cases[i].master);
            }
            CHECK_EQ(r.out_dtype, cases[i].out);
        }
        results_free(&r);
    }
}

/* ---- dynamic loss scaling -------------------------------------------------------------- */

static float w_host[4];

/* Two ranks, one parameter; on step `boom` rank 1's gradient overflows. */
static void scaler_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 30));
    if (!comm) return;
    float w[4] = {1, 2, 3, 4}, g[4];
    td_param p = {
        .name = "w", .data = w, .grad = g, .count = 4, .dtype = TD_F32, .ndim = 1, .shape = {4}};
    td_optim *opt;
    td_sgd_params sp = td_sgd_default_params();
    sp.lr = 0.5;
    CHECK_OK(td_optim_create_sgd(&opt, &p, 1, &sp));
    td_grad_scaler_params gp = td_grad_scaler_default_params();
    gp.comm = comm;
    td_grad_scaler *s;
    CHECK_OK(td_grad_scaler_create(&s, &gp));
    CHECK_EQ(td_grad_scaler_scale(s), 65536);
    for (int step = 0; step < 3; step++) {
        float scale = td_grad_scaler_scale(s);
        for (int k = 0; k < 4; k++) g[k] = 0.25f * scale; /* a backward on the scaled loss */
        if (step == 1 && rank == 1) g[2] = INFINITY;
        memcpy(w_host, w, sizeof w);
        int skipped = -1;
        CHECK_OK(td_grad_scaler_step(s, opt, &skipped));
        td_grad_scaler_update(s);
        if (step == 1) { /* skipped on every rank, parameters untouched, scale halved */
            CHECK_EQ(skipped, 1);
            CHECK(memcmp(w, w_host, sizeof w) == 0);
            CHECK_EQ(td_grad_scaler_scale(s), 32768);
        } else {
            CHECK_EQ(skipped, 0);
            CHECK_NEAR(w[0], w_host[0] - 0.5f * 0.25f, 1e-6); /* unscaled before the step */
        }
    }
    CHECK_EQ(td_grad_scaler_skipped(s), 1);
    td_grad_scaler_destroy(s);
    td_optim_destroy(opt);
    td_comm_destroy(comm);
}

static void overflow_on_one_rank_skips_the_step_everywhere(void) {
    CHECK_EQ(test_run_ranks(2, scaler_rank, NULL, 30, 0), 0);
}

static void scale_doubles_after_2000_clean_steps(void) {
    float w[2] = {0, 0}, g[2];
    td_param p = {
        .name = "w", .data = w, .grad = g, .count = 2, .dtype = TD_F32, .ndim = 1, .shape = {2}};
    td_optim *opt;
    td_sgd_params sp = td_sgd_default_params();
    CHECK_OK(td_optim_create_sgd(&opt, &p, 1, &sp));
    td_grad_scaler *s;
    CHECK_OK(td_grad_scaler_create(&s, NULL));
    for (int step = 1; step <= 2000; step++) {
        g[0] = g[1] = td_grad_scaler_scale(s) * 1e-3f;
        CHECK_OK(td_grad_scaler_step(s, opt, NULL));
        td_grad_scaler_update(s);
        if (step == 1999) CHECK_EQ(td_grad_scaler_scale(s), 65536);
    }
    CHECK_EQ(td_grad_scaler_scale(s), 131072);
    td_param *st;
    size_t n;
    td_grad_scaler_state(s, &st, &n);
    CHECK_EQ(n, 2);
    CHECK_EQ(*(double *)st[0].data, 131072);
    CHECK_EQ(*(int64_t *)st[1].data, 0);
    td_grad_scaler_destroy(s);
    td_optim_destroy(opt);
}

/* ---- whole models: O2 against O3, and DDP ----------------------------------------------- */

enum { GLOBAL = 32, STEPS = 4 };
enum { MLP_PARAMS = 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10 };

typedef struct {
    td_amp_level level;
    td_dtype dtype; /* the low dtype */
    td_dtype comm_dtype;
} dp_case;

/* What training the MLP leaves behind. */
typedef struct {
    float *params;         /* (MLP_PARAMS) the parameters at the end, widened to f32 */
    char digest[65];       /* td_params_sha256 of the parameters as stored */
    char state_digest[65]; /* ... and of the optimizer's state */
    float loss[STEPS];     /* each step's loss, before its update */
    td_dtype param_dtype;  /* every parameter's dtype, TD_DTYPE_COUNT if they differ */
    size_t param_bytes;    /* the parameters' storage */
    size_t master_bytes;   /* the optimizer's master weights ("optim.*.master") */
    size_t momentum_bytes; /* its momentum buffers */
    double bytes_per_step; /* DDP: what the bucket all-reduces moved per step */
} mlp_run;

static size_t param_bytes(const td_param *p) { return p->count * td_dtype_size(p->dtype); }

/* Trains the MLP for STEPS steps of SGD with momentum on this rank's slice of one batch; world
 * 1 runs the whole batch. With `save`, writes the parameters and the optimizer state there. */
static void train_mlp(td_comm *comm, int rank, int world, const dp_case *c, mlp_run *r,
                      const char *save) {
    memset(r, 0, sizeof *r);
    td_graph_params gp = td_graph_default_params();
    gp.amp.level = c->level;
    gp.amp.dtype = c->dtype;
    td_graph *g;
    td_model m;
    int b = GLOBAL / world;
    CHECK_OK(td_graph_create(&g, &gp));
    CHECK_OK(td_model_build(g, TD_MODEL_MLP, b, 9, &m));
    td_dataset *data;
    CHECK_OK(td_dataset_load_fashion_mnist(&data, NULL, TD_SPLIT_TEST));
    CHECK_OK(td_tensor_write(m.input, td_dataset_x(data) + (size_t)rank * b * 784));
    CHECK_OK(td_tensor_write(m.labels, td_dataset_y(data) + rank * b));
    td_dataset_destroy(data);
    td_param *p;
    size_t n;
    CHECK_OK(td_graph_parameters(g, &p, &n));
    td_sgd_params sp = td_sgd_default_params();
    sp.lr = 0.05;
    sp.momentum = 0.9;
    td_optim *opt;
    CHECK_OK(td_optim_create_sgd(&opt, p, n, &sp));
    td_ddp *ddp = NULL;
    td_trace *trace = NULL;
    if (comm) {
        td_ddp_params dp = td_ddp_default_params();
        dp.comm_dtype = c->comm_dtype;
        CHECK_OK(td_trace_create(&trace, rank));
        dp.trace = trace;
        CHECK_OK(td_ddp_create(&ddp, comm, p, n, NULL, 0, &dp));
        td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, ddp);
    }
    CHECK_EQ(td_tensor_dtype(m.loss), TD_F32);
    for (int s = 0; s < STEPS; s++) {
        if (ddp) CHECK_OK(td_ddp_prepare_forward(ddp));
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_tensor_read(m.loss, &r->loss[s]));
        CHECK_OK(td_graph_backward(g, m.loss));
        if (ddp) CHECK_OK(td_ddp_finish_backward(ddp));
        CHECK_OK(td_optim_step(opt));
        CHECK_OK(td_graph_zero_grad(g));
    }
    for (size_t e = 0; trace && e < td_trace_count(trace); e++) {
        td_trace_event ev;
        CHECK_OK(td_trace_event_get(trace, e, &ev));
        const char *at = strchr(ev.name, '(');
        if (strncmp(ev.name, "allreduce bucket", 16) == 0 && at) r->bytes_per_step += atof(at + 1);
    }
    r->bytes_per_step /= STEPS;
    r->params = malloc(MLP_PARAMS * sizeof *r->params);
    r->param_dtype = n ? p[0].dtype : TD_F32;
    size_t off = 0;
    for (size_t i = 0; i < n && off + p[i].count <= MLP_PARAMS; i++) {
        for (size_t k = 0; k < p[i].count; k++) {
            uint16_t h = ((uint16_t *)p[i].data)[k];
            r->params[off + k] = p[i].dtype == TD_F32    ? ((float *)p[i].data)[k]
                                 : p[i].dtype == TD_BF16 ? td_bf16_to_f32(h)
                                                         : td_f16_to_f32(h);
        }
        off += p[i].count;
        r->param_bytes += param_bytes(&p[i]);
        if (p[i].dtype != r->param_dtype) r->param_dtype = TD_DTYPE_COUNT;
    }
    CHECK_EQ(off, MLP_PARAMS);
    td_params_sha256(p, n, r->digest);
    td_param *st;
    size_t nst;
    td_optim_state(opt, &st, &nst);
    td_params_sha256(st, nst, r->state_digest);
    for (size_t i = 0; i < nst; i++) {
        if (strstr(st[i].name, ".master")) r->master_bytes += param_bytes(&st[i]);
        if (strstr(st[i].name, ".momentum_buffer")) r->momentum_bytes += param_bytes(&st[i]);
    }
    if (save) {
        td_param *all = malloc((n + nst) * sizeof *all);
        memcpy(all, p, n * sizeof *all);
        memcpy(all + n, st, nst * sizeof *all);
        CHECK_OK(td_checkpoint_save(save, all, n + nst, NULL, 0));
        free(all);
    }
    td_ddp_destroy(ddp);
    td_trace_destroy(trace);
    td_optim_destroy(opt);
    td_graph_destroy(g);
}

/* The relative L2 norm of a - b over the MLP's parameters. */
static double relative_difference(const float *a, const float *b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < MLP_PARAMS; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / den);
}

/* The checkpoint at path holds every parameter and optimizer buffer of the O3 run in bf16 and
 * no master weights, and loads back into a fresh O3 model and optimizer to the same bytes. */
static void o3_checkpoint_round_trips(const char *path, const mlp_run *trained) {
    td_checkpoint *ck = NULL;
    CHECK_OK(td_checkpoint_open(&ck, path));
    if (!ck) return;
    size_t bf16 = 0, count = td_checkpoint_count(ck);
    for (size_t i = 0; i < count; i++) {
        td_param info;
        CHECK_OK(td_checkpoint_tensor(ck, i, &info));
        CHECK(strstr(info.name, ".master") == NULL);
        if (info.dtype == TD_BF16) bf16 += info.count;
    }
    CHECK_EQ(bf16, 2 * (size_t)MLP_PARAMS); /* the weights and their momentum */
    td_graph_params gp = td_graph_default_params();
    gp.amp.level = TD_AMP_O3;
    gp.seed = 99; /* other initial values, so that loading has to replace them all */
    td_graph *g;
    td_model m;
    CHECK_OK(td_graph_create(&g, &gp));
    CHECK_OK(td_model_build(g, TD_MODEL_MLP, GLOBAL, 4, &m));
    td_param *p, *st;
    size_t n, nst;
    CHECK_OK(td_graph_parameters(g, &p, &n));
    td_optim *opt;
    td_sgd_params sp = td_sgd_default_params();
    sp.momentum = 0.9;
    CHECK_OK(td_optim_create_sgd(&opt, p, n, &sp));
    td_optim_state(opt, &st, &nst);
    char digest[65];
    td_params_sha256(p, n, digest);
    CHECK(strcmp(digest, trained->digest) != 0);
    CHECK_OK(td_checkpoint_read(ck, p, n));
    CHECK_OK(td_checkpoint_read(ck, st, nst));
    td_params_sha256(p, n, digest);
    CHECK(strcmp(digest, trained->digest) == 0);
    td_params_sha256(st, nst, digest);
    CHECK(strcmp(digest, trained->state_digest) == 0);
    td_optim_destroy(opt);
    td_graph_destroy(g);
    td_checkpoint_close(ck);
}

/* apex's O3 is pure low precision: the weights are bf16 and the optimizer steps them in place,
 * keeping no f32 copy; O2 steps an f32 master copy and rounds it into the bf16 weights. So the
 * two end on different bits, O3 holds half the bytes that O2's masters alone take, its momentum
 * is bf16 too, and it still trains. */
static void o3_steps_bf16_weights_without_master_weights(void) {
    dp_case o2 = {TD_AMP_O2, TD_BF16, TD_F32}, o3 = {TD_AMP_O3, TD_BF16, TD_F32};
    char dir[64], path[96];
    test_temp_dir(dir, sizeof dir, "amp_o3");
    snprintf(path, sizeof path, "%s/o3.st", dir);
    mlp_run a, b;
    train_mlp(NULL, 0, 1, &o2, &a, NULL);
    train_mlp(NULL, 0, 1, &o3, &b, path);
    fprintf(stderr,
            "    O2: params %zu B + masters %zu B + momentum %zu B, loss %.4f -> %.4f\n"
            "    O3: params %zu B + masters %zu B + momentum %zu B, loss %.4f -> %.4f\n"
            "    O3 vs O2: relative difference %.2e\n",
            a.param_bytes, a.master_bytes, a.momentum_bytes, a.loss[0], a.loss[STEPS - 1],
            b.param_bytes, b.master_bytes, b.momentum_bytes, b.loss[0], b.loss[STEPS - 1],
            relative_difference(b.params, a.params));
    CHECK_EQ(a.param_dtype, TD_BF16);
    CHECK_EQ(b.param_dtype, TD_BF16);
    CHECK_EQ(b.param_bytes, 2 * (size_t)MLP_PARAMS);
    CHECK_EQ(a.master_bytes, 4 * (size_t)MLP_PARAMS);
    CHECK_EQ(b.master_bytes, 0);
    CHECK_EQ(2 * b.param_bytes, a.master_bytes);
    CHECK_EQ(2 * b.momentum_bytes, a.momentum_bytes);
    CHECK(strcmp(a.digest, b.digest) != 0);
    CHECK(b.loss[STEPS - 1] < 0.8 * b.loss[0]);            /* it trains ... */
    CHECK(relative_difference(b.params, a.params) < 1e-2); /* ... along O2's path, up to bf16 */
    o3_checkpoint_round_trips(path, &b);
    free(a.params);
    free(b.params);
    test_remove_dir(dir);
}

static mlp_run reference;

static void dp_rank(int rank, int size, int port, void *arg) {
    const dp_case *c = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    mlp_run mine;
    train_mlp(comm, rank, size, c, &mine, NULL);
    /* Every gradient once per step, in the dtype it travels in (alignment adds a little). */
    double wire = c->level >= TD_AMP_O2 || c->comm_dtype != TD_F32 ? 2 : 4;
    if (rank == 0)
        fprintf(stderr, "    gradients travelling in %d bytes: %.0f bytes a step for %d of them\n",
                (int)wire, mine.bytes_per_step, MLP_PARAMS);
    CHECK(mine.bytes_per_step >= wire * MLP_PARAMS &&
          mine.bytes_per_step < wire * MLP_PARAMS * 1.001);
    double rel = relative_difference(mine.params, reference.params);
    if (rank == 0) fprintf(stderr, "    world %d vs 1: relative difference %.2e\n", size, rel);
    CHECK(rel < 4e-3); /* low-precision rounding, not a different trajectory */
    free(mine.params);
    td_comm_destroy(comm);
}

/* DDP at world 2 against one process on the whole batch, at the same level. */
static void ddp_equals_one_process(dp_case c) {
    train_mlp(NULL, 0, 1, &c, &reference, NULL);
    CHECK_EQ(test_run_ranks(2, dp_rank, &c, 60, 0), 0);
    free(reference.params);
}

static void ddp_with_o2_equals_one_process_with_o2(void) {
    ddp_equals_one_process((dp_case){TD_AMP_O2, TD_BF16, TD_F32});
}

/* O3's gradients are bf16 or f16 in DDP's buckets, all-reduced as they are. */
static void ddp_with_o3_in_bf16_and_f16_equals_one_process(void) {
    ddp_equals_one_process((dp_case){TD_AMP_O3, TD_BF16, TD_F32});
    ddp_equals_one_process((dp_case){TD_AMP_O3, TD_F16, TD_F32});
}

/* f32 gradients travelling as bf16: half the bytes per bucket, and still the same training up
 * to bf16 rounding. */
static void half_width_communication_halves_the_bytes(void) {
    dp_case plain = {TD_AMP_O0, TD_BF16, TD_F32}, half = {TD_AMP_O0, TD_BF16, TD_BF16};
    train_mlp(NULL, 0, 1, &plain, &reference, NULL);
    CHECK_EQ(test_run_ranks(2, dp_rank, &plain, 60, 0), 0);
    CHECK_EQ(test_run_ranks(2, dp_rank, &half, 60, 0), 0);
    free(reference.params);
}

/* ---- a CPU without bf16 instructions ----------------------------------------------------- */

static char logged[512]; /* the last warning the library logged */

static void keep_warning(td_log_level level, const char *message, void *ctx) {
    (void)ctx;
    if (level == TD_LOG_WARN) snprintf(logged, sizeof logged, "%s", message);
}

/* The MLP at `level` for two SGD steps on 16 images: its loss after them and its first weight,
 * widened to f32, into w (784 values); the graph's fallback line (or "") into why. */
static float mlp_two_steps(td_amp_level level, int emulate, float *w, td_dtype *w_dtype, char *why,
                           size_t cap) {
    td_graph_params gp = td_graph_default_params();
    gp.amp.level = level;
    gp.amp.emulate = emulate;
    td_graph *g = NULL;
    td_model m;
    float loss = NAN;
    logged[0] = 0;
    CHECK_OK(td_graph_create(&g, &gp));
    if (!g) return loss;
    const char *f = td_graph_amp_fallback(g);
    snprintf(why, cap, "%s", f ? f : "");
    CHECK(strcmp(why, logged) == 0); /* said when the graph was created, before any op */
    CHECK_OK(td_model_build(g, TD_MODEL_MLP, 16, 3, &m));
    CHECK_OK(td_graph_compile(g));
    td_dataset *data;
    CHECK_OK(td_dataset_load_fashion_mnist(&data, NULL, TD_SPLIT_TEST));
    CHECK_OK(td_tensor_write(m.input, td_dataset_x(data)));
    CHECK_OK(td_tensor_write(m.labels, td_dataset_y(data)));
    td_dataset_destroy(data);
    td_param *p;
    size_t n;
    CHECK_OK(td_graph_parameters(g, &p, &n));
    td_optim *opt;
    td_sgd_params sp = td_sgd_default_params();
    sp.lr = 0.05;
    CHECK_OK(td_optim_create_sgd(&opt, p, n, &sp));
    for (int s = 0; s < 2; s++) {
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_graph_backward(g, m.loss));
        CHECK_OK(td_optim_step(opt));
        CHECK_OK(td_graph_zero_grad(g));
    }
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_tensor_read(m.loss, &loss));
    *w_dtype = p[0].dtype;
    for (size_t i = 0; i < 784; i++)
        w[i] = p[0].dtype == TD_F32 ? ((const float *)p[0].data)[i]
                                    : td_bf16_to_f32(((const uint16_t *)p[0].data)[i]);
    td_optim_destroy(opt);
    td_graph_destroy(g);
    return loss;
}

/* In a copy of this program that oneDNN sees as a CPU without bf16 instructions: O2 says so
 * when the graph is created and then trains exactly as O0 (the same f32 kernels, the same
 * bits); O3 says so and keeps its bf16 weights; amp.emulate still computes between casts. */
static int without_bf16_child(void) {
    td_log_set_callback(keep_warning, NULL, TD_LOG_WARN);
    char info[128], why[512];
    CHECK_OK(td_graph_backend_info(td_device_cpu(), info, sizeof info));
    CHECK(strstr(info, "ISA avx2") != NULL);
    static float w0[784], w2[784], w3[784], we[784];
    td_dtype d0, d2, d3, de;
    float l0 = mlp_two_steps(TD_AMP_O0, 0, w0, &d0, why, sizeof why);
    CHECK(why[0] == 0);
    float l2 = mlp_two_steps(TD_AMP_O2, 0, w2, &d2, why, sizeof why);
    CHECK(strstr(why, "amp O2 bf16") != NULL && strstr(why, "ISA avx2") != NULL &&
          strstr(why, "f32") != NULL);
    CHECK_EQ(d2, TD_F32);
    CHECK(l2 == l0 && memcmp(w2, w0, sizeof w0) == 0);
    mlp_two_steps(TD_AMP_O3, 0, w3, &d3, why, sizeof why);
    CHECK(strstr(why, "amp O3 bf16") != NULL && strstr(why, "between casts") != NULL);
    CHECK_EQ(d3, TD_BF16);
    float le = mlp_two_steps(TD_AMP_O2, 1, we, &de, why, sizeof why);
    CHECK(why[0] == 0);
    CHECK_EQ(de, TD_BF16);
    CHECK(le != l0 && le == le);
    return test_case_failed;
}

static void amp_without_bf16_kernels_says_so_and_computes_in_f32(void) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("ONEDNN_MAX_CPU_ISA", "AVX2", 1); /* read once, by a process's first oneDNN call */
        execl("/proc/self/exe", "test_amp", "--without-bf16", (char *)NULL);
        _exit(127);
    }
    int status = -1;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    /* Here, where bf16 has kernels of its own (if it has), O2 runs as asked. */
    char info[128], why[512];
    CHECK_OK(td_graph_backend_info(td_device_cpu(), info, sizeof info));
    if (!strstr(info, "bf16") && !strstr(info, "amx")) return;
    static float w[784];
    td_dtype d;
    mlp_two_steps(TD_AMP_O2, 0, w, &d, why, sizeof why);
    CHECK(why[0] == 0);
    CHECK_EQ(d, TD_BF16);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--without-bf16")) return without_bf16_child();
    RUN(every_op_in_bf16_and_f16_matches_f32);
    RUN(low_precision_is_not_f32_in_disguise);
    RUN(levels_place_parameters_like_apex);
    RUN(overflow_on_one_rank_skips_the_step_everywhere);
    RUN(scale_doubles_after_2000_clean_steps);
    RUN(o3_steps_bf16_weights_without_master_weights);
    RUN(ddp_with_o2_equals_one_process_with_o2);
    RUN(ddp_with_o3_in_bf16_and_f16_equals_one_process);
    RUN(half_width_communication_halves_the_bytes);
    RUN(amp_without_bf16_kernels_says_so_and_computes_in_f32);
    TEST_END();
}
