/* The op contract: what an op table is, what a node holds, and what an op's kernels may touch,
 * as src/comm/comm_impl.h is the contract of a comm backend. An op is device-neutral (its
 * shape inference, precision and fusion rules); its kernels belong to a backend (backend.h),
 * which keeps its own handles and per-tensor layout records: oneDNN is the CPU backend's
 * business, never this header's. The graph (src/graph) includes this header, walks nodes and
 * calls their tables; it never names a particular op. Ops never include graph internals:
 * everything a kernel needs from the engine comes in td__op_ctx. Not installed.
 *
 * A kernel may read its node's inputs and attributes, read and write its output's data and,
 * in backward, the gradients of its inputs (through td__grad_begin / td__grad_end, which add
 * into a gradient that already holds values), and keep private state in node->state. It may
 * not add nodes, allocate tensors or look at other nodes. */
#ifndef TANDEM_OP_H
#define TANDEM_OP_H

#include "tandem/comm.h"
#include "tandem/ops.h"

#include "tensor/tensor_impl.h"

#define TD__MAX_IN 16 /* inputs of one node (concat is the widest) */
#define TD__SCRATCH_SLOTS 3

typedef struct td__node td__node;
typedef struct td__op_ctx td__op_ctx;
typedef struct td__backend td__backend;

/* Every op kind, the index of its kernels in a backend's table. */
typedef enum {
    TD__OP_LINEAR,
    TD__OP_CONV2D,
    TD__OP_POOL2D,
    TD__OP_ELTWISE,
    TD__OP_DROPOUT,
    TD__OP_BATCH_NORM,
    TD__OP_RESHAPE,
    TD__OP_ADD,
    TD__OP_CONCAT,
    TD__OP_SOFTMAX,
    TD__OP_NLL,
    TD__OP_CAST,
    TD__OP_ALL_GATHER,
    TD__OP_ALL_REDUCE,
    TD__OP_SYNC_BATCH_NORM,
    TD__OP_NORMALIZE,
    TD__OP_SCALE,
    TD__OP_EMBEDDING,
    TD__OP_LAYER_NORM,
    TD__OP_ATTENTION,
    TD__OP_TP_REGION,
    TD__OP_VOCAB_PARALLEL_CE,
    TD__OP_PARALLEL_LINEAR,
    TD__OP_COUNT
} td__op_id;

/* What the engine lends an op's kernels: owned by the graph, valid while the call runs. */
struct td__op_ctx {
    const td__backend *backend; /* whose kernels run the nodes */
    td_device device;           /* the backend's device (td_graph_params.device) */
    void *be;                   /* the backend's own handles (CPU: oneDNN's engine and stream) */
    td_arena *arena;            /* host memory for kernels' state; lives as long as the graph */
    td_arena *records;          /* the backend's per-tensor layout records (td_tensor.extra) */
    float *scratch[TD__SCRATCH_SLOTS]; /* each scratch_bytes, for accumulating gradients */
    size_t scratch_bytes;
    int training;       /* training mode (dropout drops, batch norm uses batch statistics) */
    int conv_winograd;  /* convolutions may use Winograd */
    int allow_tf32;     /* f32 matmuls and convolutions may use TF32 (td_graph_params) */
    int blocked_linear; /* linear layers take their weights in a blocked layout */
    int keep_weights;   /* this pass (forward and backward) may use the weight copies in kernel
                           layouts the last pass made: the parameters have not changed */
    size_t shard_index, shard_count; /* td_graph_set_shard: this backward is shard index of
                                        count of one step; count 0: not sharded */
    td_rng *rng;        /* the graph's dropout RNG */
    td_comm *comm;      /* the graph's process group for collective ops; NULL: a group of one */
    /* Dropout keyed by sample instead (td_graph_set_rng_key): sample n of the batch draws from
     * Philox sub-stream (rng_step << 32 | (rng_first_sample + n)) of rng->seed, from word
     * rng_sample_offset on, which each dropout node advances past its draws per sample (a
     * multiple of 4) and each forward resets to 0. */
    int rng_by_sample;
    uint64_t rng_step, rng_first_sample, rng_sample_offset;
    /* Tells the engine that node n's parameter gradients are final (weights_only: all but
     * the data input in[0]'s), so DDP can start reducing them while backward goes on. */
    void (*params_ready)(td__op_ctx *ctx, const td__node *n, int weights_only);
};

/* Per-node attributes, by op. */
typedef union {
    td_conv2d_params conv;
    td_pool2d_params pool;
    td_batch_norm_params bn;
    float p;     /* dropout probability */
    td_shape to; /* reshape's target shape */
    td_reduction reduction;
    struct {
        int world_size;  /* ranks of the group when the node was added */
        td_reduce_op op; /* all_reduce's reduction */
        int tree;        /* tp_region: sums in the fixed pairwise tree over the ranks
                            (td_comm_allreduce_tree), deterministic tensor parallelism's */
    } coll;              /* collective ops */
    float alpha;         /* scale's factor */
    float eps;           /* normalize's lower bound on the norm */
    struct {
        float eps;  /* added to the variance */
        int shards; /* the rows are this many equal blocks, each normalised by its own kernel
                       call, the weight's and bias's gradients summed over them in the pairwise
                       tree (0 or 1: one block) */
    } ln;           /* layer norm */
    struct {
        int heads;       /* attention heads; the width divides among them */
        int64_t seq_len; /* T: rows of the input are sequences of T positions, one after
                            another */
    } attn;              /* causal self-attention */
    struct {
        int world_size;         /* ranks of the group when the node was added */
        int64_t first;          /* the vocabulary id of this rank's first row or column */
        td_reduction reduction; /* the cross-entropy's */
        int shards; /* cross-entropy: 0, or this rank's shards of the vocabulary (its columns
                       cut in equal blocks), each summed alone and the sums added in the
                       pairwise tree over every rank's shards (deterministic tensor parallelism) */
    } vocab;        /* vocabulary-parallel embedding and cross-entropy */
    struct {
        int shards;   /* this rank's shards of the split dimension (td_graph_params.tp_shards /
                         the group's size) */
        int parts;    /* column: blocks of the whole weight's rows (c_attn's q, k, v), each cut
                         into shards alike */
        int by_shard; /* column: y shard by shard (shards x rows, parts x width), else (rows,
                         parts x shards x width) as a linear gives it */
    } plin;           /* column- and row-parallel linear in fixed shards */
} td__op_attr;

/* Variants of the ops that have more than one (td__node.variant). */
enum { TD__POOL_MAX = 0, TD__POOL_AVG = 1 };
enum { TD__ELT_RELU = 0, TD__ELT_GELU = 1, TD__ELT_GELU_TANH = 2 };
enum { TD__DROP_ELEMENT = 0, TD__DROP_CHANNEL = 1 };
enum { TD__SOFTMAX = 0, TD__LOG_SOFTMAX = 1 };
enum { TD__BN_PLAIN = 0, TD__BN_RELU = 1 }; /* TD__BN_RELU: a ReLU folded in */
enum { TD__EMB_TOKEN = 0, TD__EMB_POSITION = 1, TD__EMB_VOCAB_SLICE = 2 };
enum { TD__REGION_COPY = 0, TD__REGION_REDUCE = 1, TD__REGION_REDUCE_SCATTER = 2 };
enum { TD__PLIN_COLUMN = 0, TD__PLIN_ROW = 1 };

/* How an element-wise node relates to the storage of its input after the fusion pass. */
typedef enum {
    TD__OWN_OUTPUT = 0, /* writes its own output */
    TD__FOLDED,         /* its producer computes it; output and gradient alias the input */
    TD__IN_PLACE,       /* overwrites its input (and the input's gradient) */
} td__alias;

/* In what dtype a node computes (mixed precision, graph.h's td_amp_params). */
typedef enum {
    TD__PREC_FOLLOW = 0, /* its inputs' dtype (pooling, activations, dropout, add, reshape) */
    TD__PREC_LOW,        /* the low dtype from AMP level O1 on (linear, conv2d) */
    TD__PREC_F32,        /* f32 whatever its inputs (softmax, the losses) */
} td__precision;

/* The activations a producer can fold into its own primitive. */
typedef enum { TD__NO_ACTIVATION = 0, TD__ACT_RELU = 1 } td__activation;

/* One op kind, the same on every device: a table filled with designated initializers. */
typedef struct td__op {
    td__op_id id;          /* where a backend keeps its kernels */
    const char *name;      /* activation tensors are named "<name>:<node index>" */
    int propagates_layout; /* output keeps the input's (possibly backend-chosen) layout */
    int accepts_blocked;   /* consumes a backend-chosen input layout itself (conv, reshape) */
    /* Checks inputs and attributes (naming node->what on error) and gives the output's shape
     * and dtype; runs while the node is being added. */
    td_status (*infer)(const td__node *n, td_shape *shape, td_dtype *dtype);
    /* Optional fusion hooks (src/graph/fuse.c). `activation` says which activation a node
     * computes, if it is one a producer may fold in; `fold_activation` lets a producer take
     * that activation into its own computation (returns 1 when it does; every backend's
     * kernels then apply it); `set_alias` makes an activation node folded or in place. */
    td__activation (*activation)(const td__node *n);
    int (*fold_activation)(td__node *n, td__activation act);
    void (*set_alias)(td__node *n, td__alias alias);
    /* Backward reads the forward output, so nothing may overwrite it in place. */
    int backward_reads_output;
    /* Mixed precision. The graph casts inputs before adding the node: to the dtype the node
     * computes in (`precision`), and around it, in f32, when its kernels' `supports` says they
     * cannot compute in that dtype. `input_dtype` (NULL: the compute dtype for every float
     * input) lets an input keep another dtype (batch norm's f32 weight and bias). */
    td__precision precision;
    td_dtype (*input_dtype)(const td__node *n, int i, td_dtype dtype);
    /* Optional: kernels written against the backend contract alone (backend.h: copies,
     * accumulation) and the process group, which run on any backend that has none of its own
     * (the collective ops: the group moves device memory as well as host memory). */
    const struct td__kernels *generic;
    /* The kernels talk to the process group and wait for it on the host, so a sweep holding
     * the op cannot be recorded (graph/record.c). */
    int collective;
} td__op;

/* One op's kernels on one backend. */
typedef struct td__kernels {
    /* Optional (NULL: nothing to prepare): creates the backend's objects and per-node state
     * once the layouts of its inputs are known; records the output's layout (and sets
     * `blocked`) when it is not the plain one. */
    td_status (*compile)(td__op_ctx *ctx, td__node *n);
    td_status (*forward)(td__op_ctx *ctx, td__node *n);
    td_status (*backward)(td__op_ctx *ctx, td__node *n);
    /* Optional: frees node->state. */
    void (*destroy)(td__node *n);
    /* Optional (NULL: every float dtype, as plain-C kernels can): 1 when the kernels compute
     * in `dtype` on this device. */
    int (*supports)(const td__node *n, td_dtype dtype, const td__op_ctx *ctx);
    /* Optional: host-side checks of what earlier forwards found (a label out of range), run
     * before every forward, also one that replays a recording. */
    td_status (*check)(td__op_ctx *ctx, td__node *n);
    /* Optional (NULL: never), asked after compile: 1 when backward can sum the node's parameter
     * gradients over a step's shards itself (td_graph_set_shard): each shard's backward keeps
     * what its gradients need, and the last one writes their sum in deterministic mode's
     * pairwise tree and reports them (ctx->params_ready); it does so for nodes the graph marks
     * sums_shards. */
    int (*sums_shards)(const td__op_ctx *ctx, const td__node *n);
    /* Optional (NULL: never), asked after compile: the input whose copy in a kernel's layout
     * the node lays out itself as the input's values are written (weights_written), or -1. */
    int (*lays_out_weights)(const td__op_ctx *ctx, const td__node *n);
    /* Elements [begin, end) of that input were written at `data` (td_param.written's call):
     * lays out the parts of its copy that are complete, and once end reaches the last element,
     * the next forward takes the copy instead of making one. */
    void (*weights_written)(td__op_ctx *ctx, td__node *n, const void *data, size_t begin,
                            size_t end);
} td__kernels;

struct td__node {
    const td__op *op;
    const char *what; /* the builder's word for messages: "max_pool2d", "log_softmax" */
    int index;        /* position in the graph */
    int nin;
    td_tensor *in[TD__MAX_IN]; /* NULL for an absent optional input (a bias) */
    td_tensor *out;
    td__op_attr attr;
    int variant;     /* op-specific switch: max/avg, relu/gelu, channel-wise dropout, ... */
    td__alias alias; /* set by the fusion pass */
    void *state;     /* op-private compiled state */
    int sums_shards; /* set by the graph at compile: its kernels' sums_shards, and no other node
                        reads its parameters */
};

/* 64-byte aligned zeroed memory from the graph's arena (lives as long as the graph). */
void *td__op_alloc(td__op_ctx *ctx, size_t bytes);

/* Where to write t's gradient now: t->grad while nothing has been written since zeroing
 * (oneDNN backward primitives overwrite), otherwise a scratch slot that td__grad_end adds
 * into t->grad. */
void *td__grad_begin(td__op_ctx *ctx, td_tensor *t, int slot);
td_status td__grad_end(td__op_ctx *ctx, td_tensor *t);

/* The op tables (src/ops/<op>.c) and the CPU backend's kernels (src/ops/cpu/<op>.c). */
extern const td__op td__op_linear, td__op_conv2d, td__op_pool2d, td__op_eltwise, td__op_dropout,
    td__op_batch_norm, td__op_reshape, td__op_add, td__op_concat, td__op_softmax, td__op_nll,
    td__op_cast;
extern const td__op td__op_all_gather, td__op_all_reduce, td__op_sync_batch_norm, td__op_normalize,
    td__op_scale;
extern const td__op td__op_embedding, td__op_layer_norm, td__op_attention;
extern const td__op td__op_tp_region, td__op_vocab_parallel_cross_entropy, td__op_parallel_linear;
extern const td__kernels td__cpu_linear, td__cpu_conv2d, td__cpu_pool2d, td__cpu_eltwise,
    td__cpu_dropout, td__cpu_batch_norm, td__cpu_reshape, td__cpu_add, td__cpu_concat,
    td__cpu_softmax, td__cpu_nll, td__cpu_cast, td__cpu_sync_batch_norm, td__cpu_normalize,
    td__cpu_scale;
extern const td__kernels td__cpu_embedding, td__cpu_layer_norm, td__cpu_attention;
extern const td__kernels td__cpu_vocab_parallel_cross_entropy, td__cpu_parallel_linear;

#endif
