/* Activation recompute (docs/recompute.md): a model trained with its segments recomputed ends on
 * the same bits as without, gradients after every backward and parameters after every step (f32 and
 * bf16 at O1 and O2, dropout on, masks drawn from the graph's RNG or keyed by sample; a GPT;
 * PyTorch's MNIST example Net with dropout2d; a batch-norm CNN whose running statistics must not be
 * updated twice), also under DDP and ZeRO-3 at 2 ranks with a collective op inside every segment;
 * the graph's memory shrinks by exactly the dropped activations and gradients of all segments but
 * the largest; bad segment specifications are refused by name; on a GPU, recorded sweeps replay the
 * masks (skipped where none is visible). The strategies that drive the graph from outside (ZeRO
 * 1-3, pipelines, deterministic mode, AMP) are checked through examples/gpt, which must print the
 * same parameter digest with and without --recompute. */
#include <libgen.h>
#include <limits.h>

#include "tandem/ddp.h"
#include "tandem/nn.h"
#include "tandem/optim.h"
#include "tandem/zero.h"

#include "test.h"
#include "test_comm_util.h" /* test_run_ranks, test_comm_create */
#include "test_program.h"   /* run, field, printed_sha256 */

/* A call of a layer function that must succeed, or its status returned. */
#define TRY(call)                           \
    do {                                    \
        td_status try_s_ = (call);          \
        if (try_s_ != TD_OK) return try_s_; \
    } while (0)

enum { B = 8, D = 32, H = 64, CLASSES = 8, BLOCKS = 3, STEPS = 3 };

/* What a test block is built from: x + dropout(fc2(dropout(act(fc1(ln(x)))))), with an
 * all-reduce (mean over ranks) after the first dropout when `collective` is set. */
typedef struct {
    float p;
    int relu; /* ReLU (run in place over fc1's output) instead of GELU */
    int collective;
} block_arg;

static td_status block(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                       td_tensor **y) {
    const block_arg *a = arg;
    char pn[64];
    td_tensor *w, *b, *t;
    snprintf(pn, sizeof pn, "%s.ln.weight", name);
    TRY(td_graph_param(g, pn, td_shape_1d(D), &w));
    snprintf(pn, sizeof pn, "%s.ln.bias", name);
    TRY(td_graph_param(g, pn, td_shape_1d(D), &b));
    for (int i = 0; i < D; i++) ((float *)td_tensor_data(w))[i] = 1.f + 0.1f * td_rng_normal(rng);
    TRY(td_graph_layer_norm(g, x, w, b, 1e-5f, &t));
    snprintf(pn, sizeof pn, "%s.fc1", name);
    TRY(td_nn_linear(g, pn, t, H, 1, rng, &t));
    TRY(a->relu ? td_graph_relu(g, t, &t) : td_graph_gelu(g, t, &t));
    TRY(td_graph_dropout(g, t, a->p, &t));
    if (a->collective) TRY(td_graph_all_reduce(g, t, TD_OP_AVG, &t));
    snprintf(pn, sizeof pn, "%s.fc2", name);
    TRY(td_nn_linear(g, pn, t, D, 1, rng, &t));
    TRY(td_graph_dropout(g, t, a->p, &t));
    return td_graph_add(g, x, t, y);
}

static td_status head(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                      td_tensor **y) {
    (void)arg;
    return td_nn_linear(g, name, x, CLASSES, 1, rng, y);
}

/* BLOCKS blocks "block.<i>" and a "head", on (B, D) inputs. */
static td_sequential *blocks_model(block_arg a) {
    td_sequential *s = NULL;
    CHECK_OK(td_sequential_create(&s, td_shape_1d(D)));
    for (int i = 0; i < BLOCKS && s; i++) {
        char name[24];
        snprintf(name, sizeof name, "block.%d", i);
        CHECK_OK(td_sequential_add(s, name, block, &a, sizeof a));
    }
    if (s) CHECK_OK(td_sequential_add(s, "head", head, NULL, 0));
    return s;
}

static td_sequential *gpt_model(void) {
    td_gpt_params p = {.layers = 2, .heads = 2, .width = 32, .context = 16, .vocab = 64};
    td_sequential *s = NULL;
    CHECK_OK(td_gpt_sequential(&p, &s));
    return s;
}

static td_sequential *reference_model(td_model_kind kind) {
    td_sequential *s = NULL;
    CHECK_OK(td_model_sequential(kind, &s));
    return s;
}

/* A model being trained: its graph, tensors and optimizer. */
typedef struct {
    td_graph *g;
    td_model m;
    td_param *p;
    size_t np;
    td_optim *opt;
} net;

static void net_free(net *n) {
    td_optim_destroy(n->opt);
    td_graph_destroy(n->g);
}

static td_adamw_params adamw(void) {
    td_adamw_params ap = td_adamw_default_params();
    ap.lr = 1e-2;
    return ap;
}

/* Builds s for `batch` into a graph of gp with `mode`, fills its input (token ids for a GPT,
 * normal values otherwise, offset by `rank`) and labels, and makes its AdamW. 0 on failure. */
static int net_make(net *n, const td_sequential *s, td_graph_params gp, td_recompute_mode mode,
                    int64_t batch, int rank) {
    memset(n, 0, sizeof *n);
    gp.recompute = mode;
    td_status st = td_graph_create(&n->g, &gp);
    if (st == TD_OK) st = td_model_build_sequential(n->g, s, batch, 7, &n->m);
    if (st == TD_OK) st = td_graph_parameters(n->g, &n->p, &n->np);
    td_adamw_params ap = adamw();
    if (st == TD_OK) st = td_optim_create_adamw(&n->opt, n->p, n->np, &ap);
    CHECK_OK(st);
    size_t nx = st == TD_OK ? (size_t)td_tensor_numel(n->m.input) : 0;
    size_t ny = st == TD_OK ? (size_t)td_tensor_numel(n->m.labels) : 0;
    float *x = malloc((nx ? nx : 1) * sizeof *x);
    int64_t *y = malloc((ny ? ny : 1) * sizeof *y);
    if (st == TD_OK && x && y) {
        td_rng data;
        td_rng_init(&data, 3 + (uint64_t)rank);
        int64_t classes = td_tensor_shape(n->m.output).dim[1];
        for (size_t i = 0; i < nx; i++)
            x[i] = n->m.kind == TD_MODEL_GPT ? (float)td_rng_below(&data, (uint32_t)classes)
                                             : td_rng_normal(&data);
        for (size_t i = 0; i < ny; i++) y[i] = (int64_t)td_rng_below(&data, (uint32_t)classes);
        st = td_tensor_write(n->m.input, x); /* the graph's device may be a GPU */
        if (st == TD_OK) st = td_tensor_write(n->m.labels, y);
        CHECK_OK(st);
    }
    free(x);
    free(y);
    if (st != TD_OK || !x || !y) {
        net_free(n);
        memset(n, 0, sizeof *n);
        return 0;
    }
    return 1;
}

/* Bytes of entry i's data or gradient. */
static size_t entry_bytes(const td_param *p) { return p->count * td_dtype_size(p->dtype); }

/* Whether a and b hold the same bits in every data (grads 0) or gradient (grads 1); the first
 * difference is reported, naming `what`. */
static int same_bits(const td_param *a, const td_param *b, size_t n, int grads, const char *what) {
    for (size_t i = 0; i < n; i++) {
        const void *x = grads ? a[i].grad : a[i].data, *y = grads ? b[i].grad : b[i].data;
        if (memcmp(x, y, entry_bytes(&a[i])) == 0) continue;
        TEST_FAIL_AT("%s: %s of %s differs", what, grads ? "the gradient" : "the value", a[i].name);
        return 0;
    }
    return 1;
}

/* One training step's forward and backward (keyed by sample when by_sample). */
static void forward_backward(net *n, int step, int by_sample) {
    if (by_sample) CHECK_OK(td_graph_set_rng_key(n->g, (uint64_t)step, 0));
    CHECK_OK(td_graph_zero_grad(n->g));
    CHECK_OK(td_graph_forward(n->g));
    CHECK_OK(td_graph_backward(n->g, n->m.loss));
}

/* Trains s without recompute and with `mode`, side by side, STEPS steps: the losses, every
 * gradient after each backward, every parameter after each step and every buffer at the end
 * must be the same bits; the recomputing graph must hold less memory. */
static void same_training(const td_sequential *s, td_graph_params gp, td_recompute_mode mode,
                          int64_t batch, int by_sample, const char *what) {
    net a, b;
    if (!net_make(&a, s, gp, TD_RECOMPUTE_NONE, batch, 0)) return;
    if (!net_make(&b, s, gp, mode, batch, 0)) {
        net_free(&a);
        return;
    }
    int ok = 1;
    for (int step = 0; step < STEPS && ok; step++) {
        forward_backward(&a, step, by_sample);
        forward_backward(&b, step, by_sample);
        ok = memcmp(td_tensor_data(a.m.loss), td_tensor_data(b.m.loss), sizeof(float)) == 0;
        if (!ok) TEST_FAIL_AT("%s: the loss of step %d differs", what, step);
        ok = ok && same_bits(a.p, b.p, a.np, 1, what);
        CHECK_OK(td_optim_step(a.opt));
        CHECK_OK(td_optim_step(b.opt));
        ok = ok && same_bits(a.p, b.p, a.np, 0, what);
    }
    td_param *ab, *bb;
    size_t nab, nbb;
    CHECK_OK(td_graph_buffers(a.g, &ab, &nab));
    CHECK_OK(td_graph_buffers(b.g, &bb, &nbb));
    CHECK_EQ(nab, nbb);
    ok = ok && nab == nbb && same_bits(ab, bb, nab, 0, what);
    size_t ma = td_graph_memory_bytes(a.g), mb = td_graph_memory_bytes(b.g);
    if (ok)
        printf("    %s: the same bits over %d steps; graph memory %zu -> %zu bytes (%.0f%%)\n",
               what, STEPS, ma, mb, 100.0 * (double)mb / (double)ma);
    CHECK(mb < ma);
    net_free(&a);
    net_free(&b);
}

static void blocks_with_dropout_train_to_the_same_bits(void) {
    block_arg a = {.p = 0.3f};
    td_sequential *s = blocks_model(a);
    if (!s) return;
    td_graph_params gp = td_graph_default_params();
    same_training(s, gp, TD_RECOMPUTE_FULL, B, 0, "full");
    same_training(s, gp, TD_RECOMPUTE_SELECTIVE, B, 0, "selective");
    gp.recompute_keep = "gelu"; /* the linears run again, each dropout as well */
    same_training(s, gp, TD_RECOMPUTE_SELECTIVE, B, 0, "selective, gelu kept");
    td_sequential_destroy(s);
    a.relu = 1; /* fc1's output then holds the ReLU's values, in place */
    s = blocks_model(a);
    if (s) same_training(s, td_graph_default_params(), TD_RECOMPUTE_FULL, B, 0, "full, ReLU");
    td_sequential_destroy(s);
}

static void masks_keyed_by_sample_replay(void) {
    block_arg a = {.p = 0.5f};
    td_sequential *s = blocks_model(a);
    if (s) same_training(s, td_graph_default_params(), TD_RECOMPUTE_FULL, B, 1, "by sample");
    td_sequential_destroy(s);
}

static void bf16_amp_trains_to_the_same_bits(void) {
    block_arg a = {.p = 0.3f};
    td_sequential *s = blocks_model(a), *gpt = gpt_model();
    td_graph_params gp = td_graph_default_params();
    gp.amp.level = TD_AMP_O1;
    if (s) same_training(s, gp, TD_RECOMPUTE_FULL, B, 0, "O1 full");
    if (gpt) same_training(gpt, gp, TD_RECOMPUTE_SELECTIVE, 2, 0, "GPT O1 selective");
    gp.amp.level = TD_AMP_O2;
    if (s) same_training(s, gp, TD_RECOMPUTE_FULL, B, 0, "O2 full");
    td_sequential_destroy(s);
    td_sequential_destroy(gpt);
}

static void gpt_trains_to_the_same_bits(void) {
    td_sequential *s = gpt_model();
    if (!s) return;
    same_training(s, td_graph_default_params(), TD_RECOMPUTE_FULL, 4, 0, "GPT full");
    same_training(s, td_graph_default_params(), TD_RECOMPUTE_SELECTIVE, 4, 0, "GPT selective");
    td_sequential_destroy(s);
}

/* PyTorch's MNIST example Net (dropout2d after a convolution, dropout after fc1) and the CNN,
 * whose batch norms update their running statistics in forward: run twice, they would move
 * twice. */
static void conv_models_train_to_the_same_bits(void) {
    td_sequential *net_s = reference_model(TD_MODEL_NET), *cnn = reference_model(TD_MODEL_CNN);
    if (net_s) same_training(net_s, td_graph_default_params(), TD_RECOMPUTE_FULL, 4, 0, "Net full");
    if (cnn) same_training(cnn, td_graph_default_params(), TD_RECOMPUTE_FULL, 2, 0, "CNN full");
    td_sequential_destroy(net_s);
    td_sequential_destroy(cnn);
}

/* td_graph_memory_bytes of s built with gp (0 when it fails). */
static size_t memory_of(const td_sequential *s, td_graph_params gp) {
    td_graph *g = NULL;
    td_model m;
    CHECK_OK(td_graph_create(&g, &gp));
    if (!g) return 0;
    td_status st = td_model_build_sequential(g, s, B, 7, &m);
    CHECK_OK(st);
    size_t bytes = st == TD_OK ? td_graph_memory_bytes(g) : 0;
    td_graph_destroy(g);
    return bytes;
}

/* Each block's activations are (B, D) or (B, H) f32, every one with a gradient as large; the
 * block's output (the residual add) is read by the next layer and stays. Full recompute drops
 * ln, fc1, gelu, dropout, fc2, dropout: 3 (B, D) and 3 (B, H); selective keeps the linears'.
 * The region holds one block's, so the graph saves all the others'. */
static void memory_shrinks_by_the_dropped_activations(void) {
    block_arg a = {.p = 0.3f};
    td_sequential *s = blocks_model(a);
    if (!s) return;
    size_t bd = B * D * sizeof(float), bh = B * H * sizeof(float);
    size_t full = 2 * (3 * bd + 3 * bh), selective = 2 * (2 * bd + 2 * bh);
    td_graph_params gp = td_graph_default_params();
    size_t none = memory_of(s, gp);
    gp.recompute = TD_RECOMPUTE_FULL;
    size_t f = memory_of(s, gp);
    gp.recompute_segments = "block.0,block.2";
    size_t two = memory_of(s, gp);
    gp.recompute_segments = NULL;
    gp.recompute = TD_RECOMPUTE_SELECTIVE;
    size_t sel = memory_of(s, gp);
    printf("    graph memory: %zu bytes, full %zu, full in 2 of 3 blocks %zu, selective %zu\n", none,
           f, two, sel);
    CHECK_EQ(none - f, (BLOCKS - 1) * full);
    CHECK_EQ(none - two, full);
    CHECK_EQ(none - sel, (BLOCKS - 1) * selective);
    td_sequential_destroy(s);
}

/* Expects compiling s with gp to fail with `status` and a message holding `words`. */
static void refused(const td_sequential *s, td_graph_params gp, td_status status,
                    const char *words) {
    td_graph *g = NULL;
    td_model m;
    CHECK_OK(td_graph_create(&g, &gp));
    if (!g) return;
    CHECK_STATUS(td_model_build_sequential(g, s, 2, 7, &m), status);
    if (!strstr(td_last_error(), words))
        TEST_FAIL_AT("'%s' does not say '%s'", td_last_error(), words);
    td_graph_destroy(g);
}

static void bad_specifications_are_refused_by_name(void) {
    td_sequential *s = gpt_model();
    if (!s) return;
    td_graph_params gp = td_graph_default_params();
    gp.recompute = TD_RECOMPUTE_FULL;
    gp.recompute_segments = "h.0,h.9";
    refused(s, gp, TD_ENOTFOUND, "names 'h.9', which is no segment");
    CHECK(strstr(td_last_error(), "embed, h.0, h.1, head") != NULL);
    gp.recompute_segments = "h.0,,h.1";
    refused(s, gp, TD_EINVAL, "empty name");
    gp.recompute_segments = "h"; /* h.0 and h.1 */
    size_t h = memory_of(s, gp);
    CHECK(h > 0);
    gp.recompute_segments = NULL;
    gp.recompute = TD_RECOMPUTE_SELECTIVE;
    gp.recompute_keep = "linear,lineer";
    refused(s, gp, TD_ENOTFOUND, "names 'lineer', which no node of this graph is");
    CHECK(strstr(td_last_error(), "attention") != NULL);
    td_sequential_destroy(s);

    td_graph *g = NULL;
    gp = td_graph_default_params();
    gp.recompute = (td_recompute_mode)7;
    CHECK_STATUS(td_graph_create(&g, &gp), TD_EINVAL);
    CHECK(strstr(td_last_error(), "recompute = 7") != NULL);
    gp.recompute = TD_RECOMPUTE_FULL;
    CHECK_OK(td_graph_create(&g, &gp));
    if (!g) return;
    td_tensor *x, *y;
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(2, 4), TD_F32, 1, &x));
    CHECK_STATUS(td_graph_segment_end(g), TD_ESTATE);
    CHECK_STATUS(td_graph_segment_begin(g, "a,b"), TD_EINVAL);
    CHECK_STATUS(td_graph_segment_begin(g, ""), TD_EINVAL);
    CHECK_OK(td_graph_segment_begin(g, "outer"));
    CHECK_STATUS(td_graph_segment_begin(g, "inner"), TD_ESTATE);
    CHECK(strstr(td_last_error(), "'inner' begins inside segment 'outer'") != NULL);
    CHECK_OK(td_graph_relu(g, x, &y));
    CHECK_STATUS(td_graph_compile(g), TD_ESTATE);
    CHECK(strstr(td_last_error(), "segment 'outer' was begun and never ended") != NULL);
    td_graph_destroy(g);
    /* recompute asked for with nothing marked */
    CHECK_OK(td_graph_create(&g, &gp));
    if (!g) return;
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(2, 4), TD_F32, 1, &x));
    CHECK_OK(td_graph_relu(g, x, &y));
    CHECK_STATUS(td_graph_compile(g), TD_EINVAL);
    CHECK(strstr(td_last_error(), "no segment is marked") != NULL);
    td_graph_destroy(g);
}

/* ---- DDP and ZeRO-3 at 2 ranks, an all-reduce inside every segment ----------------------- */

/* The digest of entries [0, n): their values, or their gradients (grads 1). */
static void digest_of(const td_param *p, size_t n, int grads, char hex[65]) {
    td_param *view = malloc((n ? n : 1) * sizeof *view);
    hex[0] = 0;
    if (!view) return;
    for (size_t i = 0; i < n; i++) {
        view[i] = p[i];
        if (grads) view[i].data = p[i].grad;
    }
    CHECK_OK(td_params_sha256(view, n, hex));
    free(view);
}

/* This rank's STEPS of AdamW at 2 ranks under DDP (zero_stage 0) or ZeRO stage 3 (a unit per
 * block, no prefetch: a block's parameters are gathered only when the hook says so); the graph's
 * process group runs the blocks' all-reduces. Gives the digest of the parameters this rank steps
 * (ZeRO: its shards) and, under DDP, of the last averaged gradients. */
static void distributed_train(td_comm *comm, int rank, td_recompute_mode mode, int zero_stage,
                              char params_hex[65], char grads_hex[65]) {
    block_arg a = {.p = 0.3f, .collective = 1};
    td_sequential *s = blocks_model(a);
    td_graph_params gp = td_graph_default_params();
    gp.comm = comm;
    params_hex[0] = grads_hex[0] = 0;
    net n;
    int made = s && net_make(&n, s, gp, mode, B / 2, rank);
    td_sequential_destroy(s);
    if (!made) return;
    td_ddp_params dp = td_ddp_default_params();
    dp.first_bucket_bytes = dp.bucket_bytes = 4096; /* several buckets, launched in backward */
    td_ddp *ddp = NULL;
    td_zero *zero = NULL;
    td_param *stepped = n.p;
    size_t n_stepped = n.np;
    if (zero_stage) {
        static const char *const units[] = {"block.0", "block.1", "block.2", "head"};
        td_zero_params zp = td_zero_default_params();
        zp.stage = zero_stage;
        zp.units = units;
        zp.n_units = 4;
        zp.prefetch = 0;
        zp.ddp = dp;
        CHECK_OK(td_zero_create(&zero, comm, n.p, n.np, NULL, 0, &zp));
        if (zero) {
            CHECK_OK(td_zero_parameters(zero, &stepped, &n_stepped));
            td_graph_set_grad_ready_hook(n.g, td_zero_grad_ready_hook, zero);
            td_graph_set_param_use_hook(n.g, td_zero_param_use_hook, zero);
            td_optim_destroy(n.opt);
            td_adamw_params ap = adamw();
            n.opt = NULL;
            CHECK_OK(td_optim_create_adamw(&n.opt, stepped, n_stepped, &ap));
        }
    } else {
        CHECK_OK(td_ddp_create(&ddp, comm, n.p, n.np, NULL, 0, &dp));
        if (ddp) td_graph_set_grad_ready_hook(n.g, td_ddp_grad_ready_hook, ddp);
    }
    for (int step = 0; (ddp || zero) && n.opt && step < STEPS; step++) {
        CHECK_OK(zero ? td_zero_prepare_forward(zero) : td_ddp_prepare_forward(ddp));
        forward_backward(&n, step, 0);
        CHECK_OK(zero ? td_zero_finish_backward(zero) : td_ddp_finish_backward(ddp));
        CHECK_OK(td_optim_step(n.opt));
    }
    if (ddp) {
        CHECK(td_ddp_get_stats(ddp).buckets_early > 0);
        digest_of(n.p, n.np, 1, grads_hex);
    }
    if (ddp || zero) digest_of(stepped, n_stepped, 0, params_hex);
    td_graph_set_grad_ready_hook(n.g, NULL, NULL);
    td_graph_set_param_use_hook(n.g, NULL, NULL);
    td_ddp_destroy(ddp);
    td_zero_destroy(zero);
    net_free(&n);
}

static void distributed_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 20));
    if (!comm) return;
    for (int stage = 0; stage <= 3; stage += 3) {
        char pa[65], ga[65], pb[65], gb[65];
        const char *what = stage ? "ZeRO-3" : "DDP";
        distributed_train(comm, rank, TD_RECOMPUTE_NONE, stage, pa, ga);
        distributed_train(comm, rank, TD_RECOMPUTE_FULL, stage, pb, gb);
        CHECK(strlen(pa) == 64);
        if (strcmp(pa, pb) || strcmp(ga, gb))
            TEST_FAIL_AT("rank %d, %s: parameters %.16s / %.16s, gradients %.16s / %.16s without "
                         "and with recompute",
                         rank, what, pa, pb, ga, gb);
        else
            printf("    rank %d, %s, the all-reduces run again in backward: the same bits\n",
                   rank, what);
    }
    td_comm_destroy(comm);
}

static void ddp_and_zero3_2_ranks_with_collectives_recomputed(void) {
    CHECK_EQ(test_run_ranks(2, distributed_rank, NULL, 90, 0), 0);
}

/* ---- recorded sweeps on a GPU ------------------------------------------------------------- */

/* On a GPU a sweep run twice the same way is recorded as a CUDA graph and then replayed: the
 * recomputing graph's recorded backward runs its dropout kernels again with each step's own
 * forward key, and trains to the same bits as a graph that keeps its activations. */
static void gpu_recorded_sweeps_replay_the_masks(void) {
    int gpus = 0;
    CHECK_OK(td_cuda_device_count(&gpus));
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    block_arg a = {.p = 0.3f};
    td_sequential *s = blocks_model(a);
    if (!s) return;
    td_graph_params gp = td_graph_default_params();
    gp.device = td_device_cuda(0);
    net n[2];
    char params[2][65], grads[2][65];
    int made = 0;
    for (int d = 0; d < 2; d++)
        made += net_make(&n[d], s, gp, d ? TD_RECOMPUTE_FULL : TD_RECOMPUTE_NONE, B, 0);
    for (int step = 0; made == 2 && step < 6; step++)
        for (int d = 0; d < 2; d++) {
            forward_backward(&n[d], step, 0);
            digest_of(n[d].p, n[d].np, 1, grads[d]);
            CHECK_OK(td_optim_step(n[d].opt));
        }
    if (made == 2) {
        for (int d = 0; d < 2; d++) digest_of(n[d].p, n[d].np, 0, params[d]);
        if (strcmp(params[0], params[1]) || strcmp(grads[0], grads[1]))
            TEST_FAIL_AT("parameters %.16s / %.16s, gradients %.16s / %.16s without and with "
                         "recompute",
                         params[0], params[1], grads[0], grads[1]);
        const char *why;
        CHECK(td_graph_replays(n[1].g, &why) >= 6); /* forward and backward from the third step */
        if (why) TEST_FAIL_AT("recording was given up: %s", why);
    }
    net_free(&n[0]);
    net_free(&n[1]);
    td_sequential_destroy(s);
}

/* ---- the strategies through examples/gpt -------------------------------------------------- */

static char example[PATH_MAX], launcher[PATH_MAX], text[128];

#define TINY                                                                       \
    "--layers 2 --heads 2 --width 32 --context 32 --batch 8 --steps 3 --warmup 2 " \
    "--eval-every 0 --eval-batches 1 --sample 0"

/* examples/gpt at `world` ranks with `args`, then again with --recompute full and selective:
 * the same parameter digest, in less memory. */
static void same_digest(int world, const char *args) {
    char want[65], got[65];
    const char *modes[] = {"", " --recompute full", " --recompute selective"};
    const char *memory = strstr(args, "--pipeline") ? "activation memory: " : "graph memory: ";
    double mib[3];
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(run("OMP_NUM_THREADS=1 %s --nproc-per-node %d %s --data %s " TINY " %s%s",
                     launcher, world, example, text, args, modes[i]),
                 0);
        CHECK(!i || strstr(output, modes[i] + 3) != NULL); /* the banner's "recompute full" */
        mib[i] = field(memory);
        printed_sha256(i ? got : want);
        if (i && strcmp(want, got))
            TEST_FAIL_AT("world %d, %s%s: %s, without recompute %s", world, args, modes[i], got,
                         want);
    }
    CHECK(strlen(want) == 64);
    CHECK(mib[0] > 0 && mib[1] < mib[0] && mib[2] < mib[0]);
    printf("    world %d %s: %.16s... with and without recompute; %s%.2f, %.2f, %.2f MiB\n",
           world, args, want, memory, mib[0], mib[1], mib[2]);
}

static void strategies_train_to_the_same_bits(void) {
    same_digest(1, "--amp");
    same_digest(2, "--zero 3");
    same_digest(2, "--zero 2 --amp");
    same_digest(2, "--deterministic --shards 2");
    same_digest(2, "--pipeline 1f1b --micro-batches 2 --split h.1");
}

int main(int argc, char **argv) {
    (void)argc;
    char self[PATH_MAX], *dir;
    if (!realpath(argv[0], self)) {
        perror(argv[0]);
        return 1;
    }
    dir = dirname(self); /* BUILD/tests */
    snprintf(example, sizeof example, "%s/../examples/gpt", dir);
    snprintf(launcher, sizeof launcher, "%s/../bin/tandemrun", dir);
    snprintf(text, sizeof text, "/tmp/td_test_recompute_%d.txt", (int)getpid());
    FILE *f = fopen(text, "w");
    if (!f) return 1;
    for (int i = 0; i < 400; i++)
        fprintf(f, "It is a truth universally acknowledged, line %d of a small text.\n", i);
    fclose(f);
    RUN(blocks_with_dropout_train_to_the_same_bits);
    RUN(masks_keyed_by_sample_replay);
    RUN(bf16_amp_trains_to_the_same_bits);
    RUN(gpt_trains_to_the_same_bits);
    RUN(conv_models_train_to_the_same_bits);
    RUN(memory_shrinks_by_the_dropped_activations);
    RUN(bad_specifications_are_refused_by_name);
    RUN(ddp_and_zero3_2_ranks_with_collectives_recomputed);
    RUN(gpu_recorded_sweeps_replay_the_masks);
    RUN(strategies_train_to_the_same_bits);
    remove(text);
    TEST_END();
}
