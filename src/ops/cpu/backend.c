/* The CPU backend (backend.h): oneDNN's engine and stream as its handles, a oneDNN memory
 * descriptor as each tensor's layout record, reorders for copies between layouts, and the
 * kernels of every op (src/ops/cpu/<op>.c defines its td__cpu_* table; the op itself is
 * src/ops/<op>.c). */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/cpu/onednn.h"

static td_status cpu_init(td__op_ctx *ctx, const char *what) {
    td__cpu *c = calloc(1, sizeof *c);
    if (!c) return td__fail(TD_ENOMEM, "%s: out of memory", what);
    ctx->be = c;
    /* oneDNN computes bf16 itself with AVX512_BF16 (or AMX); elsewhere it runs slowly or not. */
    dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    c->bf16_native = (isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16;
    if (dnnl_engine_create(&c->engine, dnnl_cpu, 0) != dnnl_success ||
        dnnl_stream_create(&c->stream, c->engine, dnnl_stream_default_flags) != dnnl_success)
        return td__fail(TD_EBACKEND, "%s: cannot create the oneDNN cpu engine", what);
    return TD_OK;
}

static void cpu_destroy(td__op_ctx *ctx) {
    td__cpu *c = td__cpu_of(ctx);
    if (!c) return;
    if (c->stream) dnnl_stream_destroy(c->stream);
    if (c->engine) dnnl_engine_destroy(c->engine);
    free(c);
    ctx->be = NULL;
}

static td_status cpu_describe(td__op_ctx *ctx, td_tensor *t) {
    if (!t->extra) t->extra = td_arena_alloc(ctx->records, sizeof(dnnl_memory_desc_t));
    if (!t->extra) return td__fail(TD_ENOMEM, "graph: out of memory describing '%s'", t->name);
    td__md_plain(td__md(t), &t->shape, t->dtype);
    t->blocked = 0;
    return TD_OK;
}

static size_t cpu_storage_bytes(const td_tensor *t) { return dnnl_memory_desc_get_size(td__md(t)); }

static td_status cpu_alloc(td__op_ctx *ctx, size_t bytes, void **out) {
    (void)ctx;
    size_t n = (bytes + 63) & ~(size_t)63;
    *out = aligned_alloc(64, n ? n : 64);
    if (!*out) return td__fail(TD_ENOMEM, "graph: out of memory for %zu bytes of storage", bytes);
    memset(*out, 0, n);
    return TD_OK;
}

static void cpu_free(td__op_ctx *ctx, void *ptr) {
    (void)ctx;
    free(ptr);
}

static td_status cpu_zero(td__op_ctx *ctx, void *ptr, size_t bytes) {
    (void)ctx;
    memset(ptr, 0, bytes);
    return TD_OK;
}

static td_status cpu_copy(td__op_ctx *ctx, void *dst, const void *src, size_t bytes) {
    (void)ctx;
    if (bytes) memcpy(dst, src, bytes);
    return TD_OK;
}

static td_status cpu_accumulate(td__op_ctx *ctx, void *dst, const void *src, td_dtype dt,
                                size_t n) {
    (void)ctx;
    td__accumulate(dst, src, dt, n);
    return TD_OK;
}

static td_status cpu_convert(td__op_ctx *ctx, void *dst, td_dtype dst_dtype, const void *src,
                             td_dtype src_dtype, size_t n) {
    (void)ctx;
    td__convert(dst, dst_dtype, src, src_dtype, n);
    return TD_OK;
}

/* A one-off reorder: both layouts and the dtype change at once. */
static td_status cpu_copy_plain(td__op_ctx *ctx, const td_tensor *t, const void *src, void *dst,
                                td_dtype plain_dtype, int to_plain) {
    dnnl_memory_desc_t plain;
    td__md_plain(&plain, &t->shape, plain_dtype);
    td__reorder r;
    TD__TRY(to_plain ? td__reorder_init(ctx, &r, td__md(t), &plain)
                     : td__reorder_init(ctx, &r, &plain, td__md(t)));
    td_status s = td__reorder_run(ctx, &r, src, dst);
    td__reorder_free(&r);
    return s;
}

/* oneDNN's OpenMP runtime sizes a primitive's parallel regions, and how it splits its sums,
 * by the calling thread's OpenMP count (omp_get_max_threads) when the primitive is created and
 * when it runs; the count is the thread's own (an OpenMP internal control variable), so setting
 * it leaves other threads alone. */
static td_status cpu_set_threads(td__op_ctx *ctx, int n, int *was, const char *what) {
    (void)ctx;
    unsigned runtime = dnnl_version()->cpu_runtime;
    if (runtime == DNNL_RUNTIME_SEQ && n == 1) { /* one thread already */
        *was = 1;
        return TD_OK;
    }
    if (runtime != DNNL_RUNTIME_OMP)
        return td__fail(TD_EUNSUPPORTED,
                        "%s: threads = %d, but this oneDNN's CPU runtime (%u) is not OpenMP, "
                        "whose thread count tandem sets",
                        what, n, runtime);
    *was = omp_get_max_threads();
    if (*was != n) omp_set_num_threads(n);
    return TD_OK;
}

/* oneDNN's own name of the instruction set it dispatches (ONEDNN_MAX_CPU_ISA's spelling). */
static const char *isa_name(dnnl_cpu_isa_t isa) {
    switch (isa) {
    case dnnl_cpu_isa_sse41:
        return "sse41";
    case dnnl_cpu_isa_avx:
        return "avx";
    case dnnl_cpu_isa_avx2:
        return "avx2";
    case dnnl_cpu_isa_avx2_vnni:
        return "avx2_vnni";
    case dnnl_cpu_isa_avx512_mic:
        return "avx512_mic";
    case dnnl_cpu_isa_avx512_mic_4ops:
        return "avx512_mic_4ops";
    case dnnl_cpu_isa_avx512_core:
        return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni:
        return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16:
        return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx:
        return "avx512_core_amx";
    default:
        return "unknown";
    }
}

static void cpu_info(char *buf, size_t cap) {
    const dnnl_version_t *v = dnnl_version();
    snprintf(buf, cap, "oneDNN %d.%d.%d, ISA %s", v->major, v->minor, v->patch,
             isa_name(dnnl_get_effective_cpu_isa()));
}

/* Matmuls and convolutions in bf16 are oneDNN's own kernels where the ISA it dispatches has
 * bf16 instructions (td__onednn_supports); f16 it has none for CPUs. */
static int cpu_fast_dtype(const td__op_ctx *ctx, td_dtype dtype) {
    return td__onednn_supports(NULL, dtype, ctx);
}

const td__backend td__backend_cpu = {
    .name = "cpu",
    .kernels =
        {
            [TD__OP_LINEAR] = &td__cpu_linear,
            [TD__OP_CONV2D] = &td__cpu_conv2d,
            [TD__OP_POOL2D] = &td__cpu_pool2d,
            [TD__OP_ELTWISE] = &td__cpu_eltwise,
            [TD__OP_DROPOUT] = &td__cpu_dropout,
            [TD__OP_BATCH_NORM] = &td__cpu_batch_norm,
            [TD__OP_RESHAPE] = &td__cpu_reshape,
            [TD__OP_ADD] = &td__cpu_add,
            [TD__OP_CONCAT] = &td__cpu_concat,
            [TD__OP_SOFTMAX] = &td__cpu_softmax,
            [TD__OP_NLL] = &td__cpu_nll,
            [TD__OP_CAST] = &td__cpu_cast,
            [TD__OP_SYNC_BATCH_NORM] = &td__cpu_sync_batch_norm,
            [TD__OP_NORMALIZE] = &td__cpu_normalize,
            [TD__OP_SCALE] = &td__cpu_scale,
            [TD__OP_EMBEDDING] = &td__cpu_embedding,
            [TD__OP_LAYER_NORM] = &td__cpu_layer_norm,
            [TD__OP_ATTENTION] = &td__cpu_attention,
            [TD__OP_VOCAB_PARALLEL_CE] = &td__cpu_vocab_parallel_cross_entropy,
            [TD__OP_PARALLEL_LINEAR] = &td__cpu_parallel_linear,
        },
    .init = cpu_init,
    .destroy = cpu_destroy,
    .describe = cpu_describe,
    .storage_bytes = cpu_storage_bytes,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .zero = cpu_zero,
    .upload = cpu_copy,
    .download = cpu_copy,
    .copy = cpu_copy,
    .accumulate = cpu_accumulate,
    .convert = cpu_convert,
    .copy_plain = cpu_copy_plain,
    .set_threads = cpu_set_threads,
    .fast_dtype = cpu_fast_dtype,
    .info = cpu_info,
};
