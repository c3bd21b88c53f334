/* What a tensor is below the graph: its shape, dtype, kind, storage layout (a oneDNN memory
 * descriptor, plain or blocked) and storage, and the gradient beside it. Ops read and write
 * the fields of the first two groups; only the graph reads the bookkeeping at the end.
 * Not installed. It allocates nothing: the graph owns every tensor and its memory. */
#ifndef TANDEM_TENSOR_IMPL_H
#define TANDEM_TENSOR_IMPL_H

#include <dnnl.h>

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
    dnnl_memory_desc_t md; /* layout of data and grad */
    int blocked;           /* md is not the plain row-major layout */
    size_t bytes;          /* storage size of md (>= numel * dtype size with padding) */
    void *own;             /* storage the graph owns (leaves: malloc, activations: arena) */
    void *data;            /* current storage: own, or caller memory for inputs */
    void *grad;            /* the same layout and dtype as data, or NULL */
    int requires_grad;     /* a gradient is computed and stored for it */
    int grad_zero;         /* nothing has been written to grad since it was last zeroed */
    int grad_scratch;      /* slot + 1 while td__grad_begin handed out scratch, else 0 */
    /* graph bookkeeping */
    struct td_graph *g;
    int id;              /* position in the graph's tensor list */
    int producer;        /* node index, -1 for leaves */
    int nconsumers;      /* nodes that read it */
    int may_block;       /* every consumer accepts a oneDNN-chosen layout */
    td_tensor *alias_of; /* shares data and grad storage with this tensor (fused ops) */
};

/* The oneDNN data type of a dtype (i64 and f64 have none: their md only describes a shape). */
dnnl_data_type_t td__dnnl_dtype(td_dtype dtype);

/* The plain row-major layout of `shape` in `dtype` (a scalar is one element). */
void td__md_plain(dnnl_memory_desc_t *md, const td_shape *shape, td_dtype dtype);

/* 1 when md is the plain row-major layout of `shape` (in md's own dtype). */
int td__md_is_plain(const dnnl_memory_desc_t *md, const td_shape *shape);

/* Elements in t's storage (md size over the element size, blocked padding included). */
static inline size_t td__nelems(const td_tensor *t) { return t->bytes / td_dtype_size(t->dtype); }

/* Offset in elements of logical element (n, c, h, w) of a 4-d md, plain or with one inner
 * channel block (nChw8c / nChw16c); -1 for other layouts. */
int64_t td__md_offset4(const dnnl_memory_desc_t *md, int64_t n, int64_t c, int64_t h, int64_t w);

#endif
