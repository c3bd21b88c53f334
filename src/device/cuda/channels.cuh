/* The kernels of channels.cu and their launches: per-channel sums and an affine map per channel
 * over an f32 (N, C, S) tensor (S = H * W, plain NCHW), for SyncBatchNorm on a GPU. Sums are in
 * double, one block per channel, in a fixed tree: the same bits every run. Compiles for a GPU
 * and under the CPU's emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_CHANNELS_CUH
#define TANDEM_CUDA_CHANNELS_CUH

#include "device/cuda/kernel.cuh"

/* s[c] = sum of x (or of dy), s[C + c] = sum of x * x (or of dy * (x - mean[c])), over n and s. */
static __global__ void __launch_bounds__(TD__THREADS)
    td__channel_sums_kernel(const float *x, const float *dy, const float *mean, int64_t N,
                            int64_t C, int64_t S, double *s) {
    __shared__ double a_buf[TD__THREADS], b_buf[TD__THREADS];
    int64_t c = blockIdx.x, per = N * S;
    double m = mean ? (double)mean[c] : 0.0, a = 0.0, b = 0.0;
    for (int64_t i = threadIdx.x; i < per; i += TD__THREADS) {
        int64_t at = ((i / S) * C + c) * S + i % S;
        double v = x[at];
        if (dy) {
            double g = dy[at];
            a += g;
            b += g * (v - m);
        } else {
            a += v;
            b += v * v;
        }
    }
    a_buf[threadIdx.x] = a;
    b_buf[threadIdx.x] = b;
    __syncthreads();
    for (int half = TD__THREADS / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) {
            a_buf[threadIdx.x] += a_buf[threadIdx.x + half];
            b_buf[threadIdx.x] += b_buf[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        s[c] = a_buf[0];
        s[C + c] = b_buf[0];
    }
}

/* out = (in - mean[c]) a[c] + b[c], plus k[c] extra when extra is given; coef = (mean, a, b, k),
 * C floats each. */
static __global__ void __launch_bounds__(TD__THREADS)
    td__channel_affine_kernel(float *out, const float *in, const float *coef, const float *extra,
                              int64_t total, int64_t C, int64_t S) {
    TD__GRID_STRIDE(i, (size_t)total) {
        int64_t c = ((int64_t)i / S) % C;
        float v = (in[i] - coef[c]) * coef[C + c] + coef[2 * C + c];
        out[i] = extra ? v + coef[3 * C + c] * extra[i] : v;
    }
}

/* The sums of channel_sums_kernel for C channels (C < 2^31), on stream st. */
static inline void td__launch_channel_sums(cudaStream_t st, const float *x, const float *dy,
                                           const float *mean, int64_t N, int64_t C, int64_t S,
                                           double *s) {
    if (C) td__launch<td__channel_sums_kernel>((unsigned)C, 0, st, x, dy, mean, N, C, S, s);
}

/* out = the affine map of channel_affine_kernel over N x C x S elements, on stream st. */
static inline void td__launch_channel_affine(cudaStream_t st, float *out, const float *in,
                                             const float *coef, const float *extra, int64_t N,
                                             int64_t C, int64_t S) {
    int64_t total = N * C * S;
    if (total)
        td__launch<td__channel_affine_kernel>(td__blocks((size_t)total), 0, st, out, in, coef,
                                              extra, total, C, S);
}

#endif
