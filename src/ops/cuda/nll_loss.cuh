/* The kernels of nll_loss.cu and their launches: the negative log-likelihood of (N, C) f32
 * log-probabilities at int64 labels, mean or sum, summed in one block in a fixed tree; labels
 * outside [0, C) count for nothing and the first such sample goes to *bad. Compiles for a GPU and
 * under the CPU's emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_NLL_LOSS_CUH
#define TANDEM_CUDA_NLL_LOSS_CUH

#include "device/cuda/kernel.cuh"

static __global__ void __launch_bounds__(TD__THREADS)
    td__nll_forward_kernel(float *loss, const float *logp, const int64_t *lab, int64_t N, int64_t C,
                           int mean, unsigned long long *bad) {
    float s = 0.f;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
        int64_t l = lab[i];
        if (l < 0 || l >= C) {
            atomicMin(bad, (unsigned long long)i); /* the first, whichever thread finds it */
            continue;
        }
        s -= logp[(size_t)i * C + l];
    }
    s = td__block_reduce(s, 0);
    if (threadIdx.x == 0) *loss = mean ? s / (float)N : s;
}

/* dlogp = beta dlogp, then -dloss (/ N) at each sample's label. */
static __global__ void __launch_bounds__(TD__THREADS)
    td__nll_backward_kernel(float *dlogp, const float *dloss, const int64_t *lab, int64_t N,
                            int64_t C, int mean, float beta) {
    float scale = mean ? dloss[0] / (float)N : dloss[0];
    TD__GRID_STRIDE(i, (size_t)(N * C)) {
        int64_t r = (int64_t)i / C, c = (int64_t)i % C;
        float d = lab[r] == c ? -scale : 0.f;
        dlogp[i] = beta != 0.f ? beta * dlogp[i] + d : d;
    }
}

/* *loss = the loss of N samples (mean or sum), on stream s. */
static inline void td__launch_nll_forward(cudaStream_t s, float *loss, const float *logp,
                                          const int64_t *lab, int64_t N, int64_t C, int mean,
                                          unsigned long long *bad) {
    td__launch<td__nll_forward_kernel>(1, 0, s, loss, logp, lab, N, C, mean, bad);
}

/* dlogp = beta dlogp + the loss's gradient from dloss (one float in device memory). */
static inline void td__launch_nll_backward(cudaStream_t s, float *dlogp, const float *dloss,
                                           const int64_t *lab, int64_t N, int64_t C, int mean,
                                           float beta) {
    if (N > 0 && C > 0)
        td__launch<td__nll_backward_kernel>(td__blocks((size_t)(N * C)), 0, s, dlogp, dloss, lab, N,
                                            C, mean, beta);
}

#endif
