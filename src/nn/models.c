/* The reference models (PyTorch's MNIST example Net, an MLP, a BatchNorm CNN, and the ResNet of
 * resnet.c) as layer lists, built into a graph for one batch size, plus the helpers an example
 * needs around them: names, and predictions/accuracy from the log-probabilities. Training loops
 * live in the examples. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/nn.h"

#include "core/core_impl.h"
#include "nn/nn_impl.h"

static const char *const model_names[TD_MODEL_COUNT] = {"net", "mlp", "cnn", "resnet", "gpt"};

const char *td_model_name(td_model_kind kind) {
    return (unsigned)kind < TD_MODEL_COUNT ? model_names[kind] : "invalid";
}

td_status td_model_kind_parse(const char *name, td_model_kind *out) {
    if (!name || !out) return td__fail(TD_EINVAL, "td_model_kind_parse: NULL argument");
    for (int i = 0; i < TD_MODEL_COUNT; i++)
        if (strcmp(name, model_names[i]) == 0) {
            *out = (td_model_kind)i;
            return TD_OK;
        }
    return td__fail(TD_EINVAL, "unknown model '%s' (expected net, mlp, cnn, resnet or gpt)", name);
}

/* The models as layers. Each layer draws its parameters in the order the whole model always
 * has (layer by layer, weight then bias), so these lists build the same numbers as before they
 * were lists. */

/* Net: conv 1->10 k5, maxpool 2, relu | conv 10->20 k5, dropout2d, maxpool 2, relu | flatten,
 * fc 320->50, relu, dropout | fc 50->10. */
static td_status net_conv(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                          td_tensor **y) {
    int second = *(const int *)arg;
    td_conv2d_params cp = td_conv2d_default_params();
    td_pool2d_params pp = td_pool2d_default_params();
    td_tensor *t;
    TD__TRY(td_nn_conv2d(g, name, x, second ? 20 : 10, 5, &cp, 1, rng, &t));
    if (second) TD__TRY(td_graph_dropout2d(g, t, 0.5f, &t));
    TD__TRY(td_graph_max_pool2d(g, t, &pp, &t));
    return td_graph_relu(g, t, y);
}

static td_status net_fc1(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                         td_tensor **y) {
    (void)arg;
    td_tensor *t;
    TD__TRY(td_graph_flatten(g, x, 1, &t));
    TD__TRY(td_nn_linear(g, name, t, 50, 1, rng, &t));
    TD__TRY(td_graph_relu(g, t, &t));
    return td_graph_dropout(g, t, 0.5f, y);
}

/* A linear layer of `*arg` outputs; MLP layers flatten first and ReLU after, but not the last. */
typedef struct {
    int64_t out;
    int flatten, relu;
} fc_arg;

static td_status fc_layer(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                          td_tensor **y) {
    const fc_arg *a = arg;
    td_tensor *t = x;
    if (a->flatten) TD__TRY(td_graph_flatten(g, t, 1, &t));
    TD__TRY(td_nn_linear(g, name, t, a->out, 1, rng, &t));
    if (a->relu) return td_graph_relu(g, t, y);
    *y = t;
    return TD_OK;
}

/* CNN: conv i (3x3, pad 1) + bn i + relu, then a max pool after the second and fourth. */
typedef struct {
    int index;
    int64_t out;
    int pool;
} cnn_arg;

static td_status cnn_conv(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                          td_tensor **y) {
    (void)name;
    const cnn_arg *a = arg;
    char conv[16], bn[16];
    snprintf(conv, sizeof conv, "conv%d", a->index);
    snprintf(bn, sizeof bn, "bn%d", a->index);
    td_conv2d_params cp = td_conv2d_default_params();
    cp.padding[0] = cp.padding[1] = 1;
    td_tensor *t;
    TD__TRY(td_nn_conv2d(g, conv, x, a->out, 3, &cp, 1, rng, &t));
    TD__TRY(td_nn_batch_norm2d(g, bn, t, &t));
    TD__TRY(td_graph_relu(g, t, &t));
    if (!a->pool) {
        *y = t;
        return TD_OK;
    }
    td_pool2d_params pp = td_pool2d_default_params();
    return td_graph_max_pool2d(g, t, &pp, y);
}

static td_status add_layers(td_sequential *s, td_model_kind kind) {
    switch (kind) {
    case TD_MODEL_NET: {
        int first = 0, second = 1;
        fc_arg fc2 = {10, 0, 0};
        TD__TRY(td_sequential_add(s, "conv1", net_conv, &first, sizeof first));
        TD__TRY(td_sequential_add(s, "conv2", net_conv, &second, sizeof second));
        TD__TRY(td_sequential_add(s, "fc1", net_fc1, NULL, 0));
        return td_sequential_add(s, "fc2", fc_layer, &fc2, sizeof fc2);
    }
    case TD_MODEL_MLP: {
        fc_arg fc1 = {1024, 1, 1}, fc2 = {1024, 0, 1}, fc3 = {10, 0, 0};
        TD__TRY(td_sequential_add(s, "fc1", fc_layer, &fc1, sizeof fc1));
        TD__TRY(td_sequential_add(s, "fc2", fc_layer, &fc2, sizeof fc2));
        return td_sequential_add(s, "fc3", fc_layer, &fc3, sizeof fc3);
    }
    default: {
        cnn_arg c[4] = {{1, 32, 0}, {2, 32, 1}, {3, 64, 0}, {4, 64, 1}};
        for (int i = 0; i < 4; i++) {
            char name[16];
            snprintf(name, sizeof name, "conv%d", c[i].index);
            TD__TRY(td_sequential_add(s, name, cnn_conv, &c[i], sizeof c[i]));
        }
        fc_arg fc = {10, 1, 0};
        return td_sequential_add(s, "fc", fc_layer, &fc, sizeof fc);
    }
    }
}

td_status td_model_sequential(td_model_kind kind, td_sequential **out) {
    if (!out) return td__fail(TD_EINVAL, "td_model_sequential: out is NULL");
    *out = NULL;
    if ((unsigned)kind >= TD_MODEL_COUNT)
        return td__fail(TD_EINVAL, "td_model_sequential: unknown model kind %d", (int)kind);
    if (kind == TD_MODEL_RESNET) {
        td_resnet_params rp = td_resnet_default_params();
        return td_resnet_sequential(&rp, out);
    }
    if (kind == TD_MODEL_GPT) {
        td_gpt_params gp = td_gpt_default_params();
        return td_gpt_sequential(&gp, out);
    }
    td_sequential *s;
    TD__TRY(td_sequential_create(&s, td_shape_make(3, (const int64_t[]){1, 28, 28})));
    td_status st = add_layers(s, kind);
    if (st != TD_OK) {
        td_sequential_destroy(s);
        return st;
    }
    td__sequential_set_kind(s, kind);
    *out = s;
    return TD_OK;
}

td_status td_model_build(td_graph *g, td_model_kind kind, int64_t batch, uint64_t seed,
                         td_model *out) {
    if (!g || !out) return td__fail(TD_EINVAL, "td_model_build: NULL argument");
    if ((unsigned)kind >= TD_MODEL_COUNT)
        return td__fail(TD_EINVAL, "td_model_build: unknown model kind %d", (int)kind);
    if (batch < 1)
        return td__fail(TD_EINVAL, "td_model_build: batch %lld (must be >= 1)", (long long)batch);
    td_sequential *s;
    TD__TRY(td_model_sequential(kind, &s));
    td_status st = td_model_build_sequential(g, s, batch, seed, out);
    td_sequential_destroy(s);
    return st;
}

td_status td_model_predict(const td_model *m, int64_t *pred, int64_t *correct) {
    if (!m || !m->output) return td__fail(TD_EINVAL, "td_model_predict: model not built");
    if (!td_tensor_data(m->output) || !td_tensor_data(m->labels))
        return td__fail(TD_ESTATE, "td_model_predict: the graph is not compiled");
    /* Through copies, wherever the graph keeps its tensors; one label per row of the output. */
    td_shape os = td_tensor_shape(m->output);
    int64_t B = os.dim[0], C = os.dim[1], ok = 0;
    float *lp = malloc((size_t)(B * C) * sizeof *lp);
    int64_t *lab = malloc((size_t)B * sizeof *lab);
    td_status st = lp && lab ? TD_OK : td__fail(TD_ENOMEM, "td_model_predict: out of memory");
    if (st == TD_OK) st = td_tensor_read(m->output, lp);
    if (st == TD_OK) st = td_tensor_read(m->labels, lab);
    for (int64_t i = 0; st == TD_OK && i < B; i++) {
        int64_t best = 0;
        for (int64_t c = 1; c < C; c++)
            if (lp[i * C + c] > lp[i * C + best]) best = c;
        if (pred) pred[i] = best;
        ok += best == lab[i];
    }
    free(lp);
    free(lab);
    if (st == TD_OK && correct) *correct = ok;
    return st;
}
