/* The kernels of dropout.cu and their launches: the mask drawn from the CPU's Philox words
 * (core/philox.h compiles for both), so a mask is the same bits on either device, and the mask
 * applied with its scale, forward and backward alike. Compiles for a GPU and under the CPU's
 * emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_DROPOUT_CUH
#define TANDEM_CUDA_DROPOUT_CUH

#include "core/philox.h"
#include "device/cuda/dtype.cuh"

/* The dropout RNG's position at the start of a forward, as the device reads it (backend.cu
 * writes it before each forward): the host's td_rng (seed, offset) and the sample key of
 * td_graph_set_rng_key (step, first_sample). */
struct td__gpu_rng_key {
    uint64_t seed, offset, step, first_sample;
};

/* keep[e] for the forward's mask entries: entry e draws word (offset + delta + e) of stream 0,
 * or, keyed by sample, word (sample_delta + e % per_sample) of sample e / per_sample's stream. */
static __global__ void __launch_bounds__(TD__THREADS)
    td__dropout_draw_kernel(unsigned char *keep, size_t count, const td__gpu_rng_key *k,
                            uint64_t delta, uint64_t sample_delta, int by_sample,
                            uint64_t per_sample, float p) {
    TD__GRID_STRIDE(e, count) {
        uint32_t b[4];
        uint64_t w;
        if (by_sample) {
            w = sample_delta + e % per_sample;
            td__philox4x32_10(k->seed, k->step << 32 | (k->first_sample + e / per_sample), w >> 2,
                              b);
        } else {
            w = k->offset + delta + e;
            td__philox4x32_10(k->seed, 0, w >> 2, b);
        }
        keep[e] = td__philox_uniform(b[w & 3]) >= p;
    }
}

/* y = beta y + x * (scale or 0, as entry i / per_entry of the mask says), multiplied as the
 * CPU does; without a mask (a forward that did not drop) x passes unchanged. Forward (x, y)
 * and backward (dy, dx) alike. */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__dropout_apply_kernel(T *y, const T *x, const unsigned char *keep, size_t n,
                             size_t per_entry, float scale, float beta) {
    TD__GRID_STRIDE(i, n) {
        float v = keep ? td_ld(x, i) * (keep[i / per_entry] ? scale : 0.f) : td_ld(x, i);
        td_st(y, i, beta != 0.f ? beta * td_ld(y, i) + v : v);
    }
}

/* Mask entries per sample: count entries over N samples (none without samples). */
static inline uint64_t td__dropout_per_sample(size_t count, int64_t N) {
    return N > 0 ? (uint64_t)(count / (size_t)N) : 0;
}

/* The forward's mask: count entries of N samples, from the key at k (device memory) and what
 * the forward drew before (delta words of stream 0, or sample_delta words of each sample's). */
static inline void td__launch_dropout_draw(cudaStream_t s, unsigned char *keep, size_t count,
                                           int64_t N, const td__gpu_rng_key *k, uint64_t delta,
                                           uint64_t sample_delta, int by_sample, float p) {
    if (count)
        td__launch<td__dropout_draw_kernel>(td__blocks(count), 0, s, keep, count, k, delta,
                                            sample_delta, by_sample,
                                            td__dropout_per_sample(count, N), p);
}

/* y = beta y + x through the mask of `count` entries over n elements (each entry covers n /
 * count of them: one, or a channel's plane); keep NULL passes x unchanged. */
template <typename T>
static inline void td__launch_dropout_apply(cudaStream_t s, T *y, const T *x,
                                            const unsigned char *keep, size_t n, size_t count,
                                            float scale, float beta) {
    if (n)
        td__launch<td__dropout_apply_kernel<T>>(td__blocks(n), 0, s, y, x, keep, n, n / count,
                                                scale, beta);
}

#endif
