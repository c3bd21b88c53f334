/* Which vector instructions the library's own kernels use: the collectives' reductions, the
 * bf16/f16 conversions, attention's exponentials. Each such kernel is compiled for its
 * instruction set alone (a function named *_avx2 or *_avx512, under a target attribute) beside
 * a plain x86-64 one, and chosen here at run time, so one build runs on any x86-64 CPU and uses
 * AVX-512 where the CPU has it. TANDEM_MAX_CPU_ISA caps the choice (sse2, avx2, avx512; as
 * oneDNN's ONEDNN_MAX_CPU_ISA caps oneDNN's own, which this does not touch). */
#include <pthread.h>
#include <stdlib.h>
#include <strings.h>

#include "core/core_impl.h"

static pthread_once_t isa_once = PTHREAD_ONCE_INIT;
static td__isa isa_chosen = TD__ISA_SSE2;

static const char *const isa_names[] = {"sse2", "avx2", "avx512"};

/* What the CPU (and the kernel, which must save the wider registers) supports. */
static td__isa isa_of_cpu(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return avx512 ? TD__ISA_AVX512 : avx2 ? TD__ISA_AVX2 : TD__ISA_SSE2;
#else
    return TD__ISA_SSE2;
#endif
}

static void isa_decide(void) {
    td__isa have = isa_of_cpu(), cap = TD__ISA_AVX512;
    const char *v = getenv("TANDEM_MAX_CPU_ISA");
    if (v && *v && strcasecmp(v, "all") != 0) {
        int found = 0;
        for (int i = 0; i <= TD__ISA_AVX512; i++)
            if (strcasecmp(v, isa_names[i]) == 0) cap = (td__isa)i, found = 1;
        if (!found) {
            /* The safe side: a misspelt cap must not turn vector paths on. */
            cap = TD__ISA_SSE2;
            td__log(TD_LOG_WARN,
                    "TANDEM_MAX_CPU_ISA=%s is none of sse2, avx2, avx512, all: using sse2", v);
        }
    }
    isa_chosen = have < cap ? have : cap;
}

td__isa td__cpu_isa(void) {
    pthread_once(&isa_once, isa_decide);
    return isa_chosen;
}
