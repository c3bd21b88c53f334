/* Layers that own their parameters: create "<name>.weight"/".bias" (and BatchNorm's
 * running stats) in the graph, initialise them exactly as torch.nn's defaults do, and add
 * the op node. Initialisation draws from the caller's td_rng in a fixed order (weight,
 * then bias, layer by layer), so one seed gives one model everywhere. */
#include <math.h>
#include <stdio.h>

#include "tandem/nn.h"

#include "core/core_impl.h"

/* kaiming_uniform_(a = sqrt(5)) reduces to U(+-1/sqrt(fan_in)); bias uses the same bound. */
static void init_uniform(td_tensor *t, td_rng *rng, int64_t fan_in) {
    float bound = fan_in > 0 ? 1.0f / sqrtf((float)fan_in) : 0.0f;
    td_rng_fill_uniform(rng, td_tensor_data(t), (size_t)td_tensor_numel(t), -bound, bound);
}

static td_status param_named(td_graph *g, const char *layer, const char *what, td_shape s,
                             td_tensor **out) {
    char name[64];
    if (snprintf(name, sizeof name, "%s.%s", layer, what) >= (int)sizeof name)
        return td__fail(TD_EINVAL, "layer name '%s' is too long", layer);
    return td_graph_param(g, name, s, out);
}

td_status td_nn_linear(td_graph *g, const char *name, td_tensor *x, int64_t out_features, int bias,
                       td_rng *rng, td_tensor **y) {
    if (!g || !name || !x || !rng || !y) return td__fail(TD_EINVAL, "td_nn_linear: NULL argument");
    td_shape xs = td_tensor_shape(x);
    if (xs.ndim != 2 || out_features < 1)
        return td__fail(TD_ESHAPE, "td_nn_linear '%s': input must be (N, IN) and out_features >= 1",
                        name);
    int64_t in = xs.dim[1];
    td_tensor *w, *b = NULL;
    TD__TRY(param_named(g, name, "weight", td_shape_2d(out_features, in), &w));
    init_uniform(w, rng, in);
    if (bias) {
        TD__TRY(param_named(g, name, "bias", td_shape_1d(out_features), &b));
        init_uniform(b, rng, in);
    }
    return td_graph_linear(g, x, w, b, y);
}

td_status td_nn_conv2d(td_graph *g, const char *name, td_tensor *x, int64_t out_channels,
                       int kernel, const td_conv2d_params *p, int bias, td_rng *rng,
                       td_tensor **y) {
    if (!g || !name || !x || !rng || !y) return td__fail(TD_EINVAL, "td_nn_conv2d: NULL argument");
    td_shape xs = td_tensor_shape(x);
    if (xs.ndim != 4 || out_channels < 1 || kernel < 1)
        return td__fail(
            TD_ESHAPE,
            "td_nn_conv2d '%s': input must be (N, C, H, W), out_channels and kernel >= 1", name);
    int64_t c = xs.dim[1], fan_in = c * kernel * kernel;
    td_tensor *w, *b = NULL;
    TD__TRY(param_named(g, name, "weight", td_shape_4d(out_channels, c, kernel, kernel), &w));
    init_uniform(w, rng, fan_in);
    if (bias) {
        TD__TRY(param_named(g, name, "bias", td_shape_1d(out_channels), &b));
        init_uniform(b, rng, fan_in);
    }
    return td_graph_conv2d(g, x, w, b, p, y);
}

td_status td_nn_batch_norm2d(td_graph *g, const char *name, td_tensor *x, td_tensor **y) {
    if (!g || !name || !x || !y) return td__fail(TD_EINVAL, "td_nn_batch_norm2d: NULL argument");
    td_shape xs = td_tensor_shape(x);
    if (xs.ndim != 4)
        return td__fail(TD_ESHAPE, "td_nn_batch_norm2d '%s': input must be (N, C, H, W)", name);
    int64_t c = xs.dim[1];
    td_tensor *w, *b, *rm, *rv;
    TD__TRY(param_named(g, name, "weight", td_shape_1d(c), &w));
    TD__TRY(param_named(g, name, "bias", td_shape_1d(c), &b));
    char bname[64];
    snprintf(bname, sizeof bname, "%s.running_mean", name);
    TD__TRY(td_graph_buffer(g, bname, td_shape_1d(c), &rm));
    snprintf(bname, sizeof bname, "%s.running_var", name);
    TD__TRY(td_graph_buffer(g, bname, td_shape_1d(c), &rv));
    float *wd = td_tensor_data(w), *vd = td_tensor_data(rv);
    for (int64_t i = 0; i < c; i++) wd[i] = vd[i] = 1.0f; /* bias and running_mean stay 0 */
    td_batch_norm_params p = td_batch_norm_default_params();
    return td_graph_batch_norm2d(g, x, w, b, rm, rv, &p, y);
}
