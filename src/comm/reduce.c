/* Reduction kernels for the collectives: dst = op over n source buffers, for every dtype and
 * op. Plain loops over blocks of 16 elements with fixed-trip inner loops, which the compiler
 * turns into vector code; they are compiled three times, for plain x86-64, AVX2 and AVX-512,
 * and td__reduce takes the set the CPU allows (core/cpu.c). The fold order is the source order
 * and no operation is fused, so every set gives the same bits, whichever rank computes them.
 * No threading, no allocation.
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
#define FLOAT_KERNELS(tag, isa, T, A, LD, ST)             \
    KERNEL(tag##_sum_##isa, T, A, LD, ST, ADD, FIN_NONE)  \
    KERNEL(tag##_prod_##isa, T, A, LD, ST, MUL, FIN_NONE) \
    KERNEL(tag##_min_##isa, T, A, LD, ST, MIN, FIN_NONE)  \
    KERNEL(tag##_max_##isa, T, A, LD, ST, MAX, FIN_NONE)  \
    KERNEL(tag##_avg_##isa, T, A, LD, ST, ADD, FIN_DIV)

/* Integers: SUM/PROD in the unsigned type of the same width (defined wrap-around), MIN/MAX
 * in the element type, AVG in 64 bits. */
#define INT_KERNELS(tag, isa, T, U)                       \
    KERNEL(tag##_sum_##isa, T, U, ID, ID, ADD, FIN_NONE)  \
    KERNEL(tag##_prod_##isa, T, U, ID, ID, MUL, FIN_NONE) \
    KERNEL(tag##_min_##isa, T, T, ID, ID, MIN, FIN_NONE)  \
    KERNEL(tag##_max_##isa, T, T, ID, ID, MAX, FIN_NONE)

/* i64 AVG: the sum wraps like SUM (there is no wider type), then divides. */
static inline int64_t wrap_add_i64(int64_t a, int64_t b) {
    return (int64_t)((uint64_t)a + (uint64_t)b);
}

typedef void (*kernel_fn)(void *, const void *const *, int, size_t, int);

#define ROW(tag, isa) \
    { tag##_sum_##isa, tag##_prod_##isa, tag##_min_##isa, tag##_max_##isa, tag##_avg_##isa }

/* Every kernel, named *_<isa>, and their table kernels_<isa>[dtype][op]. */
#define ALL_KERNELS(isa)                                                                \
    FLOAT_KERNELS(f32, isa, float, float, ID, ID)                                       \
    FLOAT_KERNELS(f64, isa, double, double, ID, ID)                                     \
    FLOAT_KERNELS(bf16, isa, uint16_t, float, td__bf16_to_f32, td__f32_to_bf16)         \
    FLOAT_KERNELS(f16, isa, uint16_t, float, td__f16_to_f32, td__f32_to_f16)            \
    INT_KERNELS(i32, isa, int32_t, uint32_t)                                            \
    INT_KERNELS(i64, isa, int64_t, uint64_t)                                            \
    INT_KERNELS(u8, isa, uint8_t, unsigned)                                             \
    KERNEL(i32_avg_##isa, int32_t, int64_t, ID, ID, ADD, FIN_DIV)                       \
    KERNEL(u8_avg_##isa, uint8_t, int64_t, ID, ID, ADD, FIN_DIV)                        \
    KERNEL(i64_avg_##isa, int64_t, int64_t, ID, ID, wrap_add_i64, FIN_DIV)              \
    static const kernel_fn kernels_##isa[TD_DTYPE_COUNT][TD_OP_COUNT] = {               \
        [TD_F32] = ROW(f32, isa), [TD_F64] = ROW(f64, isa), [TD_BF16] = ROW(bf16, isa), \
        [TD_F16] = ROW(f16, isa), [TD_I32] = ROW(i32, isa), [TD_I64] = ROW(i64, isa),   \
        [TD_U8] = ROW(u8, isa),                                                         \
    };

ALL_KERNELS(sse2)

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
ALL_KERNELS(avx2)
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512")
ALL_KERNELS(avx512)
#pragma GCC pop_options
#endif

void td__reduce(void *dst, const void *const *src, int nsrc, size_t count, td_dtype dtype,
                td_reduce_op op, int avg_div) {
    if (count == 0 || nsrc <= 0) return;
    const kernel_fn(*kernels)[TD_OP_COUNT] = kernels_sse2;
#if defined(__x86_64__)
    td__isa isa = td__cpu_isa();
    if (isa >= TD__ISA_AVX512)
        kernels = kernels_avx512;
    else if (isa >= TD__ISA_AVX2)
        kernels = kernels_avx2;
#endif
    kernels[dtype][op](dst, src, nsrc, count, avg_div > 0 ? avg_div : 1);
}
