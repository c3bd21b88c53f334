/* The oneDNN plumbing of the CPU backend's kernels: its handles and per-tensor memory
 * descriptors, memory objects re-pointed only when a pointer changes, primitive descriptors
 * and primitives created with errors that name the op, execution on the engine's stream, and
 * reorders between layouts (with "adapters" that exist only where two layouts differ). No op
 * logic lives here. Not installed. */
#ifndef TANDEM_ONEDNN_H
#define TANDEM_ONEDNN_H

#include <dnnl.h>

#include "ops/backend.h"

/* The CPU backend's handles (td__op_ctx.be). */
typedef struct {
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    int bf16_native; /* oneDNN computes bf16 here (the CPU has AVX512_BF16 or AMX) */
} td__cpu;

static inline td__cpu *td__cpu_of(const td__op_ctx *ctx) { return (td__cpu *)ctx->be; }

/* The memory descriptor the CPU backend records for t (td_tensor.extra): the layout of its
 * data and grad. */
static inline dnnl_memory_desc_t *td__md(const td_tensor *t) {
    return (dnnl_memory_desc_t *)t->extra;
}

/* The oneDNN data type of a dtype (i64 and f64 have none: their md only describes a shape). */
dnnl_data_type_t td__dnnl_dtype(td_dtype dtype);

/* The plain row-major layout of `shape` in `dtype` (a scalar is one element). */
void td__md_plain(dnnl_memory_desc_t *md, const td_shape *shape, td_dtype dtype);

/* 1 when md is the plain row-major layout of `shape` (in md's own dtype). */
int td__md_is_plain(const dnnl_memory_desc_t *md, const td_shape *shape);

/* Offset in elements of logical element (n, c, h, w) of a 4-d md, plain or with one inner
 * channel block (nChw8c / nChw16c); -1 for other layouts. */
int64_t td__md_offset4(const dnnl_memory_desc_t *md, int64_t n, int64_t c, int64_t h, int64_t w);

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

/* Returns TD_EBACKEND naming `what` when a oneDNN call fails. */
#define TD__DNNL(call, what)                                                                     \
    do {                                                                                         \
        dnnl_status_t td_s_ = (call);                                                            \
        if (td_s_ != dnnl_success)                                                               \
            return td__fail(TD_EBACKEND, "%s: oneDNN call %s failed (status %d)", (what), #call, \
                            (int)td_s_);                                                         \
    } while (0)

/* The kernels' `supports` for ops that run through oneDNN: f32, and bf16 where oneDNN
 * computes it natively (td__cpu.bf16_native). */
int td__onednn_supports(const td__node *n, td_dtype dtype, const td__op_ctx *ctx);

/* Creates a memory object for md (handle set later with td__mem_bind). */
td_status td__mem_init(td__op_ctx *ctx, td__mem *m, const dnnl_memory_desc_t *md);
void td__mem_free(td__mem *m);

static inline void td__mem_bind(td__mem *m, void *ptr) {
    if (m->ptr != ptr) {
        dnnl_memory_set_data_handle(m->mem, ptr);
        m->ptr = ptr;
    }
}

/* Creates a primitive descriptor for an op descriptor (hint: the forward pd or NULL). */
td_status td__pd_create(td__op_ctx *ctx, dnnl_primitive_desc_t *pd, const_dnnl_op_desc_t desc,
                        const_dnnl_primitive_desc_t hint, const char *what);

/* 1 when oneDNN picked a slow kernel for this pd: its reference one, or a gemm-based one
 * (im2col + gemm), several times slower than its direct kernels where those exist. */
int td__pd_is_slow(const_dnnl_primitive_desc_t pd);

/* A copy of the md that a pd reports for `what` (dnnl_query_src_md, ...). */
dnnl_memory_desc_t td__pd_md(const_dnnl_primitive_desc_t pd, dnnl_query_t what);

/* Creates a primitive from a primitive descriptor (the pd stays owned by the caller). */
td_status td__prim_create(dnnl_primitive_t *prim, const_dnnl_primitive_desc_t pd, const char *what);

/* Runs a primitive on the engine's stream and waits. */
td_status td__exec(td__op_ctx *ctx, dnnl_primitive_t prim, int nargs, const dnnl_exec_arg_t *args,
                   const char *what);

td_status td__reorder_init(td__op_ctx *ctx, td__reorder *r, const dnnl_memory_desc_t *src,
                           const dnnl_memory_desc_t *dst);
td_status td__reorder_run(td__op_ctx *ctx, td__reorder *r, const void *src, void *dst);
void td__reorder_free(td__reorder *r);

/* A reorder that exists only when two layouts differ, with its own destination buffer
 * from the arena: `td__adapt_in` returns src itself or the reordered copy. */
typedef struct {
    int need;
    td__reorder r;
    void *buf;
    const void *src_now;   /* what buf was last reordered from */
    const void *made_from; /* what its owner wrote buf from since (td__adapt_made), or NULL */
    /* A plain matrix whose rows are a multiple of 4 KiB is copied into `stage`, rows padded,
     * before a reorder that gathers across its rows (see td__adapt_init). */
    char *stage;
    size_t rows, row_bytes, stage_row_bytes;
} td__adapt;

td_status td__adapt_init(td__op_ctx *ctx, td__adapt *a, const dnnl_memory_desc_t *from,
                         const dnnl_memory_desc_t *to);
/* src in `from` layout -> pointer to the same values in `to` layout (NULL on failure). */
void *td__adapt_in(td__op_ctx *ctx, td__adapt *a, const void *src);
/* td__adapt_in for weights: the copy the last call made when the pass keeps its weights
 * (ctx->keep_weights) and w is where that copy came from. */
void *td__adapt_weights(td__op_ctx *ctx, td__adapt *a, const void *w);
/* Says that the adapter's owner wrote buf itself, in `to` layout, from src's values (NULL:
 * buf is being rewritten and holds no copy): the next td__adapt_weights of src takes it. */
void td__adapt_made(td__adapt *a, const void *src);
/* Where a primitive should write a result that belongs at dst (in `to` layout)... */
void *td__adapt_out_ptr(td__adapt *a, void *dst);
/* ...and the reorder into dst afterwards (a no-op when the layouts match). */
td_status td__adapt_out(td__op_ctx *ctx, td__adapt *a, void *dst);
void td__adapt_free(td__adapt *a);

#endif
