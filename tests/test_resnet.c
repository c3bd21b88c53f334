/* The ResNet and the sequential models it is built as. Against PyTorch: two small ResNets
 * (BasicBlock and Bottleneck, made by tests/fixtures/models/make_resnet_ref.py with torch 1.13)
 * load their state_dict by name and must give PyTorch's log-probabilities, loss, every
 * parameter gradient, the running statistics after a training forward and the eval output.
 * Then the layer lists: names and shapes of the default ResNet, cutting a model at any layer
 * builds the same parameters and the same output as building it whole, lookup of cuts by name,
 * and the errors of a bad description. Then torchvision's resnet18 .. resnet152: their parameter
 * counts, resnet50's state_dict names and shapes, and one training step of the ImageNet stem. */
#include <string.h>

#include "tandem/checkpoint.h"
#include "tandem/nn.h"

#include "test.h"

#define REF "tests/fixtures/models/resnet_ref.safetensors"

/* |got - want| <= rtol * max|want| + atol over n values; fails the case naming `what`. */
static void check_close(const char *what, const float *got, const float *want, size_t n,
                        double rtol, double atol) {
    double scale = 0, worst = 0;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(want[i]));
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        if (d > worst) worst = d;
        if (!(d <= rtol * scale + atol) && bad++ == 0) first = i;
    }
    if (bad)
        TEST_FAIL_AT("%s: %zu of %zu differ, first [%zu] %.9g vs PyTorch %.9g (worst %.3g, scale "
                     "%.3g)",
                     what, bad, n, first, (double)got[first], (double)want[first], worst, scale);
}

/* Elements of tensor `name` of the fixture (0 when absent). */
static size_t ref_count(td_checkpoint *ck, const char *name) {
    for (size_t i = 0; i < td_checkpoint_count(ck); i++) {
        td_param info;
        if (td_checkpoint_tensor(ck, i, &info) == TD_OK && strcmp(info.name, name) == 0)
            return info.count;
    }
    return 0;
}

/* Reads tensor `name` of the fixture into a new buffer of `count` elements of `dtype`. */
static void *ref_read(td_checkpoint *ck, const char *name, td_dtype dtype, size_t count) {
    for (size_t i = 0; i < td_checkpoint_count(ck); i++) {
        td_param info;
        if (td_checkpoint_tensor(ck, i, &info) || strcmp(info.name, name)) continue;
        if (info.dtype != dtype || info.count != count) {
            TEST_FAIL_AT("%s: %zu elements of %s, expected %zu of %s", name, info.count,
                         td_dtype_name(info.dtype), count, td_dtype_name(dtype));
            return NULL;
        }
        void *buf = malloc(count * td_dtype_size(dtype));
        info.data = buf;
        CHECK_OK(td_checkpoint_read(ck, &info, 1));
        return buf;
    }
    TEST_FAIL_AT("%s: not in %s", name, REF);
    return NULL;
}

static void pytorch_case(td_checkpoint *ck, const char *tag) {
    char name[128];
    snprintf(name, sizeof name, "%s.config", tag);
    int64_t *cfg = ref_read(ck, name, TD_I64, ref_count(ck, name));
    if (!cfg) return;
    td_resnet_params rp = td_resnet_default_params();
    rp.block = cfg[0] ? TD_RESNET_BOTTLENECK : TD_RESNET_BASIC;
    rp.base_width = cfg[1];
    rp.stages = (int)cfg[2];
    for (int i = 0; i < rp.stages; i++) rp.blocks[i] = (int)cfg[3 + i];
    free(cfg);
    const int B = 3;
    td_sequential *s;
    td_graph *g;
    td_model m;
    CHECK_OK(td_resnet_sequential(&rp, &s));
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_model_build_sequential(g, s, B, 1, &m));
    CHECK_EQ(m.kind, TD_MODEL_RESNET);
    td_param *p, *b;
    size_t np, nb;
    CHECK_OK(td_graph_parameters(g, &p, &np));
    CHECK_OK(td_graph_buffers(g, &b, &nb));
    /* The graph's parameters and buffers under the fixture's names: loading by name is the
     * check that the names are torchvision's. */
    td_param *state = calloc(np + nb, sizeof *state);
    char(*names)[96] = calloc(np + nb, sizeof *names);
    for (size_t i = 0; i < np + nb; i++) {
        state[i] = i < np ? p[i] : b[i - np];
        snprintf(names[i], sizeof names[i], "%s.state.%s", tag, state[i].name);
        state[i].name = names[i];
    }
    CHECK_OK(td_checkpoint_read(ck, state, np + nb));
    snprintf(name, sizeof name, "%s.x", tag);
    float *x = ref_read(ck, name, TD_F32, (size_t)B * 784);
    snprintf(name, sizeof name, "%s.labels", tag);
    int64_t *labels = ref_read(ck, name, TD_I64, B);
    if (x && labels) {
        CHECK_OK(td_tensor_write(m.input, x));
        CHECK_OK(td_tensor_write(m.labels, labels));
    }
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_graph_backward(g, m.loss));
    float logp[30], loss;
    CHECK_OK(td_tensor_read(m.output, logp));
    CHECK_OK(td_tensor_read(m.loss, &loss));
    snprintf(name, sizeof name, "%s.logp", tag);
    float *want = ref_read(ck, name, TD_F32, 30);
    if (want) check_close("train log-probabilities", logp, want, 30, 1e-5, 1e-5);
    free(want);
    snprintf(name, sizeof name, "%s.loss", tag);
    want = ref_read(ck, name, TD_F32, 1);
    if (want) CHECK_NEAR(loss, want[0], 1e-5);
    free(want);
    for (size_t i = 0; i < np; i++) {
        snprintf(name, sizeof name, "%s.grad.%s", tag, p[i].name);
        want = ref_read(ck, name, TD_F32, p[i].count);
        if (want) check_close(name, p[i].grad, want, p[i].count, 1e-4, 1e-6);
        free(want);
    }
    size_t running = 0;
    for (size_t i = 0; i < nb; i++) {
        snprintf(name, sizeof name, "%s.after.%s", tag, b[i].name);
        want = ref_read(ck, name, TD_F32, b[i].count);
        if (want) check_close(name, b[i].data, want, b[i].count, 1e-5, 1e-6);
        running += want != NULL;
        free(want);
    }
    CHECK_EQ(running, nb);
    td_graph_set_training(g, 0);
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_tensor_read(m.output, logp));
    snprintf(name, sizeof name, "%s.eval_logp", tag);
    want = ref_read(ck, name, TD_F32, 30);
    if (want) check_close("eval log-probabilities", logp, want, 30, 1e-5, 1e-5);
    free(want);
    printf("    %s: %zu parameters, %zu buffers match PyTorch\n", tag, np, nb);
    free(x);
    free(labels);
    free(state);
    free(names);
    td_graph_destroy(g);
    td_sequential_destroy(s);
}

static void resnet_matches_pytorch(void) {
    td_checkpoint *ck;
    CHECK_OK(td_checkpoint_open(&ck, test_source_path(REF)));
    if (!ck) return;
    pytorch_case(ck, "basic");
    pytorch_case(ck, "bottleneck");
    td_checkpoint_close(ck);
}

static void default_resnet_layers_and_shapes(void) {
    td_sequential *s;
    CHECK_OK(td_model_sequential(TD_MODEL_RESNET, &s));
    const char *names[] = {"stem", "layer1.0", "layer2.0", "layer3.0", "layer4.0", "fc"};
    int64_t channels[] = {1, 16, 16, 32, 64, 128}, size[] = {28, 28, 28, 14, 7, 4};
    CHECK_EQ(td_sequential_count(s), 6);
    for (size_t i = 0; i < 6; i++) {
        CHECK(strcmp(td_sequential_layer_name(s, i), names[i]) == 0);
        td_shape sh;
        CHECK_OK(td_sequential_shape_at(s, i, 5, &sh));
        CHECK_EQ(sh.ndim, 4);
        CHECK_EQ(sh.dim[0], 5);
        CHECK_EQ(sh.dim[1], channels[i]);
        CHECK_EQ(sh.dim[2], size[i]);
    }
    td_shape out;
    CHECK_OK(td_sequential_shape_at(s, 6, 5, &out));
    CHECK(out.ndim == 2 && out.dim[0] == 5 && out.dim[1] == 10);
    size_t at;
    CHECK_OK(td_sequential_find(s, "layer3", &at));
    CHECK_EQ(at, 3);
    CHECK_OK(td_sequential_find(s, "fc", &at));
    CHECK_EQ(at, 5);
    CHECK_STATUS(td_sequential_find(s, "layer9", &at), TD_ENOTFOUND);
    CHECK(strstr(td_last_error(), "layer2.0") != NULL);
    CHECK_STATUS(td_sequential_find(s, "layer", &at), TD_ENOTFOUND); /* no partial words */
    td_sequential_destroy(s);

    td_model_kind kind;
    CHECK_OK(td_model_kind_parse("resnet", &kind));
    CHECK_EQ(kind, TD_MODEL_RESNET);
    CHECK(strcmp(td_model_name(TD_MODEL_RESNET), "resnet") == 0);
    td_graph *g;
    td_model m;
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_model_build(g, TD_MODEL_RESNET, 2, 3, &m));
    td_param *p;
    size_t n, total = 0;
    CHECK_OK(td_graph_parameters(g, &p, &n));
    for (size_t i = 0; i < n; i++) total += p[i].count;
    CHECK_EQ(total, 308538);
    CHECK(strcmp(p[0].name, "conv1.weight") == 0);
    CHECK(strcmp(p[n - 1].name, "fc.bias") == 0);
    td_graph_destroy(g);

    /* A deeper bottleneck variant builds too. */
    td_resnet_params rp = td_resnet_default_params();
    rp.block = TD_RESNET_BOTTLENECK;
    rp.stages = 3;
    rp.blocks[0] = 2;
    CHECK_OK(td_resnet_sequential(&rp, &s));
    CHECK_EQ(td_sequential_count(s), 6);
    CHECK_OK(td_sequential_shape_at(s, 5, 1, &out));
    CHECK_EQ(out.dim[1], 64 * 4);
    td_sequential_destroy(s);
    rp.stages = 0;
    CHECK_STATUS(td_resnet_sequential(&rp, &s), TD_EINVAL);
}

/* torchvision's resnet50 state_dict less num_batches_tracked, written out from its module
 * tree: parameters (or buffers) in module order, each with its shape (unused dims 0). */
typedef struct {
    int buffers;
    size_t n;
    char name[200][48];
    int64_t shape[200][4];
} keys;

static void key(keys *k, const char *module, const char *what, int64_t d0, int64_t d1, int64_t d2,
                int64_t d3) {
    snprintf(k->name[k->n], sizeof k->name[k->n], "%s%s", module, what);
    int64_t d[4] = {d0, d1, d2, d3};
    memcpy(k->shape[k->n++], d, sizeof d);
}

static void conv_keys(keys *k, const char *module, int64_t out, int64_t in, int64_t size) {
    if (!k->buffers) key(k, module, ".weight", out, in, size, size);
}

static void bn_keys(keys *k, const char *module, int64_t c) {
    key(k, module, k->buffers ? ".running_mean" : ".weight", c, 0, 0, 0);
    key(k, module, k->buffers ? ".running_var" : ".bias", c, 0, 0, 0);
}

/* conv1, bn1, layer1..4 of Bottlenecks [3, 4, 6, 3] (conv1..3, bn1..3, and downsample.0 and
 * .1 in each stage's first block), fc. */
static void torchvision_resnet50_keys(keys *k) {
    conv_keys(k, "conv1", 64, 3, 7);
    bn_keys(k, "bn1", 64);
    const int blocks[4] = {3, 4, 6, 3};
    int64_t in = 64;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < blocks[i]; j++) {
            int64_t planes = 64 << i;
            char m[40];
#define AT(what) (snprintf(m, sizeof m, "layer%d.%d.%s", i + 1, j, what), m)
            conv_keys(k, AT("conv1"), planes, in, 1);
            bn_keys(k, AT("bn1"), planes);
            conv_keys(k, AT("conv2"), planes, planes, 3);
            bn_keys(k, AT("bn2"), planes);
            conv_keys(k, AT("conv3"), planes * 4, planes, 1);
            bn_keys(k, AT("bn3"), planes * 4);
            if (j == 0) {
                conv_keys(k, AT("downsample.0"), planes * 4, in, 1);
                bn_keys(k, AT("downsample.1"), planes * 4);
            }
#undef AT
            in = planes * 4;
        }
    if (k->buffers) return;
    key(k, "fc", ".weight", 1000, 2048, 0, 0);
    key(k, "fc", ".bias", 1000, 0, 0, 0);
}

/* The graph's parameters (or buffers) must be torchvision's keys, in order, with their shapes. */
static void check_resnet50_keys(td_graph *g, int buffers) {
    td_param *p;
    size_t n;
    CHECK_OK(buffers ? td_graph_buffers(g, &p, &n) : td_graph_parameters(g, &p, &n));
    keys *k = calloc(1, sizeof *k);
    k->buffers = buffers;
    torchvision_resnet50_keys(k);
    CHECK_EQ(k->n, buffers ? 106 : 161); /* 320 keys with the 53 num_batches_tracked */
    CHECK_EQ(n, k->n);
    for (size_t i = 0; i < n && i < k->n; i++) {
        int64_t d[4] = {0, 0, 0, 0};
        for (int j = 0; j < p[i].ndim && j < 4; j++) d[j] = p[i].shape[j];
        if (strcmp(p[i].name, k->name[i]) || memcmp(d, k->shape[i], sizeof d)) {
            TEST_FAIL_AT("%s %zu: '%s' (%lld, %lld, %lld, %lld), torchvision '%s' (%lld, %lld, "
                         "%lld, %lld)",
                         buffers ? "buffer" : "parameter", i, p[i].name, (long long)d[0],
                         (long long)d[1], (long long)d[2], (long long)d[3], k->name[i],
                         (long long)k->shape[i][0], (long long)k->shape[i][1],
                         (long long)k->shape[i][2], (long long)k->shape[i][3]);
            break;
        }
    }
    free(k);
}

/* torchvision's resnet<depth>: blocks, layers, shapes after the stem and before the head, and
 * the parameter count of the model built. Building draws every weight (about 50 ns each on one
 * core: 3 s and 240 MB for resnet152), so by default only resnet18 and resnet50 are built, one
 * of each block kind; TD_LONG=1 builds all five. */
static void torchvision_resnets(void) {
    const struct {
        int depth, bottleneck, blocks[4];
        size_t parameters;
    } tv[] = {{18, 0, {2, 2, 2, 2}, 11689512},
              {34, 0, {3, 4, 6, 3}, 21797672},
              {50, 1, {3, 4, 6, 3}, 25557032},
              {101, 1, {3, 4, 23, 3}, 44549160},
              {152, 1, {3, 8, 36, 3}, 60192808}};
    for (int k = 0; k < 5; k++) {
        td_resnet_params rp;
        CHECK_OK(td_resnet_torchvision_params(tv[k].depth, &rp));
        CHECK(rp.block == (tv[k].bottleneck ? TD_RESNET_BOTTLENECK : TD_RESNET_BASIC));
        CHECK(rp.stages == 4 && memcmp(rp.blocks, tv[k].blocks, sizeof tv[k].blocks) == 0);
        CHECK(rp.base_width == 64 && rp.in_channels == 3 && rp.image_size == 224);
        CHECK(rp.classes == 1000 && rp.imagenet_stem == 1);
        td_sequential *s;
        CHECK_OK(td_resnet_sequential(&rp, &s));
        size_t layers = td_sequential_count(s);
        CHECK_EQ(layers, 2 + (size_t)(tv[k].blocks[0] + tv[k].blocks[1] + tv[k].blocks[2] +
                                      tv[k].blocks[3]));
        /* After the stem, conv1 stride 2 and max pool stride 2: 224 -> 56. (The shape at a later
         * layer would replay, drawing, every weight before it.) */
        td_shape sh;
        CHECK_OK(td_sequential_shape_at(s, 1, 1, &sh));
        CHECK(sh.dim[1] == 64 && sh.dim[2] == 56 && sh.dim[3] == 56);
        if (tv[k].depth != 18 && tv[k].depth != 50 && !getenv("TD_LONG")) {
            td_sequential_destroy(s);
            continue;
        }
        /* Built, not compiled: the parameters exist, no activations are allocated. */
        td_graph *g;
        td_tensor *x, *y;
        CHECK_OK(td_graph_create(&g, NULL));
        CHECK_OK(td_graph_input(g, "x", td_shape_4d(1, 3, 224, 224), TD_F32, 0, &x));
        CHECK_OK(td_sequential_build(s, g, 0, layers, x, 1, &y));
        CHECK(td_tensor_shape(y).dim[1] == 1000);
        td_param *p;
        size_t n, total = 0;
        CHECK_OK(td_graph_parameters(g, &p, &n));
        for (size_t i = 0; i < n; i++) total += p[i].count;
        if (total != tv[k].parameters)
            TEST_FAIL_AT("resnet%d: %zu parameters, torchvision %zu", tv[k].depth, total,
                         tv[k].parameters);
        if (tv[k].depth == 50) {
            check_resnet50_keys(g, 0);
            check_resnet50_keys(g, 1);
        }
        td_graph_destroy(g);
        td_sequential_destroy(s);
    }
    td_resnet_params rp = td_resnet_default_params(), kept = rp;
    CHECK_EQ(rp.imagenet_stem, 0);
    CHECK_STATUS(td_resnet_torchvision_params(20, &rp), TD_EINVAL);
    CHECK(strstr(td_last_error(), "depth 20") != NULL);
    CHECK(memcmp(&rp, &kept, sizeof rp) == 0);
    CHECK_STATUS(td_resnet_torchvision_params(50, NULL), TD_EINVAL);
    rp.imagenet_stem = 2;
    td_sequential *s;
    CHECK_STATUS(td_resnet_sequential(&rp, &s), TD_EINVAL);
    CHECK(strstr(td_last_error(), "imagenet_stem 2") != NULL);
}

/* resnet18 with the ImageNet stem on 64 x 64 images (64 -> 16 after the stem, 2 x 2 before the
 * pooling head): one training step gives a finite loss near ln(1000) and gradients everywhere. */
static void imagenet_stem_trains(void) {
    td_resnet_params rp;
    CHECK_OK(td_resnet_torchvision_params(18, &rp));
    rp.image_size = 64;
    td_sequential *s;
    td_graph *g;
    td_model m;
    const int64_t B = 2;
    CHECK_OK(td_resnet_sequential(&rp, &s));
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_model_build_sequential(g, s, B, 3, &m));
    td_rng r;
    td_rng_init(&r, 11);
    td_rng_fill_uniform(&r, td_tensor_data(m.input), (size_t)B * 3 * 64 * 64, -1, 1);
    int64_t labels[2] = {7, 999};
    CHECK_OK(td_tensor_write(m.labels, labels));
    CHECK_OK(td_graph_forward(g));
    CHECK_OK(td_graph_backward(g, m.loss));
    float loss;
    CHECK_OK(td_tensor_read(m.loss, &loss));
    CHECK(isfinite(loss) && fabs(loss - log(1000.0)) < 3.0);
    td_param *p;
    size_t n;
    CHECK_OK(td_graph_parameters(g, &p, &n));
    for (size_t i = 0; i < n; i++) {
        const float *gd = p[i].grad;
        double sq = 0;
        for (size_t j = 0; j < p[i].count; j++) sq += (double)gd[j] * gd[j];
        if (!(isfinite(sq) && sq > 0)) {
            TEST_FAIL_AT("%s: gradient norm^2 %g", p[i].name, sq);
            break;
        }
    }
    td_graph_destroy(g);
    td_sequential_destroy(s);
}

/* Builds layers [first, last) of s for batch B into a fresh training graph. */
static td_graph *part(const td_sequential *s, size_t first, size_t last, int64_t B, td_tensor **x,
                      td_tensor **y) {
    td_graph *g;
    CHECK_OK(td_graph_create(&g, NULL));
    td_shape in;
    CHECK_OK(td_sequential_shape_at(s, first, B, &in));
    CHECK_OK(td_graph_input(g, "x", in, TD_F32, first > 0, x));
    CHECK_OK(td_sequential_build(s, g, first, last, *x, 42, y));
    CHECK_OK(td_graph_compile(g));
    return g;
}

/* Parameter `name` of g, or NULL. */
static const td_param *param_named(td_graph *g, const char *name) {
    td_param *p;
    size_t n;
    td_graph_parameters(g, &p, &n);
    for (size_t i = 0; i < n; i++)
        if (strcmp(p[i].name, name) == 0) return &p[i];
    return NULL;
}

static void cut_anywhere_builds_the_same_model(void) {
    td_model_kind kinds[] = {TD_MODEL_RESNET, TD_MODEL_CNN, TD_MODEL_NET};
    for (int k = 0; k < 3; k++) {
        td_sequential *s;
        CHECK_OK(td_model_sequential(kinds[k], &s));
        size_t L = td_sequential_count(s);
        const int64_t B = 4;
        td_tensor *wx, *wy;
        td_graph *whole = part(s, 0, L, B, &wx, &wy);
        td_graph_set_training(whole, 0); /* eval: no dropout draws */
        td_rng r;
        td_rng_init(&r, 5);
        td_rng_fill_uniform(&r, td_tensor_data(wx), (size_t)B * 784, 0, 1);
        CHECK_OK(td_graph_forward(whole));
        float want[40], got[40];
        CHECK_OK(td_tensor_read(wy, want));
        for (size_t cut = 1; cut < L; cut++) {
            td_tensor *ax, *ay, *bx, *by;
            td_graph *a = part(s, 0, cut, B, &ax, &ay), *b = part(s, cut, L, B, &bx, &by);
            td_graph_set_training(a, 0);
            td_graph_set_training(b, 0);
            td_param *p;
            size_t n, found = 0;
            CHECK_OK(td_graph_parameters(whole, &p, &n));
            for (size_t i = 0; i < n; i++) {
                const td_param *q = param_named(a, p[i].name);
                if (!q) q = param_named(b, p[i].name);
                if (!q) continue;
                found++;
                CHECK(q->count == p[i].count &&
                      memcmp(q->data, p[i].data, p[i].count * sizeof(float)) == 0);
            }
            CHECK_EQ(found, n);
            CHECK_OK(td_tensor_write(ax, td_tensor_data(wx)));
            CHECK_OK(td_graph_forward(a));
            float *mid = malloc((size_t)td_tensor_numel(ay) * sizeof *mid);
            CHECK_OK(td_tensor_read(ay, mid));
            CHECK_OK(td_tensor_write(bx, mid));
            CHECK_OK(td_graph_forward(b));
            CHECK_OK(td_tensor_read(by, got));
            for (int i = 0; i < B * 10; i++) CHECK_NEAR(got[i], want[i], 1e-4);
            free(mid);
            td_graph_destroy(a);
            td_graph_destroy(b);
        }
        td_graph_destroy(whole);
        td_sequential_destroy(s);
    }
}

static td_status relu_layer(td_graph *g, const char *name, td_tensor *x, td_rng *rng,
                            const void *arg, td_tensor **y) {
    (void)name, (void)rng, (void)arg;
    return td_graph_relu(g, x, y);
}

static td_status failing_layer(td_graph *g, const char *name, td_tensor *x, td_rng *rng,
                               const void *arg, td_tensor **y) {
    (void)rng, (void)arg;
    return td_nn_conv2d(g, name, x, 4, 3, NULL, 1, rng, y); /* x is 2-d: refused */
}

static void sequential_errors(void) {
    td_sequential *s;
    CHECK_STATUS(td_sequential_create(&s, td_shape_make(0, NULL)), TD_ESHAPE);
    CHECK_OK(td_sequential_create(&s, td_shape_make(1, (const int64_t[]){6})));
    CHECK_OK(td_sequential_add(s, "a", relu_layer, NULL, 0));
    CHECK_STATUS(td_sequential_add(s, "a", relu_layer, NULL, 0), TD_EINVAL);
    CHECK_STATUS(td_sequential_add(s, "", relu_layer, NULL, 0), TD_EINVAL);
    CHECK_OK(td_sequential_add(s, "bad", failing_layer, NULL, 0));
    td_graph *g;
    td_tensor *x, *y;
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(2, 6), TD_F32, 0, &x));
    CHECK_STATUS(td_sequential_build(s, g, 0, 2, x, 0, &y), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "layer 1 'bad'") != NULL);
    CHECK_STATUS(td_sequential_build(s, g, 1, 1, x, 0, &y), TD_EINVAL);
    td_tensor *x3;
    CHECK_OK(td_graph_input(g, "x3", td_shape_2d(2, 7), TD_F32, 0, &x3));
    CHECK_STATUS(td_sequential_build(s, g, 0, 1, x3, 0, &y), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "(2, 6)") != NULL);
    td_graph_destroy(g);
    td_sequential_destroy(s);
}

int main(void) {
    RUN(resnet_matches_pytorch);
    RUN(default_resnet_layers_and_shapes);
    RUN(cut_anywhere_builds_the_same_model);
    RUN(sequential_errors);
    RUN(torchvision_resnets);
    RUN(imagenet_stem_trains);
    TEST_END();
}
