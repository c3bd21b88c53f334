/* Graph options that change how the CPU kernels run, not what they compute.
 *  - The thread count of a graph's kernels (td_graph_params.threads): a graph on one thread
 *    trains the CNN (batch norm, convolutions whose weight gradients sum over the batch) to the
 *    same gradient bits whatever OpenMP count its caller has, while the caller's own count
 *    (which the same graph without the option follows, to other bits) comes back after every
 *    call.
 *  - Blocked linear weights (td_graph_params.blocked_linear): the same loss, outputs and
 *    gradients as the plain layout to f32 rounding, for a weight whose rows are 4 KiB (the
 *    padded reorder) and one whose are not, with and without an input gradient; and at AMP O1,
 *    where the layers compute in bf16 through oneDNN's matmul, to bf16 rounding.
 *  - Kept weights (td_graph_keep_weights): a forward that keeps the last one's weight copies
 *    gives that forward's bits while the parameters are unchanged, and one that does not keep
 *    them follows a change; a parameter moved elsewhere is laid out again even when kept. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/nn.h"

#include "test.h"

enum { BATCH = 16 };

/* One forward and backward of the CNN on fixed images at the calling thread's OpenMP count
 * `caller`, in a graph of `threads`; its parameter gradients, concatenated, into out (which
 * holds `cap` floats); returns how many. */
static size_t cnn_gradients(int threads, int caller, float *out, size_t cap) {
    omp_set_num_threads(caller);
    td_graph_params gp = td_graph_default_params();
    gp.threads = threads;
    td_graph *g;
    td_model m;
    size_t k = 0;
    CHECK_OK(td_graph_create(&g, &gp));
    CHECK_OK(td_model_build(g, TD_MODEL_CNN, BATCH, 3, &m));
    float *x = td_tensor_data(m.input);
    int64_t *y = td_tensor_data(m.labels);
    td_rng r;
    td_rng_init(&r, 5);
    for (int i = 0; i < BATCH * 784; i++) x[i] = td_rng_uniform(&r);
    for (int i = 0; i < BATCH; i++) y[i] = i % 10;
    CHECK_OK(td_graph_forward(g));
    CHECK_EQ(omp_get_max_threads(), caller);
    CHECK_OK(td_graph_backward(g, m.loss));
    CHECK_EQ(omp_get_max_threads(), caller);
    td_param *p;
    size_t n;
    CHECK_OK(td_graph_parameters(g, &p, &n));
    for (size_t i = 0; i < n && k + p[i].count <= cap; i++) {
        memcpy(out + k, p[i].grad, p[i].count * sizeof(float));
        k += p[i].count;
    }
    td_graph_destroy(g);
    return k;
}

static void one_thread_gives_the_same_bits_under_any_caller_count(void) {
    size_t cap = 1 << 20;
    float *one = malloc(cap * sizeof(float)), *two = malloc(cap * sizeof(float));
    float *free_two = malloc(cap * sizeof(float));
    size_t n1 = cnn_gradients(1, 1, one, cap), n2 = cnn_gradients(1, 2, two, cap);
    CHECK(n1 > 0 && n1 == n2);
    if (n1 == n2 && memcmp(one, two, n1 * sizeof(float)) != 0)
        TEST_FAIL_AT("a graph on one thread gives other gradients when its caller has 2");
    /* The caller's count, which a graph without the option follows, changes the bits: the
     * check above can fail. */
    size_t n3 = cnn_gradients(0, 2, free_two, cap);
    CHECK(n3 == n1 && memcmp(one, free_two, n1 * sizeof(float)) != 0);
    omp_set_num_threads(1);
    free(one);
    free(two);
    free(free_two);
}

static void negative_threads_are_refused(void) {
    td_graph_params gp = td_graph_default_params();
    gp.threads = -1;
    td_graph *g = (td_graph *)&gp;
    CHECK_STATUS(td_graph_create(&g, &gp), TD_EINVAL);
    CHECK(g == NULL);
    CHECK(strstr(td_last_error(), "threads = -1") != NULL);
}

/* A two-layer classifier over x (N, 1024): fc1 (64, 1024) has rows of 4 KiB, fc2 (10, 64) not. */
enum { N = 16, IN = 1024, HID = 64, OUT = 10 };

typedef struct {
    td_graph *g;
    td_tensor *x, *y, *out, *loss;
} net;

static void net_build(net *m, int blocked, int input_grad, td_amp_level amp) {
    td_graph_params gp = td_graph_default_params();
    gp.blocked_linear = blocked;
    gp.amp.level = amp;
    td_rng rng;
    td_rng_init(&rng, 7);
    td_tensor *h;
    CHECK_OK(td_graph_create(&m->g, &gp));
    CHECK_OK(td_graph_input(m->g, "x", td_shape_2d(N, IN), TD_F32, input_grad, &m->x));
    CHECK_OK(td_graph_input(m->g, "y", td_shape_1d(N), TD_I64, 0, &m->y));
    CHECK_OK(td_nn_linear(m->g, "fc1", m->x, HID, 1, &rng, &h));
    CHECK_OK(td_graph_relu(m->g, h, &h));
    CHECK_OK(td_nn_linear(m->g, "fc2", h, OUT, 1, &rng, &m->out));
    CHECK_OK(td_graph_cross_entropy(m->g, m->out, m->y, TD_REDUCTION_MEAN, &m->loss, NULL));
    CHECK_OK(td_graph_compile(m->g));
    float *x = td_tensor_data(m->x);
    int64_t *y = td_tensor_data(m->y);
    td_rng data;
    td_rng_init(&data, 8);
    for (int i = 0; i < N * IN; i++) x[i] = td_rng_normal(&data);
    for (int i = 0; i < N; i++) y[i] = i % OUT;
}

/* Forward and backward; the outputs, then every parameter gradient, then the input gradient
 * (when it has one) into out; returns how many floats. */
static size_t net_step(net *m, float *out) {
    CHECK_OK(td_graph_zero_grad(m->g));
    CHECK_OK(td_graph_forward(m->g));
    CHECK_OK(td_graph_backward(m->g, m->loss));
    size_t k = 0;
    CHECK_OK(td_tensor_read(m->out, out));
    k += N * OUT;
    td_param *p;
    size_t n;
    CHECK_OK(td_graph_parameters(m->g, &p, &n));
    for (size_t i = 0; i < n; i++) {
        memcpy(out + k, p[i].grad, p[i].count * sizeof(float));
        k += p[i].count;
    }
    if (td_tensor_grad(m->x)) {
        CHECK_OK(td_tensor_read_grad(m->x, out + k));
        k += N * IN;
    }
    return k;
}

enum { MAX_FLOATS = N * OUT + HID * IN + HID + OUT * HID + OUT + N * IN };

static void blocked_linear_match_the_plain_layout(void) {
    float *a = malloc(MAX_FLOATS * sizeof(float)), *b = malloc(MAX_FLOATS * sizeof(float));
    for (int k = 0; k < 4; k++) {
        int input_grad = k % 2;
        td_amp_level amp = k < 2 ? TD_AMP_O0 : TD_AMP_O1;
        net plain, blocked;
        net_build(&plain, 0, input_grad, amp);
        net_build(&blocked, 1, input_grad, amp);
        size_t na = net_step(&plain, a), nb = net_step(&blocked, b);
        CHECK_EQ(na, nb);
        double worst = 0;
        for (size_t i = 0; i < na && na == nb; i++) {
            double d = fabs((double)a[i] - b[i]) / (fabs((double)a[i]) + 1e-3);
            if (d > worst) worst = d;
        }
        CHECK(worst < (amp == TD_AMP_O0 ? 1e-4 : 1e-2));
        td_graph_destroy(plain.g);
        td_graph_destroy(blocked.g);
    }
    free(a);
    free(b);
}

static void kept_weights_hold_until_the_parameters_change(void) {
    float *first = malloc(MAX_FLOATS * sizeof(float)), *again = malloc(MAX_FLOATS * sizeof(float));
    float *changed = malloc(MAX_FLOATS * sizeof(float));
    net m, ref;
    net_build(&m, 1, 1, TD_AMP_O0);
    net_build(&ref, 1, 1, TD_AMP_O0);
    size_t n = net_step(&m, first);
    td_graph_keep_weights(m.g);
    CHECK(net_step(&m, again) == n && memcmp(first, again, n * sizeof(float)) == 0);
    /* fc1's weight changes: the next forward, not kept, lays it out again (as a fresh graph with
     * the same values does); one that kept the old copy would give the first bits */
    td_param *p, *pr;
    size_t np;
    CHECK_OK(td_graph_parameters(m.g, &p, &np));
    CHECK_OK(td_graph_parameters(ref.g, &pr, &np));
    float *w = p[0].data, *wr = pr[0].data;
    for (size_t e = 0; e < p[0].count; e++) w[e] = wr[e] = 0.5f * w[e];
    CHECK(net_step(&m, changed) == n && memcmp(first, changed, n * sizeof(float)) != 0);
    CHECK(net_step(&ref, again) == n && memcmp(changed, again, n * sizeof(float)) == 0);
    /* moved to other memory with other values: laid out again even when kept */
    float *moved = aligned_alloc(64, p[0].count * sizeof(float));
    for (size_t e = 0; e < p[0].count; e++) moved[e] = wr[e] = 2.0f * w[e];
    p[0].data = moved;
    td_graph_keep_weights(m.g);
    CHECK(net_step(&m, changed) == n);
    CHECK(net_step(&ref, again) == n && memcmp(changed, again, n * sizeof(float)) == 0);
    p[0].data = w;
    td_graph_destroy(m.g);
    td_graph_destroy(ref.g);
    free(moved);
    free(first);
    free(again);
    free(changed);
}

/* The CNN's convolutions keep their weight copies too: a kept forward repeats the bits. */
static void kept_convolution_weights_repeat_the_bits(void) {
    size_t cap = 1 << 20;
    float *a = malloc(cap * sizeof(float)), *b = malloc(cap * sizeof(float));
    td_graph *g;
    td_model m;
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_model_build(g, TD_MODEL_CNN, BATCH, 3, &m));
    float *x = td_tensor_data(m.input);
    for (int i = 0; i < BATCH * 784; i++) x[i] = (float)(i % 13) / 13.0f;
    td_param *p;
    size_t n;
    CHECK_OK(td_graph_parameters(g, &p, &n));
    float *out[2] = {a, b};
    size_t k[2] = {0, 0};
    for (int pass = 0; pass < 2; pass++) {
        if (pass) td_graph_keep_weights(g);
        CHECK_OK(td_graph_zero_grad(g));
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_graph_backward(g, m.loss));
        for (size_t i = 0; i < n && k[pass] + p[i].count <= cap; i++) {
            memcpy(out[pass] + k[pass], p[i].grad, p[i].count * sizeof(float));
            k[pass] += p[i].count;
        }
    }
    CHECK(k[0] > 0 && k[0] == k[1] && memcmp(a, b, k[0] * sizeof(float)) == 0);
    td_graph_destroy(g);
    free(a);
    free(b);
}

int main(void) {
    RUN(one_thread_gives_the_same_bits_under_any_caller_count);
    RUN(negative_threads_are_refused);
    RUN(blocked_linear_match_the_plain_layout);
    RUN(kept_weights_hold_until_the_parameters_change);
    RUN(kept_convolution_weights_repeat_the_bits);
    TEST_END();
}
