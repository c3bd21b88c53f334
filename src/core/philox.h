/* Philox4x32-10 (Salmon et al., SC'11) as one inline function that compiles for the host and,
 * under nvcc, for the GPU too, so that a dropout mask drawn on a GPU is the same bits as the
 * one the CPU draws from the same (seed, stream, counter). td_philox4x32_stream (rng.c) is the
 * public name on the host. Not installed. */
#ifndef TANDEM_PHILOX_H
#define TANDEM_PHILOX_H

#include <stdint.h>

#ifdef __CUDACC__
#define TD__HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TD__HOST_DEVICE inline
#endif

/* Block `counter` of sub-stream `stream` of `seed`: the 128-bit counter is (counter, stream). */
static TD__HOST_DEVICE void td__philox4x32_10(uint64_t seed, uint64_t stream, uint64_t counter,
                                              uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = (uint32_t)stream,
             c3 = (uint32_t)(stream >> 32);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* A 32-bit word as a float in [0, 1) with 24 bits, as td_rng_uniform makes it. */
static TD__HOST_DEVICE float td__philox_uniform(uint32_t word) {
    return (float)(word >> 8) * (1.0f / 16777216.0f);
}

#endif
