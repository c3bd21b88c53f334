/* Internals of the graph engine shared by the files of src/graph: the graph struct and the
 * passes and helpers its files call. The graph sits above the ops: it includes the op
 * contract (ops/op.h) and walks op tables, and only build.c names particular ops. Not
 * installed; nn/ and parallel/ use the public headers. */
#ifndef TANDEM_GRAPH_IMPL_H
#define TANDEM_GRAPH_IMPL_H

#include "tandem/graph.h"

#include "ops/backend.h"

/* A cast the graph made (autocast.c), so that a tensor is cast to a dtype only once. */
typedef struct {
    td_tensor *from;
    td_dtype dtype;
    td_tensor *to;
} td__graph_cast_entry;

/* A sweep the backend recorded (record.c): its key, its recording and what a replay must redo
 * on the host. */
typedef struct {
    void *recording; /* the backend's; NULL: none */
    int seen;
    uint64_t storage_gen;
    /* where every tensor's memory was when recorded */ /* the last sweep ran op by op with this
                                                           key */
    int training, by_sample;     /* forward's key: the training mode, dropout keyed by sample */
    const td_tensor *from;       /* backward's key: where it starts ... */
    unsigned char *flags_before; /* ... and every tensor's gradient flags (ntensors) */
    unsigned char *flags_after;  /* backward: the flags a replay leaves */
    uint64_t rng_advance, sample_advance; /* forward: the dropout RNG's draws */
} td__recorded_sweep;

/* A recompute segment (recompute.c): the nodes [first, last] added between
 * td_graph_segment_begin and td_graph_segment_end. */
typedef struct {
    char name[48];
    int first, last; /* last < first: no nodes */
    int selected;    /* recompute_segments names it */
} td__segment;

/* Activation recompute (recompute.c): the segments, what compile planned, and what the last
 * forward leaves for backward to run it again with. */
typedef struct {
    td__segment *segments;
    int nsegments, cap_segments;
    int open;              /* the segment being built, or -1 */
    char *segments_spec;   /* td_graph_params.recompute_segments, copied */
    char *keep_spec;       /* td_graph_params.recompute_keep, copied */
    int *segment_of;       /* (nnodes) the recomputing segment node k is in, or -1; NULL: none */
    unsigned char *rerun;  /* (nnodes) its output is dropped: backward runs it forward again */
    unsigned char *drop;   /* (ntensors) dropped: lives in the shared region */
    size_t *cursor;        /* (nsegments) bytes of the region a segment's dropped tensors take */
    size_t region;         /* the shared region: the largest segment's */
    uint64_t *rng_at;      /* (nnodes) the dropout RNG's offset before node k ran forward, from
                              the forward's start */
    uint64_t *sample_at;   /* (nnodes) the sample stream's offset before node k ran forward */
    td_rng rng;            /* the dropout RNG as the last forward started */
    int training, by_sample;          /* the last forward's mode and dropout key ... */
    uint64_t step, first_sample;      /* ... (td_graph_set_rng_key's) */
    int done;              /* the segment this backward ran forward again last, or -1 */
} td__recompute;

/* A parameter's writer hook context (td_param.written): the node whose kernels lay out a copy
 * of it as it is written. */
typedef struct {
    td_graph *g;
    td__node *node;
} td__param_writer;

struct td_graph {
    td__op_ctx ctx; /* first: an op's ctx pointer is the graph's address */
    td_graph_params opt;
    int compiled;
    td_rng rng;
    td_tensor **tensors;
    int ntensors, cap_tensors;
    td__node **nodes;
    int nnodes, cap_nodes;
    td_param *params; /* the public view: params[i].grad is where gradient i lives */
    td_tensor **param_t;
    int nparams, cap_params;
    td_param *buffers;
    td_tensor **buffer_t;
    int nbuffers, cap_buffers;
    int *param_last_node;  /* (nparams) lowest consumer node index, or -1 */
    int *param_final_node; /* (nparams) highest consumer node index, or -1 */
    unsigned char *fired;  /* (nparams) hook already called in this sweep */
    unsigned char *used;   /* (nparams) the use hook's BEFORE_BACKWARD made in this sweep */
    unsigned char *shard_summed; /* (nparams) read by a node that sums a step's shards itself */
    td__param_writer *writers;   /* (nparams) td_param.written's contexts */
    td_grad_ready_fn hook;
    void *hook_ctx;
    td_param_use_fn use_hook; /* td_graph_set_param_use_hook's */
    void *use_ctx;
    td__graph_cast_entry *casts;
    int ncasts, cap_casts;
    /* Activations, gradients and scratch (and, on a GPU, the leaves too) in one allocation
     * from the backend, made by td__graph_allocate. */
    void *storage;
    size_t storage_bytes;
    int zero_failed;  /* a deferred gradient zeroing failed during this backward */
    int keep_weights; /* td_graph_keep_weights: the next forward keeps its kernels' weights */
    td__recorded_sweep rec_forward, rec_backward;
    size_t replays;         /* sweeps run as replays */
    uint64_t storage_gen;   /* bumped whenever a tensor is pointed at other memory */
    char record_why[256];   /* why recording was given up; empty while it is on */
    int record_checked;     /* the nodes were found recordable */
    char amp_fallback[512]; /* why the AMP level computes in f32 here (td_graph_amp_fallback) */
    float *dy_host;         /* backward's upstream gradient, staged in pageable memory */
    size_t dy_host_count;
    td__recompute rc;     /* activation recompute (recompute.c) */
};

/* Where td__graph_allocate puts each tensor: offsets into the graph's one storage block, by
 * tensor id (SIZE_MAX: none). */
typedef struct {
    size_t *data, *grad;
    size_t total;
} td__storage_plan;

/* Reserves bytes (64-byte aligned) at the end of the plan and returns their offset
 * (memplan.c). */
size_t td__storage_place(td__storage_plan *p, size_t bytes);

/* Adds a node of `op` over inputs ins (checked: of this graph, not compiled) with
 * attributes `attr` and `variant`, under mixed precision (autocast.c: its inputs cast to the
 * dtype it computes in, its output cast back when it computes in f32 for its kernels); the op's
 * infer gives its output. `what` names the node in errors ("max_pool2d"). */
td_status td__graph_add(td_graph *g, const td__op *op, const char *what, td_tensor *const *ins,
                        int nin, const td__op_attr *attr, int variant, td_tensor **out);

/* The checks of td__graph_add before anything is added (graph.c): g and out given, g not
 * compiled, 1 to TD__MAX_IN inputs of this graph, kernels for op on g's device. */
td_status td__graph_check_add(td_graph *g, const td__op *op, const char *what,
                              td_tensor *const *ins, int nin, td_tensor **out);

/* Adds a node of `op` over checked inputs exactly as given, with no mixed precision (graph.c):
 * td__graph_add's last step, and how mixed precision inserts its casts. */
td_status td__graph_insert(td_graph *g, const td__op *op, const char *what, td_tensor *const *ins,
                           int nin, const td__op_attr *attr, int variant, td_tensor **out);

/* Compile passes, in the order td_graph_compile runs them. */
void td__graph_fuse(td_graph *g);                 /* fuse.c: fold or run activations in place */
td_status td__recompute_plan(td_graph *g);        /* recompute.c: which activations are dropped */
void td__graph_plan_layouts(td_graph *g);         /* which activations may stay blocked */
td_status td__graph_make_primitives(td_graph *g); /* every op's compile */
td_status td__graph_allocate(td_graph *g);        /* activation, gradient and scratch memory */

/* Recompute (recompute.c). init copies td_graph_params' strings and checks the mode (errors
 * name td_graph_create); free releases what recompute holds. */
td_status td__recompute_init(td_graph *g);
void td__recompute_free(td_graph *g);

/* Places a dropped tensor t (and its gradient) in its segment's part of the shared region,
 * at offsets relative to the region, and returns 1; 0 for a tensor that is not dropped.
 * rebase then reserves the region and moves those offsets into it. */
int td__recompute_place(td_graph *g, td__storage_plan *p, const td_tensor *t);
void td__recompute_rebase(td_graph *g, td__storage_plan *p);

/* Forward's part: the key the sweep draws dropout with (begin, before the sweep, which may be a
 * replay) and the RNG's offsets before node k runs (note). */
void td__recompute_forward_begin(td_graph *g);
void td__recompute_note(td_graph *g, int k);

/* Backward's part, before node k runs backward: when k is the first node of a recomputing
 * segment this backward reaches, announces the parameters its dropped nodes read (the
 * parameter-use hook) and runs them forward again, as the last forward ran them. */
td_status td__recompute_before_backward(td_graph *g, int k);

/* The parameter-use hook's BEFORE_BACKWARD for the parameters node n reads, each once per
 * backward (graph.c). */
td_status td__graph_use_params_backward(td_graph *g, const td__node *n);

/* Runs run(g, arg), a forward (from NULL) or a backward from `from`, recorded and replayed
 * where the backend can (record.c). */
td_status td__graph_sweep(td_graph *g, const td_tensor *from,
                          td_status (*run)(td_graph *, const void *), const void *arg);

/* Frees the graph's recordings. */
void td__graph_records_free(td_graph *g);

/* Inference graphs (grad_enabled = 0): places every activation in the plan, letting an
 * activation reuse the memory of one whose consumers have all run (memplan.c). */
td_status td__plan_inference_memory(td_graph *g, td__storage_plan *plan);

/* The graph's kernel thread count (td_graph_params.threads) for one call into its kernels:
 * enter sets it (what names the call in errors) and gives the caller's in *was, which leave
 * sets back; *was is 0 when nothing was changed. */
td_status td__graph_threads_enter(td_graph *g, const char *what, int *was);
void td__graph_threads_leave(td_graph *g, int was);

/* Points parameter and buffer tensors at the storage their td_param entries name: the
 * td_param arrays are the one source of truth for where parameters, buffers and parameter
 * gradients live (DDP moves gradients into its buckets; a loader may move data). */
void td__graph_sync_storage(td_graph *g);

#endif
