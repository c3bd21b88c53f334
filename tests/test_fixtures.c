/* Reference kernels against PyTorch: every fixture in tests/fixtures/ops (made once by
 * make_fixtures.py with torch 1.13) is loaded, the op is re-run through the td__ref_*
 * kernels, and the output, updated state and every gradient must match. Tolerances:
 * |got - want| <= ATOL + RTOL |want| with RTOL 1e-5 and ATOL 1e-6 (1e-5 for the ops that
 * sum many terms: PyTorch accumulates in f32, the references in f64). Also checks that a
 * damaged fixture file is an error, not a crash. */
#include <dirent.h>
#include <unistd.h>

#include "fixture.h"
#include "ops/ref/ref.h"
#include "test.h"

#define RTOL 1e-5
#define ATOL 1e-6
#define ATOL_SUM 1e-5

static void check_close(const char *what, const float *got, const float *want, size_t n,
                        double rtol, double atol) {
    int bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        if (!(d <= atol + rtol * fabs(want[i]))) {
            if (bad++ < 3)
                TEST_FAIL_AT("%s[%zu]: got %.9g, PyTorch %.9g", what, i, (double)got[i],
                             (double)want[i]);
        }
        if (d > worst) worst = d;
    }
    if (bad) TEST_FAIL_AT("%s: %d of %zu differ (worst %.3g)", what, bad, n, worst);
}

/* Loads a fixture and checks every named array exists; 0 (case failed) otherwise. */
static int load(fixture *f, const char *name, const char *const *arrays) {
    td_status st = fixture_load(f, name);
    if (st != TD_OK) {
        TEST_FAIL_AT("%s: %s", name, td_last_error());
        return 0;
    }
    for (; *arrays; arrays++) {
        if (!fixture_get(f, *arrays)) {
            TEST_FAIL_AT("%s: no array '%s'", f->path, *arrays);
            fixture_free(f);
            return 0;
        }
    }
    return 1;
}

#define ARRAYS(...) ((const char *const[]){__VA_ARGS__, NULL})
#define A(name) fixture_f32(&f, name)
#define SHAPE(name, d) (fixture_get(&f, name)->shape[d])
#define COUNT(name) (fixture_get(&f, name)->count)

static float *scratch(size_t n) { return calloc(n ? n : 1, sizeof(float)); }

static void linear_matches_pytorch(void) {
    fixture f;
    if (!load(&f, "linear", ARRAYS("x", "weight", "bias", "y", "dy", "dx", "dweight", "dbias")))
        return;
    int N = (int)SHAPE("x", 0), IN = (int)SHAPE("x", 1), OUT = (int)SHAPE("weight", 0);
    float *y = scratch(COUNT("y")), *dx = scratch(COUNT("x")), *dw = scratch(COUNT("weight"));
    float *db = scratch(OUT);
    td__ref_linear_forward(y, A("x"), A("weight"), A("bias"), N, IN, OUT);
    td__ref_linear_backward(dx, dw, db, A("dy"), A("x"), A("weight"), N, IN, OUT);
    check_close("linear y", y, A("y"), COUNT("y"), RTOL, ATOL_SUM);
    check_close("linear dx", dx, A("dx"), COUNT("x"), RTOL, ATOL_SUM);
    check_close("linear dweight", dw, A("dweight"), COUNT("weight"), RTOL, ATOL_SUM);
    check_close("linear dbias", db, A("dbias"), OUT, RTOL, ATOL_SUM);
    free(y), free(dx), free(dw), free(db);
    fixture_free(&f);
}

static void conv2d_case(const char *name) {
    fixture f;
    if (!load(&f, name, ARRAYS("x", "weight", "y", "dy", "dx", "dweight"))) return;
    td__ref_conv2d_dims d = {(int)SHAPE("x", 0),
                             (int)SHAPE("x", 1),
                             (int)SHAPE("x", 2),
                             (int)SHAPE("x", 3),
                             (int)SHAPE("weight", 0),
                             (int)SHAPE("weight", 2),
                             (int)SHAPE("weight", 3),
                             (int)fixture_attr(&f, "stride_h", 1),
                             (int)fixture_attr(&f, "stride_w", 1),
                             (int)fixture_attr(&f, "pad_h", 0),
                             (int)fixture_attr(&f, "pad_w", 0),
                             (int)fixture_attr(&f, "dil_h", 1),
                             (int)fixture_attr(&f, "dil_w", 1)};
    int OH, OW;
    td__ref_conv2d_out(&d, &OH, &OW);
    CHECK_EQ(OH, SHAPE("y", 2));
    CHECK_EQ(OW, SHAPE("y", 3));
    const float *b = A("bias");
    float *y = scratch(COUNT("y")), *dx = scratch(COUNT("x")), *dw = scratch(COUNT("weight"));
    float *db = scratch(d.OC);
    td__ref_conv2d_forward(y, A("x"), A("weight"), b, &d);
    td__ref_conv2d_backward(dx, dw, b ? db : NULL, A("dy"), A("x"), A("weight"), &d);
    check_close("conv2d y", y, A("y"), COUNT("y"), RTOL, ATOL_SUM);
    check_close("conv2d dx", dx, A("dx"), COUNT("x"), RTOL, ATOL_SUM);
    check_close("conv2d dweight", dw, A("dweight"), COUNT("weight"), RTOL, ATOL_SUM);
    if (b) {
        CHECK(A("dbias") != NULL);
        if (A("dbias")) check_close("conv2d dbias", db, A("dbias"), d.OC, RTOL, ATOL_SUM);
    }
    free(y), free(dx), free(dw), free(db);
    fixture_free(&f);
}

static void conv2d_matches_pytorch(void) {
    conv2d_case("conv2d");
    conv2d_case("conv2d_nobias");
}

static void pool_case(const char *name, int is_max) {
    fixture f;
    if (!load(&f, name, ARRAYS("x", "y", "dy", "dx"))) return;
    td__ref_pool2d_dims d = {(int)SHAPE("x", 0),
                             (int)SHAPE("x", 1),
                             (int)SHAPE("x", 2),
                             (int)SHAPE("x", 3),
                             (int)fixture_attr(&f, "kernel_h", 1),
                             (int)fixture_attr(&f, "kernel_w", 1),
                             (int)fixture_attr(&f, "stride_h", 1),
                             (int)fixture_attr(&f, "stride_w", 1),
                             (int)fixture_attr(&f, "pad_h", 0),
                             (int)fixture_attr(&f, "pad_w", 0)};
    int OH, OW;
    td__ref_pool2d_out(&d, &OH, &OW);
    CHECK_EQ(OH, SHAPE("y", 2));
    CHECK_EQ(OW, SHAPE("y", 3));
    size_t ny = COUNT("y");
    float *y = scratch(ny), *dx = scratch(COUNT("x"));
    if (is_max) {
        int64_t *idx = calloc(ny, sizeof *idx);
        td__ref_maxpool2d_forward(y, idx, A("x"), &d);
        td__ref_maxpool2d_backward(dx, A("dy"), A("x"), &d);
        const fixture_array *want = fixture_get(&f, "indices");
        CHECK(want && want->dtype == TD_I64 && want->count == ny);
        int bad = 0;
        for (size_t i = 0; want && i < ny; i++) bad += idx[i] != ((const int64_t *)want->data)[i];
        CHECK_EQ(bad, 0);
        free(idx);
    } else {
        td__ref_avgpool2d_forward(y, A("x"), &d);
        td__ref_avgpool2d_backward(dx, A("dy"), &d);
    }
    check_close(name, y, A("y"), ny, RTOL, ATOL);
    check_close(name, dx, A("dx"), COUNT("x"), RTOL, ATOL);
    free(y), free(dx);
    fixture_free(&f);
}

static void pooling_matches_pytorch(void) {
    pool_case("max_pool2d", 1);
    pool_case("max_pool2d_ties", 1);
    pool_case("avg_pool2d", 0);
}

static void activations_match_pytorch(void) {
    static const char *const names[] = {"relu", "gelu", "gelu_tanh"};
    for (int k = 0; k < 3; k++) {
        fixture f;
        if (!load(&f, names[k], ARRAYS("x", "y", "dy", "dx"))) continue;
        size_t n = COUNT("x");
        float *y = scratch(n), *dx = scratch(n);
        if (k == 2) {
            td__ref_gelu_tanh_forward(y, A("x"), n);
            td__ref_gelu_tanh_backward(dx, A("dy"), A("x"), n);
        } else if (k) {
            td__ref_gelu_forward(y, A("x"), n);
            td__ref_gelu_backward(dx, A("dy"), A("x"), n);
        } else {
            td__ref_relu_forward(y, A("x"), n);
            td__ref_relu_backward(dx, A("dy"), A("x"), n);
        }
        char what[32];
        snprintf(what, sizeof what, "%s y", names[k]);
        check_close(what, y, A("y"), n, RTOL, ATOL);
        snprintf(what, sizeof what, "%s dx", names[k]);
        check_close(what, dx, A("dx"), n, RTOL, ATOL);
        free(y), free(dx);
        fixture_free(&f);
    }
}

static void layer_norm_matches_pytorch(void) {
    fixture f;
    if (!load(&f, "layer_norm", ARRAYS("x", "weight", "bias", "y", "dy", "dx", "dweight"))) return;
    int C = (int)COUNT("weight");
    size_t n = COUNT("x"), rows = n / (size_t)C;
    float eps = (float)fixture_attr(&f, "eps", 1e-5);
    float *y = scratch(n), *dx = scratch(n), *dw = scratch(C), *db = scratch(C);
    td__ref_layer_norm_forward(y, NULL, NULL, A("x"), A("weight"), A("bias"), rows, C, eps);
    td__ref_layer_norm_backward(dx, dw, db, A("dy"), A("x"), A("weight"), rows, C, eps);
    check_close("layer_norm y", y, A("y"), n, RTOL, ATOL_SUM);
    check_close("layer_norm dx", dx, A("dx"), n, RTOL, ATOL_SUM);
    check_close("layer_norm dweight", dw, A("dweight"), C, RTOL, ATOL_SUM);
    check_close("layer_norm dbias", db, A("dbias"), C, RTOL, ATOL_SUM);
    free(y), free(dx), free(dw), free(db);
    fixture_free(&f);
}

static void embedding_matches_pytorch(void) {
    fixture f;
    if (!load(&f, "embedding",
              ARRAYS("idx", "weight", "pos_weight", "tok", "y", "dy", "dweight", "dpos_weight")))
        return;
    const fixture_array *idx = fixture_get(&f, "idx");
    int S = (int)SHAPE("idx", 0), T = (int)SHAPE("idx", 1), V = (int)SHAPE("weight", 0);
    int C = (int)SHAPE("weight", 1);
    size_t n = (size_t)S * T;
    float *tok = scratch(n * C), *y = scratch(n * C), *dw = scratch((size_t)V * C);
    float *dp = scratch((size_t)T * C);
    td__ref_embedding_forward(tok, idx->data, A("weight"), n, C);
    td__ref_position_embedding_forward(y, tok, A("pos_weight"), S, T, C);
    td__ref_embedding_backward(dw, A("dy"), idx->data, n, V, C);
    td__ref_position_embedding_backward(dp, A("dy"), S, T, C);
    check_close("embedding", tok, A("tok"), n * C, RTOL, ATOL);
    check_close("position embedding", y, A("y"), n * C, RTOL, ATOL);
    check_close("embedding dweight", dw, A("dweight"), (size_t)V * C, RTOL, ATOL);
    check_close("position embedding dweight", dp, A("dpos_weight"), (size_t)T * C, RTOL, ATOL);
    for (size_t i = (size_t)T * C; i < COUNT("dpos_weight"); i++) CHECK(A("dpos_weight")[i] == 0);
    free(tok), free(y), free(dw), free(dp);
    fixture_free(&f);
}

static void attention_matches_pytorch(void) {
    fixture f;
    if (!load(&f, "attention", ARRAYS("qkv", "y", "dy", "dqkv"))) return;
    int B = (int)SHAPE("qkv", 0), T = (int)SHAPE("qkv", 1), C = (int)SHAPE("y", 2);
    int NH = (int)fixture_attr(&f, "heads", 1);
    float *y = scratch(COUNT("y")), *dx = scratch(COUNT("qkv"));
    td__ref_attention_forward(y, A("qkv"), B, T, C, NH);
    td__ref_attention_backward(dx, A("dy"), A("qkv"), B, T, C, NH);
    check_close("attention y", y, A("y"), COUNT("y"), RTOL, ATOL_SUM);
    check_close("attention dqkv", dx, A("dqkv"), COUNT("qkv"), RTOL, ATOL_SUM);
    free(y), free(dx);
    fixture_free(&f);
}

static void dropout_matches_pytorch(void) {
    for (int two_d = 0; two_d < 2; two_d++) {
        fixture f;
        if (!load(&f, two_d ? "dropout2d" : "dropout", ARRAYS("x", "mask", "y", "dy", "dx")))
            continue;
        size_t n = COUNT("x");
        const uint8_t *mask = fixture_get(&f, "mask")->data;
        float p = (float)fixture_attr(&f, "p", 0.0), scale = 1.0f / (1.0f - p);
        float *y = scratch(n), *dx = scratch(n);
        int N = (int)SHAPE("x", 0), C = (int)SHAPE("x", 1);
        size_t plane = n / ((size_t)N * C);
        size_t kept = 0;
        for (size_t i = 0; i < COUNT("mask"); i++) kept += mask[i];
        CHECK(kept > 0 && kept < COUNT("mask")); /* the fixture exercises both branches */
        if (two_d) {
            CHECK_EQ(COUNT("mask"), (size_t)N * C);
            td__ref_dropout2d_forward(y, A("x"), mask, scale, N, C, plane);
            td__ref_dropout2d_backward(dx, A("dy"), mask, scale, N, C, plane);
        } else {
            td__ref_dropout_forward(y, A("x"), mask, scale, n);
            td__ref_dropout_backward(dx, A("dy"), mask, scale, n);
        }
        check_close("dropout y", y, A("y"), n, RTOL, ATOL);
        check_close("dropout dx", dx, A("dx"), n, RTOL, ATOL);
        free(y), free(dx);
        fixture_free(&f);
    }
}

static void batch_norm_matches_pytorch(void) {
    for (int training = 1; training >= 0; training--) {
        fixture f;
        if (!load(&f, training ? "batch_norm2d_train" : "batch_norm2d_eval",
                  ARRAYS("x", "weight", "bias", "running_mean", "running_var", "y",
                         "running_mean_out", "running_var_out", "dy", "dx", "dweight", "dbias")))
            continue;
        CHECK_EQ((int)fixture_attr(&f, "training", -1), training);
        int N = (int)SHAPE("x", 0), C = (int)SHAPE("x", 1);
        int HW = (int)(SHAPE("x", 2) * SHAPE("x", 3));
        float eps = (float)fixture_attr(&f, "eps", 1e-5);
        float momentum = (float)fixture_attr(&f, "momentum", 0.1);
        size_t n = COUNT("x");
        float *y = scratch(n), *dx = scratch(n), *dw = scratch(C), *db = scratch(C);
        float *mean = scratch(C), *invstd = scratch(C), *rm = scratch(C), *rv = scratch(C);
        memcpy(rm, A("running_mean"), C * sizeof(float));
        memcpy(rv, A("running_var"), C * sizeof(float));
        if (training) {
            td__ref_batchnorm2d_forward_train(y, mean, invstd, rm, rv, A("x"), A("weight"),
                                              A("bias"), N, C, HW, eps, momentum);
            td__ref_batchnorm2d_backward_train(dx, dw, db, A("dy"), A("x"), A("weight"), mean,
                                               invstd, N, C, HW);
        } else {
            td__ref_batchnorm2d_forward_eval(y, A("x"), rm, rv, A("weight"), A("bias"), N, C, HW,
                                             eps);
            td__ref_batchnorm2d_backward_eval(dx, dw, db, A("dy"), A("x"), rm, rv, A("weight"), N,
                                              C, HW, eps);
        }
        check_close("bn y", y, A("y"), n, RTOL, ATOL_SUM);
        check_close("bn running_mean", rm, A("running_mean_out"), C, RTOL, ATOL);
        check_close("bn running_var", rv, A("running_var_out"), C, RTOL, ATOL);
        check_close("bn dx", dx, A("dx"), n, RTOL, ATOL_SUM);
        check_close("bn dweight", dw, A("dweight"), C, RTOL, ATOL_SUM);
        check_close("bn dbias", db, A("dbias"), C, RTOL, ATOL_SUM);
        free(y), free(dx), free(dw), free(db), free(mean), free(invstd), free(rm), free(rv);
        fixture_free(&f);
    }
}

static void concat_matches_pytorch(void) {
    fixture f;
    if (!load(&f, "concat", ARRAYS("x0", "x1", "x2", "y", "dy", "dx0", "dx1", "dx2"))) return;
    const char *xn[3] = {"x0", "x1", "x2"}, *dn[3] = {"dx0", "dx1", "dx2"};
    int C[3];
    const float *xs[3];
    float *dxs[3];
    for (int j = 0; j < 3; j++) {
        C[j] = (int)SHAPE(xn[j], 1);
        xs[j] = A(xn[j]);
        dxs[j] = scratch(COUNT(xn[j]));
    }
    int N = (int)SHAPE("y", 0);
    size_t inner = COUNT("y") / ((size_t)N * SHAPE("y", 1));
    float *y = scratch(COUNT("y"));
    td__ref_concat_forward(y, xs, C, 3, N, inner);
    td__ref_concat_backward(dxs, A("dy"), C, 3, N, inner);
    check_close("concat y", y, A("y"), COUNT("y"), 0.0, 0.0);
    for (int j = 0; j < 3; j++) {
        check_close(dn[j], dxs[j], A(dn[j]), COUNT(xn[j]), 0.0, 0.0);
        free(dxs[j]);
    }
    free(y);
    fixture_free(&f);
}

static void softmax_matches_pytorch(void) {
    for (int lg = 0; lg < 2; lg++) {
        fixture f;
        if (!load(&f, lg ? "log_softmax" : "softmax", ARRAYS("x", "y", "dy", "dx"))) continue;
        size_t rows = (size_t)SHAPE("x", 0);
        int D = (int)SHAPE("x", 1);
        float *y = scratch(COUNT("x")), *dx = scratch(COUNT("x"));
        if (lg) {
            td__ref_log_softmax_forward(y, A("x"), rows, D);
            td__ref_log_softmax_backward(dx, A("dy"), y, rows, D);
        } else {
            td__ref_softmax_forward(y, A("x"), rows, D);
            td__ref_softmax_backward(dx, A("dy"), y, rows, D);
        }
        check_close(lg ? "log_softmax y" : "softmax y", y, A("y"), COUNT("x"), RTOL, ATOL);
        check_close(lg ? "log_softmax dx" : "softmax dx", dx, A("dx"), COUNT("x"), RTOL, ATOL);
        free(y), free(dx);
        fixture_free(&f);
    }
}

static void losses_match_pytorch(void) {
    const char *names[7] = {"nll_loss_mean",           "nll_loss_sum",
                            "cross_entropy_mean",      "cross_entropy_sum",
                            "nll_loss_mean_ignore",    "cross_entropy_mean_ignore",
                            "cross_entropy_sum_ignore"};
    for (int k = 0; k < 7; k++) {
        fixture f;
        if (!load(&f, names[k], ARRAYS("x", "labels", "y", "dy", "dx"))) continue;
        const fixture_array *lab = fixture_get(&f, "labels");
        CHECK(lab->dtype == TD_I64);
        const int64_t *labels = lab->data;
        int N = (int)SHAPE("x", 0), C = (int)SHAPE("x", 1);
        int ce = strncmp(names[k], "cross", 5) == 0;
        td__ref_reduction red = (td__ref_reduction)(int)fixture_attr(&f, "reduction", 0);
        int64_t ignore = (int64_t)fixture_attr(&f, "ignore_index", -100);
        float loss = 0.0f, *dx = scratch(COUNT("x"));
        if (ce) {
            CHECK_OK(td__ref_cross_entropy_forward(&loss, A("x"), labels, N, C, red, ignore));
            CHECK_OK(
                td__ref_cross_entropy_backward(dx, A("dy")[0], A("x"), labels, N, C, red, ignore));
        } else {
            CHECK_OK(td__ref_nll_loss_forward(&loss, A("x"), labels, N, C, red, ignore));
            CHECK_OK(td__ref_nll_loss_backward(dx, A("dy")[0], labels, N, C, red, ignore));
        }
        check_close(names[k], &loss, A("y"), 1, RTOL, ATOL);
        check_close(names[k], dx, A("dx"), COUNT("x"), RTOL, ATOL);
        free(dx);
        fixture_free(&f);
    }
}

/* Writes the first `keep` bytes of fixture `src` (plus `extra`) as <dir>/bad.tdf. */
static void write_damaged(const char *dir, const char *src, long keep, const char *extra) {
    char in[600], out[600];
    snprintf(in, sizeof in, "%s/%s.tdf", fixture_dir(), src);
    snprintf(out, sizeof out, "%s/bad.tdf", dir);
    FILE *fi = fopen(in, "rb"), *fo = fopen(out, "wb");
    CHECK(fi && fo);
    if (!fi || !fo) {
        if (fi) fclose(fi);
        if (fo) fclose(fo);
        return;
    }
    for (long i = 0; keep < 0 || i < keep; i++) {
        int c = fgetc(fi);
        if (c == EOF) break;
        fputc(c, fo);
    }
    if (extra) fputs(extra, fo);
    fclose(fi);
    fclose(fo);
}

static void damaged_fixtures_are_errors(void) {
    char dir[] = "/tmp/td_fixture_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    const char *old = getenv("TD_FIXTURES_DIR");
    char saved[512];
    snprintf(saved, sizeof saved, "%s", old ? old : "");
    fixture f;
    write_damaged(dir, "linear", -1, NULL);
    setenv("TD_FIXTURES_DIR", dir, 1);
    CHECK_OK(fixture_load(&f, "bad")); /* the full copy loads */
    fixture_free(&f);
    unsetenv("TD_FIXTURES_DIR");
    if (old) setenv("TD_FIXTURES_DIR", saved, 1);

    write_damaged(dir, "linear", 500, NULL); /* the header is ~170 bytes: data cut short */
    setenv("TD_FIXTURES_DIR", dir, 1);
    CHECK_STATUS(fixture_load(&f, "bad"), TD_EFORMAT);
    CHECK(strstr(td_last_error(), "truncated") != NULL);
    unsetenv("TD_FIXTURES_DIR");
    if (old) setenv("TD_FIXTURES_DIR", saved, 1);

    write_damaged(dir, "linear", 30, NULL); /* no 'end' line */
    setenv("TD_FIXTURES_DIR", dir, 1);
    CHECK_STATUS(fixture_load(&f, "bad"), TD_EFORMAT);
    CHECK_STATUS(fixture_load(&f, "missing"), TD_EIO);
    unsetenv("TD_FIXTURES_DIR");
    if (old) setenv("TD_FIXTURES_DIR", saved, 1);

    char path[600];
    snprintf(path, sizeof path, "%s/bad.tdf", dir);
    unlink(path);
    rmdir(dir);
}

/* Every fixture the generator writes is checked by a case above (normalize and NT-Xent by
 * test_contrastive.c; the transformer's ops through the graph also by test_transformer_ops.c): a
 * new .tdf without a case fails, so no fixture sits unread. */
static void every_fixture_is_checked(void) {
    static const char *const covered[] = {"linear",
                                          "conv2d",
                                          "conv2d_nobias",
                                          "max_pool2d",
                                          "max_pool2d_ties",
                                          "avg_pool2d",
                                          "relu",
                                          "gelu",
                                          "dropout",
                                          "dropout2d",
                                          "batch_norm2d_train",
                                          "batch_norm2d_eval",
                                          "concat",
                                          "softmax",
                                          "log_softmax",
                                          "nll_loss_mean",
                                          "nll_loss_sum",
                                          "cross_entropy_mean",
                                          "cross_entropy_sum",
                                          "nll_loss_mean_ignore",
                                          "cross_entropy_mean_ignore",
                                          "cross_entropy_sum_ignore",
                                          "normalize",
                                          "nt_xent_local",
                                          "nt_xent_global",
                                          "gelu_tanh",
                                          "layer_norm",
                                          "embedding",
                                          "attention"};
    const size_t ncovered = sizeof covered / sizeof *covered;
    DIR *dir = opendir(fixture_dir());
    CHECK(dir != NULL);
    if (!dir) return;
    size_t found = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".tdf")) continue;
        int known = 0;
        for (size_t i = 0; i < ncovered; i++)
            known |= strlen(covered[i]) == len - 4 && !strncmp(covered[i], e->d_name, len - 4);
        if (!known) TEST_FAIL_AT("%s/%s has no test case", fixture_dir(), e->d_name);
        found += known;
    }
    closedir(dir);
    CHECK_EQ(found, ncovered);
}

int main(void) {
    RUN(linear_matches_pytorch);
    RUN(conv2d_matches_pytorch);
    RUN(pooling_matches_pytorch);
    RUN(activations_match_pytorch);
    RUN(dropout_matches_pytorch);
    RUN(batch_norm_matches_pytorch);
    RUN(concat_matches_pytorch);
    RUN(softmax_matches_pytorch);
    RUN(losses_match_pytorch);
    RUN(layer_norm_matches_pytorch);
    RUN(embedding_matches_pytorch);
    RUN(attention_matches_pytorch);
    RUN(damaged_fixtures_are_errors);
    RUN(every_fixture_is_checked);
    TEST_END();
}
