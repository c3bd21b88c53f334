/* A linear layer's (OUT, IN) weights laid out in the blocked layout oneDNN's f32 inner product
 * takes them in (AB16b64a on AVX-512), a group of rows at a time, by the CPU backend's linear
 * kernels as an optimizer step writes the weights (linear_layout.c). Not installed. */
#ifndef TANDEM_LINEAR_LAYOUT_H
#define TANDEM_LINEAR_LAYOUT_H

#include <dnnl.h>
#include <stddef.h>
#include <stdint.h>

/* A blocked layout of (out, in) f32 weights with two inner blocks, in (b, inner dim 1 = in)
 * then (a, inner dim 0 = out) order: element (a, b) lies at (a / rb) row_stride + (b / cb)
 * col_stride + (b % cb) rb + a % rb, and elements past out or in are zeros. */
typedef struct {
    int64_t out, in;
    int64_t rb, cb;                 /* inner block sizes: rows (out) and columns (in) */
    int64_t row_stride, col_stride; /* elements between row blocks and between column blocks */
} td__linear_layout;

/* Reads an f32 weight layout md of that form into l; 0 when md is another layout. */
int td__linear_layout_of(td__linear_layout *l, const dnnl_memory_desc_t *md);

/* Rows a group of td__linear_layout_rows holds: 16 where AVX-512 lays them out (cb 16 and rb a
 * multiple of 16), else rb. */
int64_t td__linear_layout_group(const td__linear_layout *l);

/* Writes row groups [first, last) of w (out, in, row-major) into dst (64-byte aligned) in the
 * layout, their padding zeros included: group `last - 1` may hold the last rows and the padding
 * past them. The same bytes oneDNN's reorder writes. */
void td__linear_layout_rows(const td__linear_layout *l, float *dst, const float *w, int64_t first,
                            int64_t last);

#endif
