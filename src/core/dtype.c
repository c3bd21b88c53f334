/* Element types: sizes, names, and the bf16 / f16 <-> f32 conversions. */
#include <string.h>

#include "tandem/core.h"

size_t td_dtype_size(td_dtype dtype) {
    static const size_t sizes[TD_DTYPE_COUNT] = {4, 8, 2, 2, 4, 8, 1};
    return (unsigned)dtype < TD_DTYPE_COUNT ? sizes[dtype] : 0;
}

const char *td_dtype_name(td_dtype dtype) {
    static const char *names[TD_DTYPE_COUNT] = {"f32", "f64", "bf16", "f16", "i32", "i64", "u8"};
    return (unsigned)dtype < TD_DTYPE_COUNT ? names[dtype] : "invalid";
}

static uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static float bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

uint16_t td_f32_to_bf16(float x) {
    uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float td_bf16_to_f32(uint16_t x) { return bits_f32((uint32_t)x << 16); }

uint16_t td_f32_to_f16(float x) {
    uint32_t u = f32_bits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow to inf */
    if (abs < 0x38800000u) {                                   /* subnormal or zero */
        float f = bits_f32(abs) * 16777216.0f;                 /* scale by 2^24 */
        uint32_t m = (uint32_t)f;
        float rem = f - (float)m;
        if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;
        return (uint16_t)(sign | m);
    }
    uint32_t e = ((abs >> 23) - 112u) << 10;
    uint32_t m = (abs >> 13) & 0x3ffu;
    uint32_t h = e | m;
    uint32_t rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

float td_f16_to_f32(uint16_t x) {
    uint32_t sign = (uint32_t)(x & 0x8000u) << 16;
    uint32_t e = (x >> 10) & 0x1fu;
    uint32_t m = x & 0x3ffu;
    if (e == 0) {
        float f = (float)m / 16777216.0f; /* m * 2^-24 */
        return (sign ? -f : f);
    }
    if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
