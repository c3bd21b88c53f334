/* The public op builders of graph.h: each packs its attributes and adds one node of the op
 * it names through td__graph_add, whose op table checks the inputs and gives the output.
 * This is the one file of the graph that names particular ops: the catalogue of what a model
 * can be built from. */
#include "graph/graph_impl.h"

/* One node of `op` with a single input. */
static td_status unary(td_graph *g, const td__op *op, const char *what, td_tensor *x,
                       const td__op_attr *attr, int variant, td_tensor **y) {
    return td__graph_add(g, op, what, &x, 1, attr, variant, y);
}

td_status td_graph_cast(td_graph *g, td_tensor *x, td_dtype dtype, td_tensor **y) {
    return unary(g, &td__op_cast, "cast", x, NULL, (int)dtype, y);
}

td_status td_graph_linear(td_graph *g, td_tensor *x, td_tensor *w, td_tensor *b, td_tensor **y) {
    td_tensor *ins[3] = {x, w, b};
    return td__graph_add(g, &td__op_linear, "linear", ins, 3, NULL, 0, y);
}

td_status td_graph_conv2d(td_graph *g, td_tensor *x, td_tensor *w, td_tensor *b,
                          const td_conv2d_params *p, td_tensor **y) {
    td_tensor *ins[3] = {x, w, b};
    td__op_attr a = {.conv = p ? *p : td_conv2d_default_params()};
    return td__graph_add(g, &td__op_conv2d, "conv2d", ins, 3, &a, 0, y);
}

static td_status pool(td_graph *g, td_tensor *x, const td_pool2d_params *p, int variant,
                      const char *what, td_tensor **y) {
    if (!p) return td__fail(TD_EINVAL, "%s: params are NULL", what);
    td__op_attr a = {.pool = *p};
    return unary(g, &td__op_pool2d, what, x, &a, variant, y);
}

td_status td_graph_max_pool2d(td_graph *g, td_tensor *x, const td_pool2d_params *p, td_tensor **y) {
    return pool(g, x, p, TD__POOL_MAX, "max_pool2d", y);
}

td_status td_graph_avg_pool2d(td_graph *g, td_tensor *x, const td_pool2d_params *p, td_tensor **y) {
    return pool(g, x, p, TD__POOL_AVG, "avg_pool2d", y);
}

td_status td_graph_relu(td_graph *g, td_tensor *x, td_tensor **y) {
    return unary(g, &td__op_eltwise, "relu", x, NULL, TD__ELT_RELU, y);
}

td_status td_graph_gelu(td_graph *g, td_tensor *x, td_tensor **y) {
    return unary(g, &td__op_eltwise, "gelu", x, NULL, TD__ELT_GELU, y);
}

td_status td_graph_gelu_tanh(td_graph *g, td_tensor *x, td_tensor **y) {
    return unary(g, &td__op_eltwise, "gelu_tanh", x, NULL, TD__ELT_GELU_TANH, y);
}

td_status td_graph_dropout(td_graph *g, td_tensor *x, float p, td_tensor **y) {
    td__op_attr a = {.p = p};
    return unary(g, &td__op_dropout, "dropout", x, &a, TD__DROP_ELEMENT, y);
}

td_status td_graph_dropout2d(td_graph *g, td_tensor *x, float p, td_tensor **y) {
    td__op_attr a = {.p = p};
    return unary(g, &td__op_dropout, "dropout2d", x, &a, TD__DROP_CHANNEL, y);
}

td_status td_graph_batch_norm2d(td_graph *g, td_tensor *x, td_tensor *weight, td_tensor *bias,
                                td_tensor *running_mean, td_tensor *running_var,
                                const td_batch_norm_params *p, td_tensor **y) {
    if (g && g->opt.sync_batch_norm)
        return td_graph_sync_batch_norm2d(g, x, weight, bias, running_mean, running_var, p, y);
    td_tensor *ins[5] = {x, weight, bias, running_mean, running_var};
    td__op_attr a = {.bn = p ? *p : td_batch_norm_default_params()};
    return td__graph_add(g, &td__op_batch_norm, "batch_norm2d", ins, 5, &a, 0, y);
}

/* Ranks in the graph's group (1 without one). */
static int world_size(const td_graph *g) { return g->opt.comm ? td_comm_size(g->opt.comm) : 1; }

td_status td_graph_sync_batch_norm2d(td_graph *g, td_tensor *x, td_tensor *weight, td_tensor *bias,
                                     td_tensor *running_mean, td_tensor *running_var,
                                     const td_batch_norm_params *p, td_tensor **y) {
    td_tensor *ins[5] = {x, weight, bias, running_mean, running_var};
    td__op_attr a = {.bn = p ? *p : td_batch_norm_default_params()};
    /* One rank: PyTorch's SyncBatchNorm runs plain batch norm, and so does this. */
    if (!g || world_size(g) == 1)
        return td__graph_add(g, &td__op_batch_norm, "batch_norm2d", ins, 5, &a, 0, y);
    return td__graph_add(g, &td__op_sync_batch_norm, "sync_batch_norm2d", ins, 5, &a, 0, y);
}

static int rank_shards(const td_graph *g);

td_status td_graph_all_gather(td_graph *g, td_tensor *x, td_tensor **y) {
    td__op_attr a = {.coll = {.world_size = g ? world_size(g) : 1, .tree = rank_shards(g) > 0}};
    return unary(g, &td__op_all_gather, "all_gather", x, &a, 0, y);
}

td_status td_graph_all_reduce(td_graph *g, td_tensor *x, td_reduce_op op, td_tensor **y) {
    td__op_attr a = {.coll = {.world_size = g ? world_size(g) : 1, .op = op}};
    return unary(g, &td__op_all_reduce, "all_reduce", x, &a, 0, y);
}

/* ---- tensor parallelism ------------------------------------------------------------------ */

/* Deterministic tensor parallelism's shards on each rank (td_graph_params.tp_shards), or 0. */
static int rank_shards(const td_graph *g) {
    return g && g->opt.tp_shards ? g->opt.tp_shards / world_size(g) : 0;
}

static td_status region(td_graph *g, td_tensor *x, int variant, const char *what, td_tensor **y) {
    td__op_attr a = {
        .coll = {.world_size = g ? world_size(g) : 1, .op = TD_OP_SUM, .tree = rank_shards(g) > 0}};
    return unary(g, &td__op_tp_region, what, x, &a, variant, y);
}

td_status td_graph_copy_to_tp_region(td_graph *g, td_tensor *x, td_tensor **y) {
    return region(g, x, TD__REGION_COPY, "copy_to_tp_region", y);
}

td_status td_graph_reduce_from_tp_region(td_graph *g, td_tensor *x, td_tensor **y) {
    return region(g, x, TD__REGION_REDUCE, "reduce_from_tp_region", y);
}

td_status td_graph_reduce_scatter(td_graph *g, td_tensor *x, td_tensor **y) {
    return region(g, x, TD__REGION_REDUCE_SCATTER, "reduce_scatter", y);
}

/* The attributes of a vocabulary-parallel node whose rank holds `rows` of the vocabulary. */
static td__op_attr vocab_slice(const td_graph *g, int64_t rows, td_reduction reduction) {
    td__op_attr a = {.vocab = {.world_size = g ? world_size(g) : 1,
                               .first = (g ? td_graph_rank(g) : 0) * rows,
                               .reduction = reduction}};
    return a;
}

td_status td_graph_vocab_parallel_embedding(td_graph *g, td_tensor *idx, td_tensor *weight,
                                            td_tensor **y) {
    if (!weight) return td__fail(TD_EINVAL, "vocab_parallel_embedding: the table is NULL");
    td_tensor *ins[2] = {idx, weight};
    td__op_attr a = vocab_slice(g, weight->shape.dim[0], TD_REDUCTION_MEAN);
    return td__graph_add(g, &td__op_embedding, "vocab_parallel_embedding", ins, 2, &a,
                         TD__EMB_VOCAB_SLICE, y);
}

td_status td_graph_vocab_parallel_cross_entropy(td_graph *g, td_tensor *logits, td_tensor *labels,
                                                td_reduction reduction, td_tensor **loss) {
    if (!logits) return td__fail(TD_EINVAL, "vocab_parallel_cross_entropy: the logits are NULL");
    td_tensor *ins[2] = {logits, labels};
    int64_t cols = logits->shape.ndim == 2 ? logits->shape.dim[1] : 0;
    td__op_attr a = vocab_slice(g, cols, reduction);
    a.vocab.shards = rank_shards(g);
    return td__graph_add(g, &td__op_vocab_parallel_cross_entropy, "vocab_parallel_cross_entropy",
                         ins, 2, &a, 0, loss);
}

td_status td_graph_column_parallel_linear(td_graph *g, td_tensor *x, td_tensor *w, td_tensor *b,
                                          int parts, int by_shard, td_tensor **y) {
    if (!rank_shards(g)) return td_graph_linear(g, x, w, b, y);
    td_tensor *ins[3] = {x, w, b};
    td__op_attr a = {.plin = {.shards = rank_shards(g), .parts = parts, .by_shard = by_shard}};
    return td__graph_add(g, &td__op_parallel_linear, "column_parallel_linear", ins, 3, &a,
                         TD__PLIN_COLUMN, y);
}

td_status td_graph_row_parallel_linear(td_graph *g, td_tensor *x, td_tensor *w, td_tensor *b,
                                       td_tensor **y) {
    if (!rank_shards(g)) return td_graph_linear(g, x, w, b, y);
    td_tensor *ins[3] = {x, w, b};
    td__op_attr a = {.plin = {.shards = rank_shards(g), .parts = 1}};
    return td__graph_add(g, &td__op_parallel_linear, "row_parallel_linear", ins, 3, &a,
                         TD__PLIN_ROW, y);
}

td_status td_graph_normalize(td_graph *g, td_tensor *x, float eps, td_tensor **y) {
    td__op_attr a = {.eps = eps};
    return unary(g, &td__op_normalize, "normalize", x, &a, 0, y);
}

td_status td_graph_scale(td_graph *g, td_tensor *x, float alpha, td_tensor **y) {
    td__op_attr a = {.alpha = alpha};
    return unary(g, &td__op_scale, "scale", x, &a, 0, y);
}

td_status td_graph_reshape(td_graph *g, td_tensor *x, td_shape shape, td_tensor **y) {
    td__op_attr a = {.to = shape};
    return unary(g, &td__op_reshape, "reshape", x, &a, 0, y);
}

td_status td_graph_flatten(td_graph *g, td_tensor *x, int start_dim, td_tensor **y) {
    if (!x) return td__fail(TD_EINVAL, "flatten: the input is NULL");
    td_shape s = td_tensor_shape(x);
    if (start_dim < 0 || start_dim >= (s.ndim > 0 ? s.ndim : 1))
        return td__fail(TD_EINVAL, "flatten: start_dim %d out of range for %d dims", start_dim,
                        s.ndim);
    int64_t rest = 1;
    for (int i = start_dim; i < s.ndim; i++) rest *= s.dim[i];
    s.ndim = start_dim + 1;
    s.dim[start_dim] = rest;
    td__op_attr a = {.to = s};
    return unary(g, &td__op_reshape, "flatten", x, &a, 0, y);
}

td_status td_graph_add(td_graph *g, td_tensor *a, td_tensor *b, td_tensor **y) {
    td_tensor *ins[2] = {a, b};
    return td__graph_add(g, &td__op_add, "add", ins, 2, NULL, 0, y);
}

td_status td_graph_concat(td_graph *g, td_tensor *const *xs, int n, td_tensor **y) {
    if (!xs || n < 1 || n > TD__MAX_IN)
        return td__fail(TD_EINVAL, "concat: need 1..%d inputs", TD__MAX_IN);
    for (int i = 0; i < n; i++)
        if (!xs[i]) return td__fail(TD_EINVAL, "concat: input %d is NULL", i);
    return td__graph_add(g, &td__op_concat, "concat", xs, n, NULL, 0, y);
}

td_status td_graph_softmax(td_graph *g, td_tensor *x, td_tensor **y) {
    return unary(g, &td__op_softmax, "softmax", x, NULL, TD__SOFTMAX, y);
}

td_status td_graph_log_softmax(td_graph *g, td_tensor *x, td_tensor **y) {
    return unary(g, &td__op_softmax, "log_softmax", x, NULL, TD__LOG_SOFTMAX, y);
}

td_status td_graph_nll_loss(td_graph *g, td_tensor *logp, td_tensor *labels, td_reduction reduction,
                            td_tensor **loss) {
    td_tensor *ins[2] = {logp, labels};
    td__op_attr a = {.reduction = reduction};
    return td__graph_add(g, &td__op_nll, "nll_loss", ins, 2, &a, 0, loss);
}

td_status td_graph_cross_entropy(td_graph *g, td_tensor *logits, td_tensor *labels,
                                 td_reduction reduction, td_tensor **loss, td_tensor **logp) {
    td_tensor *lp;
    TD__TRY(td_graph_log_softmax(g, logits, &lp));
    if (logp) *logp = lp;
    return td_graph_nll_loss(g, lp, labels, reduction, loss);
}

td_status td_graph_embedding(td_graph *g, td_tensor *idx, td_tensor *weight, td_tensor **y) {
    td_tensor *ins[2] = {idx, weight};
    return td__graph_add(g, &td__op_embedding, "embedding", ins, 2, NULL, TD__EMB_TOKEN, y);
}

td_status td_graph_position_embedding(td_graph *g, td_tensor *x, td_tensor *weight, td_tensor **y) {
    td_tensor *ins[2] = {x, weight};
    return td__graph_add(g, &td__op_embedding, "position_embedding", ins, 2, NULL, TD__EMB_POSITION,
                         y);
}

td_status td_graph_layer_norm(td_graph *g, td_tensor *x, td_tensor *weight, td_tensor *bias,
                              float eps, td_tensor **y) {
    td_tensor *ins[3] = {x, weight, bias};
    td__op_attr a = {.ln = {.eps = eps}};
    return td__graph_add(g, &td__op_layer_norm, "layer_norm", ins, 3, &a, 0, y);
}

td_status td_graph_layer_norm_shards(td_graph *g, td_tensor *x, td_tensor *weight, td_tensor *bias,
                                     float eps, int shards, td_tensor **y) {
    td_tensor *ins[3] = {x, weight, bias};
    td__op_attr a = {.ln = {.eps = eps, .shards = shards}};
    return td__graph_add(g, &td__op_layer_norm, "layer_norm", ins, 3, &a, 0, y);
}

td_status td_graph_causal_attention(td_graph *g, td_tensor *qkv, int heads, int64_t seq_len,
                                    td_tensor **y) {
    if (!qkv) return td__fail(TD_EINVAL, "attention: qkv is NULL");
    if (seq_len == 0 && qkv->shape.ndim == 3) seq_len = qkv->shape.dim[1];
    td__op_attr a = {.attn = {.heads = heads, .seq_len = seq_len}};
    return unary(g, &td__op_attention, "attention", qkv, &a, 0, y);
}
