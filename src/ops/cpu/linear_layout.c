/* A linear layer's weights laid out in the forward kernel's blocked layout a group of rows at a
 * time, so that an optimizer step can have them laid out while the rows it just wrote are in
 * cache (td_param.written), instead of oneDNN's reorder reading the whole weight cold at the
 * next forward (for the MLP's 1024 x 1024 layer, 0.56 ms of a 9 ms step with the padding copy
 * its 4 KiB rows need). It copies values and writes zeros, so the bits are the reorder's.
 *
 * On AVX-512 with column blocks of 16 (AB16b64a, what oneDNN 2.6's inner product takes there)
 * each block of 16 rows by 16 columns is loaded a row at a time, transposed in registers and
 * stored a column at a time, 16 rows of the weight as soon as the optimizer has written them.
 * The stores stream past the caches: the copy (7.4 MB for the MLP) is read again only at the
 * next forward, and a store that first reads the line it writes cost half again as much (a
 * 1024 x 1024 weight in 0.25 ms against 0.36 ms from rows in cache). Elsewhere plain C writes
 * element by element. */
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/core_impl.h"
#include "ops/cpu/linear_layout.h"

int td__linear_layout_of(td__linear_layout *l, const dnnl_memory_desc_t *md) {
    const dnnl_blocking_desc_t *b = &md->format_desc.blocking;
    if (md->ndims != 2 || md->data_type != dnnl_f32 || md->format_kind != dnnl_blocked ||
        md->offset0 != 0 || md->extra.flags != 0 || b->inner_nblks != 2 || b->inner_idxs[0] != 1 ||
        b->inner_idxs[1] != 0)
        return 0;
    *l = (td__linear_layout){.out = md->dims[0],
                             .in = md->dims[1],
                             .rb = b->inner_blks[1],
                             .cb = b->inner_blks[0],
                             .row_stride = b->strides[0],
                             .col_stride = b->strides[1]};
    return md->padded_dims[0] == (l->out + l->rb - 1) / l->rb * l->rb &&
           md->padded_dims[1] == (l->in + l->cb - 1) / l->cb * l->cb;
}

/* Row block rb0 of the layout (its rb rows, zeros past out and in), element by element. */
static void rows_plain(const td__linear_layout *l, float *dst, const float *w, int64_t rb0) {
    for (int64_t cb0 = 0; cb0 * l->cb < l->in; cb0++) {
        float *blk = dst + rb0 * l->row_stride + cb0 * l->col_stride;
        for (int64_t c = 0; c < l->cb; c++)
            for (int64_t r = 0; r < l->rb; r++) {
                int64_t a = rb0 * l->rb + r, b = cb0 * l->cb + c;
                blk[c * l->rb + r] = a < l->out && b < l->in ? w[a * l->in + b] : 0.0f;
            }
    }
}

#if defined(__x86_64__)
/* Rows [a0, a0 + 16) by columns [b0, b0 + 16) of w, transposed: column c goes to dst + c * ld.
 * Rows past out and columns past in read as zeros. */
__attribute__((target("avx512f"))) static void block16_avx512(const td__linear_layout *l,
                                                              float *dst, int64_t ld,
                                                              const float *w, int64_t a0,
                                                              int64_t b0) {
    int64_t cols = l->in - b0 < 16 ? l->in - b0 : 16;
    __mmask16 m = cols == 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++)
        r[i] = a0 + i < l->out ? _mm512_maskz_loadu_ps(m, w + (a0 + i) * l->in + b0)
                               : _mm512_setzero_ps();
    /* pairs of rows interleaved, then fours: u[4g + c] holds, in its 128-bit lane k, column
     * 4k + c of rows 4g .. 4g + 3 */
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {
        r[4 * g] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        r[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xee);
        r[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        r[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xee);
    }
    /* then the lanes: column 4k + c gathers lane k of u[c], u[4 + c], u[8 + c], u[12 + c] */
    for (int c = 0; c < 4; c++) {
        __m512 p = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
        __m512 q = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
        __m512 p2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        __m512 q2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
        _mm512_stream_ps(dst + c * ld, _mm512_shuffle_f32x4(p, p2, 0x88));
        _mm512_stream_ps(dst + (8 + c) * ld, _mm512_shuffle_f32x4(p, p2, 0xdd));
        _mm512_stream_ps(dst + (4 + c) * ld, _mm512_shuffle_f32x4(q, q2, 0x88));
        _mm512_stream_ps(dst + (12 + c) * ld, _mm512_shuffle_f32x4(q, q2, 0xdd));
    }
}
#endif

/* 1 when AVX-512 lays the layout out, 16 rows at a time. */
static int by_avx512(const td__linear_layout *l) {
#if defined(__x86_64__)
    return l->cb == 16 && l->rb % 16 == 0 && l->row_stride % 16 == 0 && l->col_stride % 16 == 0 &&
           td__cpu_isa() >= TD__ISA_AVX512;
#else
    (void)l;
    return 0;
#endif
}

int64_t td__linear_layout_group(const td__linear_layout *l) { return by_avx512(l) ? 16 : l->rb; }

void td__linear_layout_rows(const td__linear_layout *l, float *dst, const float *w, int64_t first,
                            int64_t last) {
#if defined(__x86_64__)
    if (by_avx512(l)) {
        int64_t per = l->rb / 16, rows = (l->out + l->rb - 1) / l->rb * l->rb;
        if (last * 16 > rows) last = rows / 16;
        for (int64_t q = first; q < last; q++) {
            float *blk = dst + q / per * l->row_stride + q % per * 16;
            for (int64_t cb0 = 0; cb0 * 16 < l->in; cb0++)
                block16_avx512(l, blk + cb0 * l->col_stride, l->rb, w, q * 16, cb0 * 16);
        }
        _mm_sfence(); /* the streaming stores are seen by the kernels' threads too */
        return;
    }
#endif
    for (int64_t rb0 = first; rb0 < last; rb0++) rows_plain(l, dst, w, rb0);
}
