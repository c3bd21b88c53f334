/* Internal helpers shared by every subsystem: setting the thread's error message and
 * logging, and the early-return macro every layer uses. Not installed. */
#ifndef TANDEM_CORE_IMPL_H
#define TANDEM_CORE_IMPL_H

#include <string.h>

#include "tandem/core.h"

#if defined(__GNUC__)
#define TD__PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define TD__PRINTF(a, b)
#endif

/* Records a formatted message as this thread's last error and returns `status`, so that
 * failures read `return td__fail(TD_EFORMAT, "%s: truncated", path);`. */
td_status td__fail(td_status status, const char *fmt, ...) TD__PRINTF(2, 3);

/* Returns from the calling function with the status of `call` when it is an error. */
#define TD__TRY(call)                     \
    do {                                  \
        td_status td_t_ = (call);         \
        if (td_t_ != TD_OK) return td_t_; \
    } while (0)

/* Sends a formatted message to the installed log sink, if any accepts `level`. */
void td__log(td_log_level level, const char *fmt, ...) TD__PRINTF(2, 3);

/* The vector instruction sets the library's own kernels are compiled for beside plain x86-64
 * (oneDNN chooses its own), in order. */
typedef enum { TD__ISA_SSE2 = 0, TD__ISA_AVX2 = 1, TD__ISA_AVX512 = 2 } td__isa;

/* The richest set this CPU has that TANDEM_MAX_CPU_ISA allows (cpu.c), decided once per
 * process: TD__ISA_AVX2 is AVX2 + FMA + F16C, TD__ISA_AVX512 adds AVX-512 F, BW, VL and DQ. */
td__isa td__cpu_isa(void);

/* The state letter /proc/<pid>/stat gives the process (R, S, D, T, t, Z, X, ...), or 0 when it
 * cannot be read (no such process). */
char td__proc_state(int pid);

/* Writes "(d0, d1, ...)", the first ndim of dims (at most TD_MAX_DIMS), for messages; returns
 * out. */
const char *td__dims_str(char *out, size_t cap, int64_t ndim, const int64_t *dims);

/* 1 when process `pid` of this host has exited: it no longer exists, or it is a zombie its
 * parent has not reaped yet. 0 for pid <= 0. */
int td__pid_dead(int pid);

/* Names of code addresses (symbols.c), the files' symbol tables read once per use: open, name
 * any number of addresses, close. */
typedef struct td__symbols td__symbols;
td__symbols *td__symbols_open(void);
void td__symbols_close(td__symbols *s);

/* "function+0x1c (file)", or "file(+0x7cf2)" where the file names no function there. */
void td__symbolize(td__symbols *s, const void *addr, char *out, size_t cap);

/* 1 when `sig` is in the mask /proc/<pid>/status (or task/<tid>/status, tid > 0) gives under
 * `field`: "SigCgt" (caught), "SigBlk" (blocked), "SigIgn"; 0 otherwise or unreadable. */
int td__proc_signal(int pid, int tid, const char *field, int sig);

/* Writes the n bytes of s into out as the body of a JSON string (without the quotes): '"' and
 * '\\' escaped, control characters, DEL and bytes that are not part of well-formed UTF-8 as
 * \u00XX of their value, so the text is valid JSON and shows every byte. Writes whole escapes
 * only and always terminates out (when cap > 0); returns the length of the whole escaped text,
 * as snprintf does, so a caller can size a buffer with td__json_escape(NULL, 0, s, n). */
size_t td__json_escape(char *out, size_t cap, const char *s, size_t n);

/* 1 when the n bytes of s are well-formed UTF-8 (what a JSON file must hold), else 0. */
int td__utf8_valid(const char *s, size_t n);

/* The conversions of tandem/core.h as inline functions for loops over elements: round to
 * nearest even, NaN stays NaN (quiet), f16 overflows to infinity and keeps subnormals. */
static inline uint32_t td__f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float td__bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

static inline uint16_t td__f32_to_bf16(float x) {
    uint32_t u = td__f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float td__bf16_to_f32(uint16_t x) { return td__bits_f32((uint32_t)x << 16); }

static inline uint16_t td__f32_to_f16(float x) {
    uint32_t u = td__f32_bits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t abs = u & 0x7fffffffu;
    /* A NaN stays quiet with its payload's top bits, as F16C's vcvtps2ph converts it. */
    if (abs > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
    if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow to inf */
    if (abs < 0x38800000u) {                                   /* subnormal or zero */
        float f = td__bits_f32(abs) * 16777216.0f;             /* scale by 2^24 */
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

static inline float td__f16_to_f32(uint16_t x) {
    uint32_t sign = (uint32_t)(x & 0x8000u) << 16;
    uint32_t e = (x >> 10) & 0x1fu;
    uint32_t m = x & 0x3ffu;
    if (e == 0) {
        float f = (float)m / 16777216.0f; /* m * 2^-24 */
        return (sign ? -f : f);
    }
    /* A NaN comes out quiet, as F16C's vcvtph2ps gives it. */
    if (e == 31) return td__bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
    return td__bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* 1 for the floating dtypes a tensor may have (f32, bf16, f16). */
static inline int td__is_float(td_dtype dt) {
    return dt == TD_F32 || dt == TD_BF16 || dt == TD_F16;
}

/* Element i of a buffer of float dtype dt, as f32, and back. */
static inline float td__load(const void *p, td_dtype dt, size_t i) {
    if (dt == TD_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dt == TD_BF16 ? td__bf16_to_f32(h) : td__f16_to_f32(h);
}

static inline void td__store(void *p, td_dtype dt, size_t i, float v) {
    if (dt == TD_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = dt == TD_BF16 ? td__f32_to_bf16(v) : td__f32_to_f16(v);
}

/* dst (n elements of dt) = src (n elements of st), between f32, bf16 and f16. */
void td__convert(void *dst, td_dtype dt, const void *src, td_dtype st, size_t n);

/* dst += src over n elements of float dtype dt, each sum in f32 then rounded. */
void td__accumulate(void *dst, const void *src, td_dtype dt, size_t n);

/* ---- sums whose bits do not depend on the partition (fixed_sum.c) ------------------------ */

/* x[0] = the aligned pairwise tree over the L buffers of n floats x[0 .. L) (stride 1, 2, 4,
 * ..., the earlier buffer on the left), in place: the others are overwritten. */
void td__pairwise_sum(float *const *x, size_t L, size_t n);

/* The 32-bit digits of an exact sum of squares of f32 values, from 2^-298 up (in 64-bit words,
 * so that td_comm's I64 SUM of up to 2^31 ranks' normalised accumulators cannot overflow). */
#define TD__SUMSQ_DIGITS 20

/* An exact sum of squares: d[0 .. DIGITS) the digits, d[DIGITS] the infinities and
 * d[DIGITS + 1] the NaNs among the values. Add accumulators as TD__SUMSQ_WORDS int64s. */
typedef struct {
    uint64_t d[TD__SUMSQ_DIGITS + 2];
} td__sumsq;

#define TD__SUMSQ_WORDS (TD__SUMSQ_DIGITS + 2)

/* An empty sum. */
void td__sumsq_init(td__sumsq *s);

/* Adds x[i]^2 for i < n, exactly; leaves s normalised. */
void td__sumsq_add_f32(td__sumsq *s, const float *x, size_t n);

/* Carries the digits back below 2^32 (after adding accumulators word by word). */
void td__sumsq_normalize(td__sumsq *s);

/* The sum as a double (the same bits for the same digits), NaN or infinity when a value was. */
double td__sumsq_value(const td__sumsq *s);

#endif
