/* Per-channel kernels over an f32 (N, C, S) tensor (S = H * W, plain NCHW), for ops whose
 * statistics cross ranks and so are summed by the host's process group between kernels
 * (SyncBatchNorm, src/ops/sync_batch_norm_device.c): the sums of a channel, and an affine map
 * per channel. Sums are in double, one block per channel, in a fixed tree: the same bits every
 * run. Queued on the stream given. */
#include "device/cuda/runtime.cuh"

#define THREADS 256

/* s[c] = sum of x (or of dy), s[C + c] = sum of x * x (or of dy * (x - mean[c])), over n and s. */
__global__ void channel_sums_kernel(const float *x, const float *dy, const float *mean, int64_t N,
                                    int64_t C, int64_t S, double *s) {
    __shared__ double a_buf[THREADS], b_buf[THREADS];
    int64_t c = blockIdx.x, per = N * S;
    double m = mean ? (double)mean[c] : 0.0, a = 0.0, b = 0.0;
    for (int64_t i = threadIdx.x; i < per; i += THREADS) {
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
    for (int half = THREADS / 2; half > 0; half /= 2) {
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
__global__ void channel_affine_kernel(float *out, const float *in, const float *coef,
                                      const float *extra, int64_t total, int64_t C, int64_t S) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t c = (i / S) % C;
        float v = (in[i] - coef[c]) * coef[C + c] + coef[2 * C + c];
        out[i] = extra ? v + coef[3 * C + c] * extra[i] : v;
    }
}

td_status td__cu_channel_sums(int device, void *stream, const float *x, const float *dy,
                              const float *mean, int64_t N, int64_t C, int64_t S, double *s) {
    if (C == 0) return TD_OK;
    if (C > INT32_MAX)
        return td__host->fail(TD_EINVAL, "channel sums: %lld channels", (long long)C);
    TD__CU(cudaSetDevice(device));
    channel_sums_kernel<<<(unsigned)C, THREADS, 0, (cudaStream_t)stream>>>(x, dy, mean, N, C, S, s);
    TD__CU(cudaGetLastError());
    return TD_OK;
}

td_status td__cu_channel_affine(int device, void *stream, float *out, const float *in,
                                const float *coef, const float *extra, int64_t N, int64_t C,
                                int64_t S) {
    int64_t total = N * C * S;
    if (total == 0) return TD_OK;
    TD__CU(cudaSetDevice(device));
    int64_t b = (total + THREADS - 1) / THREADS;
    unsigned blocks = (unsigned)(b > 65535 ? 65535 : b);
    channel_affine_kernel<<<blocks, THREADS, 0, (cudaStream_t)stream>>>(out, in, coef, extra, total,
                                                                        C, S);
    TD__CU(cudaGetLastError());
    return TD_OK;
}
