/* Reference kernels against central finite differences: for each op the loss is
 * sum(out * r) with random r, so the analytic backward (fed dy = r) must equal the
 * numerical gradient of that loss for every input and parameter element: a full
 * vector-Jacobian product, at small odd shapes. Also a few hand-computed values (tie rule,
 * running statistics, label errors) that finite differences cannot see. */
#include <string.h>

#include "core/core_impl.h"
#include "ops/ref/ref.h"
#include "test.h"

/* ---- the finite-difference harness -------------------------------------------------- */

typedef void (*fwd_fn)(void *ctx); /* recomputes ctx's output from its inputs */

typedef struct {
    fwd_fn fwd;
    void *ctx;
    const float *out; /* (nout), written by fwd */
    const float *r;   /* (nout) upstream weights */
    size_t nout;
} fd_problem;

static double fd_loss(const fd_problem *p) {
    p->fwd(p->ctx);
    double s = 0.0;
    for (size_t i = 0; i < p->nout; i++) s += (double)p->out[i] * p->r[i];
    return s;
}

/* Checks grad (n) against the central difference of the loss in `in` (n), element by
 * element: |fd - grad| <= atol + rtol |fd|. Restores `in` and the output. */
static void fd_check(const fd_problem *p, const char *what, float *in, const float *grad, size_t n,
                     float eps, double atol, double rtol) {
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        float save = in[i];
        float hi = save + eps, lo = save - eps;
        in[i] = hi;
        double lp = fd_loss(p);
        in[i] = lo;
        double lm = fd_loss(p);
        in[i] = save;
        double fd = (lp - lm) / ((double)hi - (double)lo);
        if (!(fabs(fd - grad[i]) <= atol + rtol * fabs(fd))) {
            if (bad++ < 3)
                TEST_FAIL_AT("%s[%zu]: analytic %.7g vs numerical %.7g", what, i, (double)grad[i],
                             fd);
        }
    }
    if (bad > 3) TEST_FAIL_AT("%s: %d of %zu elements differ", what, bad, n);
    p->fwd(p->ctx);
}

static td_rng rng;

static float *randn(size_t n) {
    float *a = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) a[i] = td_rng_normal(&rng);
    return a;
}

static float *zeros(size_t n) { return calloc(n ? n : 1, sizeof(float)); }

/* Smooth ops: truncation O(eps^2), f32 rounding of outputs O(1e-7 / eps). */
#define EPS 1e-2f
#define ATOL 2e-3
#define RTOL 2e-3

/* ---- linear ------------------------------------------------------------------------- */

typedef struct {
    float *y, *x, *w, *b;
    int N, IN, OUT;
} linear_ctx;

static void linear_fwd(void *c) {
    linear_ctx *k = c;
    td__ref_linear_forward(k->y, k->x, k->w, k->b, k->N, k->IN, k->OUT);
}

static void linear_matches_finite_differences(void) {
    linear_ctx k = {0};
    k.N = 3, k.IN = 5, k.OUT = 4;
    k.x = randn(15), k.w = randn(20), k.b = randn(4), k.y = zeros(12);
    float *r = randn(12), *dx = zeros(15), *dw = zeros(20), *db = zeros(4);
    fd_problem p = {linear_fwd, &k, k.y, r, 12};
    linear_fwd(&k);
    /* y[1][2] by hand */
    double s = k.b[2];
    for (int i = 0; i < 5; i++) s += (double)k.x[5 + i] * k.w[2 * 5 + i];
    CHECK_NEAR(k.y[1 * 4 + 2], s, 1e-5);
    td__ref_linear_backward(dx, dw, db, r, k.x, k.w, 3, 5, 4);
    fd_check(&p, "linear dx", k.x, dx, 15, EPS, ATOL, RTOL);
    fd_check(&p, "linear dw", k.w, dw, 20, EPS, ATOL, RTOL);
    fd_check(&p, "linear db", k.b, db, 4, EPS, ATOL, RTOL);
    free(k.x), free(k.w), free(k.b), free(k.y), free(r), free(dx), free(dw), free(db);
}

/* ---- conv2d ------------------------------------------------------------------------- */

typedef struct {
    float *y, *x, *w, *b;
    td__ref_conv2d_dims d;
} conv_ctx;

static void conv_fwd(void *c) {
    conv_ctx *k = c;
    td__ref_conv2d_forward(k->y, k->x, k->w, k->b, &k->d);
}

static void conv_case(td__ref_conv2d_dims d, int with_bias) {
    int OH, OW;
    td__ref_conv2d_out(&d, &OH, &OW);
    CHECK(OH > 0 && OW > 0);
    size_t nx = (size_t)d.N * d.C * d.H * d.W, nw = (size_t)d.OC * d.C * d.KH * d.KW;
    size_t ny = (size_t)d.N * d.OC * OH * OW;
    conv_ctx k = {zeros(ny), randn(nx), randn(nw), with_bias ? randn(d.OC) : NULL, d};
    float *r = randn(ny), *dx = zeros(nx), *dw = zeros(nw), *db = zeros(d.OC);
    fd_problem p = {conv_fwd, &k, k.y, r, ny};
    td__ref_conv2d_backward(dx, dw, with_bias ? db : NULL, r, k.x, k.w, &d);
    fd_check(&p, "conv dx", k.x, dx, nx, EPS, ATOL, RTOL);
    fd_check(&p, "conv dw", k.w, dw, nw, EPS, ATOL, RTOL);
    if (with_bias) fd_check(&p, "conv db", k.b, db, d.OC, EPS, ATOL, RTOL);
    free(k.y), free(k.x), free(k.w), free(k.b), free(r), free(dx), free(dw), free(db);
}

static void conv2d_matches_finite_differences(void) {
    /* N C H W OC KH KW sh sw ph pw dh dw */
    conv_case((td__ref_conv2d_dims){2, 3, 7, 6, 4, 3, 2, 2, 1, 1, 2, 1, 2}, 1);
    conv_case((td__ref_conv2d_dims){1, 2, 5, 5, 3, 3, 3, 1, 1, 0, 0, 1, 1}, 0);
    conv_case((td__ref_conv2d_dims){2, 1, 6, 7, 2, 2, 3, 3, 2, 2, 1, 2, 1}, 1);
}

static void conv2d_out_size_follows_pytorch(void) {
    int OH, OW;
    /* H: 28, k5 -> 24. W: 28, k3 dilated 2 (span 5), pad 1, stride 2 -> 25/2 + 1 = 13 */
    td__ref_conv2d_out(&(td__ref_conv2d_dims){1, 1, 28, 28, 1, 5, 3, 1, 2, 0, 1, 1, 2}, &OH, &OW);
    CHECK_EQ(OH, 24);
    CHECK_EQ(OW, 13);
    td__ref_conv2d_out(&(td__ref_conv2d_dims){1, 1, 4, 4, 1, 5, 5, 1, 1, 0, 0, 1, 1}, &OH, &OW);
    CHECK(OH <= 0 && OW <= 0);
}

/* ---- pooling ------------------------------------------------------------------------ */

typedef struct {
    float *y, *x;
    td__ref_pool2d_dims d;
    int is_max;
} pool_ctx;

static void pool_fwd(void *c) {
    pool_ctx *k = c;
    if (k->is_max)
        td__ref_maxpool2d_forward(k->y, NULL, k->x, &k->d);
    else
        td__ref_avgpool2d_forward(k->y, k->x, &k->d);
}

static void pool_case(td__ref_pool2d_dims d, int is_max) {
    int OH, OW;
    td__ref_pool2d_out(&d, &OH, &OW);
    size_t nx = (size_t)d.N * d.C * d.H * d.W, ny = (size_t)d.N * d.C * OH * OW;
    pool_ctx k = {zeros(ny), zeros(nx), d, is_max};
    /* Distinct values 0.05 apart (a shuffled ramp), so no max is within eps of a tie. */
    for (size_t i = 0; i < nx; i++) k.x[i] = 0.05f * (float)i - 1.0f;
    for (size_t i = nx; i > 1; i--) {
        size_t j = td_rng_below(&rng, (uint32_t)i);
        float t = k.x[i - 1];
        k.x[i - 1] = k.x[j], k.x[j] = t;
    }
    float *r = randn(ny), *dx = zeros(nx);
    fd_problem p = {pool_fwd, &k, k.y, r, ny};
    if (is_max)
        td__ref_maxpool2d_backward(dx, r, k.x, &d);
    else
        td__ref_avgpool2d_backward(dx, r, &d);
    fd_check(&p, is_max ? "maxpool dx" : "avgpool dx", k.x, dx, nx, 1e-2f, 1e-3, 1e-3);
    free(k.y), free(k.x), free(r), free(dx);
}

static void pooling_matches_finite_differences(void) {
    /* N C H W KH KW sh sw ph pw */
    td__ref_pool2d_dims a = {2, 3, 7, 6, 3, 2, 2, 2, 1, 1};
    td__ref_pool2d_dims b = {1, 2, 5, 7, 2, 2, 2, 2, 0, 0};
    td__ref_pool2d_dims c = {2, 1, 6, 5, 3, 3, 1, 2, 1, 0}; /* overlapping windows */
    pool_case(a, 1), pool_case(b, 1), pool_case(c, 1);
    pool_case(a, 0), pool_case(b, 0), pool_case(c, 0);
}

static void maxpool_ties_go_to_the_first_max(void) {
    /* 1x1x4x4 of equal values, 2x2 windows stride 2: each window routes to its top-left. */
    float x[16], dx[16], y[4], dy[4] = {1, 2, 3, 4};
    int64_t idx[4];
    for (int i = 0; i < 16; i++) x[i] = 0.5f;
    td__ref_pool2d_dims d = {1, 1, 4, 4, 2, 2, 2, 2, 0, 0};
    td__ref_maxpool2d_forward(y, idx, x, &d);
    td__ref_maxpool2d_backward(dx, dy, x, &d);
    CHECK_EQ(idx[0], 0);
    CHECK_EQ(idx[1], 2);
    CHECK_EQ(idx[2], 8);
    CHECK_EQ(idx[3], 10);
    float want[16] = {1, 0, 2, 0, 0, 0, 0, 0, 3, 0, 4, 0, 0, 0, 0, 0};
    for (int i = 0; i < 16; i++) CHECK_NEAR(dx[i], want[i], 0.0);
    /* padding never wins, even against negative values */
    for (int i = 0; i < 16; i++) x[i] = -1.0f - (float)i;
    td__ref_pool2d_dims e = {1, 1, 4, 4, 2, 2, 2, 2, 1, 1};
    float y3[9];
    td__ref_maxpool2d_forward(y3, NULL, x, &e);
    CHECK_NEAR(y3[0], -1.0, 0.0);
    CHECK_NEAR(y3[8], -16.0, 0.0);
}

static void avgpool_divisor_counts_padding(void) {
    float x[4] = {1, 2, 3, 4}, y[4];
    td__ref_pool2d_dims d = {1, 1, 2, 2, 2, 2, 1, 1, 1, 1}; /* 3x3 output */
    int OH, OW;
    td__ref_pool2d_out(&d, &OH, &OW);
    CHECK_EQ(OH, 3);
    float y9[9];
    (void)y;
    td__ref_avgpool2d_forward(y9, x, &d);
    CHECK_NEAR(y9[0], 1.0 / 4, 1e-7);  /* corner sees one value, divides by 4 */
    CHECK_NEAR(y9[4], 10.0 / 4, 1e-7); /* centre sees all four */
}

/* ---- element-wise ------------------------------------------------------------------- */

typedef struct {
    float *y, *x;
    const uint8_t *mask;
    size_t n;
    int kind; /* 0 relu, 1 gelu, 2 dropout, 3 dropout2d, 4 softmax, 5 log_softmax */
    int N, C, D;
    size_t plane;
    float scale;
} elt_ctx;

static void elt_fwd(void *c) {
    elt_ctx *k = c;
    switch (k->kind) {
    case 0:
        td__ref_relu_forward(k->y, k->x, k->n);
        break;
    case 1:
        td__ref_gelu_forward(k->y, k->x, k->n);
        break;
    case 2:
        td__ref_dropout_forward(k->y, k->x, k->mask, k->scale, k->n);
        break;
    case 3:
        td__ref_dropout2d_forward(k->y, k->x, k->mask, k->scale, k->N, k->C, k->plane);
        break;
    case 4:
        td__ref_softmax_forward(k->y, k->x, k->n / k->D, k->D);
        break;
    default:
        td__ref_log_softmax_forward(k->y, k->x, k->n / k->D, k->D);
        break;
    }
}

static void activations_match_finite_differences(void) {
    size_t n = 2 * 3 * 5;
    elt_ctx k = {zeros(n), randn(n), NULL, n, 0, 2, 3, 5, 5, 1.0f / (1.0f - 0.3f)};
    uint8_t mask[30];
    for (size_t i = 0; i < n; i++) mask[i] = td_rng_uniform(&rng) >= 0.3f;
    float *r = randn(n), *dx = zeros(n);
    fd_problem p = {elt_fwd, &k, k.y, r, n};

    /* relu: keep every input away from the kink at 0 */
    for (size_t i = 0; i < n; i++) k.x[i] += k.x[i] >= 0 ? 0.05f : -0.05f;
    k.kind = 0;
    td__ref_relu_backward(dx, r, k.x, n);
    fd_check(&p, "relu dx", k.x, dx, n, 1e-2f, 1e-4, 1e-4);

    k.kind = 1;
    td__ref_gelu_backward(dx, r, k.x, n);
    fd_check(&p, "gelu dx", k.x, dx, n, EPS, ATOL, RTOL);
    float g;
    td__ref_gelu_forward(&g, &(float){1.0f}, 1);
    CHECK_NEAR(g, 0.8413447460685429, 1e-7); /* Phi(1) */

    k.kind = 2, k.mask = mask;
    td__ref_dropout_backward(dx, r, mask, k.scale, n);
    fd_check(&p, "dropout dx", k.x, dx, n, EPS, ATOL, RTOL);

    k.kind = 3; /* mask (N=2, C=3) over planes of 5 */
    td__ref_dropout2d_backward(dx, r, mask, k.scale, 2, 3, 5);
    fd_check(&p, "dropout2d dx", k.x, dx, n, EPS, ATOL, RTOL);
    td__ref_dropout2d_forward(k.y, k.x, mask, k.scale, 2, 3, 5);
    for (size_t i = 0; i < n; i++) CHECK_NEAR(k.y[i], mask[i / 5] ? k.x[i] * k.scale : 0.0, 1e-6);

    k.kind = 4; /* rows of D = 5 */
    elt_fwd(&k);
    td__ref_softmax_backward(dx, r, k.y, n / 5, 5);
    fd_check(&p, "softmax dx", k.x, dx, n, EPS, ATOL, RTOL);
    for (size_t row = 0; row < n / 5; row++) {
        double s = 0.0;
        for (int j = 0; j < 5; j++) s += k.y[row * 5 + j];
        CHECK_NEAR(s, 1.0, 1e-6);
    }

    k.kind = 5;
    elt_fwd(&k);
    td__ref_log_softmax_backward(dx, r, k.y, n / 5, 5);
    fd_check(&p, "log_softmax dx", k.x, dx, n, EPS, ATOL, RTOL);
    /* large logits must not overflow */
    float big[3] = {1000.0f, 1001.0f, 999.0f}, lb[3];
    td__ref_log_softmax_forward(lb, big, 1, 3);
    CHECK_NEAR(lb[1], -0.40760596444438, 1e-5);

    free(k.y), free(k.x), free(r), free(dx);
}

/* ---- batch norm --------------------------------------------------------------------- */

typedef struct {
    float *y, *x, *w, *b, *rm, *rv, *mean, *invstd;
    int N, C, HW, train;
} bn_ctx;

static void bn_fwd(void *c) {
    bn_ctx *k = c;
    if (k->train) {
        /* finite differences must not drift the running stats: pass none */
        td__ref_batchnorm2d_forward_train(k->y, k->mean, k->invstd, NULL, NULL, k->x, k->w, k->b,
                                          k->N, k->C, k->HW, 1e-5f, 0.1f);
    } else {
        td__ref_batchnorm2d_forward_eval(k->y, k->x, k->rm, k->rv, k->w, k->b, k->N, k->C, k->HW,
                                         1e-5f);
    }
}

static void batchnorm_matches_finite_differences(void) {
    int N = 3, C = 2, HW = 5;
    size_t n = (size_t)N * C * HW;
    bn_ctx k = {zeros(n), randn(n), randn(C), randn(C), randn(C), zeros(C),
                zeros(C), zeros(C), N,        C,        HW,       1};
    for (int c = 0; c < C; c++) k.rv[c] = 0.5f + 0.3f * (float)c;
    float *r = randn(n), *dx = zeros(n), *dw = zeros(C), *db = zeros(C);
    fd_problem p = {bn_fwd, &k, k.y, r, n};
    bn_fwd(&k);
    td__ref_batchnorm2d_backward_train(dx, dw, db, r, k.x, k.w, k.mean, k.invstd, N, C, HW);
    fd_check(&p, "bn train dx", k.x, dx, n, EPS, 5e-3, 5e-3);
    fd_check(&p, "bn train dw", k.w, dw, C, EPS, ATOL, RTOL);
    fd_check(&p, "bn train db", k.b, db, C, EPS, ATOL, RTOL);

    k.train = 0;
    td__ref_batchnorm2d_backward_eval(dx, dw, db, r, k.x, k.rm, k.rv, k.w, N, C, HW, 1e-5f);
    fd_check(&p, "bn eval dx", k.x, dx, n, EPS, ATOL, RTOL);
    fd_check(&p, "bn eval dw", k.w, dw, C, EPS, ATOL, RTOL);
    fd_check(&p, "bn eval db", k.b, db, C, EPS, ATOL, RTOL);
    free(k.y), free(k.x), free(k.w), free(k.b), free(k.rm), free(k.rv), free(k.mean);
    free(k.invstd), free(r), free(dx), free(dw), free(db);
}

static void batchnorm_running_stats_use_unbiased_variance(void) {
    /* one channel, values 1 and 3: mean 2, biased var 1, unbiased var 2 */
    float x[2] = {1, 3}, y[2], mean, invstd, rm = 0.0f, rv = 1.0f;
    td__ref_batchnorm2d_forward_train(y, &mean, &invstd, &rm, &rv, x, NULL, NULL, 2, 1, 1, 1e-5f,
                                      0.1f);
    CHECK_NEAR(mean, 2.0, 0.0);
    CHECK_NEAR(invstd, 1.0 / sqrt(1.0 + 1e-5), 1e-7);
    CHECK_NEAR(rm, 0.2, 1e-7);
    CHECK_NEAR(rv, 0.9 * 1.0 + 0.1 * 2.0, 1e-7);
    CHECK_NEAR(y[0], -1.0 / sqrt(1.0 + 1e-5), 1e-6);
}

/* ---- structural --------------------------------------------------------------------- */

typedef struct {
    float *y, *a, *b, *c;
    int C[3];
    int N;
    size_t inner;
} cat_ctx;

static void cat_fwd(void *c) {
    cat_ctx *k = c;
    const float *xs[3] = {k->a, k->b, k->c};
    td__ref_concat_forward(k->y, xs, k->C, 3, k->N, k->inner);
}

static void concat_add_flatten(void) {
    cat_ctx k = {0};
    k.N = 2, k.inner = 3, k.C[0] = 1, k.C[1] = 3, k.C[2] = 2;
    k.a = randn(6), k.b = randn(18), k.c = randn(12), k.y = zeros(36);
    float *r = randn(36), *da = zeros(6), *db = zeros(18), *dc = zeros(12);
    fd_problem p = {cat_fwd, &k, k.y, r, 36};
    cat_fwd(&k);
    CHECK_NEAR(k.y[1 * 18 + 0], k.a[3], 0.0);         /* sample 1 starts with a's channel */
    CHECK_NEAR(k.y[1 * 18 + 3 + 4], k.b[9 + 4], 0.0); /* then b's */
    float *const dxs[3] = {da, db, dc};
    td__ref_concat_backward(dxs, r, k.C, 3, k.N, k.inner);
    fd_check(&p, "concat da", k.a, da, 6, EPS, ATOL, RTOL);
    fd_check(&p, "concat db", k.b, db, 18, EPS, ATOL, RTOL);
    fd_check(&p, "concat dc", k.c, dc, 12, EPS, ATOL, RTOL);

    float s[6];
    td__ref_add_forward(s, k.a, k.b, 6);
    for (int i = 0; i < 6; i++) CHECK_NEAR(s[i], k.a[i] + k.b[i], 0.0);
    td__ref_flatten_forward(s, k.c, 6);
    td__ref_flatten_backward(da, s, 6);
    CHECK(memcmp(da, k.c, 6 * sizeof(float)) == 0);
    free(k.y), free(k.a), free(k.b), free(k.c), free(r), free(da), free(db), free(dc);
}

/* ---- losses ------------------------------------------------------------------------- */

typedef struct {
    float loss, *x;
    const int64_t *labels;
    int N, C, ce;
    td__ref_reduction red;
} loss_ctx;

static void loss_fwd(void *c) {
    loss_ctx *k = c;
    td_status st =
        k->ce ? td__ref_cross_entropy_forward(&k->loss, k->x, k->labels, k->N, k->C, k->red, -100)
              : td__ref_nll_loss_forward(&k->loss, k->x, k->labels, k->N, k->C, k->red, -100);
    if (st != TD_OK) k->loss = NAN;
}

static void losses_match_finite_differences(void) {
    int64_t labels[5] = {2, 0, -100, 3, 2};
    for (int ce = 0; ce < 2; ce++)
        for (int red = 0; red < 2; red++) {
            loss_ctx k = {0.0f, randn(20), labels, 5, 4, ce, (td__ref_reduction)red};
            if (!ce) td__ref_log_softmax_forward(k.x, k.x, 5, 4);
            float r = 0.7f, *dx = zeros(20);
            fd_problem p = {loss_fwd, &k, &k.loss, &r, 1};
            if (ce)
                CHECK_OK(td__ref_cross_entropy_backward(dx, r, k.x, labels, 5, 4, k.red, -100));
            else
                CHECK_OK(td__ref_nll_loss_backward(dx, r, labels, 5, 4, k.red, -100));
            fd_check(&p, ce ? "cross_entropy dx" : "nll dx", k.x, dx, 20, EPS, ATOL, RTOL);
            for (int j = 0; j < 4; j++) CHECK_NEAR(dx[2 * 4 + j], 0.0, 0.0); /* ignored row */
            /* value by hand: mean over the 4 kept samples */
            double s = 0.0;
            for (int i = 0; i < 5; i++) {
                if (labels[i] < 0) continue;
                double lse = 0.0;
                for (int j = 0; j < 4; j++) lse += exp(k.x[i * 4 + j]);
                s += ce ? log(lse) - k.x[i * 4 + labels[i]] : -k.x[i * 4 + labels[i]];
            }
            loss_fwd(&k);
            CHECK_NEAR(k.loss, red ? s : s / 4, 1e-5);
            free(k.x), free(dx);
        }
}

static void losses_reject_bad_labels(void) {
    float x[6] = {0}, loss = 0.0f;
    int64_t bad[2] = {1, 3};
    CHECK_STATUS(td__ref_nll_loss_forward(&loss, x, bad, 2, 3, TD__REF_MEAN, -100), TD_EINVAL);
    CHECK(strstr(td_last_error(), "label 3 of sample 1") != NULL);
    CHECK_STATUS(td__ref_cross_entropy_backward(x, 1.0f, x, bad, 2, 3, TD__REF_SUM, -100),
                 TD_EINVAL);
    int64_t none[2] = {-100, -100};
    CHECK_OK(td__ref_nll_loss_forward(&loss, x, none, 2, 3, TD__REF_MEAN, -100));
    CHECK(isnan(loss)); /* PyTorch: mean over zero kept samples is NaN */
    CHECK_OK(td__ref_nll_loss_forward(&loss, x, none, 2, 3, TD__REF_SUM, -100));
    CHECK_NEAR(loss, 0.0, 0.0);
}

int main(void) {
    td_rng_init(&rng, 1234);
    RUN(linear_matches_finite_differences);
    RUN(conv2d_matches_finite_differences);
    RUN(conv2d_out_size_follows_pytorch);
    RUN(pooling_matches_finite_differences);
    RUN(maxpool_ties_go_to_the_first_max);
    RUN(avgpool_divisor_counts_padding);
    RUN(activations_match_finite_differences);
    RUN(batchnorm_matches_finite_differences);
    RUN(batchnorm_running_stats_use_unbiased_variance);
    RUN(concat_add_flatten);
    RUN(losses_match_finite_differences);
    RUN(losses_reject_bad_labels);
    TEST_END();
}
