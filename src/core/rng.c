/* Philox4x32-10 (Salmon et al., SC'11): a counter-based generator, so any value of the
 * stream can be computed directly from (seed, position) without sequential state. The 128-bit
 * counter is (position, stream): td_rng walks stream 0; deterministic training gives each
 * (step, sample) a stream of its own. */
#include <math.h>

#include "tandem/core.h"

void td_philox4x32_stream(uint64_t seed, uint64_t stream, uint64_t counter, uint32_t out[4]) {
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

void td_philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]) {
    td_philox4x32_stream(seed, 0, counter, out);
}

void td_rng_init(td_rng *rng, uint64_t seed) {
    rng->seed = seed;
    rng->offset = 0;
}

uint32_t td_rng_u32(td_rng *rng) {
    uint32_t block[4];
    td_philox4x32(rng->seed, rng->offset >> 2, block);
    return block[rng->offset++ & 3];
}

float td_rng_uniform(td_rng *rng) { return (float)(td_rng_u32(rng) >> 8) * (1.0f / 16777216.0f); }

float td_rng_normal(td_rng *rng) {
    float u1 = ((float)(td_rng_u32(rng) >> 8) + 1.0f) * (1.0f / 16777217.0f); /* (0, 1] */
    float u2 = td_rng_uniform(rng);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

uint32_t td_rng_below(td_rng *rng, uint32_t n) {
    uint32_t limit = (uint32_t)(-n) % n; /* values below this would bias the result */
    for (;;) {
        uint64_t m = (uint64_t)td_rng_u32(rng) * n;
        if ((uint32_t)m >= limit) return (uint32_t)(m >> 32);
    }
}

void td_rng_fill_uniform(td_rng *rng, float *out, size_t n, float lo, float hi) {
    float span = hi - lo;
    for (size_t i = 0; i < n; i++) out[i] = lo + span * td_rng_uniform(rng);
}
