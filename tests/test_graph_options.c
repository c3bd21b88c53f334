/* Graph options that change how the CPU kernels run, not what they compute: the thread count
 * of a graph's kernels (td_graph_params.threads). A graph on one thread trains the CNN (batch
 * norm, convolutions whose weight gradients sum over the batch) to the same gradient bits
 * whatever OpenMP count its caller has, while the caller's own count (which the same graph
 * without the option follows, to other bits) comes back after every call. */
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

int main(void) {
    RUN(one_thread_gives_the_same_bits_under_any_caller_count);
    RUN(negative_threads_are_refused);
    TEST_END();
}
