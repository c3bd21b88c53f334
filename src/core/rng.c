/* Philox4x32-10 (Salmon et al., SC'11): a counter-based generator, so any value of the
 * stream can be computed directly from (seed, position) without sequential state. The 128-bit
 * counter is (position, stream): td_rng walks stream 0; deterministic training gives each
 * (step, sample) a stream of its own. */
#include <math.h>

#include "tandem/core.h"

#include "core/philox.h"

void td_philox4x32_stream(uint64_t seed, uint64_t stream, uint64_t counter, uint32_t out[4]) {
    td__philox4x32_10(seed, stream, counter, out);
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

float td_rng_uniform(td_rng *rng) { return td__philox_uniform(td_rng_u32(rng)); }

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
