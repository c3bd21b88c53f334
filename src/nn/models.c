/* The three reference models (the seeds' Net, an MLP and a BatchNorm CNN) built into a
 * graph for one batch size, plus the helpers an example needs around them: names, and
 * predictions/accuracy from the log-probabilities. Training loops live in the examples. */
#include <stdio.h>
#include <string.h>

#include "tandem/nn.h"

#include "core/core_impl.h"

static const char *const model_names[TD_MODEL_COUNT] = {"net", "mlp", "cnn"};

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
    return td__fail(TD_EINVAL, "unknown model '%s' (expected net, mlp or cnn)", name);
}

/* conv 1->10 k5, maxpool 2, relu, conv 10->20 k5, dropout2d, maxpool 2, relu, flatten,
 * fc 320->50, relu, dropout, fc 50->10, log_softmax. */
static td_status build_net(td_graph *g, td_tensor *x, td_rng *rng, td_tensor **logits) {
    td_conv2d_params cp = td_conv2d_default_params();
    td_pool2d_params pp = td_pool2d_default_params();
    td_tensor *t;
    TD__TRY(td_nn_conv2d(g, "conv1", x, 10, 5, &cp, 1, rng, &t));
    TD__TRY(td_graph_max_pool2d(g, t, &pp, &t));
    TD__TRY(td_graph_relu(g, t, &t));
    TD__TRY(td_nn_conv2d(g, "conv2", t, 20, 5, &cp, 1, rng, &t));
    TD__TRY(td_graph_dropout2d(g, t, 0.5f, &t));
    TD__TRY(td_graph_max_pool2d(g, t, &pp, &t));
    TD__TRY(td_graph_relu(g, t, &t));
    TD__TRY(td_graph_flatten(g, t, 1, &t));
    TD__TRY(td_nn_linear(g, "fc1", t, 50, 1, rng, &t));
    TD__TRY(td_graph_relu(g, t, &t));
    TD__TRY(td_graph_dropout(g, t, 0.5f, &t));
    return td_nn_linear(g, "fc2", t, 10, 1, rng, logits);
}

static td_status build_mlp(td_graph *g, td_tensor *x, td_rng *rng, td_tensor **logits) {
    td_tensor *t;
    TD__TRY(td_graph_flatten(g, x, 1, &t));
    TD__TRY(td_nn_linear(g, "fc1", t, 1024, 1, rng, &t));
    TD__TRY(td_graph_relu(g, t, &t));
    TD__TRY(td_nn_linear(g, "fc2", t, 1024, 1, rng, &t));
    TD__TRY(td_graph_relu(g, t, &t));
    return td_nn_linear(g, "fc3", t, 10, 1, rng, logits);
}

static td_status conv_bn_relu(td_graph *g, int i, td_tensor *x, int64_t oc, td_rng *rng,
                              td_tensor **y) {
    char conv[16], bn[16];
    snprintf(conv, sizeof conv, "conv%d", i);
    snprintf(bn, sizeof bn, "bn%d", i);
    td_conv2d_params cp = td_conv2d_default_params();
    cp.padding[0] = cp.padding[1] = 1;
    td_tensor *t;
    TD__TRY(td_nn_conv2d(g, conv, x, oc, 3, &cp, 1, rng, &t));
    TD__TRY(td_nn_batch_norm2d(g, bn, t, &t));
    return td_graph_relu(g, t, y);
}

static td_status build_cnn(td_graph *g, td_tensor *x, td_rng *rng, td_tensor **logits) {
    td_pool2d_params pp = td_pool2d_default_params();
    td_tensor *t;
    TD__TRY(conv_bn_relu(g, 1, x, 32, rng, &t));
    TD__TRY(conv_bn_relu(g, 2, t, 32, rng, &t));
    TD__TRY(td_graph_max_pool2d(g, t, &pp, &t));
    TD__TRY(conv_bn_relu(g, 3, t, 64, rng, &t));
    TD__TRY(conv_bn_relu(g, 4, t, 64, rng, &t));
    TD__TRY(td_graph_max_pool2d(g, t, &pp, &t));
    TD__TRY(td_graph_flatten(g, t, 1, &t));
    return td_nn_linear(g, "fc", t, 10, 1, rng, logits);
}

td_status td_model_build(td_graph *g, td_model_kind kind, int64_t batch, uint64_t seed,
                         td_model *out) {
    if (!g || !out) return td__fail(TD_EINVAL, "td_model_build: NULL argument");
    if ((unsigned)kind >= TD_MODEL_COUNT)
        return td__fail(TD_EINVAL, "td_model_build: unknown model kind %d", (int)kind);
    if (batch < 1)
        return td__fail(TD_EINVAL, "td_model_build: batch %lld (must be >= 1)", (long long)batch);
    memset(out, 0, sizeof *out);
    out->kind = kind;
    out->batch = batch;
    td_rng rng;
    td_rng_init(&rng, seed);
    td_tensor *logits;
    TD__TRY(td_graph_input(g, "input", td_shape_4d(batch, 1, 28, 28), TD_F32, 0, &out->input));
    TD__TRY(td_graph_input(g, "labels", td_shape_1d(batch), TD_I64, 0, &out->labels));
    switch (kind) {
    case TD_MODEL_NET:
        TD__TRY(build_net(g, out->input, &rng, &logits));
        break;
    case TD_MODEL_MLP:
        TD__TRY(build_mlp(g, out->input, &rng, &logits));
        break;
    default:
        TD__TRY(build_cnn(g, out->input, &rng, &logits));
        break;
    }
    TD__TRY(td_graph_cross_entropy(g, logits, out->labels, TD_REDUCTION_MEAN, &out->loss,
                                   &out->output));
    return td_graph_compile(g);
}

td_status td_model_predict(const td_model *m, int64_t *pred, int64_t *correct) {
    if (!m || !m->output) return td__fail(TD_EINVAL, "td_model_predict: model not built");
    const float *lp = td_tensor_data(m->output);
    const int64_t *lab = td_tensor_data(m->labels);
    if (!lp || !lab) return td__fail(TD_ESTATE, "td_model_predict: the graph is not compiled");
    int64_t B = m->batch, C = td_tensor_shape(m->output).dim[1], ok = 0;
    for (int64_t i = 0; i < B; i++) {
        int64_t best = 0;
        for (int64_t c = 1; c < C; c++)
            if (lp[i * C + c] > lp[i * C + best]) best = c;
        if (pred) pred[i] = best;
        ok += best == lab[i];
    }
    if (correct) *correct = ok;
    return TD_OK;
}
