/* A linear layer's weight and bias gradients over the shards of a deterministic step, summed in
 * deterministic mode's pairwise tree while each tile of the result is in registers or L1.
 *
 * Deterministic mode (docs/reproducibility.md) runs a rank's L shards one after another and sums
 * their gradients in a fixed tree whose leaves are the shards. Done one shard at a time, every
 * shard writes its whole weight gradient and the tree reads it back to fold it (for the MLP at
 * four shards a rank, 7.4 MB written four times and folded three times per step). Here the
 * layer keeps each shard's input and output gradient (packed: 132 KiB a shard of 16 for a
 * 1024-wide layer, with its bias gradient, summed while packing) and computes, at the step's
 * last shard, a 4 x 64 tile of every shard's gradient in turn, folding it into the tree at once:
 * the gradient is written once per step.
 *
 * The bits are fixed by construction: shard s's element (j, k) is the sum over its samples i in
 * order of dy[i, j] x[i, k], one fused multiply-add each from zero (the order oneDNN's f32
 * inner product takes for a batch of up to 64 on one thread, so the bits are those of its
 * per-shard gradient there), and the shards are added as ddp_shard_tree.c adds them: node
 * (l, i) = node (l-1, 2i) + node (l-1, 2i+1), a binary counter's carries in shard order, and for
 * a count that is not a power of two the nodes its one bits leave, added from the lowest up.
 * The kernel is AVX-512's, AVX2's or plain C's, chosen at run time; all three give the same bits.
 * Single-threaded, as deterministic mode's kernels are. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/core_impl.h"
#include "ops/cpu/linear_shards.h"

#define ROWS 4             /* output rows (j) per tile */
#define COLS 64            /* input columns (k) per tile: four vectors of 16 */
#define TILE (ROWS * COLS) /* floats of one tile, and of one block of the bias */
#define MAX_ADDS 128       /* nodes one shard's node may absorb: two per level at most */
#define CHUNK 8            /* output rows whose gradient is written column block by block */

/* Shard j's place in the tree of `count` leaves: the waiting nodes it absorbs, by level, in
 * order (its lower sibling at each level it climbs, then, after the last shard of a count that
 * is not a power of two, the nodes the count's other one bits left, from the lowest up); the
 * level at which its node then waits in *wait, or -1 when it is the root. */
static int tree_plan(size_t j, size_t count, int levels, int add[MAX_ADDS], int *wait) {
    int up = 0, n = 0;
    while ((j >> up) & 1) up++;
    for (int l = 0; l < up; l++) add[n++] = l;
    *wait = j + 1 < count ? up : -1;
    if (j + 1 == count && (count & (count - 1)) != 0)
        for (int l = up + 1; l <= levels; l++)
            if ((count >> l) & 1) add[n++] = l;
    return n;
}

/* The packed layout of one shard: its x in column blocks of COLS, each (n, COLS) and zero past
 * `in`, then its dy in row blocks of ROWS, each (n, ROWS) and zero past `out`: what one tile
 * reads is contiguous (a row of 1024 floats, 4 KiB, would put every sample of a tile in the same
 * cache sets); then its bias gradient, each output's dy summed over the samples. */
static int64_t col_blocks(int64_t in) { return (in + COLS - 1) / COLS; }
static int64_t row_blocks(int64_t out) { return (out + ROWS - 1) / ROWS; }

size_t td__linear_shard_floats(int64_t n, int64_t in, int64_t out) {
    size_t f = (size_t)((n + 1) * row_blocks(out) * ROWS + n * col_blocks(in) * COLS);
    return (f + 15) / 16 * 16; /* the next shard's blocks start on 64 bytes too */
}

/* Where the bias gradient starts in a shard's packed floats. */
static int64_t bias_at(int64_t n, int64_t in, int64_t out) {
    return n * (col_blocks(in) * COLS + row_blocks(out) * ROWS);
}

void td__linear_shard_pack(float *packed, const float *x, const float *dy, int64_t n, int64_t in,
                           int64_t out) {
    float *p = packed;
    for (int64_t k0 = 0; k0 < in; k0 += COLS) {
        int64_t w = in - k0 < COLS ? in - k0 : COLS;
        for (int64_t i = 0; i < n; i++, p += COLS) {
            memcpy(p, x + i * in + k0, (size_t)w * sizeof *p);
            memset(p + w, 0, (size_t)(COLS - w) * sizeof *p);
        }
    }
    /* dy along its rows, ROWS outputs of a sample at a time into their block */
    const int64_t full = out / ROWS, tail = out - full * ROWS;
    float *bias = packed + bias_at(n, in, out);
    memset(bias, 0, (size_t)out * sizeof *bias);
    for (int64_t i = 0; i < n; i++) {
        const float *r = dy + i * out;
        for (int64_t jb = 0; jb < full; jb++)
            memcpy(p + (jb * n + i) * ROWS, r + jb * ROWS, ROWS * sizeof *p);
        if (tail) {
            float *q = p + (full * n + i) * ROWS;
            memcpy(q, r + full * ROWS, (size_t)tail * sizeof *q);
            memset(q + tail, 0, (size_t)(ROWS - tail) * sizeof *q);
        }
        /* the samples in order, one addition each from zero */
        for (int64_t j = 0; j < out; j++) bias[j] = bias[j] + r[j];
    }
}

/* A tile's finish, shared by the instruction sets' kernels below: the tiles `node` [0, nadd)
 * added one after another to t (each node + the sum so far), then t stored at dst (rows ld
 * apart): the whole tile when dst is a waiting node's, else, times `by` (the root), its first r
 * rows and w columns. */
static void tile_finish(float *restrict t, const float *const *node, int nadd, float *dst,
                        int64_t ld, int whole, int r, int w, float by) {
    for (int k = 0; k < nadd; k++)
        for (int e = 0; e < TILE; e++) t[e] = node[k][e] + t[e];
    if (!whole && by != 1.0f)
        for (int e = 0; e < TILE; e++) t[e] = t[e] * by;
    for (int a = 0; a < (whole ? ROWS : r); a++)
        memcpy(dst + a * ld, t + a * COLS, (size_t)(whole ? COLS : w) * sizeof *t);
}

/* A tile's kernel: one shard's tile of dy^T x from its packed blocks xb (n, COLS) and dyb (n,
 * ROWS), finished as tile_finish says. Each instruction set's gives the same bits: every
 * product is one fused multiply-add, in sample order. */
typedef void (*tile_fn)(const float *xb, const float *dyb, int64_t n, const float *const *node,
                        int nadd, float *dst, int64_t ld, int whole, int r, int w, float by);

static void tile_plain(const float *xb, const float *dyb, int64_t n, const float *const *node,
                       int nadd, float *dst, int64_t ld, int whole, int r, int w, float by) {
    _Alignas(64) float t[TILE];
    for (int a = 0; a < ROWS; a++)
        for (int c = 0; c < COLS; c++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < n; i++) acc = fmaf(dyb[i * ROWS + a], xb[i * COLS + c], acc);
            t[a * COLS + c] = acc;
        }
    tile_finish(t, node, nadd, dst, ld, whole, r, w, by);
}

#if defined(__x86_64__)
/* AVX2: the tile a quarter at a time, four rows by two vectors of 8 in registers. */
__attribute__((target("avx2,fma"))) static void tile_avx2(const float *xb, const float *dyb,
                                                          int64_t n, const float *const *node,
                                                          int nadd, float *dst, int64_t ld,
                                                          int whole, int r, int w, float by) {
    _Alignas(64) float t[TILE];
    for (int q = 0; q < COLS; q += 16) {
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
               a30 = a00, a31 = a00;
        for (int64_t i = 0; i < n; i++) {
            const float *xr = xb + i * COLS + q, *d = dyb + i * ROWS;
            __m256 v0 = _mm256_load_ps(xr), v1 = _mm256_load_ps(xr + 8);
            __m256 b = _mm256_broadcast_ss(d);
            a00 = _mm256_fmadd_ps(b, v0, a00), a01 = _mm256_fmadd_ps(b, v1, a01);
            b = _mm256_broadcast_ss(d + 1);
            a10 = _mm256_fmadd_ps(b, v0, a10), a11 = _mm256_fmadd_ps(b, v1, a11);
            b = _mm256_broadcast_ss(d + 2);
            a20 = _mm256_fmadd_ps(b, v0, a20), a21 = _mm256_fmadd_ps(b, v1, a21);
            b = _mm256_broadcast_ss(d + 3);
            a30 = _mm256_fmadd_ps(b, v0, a30), a31 = _mm256_fmadd_ps(b, v1, a31);
        }
        _mm256_store_ps(t + q, a00), _mm256_store_ps(t + q + 8, a01);
        _mm256_store_ps(t + COLS + q, a10), _mm256_store_ps(t + COLS + q + 8, a11);
        _mm256_store_ps(t + 2 * COLS + q, a20), _mm256_store_ps(t + 2 * COLS + q + 8, a21);
        _mm256_store_ps(t + 3 * COLS + q, a30), _mm256_store_ps(t + 3 * COLS + q + 8, a31);
    }
    tile_finish(t, node, nadd, dst, ld, whole, r, w, by);
}

/* AVX-512: the whole tile in sixteen registers, named so that they stay there. */
__attribute__((target("avx512f"))) static void tile_avx512(const float *xb, const float *dyb,
                                                           int64_t n, const float *const *node,
                                                           int nadd, float *dst, int64_t ld,
                                                           int whole, int r, int w, float by) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00,
           a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00,
           a32 = a00, a33 = a00;
    for (int64_t i = 0; i < n; i++) {
        const float *xr = xb + i * COLS, *d = dyb + i * ROWS;
        __m512 v0 = _mm512_load_ps(xr), v1 = _mm512_load_ps(xr + 16), v2 = _mm512_load_ps(xr + 32),
               v3 = _mm512_load_ps(xr + 48);
        /* in registers: loaded once for the four rows, not once per multiply-add */
        __asm__("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3));
        __m512 b = _mm512_set1_ps(d[0]);
        a00 = _mm512_fmadd_ps(b, v0, a00), a01 = _mm512_fmadd_ps(b, v1, a01);
        a02 = _mm512_fmadd_ps(b, v2, a02), a03 = _mm512_fmadd_ps(b, v3, a03);
        b = _mm512_set1_ps(d[1]);
        a10 = _mm512_fmadd_ps(b, v0, a10), a11 = _mm512_fmadd_ps(b, v1, a11);
        a12 = _mm512_fmadd_ps(b, v2, a12), a13 = _mm512_fmadd_ps(b, v3, a13);
        b = _mm512_set1_ps(d[2]);
        a20 = _mm512_fmadd_ps(b, v0, a20), a21 = _mm512_fmadd_ps(b, v1, a21);
        a22 = _mm512_fmadd_ps(b, v2, a22), a23 = _mm512_fmadd_ps(b, v3, a23);
        b = _mm512_set1_ps(d[3]);
        a30 = _mm512_fmadd_ps(b, v0, a30), a31 = _mm512_fmadd_ps(b, v1, a31);
        a32 = _mm512_fmadd_ps(b, v2, a32), a33 = _mm512_fmadd_ps(b, v3, a33);
    }
    for (int k = 0; k < nadd; k++) {
        const float *t = node[k];
#define ADD(acc, e) acc = _mm512_add_ps(_mm512_load_ps(t + 16 * (e)), acc)
        ADD(a00, 0), ADD(a01, 1), ADD(a02, 2), ADD(a03, 3), ADD(a10, 4), ADD(a11, 5);
        ADD(a12, 6), ADD(a13, 7), ADD(a20, 8), ADD(a21, 9), ADD(a22, 10), ADD(a23, 11);
        ADD(a30, 12), ADD(a31, 13), ADD(a32, 14), ADD(a33, 15);
#undef ADD
    }
    if (whole) {
#define PUT(acc, a, c) _mm512_store_ps(dst + (a)*ld + 16 * (c), acc)
        PUT(a00, 0, 0), PUT(a01, 0, 1), PUT(a02, 0, 2), PUT(a03, 0, 3);
        PUT(a10, 1, 0), PUT(a11, 1, 1), PUT(a12, 1, 2), PUT(a13, 1, 3);
        PUT(a20, 2, 0), PUT(a21, 2, 1), PUT(a22, 2, 2), PUT(a23, 2, 3);
        PUT(a30, 3, 0), PUT(a31, 3, 1), PUT(a32, 3, 2), PUT(a33, 3, 3);
#undef PUT
        return;
    }
    if (by != 1.0f) {
        const __m512 f = _mm512_set1_ps(by);
#define MUL(acc) acc = _mm512_mul_ps(acc, f)
        MUL(a00), MUL(a01), MUL(a02), MUL(a03), MUL(a10), MUL(a11), MUL(a12), MUL(a13);
        MUL(a20), MUL(a21), MUL(a22), MUL(a23), MUL(a30), MUL(a31), MUL(a32), MUL(a33);
#undef MUL
    }
    /* the gradient streams past the caches: its next reader comes after a pass over the rest */
    if (r == ROWS && w == COLS && ((uintptr_t)dst & 63) == 0 && (ld & 15) == 0) {
#define PUT(acc, a, c) _mm512_stream_ps(dst + (a)*ld + 16 * (c), acc)
        PUT(a00, 0, 0), PUT(a01, 0, 1), PUT(a02, 0, 2), PUT(a03, 0, 3);
        PUT(a10, 1, 0), PUT(a11, 1, 1), PUT(a12, 1, 2), PUT(a13, 1, 3);
        PUT(a20, 2, 0), PUT(a21, 2, 1), PUT(a22, 2, 2), PUT(a23, 2, 3);
        PUT(a30, 3, 0), PUT(a31, 3, 1), PUT(a32, 3, 2), PUT(a33, 3, 3);
#undef PUT
        return;
    }
    __mmask16 m[4];
    for (int c = 0; c < 4; c++) {
        int v = w - 16 * c;
        m[c] = v >= 16 ? (__mmask16)0xffff : v <= 0 ? (__mmask16)0 : (__mmask16)((1u << v) - 1);
    }
#define PUT(acc, a, c) _mm512_mask_storeu_ps(dst + (a)*ld + 16 * (c), m[c], acc)
    PUT(a00, 0, 0), PUT(a01, 0, 1), PUT(a02, 0, 2), PUT(a03, 0, 3);
    if (r > 1) PUT(a10, 1, 0), PUT(a11, 1, 1), PUT(a12, 1, 2), PUT(a13, 1, 3);
    if (r > 2) PUT(a20, 2, 0), PUT(a21, 2, 1), PUT(a22, 2, 2), PUT(a23, 2, 3);
    if (r > 3) PUT(a30, 3, 0), PUT(a31, 3, 1), PUT(a32, 3, 2), PUT(a33, 3, 3);
#undef PUT
}
#endif

/* The widest kernel this CPU runs (TANDEM_MAX_CPU_ISA caps it: core/cpu.c). */
static tile_fn tile_kernel(void) {
#if defined(__x86_64__)
    td__isa isa = td__cpu_isa();
    if (isa >= TD__ISA_AVX512) return tile_avx512;
    if (isa >= TD__ISA_AVX2) return tile_avx2;
#endif
    return tile_plain;
}

int td__linear_shard_grads(float *dw, float *db, const float *const *packed, size_t count,
                           int64_t n, int64_t in, int64_t out, float by_w, float by_b) {
    int levels = 0;
    for (size_t c = count; c > 1; c >>= 1) levels++;
    /* the waiting nodes' tiles by level, and the bias's block being summed */
    float *pend = aligned_alloc(64, ((size_t)levels + 2) * TILE * sizeof(float));
    if (!pend) return -1;
    float *cur = pend + ((size_t)levels + 1) * TILE;
    int add[MAX_ADDS], wait;
    const float *node[MAX_ADDS];
    tile_fn tile_of = tile_kernel();
    const int64_t nkb = col_blocks(in), dy_at = n * nkb * COLS;
    /* Rows in chunks of a few, column blocks inside a chunk: dw is written along its rows, a
     * few at a time (column blocks outside, writing dw down its columns, ran at half the speed
     * into a dw out of cache), and each shard's inputs for a column block stay in L1 across
     * the chunk's rows. */
    for (int64_t c0 = 0; c0 < out; c0 += CHUNK)
        for (int64_t kb = 0; kb < nkb; kb++) {
            int64_t k0 = kb * COLS;
            int w = in - k0 < COLS ? (int)(in - k0) : COLS;
            for (int64_t j0 = c0; j0 < out && j0 < c0 + CHUNK; j0 += ROWS) {
                int64_t jb = j0 / ROWS;
                int r = out - j0 < ROWS ? (int)(out - j0) : ROWS;
                for (size_t s = 0; s < count; s++) {
                    int nadd = tree_plan(s, count, levels, add, &wait);
                    for (int k = 0; k < nadd; k++) node[k] = pend + (size_t)add[k] * TILE;
                    const float *xb = packed[s] + kb * n * COLS,
                                *dyb = packed[s] + dy_at + jb * n * ROWS;
                    if (wait >= 0)
                        tile_of(xb, dyb, n, node, nadd, pend + (size_t)wait * TILE, COLS, 1, r, w,
                                1.0f);
                    else
                        tile_of(xb, dyb, n, node, nadd, dw + j0 * in + k0, in, 0, r, w, by_w);
                }
            }
        }
    for (int64_t j0 = 0; db && j0 < out; j0 += TILE) {
        int w = out - j0 < TILE ? (int)(out - j0) : TILE;
        for (size_t s = 0; s < count; s++) {
            memcpy(cur, packed[s] + bias_at(n, in, out) + j0, (size_t)w * sizeof *cur);
            int nadd = tree_plan(s, count, levels, add, &wait);
            for (int k = 0; k < nadd; k++)
                for (int e = 0; e < w; e++) cur[e] = pend[add[k] * TILE + e] + cur[e];
            if (wait < 0 && by_b != 1.0f)
                for (int e = 0; e < w; e++) cur[e] = cur[e] * by_b;
            memcpy(wait >= 0 ? pend + (size_t)wait * TILE : db + j0, cur, (size_t)w * sizeof *cur);
        }
    }
    free(pend);
#if defined(__x86_64__)
    _mm_sfence();
#endif
    return 0;
}
