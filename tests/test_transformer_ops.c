/* The transformer's ops (docs/gpt.md) against the reference kernels and the PyTorch fixtures:
 * token and position embeddings, layer norm, causal self-attention and the tanh GELU, each a
 * one-op graph run forward and backward_from a random upstream gradient (test_op_rig.h). Also
 * what GPT-2 needs of them beyond one op: a table read by an embedding and by a linear (the
 * tied output projection) gets the sum of both gradients; attention at lengths that span several
 * of its row blocks; token ids as f32; bad ids and shapes are errors naming the problem; a ReLU
 * after attention leaves attention's output (which its GPU backward reads) intact; and the
 * mixed-precision rules (layer norm in f32, attention's output in the low dtype, values close to
 * f32's) in bf16 and f16. Tolerance TOL (1 + |want|) as test_ops.c. */
#include "ops/ref/ref.h"
#include "test_op_rig.h"

/* ---- tanh GELU ------------------------------------------------------------------------ */

static int graph_gelu_tanh(td_shape s, const float *x, const float *dy, float *y, float *dx) {
    rig r;
    rig_init(&r);
    td_tensor *tx = rig_leaf(&r, 0, "x", s, TD_F32, x), *ty = NULL;
    if (r.ok) RIG_CALL(&r, td_graph_gelu_tanh(r.g, tx, &ty));
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        rig_grad(&r, tx, dx);
    }
    return rig_done(&r);
}

static void gelu_tanh_matches_reference_and_pytorch(void) {
    size_t n = 2 * 3 * 7;
    float *x = randn(n), *dy = randn(n), *y = scratch(n), *dx = scratch(n);
    float *ry = scratch(n), *rdx = scratch(n);
    for (size_t i = 0; i < n; i++) x[i] *= 3.0f;
    if (graph_gelu_tanh(td_shape_3d(2, 3, 7), x, dy, y, dx)) {
        td__ref_gelu_tanh_forward(ry, x, n);
        td__ref_gelu_tanh_backward(rdx, dy, x, n);
        check_close("gelu_tanh y", y, ry, n, TOL);
        check_close("gelu_tanh dx", dx, rdx, n, TOL);
        /* the erf form differs by up to ~1e-3: the test tells them apart */
        td__ref_gelu_forward(ry, x, n);
        double diff = 0;
        for (size_t i = 0; i < n; i++) diff = fmax(diff, fabs(ry[i] - y[i]));
        CHECK(diff > 1e-4);
    }
    free(x), free(dy), free(y), free(dx), free(ry), free(rdx);
    fixture f;
    if (!load(&f, "gelu_tanh")) return;
    const fixture_array *fx = fixture_get(&f, "x");
    float *gy = scratch(fx->count), *gdx = scratch(fx->count);
    if (graph_gelu_tanh(td_shape_make(fx->ndim, fx->shape), fx->data, fixture_f32(&f, "dy"), gy,
                        gdx)) {
        check_close("gelu_tanh y vs PyTorch", gy, fixture_f32(&f, "y"), fx->count, TOL);
        check_close("gelu_tanh dx vs PyTorch", gdx, fixture_f32(&f, "dx"), fx->count, TOL);
    }
    free(gy), free(gdx);
    fixture_free(&f);
}

/* ---- layer norm ----------------------------------------------------------------------- */

static int graph_layer_norm(td_shape s, const float *x, const float *w, const float *b,
                            const float *dy, float *y, float *dx, float *dw, float *db) {
    int64_t C = s.dim[s.ndim - 1];
    rig r;
    rig_init(&r);
    td_tensor *tx = rig_leaf(&r, 0, "x", s, TD_F32, x), *ty = NULL;
    td_tensor *tw = w ? rig_leaf(&r, 1, "ln.weight", td_shape_1d(C), TD_F32, w) : NULL;
    td_tensor *tb = b ? rig_leaf(&r, 1, "ln.bias", td_shape_1d(C), TD_F32, b) : NULL;
    if (r.ok) RIG_CALL(&r, td_graph_layer_norm(r.g, tx, tw, tb, 1e-5f, &ty));
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        rig_grad(&r, tx, dx);
        if (w) rig_grad(&r, tw, dw);
        if (b) rig_grad(&r, tb, db);
    }
    return rig_done(&r);
}

static void layer_norm_matches_reference(void) {
    const int rows = 12, C = 33;
    size_t n = (size_t)rows * C;
    for (int affine = 0; affine < 2; affine++) {
        float *x = randn(n), *dy = randn(n), *w = randn(C), *b = randn(C);
        for (size_t i = 0; i < n; i++) x[i] = 3.0f * x[i] + 1.0f;
        float *y = scratch(n), *dx = scratch(n), *dw = scratch(C), *db = scratch(C);
        float *ry = scratch(n), *rdx = scratch(n), *rdw = scratch(C), *rdb = scratch(C);
        const float *pw = affine ? w : NULL, *pb = affine ? b : NULL;
        if (graph_layer_norm(td_shape_3d(3, 4, C), x, pw, pb, dy, y, dx, dw, db)) {
            td__ref_layer_norm_forward(ry, NULL, NULL, x, pw, pb, rows, C, 1e-5f);
            td__ref_layer_norm_backward(rdx, rdw, rdb, dy, x, pw, rows, C, 1e-5f);
            check_close("layer_norm y", y, ry, n, TOL);
            check_close("layer_norm dx", dx, rdx, n, TOL);
            if (affine) {
                check_close("layer_norm dweight", dw, rdw, C, TOL);
                check_close("layer_norm dbias", db, rdb, C, TOL);
            }
        }
        free(x), free(dy), free(w), free(b), free(y), free(dx), free(dw), free(db);
        free(ry), free(rdx), free(rdw), free(rdb);
    }
}

static void layer_norm_matches_pytorch(void) {
    fixture f;
    if (!load(&f, "layer_norm")) return;
    const fixture_array *x = fixture_get(&f, "x");
    int64_t C = x->shape[x->ndim - 1];
    float *y = scratch(x->count), *dx = scratch(x->count), *dw = scratch(C), *db = scratch(C);
    if (graph_layer_norm(td_shape_make(x->ndim, x->shape), x->data, fixture_f32(&f, "weight"),
                         fixture_f32(&f, "bias"), fixture_f32(&f, "dy"), y, dx, dw, db)) {
        check_close("layer_norm y", y, fixture_f32(&f, "y"), x->count, TOL);
        check_close("layer_norm dx", dx, fixture_f32(&f, "dx"), x->count, TOL);
        check_close("layer_norm dweight", dw, fixture_f32(&f, "dweight"), C, TOL);
        check_close("layer_norm dbias", db, fixture_f32(&f, "dbias"), C, TOL);
    }
    free(y), free(dx), free(dw), free(db);
    fixture_free(&f);
}

/* ---- embeddings ----------------------------------------------------------------------- */

/* Token embedding of idx (S, T) from wte (V, C), then wpe (>= T, C) added by position:
 * tok and y (S, T, C), the tables' gradients. ids_f32: the ids as an f32 input. */
static int graph_embedding(int S, int T, int V, int P, int C, const int64_t *idx, int ids_f32,
                           const float *wte, const float *wpe, const float *dy, float *tok,
                           float *y, float *dwte, float *dwpe) {
    rig r;
    rig_init(&r);
    float *fid = malloc((size_t)S * T * sizeof *fid);
    for (int i = 0; i < S * T; i++) fid[i] = (float)idx[i];
    td_tensor *ti = rig_leaf(&r, 3, "idx", td_shape_2d(S, T), ids_f32 ? TD_F32 : TD_I64,
                             ids_f32 ? (const void *)fid : (const void *)idx);
    td_tensor *tw = rig_leaf(&r, 1, "wte.weight", td_shape_2d(V, C), TD_F32, wte);
    td_tensor *tp = rig_leaf(&r, 1, "wpe.weight", td_shape_2d(P, C), TD_F32, wpe);
    td_tensor *tt = NULL, *ty = NULL;
    if (r.ok) RIG_CALL(&r, td_graph_embedding(r.g, ti, tw, &tt));
    if (r.ok) RIG_CALL(&r, td_graph_position_embedding(r.g, tt, tp, &ty));
    if (r.ok) {
        td_shape s = td_tensor_shape(ty);
        CHECK(s.ndim == 3 && s.dim[0] == S && s.dim[1] == T && s.dim[2] == C);
    }
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, tt, tok);
        rig_read(&r, ty, y);
        rig_grad(&r, tw, dwte);
        rig_grad(&r, tp, dwpe);
    }
    free(fid);
    return rig_done(&r);
}

static void embedding_matches_reference(void) {
    const int S = 3, T = 6, V = 11, P = 8, C = 5;
    size_t n = (size_t)S * T;
    int64_t idx[3 * 6];
    for (size_t i = 0; i < n; i++) idx[i] = (int64_t)((i * 7 + 3) % 5); /* repeats: adds */
    idx[4] = V - 1;
    float *wte = randn((size_t)V * C), *wpe = randn((size_t)P * C), *dy = randn(n * C);
    for (int ids_f32 = 0; ids_f32 < 2; ids_f32++) {
        float *tok = scratch(n * C), *y = scratch(n * C), *dwte = scratch((size_t)V * C);
        float *dwpe = scratch((size_t)P * C), *rtok = scratch(n * C), *ry = scratch(n * C);
        float *rdwte = scratch((size_t)V * C), *rdwpe = scratch((size_t)P * C);
        if (graph_embedding(S, T, V, P, C, idx, ids_f32, wte, wpe, dy, tok, y, dwte, dwpe)) {
            td__ref_embedding_forward(rtok, idx, wte, n, C);
            td__ref_position_embedding_forward(ry, rtok, wpe, S, T, C);
            td__ref_embedding_backward(rdwte, dy, idx, n, V, C);
            td__ref_position_embedding_backward(rdwpe, dy, S, T, C);
            check_close("embedding", tok, rtok, n * C, TOL);
            check_close("position embedding", y, ry, n * C, TOL);
            check_close("embedding dweight", dwte, rdwte, (size_t)V * C, TOL);
            /* rows past T of the position table get nothing */
            check_close("position embedding dweight", dwpe, rdwpe, (size_t)T * C, TOL);
            for (size_t i = (size_t)T * C; i < (size_t)P * C; i++) CHECK(dwpe[i] == 0.0f);
        }
        free(tok), free(y), free(dwte), free(dwpe), free(rtok), free(ry), free(rdwte);
        free(rdwpe);
    }
    free(wte), free(wpe), free(dy);
}

static void embedding_matches_pytorch(void) {
    fixture f;
    if (!load(&f, "embedding")) return;
    const fixture_array *idx = fixture_get(&f, "idx"), *w = fixture_get(&f, "weight");
    const fixture_array *p = fixture_get(&f, "pos_weight"), *y = fixture_get(&f, "y");
    int S = (int)idx->shape[0], T = (int)idx->shape[1], V = (int)w->shape[0];
    int P = (int)p->shape[0], C = (int)w->shape[1];
    float *tok = scratch(y->count), *gy = scratch(y->count), *dw = scratch(w->count);
    float *dp = scratch(p->count);
    if (graph_embedding(S, T, V, P, C, idx->data, 0, w->data, p->data, fixture_f32(&f, "dy"), tok,
                        gy, dw, dp)) {
        check_close("embedding vs PyTorch", tok, fixture_f32(&f, "tok"), y->count, TOL);
        check_close("position embedding vs PyTorch", gy, fixture_f32(&f, "y"), y->count, TOL);
        check_close("embedding dweight vs PyTorch", dw, fixture_f32(&f, "dweight"), w->count, TOL);
        check_close("position embedding dweight vs PyTorch", dp, fixture_f32(&f, "dpos_weight"),
                    p->count, TOL);
    }
    free(tok), free(gy), free(dw), free(dp);
    fixture_free(&f);
}

/* GPT-2's tied output projection: logits = embedding(idx) W^T with W the same table. */
static void tied_table_gets_both_gradients(void) {
    const int N = 6, V = 9, C = 4;
    int64_t idx[6] = {1, 4, 4, 0, 8, 1};
    float *w = randn((size_t)V * C), *dy = randn((size_t)N * V);
    float *dw = scratch((size_t)V * C), *x = scratch((size_t)N * C), *dx = scratch((size_t)N * C);
    float *lin_dw = scratch((size_t)V * C), *emb_dw = scratch((size_t)V * C);
    rig r;
    rig_init(&r);
    td_tensor *ti = rig_leaf(&r, 3, "idx", td_shape_1d(N), TD_I64, idx);
    td_tensor *tw = rig_leaf(&r, 1, "wte.weight", td_shape_2d(V, C), TD_F32, w);
    td_tensor *te = NULL, *ty = NULL;
    if (r.ok) RIG_CALL(&r, td_graph_embedding(r.g, ti, tw, &te));
    if (r.ok) RIG_CALL(&r, td_graph_linear(r.g, te, tw, NULL, &ty));
    if (rig_run(&r, ty, dy)) {
        rig_grad(&r, tw, dw);
        td__ref_embedding_forward(x, idx, w, N, C);
        td__ref_linear_backward(dx, lin_dw, NULL, dy, x, w, N, C, V);
        td__ref_embedding_backward(emb_dw, dx, idx, N, V, C);
        for (int i = 0; i < V * C; i++) lin_dw[i] += emb_dw[i];
        check_close("tied weight gradient", dw, lin_dw, (size_t)V * C, TOL);
    }
    rig_done(&r);
    free(w), free(dy), free(dw), free(x), free(dx), free(lin_dw), free(emb_dw);
}

static void embedding_rejects_bad_ids(void) {
    for (int k = 0; k < 3; k++) {
        td_graph *g;
        td_tensor *idx, *w, *y;
        CHECK_OK(td_graph_create(&g, NULL));
        CHECK_OK(td_graph_input(g, "idx", td_shape_1d(3), k ? TD_F32 : TD_I64, 0, &idx));
        CHECK_OK(td_graph_param(g, "wte.weight", td_shape_2d(5, 2), &w));
        CHECK_OK(td_graph_embedding(g, idx, w, &y));
        CHECK_OK(td_graph_compile(g));
        int64_t bad_i[3] = {0, 5, 1};
        float bad_f[2][3] = {{0, 1.5f, 2}, {0, 1, -1}};
        CHECK_OK(td_tensor_write(idx, k ? (const void *)bad_f[k - 1] : (const void *)bad_i));
        CHECK_STATUS(td_graph_forward(g), TD_EINVAL);
        const char *want = k == 1   ? "token 1 of 'idx' is 1.5, not a whole number"
                           : k == 2 ? "token 2 of 'idx' is -1, outside [0, 5)"
                                    : "token 1 of 'idx' is 5, outside [0, 5)";
        if (!strstr(td_last_error(), want))
            TEST_FAIL_AT("error '%s' does not say '%s'", td_last_error(), want);
        td_graph_destroy(g);
    }
    td_graph *g;
    td_tensor *x, *w, *y;
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_graph_input(g, "x", td_shape_3d(2, 9, 4), TD_F32, 0, &x));
    CHECK_OK(td_graph_param(g, "wpe.weight", td_shape_2d(8, 4), &w));
    CHECK_STATUS(td_graph_position_embedding(g, x, w, &y), TD_ESHAPE); /* 9 > 8 positions */
    td_graph_destroy(g);
}

/* ---- attention ------------------------------------------------------------------------ */

static int graph_attention(int B, int T, int C, int NH, int flat, const float *qkv, const float *dy,
                           float *y, float *dqkv) {
    rig r;
    rig_init(&r);
    td_shape s = flat ? td_shape_2d((int64_t)B * T, 3 * C) : td_shape_3d(B, T, 3 * C);
    td_tensor *tx = rig_leaf(&r, 0, "qkv", s, TD_F32, qkv), *ty = NULL;
    if (r.ok) RIG_CALL(&r, td_graph_causal_attention(r.g, tx, NH, flat ? T : 0, &ty));
    if (rig_run(&r, ty, dy)) {
        rig_read(&r, ty, y);
        rig_grad(&r, tx, dqkv);
    }
    return rig_done(&r);
}

static void attention_matches_reference(void) {
    /* T = 70 spans two row blocks of 64; T = 1 is a single key */
    const int cases[][4] = {{2, 5, 8, 2}, {2, 70, 12, 3}, {3, 1, 4, 1}, {1, 130, 8, 1}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int B = cases[c][0], T = cases[c][1], C = cases[c][2], NH = cases[c][3];
        size_t nx = (size_t)B * T * 3 * C, ny = (size_t)B * T * C;
        float *x = randn(nx), *dy = randn(ny), *y = scratch(ny), *dx = scratch(nx);
        float *ry = scratch(ny), *rdx = scratch(nx);
        td__ref_attention_forward(ry, x, B, T, C, NH);
        td__ref_attention_backward(rdx, dy, x, B, T, C, NH);
        for (int flat = 0; flat < 2; flat++)
            if (graph_attention(B, T, C, NH, flat, x, dy, y, dx)) {
                check_close("attention y", y, ry, ny, TOL);
                check_close("attention dqkv", dx, rdx, nx, TOL);
            }
        free(x), free(dy), free(y), free(dx), free(ry), free(rdx);
    }
}

static void attention_matches_pytorch(void) {
    fixture f;
    if (!load(&f, "attention")) return;
    const fixture_array *x = fixture_get(&f, "qkv"), *y = fixture_get(&f, "y");
    int B = (int)x->shape[0], T = (int)x->shape[1], C = (int)y->shape[2];
    int NH = (int)fixture_attr(&f, "heads", 1);
    float *gy = scratch(y->count), *dx = scratch(x->count);
    if (graph_attention(B, T, C, NH, 0, x->data, fixture_f32(&f, "dy"), gy, dx)) {
        check_close("attention y vs PyTorch", gy, fixture_f32(&f, "y"), y->count, TOL);
        check_close("attention dqkv vs PyTorch", dx, fixture_f32(&f, "dqkv"), x->count, TOL);
    }
    free(gy), free(dx);
    fixture_free(&f);
}

static void attention_rejects_bad_shapes(void) {
    td_graph *g;
    td_tensor *x, *y;
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_graph_input(g, "qkv", td_shape_2d(10, 24), TD_F32, 1, &x));
    CHECK_STATUS(td_graph_causal_attention(g, x, 3, 5, &y), TD_ESHAPE); /* C 8, 3 heads */
    CHECK(strstr(td_last_error(), "24 wide") != NULL);
    CHECK_STATUS(td_graph_causal_attention(g, x, 2, 4, &y), TD_ESHAPE); /* 10 rows, T 4 */
    CHECK(strstr(td_last_error(), "not whole sequences of 4") != NULL);
    CHECK_OK(td_graph_causal_attention(g, x, 2, 5, &y));
    td_graph_destroy(g);
}

/* A ReLU after attention writes its own output instead of overwriting attention's in place:
 * attention's backward on a GPU reads that output (src/ops/cuda/attention.cu). */
static void attention_output_survives_a_relu(void) {
    const int B = 1, T = 6, C = 4, NH = 2;
    size_t nx = (size_t)B * T * 3 * C, ny = (size_t)B * T * C;
    float *x = randn(nx), *y = scratch(ny), *ry = scratch(ny);
    td__ref_attention_forward(ry, x, B, T, C, NH);
    int negative = 0;
    for (size_t i = 0; i < ny; i++) negative += ry[i] < 0.f;
    CHECK(negative > 0);
    td_graph *g;
    td_tensor *tx, *ty, *tr;
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_graph_input(g, "qkv", td_shape_2d((int64_t)B * T, 3 * C), TD_F32, 1, &tx));
    CHECK_OK(td_graph_causal_attention(g, tx, NH, T, &ty));
    CHECK_OK(td_graph_relu(g, ty, &tr));
    CHECK_OK(td_graph_compile(g));
    CHECK_OK(td_tensor_write(tx, x));
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_tensor_read(ty, y));
    check_close("attention y under its ReLU", y, ry, ny, TOL);
    td_graph_destroy(g);
    free(x), free(y), free(ry);
}

/* ---- mixed precision ------------------------------------------------------------------ */

/* At O1, layer norm computes and hands on f32, attention hands on the low dtype, and the values
 * stay within the low dtype's rounding of f32's. */
static void mixed_precision_rules(void) {
    const int B = 2, T = 9, C = 8, NH = 2;
    size_t nx = (size_t)B * T * 3 * C, ny = (size_t)B * T * C;
    float *x = randn(nx), *dy = randn(ny), *y = scratch(ny), *dx = scratch(nx);
    float *ry = scratch(ny), *rdx = scratch(nx), *ln = scratch(nx), *rln = scratch(nx);
    td__ref_attention_forward(ry, x, B, T, C, NH);
    td__ref_attention_backward(rdx, dy, x, B, T, C, NH);
    td__ref_layer_norm_forward(rln, NULL, NULL, x, NULL, NULL, (size_t)B * T, 3 * C, 1e-5f);
    const td_dtype lows[2] = {TD_BF16, TD_F16};
    for (int k = 0; k < 2; k++) {
        td_graph_params gp = td_graph_default_params();
        gp.amp.level = TD_AMP_O1;
        gp.amp.dtype = lows[k];
        td_graph *g;
        td_tensor *tx, *tl, *tc, *ty;
        CHECK_OK(td_graph_create(&g, &gp));
        CHECK_OK(td_graph_input(g, "qkv", td_shape_3d(B, T, 3 * C), TD_F32, 1, &tx));
        CHECK_OK(td_graph_layer_norm(g, tx, NULL, NULL, 1e-5f, &tl));
        CHECK_OK(td_graph_cast(g, tx, lows[k], &tc)); /* a low input, as a linear hands on */
        CHECK_OK(td_graph_causal_attention(g, tc, NH, 0, &ty));
        CHECK_EQ(td_tensor_dtype(tl), TD_F32);
        CHECK_EQ(td_tensor_dtype(ty), lows[k]);
        CHECK_OK(td_graph_compile(g));
        CHECK_OK(td_tensor_write(tx, x));
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_graph_zero_grad(g));
        CHECK_OK(td_graph_backward_from(g, ty, dy));
        uint16_t *low = malloc(ny * sizeof *low); /* td_tensor_read copies y's own dtype */
        CHECK_OK(td_tensor_read(ty, low));
        td__convert(y, TD_F32, low, lows[k], ny);
        free(low);
        CHECK_OK(td_tensor_read(tl, ln));
        CHECK_OK(td_tensor_read_grad(tx, dx));
        double tol = lows[k] == TD_BF16 ? 3e-2 : 4e-3;
        check_close(lows[k] == TD_BF16 ? "bf16 attention y" : "f16 attention y", y, ry, ny, tol);
        check_close(lows[k] == TD_BF16 ? "bf16 attention dqkv" : "f16 attention dqkv", dx, rdx, nx,
                    tol);
        check_close("layer norm under O1", ln, rln, nx, TOL);
        td_graph_destroy(g);
    }
    free(x), free(dy), free(y), free(dx), free(ry), free(rdx), free(ln), free(rln);
}

int main(void) {
    td_rng_init(&rng, 2024);
    RUN(gelu_tanh_matches_reference_and_pytorch);
    RUN(layer_norm_matches_reference);
    RUN(layer_norm_matches_pytorch);
    RUN(embedding_matches_reference);
    RUN(embedding_matches_pytorch);
    RUN(tied_table_gets_both_gradients);
    RUN(embedding_rejects_bad_ids);
    RUN(attention_matches_reference);
    RUN(attention_matches_pytorch);
    RUN(attention_rejects_bad_shapes);
    RUN(attention_output_survives_a_relu);
    RUN(mixed_precision_rules);
    TEST_END();
}
