/* td_graph_set_shard: linear layers that sum the shards of a deterministic step themselves.
 *  - The sum is the one deterministic mode defines: each shard's weight gradient sums its
 *    samples in order, one fused multiply-add each from zero, its bias gradient one addition
 *    each, and the shards are added in the aligned pairwise tree (counts of 1, 3, 4 and 8, shards
 *    of 3, 5 and 16 samples);
 *    checked bit for bit against the same computed here in plain C from the shards' inputs and
 *    output gradients, for a layer whose rows are 4 KiB, one whose are not, one with fewer
 *    outputs than a tile's rows and one without a bias, with inputs whose magnitudes make the
 *    order show in the last bits (a plain left-to-right sum differs).
 *  - It is the layer's gradient: against the oneDNN gradients of the same shards without
 *    set_shard, added in the same tree, to f32 rounding (and bit for bit where oneDNN's kernel
 *    sums a shard's samples in that order too, which the test prints).
 *  - The grad-ready hook hears of the summed parameters at the last shard only, their td_param
 *    entries say shard_sum while the step is sharded and not after set_shard(g, 0, 0), and a
 *    shard index outside the count is refused. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/nn.h"

#include "test.h"

enum { MAX_SHARDS = 8 };

/* Values whose magnitudes span 2^-12 .. 2^12, so that the order of a sum shows in its bits. */
static float spread(td_rng *r) {
    return ldexpf(td_rng_uniform(r) - 0.5f, (int)(td_rng_u32(r) % 25) - 12);
}

/* The aligned pairwise tree over v[0..n): v[i] += v[i + stride], stride 1, 2, 4, ... (what
 * deterministic mode's binary counter computes, for any n). */
static float tree(float *v, size_t n) {
    for (size_t stride = 1; stride < n; stride *= 2)
        for (size_t i = 0; i + stride < n; i += 2 * stride) v[i] = v[i] + v[i + stride];
    return v[0];
}

typedef struct {
    int64_t n, in, out;
    int bias;
    size_t shards;
} layer_case;

static int ready_count[2];

static void count_ready(size_t i, void *ctx) {
    (void)ctx;
    if (i < 2) ready_count[i]++;
}

/* Runs c->shards shards of a linear layer through a graph (with set_shard when sharded), each
 * from its own x and dy; the parameters' gradients after the last into dw, db. */
static void run_layer(const layer_case *c, int sharded, const float *x, const float *dy, float *dw,
                      float *db, float **each_w, float **each_b) {
    td_graph *g;
    td_tensor *in, *y;
    td_rng rng;
    td_rng_init(&rng, 3);
    td_graph_params gp = td_graph_default_params();
    gp.threads = 1;
    CHECK_OK(td_graph_create(&g, &gp));
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(c->n, c->in), TD_F32, 0, &in));
    CHECK_OK(td_nn_linear(g, "fc", in, c->out, c->bias, &rng, &y));
    CHECK_OK(td_graph_compile(g));
    td_param *p;
    size_t np;
    CHECK_OK(td_graph_parameters(g, &p, &np));
    CHECK_EQ(np, (size_t)(c->bias ? 2 : 1));
    td_graph_set_grad_ready_hook(g, count_ready, NULL);
    size_t nx = (size_t)(c->n * c->in), ny = (size_t)(c->n * c->out);
    for (size_t s = 0; s < c->shards; s++) {
        CHECK_OK(td_tensor_write(in, x + s * nx));
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_graph_zero_grad(g));
        if (sharded) CHECK_OK(td_graph_set_shard(g, s, c->shards));
        for (size_t i = 0; i < np; i++) CHECK_EQ(p[i].shard_sum, sharded);
        ready_count[0] = ready_count[1] = 0;
        CHECK_OK(td_graph_backward_from(g, y, dy + s * ny));
        int reported = !sharded || s + 1 == c->shards;
        for (size_t i = 0; i < np; i++) CHECK_EQ(ready_count[i], reported);
        if (!sharded) {
            memcpy(each_w[s], p[0].grad, p[0].count * sizeof(float));
            if (c->bias) memcpy(each_b[s], p[1].grad, p[1].count * sizeof(float));
        }
    }
    if (sharded) {
        memcpy(dw, p[0].grad, p[0].count * sizeof(float));
        if (c->bias) memcpy(db, p[1].grad, p[1].count * sizeof(float));
        CHECK_OK(td_graph_set_shard(g, 0, 0));
        for (size_t i = 0; i < np; i++) CHECK_EQ(p[i].shard_sum, 0);
    }
    td_graph_set_grad_ready_hook(g, NULL, NULL);
    td_graph_destroy(g);
}

static void check_case(const layer_case *c) {
    size_t S = c->shards, nx = (size_t)(c->n * c->in), ny = (size_t)(c->n * c->out),
           nw = (size_t)(c->in * c->out);
    float *x = malloc(S * nx * sizeof *x), *dy = malloc(S * ny * sizeof *dy);
    td_rng r;
    td_rng_init(&r, 11 + S);
    for (size_t e = 0; e < S * nx; e++) x[e] = spread(&r);
    for (size_t e = 0; e < S * ny; e++) dy[e] = spread(&r);
    float *dw = malloc(nw * sizeof *dw), *db = calloc((size_t)c->out, sizeof *db);
    float *each_w[MAX_SHARDS], *each_b[MAX_SHARDS];
    for (size_t s = 0; s < S; s++) {
        each_w[s] = malloc(nw * sizeof(float));
        each_b[s] = calloc((size_t)c->out, sizeof(float));
    }
    run_layer(c, 1, x, dy, dw, db, each_w, each_b);
    run_layer(c, 0, x, dy, NULL, NULL, each_w, each_b);
    size_t wrong = 0, plain_differs = 0, onednn_same = 0, far = 0;
    float v[MAX_SHARDS], u[MAX_SHARDS];
    for (int64_t j = 0; j < c->out; j++) {
        for (int64_t k = 0; k < c->in; k++) {
            float plain = 0;
            for (size_t s = 0; s < S; s++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < c->n; i++) {
                    float a = dy[s * ny + (size_t)(i * c->out + j)],
                          b = x[s * nx + (size_t)(i * c->in + k)];
                    acc = fmaf(a, b, acc);
                    plain = fmaf(a, b, plain);
                }
                v[s] = acc;
                u[s] = each_w[s][j * c->in + k];
            }
            float want = tree(v, S), theirs = tree(u, S), got = dw[j * c->in + k];
            wrong += memcmp(&want, &got, sizeof got) != 0;
            plain_differs += plain != want;
            onednn_same += memcmp(&theirs, &got, sizeof got) == 0;
            far += fabsf(theirs - got) > 1e-5f * (fabsf(theirs) + 1e-3f);
        }
        if (c->bias) {
            for (size_t s = 0; s < S; s++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < c->n; i++)
                    acc = acc + dy[s * ny + (size_t)(i * c->out + j)];
                v[s] = acc;
            }
            float want = tree(v, S);
            wrong += memcmp(&want, &db[j], sizeof want) != 0;
        }
    }
    if (wrong)
        TEST_FAIL_AT("(%lld, %lld) over %zu shards of %lld: %zu values differ from the tree's",
                     (long long)c->out, (long long)c->in, S, (long long)c->n, wrong);
    CHECK_EQ(far, 0);
    if (S > 1) CHECK(plain_differs > nw / 100); /* the order shows in the bits */
    printf("    (%lld, %lld), %zu shards of %lld: %s oneDNN's per-shard gradients in the tree "
           "(%zu of %zu)\n",
           (long long)c->out, (long long)c->in, S, (long long)c->n,
           onednn_same == nw ? "the bits of" : "within f32 rounding of", onednn_same, nw);
    for (size_t s = 0; s < S; s++) {
        free(each_w[s]);
        free(each_b[s]);
    }
    free(x);
    free(dy);
    free(dw);
    free(db);
}

static void summed_shards_are_the_fixed_tree(void) {
    static const layer_case cases[] = {
        {16, 1024, 70, 1, 4}, /* rows of 4 KiB */
        {16, 784, 33, 1, 8},  /* not a whole column block, not a whole tile of rows */
        {16, 100, 3, 1, 3},   /* fewer outputs than a tile's rows, a count not a power of two */
        {5, 64, 9, 0, 1},     /* no bias, one shard, a batch of 5 */
        {3, 50, 7, 1, 4},     /* shards of 3: each packed shard's floats are not a multiple of 16 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) check_case(&cases[i]);
}

static void bad_shards_are_refused(void) {
    td_graph *g;
    td_tensor *in, *y;
    td_rng rng;
    td_rng_init(&rng, 3);
    td_graph_params gp = td_graph_default_params();
    CHECK_OK(td_graph_create(&g, &gp));
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(4, 8), TD_F32, 0, &in));
    CHECK_OK(td_nn_linear(g, "fc", in, 3, 1, &rng, &y));
    CHECK_STATUS(td_graph_set_shard(g, 0, 2), TD_ESTATE); /* not compiled */
    CHECK_OK(td_graph_compile(g));
    CHECK_STATUS(td_graph_set_shard(g, 2, 2), TD_EINVAL);
    CHECK(strstr(td_last_error(), "shard 2 of 2") != NULL);
    CHECK_OK(td_graph_set_shard(g, 1, 2));
    td_graph_destroy(g);
    CHECK_STATUS(td_graph_set_shard(NULL, 0, 1), TD_EINVAL);
}

int main(void) {
    RUN(summed_shards_are_the_fixed_tree);
    RUN(bad_shards_are_refused);
    TEST_END();
}
