/* Element types: sizes, names, and the bf16 / f16 <-> f32 conversions, one at a time and in
 * bulk (the scalar rules themselves are inline in core_impl.h). */
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/core_impl.h"

#if defined(__x86_64__)
/* Vector conversions, chosen at run time (cpu.c: the library may run on another CPU than it was
 * built on). F16C converts eight at a time, rounding to nearest even and keeping subnormals as
 * the scalar rules do. */
__attribute__((target("avx2,fma,f16c"))) static size_t f32_to_f16_avx2(uint16_t *d, const float *s,
                                                                       size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}

__attribute__((target("avx2,fma,f16c"))) static size_t f16_to_f32_avx2(float *d, const uint16_t *s,
                                                                       size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    return i;
}

/* bf16 sixteen at a time with AVX-512F integer operations: the scalar rule (round to nearest
 * even, NaNs kept quiet) bit for bit. Not AVX512_BF16's vcvtneps2bf16, which flushes
 * subnormals: a CPU with it would then round differently from one without. */
__attribute__((target("avx512f"))) static size_t f32_to_bf16_avx512(uint16_t *d, const float *s,
                                                                    size_t n) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff),
                  abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000),
                  quiet = _mm512_set1_epi32(0x400000);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i u = _mm512_loadu_si512(s + i);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(half, odd));
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, quiet));
        _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    }
    return i;
}

__attribute__((target("avx512f"))) static size_t bf16_to_f32_avx512(float *d, const uint16_t *s,
                                                                    size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i)));
        _mm512_storeu_si512(d + i, _mm512_slli_epi32(h, 16));
    }
    return i;
}
#endif

size_t td_dtype_size(td_dtype dtype) {
    static const size_t sizes[TD_DTYPE_COUNT] = {4, 8, 2, 2, 4, 8, 1};
    return (unsigned)dtype < TD_DTYPE_COUNT ? sizes[dtype] : 0;
}

const char *td_dtype_name(td_dtype dtype) {
    static const char *names[TD_DTYPE_COUNT] = {"f32", "f64", "bf16", "f16", "i32", "i64", "u8"};
    return (unsigned)dtype < TD_DTYPE_COUNT ? names[dtype] : "invalid";
}

uint16_t td_f32_to_bf16(float x) { return td__f32_to_bf16(x); }
float td_bf16_to_f32(uint16_t x) { return td__bf16_to_f32(x); }
uint16_t td_f32_to_f16(float x) { return td__f32_to_f16(x); }
float td_f16_to_f32(uint16_t x) { return td__f16_to_f32(x); }

void td__convert(void *dst, td_dtype dt, const void *src, td_dtype st, size_t n) {
    if (dt == st) {
        memmove(dst, src, n * td_dtype_size(dt));
        return;
    }
    if (st == TD_F32) {
        const float *s = src;
        uint16_t *d = dst;
        size_t i = 0;
        if (dt == TD_BF16) {
#if defined(__x86_64__)
            if (td__cpu_isa() >= TD__ISA_AVX512) i = f32_to_bf16_avx512(d, s, n);
#endif
            for (; i < n; i++) d[i] = td__f32_to_bf16(s[i]);
            return;
        }
#if defined(__x86_64__)
        if (td__cpu_isa() >= TD__ISA_AVX2) i = f32_to_f16_avx2(d, s, n);
#endif
        for (; i < n; i++) d[i] = td__f32_to_f16(s[i]);
    } else if (dt == TD_F32) {
        const uint16_t *s = src;
        float *d = dst;
        size_t i = 0;
        if (st == TD_BF16) {
#if defined(__x86_64__)
            if (td__cpu_isa() >= TD__ISA_AVX512) i = bf16_to_f32_avx512(d, s, n);
#endif
            for (; i < n; i++) d[i] = td__bf16_to_f32(s[i]);
            return;
        }
#if defined(__x86_64__)
        if (td__cpu_isa() >= TD__ISA_AVX2) i = f16_to_f32_avx2(d, s, n);
#endif
        for (; i < n; i++) d[i] = td__f16_to_f32(s[i]);
    } else { /* bf16 <-> f16, through f32 */
        for (size_t i = 0; i < n; i++) td__store(dst, dt, i, td__load(src, st, i));
    }
}

void td__accumulate(void *dst, const void *src, td_dtype dt, size_t n) {
    if (dt == TD_F32) {
        float *d = dst;
        const float *s = src;
        for (size_t i = 0; i < n; i++) d[i] += s[i];
        return;
    }
    for (size_t i = 0; i < n; i++)
        td__store(dst, dt, i, td__load(dst, dt, i) + td__load(src, dt, i));
}
