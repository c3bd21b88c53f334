/* The test harness: CHECK macros that print file, line and both values, and a runner
 * that prints one line per case and a closing "P passed, F failed" line that
 * tests/run.sh adds up. Header-only; every tests/test_*.c includes it once. */
#ifndef TANDEM_TEST_H
#define TANDEM_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "tandem/core.h"

static int test_case_failed; /* set by a failing CHECK inside the current case */
static int test_passed, test_failed;

#define TEST_FAIL_AT(...)                                                                    \
    do {                                                                                     \
        fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                                      \
        fprintf(stderr, __VA_ARGS__);                                                        \
        fputc('\n', stderr);                                                                 \
        test_case_failed = 1;                                                                \
    } while (0)

/* Fails the case (and keeps going) when cond is false. */
#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) TEST_FAIL_AT("CHECK(%s) failed", #cond);                                \
    } while (0)

/* Integers compared as long long. */
#define CHECK_EQ(a, b)                                                                       \
    do {                                                                                     \
        long long test_a_ = (long long)(a), test_b_ = (long long)(b);                        \
        if (test_a_ != test_b_) TEST_FAIL_AT("%s == %s: %lld != %lld", #a, #b, test_a_, test_b_); \
    } while (0)

/* |a - b| <= tol, printing both. */
#define CHECK_NEAR(a, b, tol)                                                                \
    do {                                                                                     \
        double test_a_ = (double)(a), test_b_ = (double)(b);                                 \
        if (!(fabs(test_a_ - test_b_) <= (double)(tol)))                                     \
            TEST_FAIL_AT("%s ~ %s: %.9g vs %.9g (tol %g)", #a, #b, test_a_, test_b_, (double)(tol)); \
    } while (0)

/* A tandem call that must succeed; prints the status and the thread's last error. */
#define CHECK_OK(call)                                                                       \
    do {                                                                                     \
        td_status test_s_ = (call);                                                          \
        if (test_s_ != TD_OK)                                                                \
            TEST_FAIL_AT("%s -> %s: %s", #call, td_status_string(test_s_), td_last_error()); \
    } while (0)

/* A tandem call that must fail with `expected`. */
#define CHECK_STATUS(call, expected)                                                         \
    do {                                                                                     \
        td_status test_s_ = (call);                                                          \
        if (test_s_ != (expected))                                                           \
            TEST_FAIL_AT("%s -> %s, expected %s (%s)", #call, td_status_string(test_s_),     \
                         td_status_string(expected), td_last_error());                       \
    } while (0)

/* Runs one case and reports it. */
#define RUN(test_fn)                                                                         \
    do {                                                                                     \
        test_case_failed = 0;                                                                \
        test_fn();                                                                           \
        if (test_case_failed) test_failed++; else test_passed++;                             \
        printf("%s %s\n", test_case_failed ? "FAIL" : "ok  ", #test_fn);                     \
        fflush(stdout);                                                                      \
    } while (0)

/* Ends main: the closing line, and a non-zero exit when anything failed. */
#define TEST_END()                                                                           \
    do {                                                                                     \
        printf("%d passed, %d failed\n", test_passed, test_failed);                          \
        return test_failed ? 1 : 0;                                                          \
    } while (0)

#endif
