/* The kernels of linear.cu and their launch: the bias gradient, a column sum of dy over its rows
 * in two stages with no atomics (cuBLASLt computes the rest): blocks of 32 columns by a chunk of
 * rows (tiling.h) each write a partial sum, then one thread per column adds the partial sums in
 * chunk order, so a wide batch fills the GPU and the result is the same bits every run. Compiles
 * for a GPU and under the CPU's emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_LINEAR_CUH
#define TANDEM_CUDA_LINEAR_CUH

#include "device/cuda/dtype.cuh"
#include "ops/cuda/tiling.h"

#define TD__COLSUM_COLS 32                               /* columns of one stage-one block */
#define TD__COLSUM_LANES (TD__THREADS / TD__COLSUM_COLS) /* rows it reads at once */

/* Stage one: block (column tile, chunk) sums x over the chunk's rows for its 32 columns,
 * TD__COLSUM_LANES rows at a time, then the lanes in order; into partial[chunk][c]. */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__colsum_partial_kernel(float *partial, const T *x, int64_t rows, int64_t cols,
                              int64_t chunk_rows) {
    __shared__ float lanes[TD__COLSUM_LANES][TD__COLSUM_COLS];
    int col = threadIdx.x % TD__COLSUM_COLS, lane = threadIdx.x / TD__COLSUM_COLS;
    int64_t c = (int64_t)blockIdx.x * TD__COLSUM_COLS + col, chunk = blockIdx.y;
    int64_t r0 = chunk * chunk_rows, r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    float sum = 0.f;
    if (c < cols)
        for (int64_t r = r0 + lane; r < r1; r += TD__COLSUM_LANES)
            sum += td_ld(x, (size_t)(r * cols + c));
    lanes[lane][col] = sum;
    __syncthreads();
    if (lane != 0 || c >= cols) return;
    for (int l = 1; l < TD__COLSUM_LANES; l++) sum += lanes[l][col];
    partial[chunk * cols + c] = sum;
}

/* Stage two: out[c] = beta out[c] + the partial sums of column c in chunk order. */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__colsum_finish_kernel(T *out, const float *partial, int64_t chunks, int64_t cols,
                             float beta) {
    TD__GRID_STRIDE(c, (size_t)cols) {
        float sum = 0.f;
        for (int64_t k = 0; k < chunks; k++) sum += partial[k * cols + (int64_t)c];
        td_st(out, c, beta != 0.f ? beta * td_ld(out, c) + sum : sum);
    }
}

/* out (cols) = beta out + the sums of x's rows (rows, cols), through partial (td__partials(rows)
 * cols floats of device memory). */
template <typename T>
static inline void td__launch_column_sum(cudaStream_t s, T *out, float *partial, const T *x,
                                         int64_t rows, int64_t cols, float beta) {
    if (cols == 0) return;
    int64_t chunks = td__partials(rows);
    dim3 grid((unsigned)((cols + TD__COLSUM_COLS - 1) / TD__COLSUM_COLS), (unsigned)chunks);
    td__launch<td__colsum_partial_kernel<T>>(grid, 0, s, partial, x, rows, cols,
                                             td__partial_rows(rows));
    td__launch<td__colsum_finish_kernel<T>>(td__blocks((size_t)cols), 0, s, out,
                                            (const float *)partial, chunks, cols, beta);
}

#endif
