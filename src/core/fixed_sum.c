/* Sums whose bits do not depend on how their terms are split among ranks, shards or threads:
 *  - the aligned pairwise tree over L buffers (node (l, i) = node (l-1, 2i) + node (l-1, 2i+1),
 *    the earlier buffers on the left), the order deterministic mode adds fixed shards in, so
 *    that a rank holding a subtree and the levels above the ranks added after give the bits of
 *    one process adding all the leaves;
 *  - the exact sum of squares of f32 values (gradient norms): every square of an f32 is exact in
 *    a 48-bit integer times a power of two, so the squares are added as integers into a
 *    fixed-point accumulator of 32-bit digits (2^-298 .. 2^342), which is exact and associative:
 *    any partition of the values, summed in any order and the accumulators added across ranks
 *    (as 64-bit integers, td_comm's SUM), gives the same digits, and so the same double.
 * Plain C; the pairwise loops are written in blocks the compiler vectorises without changing
 * any element's order of addition. */
#include <math.h>

#include "core/core_impl.h"

#define VEC 16 /* floats per fixed-trip block: what -O2 vectorises */

/* acc = acc + x, element by element. */
static void add_into(float *restrict acc, const float *restrict x, size_t n) {
    size_t e = 0;
    for (; e + VEC <= n; e += VEC)
        for (size_t k = 0; k < VEC; k++) acc[e + k] = acc[e + k] + x[e + k];
    for (; e < n; e++) acc[e] = acc[e] + x[e];
}

void td__pairwise_sum(float *const *x, size_t L, size_t n) {
    for (size_t stride = 1; stride < L; stride *= 2)
        for (size_t i = 0; i + stride < L; i += 2 * stride) add_into(x[i], x[i + stride], n);
}

/* ---- the exact sum of squares ------------------------------------------------------------ */

/* Squares are gathered per f32 exponent: m^2 < 2^48 for a 24-bit significand m, so 2^16 of them
 * fit a bin of 64 bits before the bins are moved into the digits. */
#define CHUNK 65536

void td__sumsq_init(td__sumsq *s) { memset(s, 0, sizeof *s); }

/* Digits back below 2^32, carrying upwards. */
void td__sumsq_normalize(td__sumsq *s) {
    uint64_t carry = 0;
    for (int i = 0; i < TD__SUMSQ_DIGITS; i++) {
        uint64_t v = s->d[i] + carry;
        s->d[i] = v & 0xffffffffu;
        carry = v >> 32;
    }
    /* past 2^342 only an overflowing count of huge squares could carry: saturate as infinity */
    if (carry) s->d[TD__SUMSQ_DIGITS]++;
}

/* bins[ex] holds sums of m^2 for values m 2^(ex - 150): m^2 2^(2 ex - 300), at digit offset
 * 2 ex - 2 of the accumulator's 2^-298. */
static void fold_bins(td__sumsq *s, uint64_t *bins) {
    for (int ex = 1; ex < 255; ex++) {
        if (!bins[ex]) continue;
        unsigned shift = 2u * (unsigned)ex - 2u;
        unsigned __int128 v = (unsigned __int128)bins[ex] << (shift % 32);
        size_t at = shift / 32;
        s->d[at] += (uint64_t)v & 0xffffffffu;
        s->d[at + 1] += (uint64_t)(v >> 32) & 0xffffffffu;
        s->d[at + 2] += (uint64_t)(v >> 64);
        bins[ex] = 0;
    }
    td__sumsq_normalize(s);
}

void td__sumsq_add_f32(td__sumsq *s, const float *x, size_t n) {
    uint64_t bins[256] = {0};
    for (size_t c = 0; c < n; c += CHUNK) {
        size_t end = n - c < CHUNK ? n : c + CHUNK;
        for (size_t i = c; i < end; i++) {
            uint32_t u = td__f32_bits(x[i]);
            uint32_t ex = (u >> 23) & 0xffu, m = u & 0x7fffffu;
            if (ex == 255) { /* infinity or NaN: counted, not summed */
                s->d[TD__SUMSQ_DIGITS + (m != 0)]++;
                continue;
            }
            m |= (uint32_t)(ex != 0) << 23;
            ex += ex == 0; /* a subnormal's scale is the smallest normal's */
            bins[ex] += (uint64_t)m * m;
        }
        fold_bins(s, bins);
    }
}

double td__sumsq_value(const td__sumsq *s) {
    if (s->d[TD__SUMSQ_DIGITS + 1]) return NAN;
    if (s->d[TD__SUMSQ_DIGITS]) return INFINITY;
    double r = 0;
    for (int i = TD__SUMSQ_DIGITS - 1; i >= 0; i--)
        if (s->d[i]) r += ldexp((double)s->d[i], 32 * i - 298);
    return r;
}
