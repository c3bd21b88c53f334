/* The define-then-run graph: build once for a fixed batch shape, compile, then run forward
 * and backward sweeps over the node list every step.
 *
 * Building adds leaves (inputs, parameters, buffers) and op nodes; td_graph_compile creates
 * every oneDNN primitive once and allocates every activation and gradient from the graph's
 * arena, so a training step neither mallocs nor creates primitives. Gradients accumulate
 * across backward calls until td_graph_zero_grad. A per-parameter hook fires the moment a
 * parameter's gradient is final in a backward sweep (DDP hangs its buckets there).
 * The graph is single-threaded: compile and run it on one thread, since oneDNN keeps each
 * primitive's scratchpad with the thread that created it (each thread of a DataParallel
 * builds and drives its own graph). It does not optimise (see optim.h) or reduce gradients
 * (see parallel/); its collective ops (all_gather, all_reduce, SyncBatchNorm) run on the
 * process group given in td_graph_params, in node order, forward and backward, so every rank
 * must run the same graph (compiling checks that they agree).
 *
 * Compile fuses a batch norm whose output feeds only a ReLU into one primitive, and runs
 * any other ReLU in place when nothing else reads its input: such an input tensor then
 * holds the ReLU'd values (read the ReLU's output instead).
 * Activations between convolutions may live in a oneDNN blocked layout; td_tensor_read
 * and td_tensor_read_grad always copy out in plain row-major order. With activation recompute
 * (td_graph_params.recompute) the marked segments keep only what they hand on, and backward
 * runs them forward again (docs/recompute.md). */
#ifndef TANDEM_GRAPH_H
#define TANDEM_GRAPH_H

#include "tandem/comm.h"
#include "tandem/core.h"
#include "tandem/device.h"
#include "tandem/ops.h"
#include "tandem/param.h"
#include "tandem/tensor.h"
#include "tandem/trace.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A graph (opaque): owns its tensors, nodes, primitives and arena. */
typedef struct td_graph td_graph;

/* Mixed precision as apex's opt levels (docs/amp.md). Set once, when the graph is created; the
 * graph then adds cast nodes as ops are added, so building a model is the same at every
 * level. The low dtype is bf16 (oneDNN computes it natively where the instruction set it
 * dispatches has bf16: AVX512_BF16 or AMX) or f16 (this oneDNN has no f16 on CPUs). Where the
 * device has no kernels of its own for the low dtype, casts around f32 kernels would only slow
 * a step down, so O1 and O2 compute in f32 as O0 does, and O3 keeps its low weights and computes
 * between casts; td_graph_amp_fallback says so from td_graph_create on. */
typedef enum {
    TD_AMP_O0 = 0, /* f32 everywhere */
    TD_AMP_O1,     /* autocast: linear and conv2d compute in the low dtype on cast copies of
                      their f32 weights; pooling, activations, dropout, add, concat and reshape
                      follow their input's dtype; batch norm, softmax and the losses take f32 */
    TD_AMP_O2,     /* the weights themselves in the low dtype (batch norm's stay f32) and the
                      activations too; the optimizer keeps f32 master weights (td_param's
                      master_dtype is f32; optim.h) */
    TD_AMP_O3,     /* everything in the low dtype, batch norm's weights too, and no master
                      weights: td_param's master_dtype is the low dtype, so the optimizer
                      updates the weights in place and keeps its state in the low dtype (apex's
                      pure half precision): the least memory, and the level that can stall or
                      diverge */
} td_amp_level;

/* A graph's mixed precision. */
typedef struct {
    td_amp_level level; /* TD_AMP_O0 */
    td_dtype dtype;     /* the low dtype: TD_BF16 (default) or TD_F16 */
    int emulate;        /* 1: compute oneDNN ops in f32 between casts, the low dtype's
                           rounding without its kernels, where the CPU runs bf16 natively and
                           where it has no low-precision kernels at all (then instead of f32) */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_amp_params;

/* Activation recompute (torch.utils.checkpoint; torchtitan's full and selective modes;
 * docs/recompute.md): which activations of the marked segments (td_graph_segment_begin; every
 * td_sequential layer is one) forward keeps for backward. */
typedef enum {
    TD_RECOMPUTE_NONE = 0, /* every activation is kept from forward to backward */
    TD_RECOMPUTE_FULL,     /* a segment keeps only what is read outside it (its output) and its
                              nodes that update buffers (batch norm's running statistics); its
                              other activations share one region with every other segment's, and
                              backward runs the segment's forward again before its backward */
    TD_RECOMPUTE_SELECTIVE /* as full, but the outputs of the op kinds recompute_keep names are
                              kept too, so only the cheap ops run again */
} td_recompute_mode;

/* Options of td_graph_create; fill with td_graph_default_params. */
typedef struct {
    int grad_enabled;         /* 0: inference only: no gradient memory, backward refused, and
                                 activations reuse each other's memory, so after forward
                                 only outputs and the last node's inputs hold values */
    uint64_t seed;            /* initial state of the dropout RNG (td_graph_rng) */
    size_t arena_block_bytes; /* 0 picks a default */
    int conv_winograd;        /* 1: oneDNN may pick Winograd for 3x3 convolutions where it is
                                 faster (f32 results differ from direct in the last bits);
                                 0: direct convolution only */
    td_amp_params amp;        /* mixed precision: O0 (f32), bf16 when a level is set */
    td_comm *comm;            /* the process group collective ops run on (not owned; it must
                                 outlive the graph); NULL: this process alone, a group of one */
    int sync_batch_norm;      /* 1: every td_graph_batch_norm2d (so every td_nn_batch_norm2d
                                 and every model's batch norm) is td_graph_sync_batch_norm2d,
                                 as torch.nn.SyncBatchNorm.convert_sync_batchnorm converts a
                                 model; 0: plain batch norm, per-rank statistics */
    td_device device;         /* where the graph computes and keeps its tensors (the CPU by
                                 default). Leaves stay in host memory until td_graph_compile,
                                 so initialisers write them there; compiling moves them to
                                 the device, and from then on td_tensor_data and td_param
                                 point into device memory (td_tensor_read and td_tensor_write
                                 copy either way). Creating a graph on a GPU that cannot be
                                 used here fails naming why. */
    int cuda_graphs;          /* 1 (default): on a GPU, a forward or backward run a second time
                                 the same way is recorded as a CUDA graph and later ones are
                                 replays of it (td_graph_replays); 0: every op is launched
                                 on its own each time */
    int allow_tf32;           /* 1: f32 matmuls and convolutions on a GPU may round their inputs
                                 to TF32 on tensor cores (PyTorch's allow_tf32); 0 (default):
                                 full f32 */
    int threads;              /* threads the CPU kernels (oneDNN) of this graph's compile,
                                 forward and backward run on; 0: the calling thread's OpenMP
                                 count (OMP_NUM_THREADS). oneDNN splits some sums among its
                                 threads (a weight gradient over the batch, batch norm's
                                 statistics), so their bits depend on the count: 1 makes them
                                 the same under any OMP_NUM_THREADS (deterministic training,
                                 docs/reproducibility.md) */
    int blocked_linear;       /* 1: linear layers compute from copies of their weights in the
                                 blocked layouts oneDNN's kernels prefer, made from the (OUT,
                                 IN) parameter at each forward unless td_graph_keep_weights
                                 says they still hold, or laid out by the optimizer step that
                                 wrote the weights (td_param.written: a step, td_tensor_write
                                 or a checkpoint load; weights changed by other means before
                                 the next forward must go through one of them): faster for
                                 small batches that run several times per optimizer step
                                 (deterministic mode's shards); f32 results differ from the
                                 plain layout's in the last bits */
    td_trace *trace;          /* NULL, or where every node's forward and backward run is
                                 recorded as a span on the calling thread (the node's output
                                 name, "conv2d:3"; categories "forward" and "backward"), that
                                 row named "compute" (not owned; it must outlive the graph);
                                 the job's trace is td_comm_trace's (docs/tracing.md) */
    td_recompute_mode recompute;    /* activation recompute in training graphs (ignored when
                                       grad_enabled is 0); anything but NONE needs a segment */
    const char *recompute_segments; /* NULL: every segment recomputes; else the ones named, comma
                                       separated, each a segment's name or the part before a dot
                                       of several ("h" is h.0, h.1, ...; "h.0,h.2" every other);
                                       a name that matches no segment fails td_graph_compile */
    const char *recompute_keep;     /* SELECTIVE: the ops whose outputs are kept, by their
                                       builders' words, comma separated ("linear,attention");
                                       NULL: "linear,conv2d,attention" and every collective op
                                       (no collective runs twice); a word no node of the graph
                                       has fails td_graph_compile. Copied at create, as
                                       recompute_segments */
    int tp_shards;                  /* 0: tensor-parallel ops sum over the group in its backend's
                                       order; S: deterministic tensor parallelism
                                       (docs/parallelism.md): the split dimension of every
                                       tensor-parallel layer is S fixed shards, S / (the group's
                                       size) on each rank (a power of two, at most 64), each
                                       computed alone in one shape at any group size, and every
                                       sum over shards (a row-parallel layer's output, a
                                       column-parallel layer's input gradient, the vocabulary's
                                       exponentials, the layer norms' gradients over the tokens)
                                       added in the pairwise tree over the S shards: the same
                                       bits at tp 1, 2, 4, ... S. f32 only (no mixed precision) */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64 - sizeof(int)];
} td_graph_params;

/* grad_enabled = 1, seed = 0, default arena blocks, conv_winograd = 1, amp O0 bf16, no
 * process group, plain batch norm, the CPU, CUDA graphs on, TF32 off, the caller's thread
 * count, plain linear weights, no trace, no recompute, no tp shards. */
td_graph_params td_graph_default_params(void);

/* Creates an empty graph in training mode; params may be NULL for the defaults. */
td_status td_graph_create(td_graph **out, const td_graph_params *params);

/* Frees the graph and every tensor, primitive and buffer it owns. */
void td_graph_destroy(td_graph *g);

/* ---- leaves --------------------------------------------------------------------------- */

/* A data input (e.g. images f32, labels i64). requires_grad asks for its gradient (in the
 * input's float dtype: td_tensor_grad after backward), as op tests and pipeline stages need;
 * data inputs normally pass 0. */
td_status td_graph_input(td_graph *g, const char *name, td_shape shape, td_dtype dtype,
                         int requires_grad, td_tensor **out);

/* A trainable f32 parameter, zero-filled; its data is writable at once (for init). */
td_status td_graph_param(td_graph *g, const char *name, td_shape shape, td_tensor **out);

/* Says which slice of the whole tensor of its name a tensor-parallel model's parameter is (its
 * td_param.split; param.h); TD_EINVAL when the slice does not fit its shape. */
td_status td_graph_set_param_split(td_graph *g, td_tensor *param, const td_param_split *split);

/* A non-trainable f32 state buffer (BatchNorm running stats), zero-filled. */
td_status td_graph_buffer(td_graph *g, const char *name, td_shape shape, td_tensor **out);

/* ---- ops (each adds one node and returns its output tensor; options in ops.h) ---------- */

/* y = x W^T + b; x (N, IN), w (OUT, IN), b (OUT) or NULL, y (N, OUT). */
td_status td_graph_linear(td_graph *g, td_tensor *x, td_tensor *w, td_tensor *b, td_tensor **y);

/* x (N, C, H, W), w (OC, C, KH, KW), b (OC) or NULL; y (N, OC, OH, OW). */
td_status td_graph_conv2d(td_graph *g, td_tensor *x, td_tensor *w, td_tensor *b,
                          const td_conv2d_params *p, td_tensor **y);

/* Max pooling over (N, C, H, W); backward routes through the recorded argmax. */
td_status td_graph_max_pool2d(td_graph *g, td_tensor *x, const td_pool2d_params *p, td_tensor **y);

/* Average pooling; padded zeros count in the divisor (PyTorch's count_include_pad). */
td_status td_graph_avg_pool2d(td_graph *g, td_tensor *x, const td_pool2d_params *p, td_tensor **y);

/* max(x, 0), any shape. */
td_status td_graph_relu(td_graph *g, td_tensor *x, td_tensor **y);

/* The same values in another float dtype (f32, bf16, f16), any shape and layout; backward
 * converts the gradient back. Mixed precision adds these itself. */
td_status td_graph_cast(td_graph *g, td_tensor *x, td_dtype dtype, td_tensor **y);

/* x * Phi(x) with the exact erf form (PyTorch's default GELU), any shape. */
td_status td_graph_gelu(td_graph *g, td_tensor *x, td_tensor **y);

/* GPT-2's GELU, the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 * (F.gelu(x, approximate="tanh")), any shape. */
td_status td_graph_gelu_tanh(td_graph *g, td_tensor *x, td_tensor **y);

/* Training: zero each element with probability p, scale the rest by 1/(1-p); eval: copy.
 * Masks come from td_graph_rng. */
td_status td_graph_dropout(td_graph *g, td_tensor *x, float p, td_tensor **y);

/* Like dropout, but one draw per (n, c) channel of an (N, C, H, W) tensor. */
td_status td_graph_dropout2d(td_graph *g, td_tensor *x, float p, td_tensor **y);

/* Batch norm over (N, C, H, W). weight/bias (C) parameters, running_mean/var (C) buffers.
 * Training normalises with batch statistics and updates the running ones; eval uses the
 * running ones. A graph created with sync_batch_norm = 1 adds td_graph_sync_batch_norm2d. */
td_status td_graph_batch_norm2d(td_graph *g, td_tensor *x, td_tensor *weight, td_tensor *bias,
                                td_tensor *running_mean, td_tensor *running_var,
                                const td_batch_norm_params *p, td_tensor **y);

/* SyncBatchNorm (torch.nn.SyncBatchNorm): td_graph_batch_norm2d whose training statistics are
 * the whole group's batch: per channel, the sum, the sum of squares and the count are
 * all-reduced forward and the sums of dy and dy * (x - mean) backward; the running variance is
 * unbiased over the global count; weight and bias gradients stay per rank (DDP averages them).
 * Ranks may hold different batch sizes. Eval mode uses the running stats and communicates
 * nothing. Computes in f32 at every AMP level. With no group or a group of one it adds plain
 * batch norm, as PyTorch does, so one process trains bit for bit as without it. */
td_status td_graph_sync_batch_norm2d(td_graph *g, td_tensor *x, td_tensor *weight, td_tensor *bias,
                                     td_tensor *running_mean, td_tensor *running_var,
                                     const td_batch_norm_params *p, td_tensor **y);

/* ---- collective ops (on the graph's process group; a copy in a group of one) ------------ */

/* torch.distributed.nn.functional.all_gather, concatenated: every rank's x (N, ...) in rank
 * order along dim 0, (world_size * N, ...), the same on every rank. Backward sums the gradient
 * over ranks and keeps this rank's rows (a reduce-scatter), so each rank's loss trains every
 * rank's x. Every rank's x has the same shape; the output follows x's dtype. */
td_status td_graph_all_gather(td_graph *g, td_tensor *x, td_tensor **y);

/* torch.distributed.nn.functional.all_reduce: the sum (TD_OP_SUM) or mean (TD_OP_AVG) over
 * ranks of x, any shape; backward all-reduces the gradient with the same op. */
td_status td_graph_all_reduce(td_graph *g, td_tensor *x, td_reduce_op op, td_tensor **y);

/* torch.distributed.nn.functional.reduce_scatter along dim 0: the sum over ranks of x (N, ...),
 * of which rank r keeps rows [r N / size, (r + 1) N / size); backward all-gathers the rows'
 * gradients (sequence parallelism's reduction, the partner of td_graph_all_gather). */
td_status td_graph_reduce_scatter(td_graph *g, td_tensor *x, td_tensor **y);

/* ---- tensor parallelism (Megatron-LM; docs/parallelism.md) ------------------------------ */
/* A tensor-parallel model builds on a graph whose group is its tp group (td_mesh_group(mesh,
 * "tp")): every rank holds the same activations outside a region and its slice inside. */

/* Megatron's f, where a region begins: y = x; backward sums the ranks' gradients of y (each
 * rank's is the gradient through its slice only). */
td_status td_graph_copy_to_tp_region(td_graph *g, td_tensor *x, td_tensor **y);

/* Megatron's g, where a region ends: y = the sum over ranks of x (each rank's partial result);
 * backward passes the gradient on unchanged (every rank's loss is the same). */
td_status td_graph_reduce_from_tp_region(td_graph *g, td_tensor *x, td_tensor **y);

/* Megatron's ColumnParallelLinear (without its gather): y = x w^T + b, x (N, K) the whole input,
 * w (parts O, K) this rank's rows of each of `parts` equal blocks of the whole weight's rows
 * (c_attn's q, k and v: 3), b (parts O) or NULL. Without tp_shards it is td_graph_linear and y
 * is (N, parts O). With tp_shards (td_graph_params) the rank's L shards are computed one by one,
 * y (N, parts O) as a linear lays it out, or with by_shard shard by shard, (L N, parts O / L):
 * shard l's outputs of every row, then shard l + 1's (what a row-parallel linear, an attention
 * over each shard's heads and element-wise ops take as they are); backward's input gradient is
 * the pairwise tree over the shards, to be summed over the ranks by copy_to_tp_region. */
td_status td_graph_column_parallel_linear(td_graph *g, td_tensor *x, td_tensor *w, td_tensor *b,
                                          int parts, int by_shard, td_tensor **y);

/* Megatron's RowParallelLinear before its sum: this rank's partial y (N, O) = x w^T (+ b, which
 * only one rank holds), w (O, K) the rank's columns of the whole weight. Without tp_shards it is
 * td_graph_linear on x (N, K); with tp_shards x is shard by shard, (L N, K / L) (a by_shard
 * column-parallel linear's), and y is the pairwise tree over the shards' products, the bias in
 * the first's, to be summed over the ranks by reduce_from_tp_region or reduce_scatter. */
td_status td_graph_row_parallel_linear(td_graph *g, td_tensor *x, td_tensor *w, td_tensor *b,
                                       td_tensor **y);

/* Megatron's VocabParallelEmbedding lookup: weight (R, C) holds rows [rank R, (rank + 1) R) of
 * the whole (size R, C) table; a token id there is looked up, any other id of the vocabulary
 * gives zeros (and no gradient). The sum over ranks (td_graph_reduce_from_tp_region, or
 * td_graph_reduce_scatter under sequence parallelism) is the whole lookup. */
td_status td_graph_vocab_parallel_embedding(td_graph *g, td_tensor *idx, td_tensor *weight,
                                            td_tensor **y);

/* Cross-entropy over logits (N, Vr) holding columns [rank Vr, (rank + 1) Vr) of the whole
 * (N, size Vr), labels (N) i64 ids of the whole vocabulary: the loss (mean or sum over rows) of
 * the whole logits, the same on every rank, though no rank holds them; it communicates 3 N
 * floats in forward and nothing in backward. */
td_status td_graph_vocab_parallel_cross_entropy(td_graph *g, td_tensor *logits, td_tensor *labels,
                                                td_reduction reduction, td_tensor **loss);

/* ---- ops for contrastive losses --------------------------------------------------------- */

/* F.normalize(x, p=2, dim=1): each row of (N, D) divided by max(||row||_2, eps) (PyTorch's
 * eps is 1e-12); in f32. */
td_status td_graph_normalize(td_graph *g, td_tensor *x, float eps, td_tensor **y);

/* alpha * x, any shape and float dtype (a temperature: alpha = 1 / t). */
td_status td_graph_scale(td_graph *g, td_tensor *x, float alpha, td_tensor **y);

/* Flattens dims start_dim.. into one (start_dim 1 is nn.Flatten). */
td_status td_graph_flatten(td_graph *g, td_tensor *x, int start_dim, td_tensor **y);

/* Same elements, new shape (equal numel). */
td_status td_graph_reshape(td_graph *g, td_tensor *x, td_shape shape, td_tensor **y);

/* a + b, same shape (a residual connection). */
td_status td_graph_add(td_graph *g, td_tensor *a, td_tensor *b, td_tensor **y);

/* Concatenates n tensors of (N, C_i, ...) along dim 1 (channels). */
td_status td_graph_concat(td_graph *g, td_tensor *const *xs, int n, td_tensor **y);

/* log softmax over the last dim of (N, C). */
td_status td_graph_log_softmax(td_graph *g, td_tensor *x, td_tensor **y);

/* softmax over the last dim of (N, C). */
td_status td_graph_softmax(td_graph *g, td_tensor *x, td_tensor **y);

/* -logp[i, label_i], reduced; logp (N, C) f32, labels (N) i64; loss is a scalar. */
td_status td_graph_nll_loss(td_graph *g, td_tensor *logp, td_tensor *labels, td_reduction reduction,
                            td_tensor **loss);

/* nll_loss(log_softmax(logits)); adds both nodes. logp (optional) receives the log-probs. */
td_status td_graph_cross_entropy(td_graph *g, td_tensor *logits, td_tensor *labels,
                                 td_reduction reduction, td_tensor **loss, td_tensor **logp);

/* ---- ops for transformers (docs/gpt.md) ----------------------------------------------- */

/* F.embedding: y = weight[idx], idx.shape + (C). weight (V, C); idx holds token ids as i64,
 * i32 or whole numbers in f32 (exact below 2^24), and an id outside [0, V) is an error naming
 * its position. Backward adds dy's rows into the rows of weight's gradient they came from, so
 * a weight also read elsewhere (a tied output projection) gets both gradients. */
td_status td_graph_embedding(td_graph *g, td_tensor *idx, td_tensor *weight, td_tensor **y);

/* A learned position embedding: y = x + weight[t] at position t of each sequence of x
 * (..., T, C), weight (T_max >= T, C): GPT-2's `tok_emb + wpe(arange(T))`. */
td_status td_graph_position_embedding(td_graph *g, td_tensor *x, td_tensor *weight, td_tensor **y);

/* nn.LayerNorm over the last dim of x (..., C): each row normalised by its mean and biased
 * variance (+ eps), times weight (C) plus bias (C); either may be NULL. Computes in f32 at
 * every mixed-precision level, as autocast does. */
td_status td_graph_layer_norm(td_graph *g, td_tensor *x, td_tensor *weight, td_tensor *bias,
                              float eps, td_tensor **y);

/* td_graph_layer_norm over `shards` equal blocks of x's rows, each normalised by its own kernel
 * call, the weight's and bias's gradients summed over the blocks in the pairwise tree (the same
 * bits whichever rank holds how many blocks: deterministic tensor parallelism's fixed shards of
 * the tokens; 1 is td_graph_layer_norm). */
td_status td_graph_layer_norm_shards(td_graph *g, td_tensor *x, td_tensor *weight, td_tensor *bias,
                                     float eps, int shards, td_tensor **y);

/* Causal multi-head self-attention over the fused projection qkv (rows, 3C): T = seq_len rows
 * per sequence, one sequence after another (or qkv (B, T, 3C) and seq_len T or 0), each row
 * [q | k | v] with C = heads x hs. y (rows, C) = softmax(q k^T / sqrt(hs), keys up to the row's
 * own position) v per head, the heads side by side: nanoGPT's CausalSelfAttention between its
 * c_attn and c_proj linears. Memory beyond y: one float per (sequence, head, position), not
 * T^2 (docs/gpt.md). */
td_status td_graph_causal_attention(td_graph *g, td_tensor *qkv, int heads, int64_t seq_len,
                                    td_tensor **y);

/* ---- recompute segments (docs/recompute.md) ------------------------------------------- */

/* Opens a segment called `name` (1 to 47 characters): the nodes added until
 * td_graph_segment_end form it, and with td_graph_params.recompute on, backward runs them
 * forward again instead of keeping their activations (a node that updates a buffer never
 * runs twice; its output is kept). Dropout replays the masks it drew, and collective ops
 * their collectives, on every rank alike. Segments do not nest; td_sequential marks each of
 * its layers. After forward, an activation of a recomputing segment that nothing outside it
 * reads holds no values (read the segment's output). */
td_status td_graph_segment_begin(td_graph *g, const char *name);

/* Closes the segment td_graph_segment_begin opened. */
td_status td_graph_segment_end(td_graph *g);

/* ---- running ------------------------------------------------------------------------- */

/* Creates primitives, picks layouts and allocates activations; no nodes may be added
 * afterwards. Compiling a compiled graph does nothing. */
td_status td_graph_compile(td_graph *g);

/* Runs every node forward. */
td_status td_graph_forward(td_graph *g);

/* What computes graphs' ops on `device`, for logs and benchmark headings: on the CPU the kernel
 * library, its version and the instruction set it dispatches here ("oneDNN 2.6.3, ISA
 * avx512_core_bf16", which ONEDNN_MAX_CPU_ISA can lower); the backend's name elsewhere. */
td_status td_graph_backend_info(td_device device, char *buf, size_t cap);

/* NULL when the graph's AMP level runs as asked; otherwise why it does not, one line naming the
 * device and what its kernels dispatch ("amp O2 bf16: cpu (oneDNN 2.6.3, avx2) has no bf16
 * matmul or convolution kernels of its own; computing in f32, as O0 does, ..."), also logged as
 * a warning when the graph was created. Owned by the graph. */
const char *td_graph_amp_fallback(const td_graph *g);

/* Says that the parameters have not changed since the last forward, so the next forward (and
 * its backward) may use the copies of the weights in kernel layouts that the last one made
 * (a convolution's, a blocked linear layer's) instead of making them again. Call it before
 * each forward after the first of an optimizer step: the shards of a deterministic step, the
 * micro-batches of an accumulated one. It holds for one forward; a forward after the
 * parameters changed must not follow it (a parameter moved elsewhere is laid out again). */
void td_graph_keep_weights(td_graph *g);

/* Says that the next backward is shard `index` of the `count` shards of one deterministic step
 * (docs/reproducibility.md; count 0 ends it). Layers that can sum their parameters' gradients
 * over the shards themselves (f32 linear layers on the CPU) then keep each shard's input and
 * output gradient, and the last shard's backward writes the sum of every shard's gradient in
 * deterministic mode's pairwise tree, each written once per step instead of once per shard; only
 * that backward reports those parameters ready, and their td_param entries say so (shard_sum),
 * which deterministic DDP follows. Call it before each shard's backward. */
td_status td_graph_set_shard(td_graph *g, size_t index, size_t count);

/* Backward from a scalar tensor (the loss) with d loss = 1; gradients accumulate. */
td_status td_graph_backward(td_graph *g, td_tensor *loss);

/* Backward from any tensor with a given output gradient (numel floats, plain order, whatever
 * y's dtype), for op tests, custom losses, scaled losses and pipeline stages; gradients
 * accumulate. dy is host memory, or memory on the graph's own GPU (copied there, never through
 * the host). */
td_status td_graph_backward_from(td_graph *g, td_tensor *y, const float *dy);

/* Zeroes every parameter gradient (and those of inputs that take one) the way PyTorch's
 * set_to_none does: the next backward writes them instead of adding to them, and zeroes the
 * ones it never reaches; until that backward they still hold their old values. */
td_status td_graph_zero_grad(td_graph *g);

/* Like td_graph_zero_grad for the inputs that take a gradient only: parameter gradients keep
 * accumulating. A pipeline stage runs one backward per micro-batch into the same parameter
 * gradients, and each backward must hand upstream its own micro-batch's input gradient. */
td_status td_graph_zero_input_grads(td_graph *g);

/* Cancels a pending zero of the parameter gradients: the next backward adds to what they hold.
 * For graphs whose td_param arrays point at one gradient storage (a pipeline stage's
 * micro-batch graphs): the first backward of a step writes, the others add. */
td_status td_graph_accumulate_param_grads(td_graph *g);

/* td_graph_accumulate_param_grads for parameter i alone (after td_graph_zero_grad): the next
 * backward adds its gradient to what it holds and writes the others (a deterministic pipeline
 * stage whose tied weight's gradient a later stage began, as one process's backward would). */
td_status td_graph_accumulate_param_grad(td_graph *g, size_t i);

/* Training (1, the default) or eval (0) mode: dropout and batch norm behave accordingly. */
void td_graph_set_training(td_graph *g, int training);

/* 1 in training mode. */
int td_graph_training(const td_graph *g);

/* The group the graph's collective ops run on (td_graph_params.comm), or NULL. */
td_comm *td_graph_comm(const td_graph *g);

/* This rank in the graph's group (td_graph_params.comm), 0 without one. */
int td_graph_rank(const td_graph *g);

/* Ranks in the graph's group, 1 without one. */
int td_graph_world_size(const td_graph *g);

/* The graph's td_graph_params.tp_shards (0: none). */
int td_graph_tp_shards(const td_graph *g);

/* The dropout RNG: save its two fields and restore them to replay masks bit for bit. */
td_rng *td_graph_rng(td_graph *g);

/* Keys dropout by sample from now on (deterministic training, docs/reproducibility.md): in each
 * forward, sample n of the batch draws its masks from the Philox sub-stream of (step,
 * first_sample + n) under the seed of td_graph_rng, node after node, in logical element order.
 * A sample's masks then depend on the seed, the step and its index only, not on the batch, the
 * layout or the rank it runs in. step and first_sample + batch must be below 2^32. */
td_status td_graph_set_rng_key(td_graph *g, uint64_t step, uint64_t first_sample);

/* The parameters in registration order; the array is owned by the graph and its address
 * is stable after td_graph_compile (grad pointers are valid after compile). The array is
 * the one place that says where parameter i's values and gradient live: a caller may
 * re-point params[i].grad (or .data), values already copied, as DDP does with its buckets,
 * and the graph follows from its next forward, backward or zero_grad. */
td_status td_graph_parameters(td_graph *g, td_param **params, size_t *n);

/* The buffers (grad == NULL) in registration order; same ownership rules. */
td_status td_graph_buffers(td_graph *g, td_param **buffers, size_t *n);

/* The tensor of parameter i (for td_tensor_* access). */
td_tensor *td_graph_param_tensor(td_graph *g, size_t index);

/* Called once per parameter per backward, as soon as that gradient is final. Parameters
 * that no node reached in this sweep are reported at the end of the sweep. */
typedef void (*td_grad_ready_fn)(size_t param_index, void *ctx);

/* Installs (or with NULL removes) the grad-ready hook. */
void td_graph_set_grad_ready_hook(td_graph *g, td_grad_ready_fn fn, void *ctx);

/* Installs (or with NULL removes) the parameter-use hook (param.h's td_param_use): in every
 * forward it is called before the first and after the last node that reads a parameter; in every
 * backward before the first node that reads it and runs backward (or, recomputed, runs forward
 * again: a segment's parameters are announced before it runs), and after the last node that
 * reads it (whether that node ran backward or not); parameters no node reads get their AFTER
 * calls at the sweep's end. The graph then takes the parameter's data and grad from its td_param
 * entry again, so the hook may move them. The calls depend on the graph alone, so every rank
 * running the same graph makes them in the same order. */
void td_graph_set_param_use_hook(td_graph *g, td_param_use_fn fn, void *ctx);

/* Makes `dst` use `src`'s parameter and buffer storage (same names, shapes, order), e.g.
 * an eval graph of another batch size that always sees the training weights. */
td_status td_graph_share_params(td_graph *dst, td_graph *src);

/* How many forward and backward sweeps ran as replays of a recording (CUDA graphs on a GPU;
 * always 0 on the CPU or with cuda_graphs off); *why_not (may be NULL) says why recording was
 * given up, or is NULL while it is on. */
size_t td_graph_replays(const td_graph *g, const char **why_not);

/* Bytes of activation/gradient memory the graph holds (arena high-water mark); recompute
 * makes it smaller (docs/recompute.md). */
size_t td_graph_memory_bytes(const td_graph *g);

#ifdef __cplusplus
}
#endif
#endif
