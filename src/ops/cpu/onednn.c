/* oneDNN plumbing for the CPU backend's kernels (see onednn.h): memory descriptors of plain
 * and blocked layouts, memory objects bound lazily, primitive creation and execution with
 * errors that name the op, and reorders between layouts. */
#include "ops/cpu/onednn.h"

#include <string.h>

dnnl_data_type_t td__dnnl_dtype(td_dtype dtype) {
    switch (dtype) {
    case TD_BF16:
        return dnnl_bf16;
    case TD_F16:
        return dnnl_f16;
    case TD_I32:
        return dnnl_s32;
    case TD_U8:
        return dnnl_u8;
    default:
        return dnnl_f32;
    }
}

/* The plain row-major md of a shape in a oneDNN data type. */
static void plain(dnnl_memory_desc_t *md, const td_shape *shape, dnnl_data_type_t type) {
    static const dnnl_format_tag_t tags[] = {dnnl_a,      dnnl_a,       dnnl_ab,
                                             dnnl_abc,    dnnl_abcd,    dnnl_abcde,
                                             dnnl_abcdef, dnnl_abcdefg, dnnl_abcdefgh};
    dnnl_dims_t dims = {1};
    int nd = shape->ndim ? shape->ndim : 1;
    for (int i = 0; i < shape->ndim; i++) dims[i] = shape->dim[i];
    dnnl_memory_desc_init_by_tag(md, nd, dims, type, tags[nd]);
}

void td__md_plain(dnnl_memory_desc_t *md, const td_shape *shape, td_dtype dtype) {
    plain(md, shape, td__dnnl_dtype(dtype));
}

int td__md_is_plain(const dnnl_memory_desc_t *md, const td_shape *shape) {
    dnnl_memory_desc_t p;
    plain(&p, shape, md->data_type);
    return dnnl_memory_desc_equal(md, &p);
}

int64_t td__md_offset4(const dnnl_memory_desc_t *md, int64_t n, int64_t c, int64_t h, int64_t w) {
    if (md->ndims != 4 || md->format_kind != dnnl_blocked) return -1;
    const dnnl_blocking_desc_t *b = &md->format_desc.blocking;
    int64_t blk = 1;
    if (b->inner_nblks == 1 && b->inner_idxs[0] == 1)
        blk = b->inner_blks[0];
    else if (b->inner_nblks != 0)
        return -1;
    return n * b->strides[0] + (c / blk) * b->strides[1] + h * b->strides[2] + w * b->strides[3] +
           (c % blk);
}

int td__onednn_supports(const td__node *n, td_dtype dtype, const td__op_ctx *ctx) {
    (void)n;
    return dtype == TD_F32 || (dtype == TD_BF16 && td__cpu_of(ctx)->bf16_native);
}

td_status td__mem_init(td__op_ctx *ctx, td__mem *m, const dnnl_memory_desc_t *md) {
    m->ptr = NULL;
    TD__DNNL(dnnl_memory_create(&m->mem, md, td__cpu_of(ctx)->engine, DNNL_MEMORY_NONE), "memory");
    return TD_OK;
}

void td__mem_free(td__mem *m) {
    if (m->mem) dnnl_memory_destroy(m->mem);
    m->mem = NULL;
    m->ptr = NULL;
}

td_status td__pd_create(td__op_ctx *ctx, dnnl_primitive_desc_t *pd, const_dnnl_op_desc_t desc,
                        const_dnnl_primitive_desc_t hint, const char *what) {
    TD__DNNL(dnnl_primitive_desc_create(pd, desc, NULL, td__cpu_of(ctx)->engine, hint), what);
    return TD_OK;
}

int td__pd_is_slow(const_dnnl_primitive_desc_t pd) {
    const char *impl = NULL;
    if (dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) != dnnl_success || !impl)
        return 0;
    return strncmp(impl, "ref", 3) == 0 || strstr(impl, "gemm") != NULL;
}

dnnl_memory_desc_t td__pd_md(const_dnnl_primitive_desc_t pd, dnnl_query_t what) {
    const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(pd, what, 0);
    dnnl_memory_desc_t copy;
    if (md)
        copy = *md;
    else
        memset(&copy, 0, sizeof copy);
    return copy;
}

td_status td__prim_create(dnnl_primitive_t *prim, const_dnnl_primitive_desc_t pd,
                          const char *what) {
    TD__DNNL(dnnl_primitive_create(prim, pd), what);
    return TD_OK;
}

td_status td__exec(td__op_ctx *ctx, dnnl_primitive_t prim, int nargs, const dnnl_exec_arg_t *args,
                   const char *what) {
    TD__DNNL(dnnl_primitive_execute(prim, td__cpu_of(ctx)->stream, nargs, args), what);
    return TD_OK;
}

td_status td__reorder_init(td__op_ctx *ctx, td__reorder *r, const dnnl_memory_desc_t *src,
                           const dnnl_memory_desc_t *dst) {
    memset(r, 0, sizeof *r);
    dnnl_primitive_desc_t pd;
    TD__DNNL(dnnl_reorder_primitive_desc_create(&pd, src, td__cpu_of(ctx)->engine, dst,
                                                td__cpu_of(ctx)->engine, NULL),
             "reorder");
    td_status s = td__prim_create(&r->prim, pd, "reorder");
    dnnl_primitive_desc_destroy(pd);
    if (s != TD_OK) return s;
    TD__TRY(td__mem_init(ctx, &r->src, src));
    return td__mem_init(ctx, &r->dst, dst);
}

td_status td__reorder_run(td__op_ctx *ctx, td__reorder *r, const void *src, void *dst) {
    td__mem_bind(&r->src, (void *)src);
    td__mem_bind(&r->dst, dst);
    dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, r->src.mem}, {DNNL_ARG_TO, r->dst.mem}};
    return td__exec(ctx, r->prim, 2, args, "reorder");
}

void td__reorder_free(td__reorder *r) {
    if (r->prim) dnnl_primitive_destroy(r->prim);
    td__mem_free(&r->src);
    td__mem_free(&r->dst);
    r->prim = NULL;
}

/* 1 when a reorder from `from` to `to` reads a plain matrix down its columns with rows of a
 * multiple of 4 KiB: every row then maps to the same cache sets, and oneDNN's reorder runs
 * several times slower than from rows padded by a cache line (a (1024, 1024) f32 weight into
 * AB16b64a: 1.1 ms against 0.3 ms, plus 0.1 ms for the padding copy). */
static int gathers_4k_rows(const dnnl_memory_desc_t *from, const dnnl_memory_desc_t *to) {
    if (from->ndims != 2 || from->format_kind != dnnl_blocked || to->format_kind != dnnl_blocked)
        return 0;
    const dnnl_blocking_desc_t *f = &from->format_desc.blocking, *t = &to->format_desc.blocking;
    size_t row = (size_t)from->dims[1] * dnnl_memory_desc_get_size(from) /
                 ((size_t)from->dims[0] * (size_t)from->dims[1]);
    int across = 0;
    for (int i = 0; i < t->inner_nblks; i++) across |= t->inner_idxs[i] == 0;
    return f->inner_nblks == 0 && f->strides[1] == 1 && f->strides[0] == from->dims[1] &&
           from->dims[0] >= 16 && row % 4096 == 0 && across;
}

td_status td__adapt_init(td__op_ctx *ctx, td__adapt *a, const dnnl_memory_desc_t *from,
                         const dnnl_memory_desc_t *to) {
    memset(a, 0, sizeof *a);
    if (dnnl_memory_desc_equal(from, to)) return TD_OK;
    a->need = 1;
    size_t bytes = dnnl_memory_desc_get_size(to);
    size_t fb = dnnl_memory_desc_get_size(from);
    a->buf = td__op_alloc(ctx, bytes > fb ? bytes : fb);
    if (!a->buf) return td__fail(TD_ENOMEM, "reorder: out of memory (%zu bytes)", bytes);
    if (!gathers_4k_rows(from, to)) return td__reorder_init(ctx, &a->r, from, to);
    a->rows = (size_t)from->dims[0];
    a->row_bytes = fb / a->rows;
    a->stage_row_bytes = a->row_bytes + 64;
    a->stage = td__op_alloc(ctx, a->rows * a->stage_row_bytes);
    if (!a->stage)
        return td__fail(TD_ENOMEM, "reorder: out of memory (%zu bytes)",
                        a->rows * a->stage_row_bytes);
    size_t elem = a->row_bytes / (size_t)from->dims[1];
    dnnl_dims_t strides = {(dnnl_dim_t)(a->stage_row_bytes / elem), 1};
    dnnl_memory_desc_t padded;
    TD__DNNL(dnnl_memory_desc_init_by_strides(&padded, 2, from->dims, from->data_type, strides),
             "reorder");
    return td__reorder_init(ctx, &a->r, &padded, to);
}

void *td__adapt_in(td__op_ctx *ctx, td__adapt *a, const void *src) {
    if (!a->need) return (void *)src;
    a->src_now = a->made_from = NULL;
    const void *from = src;
    if (a->stage) {
        for (size_t r = 0; r < a->rows; r++)
            memcpy(a->stage + r * a->stage_row_bytes, (const char *)src + r * a->row_bytes,
                   a->row_bytes);
        from = a->stage;
    }
    if (td__reorder_run(ctx, &a->r, from, a->buf) != TD_OK) return NULL;
    a->src_now = src;
    return a->buf;
}

void *td__adapt_weights(td__op_ctx *ctx, td__adapt *a, const void *w) {
    if (!a->need) return (void *)w;
    if (!(w && a->made_from == w) && !(ctx->keep_weights && a->src_now == w))
        return td__adapt_in(ctx, a, w);
    a->src_now = w;
    a->made_from = NULL;
    return a->buf;
}

void td__adapt_made(td__adapt *a, const void *src) {
    a->made_from = src;
    if (!src) a->src_now = NULL;
}

void *td__adapt_out_ptr(td__adapt *a, void *dst) { return a->need ? a->buf : dst; }

td_status td__adapt_out(td__op_ctx *ctx, td__adapt *a, void *dst) {
    return a->need ? td__reorder_run(ctx, &a->r, a->buf, dst) : TD_OK;
}

void td__adapt_free(td__adapt *a) {
    if (a->need) td__reorder_free(&a->r);
    a->need = 0;
}
