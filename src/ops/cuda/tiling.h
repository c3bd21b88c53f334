/* How GPU kernels divide their work among blocks: how many rows of a table one block of the
 * embedding's backward owns, how many rows one partial sum of a column sum covers (layer norm's
 * parameter gradients, linear's bias gradient), and the attention's tile and shared memory. Plain C
 * that compiles for the host and under nvcc alike, so that the CPU tests check the arithmetic
 * (every row covered once, shared memory within a block's default 48 KiB) where no GPU runs
 * the kernels. Not installed. */
#ifndef TANDEM_CUDA_TILING_H
#define TANDEM_CUDA_TILING_H

#include <stdint.h>

/* Blocks of the token embedding's backward: each owns `rows` consecutive table rows (those in
 * [block * rows, (block + 1) * rows) below V) and reads every token id once, so the table is
 * split into at most TD__EMB_BLOCKS blocks: more would read the ids more often than it helps. */
#define TD__EMB_BLOCKS 1024

static inline int64_t td__emb_rows_per_block(int64_t V) {
    return V <= TD__EMB_BLOCKS ? 1 : (V + TD__EMB_BLOCKS - 1) / TD__EMB_BLOCKS;
}

static inline int64_t td__emb_blocks(int64_t V) {
    int64_t r = td__emb_rows_per_block(V);
    return V < 1 ? 1 : (V + r - 1) / r;
}

/* Rows of one partial sum of a column sum over many rows (a layer norm's weight and bias
 * gradients, a linear's bias gradient), the first of two stages: each block sums its rows for 32
 * columns, the second stage adds the partial sums in order. 64 rows, or more so that there are
 * at most TD__PARTIALS partial sums. */
#define TD__PARTIAL_ROWS 64
#define TD__PARTIALS 1024

static inline int64_t td__partial_rows(int64_t rows) {
    int64_t r = (rows + TD__PARTIALS - 1) / TD__PARTIALS;
    return r > TD__PARTIAL_ROWS ? r : TD__PARTIAL_ROWS;
}

static inline int64_t td__partials(int64_t rows) {
    int64_t r = td__partial_rows(rows);
    return rows < 1 ? 1 : (rows + r - 1) / r;
}

/* Causal attention works on square tiles of `tile` positions of one (sequence, head): a block
 * holds the queries' or keys' tiles it needs in shared memory as f32. The three kernels and the
 * f32 values each keeps (hs the head size):
 *   forward     q, k, v, o; scores; max, sum, rescale     4 tile x hs, tile x tile, 3 x tile
 *   dq          q, do, k, v, dq; ds; lse, D               5 tile x hs, tile x tile, 2 x tile
 *   dk and dv   k, v, dk, dv, q, do; p, ds; lse, D        6 tile x hs, 2 x tile x tile, 2 x tile
 * The tile is the largest of 32, 16 and 8 whose heaviest kernel (dk and dv) fits in 48 KiB, the
 * shared memory any block may have without asking; 0 when none does (a head wider than 253). */
#define TD__ATT_SHARED_BYTES 49152

enum { TD__ATT_FORWARD = 0, TD__ATT_DQ = 1, TD__ATT_DKV = 2 };

static inline int64_t td__att_shared_floats(int kernel, int64_t tile, int64_t hs) {
    int64_t tiles = kernel == TD__ATT_FORWARD ? 4 : kernel == TD__ATT_DQ ? 5 : 6;
    int64_t squares = kernel == TD__ATT_DKV ? 2 : 1;
    int64_t rows = kernel == TD__ATT_FORWARD ? 3 : 2;
    return tiles * tile * hs + squares * tile * tile + rows * tile;
}

static inline int64_t td__att_tile(int64_t hs) {
    for (int64_t tile = 32; tile >= 8; tile /= 2)
        if (td__att_shared_floats(TD__ATT_DKV, tile, hs) * 4 <= TD__ATT_SHARED_BYTES) return tile;
    return 0;
}

#endif
