/* The kernels of layer_norm.cu and their launches, in f32: forward one block per row (the mean,
 * then the biased variance, each reduced in a fixed tree), keeping each row's mean and rstd;
 * backward dx one block per row, and the weight and bias gradients in two stages with no
 * atomics: blocks of 32 columns by a chunk of rows (tiling.h) each write a partial sum, then one
 * thread per column adds the partial sums in chunk order. Compiles for a GPU and under the CPU's
 * emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_LAYER_NORM_CUH
#define TANDEM_CUDA_LAYER_NORM_CUH

#include "device/cuda/kernel.cuh"
#include "ops/cuda/tiling.h"

#define TD__LN_COLS 32                           /* columns of one stage-one block */
#define TD__LN_LANES (TD__THREADS / TD__LN_COLS) /* rows a stage-one block reads at once */

static __global__ void __launch_bounds__(TD__THREADS)
    td__ln_forward_kernel(float *y, float *mean, float *rstd, const float *x, const float *w,
                          const float *b, int64_t C, float eps) {
    size_t at = (size_t)blockIdx.x * (size_t)C;
    const float *xr = x + at;
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += xr[c];
    float m = td__block_reduce(s, 0) / (float)C;
    float q = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) q += (xr[c] - m) * (xr[c] - m);
    float rs = 1.f / sqrtf(td__block_reduce(q, 0) / (float)C + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float v = (xr[c] - m) * rs;
        y[at + c] = v * (w ? w[c] : 1.f) + (b ? b[c] : 0.f);
    }
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = m;
        rstd[blockIdx.x] = rs;
    }
}

/* dx = beta dx + rstd (gw - sum(gw) / C - xhat sum(gw xhat) / C), one block per row. */
static __global__ void __launch_bounds__(TD__THREADS)
    td__ln_dx_kernel(float *dx, const float *dy, const float *x, const float *w, const float *mean,
                     const float *rstd, int64_t C, float beta) {
    size_t at = (size_t)blockIdx.x * (size_t)C;
    float m = mean[blockIdx.x], rs = rstd[blockIdx.x], sg = 0.f, sgx = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float gw = dy[at + c] * (w ? w[c] : 1.f);
        sg += gw;
        sgx += gw * (x[at + c] - m) * rs;
    }
    sg = td__block_reduce(sg, 0) / (float)C;
    sgx = td__block_reduce(sgx, 0) / (float)C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float gw = dy[at + c] * (w ? w[c] : 1.f), xh = (x[at + c] - m) * rs;
        float d = rs * (gw - sg - xh * sgx);
        dx[at + c] = beta != 0.f ? beta * dx[at + c] + d : d;
    }
}

/* Stage one: block (column tile, chunk) sums dy xhat and dy over the chunk's rows for its 32
 * columns, TD__LN_LANES rows at a time, then the lanes in order; into partial[0 or 1][chunk][c]. */
static __global__ void __launch_bounds__(TD__THREADS)
    td__ln_params_partial(float *partial, const float *dy, const float *x, const float *mean,
                          const float *rstd, int64_t rows, int64_t C, int64_t chunk_rows) {
    __shared__ float sw[TD__LN_LANES][TD__LN_COLS], sb[TD__LN_LANES][TD__LN_COLS];
    int col = threadIdx.x % TD__LN_COLS, lane = threadIdx.x / TD__LN_COLS;
    int64_t c = (int64_t)blockIdx.x * TD__LN_COLS + col, chunk = blockIdx.y;
    int64_t r0 = chunk * chunk_rows, r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    float aw = 0.f, ab = 0.f;
    if (c < C)
        for (int64_t r = r0 + lane; r < r1; r += TD__LN_LANES) {
            size_t at = (size_t)(r * C + c);
            aw += dy[at] * (x[at] - mean[r]) * rstd[r];
            ab += dy[at];
        }
    sw[lane][col] = aw;
    sb[lane][col] = ab;
    __syncthreads();
    if (lane != 0 || c >= C) return;
    for (int l = 1; l < TD__LN_LANES; l++) {
        aw += sw[l][col];
        ab += sb[l][col];
    }
    int64_t chunks = gridDim.y;
    partial[chunk * C + c] = aw;
    partial[(chunks + chunk) * C + c] = ab;
}

/* Stage two: dw[c] = beta_w dw[c] + the partial sums of column c in chunk order (db alike);
 * dw or db NULL when not wanted. */
static __global__ void __launch_bounds__(TD__THREADS)
    td__ln_params_sum(float *dw, float *db, const float *partial, int64_t chunks, int64_t C,
                      float beta_w, float beta_b) {
    TD__GRID_STRIDE(c, (size_t)C) {
        float w = 0.f, b = 0.f;
        for (int64_t k = 0; k < chunks; k++) {
            w += partial[k * C + (int64_t)c];
            b += partial[(chunks + k) * C + (int64_t)c];
        }
        if (dw) dw[c] = beta_w != 0.f ? beta_w * dw[c] + w : w;
        if (db) db[c] = beta_b != 0.f ? beta_b * db[c] + b : b;
    }
}

/* y = the layer norm of rows (< 2^31) of C, mean and rstd (rows each) kept; w, b NULL when
 * absent. */
static inline void td__launch_ln_forward(cudaStream_t s, float *y, float *mean, float *rstd,
                                         const float *x, const float *w, const float *b,
                                         int64_t rows, int64_t C, float eps) {
    if (rows)
        td__launch<td__ln_forward_kernel>((unsigned)rows, 0, s, y, mean, rstd, x, w, b, C, eps);
}

/* dx = beta dx + the gradient through the forward's mean and rstd. */
static inline void td__launch_ln_dx(cudaStream_t s, float *dx, const float *dy, const float *x,
                                    const float *w, const float *mean, const float *rstd,
                                    int64_t rows, int64_t C, float beta) {
    if (rows) td__launch<td__ln_dx_kernel>((unsigned)rows, 0, s, dx, dy, x, w, mean, rstd, C, beta);
}

/* dw = beta_w dw + the sum over rows of dy xhat, db = beta_b db + the sum of dy (either NULL
 * when not wanted), through partial (2 td__partials(rows) C floats of device memory). */
static inline void td__launch_ln_params(cudaStream_t s, float *dw, float *db, float *partial,
                                        const float *dy, const float *x, const float *mean,
                                        const float *rstd, int64_t rows, int64_t C, float beta_w,
                                        float beta_b) {
    if (C == 0) return;
    int64_t chunks = td__partials(rows);
    dim3 grid((unsigned)((C + TD__LN_COLS - 1) / TD__LN_COLS), (unsigned)chunks);
    td__launch<td__ln_params_partial>(grid, 0, s, partial, dy, x, mean, rstd, rows, C,
                                      td__partial_rows(rows));
    td__launch<td__ln_params_sum>(td__blocks((size_t)C), 0, s, dw, db, (const float *)partial,
                                  chunks, C, beta_w, beta_b);
}

#endif
