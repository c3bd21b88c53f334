/* What the tests of CUDA kernels under the CPU's emulation (src/device/cuda/emulate.cuh) share:
 * each case in a child process, so that a kernel the emulation stops fails its case only; data
 * in guarded buffers; comparisons against the CPU's results. C++, for tests/test_*.cc. */
#ifndef TANDEM_TEST_EMULATED_H
#define TANDEM_TEST_EMULATED_H

#include <string>
#include <sys/wait.h>
#include <type_traits>
#include <vector>

#include "device/cuda/dtype.cuh"

extern "C" {
#include "core/core_impl.h"
}
#include "test.h"

/* ---- running cases ---- */

/* Runs fn in a child; the child's exit says whether the case passed. */
static inline void run_isolated(const char *name, void (*fn)(void)) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        test_case_failed = test_case_skipped = 0;
        fn();
        fflush(stdout);
        _exit(test_case_failed ? 1 : test_case_skipped ? 2 : 0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 2) {
        test_skipped++;
        printf("skip %s\n", name);
        return;
    }
    int ok = pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && WIFEXITED(status) && WEXITSTATUS(status) == 3)
        fprintf(stderr, "%s: stopped by the emulation (above)\n", name);
    else if (!ok && WIFSIGNALED(status))
        fprintf(stderr, "%s: killed by signal %d\n", name, WTERMSIG(status));
    if (ok)
        test_passed++;
    else
        test_failed++;
    printf("%s %s\n", ok ? "ok  " : "FAIL", name);
    fflush(stdout);
}

#define RUN_ISOLATED(fn) run_isolated(#fn, fn)

/* ---- data ---- */

static td_rng rng; /* every case draws from it, seeded by main */

/* n floats uniform in [lo, hi) in a guarded buffer. */
static inline float *uniform(size_t n, const char *name, float lo = -1.f, float hi = 1.f) {
    float *p = td__emu::alloc<float>(n, name);
    td_rng_fill_uniform(&rng, p, n, lo, hi);
    return p;
}

/* The largest |a - b| / (1 + |b|) over n elements; NaN anywhere counts as infinite. */
static inline double max_rel(const float *a, const float *b, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]) / (1 + fabs((double)b[i]));
        if (!(d <= worst)) worst = std::isnan(d) ? INFINITY : d;
    }
    return worst;
}

/* The float dtype of T, and what comparing T against f32 arithmetic tolerates. */
template <typename T> static td_dtype dtype_of() {
    return std::is_same<T, float>::value           ? TD_F32
           : std::is_same<T, __nv_bfloat16>::value ? TD_BF16
                                                   : TD_F16;
}
template <typename T> static double tol_of() {
    return std::is_same<T, float>::value           ? 1e-5
           : std::is_same<T, __nv_bfloat16>::value ? 2e-2
                                                   : 4e-3;
}

/* n values in a guarded buffer of T (rounded from v), and back as f32; v rounded in place to
 * what T holds, so that the reference sees the kernel's inputs. */
template <typename T> static T *to_device(std::vector<float> &v, const char *name) {
    T *p = td__emu::alloc<T>(v.size(), name);
    for (size_t i = 0; i < v.size(); i++) {
        td_st(p, i, v[i]);
        v[i] = td_ld(p, i);
    }
    return p;
}
template <typename T> static std::vector<float> to_host(const T *p, size_t n) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) v[i] = td_ld(p, i);
    return v;
}

/* n uniform values in [lo, hi). */
static inline std::vector<float> values(size_t n, float lo = -1.f, float hi = 1.f) {
    std::vector<float> v(n);
    td_rng_fill_uniform(&rng, v.data(), n, lo, hi);
    return v;
}

#define CHECK_CLOSE(a, b, n, tol)                                                                 \
    do {                                                                                          \
        double test_d_ = max_rel(a, b, n);                                                        \
        if (!(test_d_ <= (tol)))                                                                  \
            TEST_FAIL_AT("%s vs %s over %zu elements: off by %.3g (tol %g)", #a, #b, (size_t)(n), \
                         test_d_, (double)(tol));                                                 \
    } while (0)

#endif
