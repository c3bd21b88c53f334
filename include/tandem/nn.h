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

/* SimCLR's NT-Xent loss (normalised temperature-scaled cross entropy), the mean over 2n
 * anchors. z (2n, D): this rank's L2-normalised features (td_graph_normalize), the first
 * views of its n images in rows [0, n), their second views in rows [n, 2n). keys (K, D): the
 * normalised features anchors are compared with, z itself (local negatives) or
 * td_graph_all_gather(z) (the global batch's: every rank's features as negatives), holding z's
 * rows at [first, first + 2n) (rank * 2n after an all-gather). Anchor i's logits are its
 * similarities with every key but itself divided by `temperature`, its target its other view.
 * Adds the inputs "<name>.mask" and "<name>.labels", filled here. */
td_status td_nn_nt_xent(td_graph *g, const char *name, td_tensor *z, td_tensor *keys, int64_t first,
                        float temperature, td_tensor **loss);

/* The reference models. The image models take (B, 1, 28, 28) f32 images and (B) i64 labels;
 * the GPT takes (B, T) token ids (as f32) and one i64 label per position, (B * T). */
typedef enum {
    TD_MODEL_NET = 0,    /* PyTorch's MNIST example Net: 2 convs, dropout2d, 2 linears, dropout */
    TD_MODEL_MLP = 1,    /* 784 -> 1024 -> 1024 -> 10 */
    TD_MODEL_CNN = 2,    /* 4 conv3x3 + BN + ReLU, 2 max-pools, linear 3136 -> 10 */
    TD_MODEL_RESNET = 3, /* td_resnet_default_params(): BasicBlocks [1, 1, 1, 1], width 16 */
    TD_MODEL_GPT = 4,    /* td_gpt_default_params(): GPT-2 of 4 layers, width 128, T 128 */
    TD_MODEL_COUNT
} td_model_kind;

/* The tensors of a built model; all owned by its graph. */
typedef struct {
    td_model_kind kind;
    int64_t batch;
    td_tensor *input;  /* (B, sample...) f32: write images or token ids here (or
                          td_tensor_set_data) */
    td_tensor *labels; /* (R) i64, one per row of the output: R = B for the image models,
                          B * T for a language model */
    td_tensor *output; /* (R, classes) log-probabilities; argmax is the prediction (a
                          tensor-parallel GPT: this rank's columns of the logits) */
    td_tensor *loss;   /* () f32, mean over the R rows */
} td_model;

/* Builds `kind` for batch size `batch` into an empty graph, initialised from `seed`, and
 * compiles it. For evaluation at another batch size build a second graph (grad_enabled 0
 * saves memory), call td_graph_share_params(eval, train) and td_graph_set_training(eval, 0). */
td_status td_model_build(td_graph *g, td_model_kind kind, int64_t batch, uint64_t seed,
                         td_model *out);

/* "net", "mlp", "cnn", "resnet", "gpt". */
const char *td_model_name(td_model_kind kind);

/* Parses "net" / "mlp" / "cnn" / "resnet" / "gpt"; TD_EINVAL names the bad string. */
td_status td_model_kind_parse(const char *name, td_model_kind *out);

/* ---- sequential models ------------------------------------------------------------------ */

/* A model as consecutive named layers (nn.Sequential), the shape a pipeline cuts into stages.
 * Every reference model is one (td_model_sequential); td_model_build builds it whole. */
typedef struct td_sequential td_sequential;

/* One layer: adds its parameters (named "<name>.<...>", initialised from rng) and nodes to g,
 * reading x and giving y. `arg` is the layer's own copy of what td_sequential_add was given. */
typedef td_status (*td_layer_fn)(td_graph *g, const char *name, td_tensor *x, td_rng *rng,
                                 const void *arg, td_tensor **y);

/* An empty model whose input is (B, sample...) f32 and whose last layer gives (B, classes)
 * logits. The caller owns it (td_sequential_destroy). */
td_status td_sequential_create(td_sequential **out, td_shape sample);

/* Frees the model description (not graphs built from it); NULL-safe. */
void td_sequential_destroy(td_sequential *s);

/* Appends a layer; arg_bytes of arg are copied (arg may be NULL when arg_bytes is 0). Names
 * are unique, at most 47 characters, and may hold dots ("layer1.0"). */
td_status td_sequential_add(td_sequential *s, const char *name, td_layer_fn fn, const void *arg,
                            size_t arg_bytes);

/* Inserts a layer before layer `index` (index == count appends), as td_sequential_add; a
 * reference model changed this way builds as the caller's (td_model.kind TD_MODEL_COUNT). */
td_status td_sequential_insert(td_sequential *s, size_t index, const char *name, td_layer_fn fn,
                               const void *arg, size_t arg_bytes);

/* Number of layers. */
size_t td_sequential_count(const td_sequential *s);

/* Name of layer i, or NULL past the end. */
const char *td_sequential_layer_name(const td_sequential *s, size_t i);

/* The per-sample input shape given at creation. */
td_shape td_sequential_sample_shape(const td_sequential *s);

/* The first layer called `name` or, failing that, whose name starts with "<name>." (so
 * "layer3" finds "layer3.0"); TD_ENOTFOUND names the layers there are. */
td_status td_sequential_find(const td_sequential *s, const char *name, size_t *index);

/* The shape layer `index` reads at batch `batch` (index == count: the logits' shape). */
td_status td_sequential_shape_at(const td_sequential *s, size_t index, int64_t batch,
                                 td_shape *out);

/* The shape layer `index` reads at batch `batch` on a graph whose group is `comm` (NULL: none):
 * a tensor-parallel layer's shapes follow its group's size (sequence parallelism's token
 * slices). */
td_status td_sequential_shape_on(const td_sequential *s, size_t index, int64_t batch, td_comm *comm,
                                 td_shape *out);

/* Adds layers [first, last) to g reading x (of the shape td_sequential_shape_at(first) gives)
 * and returns the last one's output in *y. Parameters are initialised exactly as the whole
 * model built from `seed` initialises them, whatever `first` is: the draws of the layers
 * before `first` are replayed (in a scratch graph that holds no activations). */
td_status td_sequential_build(const td_sequential *s, td_graph *g, size_t first, size_t last,
                              td_tensor *x, uint64_t seed, td_tensor **y);

/* The model's loss over its last layer's logits (R, classes) and labels (R) i64, added to g:
 * the cross-entropy, mean over rows (*output: the log-probabilities); for a model whose logits
 * each rank of g's group holds its own columns of (a tensor-parallel GPT) the
 * vocabulary-parallel cross-entropy (*output: the logits as given). output may be NULL. */
td_status td_sequential_loss(const td_sequential *s, td_graph *g, td_tensor *logits,
                             td_tensor *labels, td_tensor **loss, td_tensor **output);

/* Builds the whole model for batch size `batch` into an empty graph as a td_model (inputs
 * "input" and "labels", one label per row of the last layer's (R, classes) logits,
 * td_sequential_loss) and compiles it. out->kind is the reference
 * model's kind, or TD_MODEL_COUNT for a model the caller assembled. */
td_status td_model_build_sequential(td_graph *g, const td_sequential *s, int64_t batch,
                                    uint64_t seed, td_model *out);

/* The layers of a reference model (the ResNet with td_resnet_default_params()): net "conv1",
 * "conv2", "fc1", "fc2"; mlp "fc1" .. "fc3"; cnn "conv1" .. "conv4", "fc"; resnet as
 * td_resnet_sequential. The caller destroys it. */
td_status td_model_sequential(td_model_kind kind, td_sequential **out);

/* ---- ResNet -------------------------------------------------------------------------------- */

/* The residual block kinds of He et al. (torchvision's BasicBlock and Bottleneck, v1.5:
 * a bottleneck strides in its 3x3 convolution). */
typedef enum { TD_RESNET_BASIC = 0, TD_RESNET_BOTTLENECK = 1 } td_resnet_block;

#define TD_RESNET_MAX_STAGES 6

/* A ResNet; fill with td_resnet_default_params (small images) or td_resnet_torchvision_params
 * (ImageNet). The stem is a convolution to base_width channels + batch norm + ReLU: 3x3
 * stride 1 with no max pool (28x28 inputs are small already), or with imagenet_stem
 * torchvision's 7x7 stride 2 + max pool 3x3 stride 2 (a quarter of the side); stage i
 * (torchvision's layer<i+1>) has blocks[i] blocks of base_width * 2^i planes, striding by 2 from
 * the second stage on; then global average pooling and a linear classifier. Convolutions are
 * bias-free and kaiming_normal(fan_out) initialised, batch norms start at weight 1, bias 0, as in
 * torchvision. */
typedef struct {
    td_resnet_block block;
    int stages;                       /* 1 .. TD_RESNET_MAX_STAGES */
    int blocks[TD_RESNET_MAX_STAGES]; /* blocks per stage, >= 1 */
    int64_t base_width;               /* channels of the stem and of stage 1's planes */
    int64_t in_channels, image_size;  /* input (in_channels, image_size, image_size) */
    int64_t classes;
    int imagenet_stem; /* 0: conv1 3x3 stride 1; 1: conv1 7x7 stride 2 pad 3 + maxpool 3/2/1 */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[68];
} td_resnet_params;

/* BasicBlock, 4 stages of [1, 1, 1, 1] blocks, base width 16, 1 x 28 x 28 inputs, 10 classes,
 * small-image stem: 308,538 parameters; an epoch of Fashion-MNIST takes about a minute on one
 * core. */
td_resnet_params td_resnet_default_params(void);

/* torchvision's resnet<depth>() for depth 18, 34 (BasicBlock [2,2,2,2], [3,4,6,3]), 50, 101,
 * 152 (Bottleneck [3,4,6,3], [3,4,23,3], [3,8,36,3]): base width 64, 3 x 224 x 224 inputs,
 * 1000 classes, the ImageNet stem; the same parameter count and state_dict names (less
 * num_batches_tracked). Any other depth is TD_EINVAL naming it; *out is then unchanged. */
td_status td_resnet_torchvision_params(int depth, td_resnet_params *out);

/* The ResNet as layers named like torchvision's modules: "stem" (parameters conv1, bn1),
 * one layer per block "layer<i>.<j>" (parameters "layer<i>.<j>.conv1.weight", ...,
 * "layer<i>.<j>.downsample.0.weight" and ".1" for a projection shortcut), and "fc" (average
 * pooling, flatten and the classifier fc). The caller destroys it. */
td_status td_resnet_sequential(const td_resnet_params *p, td_sequential **out);

/* ---- GPT ----------------------------------------------------------------------------------- */

/* A GPT-2 (docs/gpt.md): token and position embeddings, `layers` pre-norm transformer blocks of
 * `heads`-head causal self-attention and a 4x MLP with the tanh GELU, a final layer norm and an
 * output projection tied to the token embedding. Fill with td_gpt_default_params. */
typedef struct {
    int layers;      /* transformer blocks (n_layer) */
    int heads;       /* attention heads (n_head); width divides among them */
    int64_t width;   /* embedding width C (n_embd) */
    int64_t context; /* T: the sequence length it is built for (block_size) */
    int64_t vocab;   /* V (vocab_size); 256 for bytes */
    /* Megatron-LM's tensor parallelism over the group of the graph it is built on (its tp group,
     * docs/parallelism.md; a group of one builds the whole model): each block's attention heads
     * and MLP features, and the vocabulary of the tied embedding and of the logits, are cut
     * among the ranks, which must divide heads and vocab. Every rank's slice starts as the whole
     * model's (td_param.split says which); the logits are split by columns and take the
     * vocabulary-parallel loss (td_sequential_loss). */
    int tensor_parallel;
    /* With tensor_parallel: between the regions (layer norms, residuals, the activations
     * between layers) each rank holds B T / n of the tokens, all-gathered where a region begins
     * and reduce-scattered where it ends; the context must divide among the ranks. */
    int sequence_parallel;
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64 - 2 * sizeof(int)];
} td_gpt_params;

/* 4 layers, 4 heads, width 128, context 128, vocabulary 256 (bytes): 0.84M parameters. */
td_gpt_params td_gpt_default_params(void);

/* The GPT as layers: "embed" (parameters transformer.wte.weight, transformer.wpe.weight),
 * "h.0" .. "h.<layers - 1>" (transformer.h.<i>.ln_1, .attn.c_attn, .attn.c_proj, .ln_2,
 * .mlp.c_fc, .mlp.c_proj, nanoGPT's names) and "head" (transformer.ln_f and the projection on
 * transformer.wte.weight). The sample is T token ids (f32 holding whole numbers); between layers
 * activations are (B, T, width); the logits are (B * T, vocab). A head built into a graph
 * without the embedding (a pipeline stage) holds its own transformer.wte.weight. The caller
 * destroys it. */
td_status td_gpt_sequential(const td_gpt_params *p, td_sequential **out);

/* Parameters of the model p describes (the tied projection counted once). */
int64_t td_gpt_parameter_count(const td_gpt_params *p);

/* Writes the argmax of each row of `output` into pred[0..R) and returns how many equal
 * labels (both read from the graph after forward). */
td_status td_model_predict(const td_model *m, int64_t *pred, int64_t *correct);

#ifdef __cplusplus
}
#endif
#endif
