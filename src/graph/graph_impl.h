/* Internals of the graph engine shared by src/graph, src/tensor and the oneDNN ops in
 * src/ops: the tensor and node structs, the op table, and helpers for oneDNN memory,
 * reorders and gradient accumulation. Not installed; not for code outside the engine. */
#ifndef TANDEM_GRAPH_IMPL_H
#define TANDEM_GRAPH_IMPL_H

#include <dnnl.h>

#include "tandem/graph.h"

#include "core/core_impl.h"

#define TD__MAX_IN 16 /* inputs of one node (concat is the widest) */
#define TD__SCRATCH_SLOTS 3

typedef enum { TD__INPUT, TD__PARAM, TD__BUFFER, TD__ACT } td__tensor_kind;

struct td_tensor {
    td_graph *g;
    char name[64];
    td_shape shape;
    td_dtype dtype;
    td__tensor_kind kind;
    int index;         /* position in params/buffers/inputs of its kind */
    int requires_grad; /* a gradient is computed and stored for it */
    int producer;      /* node index, -1 for leaves */
    int nconsumers;
    int may_block;         /* every consumer accepts a oneDNN-chosen layout */
    int blocked;           /* md is not the plain row-major layout */
    dnnl_memory_desc_t md; /* layout of data and grad (f32 only) */
    size_t bytes;          /* storage size of md (>= numel * dtype size with padding) */
    void *own;             /* storage the graph owns (leaves: malloc, activations: arena) */
    void *data;            /* current storage: own, or caller memory for inputs */
    float *grad;           /* (bytes / 4) in md's layout, or NULL */
    int grad_zero;         /* nothing has been written to grad since it was last zeroed */
    int grad_scratch;      /* slot + 1 while td__grad_begin handed out scratch, else 0 */
    td_tensor *alias_of;   /* shares data and grad storage with this tensor (fused ops) */
    int id;                /* position in g->tensors */
};

typedef struct td__node td__node;

/* One op kind: compile once, then forward/backward every step. */
typedef struct {
    const char *name;
    int propagates_layout; /* output keeps the input's (possibly blocked) layout */
    int accepts_blocked;   /* consumes a blocked input itself (conv, flatten, reshape) */
    td_status (*compile)(td_graph *g, td__node *n);
    td_status (*forward)(td_graph *g, td__node *n);
    td_status (*backward)(td_graph *g, td__node *n);
    void (*destroy)(td__node *n); /* frees n->state */
} td__op;

struct td__node {
    const td__op *op;
    int index;
    int nin;
    td_tensor *in[TD__MAX_IN];
    td_tensor *out;
    union {
        td_conv2d_params conv;
        td_pool2d_params pool;
        td_batch_norm_params bn;
        float p;
        int start_dim;
        td_reduction reduction;
    } attr;
    int variant; /* op-specific switch: max/avg, relu/gelu, channelwise dropout, softmax/log */
    void *state; /* op-private compiled state */
};

struct td_graph {
    td_graph_options opt;
    int training;
    int compiled;
    td_rng rng;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    td_arena *arena;
    td_tensor **tensors;
    int ntensors, cap_tensors;
    td__node **nodes;
    int nnodes, cap_nodes;
    td_param *params;
    td_tensor **param_t;
    int nparams, cap_params;
    td_param *buffers;
    td_tensor **buffer_t;
    int nbuffers, cap_buffers;
    float *scratch[TD__SCRATCH_SLOTS]; /* each scratch_bytes, for accumulating grads */
    size_t scratch_bytes;
    int *param_last_node; /* (nparams) lowest consumer node index, or -1 */
    unsigned char *fired; /* (nparams) hook already called in this sweep */
    td_grad_ready_fn hook;
    void *hook_ctx;
};

/* A oneDNN memory object whose handle is re-pointed only when the pointer changes. */
typedef struct {
    dnnl_memory_t mem;
    void *ptr;
} td__mem;

/* A compiled reorder between two layouts. */
typedef struct {
    dnnl_primitive_t prim;
    td__mem src, dst;
} td__reorder;

#define TD__DNNL(call, what)                                                                     \
    do {                                                                                         \
        dnnl_status_t td_s_ = (call);                                                            \
        if (td_s_ != dnnl_success)                                                               \
            return td__fail(TD_EBACKEND, "%s: oneDNN call %s failed (status %d)", (what), #call, \
                            (int)td_s_);                                                         \
    } while (0)

#define TD__TRY(call)                     \
    do {                                  \
        td_status td_t_ = (call);         \
        if (td_t_ != TD_OK) return td_t_; \
    } while (0)

/* Adds a node with inputs ins and a fresh f32 activation output of `shape`. */
td_status td__graph_add_node(td_graph *g, const td__op *op, td_tensor *const *ins, int nin,
                             td_shape shape, td__node **out);

/* Fires the grad-ready hook for n's parameters whose gradient is final once n's weight
 * gradients are written (n is their last consumer in backward); ops call it before their
 * data gradient so that DDP's all-reduce overlaps that work (weights_only: not the data
 * input in[0], whose gradient comes later). Idempotent. */
void td__node_params_ready(td_graph *g, td__node *n, int weights_only);

/* Inference graphs (grad_enabled = 0): gives every activation its storage, letting an
 * activation reuse the memory of one whose consumers have all run. */
td_status td__plan_inference_memory(td_graph *g);

/* Follows params[i].data/.grad and buffers[i].data when a caller re-pointed them. */
void td__graph_sync_storage(td_graph *g);

/* Checks that t belongs to g and is usable as an op input (names the op on failure). */
td_status td__check_input(td_graph *g, const td_tensor *t, const char *op);

/* Plain row-major md of a shape (f32). */
void td__md_plain(dnnl_memory_desc_t *md, const td_shape *shape);

/* Creates a memory object for md (handle set later with td__mem_bind). */
td_status td__mem_init(td_graph *g, td__mem *m, const dnnl_memory_desc_t *md);
void td__mem_free(td__mem *m);

static inline void td__mem_bind(td__mem *m, void *ptr) {
    if (m->ptr != ptr) {
        dnnl_memory_set_data_handle(m->mem, ptr);
        m->ptr = ptr;
    }
}

/* Creates a primitive descriptor for an op descriptor (hint: the forward pd or NULL). */
td_status td__pd_create(td_graph *g, dnnl_primitive_desc_t *pd, const_dnnl_op_desc_t desc,
                        const_dnnl_primitive_desc_t hint, const char *what);

/* 1 when oneDNN fell back to its slow reference kernel for this pd. */
int td__pd_is_reference(const_dnnl_primitive_desc_t pd);

/* A copy of the md that a pd reports for `what` (dnnl_query_src_md, ...). */
dnnl_memory_desc_t td__pd_md(const_dnnl_primitive_desc_t pd, dnnl_query_t what);

/* 1 when md is t's plain row-major layout. */
int td__md_is_plain(const dnnl_memory_desc_t *md, const td_shape *shape);

/* 64-byte aligned zeroed memory from the graph's arena (lives as long as the graph). */
void *td__graph_alloc(td_graph *g, size_t bytes);

/* Creates a primitive from a primitive descriptor (the pd stays owned by the caller). */
td_status td__prim_create(dnnl_primitive_t *prim, const_dnnl_primitive_desc_t pd, const char *what);

/* Runs a primitive on the graph's stream and waits. */
td_status td__exec(td_graph *g, dnnl_primitive_t prim, int nargs, const dnnl_exec_arg_t *args,
                   const char *what);

td_status td__reorder_init(td_graph *g, td__reorder *r, const dnnl_memory_desc_t *src,
                           const dnnl_memory_desc_t *dst);
td_status td__reorder_run(td_graph *g, td__reorder *r, const void *src, void *dst);
void td__reorder_free(td__reorder *r);

/* A reorder that exists only when two layouts differ, with its own destination buffer
 * from the arena: `td__adapt_in` returns src itself or the reordered copy. */
typedef struct {
    int need;
    td__reorder r;
    void *buf;
} td__adapt;

td_status td__adapt_init(td_graph *g, td__adapt *a, const dnnl_memory_desc_t *from,
                         const dnnl_memory_desc_t *to);
/* src in `from` layout -> pointer to the same values in `to` layout (NULL on failure). */
void *td__adapt_in(td_graph *g, td__adapt *a, const void *src);
/* Where a primitive should write a result that belongs at dst (in `to` layout)... */
void *td__adapt_out_ptr(td__adapt *a, void *dst);
/* ...and the reorder into dst afterwards (a no-op when the layouts match). */
td_status td__adapt_out(td_graph *g, td__adapt *a, void *dst);
void td__adapt_free(td__adapt *a);

/* Where to write t's gradient now: t->grad while nothing has been written since zeroing
 * (oneDNN backward primitives overwrite), otherwise a scratch slot that td__grad_end adds
 * into t->grad. */
float *td__grad_begin(td_graph *g, td_tensor *t, int slot);
void td__grad_end(td_graph *g, td_tensor *t);

/* Floats in t's storage (md size / 4, including blocked padding). */
static inline size_t td__nfloats(const td_tensor *t) { return t->bytes / sizeof(float); }

/* Offset in floats of logical element (n, c, h, w) of a 4-d md, plain or with one inner
 * channel block (nChw8c / nChw16c); -1 for other layouts. */
int64_t td__md_offset4(const dnnl_memory_desc_t *md, int64_t n, int64_t c, int64_t h, int64_t w);

/* Compile-time fusion: a ReLU whose input is a batch norm output used by nothing else
 * runs inside the batch norm primitive (variants below); returns 1 when it fused. */
int td__fuse_bn_relu(td__node *bn, td__node *relu);

/* Makes a ReLU whose input nothing else reads work in place. */
void td__relu_in_place(td__node *relu);

#define TD__ELT_ALIAS 2     /* eltwise variant: fused away, output aliases the input */
#define TD__ELT_INPLACE 3   /* eltwise variant: ReLU overwriting its input (and its grad) */
#define TD__BN_FUSED_RELU 1 /* batch norm variant: applies ReLU itself */

/* The op tables (src/ops). */
extern const td__op td__op_linear, td__op_conv2d, td__op_pool2d, td__op_eltwise, td__op_dropout,
    td__op_batch_norm, td__op_reshape, td__op_add, td__op_concat, td__op_softmax, td__op_nll;

#endif
