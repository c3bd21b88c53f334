/* Copies of linear layers' weights in the forward kernel's blocked layout, laid out as the
 * weights are written (td_param.written; src/ops/cpu/linear_layout.c):
 *  - written a group of rows at a time, the layout is byte for byte oneDNN's reorder into the
 *    layout its f32 inner product picks for 16 samples, padding zeros included, for shapes with
 *    and without whole blocks;
 *  - training with blocked linear layers whose optimizer steps lay the copies out gives the bits
 *    of the same training whose forwards reorder the weights themselves (the hook left out), and
 *    the forward after a step takes the step's copy rather than reading the weights again;
 *  - weights written after a step by td_tensor_write or a checkpoint load are laid out again. */
#include <dnnl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/checkpoint.h"
#include "tandem/nn.h"
#include "tandem/optim.h"

#include "ops/cpu/linear_layout.h"
#include "test.h"

enum { N = 16 }; /* samples: the shards' size for which deterministic mode blocks the weights */

/* Values whose magnitudes span 2^-12 .. 2^12, none zero: a misplaced one shows. */
static float spread(td_rng *r) {
    return ldexpf(td_rng_uniform(r) + 0.25f, (int)(td_rng_u32(r) % 25) - 12) *
           (td_rng_u32(r) & 1 ? 1.0f : -1.0f);
}

/* The weights layout oneDNN's f32 inner product forward picks for N samples of in -> out. */
static dnnl_memory_desc_t picked_layout(dnnl_engine_t eng, int64_t in, int64_t out) {
    dnnl_memory_desc_t x, w, y, picked;
    dnnl_dims_t xd = {N, in}, wd = {out, in}, yd = {N, out};
    dnnl_memory_desc_init_by_tag(&x, 2, xd, dnnl_f32, dnnl_ab);
    dnnl_memory_desc_init_by_tag(&w, 2, wd, dnnl_f32, dnnl_format_tag_any);
    dnnl_memory_desc_init_by_tag(&y, 2, yd, dnnl_f32, dnnl_ab);
    dnnl_inner_product_desc_t d;
    dnnl_primitive_desc_t pd;
    memset(&picked, 0, sizeof picked);
    if (dnnl_inner_product_forward_desc_init(&d, dnnl_forward_training, &x, &w, NULL, &y) ||
        dnnl_primitive_desc_create(&pd, &d, NULL, eng, NULL))
        return picked;
    picked = *dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
    dnnl_primitive_desc_destroy(pd);
    return picked;
}

/* oneDNN's reorder of plain w (out, in) into md, into dst. */
static int onednn_reorder(dnnl_engine_t eng, dnnl_stream_t st, const dnnl_memory_desc_t *md,
                          const float *w, int64_t in, int64_t out, void *dst) {
    dnnl_memory_desc_t plain;
    dnnl_dims_t wd = {out, in};
    dnnl_memory_desc_init_by_tag(&plain, 2, wd, dnnl_f32, dnnl_ab);
    dnnl_primitive_desc_t pd;
    dnnl_primitive_t r;
    dnnl_memory_t a, b;
    if (dnnl_reorder_primitive_desc_create(&pd, &plain, eng, md, eng, NULL)) return -1;
    int bad = dnnl_primitive_create(&r, pd) != dnnl_success;
    dnnl_primitive_desc_destroy(pd);
    if (bad) return -1;
    dnnl_memory_create(&a, &plain, eng, (void *)w);
    dnnl_memory_create(&b, md, eng, dst);
    dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, a}, {DNNL_ARG_TO, b}};
    bad = dnnl_primitive_execute(r, st, 2, args) || dnnl_stream_wait(st);
    dnnl_memory_destroy(a);
    dnnl_memory_destroy(b);
    dnnl_primitive_destroy(r);
    return bad ? -1 : 0;
}

static void layout_is_onednns_reorder(void) {
    static const int64_t shapes[][2] = {{1024, 1024}, {784, 1024}, {1024, 10}, {48, 100},
                                        {40, 67},     {3, 5},      {16, 64},   {33, 130}};
    dnnl_engine_t eng;
    dnnl_stream_t st;
    CHECK_EQ(dnnl_engine_create(&eng, dnnl_cpu, 0), dnnl_success);
    CHECK_EQ(dnnl_stream_create(&st, eng, dnnl_stream_default_flags), dnnl_success);
    td_rng rng;
    td_rng_init(&rng, 7);
    int laid = 0;
    for (size_t c = 0; c < sizeof shapes / sizeof *shapes; c++) {
        int64_t in = shapes[c][0], out = shapes[c][1];
        dnnl_memory_desc_t md = picked_layout(eng, in, out);
        td__linear_layout l;
        if (!td__linear_layout_of(&l, &md)) {
            printf("    %lld -> %lld: oneDNN picks a layout this file does not lay out\n",
                   (long long)in, (long long)out);
            continue;
        }
        laid++;
        size_t bytes = dnnl_memory_desc_get_size(&md);
        float *w = malloc((size_t)(in * out) * sizeof *w);
        unsigned char *want = aligned_alloc(64, bytes), *got = aligned_alloc(64, bytes);
        for (int64_t e = 0; e < in * out; e++) w[e] = spread(&rng);
        memset(want, 0xa5, bytes);
        memset(got, 0xa5, bytes); /* padding left unwritten would show */
        CHECK_EQ(onednn_reorder(eng, st, &md, w, in, out, want), 0);
        /* a group at a time for the first half, the rest at once, as writes come */
        int64_t group = td__linear_layout_group(&l);
        int64_t groups = (out + l.rb - 1) / l.rb * (l.rb / group);
        for (int64_t g = 0; g < groups / 2; g++)
            td__linear_layout_rows(&l, (float *)got, w, g, g + 1);
        td__linear_layout_rows(&l, (float *)got, w, groups / 2, groups);
        if (memcmp(want, got, bytes) != 0)
            TEST_FAIL_AT("%lld -> %lld (blocks %lld x %lld): the layout differs from oneDNN's",
                         (long long)in, (long long)out, (long long)l.rb, (long long)l.cb);
        else
            printf("    %lld -> %lld: blocks of %lld rows x %lld columns, as oneDNN lays them\n",
                   (long long)in, (long long)out, (long long)l.rb, (long long)l.cb);
        free(w);
        free(want);
        free(got);
    }
    dnnl_stream_destroy(st);
    dnnl_engine_destroy(eng);
    if (!laid) SKIP("oneDNN picks no layout linear_layout.c lays out on this CPU");
}

/* A two-layer network on N samples with blocked linear layers, SGD with momentum. */
typedef struct {
    td_graph *g;
    td_tensor *x, *y;
    td_param *p;
    size_t np;
    td_optim *opt;
} net;

static void net_init(net *n, int hooked) {
    td_graph_params gp = td_graph_default_params();
    gp.threads = 1;
    gp.blocked_linear = 1;
    td_rng rng;
    td_rng_init(&rng, 11);
    td_tensor *h, *r;
    CHECK_OK(td_graph_create(&n->g, &gp));
    CHECK_OK(td_graph_input(n->g, "x", td_shape_2d(N, 48), TD_F32, 0, &n->x));
    CHECK_OK(td_nn_linear(n->g, "fc1", n->x, 100, 1, &rng, &h));
    CHECK_OK(td_graph_relu(n->g, h, &r));
    CHECK_OK(td_nn_linear(n->g, "fc2", r, 10, 1, &rng, &n->y));
    CHECK_OK(td_graph_compile(n->g));
    CHECK_OK(td_graph_parameters(n->g, &n->p, &n->np));
    if (!hooked)
        for (size_t i = 0; i < n->np; i++) n->p[i].written = NULL;
    td_sgd_params sp = td_sgd_default_params();
    sp.momentum = 0.9;
    CHECK_OK(td_optim_create_sgd(&n->opt, n->p, n->np, &sp));
}

static void net_free(net *n) {
    td_optim_destroy(n->opt);
    td_graph_destroy(n->g);
}

/* One step on inputs made from `seed`: forward (its output into y), backward, optimizer step. */
static void net_step(net *n, uint64_t seed, float *y) {
    td_rng rng;
    td_rng_init(&rng, seed);
    float x[N * 48], dy[N * 10];
    for (size_t e = 0; e < N * 48; e++) x[e] = td_rng_uniform(&rng) - 0.5f;
    for (size_t e = 0; e < N * 10; e++) dy[e] = td_rng_uniform(&rng) - 0.5f;
    CHECK_OK(td_tensor_write(n->x, x));
    CHECK_OK(td_graph_forward(n->g));
    CHECK_OK(td_tensor_read(n->y, y));
    CHECK_OK(td_graph_zero_grad(n->g));
    CHECK_OK(td_graph_backward_from(n->g, n->y, dy));
    CHECK_OK(td_optim_step(n->opt));
}

/* Forward alone on the inputs of `seed`, its output into y. */
static void net_forward(net *n, uint64_t seed, float *y) {
    td_rng rng;
    td_rng_init(&rng, seed);
    float x[N * 48];
    for (size_t e = 0; e < N * 48; e++) x[e] = td_rng_uniform(&rng) - 0.5f;
    CHECK_OK(td_tensor_write(n->x, x));
    CHECK_OK(td_graph_forward(n->g));
    CHECK_OK(td_tensor_read(n->y, y));
}

static int same_params(const net *a, const net *b) {
    for (size_t i = 0; i < a->np; i++)
        if (memcmp(a->p[i].data, b->p[i].data, a->p[i].count * sizeof(float)) != 0) return 0;
    return 1;
}

static void steps_lay_out_the_same_bits(void) {
    net a, b; /* a: the steps lay the copies out; b: each forward reorders */
    net_init(&a, 1);
    net_init(&b, 0);
    size_t hooked = 0;
    for (size_t i = 0; i < a.np; i++) hooked += a.p[i].written != NULL;
    if (!hooked) {
        SKIP("oneDNN picks no layout linear_layout.c lays out on this CPU");
        net_free(&a);
        net_free(&b);
        return;
    }
    CHECK_EQ(hooked, (size_t)2); /* the two weights, not the biases */
    float ya[N * 10], yb[N * 10];
    for (uint64_t step = 0; step < 5; step++) {
        net_step(&a, 100 + step, ya);
        net_step(&b, 100 + step, yb);
        if (memcmp(ya, yb, sizeof ya) != 0)
            TEST_FAIL_AT("step %llu: outputs differ", (unsigned long long)step);
    }
    CHECK(same_params(&a, &b));
    /* The forward after a step reads the copy the step laid out: weights changed behind the
     * graph's back (nothing told) leave it as it was. */
    float *saved = malloc(a.p[0].count * sizeof *saved);
    memcpy(saved, a.p[0].data, a.p[0].count * sizeof *saved);
    memset(a.p[0].data, 0, a.p[0].count * sizeof(float));
    net_forward(&a, 7, ya);
    net_forward(&b, 7, yb);
    CHECK(memcmp(ya, yb, sizeof ya) == 0);
    /* td_tensor_write says so: the copy is laid out again from what it wrote */
    CHECK_OK(td_tensor_write(td_graph_param_tensor(a.g, 0), saved));
    net_step(&a, 200, ya);
    net_step(&b, 200, yb);
    CHECK(memcmp(ya, yb, sizeof ya) == 0);
    CHECK(same_params(&a, &b));
    free(saved);
    net_free(&a);
    net_free(&b);
}

static void loaded_weights_are_laid_out_again(void) {
    char dir[256], path[300];
    test_temp_dir(dir, sizeof dir, "weight_layout");
    snprintf(path, sizeof path, "%s/net.safetensors", dir);
    net a, b;
    net_init(&a, 1);
    net_init(&b, 0);
    float ya[N * 10], yb[N * 10];
    CHECK_OK(td_checkpoint_save(path, a.p, a.np, NULL, 0));
    net_step(&a, 1, ya);
    net_step(&b, 1, yb);
    /* loaded after a step, before the next forward: that forward reads the loaded weights */
    CHECK_OK(td_checkpoint_load(path, a.p, a.np));
    CHECK_OK(td_checkpoint_load(path, b.p, b.np));
    net_forward(&a, 2, ya);
    net_forward(&b, 2, yb);
    CHECK(memcmp(ya, yb, sizeof ya) == 0);
    net_free(&b);
    net_init(&b, 0); /* a fresh net starts from the saved weights too */
    net_forward(&b, 2, yb);
    CHECK(memcmp(ya, yb, sizeof ya) == 0);
    net_free(&a);
    net_free(&b);
    test_remove_dir(dir);
}

int main(void) {
    RUN(layout_is_onednns_reorder);
    RUN(steps_lay_out_the_same_bits);
    RUN(loaded_weights_are_laid_out_again);
    TEST_END();
}
