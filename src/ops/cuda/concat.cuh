/* The kernel of concat.cu and its launch: one strided copy between sample rows, for the forward
 * (inputs side by side along dim 1) and the backward (dy sliced back out). Compiles for a GPU
 * and under the CPU's emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_CONCAT_CUH
#define TANDEM_CUDA_CONCAT_CUH

#include "device/cuda/dtype.cuh"

/* dst[s * dst_row + dst_at + j] = beta dst[...] + src[s * src_row + src_at + j] for every sample
 * s < rows and j < width. */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__concat_rows_kernel(T *dst, size_t dst_row, size_t dst_at, const T *src, size_t src_row,
                           size_t src_at, size_t rows, size_t width, float beta) {
    TD__GRID_STRIDE(i, rows * width) {
        size_t s = i / width, j = i % width;
        float v = td_ld(src, s * src_row + src_at + j);
        size_t o = s * dst_row + dst_at + j;
        td_st(dst, o, beta != 0.f ? beta * td_ld(dst, o) + v : v);
    }
}

/* The copy of concat_rows_kernel, on stream st. */
template <typename T>
static inline void td__launch_concat_rows(cudaStream_t st, T *dst, size_t dst_row, size_t dst_at,
                                          const T *src, size_t src_row, size_t src_at, size_t rows,
                                          size_t width, float beta) {
    if (rows && width)
        td__launch<td__concat_rows_kernel<T>>(td__blocks(rows * width), 0, st, dst, dst_row, dst_at,
                                              src, src_row, src_at, rows, width, beta);
}

#endif
