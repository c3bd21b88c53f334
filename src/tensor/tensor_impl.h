/* What a tensor is below the graph: its shape, dtype, kind, storage layout (plain row-major,
 * or one its backend chose, recorded by the backend) and storage, and the gradient beside
 * it. Ops read and write the fields of the first two groups; only the graph reads the
 * bookkeeping at the end. Not installed. It allocates nothing: the graph owns every tensor
 * and its memory. */
#ifndef TANDEM_TENSOR_IMPL_H
#define TANDEM_TENSOR_IMPL_H

#include "tandem/tensor.h"

#include "core/core_impl.h"

/* What a tensor is to the graph that owns it. */
typedef enum { TD__INPUT, TD__PARAM, TD__BUFFER, TD__ACT } td__tensor_kind;

struct td_tensor {
    /* identity */
    char name[64];
    td_shape shape;
    td_dtype dtype;
    td__tensor_kind kind;
    int index; /* position among the graph's inputs, parameters or buffers of its kind */
    /* layout and storage */
    void *extra;       /* the backend's record of the layout of data and grad */
    int blocked;       /* a layout the backend chose, not the plain row-major one */
    size_t bytes;      /* storage size (>= numel * dtype size with padding) */
    void *own;         /* storage the graph owns (leaves: malloc, activations: arena) */
    void *data;        /* current storage: own, or caller memory for inputs */
    void *grad;        /* the same layout and dtype as data, or NULL */
    int requires_grad; /* a gradient is computed and stored for it */
    int grad_zero;     /* nothing has been written to grad since it was last zeroed */
    int grad_scratch;  /* slot + 1 while td__grad_begin handed out scratch, else 0 */
    float sum_scale;   /* td_param.shard_sum_scale at td_graph_set_shard (0: 1) */
    /* graph bookkeeping */
    struct td_graph *g;
    int id;              /* position in the graph's tensor list */
    int producer;        /* node index, -1 for leaves */
    int nconsumers;      /* nodes that read it */
    int may_block;       /* every consumer accepts a backend-chosen layout */
    td_tensor *alias_of; /* shares data and grad storage with this tensor (fused ops) */
};

/* Elements in t's storage (storage bytes over the element size, padding included). */
static inline size_t td__nelems(const td_tensor *t) { return t->bytes / td_dtype_size(t->dtype); }

#endif
