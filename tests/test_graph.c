/* Graph mechanics: gradient accumulation and zeroing, the grad-ready and parameter-use hooks,
 * relocated gradient buffers, train/eval behaviour of dropout and batch norm, RNG replay, parameter
 * sharing between graphs, a few SGD steps, and a finite-difference gradient check of a
 * conv + bn + relu + pool + linear + log_softmax + nll graph. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/nn.h"

#include "test.h"

/* A small MLP classifier on fixed data: x (N, IN) -> fc1 -> relu -> fc2 -> CE. */
typedef struct {
    td_graph *g;
    td_tensor *x, *y, *logp, *loss;
} tiny;

enum { TN = 8, TIN = 6, THID = 12, TOUT = 4 };

static int tiny_make(tiny *t, uint64_t seed) {
    memset(t, 0, sizeof *t);
    if (td_graph_create(&t->g, NULL) != TD_OK) return 0;
    td_rng rng;
    td_rng_init(&rng, seed);
    td_tensor *h;
    if (td_graph_input(t->g, "x", td_shape_2d(TN, TIN), TD_F32, 0, &t->x) ||
        td_graph_input(t->g, "y", td_shape_1d(TN), TD_I64, 0, &t->y) ||
        td_nn_linear(t->g, "fc1", t->x, THID, 1, &rng, &h) || td_graph_relu(t->g, h, &h) ||
        td_nn_linear(t->g, "fc2", h, TOUT, 1, &rng, &h) ||
        td_graph_cross_entropy(t->g, h, t->y, TD_REDUCTION_MEAN, &t->loss, &t->logp) ||
        td_graph_compile(t->g))
        return 0;
    float *x = td_tensor_data(t->x);
    int64_t *y = td_tensor_data(t->y);
    td_rng data;
    td_rng_init(&data, 99);
    for (int i = 0; i < TN * TIN; i++) x[i] = td_rng_normal(&data);
    for (int i = 0; i < TN; i++) y[i] = i % TOUT;
    return 1;
}

/* Concatenation of every parameter gradient. */
static size_t grads_copy(td_graph *g, float *out) {
    td_param *p;
    size_t n, k = 0;
    td_graph_parameters(g, &p, &n);
    for (size_t i = 0; i < n; i++) {
        memcpy(out + k, p[i].grad, p[i].count * sizeof(float));
        k += p[i].count;
    }
    return k;
}

static void accumulation_and_zero_grad(void) {
    tiny t;
    CHECK(tiny_make(&t, 1));
    float one[1024], two[1024], again[1024];
    CHECK_OK(td_graph_forward(t.g));
    CHECK_OK(td_graph_backward(t.g, t.loss));
    size_t n = grads_copy(t.g, one);
    CHECK(n == (size_t)(TIN * THID + THID + THID * TOUT + TOUT));
    double norm = 0;
    for (size_t i = 0; i < n; i++) norm += fabs(one[i]);
    CHECK(norm > 1e-3);
    CHECK_OK(td_graph_forward(t.g));
    CHECK_OK(td_graph_backward(t.g, t.loss));
    grads_copy(t.g, two);
    for (size_t i = 0; i < n; i++) CHECK_NEAR(two[i], 2 * one[i], 1e-6 + 1e-5 * fabs(one[i]));
    CHECK_OK(td_graph_zero_grad(t.g)); /* the next backward overwrites: no pass over memory */
    CHECK_OK(td_graph_forward(t.g));
    CHECK_OK(td_graph_backward(t.g, t.loss));
    grads_copy(t.g, again);
    for (size_t i = 0; i < n; i++) CHECK(again[i] == one[i]);
    td_graph_destroy(t.g);
}

/* A parameter that the next backward does not reach reads zero after it, and the hook sees
 * the zeros: zero_grad defers its memset to that backward. */
static void zero_grad_zeroes_unreached_params(void) {
    td_graph *g;
    td_tensor *x, *a, *b;
    td_rng rng;
    td_rng_init(&rng, 5);
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(2, 3), TD_F32, 0, &x));
    CHECK_OK(td_nn_linear(g, "a", x, 4, 1, &rng, &a));
    CHECK_OK(td_nn_linear(g, "b", x, 5, 1, &rng, &b));
    CHECK_OK(td_graph_compile(g));
    float *xd = td_tensor_data(x);
    for (int i = 0; i < 6; i++) xd[i] = (float)i - 2.5f;
    float ones[10];
    for (int i = 0; i < 10; i++) ones[i] = 1.0f;
    td_param *p;
    size_t np;
    CHECK_OK(td_graph_parameters(g, &p, &np));
    CHECK_EQ(np, 4);
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_graph_backward_from(g, b, ones)); /* b's gradients become non-zero */
    CHECK(((float *)p[2].grad)[0] != 0.0f);
    CHECK_OK(td_graph_zero_grad(g));
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_graph_backward_from(g, a, ones)); /* reaches a only */
    for (size_t i = 2; i < 4; i++)
        for (size_t k = 0; k < p[i].count; k++) CHECK(((float *)p[i].grad)[k] == 0.0f);
    CHECK(((float *)p[1].grad)[0] == 2.0f); /* a's bias: the sum of dy over the batch */
    td_graph_destroy(g);
}

typedef struct {
    td_graph *g;
    int calls[16];
    int order[16];
    int ncalls;
    float seen[16][64]; /* first values of the gradient when the hook ran */
} hook_log;

static void on_ready(size_t i, void *ctx) {
    hook_log *h = ctx;
    td_param *p;
    size_t n;
    td_graph_parameters(h->g, &p, &n);
    h->calls[i]++;
    h->order[h->ncalls++] = (int)i;
    size_t k = p[i].count < 64 ? p[i].count : 64;
    memcpy(h->seen[i], p[i].grad, k * sizeof(float));
}

static void grad_ready_hook_fires_once_with_final_values(void) {
    /* fc1.weight feeds two nodes (a shared weight), so its gradient is final only after
     * the first of them has run backward. */
    td_graph *g;
    CHECK_OK(td_graph_create(&g, NULL));
    td_rng rng;
    td_rng_init(&rng, 5);
    td_tensor *x, *y, *w, *b, *h1, *h2, *s, *loss, *out;
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(4, 8), TD_F32, 0, &x));
    CHECK_OK(td_graph_input(g, "y", td_shape_1d(4), TD_I64, 0, &y));
    CHECK_OK(td_graph_param(g, "shared.weight", td_shape_2d(8, 8), &w));
    CHECK_OK(td_graph_param(g, "shared.bias", td_shape_1d(8), &b));
    td_rng_fill_uniform(&rng, td_tensor_data(w), 64, -0.3f, 0.3f);
    CHECK_OK(td_graph_linear(g, x, w, b, &h1));
    CHECK_OK(td_graph_relu(g, h1, &h1));
    CHECK_OK(td_graph_linear(g, h1, w, NULL, &h2));
    CHECK_OK(td_graph_add(g, h1, h2, &s));
    CHECK_OK(td_nn_linear(g, "head", s, 3, 1, &rng, &out));
    CHECK_OK(td_graph_cross_entropy(g, out, y, TD_REDUCTION_SUM, &loss, NULL));
    CHECK_OK(td_graph_compile(g));
    td_rng_fill_uniform(&rng, td_tensor_data(x), 32, -1, 1);
    int64_t *lab = td_tensor_data(y);
    for (int i = 0; i < 4; i++) lab[i] = i % 3;
    hook_log h;
    memset(&h, 0, sizeof h);
    h.g = g;
    td_graph_set_grad_ready_hook(g, on_ready, &h);
    td_param *p;
    size_t n;
    CHECK_OK(td_graph_parameters(g, &p, &n));
    CHECK_EQ(n, 4);
    for (int step = 1; step <= 2; step++) {
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_graph_backward(g, loss));
        for (size_t i = 0; i < n; i++) {
            CHECK_EQ(h.calls[i], step);
            size_t k = p[i].count < 64 ? p[i].count : 64;
            for (size_t j = 0; j < k; j++) CHECK(h.seen[i][j] == ((float *)p[i].grad)[j]);
        }
    }
    /* head (params 2, 3) is reached first in backward, the shared weight last. */
    CHECK(h.order[0] == 2 || h.order[0] == 3);
    CHECK_EQ(h.order[2] + h.order[3], 1);
    td_graph_destroy(g);
}

/* A parameter fed to a linear node as its data input (an embedding table, say) is final only
 * after that node's data gradient, which comes after the weight gradient. */
static void grad_ready_hook_waits_for_data_gradients(void) {
    td_graph *g;
    CHECK_OK(td_graph_create(&g, NULL));
    td_rng rng;
    td_rng_init(&rng, 9);
    td_tensor *table, *w, *y, *out, *loss;
    CHECK_OK(td_graph_param(g, "table", td_shape_2d(4, 8), &table));
    CHECK_OK(td_graph_param(g, "head.weight", td_shape_2d(3, 8), &w));
    CHECK_OK(td_graph_input(g, "y", td_shape_1d(4), TD_I64, 0, &y));
    td_rng_fill_uniform(&rng, td_tensor_data(table), 32, -1, 1);
    td_rng_fill_uniform(&rng, td_tensor_data(w), 24, -1, 1);
    CHECK_OK(td_graph_linear(g, table, w, NULL, &out));
    CHECK_OK(td_graph_cross_entropy(g, out, y, TD_REDUCTION_MEAN, &loss, NULL));
    CHECK_OK(td_graph_compile(g));
    int64_t *lab = td_tensor_data(y);
    for (int i = 0; i < 4; i++) lab[i] = i % 3;
    hook_log h;
    memset(&h, 0, sizeof h);
    h.g = g;
    td_graph_set_grad_ready_hook(g, on_ready, &h);
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_graph_backward(g, loss));
    td_param *p;
    size_t n;
    CHECK_OK(td_graph_parameters(g, &p, &n));
    double norm = 0;
    for (size_t i = 0; i < n; i++) {
        CHECK_EQ(h.calls[i], 1);
        for (size_t j = 0; j < p[i].count; j++) {
            CHECK(h.seen[i][j] == ((float *)p[i].grad)[j]);
            norm += fabs(((float *)p[i].grad)[j]);
        }
    }
    CHECK(norm > 1e-3);
    CHECK_EQ(h.order[0], 1); /* the weight first, the table after its data gradient */
    td_graph_destroy(g);
}

/* DDP re-points params[i].grad itself (td_param's contract); the graph must follow. */
static void graph_follows_repointed_param_grads(void) {
    tiny t;
    CHECK(tiny_make(&t, 2));
    float ref[1024], mine[1024];
    CHECK_OK(td_graph_forward(t.g));
    CHECK_OK(td_graph_backward(t.g, t.loss));
    size_t n = grads_copy(t.g, ref);
    td_param *p;
    size_t np;
    CHECK_OK(td_graph_parameters(t.g, &p, &np));
    float *bucket = calloc(n, sizeof(float));
    size_t off = 0;
    for (size_t i = 0; i < np; i++) {
        memcpy(bucket + off, p[i].grad, p[i].count * sizeof(float));
        p[i].grad = bucket + off;
        off += p[i].count;
    }
    CHECK(td_tensor_grad(td_graph_param_tensor(t.g, 0)) == bucket);
    CHECK_OK(td_graph_forward(t.g));
    CHECK_OK(td_graph_backward(t.g, t.loss)); /* accumulates onto the copied values */
    for (size_t i = 0; i < n; i++) CHECK_NEAR(bucket[i], 2 * ref[i], 1e-6 + 1e-5 * fabs(ref[i]));
    CHECK_OK(td_graph_zero_grad(t.g));
    CHECK_OK(td_graph_forward(t.g));
    CHECK_OK(td_graph_backward(t.g, t.loss));
    grads_copy(t.g, mine);
    CHECK(memcmp(mine, ref, n * sizeof(float)) == 0);
    CHECK(memcmp(bucket, ref, n * sizeof(float)) == 0);
    td_graph_destroy(t.g);
    free(bucket);
}

/* The parameter-use hook (a sharded strategy gathers and frees parameters there): its calls in
 * order, interleaved with grad-ready; a hook that moves a parameter is followed; an error stops
 * the sweep. */
typedef struct {
    td_graph *g;
    int events[64][2]; /* (parameter, use), grad-ready as use 4 */
    int n;
    float *moved;      /* where BEFORE_FORWARD moves fc1.weight, or NULL */
    td_status fail_at; /* returned at fc2.bias's AFTER_FORWARD when set */
} use_log;

static td_status on_use(size_t i, td_param_use use, void *ctx) {
    use_log *u = ctx;
    if (u->n < 64) u->events[u->n][0] = (int)i, u->events[u->n++][1] = (int)use;
    td_param *p;
    size_t n;
    td_graph_parameters(u->g, &p, &n);
    if (u->moved && i == 0 && use == TD_PARAM_BEFORE_FORWARD && p[0].data != u->moved) {
        memcpy(u->moved, p[0].data, p[0].count * sizeof(float));
        for (size_t e = 0; e < p[0].count; e++) ((float *)p[0].data)[e] = NAN;
        p[0].data = u->moved;
    }
    if (u->fail_at && i == 3 && use == TD_PARAM_AFTER_FORWARD) return u->fail_at;
    return TD_OK;
}

static void on_ready_logged(size_t i, void *ctx) {
    use_log *u = ctx;
    if (u->n < 64) u->events[u->n][0] = (int)i, u->events[u->n++][1] = 4;
}

static void param_use_hook_order_moves_and_errors(void) {
    tiny t;
    CHECK(tiny_make(&t, 4));
    CHECK_OK(td_graph_forward(t.g));
    float want = *(float *)td_tensor_data(t.loss);
    use_log u;
    memset(&u, 0, sizeof u);
    u.g = t.g;
    td_graph_set_param_use_hook(t.g, on_use, &u);
    td_graph_set_grad_ready_hook(t.g, on_ready_logged, &u);
    CHECK_OK(td_graph_forward(t.g));
    CHECK_OK(td_graph_backward(t.g, t.loss));
    /* fc1's weight and bias (0, 1) before and after its node, then fc2's (2, 3); backward
     * fc2 then fc1, each parameter's BEFORE before its gradient is final and its AFTER after. */
    static const int want_fwd[8][2] = {{0, 0}, {1, 0}, {0, 1}, {1, 1},
                                       {2, 0}, {3, 0}, {2, 1}, {3, 1}};
    CHECK_EQ(u.n, 20);
    for (int k = 0; k < 8; k++) {
        CHECK_EQ(u.events[k][0], want_fwd[k][0]);
        CHECK_EQ(u.events[k][1], want_fwd[k][1]);
    }
    int seen_before[4] = {0}, ready[4] = {0}, after[4] = {0};
    for (int k = 8; k < u.n; k++) {
        int i = u.events[k][0], what = u.events[k][1];
        if (what == TD_PARAM_BEFORE_BACKWARD) {
            CHECK(!ready[i] && !after[i]);
            seen_before[i]++;
        } else if (what == TD_PARAM_AFTER_BACKWARD) {
            CHECK(ready[i]); /* the data gradient that reads it comes after its grad-ready */
            after[i]++;
        } else {
            CHECK_EQ(what, 4); /* grad-ready */
            CHECK_EQ(seen_before[i], 1);
            ready[i] = 1;
        }
    }
    for (int i = 0; i < 4; i++) CHECK_EQ(after[i], 1);
    CHECK_EQ(u.events[8][0] / 2, 1); /* fc2 first */
    /* A hook that moves fc1.weight (and poisons where it was) is followed. */
    float *moved = malloc(TIN * THID * sizeof(float));
    u.moved = moved;
    u.n = 0;
    CHECK_OK(td_graph_forward(t.g));
    CHECK(td_tensor_data(td_graph_param_tensor(t.g, 0)) == moved);
    CHECK(*(float *)td_tensor_data(t.loss) == want);
    /* A graph sharing the parameters reads where the td_param entries say, even for one moved
     * since the last sweep. */
    td_param *p;
    size_t np;
    CHECK_OK(td_graph_parameters(t.g, &p, &np));
    float *again = malloc(THID * sizeof(float));
    memcpy(again, p[1].data, THID * sizeof(float));
    p[1].data = again;
    tiny other;
    CHECK(tiny_make(&other, 5));
    CHECK_OK(td_graph_share_params(other.g, t.g));
    CHECK(td_tensor_data(td_graph_param_tensor(other.g, 1)) == again);
    td_graph_destroy(other.g);
    /* An error ends the sweep and is what it returns. */
    u.fail_at = TD_EPEER;
    CHECK_STATUS(td_graph_forward(t.g), TD_EPEER);
    td_graph_set_param_use_hook(t.g, NULL, NULL);
    td_graph_set_grad_ready_hook(t.g, NULL, NULL);
    td_graph_destroy(t.g);
    free(moved);
    free(again);
}

static void dropout_train_eval_and_replay(void) {
    td_graph *g;
    td_graph_params o = td_graph_default_params();
    o.seed = 1234;
    CHECK_OK(td_graph_create(&g, &o));
    td_tensor *x, *y, *x4, *y4;
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(64, 64), TD_F32, 1, &x));
    CHECK_OK(td_graph_dropout(g, x, 0.25f, &y));
    CHECK_OK(td_graph_input(g, "x4", td_shape_4d(4, 32, 3, 3), TD_F32, 1, &x4));
    CHECK_OK(td_graph_dropout2d(g, x4, 0.5f, &y4));
    CHECK_OK(td_graph_compile(g));
    float *xd = td_tensor_data(x), *x4d = td_tensor_data(x4);
    for (int i = 0; i < 64 * 64; i++) xd[i] = 1.0f + (float)(i % 7);
    for (int i = 0; i < 4 * 32 * 9; i++) x4d[i] = 1.0f + (float)(i % 5);
    td_rng saved = *td_graph_rng(g);
    CHECK_OK(td_graph_forward(g));
    const float *yd = td_tensor_data(y), *y4d = td_tensor_data(y4);
    static float first[64 * 64];
    memcpy(first, yd, sizeof first);
    int zeros = 0;
    for (int i = 0; i < 64 * 64; i++) {
        if (yd[i] == 0.0f)
            zeros++;
        else
            CHECK_NEAR(yd[i], xd[i] / 0.75f, 1e-5);
    }
    CHECK(zeros > 64 * 64 / 4 - 200 && zeros < 64 * 64 / 4 + 200);
    int dropped = 0;
    for (int c = 0; c < 4 * 32; c++) { /* whole channels are dropped or scaled by 2 */
        int z = 0;
        for (int k = 0; k < 9; k++) z += y4d[c * 9 + k] == 0.0f;
        CHECK(z == 0 || z == 9);
        if (z == 0)
            for (int k = 0; k < 9; k++) CHECK_NEAR(y4d[c * 9 + k], 2 * x4d[c * 9 + k], 1e-5);
        dropped += z == 9;
    }
    CHECK(dropped > 30 && dropped < 98);
    /* backward: dx = mask * scale * dy */
    static float dy[64 * 64], dx[64 * 64];
    for (int i = 0; i < 64 * 64; i++) dy[i] = 1.0f;
    CHECK_OK(td_graph_backward_from(g, y, dy));
    CHECK_OK(td_tensor_read_grad(x, dx));
    for (int i = 0; i < 64 * 64; i++) CHECK_NEAR(dx[i], yd[i] == 0.0f ? 0.0f : 1.0f / 0.75f, 1e-6);
    /* replay from the saved RNG state gives the same masks; a second draw differs */
    CHECK_OK(td_graph_forward(g));
    CHECK(memcmp(first, yd, sizeof first) != 0);
    *td_graph_rng(g) = saved;
    CHECK_OK(td_graph_forward(g));
    CHECK(memcmp(first, yd, sizeof first) == 0);
    /* eval is the identity */
    td_graph_set_training(g, 0);
    CHECK_EQ(td_graph_training(g), 0);
    CHECK_OK(td_graph_forward(g));
    CHECK(memcmp(xd, yd, sizeof first) == 0);
    for (int i = 0; i < 4 * 32 * 9; i++) CHECK(y4d[i] == x4d[i]);
    td_graph_destroy(g);
}

/* dropout2d after the Net's convolutions sees their blocked layout (20 channels pad to two
 * blocks of 16); with the same seed it must drop and scale exactly the (n, c) planes that
 * dropout2d on a plain copy of the same values does, forward and backward. */
static void dropout2d_on_blocked_layout(void) {
    enum { N = 32, C = 20, HW = 400 };
    td_graph *a, *b;
    td_graph_params o = td_graph_default_params();
    o.seed = 99;
    CHECK_OK(td_graph_create(&a, &o));
    CHECK_OK(td_graph_create(&b, &o));
    td_tensor *x, *w1, *h1, *w2, *h, *ya, *pooled, *flat, *p, *yb;
    td_conv2d_params cp = td_conv2d_default_params();
    td_pool2d_params pp = td_pool2d_default_params();
    CHECK_OK(td_graph_input(a, "x", td_shape_4d(N, 1, 28, 28), TD_F32, 0, &x));
    CHECK_OK(td_graph_param(a, "w1", td_shape_4d(10, 1, 5, 5), &w1));
    CHECK_OK(td_graph_conv2d(a, x, w1, NULL, &cp, &h1));
    CHECK_OK(td_graph_param(a, "w2", td_shape_4d(C, 10, 5, 5), &w2));
    CHECK_OK(td_graph_conv2d(a, h1, w2, NULL, &cp, &h));
    CHECK_OK(td_graph_dropout2d(a, h, 0.5f, &ya));
    CHECK_OK(td_graph_max_pool2d(a, ya, &pp, &pooled)); /* consumers as in the Net keep */
    CHECK_OK(td_graph_flatten(a, pooled, 1, &flat));    /* the conv's layout blocked */
    CHECK_OK(td_graph_input(b, "p", td_shape_4d(N, C, 20, 20), TD_F32, 1, &p));
    CHECK_OK(td_graph_dropout2d(b, p, 0.5f, &yb));
    CHECK_OK(td_graph_compile(a));
    CHECK_OK(td_graph_compile(b));
    td_rng rng;
    td_rng_init(&rng, 5);
    td_rng_fill_uniform(&rng, td_tensor_data(x), N * 784, 0.5f, 1.5f);
    td_rng_fill_uniform(&rng, td_tensor_data(w1), 10 * 25, 0.1f, 1.0f);
    td_rng_fill_uniform(&rng, td_tensor_data(w2), C * 10 * 25, 0.1f, 1.0f);
    CHECK_OK(td_graph_forward(a));
    static float hv[N * C * HW], va[N * C * HW], vb[N * C * HW], dy[N * C * HW];
    static float da[N * C * HW], db[N * C * HW];
    CHECK_OK(td_tensor_read(h, hv));
    CHECK_OK(td_tensor_write(p, hv));
    CHECK_OK(td_graph_forward(b));
    CHECK_OK(td_tensor_read(ya, va));
    CHECK_OK(td_tensor_read(yb, vb));
    for (int i = 0; i < N * C * HW; i++) dy[i] = (float)(i % 11) - 5.0f;
    CHECK_OK(td_graph_backward_from(a, ya, dy));
    CHECK_OK(td_graph_backward_from(b, yb, dy));
    CHECK_OK(td_tensor_read_grad(h, da));
    CHECK_OK(td_tensor_read_grad(p, db));
    int dropped = 0, same = 1;
    for (int i = 0; i < N * C * HW; i++) same &= va[i] == vb[i] && da[i] == db[i];
    for (int plane = 0; plane < N * C; plane++) dropped += vb[plane * HW] == 0.0f;
    CHECK(same);
    CHECK(dropped > 250 && dropped < 390);
    td_graph_destroy(a);
    td_graph_destroy(b);
}

static void batch_norm_train_and_eval(void) {
    enum { N = 6, C = 3, H = 4, W = 5 };
    td_graph *g;
    CHECK_OK(td_graph_create(&g, NULL));
    td_tensor *x, *y;
    CHECK_OK(td_graph_input(g, "x", td_shape_4d(N, C, H, W), TD_F32, 0, &x));
    CHECK_OK(td_nn_batch_norm2d(g, "bn", x, &y));
    CHECK_OK(td_graph_compile(g));
    td_param *buf, *par;
    size_t nb, np;
    CHECK_OK(td_graph_buffers(g, &buf, &nb));
    CHECK_OK(td_graph_parameters(g, &par, &np));
    CHECK_EQ(nb, 2);
    CHECK_EQ(np, 2);
    CHECK(strcmp(buf[0].name, "bn.running_mean") == 0);
    CHECK(strcmp(buf[1].name, "bn.running_var") == 0);
    CHECK(strcmp(par[0].name, "bn.weight") == 0 && par[0].grad != NULL);
    CHECK(buf[0].grad == NULL);
    float *xd = td_tensor_data(x);
    td_rng r;
    td_rng_init(&r, 3);
    for (int i = 0; i < N * C * H * W; i++) xd[i] = 2.0f + 3.0f * td_rng_normal(&r);
    float *w = par[0].data, *b = par[1].data;
    w[1] = 2.0f;
    b[2] = -1.0f;
    CHECK_OK(td_graph_forward(g));
    static float out[N * C * H * W];
    CHECK_OK(td_tensor_read(y, out));
    const float *rm = buf[0].data, *rv = buf[1].data;
    for (int c = 0; c < C; c++) {
        double s = 0, s2 = 0, ys = 0, ys2 = 0, m = N * H * W;
        for (int n = 0; n < N; n++)
            for (int k = 0; k < H * W; k++) {
                double v = xd[(n * C + c) * H * W + k], o = out[(n * C + c) * H * W + k];
                s += v, s2 += v * v, ys += o, ys2 += o * o;
            }
        double mean = s / m, var = s2 / m - mean * mean;
        double ym = ys / m, yv = ys2 / m - ym * ym;
        CHECK_NEAR(ym, b[c], 1e-4);
        CHECK_NEAR(sqrt(yv), w[c] * sqrt(var / (var + 1e-5)), 1e-3);
        CHECK_NEAR(rm[c], 0.1 * mean, 1e-4);
        CHECK_NEAR(rv[c], 0.9 + 0.1 * var * m / (m - 1), 1e-3); /* unbiased, as PyTorch */
    }
    td_graph_set_training(g, 0);
    float rm0 = rm[0];
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_tensor_read(y, out));
    CHECK(rm[0] == rm0); /* eval leaves the running stats alone */
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            for (int k = 0; k < H * W; k++) {
                int i = (n * C + c) * H * W + k;
                double e = (xd[i] - rm[c]) / sqrt(rv[c] + 1e-5) * w[c] + b[c];
                CHECK_NEAR(out[i], e, 1e-4 * (1 + fabs(e)));
            }
    td_graph_destroy(g);
}

static void sgd_steps_reduce_the_loss(void) {
    tiny t;
    CHECK(tiny_make(&t, 3));
    td_param *p;
    size_t n;
    CHECK_OK(td_graph_parameters(t.g, &p, &n));
    float first = 0, last = 0;
    for (int step = 0; step < 60; step++) {
        CHECK_OK(td_graph_zero_grad(t.g));
        CHECK_OK(td_graph_forward(t.g));
        CHECK_OK(td_graph_backward(t.g, t.loss));
        float l = *(float *)td_tensor_data(t.loss);
        if (step == 0) first = l;
        last = l;
        for (size_t i = 0; i < n; i++) {
            float *d = p[i].data, *gr = p[i].grad;
            for (size_t j = 0; j < p[i].count; j++) d[j] -= 0.5f * gr[j];
        }
    }
    CHECK(first > 1.0f);
    CHECK(last < 0.5f * first);
    td_graph_destroy(t.g);
}

/* Backward once, then compares every parameter's (and x's, when given) gradient with
 * central differences of the loss; returns how many entries disagree. */
static int fd_check(td_graph *g, td_tensor *loss, td_tensor *x, int *checked) {
    td_param *p;
    size_t np;
    td_graph_parameters(g, &p, &np);
    CHECK_OK(td_graph_zero_grad(g));
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_graph_backward(g, loss));
    int bad = 0;
    const float eps = 1e-3f;
    for (size_t i = 0; i <= np; i++) {
        td_tensor *pt = i < np ? td_graph_param_tensor(g, i) : x;
        if (!pt) break;
        float *d = td_tensor_data(pt), *gr = td_tensor_grad(pt);
        int64_t count = td_tensor_numel(pt);
        for (int64_t j = 0; j < count; j++) {
            float keep = d[j];
            d[j] = keep + eps;
            td_graph_forward(g);
            double lp = *(float *)td_tensor_data(loss);
            d[j] = keep - eps;
            td_graph_forward(g);
            double lm = *(float *)td_tensor_data(loss);
            d[j] = keep;
            double num = (lp - lm) / (2 * eps), ana = gr[j];
            (*checked)++;
            if (fabs(num - ana) > 1e-2 * fmax(fabs(num), fabs(ana)) + 2e-3) {
                bad++;
                if (bad < 8)
                    fprintf(stderr, "%s[%lld]: analytic %.6g numeric %.6g\n", td_tensor_name(pt),
                            (long long)j, ana, num);
            }
        }
    }
    return bad;
}

/* conv(1->3, k3, pad 1) + bn + relu + maxpool 2 + flatten + linear(27->5) + CE; every
 * parameter and the input checked against central differences. */
static void finite_difference_gradients(void) {
    enum { N = 4 };
    td_graph *g;
    CHECK_OK(td_graph_create(&g, NULL));
    td_rng rng;
    td_rng_init(&rng, 11);
    td_tensor *x, *y, *t, *loss;
    CHECK_OK(td_graph_input(g, "x", td_shape_4d(N, 1, 6, 6), TD_F32, 1, &x));
    CHECK_OK(td_graph_input(g, "y", td_shape_1d(N), TD_I64, 0, &y));
    td_conv2d_params cp = td_conv2d_default_params();
    cp.padding[0] = cp.padding[1] = 1;
    td_pool2d_params pp = td_pool2d_default_params();
    CHECK_OK(td_nn_conv2d(g, "conv", x, 3, 3, &cp, 1, &rng, &t));
    CHECK_OK(td_nn_batch_norm2d(g, "bn", t, &t));
    CHECK_OK(td_graph_relu(g, t, &t));
    CHECK_OK(td_graph_max_pool2d(g, t, &pp, &t));
    CHECK_OK(td_graph_flatten(g, t, 1, &t));
    CHECK_OK(td_nn_linear(g, "fc", t, 5, 1, &rng, &t));
    CHECK_OK(td_graph_cross_entropy(g, t, y, TD_REDUCTION_MEAN, &loss, NULL));
    CHECK_OK(td_graph_compile(g));
    td_rng_fill_uniform(&rng, td_tensor_data(x), N * 36, -1, 1);
    int64_t *lab = td_tensor_data(y);
    for (int i = 0; i < N; i++) lab[i] = (i * 3) % 5;
    td_param *p;
    size_t np;
    CHECK_OK(td_graph_parameters(g, &p, &np));
    CHECK_EQ(np, 6);
    /* make BN's affine parameters non-trivial */
    for (int c = 0; c < 3; c++) {
        ((float *)p[2].data)[c] = 0.5f + 0.3f * (float)c;
        ((float *)p[3].data)[c] = 0.1f * (float)c;
    }
    int checked = 0, bad = fd_check(g, loss, x, &checked);
    CHECK(checked == 30 + 6 + 135 + 5 + N * 36);
    /* a kink of relu or max pool inside +-eps can spoil a handful of entries */
    CHECK(bad <= 2);
    td_graph_destroy(g);
}

/* The tiny MLP runs its ReLU in place over the linear output; check its gradients too. */
static void finite_difference_in_place_relu(void) {
    tiny t;
    CHECK(tiny_make(&t, 8));
    int checked = 0, bad = fd_check(t.g, t.loss, NULL, &checked);
    CHECK(checked == TIN * THID + THID + THID * TOUT + TOUT);
    CHECK(bad <= 1);
    td_graph_destroy(t.g);
}

/* The image models (the GPT has its own in test_gpt.c). */
static void models_build_and_share_params(void) {
    for (int k = 0; k <= TD_MODEL_RESNET; k++) {
        td_graph *g, *e;
        td_model m, me;
        CHECK_OK(td_graph_create(&g, NULL));
        CHECK_OK(td_model_build(g, (td_model_kind)k, 8, 7, &m));
        td_graph_params o = td_graph_default_params();
        o.grad_enabled = 0;
        CHECK_OK(td_graph_create(&e, &o));
        CHECK_OK(td_model_build(e, (td_model_kind)k, 3, 8, &me));
        CHECK_OK(td_graph_share_params(e, g));
        td_graph_set_training(e, 0);
        td_graph_set_training(g, 0);
        float *x = td_tensor_data(m.input);
        int64_t *lab = td_tensor_data(m.labels);
        td_rng r;
        td_rng_init(&r, 4);
        for (int i = 0; i < 8 * 784; i++) x[i] = td_rng_uniform(&r);
        for (int i = 0; i < 8; i++) lab[i] = i;
        CHECK_OK(td_tensor_write(me.input, x + 2 * 784));
        memcpy(td_tensor_data(me.labels), lab + 2, 3 * sizeof(int64_t));
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_graph_forward(e));
        float l = *(float *)td_tensor_data(m.loss);
        CHECK(l > 1.5f && l < 3.5f); /* about ln(10) at init */
        const float *a = td_tensor_data(m.output), *b = td_tensor_data(me.output);
        for (int i = 0; i < 30; i++) CHECK_NEAR(a[20 + i], b[i], 1e-4);
        int64_t correct = -1, pred[8];
        CHECK_OK(td_model_predict(&m, pred, &correct));
        CHECK(correct >= 0 && correct <= 8);
        CHECK_STATUS(td_graph_backward(e, me.loss), TD_ESTATE);
        td_param *p;
        size_t n;
        CHECK_OK(td_graph_parameters(g, &p, &n));
        CHECK(strcmp(p[0].name, k == TD_MODEL_MLP ? "fc1.weight" : "conv1.weight") == 0);
        CHECK_EQ(n, k == TD_MODEL_NET ? 8 : k == TD_MODEL_MLP ? 6 : k == TD_MODEL_CNN ? 18 : 38);
        td_graph_destroy(e);
        td_graph_destroy(g);
    }
    td_model_kind kind;
    CHECK_OK(td_model_kind_parse("cnn", &kind));
    CHECK_EQ(kind, TD_MODEL_CNN);
    CHECK_STATUS(td_model_kind_parse("vgg", &kind), TD_EINVAL);
}

static void input_gradient_and_errors(void) {
    td_graph *g;
    CHECK_OK(td_graph_create(&g, NULL));
    td_tensor *x, *w, *y, *lab, *loss, *lp;
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(2, 3), TD_F32, 1, &x));
    CHECK_OK(td_graph_param(g, "w", td_shape_2d(4, 3), &w));
    CHECK_STATUS(td_graph_param(g, "w", td_shape_2d(4, 3), &y), TD_EINVAL);
    td_tensor *wbad;
    CHECK_OK(td_graph_param(g, "w_bad", td_shape_2d(4, 5), &wbad));
    CHECK_STATUS(td_graph_linear(g, x, wbad, NULL, &y), TD_ESHAPE);
    CHECK_OK(td_graph_linear(g, x, w, NULL, &y));
    CHECK_OK(td_graph_input(g, "labels", td_shape_1d(2), TD_I64, 0, &lab));
    CHECK_OK(td_graph_log_softmax(g, y, &lp));
    CHECK_OK(td_graph_nll_loss(g, lp, lab, TD_REDUCTION_SUM, &loss));
    CHECK_OK(td_graph_compile(g));
    CHECK_STATUS(td_graph_relu(g, y, &y), TD_ESTATE);
    float *xd = td_tensor_data(x), *wd = td_tensor_data(w);
    for (int i = 0; i < 6; i++) xd[i] = (float)i - 2.5f;
    for (int i = 0; i < 12; i++) wd[i] = 0.1f * (float)(i % 5) - 0.2f;
    int64_t *l = td_tensor_data(lab);
    l[0] = 1;
    l[1] = 7;
    CHECK_STATUS(td_graph_forward(g), TD_EINVAL); /* label 7 of 4 classes */
    CHECK(strstr(td_last_error(), "label 7") != NULL);
    l[1] = 3;
    CHECK_OK(td_graph_forward(g));
    float dy[8] = {1, 0, -1, 2, 0.5f, 0.5f, 0, -2}, dx[6];
    CHECK_OK(td_graph_backward_from(g, y, dy));
    CHECK_OK(td_tensor_read_grad(x, dx));
    for (int n = 0; n < 2; n++)
        for (int i = 0; i < 3; i++) {
            float e = 0;
            for (int o = 0; o < 4; o++) e += dy[n * 4 + o] * wd[o * 3 + i];
            CHECK_NEAR(dx[n * 3 + i], e, 1e-5);
        }
    td_graph_destroy(g);
}

/* Winograd (oneDNN's choice for 3x3) and direct convolution agree on the CNN's loss and
 * gradients to f32 rounding. */
static void winograd_matches_direct(void) {
    td_graph *g[2];
    td_model m[2];
    for (int k = 0; k < 2; k++) {
        td_graph_params o = td_graph_default_params();
        o.conv_winograd = k;
        CHECK_OK(td_graph_create(&g[k], &o));
        CHECK_OK(td_model_build(g[k], TD_MODEL_CNN, 16, 21, &m[k]));
        td_rng r;
        td_rng_init(&r, 6);
        td_rng_fill_uniform(&r, td_tensor_data(m[k].input), 16 * 784, 0, 1);
        int64_t *lab = td_tensor_data(m[k].labels);
        for (int i = 0; i < 16; i++) lab[i] = (i * 7) % 10;
        CHECK_OK(td_graph_forward(g[k]));
        CHECK_OK(td_graph_backward(g[k], m[k].loss));
    }
    CHECK_NEAR(*(float *)td_tensor_data(m[0].loss), *(float *)td_tensor_data(m[1].loss), 1e-4);
    td_param *p0, *p1;
    size_t n0, n1;
    CHECK_OK(td_graph_parameters(g[0], &p0, &n0));
    CHECK_OK(td_graph_parameters(g[1], &p1, &n1));
    CHECK_EQ(n0, n1);
    for (size_t i = 0; i < n0 && i < n1; i++) {
        const float *a = p0[i].grad, *b = p1[i].grad;
        double scale = 0;
        for (size_t j = 0; j < p0[i].count; j++) scale = fmax(scale, fabs(a[j]));
        /* the absolute term covers conv biases before BN, whose true gradient is 0 */
        for (size_t j = 0; j < p0[i].count; j++) CHECK_NEAR(a[j], b[j], 1e-3 * scale + 1e-5);
    }
    td_graph_destroy(g[0]);
    td_graph_destroy(g[1]);
}

static void inputs_point_at_caller_memory(void) {
    tiny t;
    CHECK(tiny_make(&t, 4));
    CHECK_OK(td_graph_compile(t.g)); /* compiling twice is a no-op */
    CHECK_OK(td_graph_forward(t.g));
    float own_loss = *(float *)td_tensor_data(t.loss);
    float mine[TN * TIN];
    memcpy(mine, td_tensor_data(t.x), sizeof mine);
    CHECK_OK(td_tensor_set_data(t.x, mine));
    CHECK(td_tensor_data(t.x) == mine);
    CHECK_OK(td_graph_forward(t.g));
    CHECK(*(float *)td_tensor_data(t.loss) == own_loss);
    for (int i = 0; i < TN * TIN; i++) mine[i] *= 3.0f;
    CHECK_OK(td_graph_forward(t.g));
    CHECK(*(float *)td_tensor_data(t.loss) != own_loss);
    CHECK_OK(td_tensor_set_data(t.x, NULL));
    CHECK_OK(td_graph_forward(t.g));
    CHECK(*(float *)td_tensor_data(t.loss) == own_loss);
    CHECK_STATUS(td_tensor_set_data(td_graph_param_tensor(t.g, 0), mine), TD_EINVAL);
    td_graph_destroy(t.g);
}

int main(void) {
    RUN(accumulation_and_zero_grad);
    RUN(zero_grad_zeroes_unreached_params);
    RUN(grad_ready_hook_fires_once_with_final_values);
    RUN(grad_ready_hook_waits_for_data_gradients);
    RUN(graph_follows_repointed_param_grads);
    RUN(param_use_hook_order_moves_and_errors);
    RUN(dropout_train_eval_and_replay);
    RUN(dropout2d_on_blocked_layout);
    RUN(batch_norm_train_and_eval);
    RUN(sgd_steps_reduce_the_loss);
    RUN(finite_difference_gradients);
    RUN(finite_difference_in_place_relu);
    RUN(models_build_and_share_params);
    RUN(input_gradient_and_errors);
    RUN(inputs_point_at_caller_memory);
    RUN(winograd_matches_direct);
    TEST_END();
}
