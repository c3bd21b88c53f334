/* The graph's ops against the reference kernels and the PyTorch fixtures: each case builds
 * a one-op graph through the public API (include/tandem/graph.h), runs forward and
 * backward_from a random upstream gradient, and compares the output, the updated state and
 * every input and parameter gradient with src/ops/ref_*.c on random inputs, then with
 * tests/fixtures/ops on PyTorch's inputs. A last case chains conv, batch norm, relu, max
 * pool, flatten, linear and cross entropy, so that activations cross primitives in the
 * engine's own layouts. Tolerance: |got - want| <= TOL (1 + |want|), TOL 1e-4 (oneDNN sums
 * in f32 in its own order). Dropout masks come from the graph and are read back from y. */
#include <string.h>

#include "tandem/graph.h"

#include "ops/ref/ref.h"
#include "test_op_rig.h"

/* ---- linear ------------------------------------------------------------------------- */

/* Runs linear through the graph: y (N, OUT), dx, dw, db (db NULL when b is NULL). */
static int graph_linear(int N, int IN, int OUT, const float *x, const float *w, const float *b,
                        const float *dy, float *y, float *dx, float *dw, float *db) {
    rig r;
    rig_init(&r);
    td_tensor *tx = rig_leaf(&r, 0, "x", td_shape_2d(N, IN), TD_F32, x);
    td_tensor *tw = rig_leaf(&r, 1, "fc.weight", td_shape_2d(OUT, IN), TD_F32, w);
    td_tensor *tb = b ? rig_leaf(&r, 1, "fc.bias", td_shape_1d(OUT), TD_F32, b) : NULL;
    td_tensor *ty = NULL;
    if (r.ok) RIG_CALL(&r, td_graph_linear(r.g, tx, tw, tb, &ty));
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        rig_grad(&r, tx, dx);
        rig_grad(&r, tw, dw);
        if (b) rig_grad(&r, tb, db);
    }
    return rig_done(&r);
}

static void linear_matches_reference(void) {
    int N = 5, IN = 7, OUT = 6;
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        float *x = randn(N * IN), *w = randn(OUT * IN), *b = with_bias ? randn(OUT) : NULL;
        float *dy = randn(N * OUT), *y = scratch(N * OUT), *dx = scratch(N * IN);
        float *dw = scratch(OUT * IN), *db = scratch(OUT);
        float *ry = scratch(N * OUT), *rdx = scratch(N * IN), *rdw = scratch(OUT * IN);
        float *rdb = scratch(OUT);
        if (graph_linear(N, IN, OUT, x, w, b, dy, y, dx, dw, db)) {
            td__ref_linear_forward(ry, x, w, b, N, IN, OUT);
            td__ref_linear_backward(rdx, rdw, rdb, dy, x, w, N, IN, OUT);
            check_close("linear y", y, ry, N * OUT, TOL);
            check_close("linear dx", dx, rdx, N * IN, TOL);
            check_close("linear dweight", dw, rdw, OUT * IN, TOL);
            if (b) check_close("linear dbias", db, rdb, OUT, TOL);
        }
        free(x), free(w), free(b), free(dy), free(y), free(dx), free(dw), free(db);
        free(ry), free(rdx), free(rdw), free(rdb);
    }
}

static void linear_matches_pytorch(void) {
    fixture f;
    if (!load(&f, "linear")) return;
    const fixture_array *x = fixture_get(&f, "x"), *w = fixture_get(&f, "weight");
    int N = (int)x->shape[0], IN = (int)x->shape[1], OUT = (int)w->shape[0];
    float *y = scratch(N * OUT), *dx = scratch(N * IN), *dw = scratch(OUT * IN);
    float *db = scratch(OUT);
    if (graph_linear(N, IN, OUT, x->data, w->data, fixture_f32(&f, "bias"), fixture_f32(&f, "dy"),
                     y, dx, dw, db)) {
        check_close("linear y", y, fixture_f32(&f, "y"), N * OUT, TOL);
        check_close("linear dx", dx, fixture_f32(&f, "dx"), N * IN, TOL);
        check_close("linear dweight", dw, fixture_f32(&f, "dweight"), OUT * IN, TOL);
        check_close("linear dbias", db, fixture_f32(&f, "dbias"), OUT, TOL);
    }
    free(y), free(dx), free(dw), free(db);
    fixture_free(&f);
}

/* ---- conv2d ------------------------------------------------------------------------- */

static int graph_conv2d(const td__ref_conv2d_dims *d, const float *x, const float *w,
                        const float *b, const float *dy, float *y, float *dx, float *dw,
                        float *db) {
    rig r;
    rig_init(&r);
    td_tensor *tx = rig_leaf(&r, 0, "x", td_shape_4d(d->N, d->C, d->H, d->W), TD_F32, x);
    td_tensor *tw =
        rig_leaf(&r, 1, "conv.weight", td_shape_4d(d->OC, d->C, d->KH, d->KW), TD_F32, w);
    td_tensor *tb = b ? rig_leaf(&r, 1, "conv.bias", td_shape_1d(d->OC), TD_F32, b) : NULL;
    td_conv2d_params p = td_conv2d_default_params();
    p.stride[0] = d->stride_h, p.stride[1] = d->stride_w;
    p.padding[0] = d->pad_h, p.padding[1] = d->pad_w;
    p.dilation[0] = d->dil_h, p.dilation[1] = d->dil_w;
    td_tensor *ty = NULL;
    if (r.ok) RIG_CALL(&r, td_graph_conv2d(r.g, tx, tw, tb, &p, &ty));
    if (ty) {
        int OH, OW;
        td__ref_conv2d_out(d, &OH, &OW);
        td_shape want = td_shape_4d(d->N, d->OC, OH, OW), got = td_tensor_shape(ty);
        CHECK(td_shape_equal(&want, &got));
        if (!td_shape_equal(&want, &got)) r.ok = 0;
    }
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        rig_grad(&r, tx, dx);
        rig_grad(&r, tw, dw);
        if (b) rig_grad(&r, tb, db);
    }
    return rig_done(&r);
}

static void conv2d_case(td__ref_conv2d_dims d, int with_bias) {
    int OH, OW;
    td__ref_conv2d_out(&d, &OH, &OW);
    size_t nx = (size_t)d.N * d.C * d.H * d.W, nw = (size_t)d.OC * d.C * d.KH * d.KW;
    size_t ny = (size_t)d.N * d.OC * OH * OW;
    float *x = randn(nx), *w = randn(nw), *b = with_bias ? randn(d.OC) : NULL, *dy = randn(ny);
    float *y = scratch(ny), *dx = scratch(nx), *dw = scratch(nw), *db = scratch(d.OC);
    float *ry = scratch(ny), *rdx = scratch(nx), *rdw = scratch(nw), *rdb = scratch(d.OC);
    if (graph_conv2d(&d, x, w, b, dy, y, dx, dw, db)) {
        td__ref_conv2d_forward(ry, x, w, b, &d);
        td__ref_conv2d_backward(rdx, rdw, rdb, dy, x, w, &d);
        check_close("conv2d y", y, ry, ny, TOL);
        check_close("conv2d dx", dx, rdx, nx, TOL);
        check_close("conv2d dweight", dw, rdw, nw, TOL);
        if (b) check_close("conv2d dbias", db, rdb, d.OC, TOL);
    }
    free(x), free(w), free(b), free(dy), free(y), free(dx), free(dw), free(db);
    free(ry), free(rdx), free(rdw), free(rdb);
}

static void conv2d_matches_reference(void) {
    /* N C H W OC KH KW sh sw ph pw dh dw */
    conv2d_case((td__ref_conv2d_dims){2, 3, 9, 8, 5, 3, 3, 1, 1, 1, 1, 1, 1}, 1);
    conv2d_case((td__ref_conv2d_dims){2, 3, 7, 6, 4, 3, 2, 2, 1, 1, 2, 1, 2}, 1);
    conv2d_case((td__ref_conv2d_dims){1, 4, 8, 8, 3, 5, 5, 2, 2, 2, 2, 1, 1}, 0);
    conv2d_case((td__ref_conv2d_dims){3, 1, 28, 28, 8, 5, 5, 1, 1, 0, 0, 1, 1}, 1);
}

static void conv2d_fixture(const char *name) {
    fixture f;
    if (!load(&f, name)) return;
    const fixture_array *x = fixture_get(&f, "x"), *w = fixture_get(&f, "weight");
    td__ref_conv2d_dims d = {(int)x->shape[0],
                             (int)x->shape[1],
                             (int)x->shape[2],
                             (int)x->shape[3],
                             (int)w->shape[0],
                             (int)w->shape[2],
                             (int)w->shape[3],
                             (int)fixture_attr(&f, "stride_h", 1),
                             (int)fixture_attr(&f, "stride_w", 1),
                             (int)fixture_attr(&f, "pad_h", 0),
                             (int)fixture_attr(&f, "pad_w", 0),
                             (int)fixture_attr(&f, "dil_h", 1),
                             (int)fixture_attr(&f, "dil_w", 1)};
    size_t ny = fixture_get(&f, "y")->count;
    const float *b = fixture_f32(&f, "bias");
    float *y = scratch(ny), *dx = scratch(x->count), *dw = scratch(w->count);
    float *db = scratch(d.OC);
    if (graph_conv2d(&d, x->data, w->data, b, fixture_f32(&f, "dy"), y, dx, dw, db)) {
        check_close("conv2d y", y, fixture_f32(&f, "y"), ny, TOL);
        check_close("conv2d dx", dx, fixture_f32(&f, "dx"), x->count, TOL);
        check_close("conv2d dweight", dw, fixture_f32(&f, "dweight"), w->count, TOL);
        if (b) check_close("conv2d dbias", db, fixture_f32(&f, "dbias"), d.OC, TOL);
    }
    free(y), free(dx), free(dw), free(db);
    fixture_free(&f);
}

static void conv2d_matches_pytorch(void) {
    conv2d_fixture("conv2d");
    conv2d_fixture("conv2d_nobias");
}

/* ---- pooling ------------------------------------------------------------------------ */

static int graph_pool(int is_max, const td__ref_pool2d_dims *d, const float *x, const float *dy,
                      float *y, float *dx) {
    rig r;
    rig_init(&r);
    td_tensor *tx = rig_leaf(&r, 0, "x", td_shape_4d(d->N, d->C, d->H, d->W), TD_F32, x);
    td_pool2d_params p = td_pool2d_default_params();
    p.kernel[0] = d->KH, p.kernel[1] = d->KW;
    p.stride[0] = d->stride_h, p.stride[1] = d->stride_w;
    p.padding[0] = d->pad_h, p.padding[1] = d->pad_w;
    td_tensor *ty = NULL;
    if (r.ok)
        RIG_CALL(&r, is_max ? td_graph_max_pool2d(r.g, tx, &p, &ty)
                            : td_graph_avg_pool2d(r.g, tx, &p, &ty));
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        rig_grad(&r, tx, dx);
    }
    return rig_done(&r);
}

static void pool_case(int is_max, td__ref_pool2d_dims d, const float *x_in, const float *dy_in,
                      const float *want_y, const float *want_dx) {
    int OH, OW;
    td__ref_pool2d_out(&d, &OH, &OW);
    size_t nx = (size_t)d.N * d.C * d.H * d.W, ny = (size_t)d.N * d.C * OH * OW;
    float *x = x_in ? NULL : randn(nx), *dy = dy_in ? NULL : randn(ny);
    const float *xs = x_in ? x_in : x, *dys = dy_in ? dy_in : dy;
    float *y = scratch(ny), *dx = scratch(nx), *ry = scratch(ny), *rdx = scratch(nx);
    if (is_max) {
        td__ref_maxpool2d_forward(ry, NULL, xs, &d);
        td__ref_maxpool2d_backward(rdx, dys, xs, &d);
    } else {
        td__ref_avgpool2d_forward(ry, xs, &d);
        td__ref_avgpool2d_backward(rdx, dys, &d);
    }
    if (graph_pool(is_max, &d, xs, dys, y, dx)) {
        const char *n = is_max ? "max_pool2d" : "avg_pool2d";
        check_close(n, y, want_y ? want_y : ry, ny, TOL);
        check_close(n, dx, want_dx ? want_dx : rdx, nx, TOL);
    }
    free(x), free(dy), free(y), free(dx), free(ry), free(rdx);
}

static void pooling_matches_reference(void) {
    /* N C H W KH KW sh sw ph pw */
    td__ref_pool2d_dims a = {2, 3, 8, 8, 2, 2, 2, 2, 0, 0};
    td__ref_pool2d_dims b = {2, 3, 7, 6, 3, 2, 2, 2, 1, 1};
    td__ref_pool2d_dims c = {1, 2, 9, 7, 3, 3, 1, 2, 1, 0};
    for (int is_max = 0; is_max < 2; is_max++) {
        pool_case(is_max, a, NULL, NULL, NULL, NULL);
        pool_case(is_max, b, NULL, NULL, NULL, NULL);
        pool_case(is_max, c, NULL, NULL, NULL, NULL);
    }
}

static void pool_fixture(const char *name, int is_max) {
    fixture f;
    if (!load(&f, name)) return;
    const fixture_array *x = fixture_get(&f, "x");
    td__ref_pool2d_dims d = {(int)x->shape[0],
                             (int)x->shape[1],
                             (int)x->shape[2],
                             (int)x->shape[3],
                             (int)fixture_attr(&f, "kernel_h", 1),
                             (int)fixture_attr(&f, "kernel_w", 1),
                             (int)fixture_attr(&f, "stride_h", 1),
                             (int)fixture_attr(&f, "stride_w", 1),
                             (int)fixture_attr(&f, "pad_h", 0),
                             (int)fixture_attr(&f, "pad_w", 0)};
    pool_case(is_max, d, x->data, fixture_f32(&f, "dy"), fixture_f32(&f, "y"),
              fixture_f32(&f, "dx"));
    fixture_free(&f);
}

static void pooling_matches_pytorch(void) {
    pool_fixture("max_pool2d", 1);
    pool_fixture("avg_pool2d", 0);
}

/* torchvision's ResNet stem pools 3x3, stride 2, padding 1. Padding must never win: with every
 * input negative a zero-padded max would give 0 at the borders, and on ReLU outputs (the stem's
 * case, border windows of exact zeros) it would take the gradient of a tied window from the
 * first real zero. Odd and even sides, as 112 -> 56 and 7 -> 4. */
static void max_pool_padding_never_wins(void) {
    td__ref_pool2d_dims sides[] = {{2, 3, 9, 10, 3, 3, 2, 2, 1, 1}, {1, 2, 7, 7, 3, 3, 2, 2, 1, 1}};
    for (int k = 0; k < 2; k++) {
        td__ref_pool2d_dims d = sides[k];
        size_t nx = (size_t)d.N * d.C * d.H * d.W;
        int OH, OW;
        td__ref_pool2d_out(&d, &OH, &OW);
        size_t ny = (size_t)d.N * d.C * OH * OW;
        float *x = randn(nx), *y = scratch(ny), *dx = scratch(nx), *dy = randn(ny);
        for (size_t i = 0; i < nx; i++) x[i] = -1.0f - fabsf(x[i]);
        if (graph_pool(1, &d, x, dy, y, dx)) {
            size_t above = 0;
            for (size_t i = 0; i < ny; i++) above += !(y[i] <= -1.0f);
            CHECK_EQ(above, 0);
        }
        pool_case(1, d, x, dy, NULL, NULL);
        for (size_t i = 0; i < nx; i++) x[i] = i % 5 ? 0.0f : -x[i]; /* ReLU'd: mostly zeros */
        pool_case(1, d, x, dy, NULL, NULL);
        free(x), free(y), free(dx), free(dy);
    }
}

/* PyTorch routes a tied window's gradient to its first maximum. */
static void max_pool_ties_match_pytorch(void) { pool_fixture("max_pool2d_ties", 1); }

/* ---- single-input ops: relu, gelu, softmax, log_softmax, flatten ---------------------- */

enum { OP_RELU, OP_GELU, OP_SOFTMAX, OP_LOG_SOFTMAX, OP_FLATTEN };

static int graph_unary(int op, td_shape s, const float *x, const float *dy, float *y, float *dx) {
    rig r;
    rig_init(&r);
    td_tensor *tx = rig_leaf(&r, 0, "x", s, TD_F32, x), *ty = NULL;
    if (r.ok) {
        switch (op) {
        case OP_RELU:
            RIG_CALL(&r, td_graph_relu(r.g, tx, &ty));
            break;
        case OP_GELU:
            RIG_CALL(&r, td_graph_gelu(r.g, tx, &ty));
            break;
        case OP_SOFTMAX:
            RIG_CALL(&r, td_graph_softmax(r.g, tx, &ty));
            break;
        case OP_LOG_SOFTMAX:
            RIG_CALL(&r, td_graph_log_softmax(r.g, tx, &ty));
            break;
        default:
            RIG_CALL(&r, td_graph_flatten(r.g, tx, 1, &ty));
            break;
        }
    }
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        rig_grad(&r, tx, dx);
    }
    return rig_done(&r);
}

static void ref_unary(int op, size_t rows, int D, const float *x, const float *dy, float *y,
                      float *dx) {
    size_t n = rows * (size_t)D;
    switch (op) {
    case OP_RELU:
        td__ref_relu_forward(y, x, n);
        td__ref_relu_backward(dx, dy, x, n);
        break;
    case OP_GELU:
        td__ref_gelu_forward(y, x, n);
        td__ref_gelu_backward(dx, dy, x, n);
        break;
    case OP_SOFTMAX:
        td__ref_softmax_forward(y, x, rows, D);
        td__ref_softmax_backward(dx, dy, y, rows, D);
        break;
    case OP_LOG_SOFTMAX:
        td__ref_log_softmax_forward(y, x, rows, D);
        td__ref_log_softmax_backward(dx, dy, y, rows, D);
        break;
    default:
        td__ref_flatten_forward(y, x, n);
        td__ref_flatten_backward(dx, dy, n);
        break;
    }
}

static const char *unary_name[] = {"relu", "gelu", "softmax", "log_softmax", "flatten"};

static void unary_ops_match_reference(void) {
    for (int op = 0; op <= OP_FLATTEN; op++) {
        /* softmax ops take (N, C); the element-wise ones any shape */
        td_shape s =
            op == OP_SOFTMAX || op == OP_LOG_SOFTMAX ? td_shape_2d(6, 11) : td_shape_4d(2, 3, 5, 4);
        size_t n = (size_t)td_shape_numel(&s);
        int D = (int)s.dim[s.ndim - 1];
        float *x = randn(n), *dy = randn(n), *y = scratch(n), *dx = scratch(n);
        float *ry = scratch(n), *rdx = scratch(n);
        for (size_t i = 0; i < n; i++) x[i] *= 2.0f;
        if (graph_unary(op, s, x, dy, y, dx)) {
            ref_unary(op, n / D, D, x, dy, ry, rdx);
            check_close(unary_name[op], y, ry, n, TOL);
            check_close(unary_name[op], dx, rdx, n, TOL);
        }
        free(x), free(dy), free(y), free(dx), free(ry), free(rdx);
    }
}

static void unary_ops_match_pytorch(void) {
    for (int op = 0; op <= OP_LOG_SOFTMAX; op++) {
        fixture f;
        if (!load(&f, unary_name[op])) return;
        const fixture_array *x = fixture_get(&f, "x");
        td_shape s = td_shape_make(x->ndim, x->shape);
        float *y = scratch(x->count), *dx = scratch(x->count);
        if (graph_unary(op, s, x->data, fixture_f32(&f, "dy"), y, dx)) {
            check_close(unary_name[op], y, fixture_f32(&f, "y"), x->count, TOL);
            check_close(unary_name[op], dx, fixture_f32(&f, "dx"), x->count, TOL);
        }
        free(y), free(dx);
        fixture_free(&f);
    }
}

/* ---- dropout ------------------------------------------------------------------------ */

static void dropout_case(int two_d, int training) {
    int N = 4, C = 8, H = 6, W = 5;
    size_t n = (size_t)N * C * H * W, plane = (size_t)H * W;
    float p = 0.3f, scale = 1.0f / (1.0f - p);
    float *x = randn(n), *dy = randn(n), *y = scratch(n), *dx = scratch(n);
    for (size_t i = 0; i < n; i++) x[i] += x[i] >= 0 ? 0.01f : -0.01f; /* no exact zeros */
    rig r;
    rig_init(&r);
    td_tensor *tx = rig_leaf(&r, 0, "x", td_shape_4d(N, C, H, W), TD_F32, x), *ty = NULL;
    if (r.ok)
        RIG_CALL(&r,
                 two_d ? td_graph_dropout2d(r.g, tx, p, &ty) : td_graph_dropout(r.g, tx, p, &ty));
    if (r.ok) td_graph_set_training(r.g, training);
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        rig_grad(&r, tx, dx);
    }
    if (r.ok && !training) {
        check_close("dropout eval y", y, x, n, 0.0);
        check_close("dropout eval dx", dx, dy, n, 0.0);
    } else if (r.ok) {
        /* The graph draws the mask; recover it from y and hold y and dx to the reference. */
        size_t nm = two_d ? (size_t)N * C : n, kept = 0;
        uint8_t *mask = malloc(nm);
        for (size_t i = 0; i < nm; i++) {
            mask[i] = y[two_d ? i * plane : i] != 0.0f;
            kept += mask[i];
        }
        float *ry = scratch(n), *rdx = scratch(n);
        if (two_d) {
            td__ref_dropout2d_forward(ry, x, mask, scale, N, C, plane);
            td__ref_dropout2d_backward(rdx, dy, mask, scale, N, C, plane);
        } else {
            td__ref_dropout_forward(ry, x, mask, scale, n);
            td__ref_dropout_backward(rdx, dy, mask, scale, n);
        }
        check_close(two_d ? "dropout2d y" : "dropout y", y, ry, n, TOL);
        check_close(two_d ? "dropout2d dx" : "dropout dx", dx, rdx, n, TOL);
        /* about p of the draws are dropped (binomial: 4 sigma bounds) */
        double frac = 1.0 - (double)kept / nm, sd = sqrt(p * (1 - p) / nm);
        CHECK(fabs(frac - p) <= 4 * sd);
        free(mask), free(ry), free(rdx);
    }
    rig_free(&r);
    free(x), free(dy), free(y), free(dx);
}

static void dropout_matches_reference(void) {
    dropout_case(0, 1);
    dropout_case(1, 1);
    dropout_case(0, 0);
    dropout_case(1, 0);
}

/* ---- batch norm --------------------------------------------------------------------- */

static int graph_bn(int training, int N, int C, int H, int W, const float *x, const float *w,
                    const float *b, const float *rm, const float *rv, const float *dy, float *y,
                    float *rm_out, float *rv_out, float *dx, float *dw, float *db) {
    rig r;
    rig_init(&r);
    td_tensor *tx = rig_leaf(&r, 0, "x", td_shape_4d(N, C, H, W), TD_F32, x);
    td_tensor *tw = rig_leaf(&r, 1, "bn.weight", td_shape_1d(C), TD_F32, w);
    td_tensor *tb = rig_leaf(&r, 1, "bn.bias", td_shape_1d(C), TD_F32, b);
    td_tensor *tm = rig_leaf(&r, 2, "bn.running_mean", td_shape_1d(C), TD_F32, rm);
    td_tensor *tv = rig_leaf(&r, 2, "bn.running_var", td_shape_1d(C), TD_F32, rv);
    td_batch_norm_params p = td_batch_norm_default_params();
    td_tensor *ty = NULL;
    if (r.ok) RIG_CALL(&r, td_graph_batch_norm2d(r.g, tx, tw, tb, tm, tv, &p, &ty));
    if (r.ok) td_graph_set_training(r.g, training);
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        rig_read(&r, tm, rm_out);
        rig_read(&r, tv, rv_out);
        rig_grad(&r, tx, dx);
        rig_grad(&r, tw, dw);
        rig_grad(&r, tb, db);
    }
    return rig_done(&r);
}

static void batch_norm_matches_reference(void) {
    int N = 4, C = 3, H = 5, W = 6, HW = H * W;
    size_t n = (size_t)N * C * HW;
    for (int training = 1; training >= 0; training--) {
        float *x = randn(n), *w = randn(C), *b = randn(C), *rm = randn(C), *rv = scratch(C);
        float *dy = randn(n);
        for (size_t i = 0; i < n; i++) x[i] = 1.5f * x[i] + 0.3f;
        for (int c = 0; c < C; c++) rv[c] = 0.5f + td_rng_uniform(&rng);
        float *y = scratch(n), *dx = scratch(n), *dw = scratch(C), *db = scratch(C);
        float *rm_out = scratch(C), *rv_out = scratch(C);
        float *ry = scratch(n), *rdx = scratch(n), *rdw = scratch(C), *rdb = scratch(C);
        float *mean = scratch(C), *invstd = scratch(C), *rrm = scratch(C), *rrv = scratch(C);
        memcpy(rrm, rm, C * sizeof(float));
        memcpy(rrv, rv, C * sizeof(float));
        if (graph_bn(training, N, C, H, W, x, w, b, rm, rv, dy, y, rm_out, rv_out, dx, dw, db)) {
            if (training) {
                td__ref_batchnorm2d_forward_train(ry, mean, invstd, rrm, rrv, x, w, b, N, C, HW,
                                                  1e-5f, 0.1f);
                td__ref_batchnorm2d_backward_train(rdx, rdw, rdb, dy, x, w, mean, invstd, N, C, HW);
            } else {
                td__ref_batchnorm2d_forward_eval(ry, x, rm, rv, w, b, N, C, HW, 1e-5f);
                td__ref_batchnorm2d_backward_eval(rdx, rdw, rdb, dy, x, rm, rv, w, N, C, HW, 1e-5f);
            }
            check_close(training ? "bn train y" : "bn eval y", y, ry, n, TOL);
            check_close(training ? "bn train running_mean" : "bn eval running_mean", rm_out, rrm, C,
                        TOL); /* eval leaves them as they were */
            check_close(training ? "bn train running_var" : "bn eval running_var", rv_out, rrv, C,
                        TOL);
            check_close(training ? "bn train dx" : "bn eval dx", dx, rdx, n, TOL);
            check_close(training ? "bn train dweight" : "bn eval dweight", dw, rdw, C, TOL);
            check_close(training ? "bn train dbias" : "bn eval dbias", db, rdb, C, TOL);
        }
        free(x), free(w), free(b), free(rm), free(rv), free(dy), free(y), free(dx), free(dw);
        free(db), free(rm_out), free(rv_out), free(ry), free(rdx), free(rdw), free(rdb);
        free(mean), free(invstd), free(rrm), free(rrv);
    }
}

static void batch_norm_matches_pytorch(void) {
    for (int training = 1; training >= 0; training--) {
        fixture f;
        if (!load(&f, training ? "batch_norm2d_train" : "batch_norm2d_eval")) return;
        const fixture_array *x = fixture_get(&f, "x");
        int N = (int)x->shape[0], C = (int)x->shape[1], H = (int)x->shape[2];
        int W = (int)x->shape[3];
        float *y = scratch(x->count), *dx = scratch(x->count), *dw = scratch(C);
        float *db = scratch(C), *rm = scratch(C), *rv = scratch(C);
        if (graph_bn(training, N, C, H, W, x->data, fixture_f32(&f, "weight"),
                     fixture_f32(&f, "bias"), fixture_f32(&f, "running_mean"),
                     fixture_f32(&f, "running_var"), fixture_f32(&f, "dy"), y, rm, rv, dx, dw,
                     db)) {
            check_close("bn y", y, fixture_f32(&f, "y"), x->count, TOL);
            check_close("bn running_mean", rm, fixture_f32(&f, "running_mean_out"), C, TOL);
            check_close("bn running_var", rv, fixture_f32(&f, "running_var_out"), C, TOL);
            check_close("bn dx", dx, fixture_f32(&f, "dx"), x->count, TOL);
            check_close("bn dweight", dw, fixture_f32(&f, "dweight"), C, TOL);
            check_close("bn dbias", db, fixture_f32(&f, "dbias"), C, TOL);
        }
        free(y), free(dx), free(dw), free(db), free(rm), free(rv);
        fixture_free(&f);
    }
}

/* ---- add and concat ----------------------------------------------------------------- */

static void add_matches_reference(void) {
    size_t n = 2 * 3 * 4 * 5;
    float *a = randn(n), *b = randn(n), *dy = randn(n), *y = scratch(n), *da = scratch(n);
    float *db = scratch(n), *ry = scratch(n);
    rig r;
    rig_init(&r);
    td_shape s = td_shape_4d(2, 3, 4, 5);
    td_tensor *ta = rig_leaf(&r, 0, "a", s, TD_F32, a), *tb = rig_leaf(&r, 0, "b", s, TD_F32, b);
    td_tensor *ty = NULL;
    if (r.ok) RIG_CALL(&r, td_graph_add(r.g, ta, tb, &ty));
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        rig_grad(&r, ta, da);
        rig_grad(&r, tb, db);
    }
    if (r.ok) {
        td__ref_add_forward(ry, a, b, n);
        check_close("add y", y, ry, n, TOL);
        check_close("add da", da, dy, n, TOL);
        check_close("add db", db, dy, n, TOL);
    }
    rig_free(&r);
    free(a), free(b), free(dy), free(y), free(da), free(db), free(ry);
}

/* Residual sums of convolution outputs (which oneDNN may keep blocked) and a plain input, in
 * every pairing: s = conv(x, w1) + conv(x, w2), u = p + s, y = s + u, so y = 2 s + p, against
 * the reference kernels, whatever layouts the graph picked. */
static void add_of_blocked_layouts_matches_reference(void) {
    enum { N = 2, C = 3, H = 6, W = 6, OC = 16 };
    size_t nx = N * C * H * W, nw = OC * C * 9, ny = N * OC * H * W;
    float *x = randn(nx), *w1 = randn(nw), *w2 = randn(nw), *p = randn(ny), *dy = randn(ny);
    float *y = scratch(ny), *dx = scratch(nx), *dw1 = scratch(nw), *dw2 = scratch(nw);
    float *dp = scratch(ny), *ry = scratch(ny), *r2 = scratch(ny), *rdx = scratch(nx);
    float *rdx2 = scratch(nx), *rdw1 = scratch(nw), *rdw2 = scratch(nw), *dy2 = scratch(ny);
    rig r;
    rig_init(&r);
    td_tensor *tx = rig_leaf(&r, 0, "x", td_shape_4d(N, C, H, W), TD_F32, x);
    td_tensor *t1w = rig_leaf(&r, 1, "w1", td_shape_4d(OC, C, 3, 3), TD_F32, w1);
    td_tensor *t2w = rig_leaf(&r, 1, "w2", td_shape_4d(OC, C, 3, 3), TD_F32, w2);
    td_tensor *tp = rig_leaf(&r, 0, "p", td_shape_4d(N, OC, H, W), TD_F32, p);
    td_tensor *t1 = NULL, *t2 = NULL, *ts = NULL, *tu = NULL, *ty = NULL;
    td_conv2d_params cp = td_conv2d_default_params();
    cp.padding[0] = cp.padding[1] = 1;
    if (r.ok) RIG_CALL(&r, td_graph_conv2d(r.g, tx, t1w, NULL, &cp, &t1));
    if (r.ok) RIG_CALL(&r, td_graph_conv2d(r.g, tx, t2w, NULL, &cp, &t2));
    if (r.ok) RIG_CALL(&r, td_graph_add(r.g, t1, t2, &ts));
    if (r.ok) RIG_CALL(&r, td_graph_add(r.g, tp, ts, &tu));
    if (r.ok) RIG_CALL(&r, td_graph_add(r.g, ts, tu, &ty));
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        rig_grad(&r, tx, dx);
        rig_grad(&r, t1w, dw1);
        rig_grad(&r, t2w, dw2);
        rig_grad(&r, tp, dp);
    }
    if (r.ok) {
        td__ref_conv2d_dims d = {N, C, H, W, OC, 3, 3, 1, 1, 1, 1, 1, 1};
        td__ref_conv2d_forward(ry, x, w1, NULL, &d);
        td__ref_conv2d_forward(r2, x, w2, NULL, &d);
        for (size_t i = 0; i < ny; i++) ry[i] = 2 * (ry[i] + r2[i]) + p[i];
        for (size_t i = 0; i < ny; i++) dy2[i] = 2 * dy[i];
        td__ref_conv2d_backward(rdx, rdw1, NULL, dy2, x, w1, &d);
        td__ref_conv2d_backward(rdx2, rdw2, NULL, dy2, x, w2, &d);
        for (size_t i = 0; i < nx; i++) rdx[i] += rdx2[i];
        check_close("blocked add y", y, ry, ny, 1e-4);
        check_close("blocked add dx", dx, rdx, nx, 1e-4);
        check_close("blocked add dw1", dw1, rdw1, nw, 1e-4);
        check_close("blocked add dw2", dw2, rdw2, nw, 1e-4);
        check_close("blocked add dp", dp, dy, ny, TOL);
    }
    rig_free(&r);
    free(x), free(w1), free(w2), free(p), free(dy), free(y), free(dx), free(dw1), free(dw2);
    free(dp), free(ry), free(r2), free(rdx), free(rdx2), free(rdw1), free(rdw2), free(dy2);
}

/* Three inputs (N, C_k, H, W) concatenated on dim 1. */
static int graph_concat(int N, const int *C, int H, int W, const float *const *xs, const float *dy,
                        float *y, float *const *dxs) {
    rig r;
    rig_init(&r);
    td_tensor *t[3] = {NULL, NULL, NULL}, *ty = NULL;
    const char *names[3] = {"x0", "x1", "x2"};
    for (int j = 0; j < 3; j++)
        t[j] = rig_leaf(&r, 0, names[j], td_shape_4d(N, C[j], H, W), TD_F32, xs[j]);
    if (r.ok) RIG_CALL(&r, td_graph_concat(r.g, t, 3, &ty));
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        for (int j = 0; j < 3; j++) rig_grad(&r, t[j], dxs[j]);
    }
    return rig_done(&r);
}

static void concat_matches_reference_and_pytorch(void) {
    int N = 3, H = 4, W = 3, C[3] = {2, 5, 1};
    size_t inner = (size_t)H * W, ny = (size_t)N * 8 * inner;
    float *xs[3], *dxs[3], *rdxs[3];
    for (int j = 0; j < 3; j++) {
        xs[j] = randn((size_t)N * C[j] * inner);
        dxs[j] = scratch((size_t)N * C[j] * inner);
        rdxs[j] = scratch((size_t)N * C[j] * inner);
    }
    float *dy = randn(ny), *y = scratch(ny), *ry = scratch(ny);
    if (graph_concat(N, C, H, W, (const float *const *)xs, dy, y, dxs)) {
        td__ref_concat_forward(ry, (const float *const *)xs, C, 3, N, inner);
        td__ref_concat_backward(rdxs, dy, C, 3, N, inner);
        check_close("concat y", y, ry, ny, TOL);
        for (int j = 0; j < 3; j++)
            check_close("concat dx", dxs[j], rdxs[j], (size_t)N * C[j] * inner, TOL);
    }
    for (int j = 0; j < 3; j++) free(xs[j]), free(dxs[j]), free(rdxs[j]);
    free(dy), free(y), free(ry);

    fixture f;
    if (!load(&f, "concat")) return;
    const char *xn[3] = {"x0", "x1", "x2"}, *dn[3] = {"dx0", "dx1", "dx2"};
    const float *fx[3];
    int fc[3];
    const fixture_array *x0 = fixture_get(&f, "x0");
    for (int j = 0; j < 3; j++) {
        fx[j] = fixture_f32(&f, xn[j]);
        fc[j] = (int)fixture_get(&f, xn[j])->shape[1];
        dxs[j] = scratch(fixture_get(&f, xn[j])->count);
    }
    size_t fny = fixture_get(&f, "y")->count;
    float *fy = scratch(fny);
    if (graph_concat((int)x0->shape[0], fc, (int)x0->shape[2], (int)x0->shape[3], fx,
                     fixture_f32(&f, "dy"), fy, dxs)) {
        check_close("concat y", fy, fixture_f32(&f, "y"), fny, TOL);
        for (int j = 0; j < 3; j++)
            check_close(dn[j], dxs[j], fixture_f32(&f, dn[j]), fixture_get(&f, xn[j])->count, TOL);
    }
    for (int j = 0; j < 3; j++) free(dxs[j]);
    free(fy);
    fixture_free(&f);
}

/* ---- losses ------------------------------------------------------------------------- */

static int graph_loss(int ce, td_reduction red, int N, int C, const float *x, const int64_t *labels,
                      float dloss, float *loss, float *dx) {
    rig r;
    rig_init(&r);
    td_tensor *tx = rig_leaf(&r, 0, "x", td_shape_2d(N, C), TD_F32, x);
    td_tensor *tl = rig_leaf(&r, 3, "labels", td_shape_1d(N), TD_I64, labels), *ty = NULL;
    if (r.ok)
        RIG_CALL(&r, ce ? td_graph_cross_entropy(r.g, tx, tl, red, &ty, NULL)
                        : td_graph_nll_loss(r.g, tx, tl, red, &ty));
    if (ty) CHECK_EQ(td_tensor_numel(ty), 1);
    if (rig_run(&r, ty, &dloss)) {
        rig_read(&r, ty, loss);
        rig_grad(&r, tx, dx);
    }
    return rig_done(&r);
}

static void losses_match_reference(void) {
    int N = 7, C = 10;
    int64_t labels[7];
    for (int i = 0; i < N; i++) labels[i] = td_rng_below(&rng, C);
    for (int ce = 0; ce < 2; ce++)
        for (int red = 0; red < 2; red++) {
            float *x = randn(N * C), *dx = scratch(N * C), *rdx = scratch(N * C);
            float loss = 0.0f, rloss = 0.0f, dloss = 0.5f + td_rng_uniform(&rng);
            if (!ce) td__ref_log_softmax_forward(x, x, N, C);
            if (graph_loss(ce, (td_reduction)red, N, C, x, labels, dloss, &loss, dx)) {
                td__ref_reduction rr = red ? TD__REF_SUM : TD__REF_MEAN;
                if (ce) {
                    CHECK_OK(td__ref_cross_entropy_forward(&rloss, x, labels, N, C, rr, -100));
                    CHECK_OK(td__ref_cross_entropy_backward(rdx, dloss, x, labels, N, C, rr, -100));
                } else {
                    CHECK_OK(td__ref_nll_loss_forward(&rloss, x, labels, N, C, rr, -100));
                    CHECK_OK(td__ref_nll_loss_backward(rdx, dloss, labels, N, C, rr, -100));
                }
                const char *m = ce ? "cross_entropy" : "nll_loss";
                check_close(m, &loss, &rloss, 1, TOL);
                check_close(m, dx, rdx, N * C, TOL);
            }
            free(x), free(dx), free(rdx);
        }
}

static void losses_match_pytorch(void) {
    const char *names[4] = {"nll_loss_mean", "nll_loss_sum", "cross_entropy_mean",
                            "cross_entropy_sum"};
    for (int k = 0; k < 4; k++) {
        fixture f;
        if (!load(&f, names[k])) return;
        const fixture_array *x = fixture_get(&f, "x");
        int N = (int)x->shape[0], C = (int)x->shape[1];
        float loss = 0.0f, *dx = scratch(x->count);
        td_reduction red = (td_reduction)(int)fixture_attr(&f, "reduction", 0);
        if (graph_loss(k >= 2, red, N, C, x->data, fixture_get(&f, "labels")->data,
                       fixture_f32(&f, "dy")[0], &loss, dx)) {
            check_close(names[k], &loss, fixture_f32(&f, "y"), 1, TOL);
            check_close(names[k], dx, fixture_f32(&f, "dx"), x->count, TOL);
        }
        free(dx);
        fixture_free(&f);
    }
}

/* A label outside [0, C) is an error from forward, not a read out of bounds. (The graph
 * API has no ignore_index, so PyTorch's -100 is one of these too.) */
static void losses_reject_bad_labels(void) {
    int N = 3, C = 4;
    int64_t bad[3][3] = {{0, 4, 1}, {-1, 0, 0}, {2, 1, -100}};
    float x[12] = {0};
    for (int ce = 0; ce < 2; ce++)
        for (int k = 0; k < 3; k++) {
            td_graph *g = NULL;
            td_tensor *tx = NULL, *tl = NULL, *ty = NULL;
            CHECK_OK(td_graph_create(&g, NULL));
            if (!g) return;
            CHECK_OK(td_graph_input(g, "x", td_shape_2d(N, C), TD_F32, 1, &tx));
            CHECK_OK(td_graph_input(g, "labels", td_shape_1d(N), TD_I64, 0, &tl));
            if (tx && tl)
                CHECK_OK(ce ? td_graph_cross_entropy(g, tx, tl, TD_REDUCTION_MEAN, &ty, NULL)
                            : td_graph_nll_loss(g, tx, tl, TD_REDUCTION_MEAN, &ty));
            if (ty) {
                CHECK_OK(td_graph_compile(g));
                CHECK_OK(td_tensor_write(tx, x));
                CHECK_OK(td_tensor_write(tl, bad[k]));
                CHECK_STATUS(td_graph_forward(g), TD_EINVAL);
                CHECK(strstr(td_last_error(), "label") != NULL);
            }
            td_graph_destroy(g);
        }
}

/* ---- a small network: the ops chained, so activations pass between primitives in
 * whatever layouts the engine picks (16 channels invite blocked ones) ------------------- */

static void chain_matches_reference(void) {
    enum { N = 2, C0 = 3, H = 10, W = 10, C1 = 16, HP = 5, K = 10, FIN = C1 * HP * HP };
    const size_t n0 = N * C0 * H * W, n1 = N * C1 * H * W, n5 = N * FIN;
    td__ref_conv2d_dims cd1 = {N, C0, H, W, C1, 3, 3, 1, 1, 1, 1, 1, 1};
    td__ref_conv2d_dims cd2 = {N, C1, H, W, C1, 3, 3, 1, 1, 1, 1, 1, 1};
    td__ref_pool2d_dims pd = {N, C1, H, W, 2, 2, 2, 2, 0, 0};
    float *x = randn(n0), *w1 = randn(C1 * C0 * 9), *b1 = randn(C1), *g = randn(C1);
    float *be = randn(C1), *w2 = randn(C1 * C1 * 9), *b2 = randn(C1), *wf = randn(K * FIN);
    float *bf = randn(K), *rm = scratch(C1), *rv = scratch(C1);
    int64_t labels[N] = {3, 7};
    for (int c = 0; c < C1; c++) rv[c] = 1.0f;
    for (size_t i = 0; i < (size_t)C1 * C1 * 9; i++) w2[i] *= 0.2f;
    for (size_t i = 0; i < (size_t)K * FIN; i++) wf[i] *= 0.05f;

    /* the reference forward and backward, step by step */
    float *y1 = scratch(n1), *y2 = scratch(n1), *y3 = scratch(n1), *y4 = scratch(n1);
    float *y5 = scratch(n5), *y6 = scratch(N * K), loss = 0.0f;
    float *mean = scratch(C1), *invstd = scratch(C1), *rrm = scratch(C1), *rrv = scratch(C1);
    memcpy(rrv, rv, C1 * sizeof(float));
    td__ref_conv2d_forward(y1, x, w1, b1, &cd1);
    td__ref_batchnorm2d_forward_train(y2, mean, invstd, rrm, rrv, y1, g, be, N, C1, H * W, 1e-5f,
                                      0.1f);
    td__ref_relu_forward(y3, y2, n1);
    td__ref_conv2d_forward(y4, y3, w2, b2, &cd2);
    td__ref_maxpool2d_forward(y5, NULL, y4, &pd);
    td__ref_linear_forward(y6, y5, wf, bf, N, FIN, K);
    CHECK_OK(td__ref_cross_entropy_forward(&loss, y6, labels, N, K, TD__REF_MEAN, -100));
    float *d6 = scratch(N * K), *d5 = scratch(n5), *d4 = scratch(n1), *d3 = scratch(n1);
    float *d2 = scratch(n1), *d1 = scratch(n1), *dx = scratch(n0);
    float *dwf = scratch(K * FIN), *dbf = scratch(K), *dw2 = scratch(C1 * C1 * 9);
    float *db2 = scratch(C1), *dg = scratch(C1), *dbe = scratch(C1);
    float *dw1 = scratch(C1 * C0 * 9), *db1 = scratch(C1);
    CHECK_OK(td__ref_cross_entropy_backward(d6, 1.0f, y6, labels, N, K, TD__REF_MEAN, -100));
    td__ref_linear_backward(d5, dwf, dbf, d6, y5, wf, N, FIN, K);
    td__ref_maxpool2d_backward(d4, d5, y4, &pd);
    td__ref_conv2d_backward(d3, dw2, db2, d4, y3, w2, &cd2);
    td__ref_relu_backward(d2, d3, y2, n1);
    td__ref_batchnorm2d_backward_train(d1, dg, dbe, d2, y1, g, mean, invstd, N, C1, H * W);
    td__ref_conv2d_backward(dx, dw1, db1, d1, x, w1, &cd1);

    /* the same network through the graph */
    rig r;
    rig_init(&r);
    td_tensor *tx = rig_leaf(&r, 0, "x", td_shape_4d(N, C0, H, W), TD_F32, x);
    td_tensor *tl = rig_leaf(&r, 3, "labels", td_shape_1d(N), TD_I64, labels);
    td_tensor *tw1 = rig_leaf(&r, 1, "c1.weight", td_shape_4d(C1, C0, 3, 3), TD_F32, w1);
    td_tensor *tb1 = rig_leaf(&r, 1, "c1.bias", td_shape_1d(C1), TD_F32, b1);
    td_tensor *tg = rig_leaf(&r, 1, "bn.weight", td_shape_1d(C1), TD_F32, g);
    td_tensor *tbe = rig_leaf(&r, 1, "bn.bias", td_shape_1d(C1), TD_F32, be);
    td_tensor *tm = rig_leaf(&r, 2, "bn.running_mean", td_shape_1d(C1), TD_F32, rm);
    td_tensor *tv = rig_leaf(&r, 2, "bn.running_var", td_shape_1d(C1), TD_F32, rv);
    td_tensor *tw2 = rig_leaf(&r, 1, "c2.weight", td_shape_4d(C1, C1, 3, 3), TD_F32, w2);
    td_tensor *tb2 = rig_leaf(&r, 1, "c2.bias", td_shape_1d(C1), TD_F32, b2);
    td_tensor *twf = rig_leaf(&r, 1, "fc.weight", td_shape_2d(K, FIN), TD_F32, wf);
    td_tensor *tbf = rig_leaf(&r, 1, "fc.bias", td_shape_1d(K), TD_F32, bf);
    td_tensor *t1 = NULL, *t2 = NULL, *t3 = NULL, *t4 = NULL, *t5 = NULL, *tflat = NULL;
    td_tensor *t6 = NULL, *tloss = NULL;
    td_conv2d_params cp = td_conv2d_default_params();
    cp.padding[0] = cp.padding[1] = 1;
    td_pool2d_params pp = td_pool2d_default_params();
    td_batch_norm_params bp = td_batch_norm_default_params();
    if (r.ok) RIG_CALL(&r, td_graph_conv2d(r.g, tx, tw1, tb1, &cp, &t1));
    if (r.ok) RIG_CALL(&r, td_graph_batch_norm2d(r.g, t1, tg, tbe, tm, tv, &bp, &t2));
    if (r.ok) RIG_CALL(&r, td_graph_relu(r.g, t2, &t3));
    if (r.ok) RIG_CALL(&r, td_graph_conv2d(r.g, t3, tw2, tb2, &cp, &t4));
    if (r.ok) RIG_CALL(&r, td_graph_max_pool2d(r.g, t4, &pp, &t5));
    if (r.ok) RIG_CALL(&r, td_graph_flatten(r.g, t5, 1, &tflat));
    if (r.ok) RIG_CALL(&r, td_graph_linear(r.g, tflat, twf, tbf, &t6));
    if (r.ok) RIG_CALL(&r, td_graph_cross_entropy(r.g, t6, tl, TD_REDUCTION_MEAN, &tloss, NULL));
    if (rig_run(&r, tloss, &(float){1.0f})) {
        float gl = 0.0f, *g6 = scratch(N * K), *gx = scratch(n0), *gw1 = scratch(C1 * C0 * 9);
        float *gb1 = scratch(C1), *gg = scratch(C1), *gbe = scratch(C1);
        float *gw2 = scratch(C1 * C1 * 9), *gb2 = scratch(C1), *gwf = scratch(K * FIN);
        float *gbf = scratch(K), *grm = scratch(C1), *grv = scratch(C1);
        rig_read(&r, tloss, &gl);
        rig_read(&r, t6, g6);
        rig_read(&r, tm, grm);
        rig_read(&r, tv, grv);
        rig_grad(&r, tx, gx);
        rig_grad(&r, tw1, gw1);
        rig_grad(&r, tb1, gb1);
        rig_grad(&r, tg, gg);
        rig_grad(&r, tbe, gbe);
        rig_grad(&r, tw2, gw2);
        rig_grad(&r, tb2, gb2);
        rig_grad(&r, twf, gwf);
        rig_grad(&r, tbf, gbf);
        if (r.ok) {
            check_close("chain logits", g6, y6, N * K, TOL);
            check_close("chain loss", &gl, &loss, 1, TOL);
            check_close("chain running_mean", grm, rrm, C1, TOL);
            check_close("chain running_var", grv, rrv, C1, TOL);
            check_close("chain dx", gx, dx, n0, TOL);
            check_close("chain c1.weight", gw1, dw1, C1 * C0 * 9, TOL);
            check_close("chain c1.bias", gb1, db1, C1, TOL);
            check_close("chain bn.weight", gg, dg, C1, TOL);
            check_close("chain bn.bias", gbe, dbe, C1, TOL);
            check_close("chain c2.weight", gw2, dw2, C1 * C1 * 9, TOL);
            check_close("chain c2.bias", gb2, db2, C1, TOL);
            check_close("chain fc.weight", gwf, dwf, K * FIN, TOL);
            check_close("chain fc.bias", gbf, dbf, K, TOL);
        }
        free(g6), free(gx), free(gw1), free(gb1), free(gg), free(gbe), free(gw2), free(gb2);
        free(gwf), free(gbf), free(grm), free(grv);
    }
    rig_free(&r);
    free(x), free(w1), free(b1), free(g), free(be), free(w2), free(b2), free(wf), free(bf);
    free(rm), free(rv), free(y1), free(y2), free(y3), free(y4), free(y5), free(y6);
    free(mean), free(invstd), free(rrm), free(rrv), free(d6), free(d5), free(d4), free(d3);
    free(d2), free(d1), free(dx), free(dwf), free(dbf), free(dw2), free(db2), free(dg);
    free(dbe), free(dw1), free(db1);
}

int main(void) {
    td_rng_init(&rng, 20261122);
    RUN(linear_matches_reference);
    RUN(linear_matches_pytorch);
    RUN(conv2d_matches_reference);
    RUN(conv2d_matches_pytorch);
    RUN(pooling_matches_reference);
    RUN(pooling_matches_pytorch);
    RUN(max_pool_padding_never_wins);
    RUN(max_pool_ties_match_pytorch);
    RUN(unary_ops_match_reference);
    RUN(unary_ops_match_pytorch);
    RUN(dropout_matches_reference);
    RUN(batch_norm_matches_reference);
    RUN(batch_norm_matches_pytorch);
    RUN(add_matches_reference);
    RUN(add_of_blocked_layouts_matches_reference);
    RUN(concat_matches_reference_and_pytorch);
    RUN(losses_match_reference);
    RUN(losses_match_pytorch);
    RUN(losses_reject_bad_labels);
    RUN(chain_matches_reference);
    TEST_END();
}
