/* Layers with PyTorch's default initialisation, and the three reference models.
 *
 * A layer creates its parameters in a td_graph (named "<name>.weight", "<name>.bias",
 * "<name>.running_mean", ...), fills them from a td_rng exactly as torch.nn's defaults
 * (kaiming_uniform(a=sqrt(5)) weights, U(+-1/sqrt(fan_in)) biases, BN weight 1 bias 0), and
 * adds the op node. The same seed gives the same model on every rank. Optimisers live in
 * optim.h; this header does not train. */
#ifndef TANDEM_NN_H
#define TANDEM_NN_H

#include "tandem/graph.h"

#ifdef __cplusplus
extern "C" {
#endif

/* nn.Linear(in = x's last dim, out_features, bias). */
td_status td_nn_linear(td_graph *g, const char *name, td_tensor *x, int64_t out_features, int bias,
                       td_rng *rng, td_tensor **y);

/* nn.Conv2d(in = x's channels, out_channels, kernel k x k, geometry p, bias). */
td_status td_nn_conv2d(td_graph *g, const char *name, td_tensor *x, int64_t out_channels,
                       int kernel, const td_conv2d_params *p, int bias, td_rng *rng, td_tensor **y);

/* nn.BatchNorm2d(x's channels), eps 1e-5, momentum 0.1. */
td_status td_nn_batch_norm2d(td_graph *g, const char *name, td_tensor *x, td_tensor **y);

/* The reference models (all take (B, 1, 28, 28) f32 images and (B) i64 labels). */
typedef enum {
    TD_MODEL_NET = 0, /* the seeds' Net: 2 convs, dropout2d, 2 linears, dropout */
    TD_MODEL_MLP = 1, /* 784 -> 1024 -> 1024 -> 10 */
    TD_MODEL_CNN = 2, /* 4 conv3x3 + BN + ReLU, 2 max-pools, linear 3136 -> 10 */
    TD_MODEL_COUNT
} td_model_kind;

/* The tensors of a built model; all owned by its graph. */
typedef struct {
    td_model_kind kind;
    int64_t batch;
    td_tensor *input;  /* (B, 1, 28, 28) f32: write images here (or td_tensor_set_data) */
    td_tensor *labels; /* (B) i64 */
    td_tensor *output; /* (B, 10) log-probabilities; argmax is the prediction */
    td_tensor *loss;   /* () f32, mean over the batch */
} td_model;

/* Builds `kind` for batch size `batch` into an empty graph, initialised from `seed`, and
 * compiles it. For evaluation at another batch size build a second graph (grad_enabled 0
 * saves memory), call td_graph_share_params(eval, train) and td_graph_set_training(eval, 0). */
td_status td_model_build(td_graph *g, td_model_kind kind, int64_t batch, uint64_t seed,
                         td_model *out);

/* "net", "mlp", "cnn". */
const char *td_model_name(td_model_kind kind);

/* Parses "net" / "mlp" / "cnn"; TD_EINVAL names the bad string. */
td_status td_model_kind_parse(const char *name, td_model_kind *out);

/* Writes the argmax of each row of `output` into pred[0..B) and returns how many equal
 * labels (both read from the graph after forward). */
td_status td_model_predict(const td_model *m, int64_t *pred, int64_t *correct);

#ifdef __cplusplus
}
#endif
#endif
