/* Reduction kernels for the collectives: dst = op over n source buffers, for every dtype and
 * op. Plain loops over blocks of 16 elements with fixed-trip inner loops, which the compiler
 * turns into vector code at -O2 -march=native; the fold order is the source order, so the
 * result does not depend on which rank computes it. No threading, no allocation.
 *
 * Integer semantics: SUM and PROD wrap modulo 2^bits (as MPI and NCCL do), MIN/MAX are exact,
 * AVG sums in 64 bits and divides truncating toward zero. bf16 and f16 accumulate in f32. */
#include <string.h>

#include "comm/comm_impl.h"
#include "core/core_impl.h"

#define BLK 16

#define ID(x) (x)
#define ADD(a, b) ((a) + (b))
#define MUL(a, b) ((a) * (b))
#define MIN(a, b) ((b) < (a) ? (b) : (a))
#define MAX(a, b) ((b) > (a) ? (b) : (a))
#define FIN_NONE(a, d) (a)
#define FIN_DIV(a, d) ((a) / (d))

/* One kernel: T is the element type, A the accumulator, LD/ST convert between them. */
#define KERNEL(name, T, A, LD, ST, OP, FIN)                                                  \
    static void name(void *dstv, const void *const *srcv, int nsrc, size_t count, int div) { \
        T *dst = dstv;                                                                       \
        size_t i = 0;                                                                        \
        (void)div;                                                                           \
        for (; i + BLK <= count; i += BLK) {                                                 \
            A acc[BLK];                                                                      \
            const T *s0 = srcv[0];                                                           \
            for (int k = 0; k < BLK; k++) acc[k] = (A)LD(s0[i + k]);                         \
            for (int j = 1; j < nsrc; j++) {                                                 \
                const T *s = srcv[j];                                                        \
                for (int k = 0; k < BLK; k++) acc[k] = OP(acc[k], (A)LD(s[i + k]));          \
            }                                                                                \
            for (int k = 0; k < BLK; k++) dst[i + k] = (T)ST(FIN(acc[k], (A)div));           \
        }                                                                                    \
        for (; i < count; i++) {                                                             \
            A acc = (A)LD(((const T *)srcv[0])[i]);                                          \
            for (int j = 1; j < nsrc; j++) acc = OP(acc, (A)LD(((const T *)srcv[j])[i]));    \
            dst[i] = (T)ST(FIN(acc, (A)div));                                                \
        }                                                                                    \
    }

/* Floats: every op in the element's own precision (bf16/f16 in f32). */
#define FLOAT_KERNELS(tag, T, A, LD, ST)            \
    KERNEL(tag##_sum, T, A, LD, ST, ADD, FIN_NONE)  \
    KERNEL(tag##_prod, T, A, LD, ST, MUL, FIN_NONE) \
    KERNEL(tag##_min, T, A, LD, ST, MIN, FIN_NONE)  \
    KERNEL(tag##_max, T, A, LD, ST, MAX, FIN_NONE)  \
    KERNEL(tag##_avg, T, A, LD, ST, ADD, FIN_DIV)

FLOAT_KERNELS(f32, float, float, ID, ID)
FLOAT_KERNELS(f64, double, double, ID, ID)
FLOAT_KERNELS(bf16, uint16_t, float, td__bf16_to_f32, td__f32_to_bf16)
FLOAT_KERNELS(f16, uint16_t, float, td__f16_to_f32, td__f32_to_f16)

/* Integers: SUM/PROD in the unsigned type of the same width (defined wrap-around), MIN/MAX
 * in the element type, AVG in 64 bits. */
#define INT_KERNELS(tag, T, U)                      \
    KERNEL(tag##_sum, T, U, ID, ID, ADD, FIN_NONE)  \
    KERNEL(tag##_prod, T, U, ID, ID, MUL, FIN_NONE) \
    KERNEL(tag##_min, T, T, ID, ID, MIN, FIN_NONE)  \
    KERNEL(tag##_max, T, T, ID, ID, MAX, FIN_NONE)

INT_KERNELS(i32, int32_t, uint32_t)
INT_KERNELS(i64, int64_t, uint64_t)
INT_KERNELS(u8, uint8_t, unsigned)
KERNEL(i32_avg, int32_t, int64_t, ID, ID, ADD, FIN_DIV)
KERNEL(u8_avg, uint8_t, int64_t, ID, ID, ADD, FIN_DIV)

/* i64 AVG: the sum wraps like SUM (there is no wider type), then divides. */
static inline int64_t wrap_add_i64(int64_t a, int64_t b) {
    return (int64_t)((uint64_t)a + (uint64_t)b);
}
KERNEL(i64_avg, int64_t, int64_t, ID, ID, wrap_add_i64, FIN_DIV)

typedef void (*kernel_fn)(void *, const void *const *, int, size_t, int);

#define ROW(tag) \
    { tag##_sum, tag##_prod, tag##_min, tag##_max, tag##_avg }
static const kernel_fn kernels[TD_DTYPE_COUNT][TD_OP_COUNT] = {
    [TD_F32] = ROW(f32), [TD_F64] = ROW(f64), [TD_BF16] = ROW(bf16), [TD_F16] = ROW(f16),
    [TD_I32] = ROW(i32), [TD_I64] = ROW(i64), [TD_U8] = ROW(u8),
};

void td__reduce(void *dst, const void *const *src, int nsrc, size_t count, td_dtype dtype,
                td_reduce_op op, int avg_div) {
    if (count == 0 || nsrc <= 0) return;
    kernels[dtype][op](dst, src, nsrc, count, avg_div > 0 ? avg_div : 1);
}
