/* The test harness: CHECK macros that print file, line and both values, a runner that
 * prints one line per case and a closing "P passed, F failed" line that tests/run.sh adds
 * up, and the few file helpers several tests share (source paths, a temporary directory,
 * whole-file reads and writes). Header-only; every tests/test_*.c includes it once. */
#ifndef TANDEM_TEST_H
#define TANDEM_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/core.h"

static int test_case_failed;  /* set by a failing CHECK inside the current case */
static int test_case_skipped; /* set by SKIP inside the current case */
static int test_passed, test_failed, test_skipped;

/* Ends the current case as skipped, with one line saying why ("no CUDA device"): a case that
 * needs what this machine lacks is counted as skipped, never as passed. Use as `SKIP(...);
 * return;`. */
#define SKIP(...)              \
    do {                       \
        printf("skipped: ");   \
        printf(__VA_ARGS__);   \
        putchar('\n');         \
        test_case_skipped = 1; \
    } while (0)

#define TEST_FAIL_AT(...)                               \
    do {                                                \
        fprintf(stderr, "%s:%d: ", __FILE__, __LINE__); \
        fprintf(stderr, __VA_ARGS__);                   \
        fputc('\n', stderr);                            \
        test_case_failed = 1;                           \
    } while (0)

/* Fails the case (and keeps going) when cond is false. */
#define CHECK(cond)                                           \
    do {                                                      \
        if (!(cond)) TEST_FAIL_AT("CHECK(%s) failed", #cond); \
    } while (0)

/* Integers compared as long long. */
#define CHECK_EQ(a, b)                                                                            \
    do {                                                                                          \
        long long test_a_ = (long long)(a), test_b_ = (long long)(b);                             \
        if (test_a_ != test_b_) TEST_FAIL_AT("%s == %s: %lld != %lld", #a, #b, test_a_, test_b_); \
    } while (0)

/* |a - b| <= tol, printing both. */
#define CHECK_NEAR(a, b, tol)                                                        \
    do {                                                                             \
        double test_a_ = (double)(a), test_b_ = (double)(b);                         \
        if (!(fabs(test_a_ - test_b_) <= (double)(tol)))                             \
            TEST_FAIL_AT("%s ~ %s: %.9g vs %.9g (tol %g)", #a, #b, test_a_, test_b_, \
                         (double)(tol));                                             \
    } while (0)

/* A tandem call that must succeed; prints the status and the thread's last error. */
#define CHECK_OK(call)                                                                       \
    do {                                                                                     \
        td_status test_s_ = (call);                                                          \
        if (test_s_ != TD_OK)                                                                \
            TEST_FAIL_AT("%s -> %s: %s", #call, td_status_string(test_s_), td_last_error()); \
    } while (0)

/* A tandem call that must fail with `expected`. */
#define CHECK_STATUS(call, expected)                                                     \
    do {                                                                                 \
        td_status test_s_ = (call);                                                      \
        if (test_s_ != (expected))                                                       \
            TEST_FAIL_AT("%s -> %s, expected %s (%s)", #call, td_status_string(test_s_), \
                         td_status_string(expected), td_last_error());                   \
    } while (0)

/* Runs one case and reports it. */
#define RUN(test_fn)                              \
    do {                                          \
        test_case_failed = test_case_skipped = 0; \
        test_fn();                                \
        if (test_case_failed)                     \
            test_failed++;                        \
        else if (test_case_skipped)               \
            test_skipped++;                       \
        else                                      \
            test_passed++;                        \
        printf("%s %s\n",                         \
               test_case_failed    ? "FAIL"       \
               : test_case_skipped ? "skip"       \
                                   : "ok  ",      \
               #test_fn);                         \
        fflush(stdout);                           \
    } while (0)

/* Ends main: the closing line, and a non-zero exit when anything failed. */
#define TEST_END()                                                                                \
    do {                                                                                          \
        if (test_skipped)                                                                         \
            printf("%d passed, %d failed, %d skipped\n", test_passed, test_failed, test_skipped); \
        else                                                                                      \
            printf("%d passed, %d failed\n", test_passed, test_failed);                           \
        return test_failed ? 1 : 0;                                                               \
    } while (0)

/* A path below the repository root, as given when it is readable from the current directory
 * (tests run from the root), else found from this executable (BUILD/tests/test_x). The
 * result may live in a static buffer that the next call overwrites. */
static inline const char *test_source_path(const char *rel) {
    static char buf[4096];
    if (access(rel, R_OK) == 0) return rel;
    ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n <= 0) return rel;
    buf[n] = '\0';
    for (int up = 0; up < 3; up++) {
        char *slash = strrchr(buf, '/');
        if (!slash) return rel;
        *slash = '\0';
    }
    size_t len = strlen(buf);
    snprintf(buf + len, sizeof buf - len, "/%s", rel);
    return access(buf, R_OK) == 0 ? buf : rel;
}

/* Makes a fresh /tmp/td_test_<name>_XXXXXX into dir (cap bytes); exits the test program
 * when it cannot, since no case could run without it. */
static inline void test_temp_dir(char *dir, size_t cap, const char *name) {
    snprintf(dir, cap, "/tmp/td_test_%s_XXXXXX", name);
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        exit(1);
    }
}

/* Removes a directory made by test_temp_dir and everything in it. */
static inline void test_remove_dir(const char *dir) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

/* Writes len bytes to path, failing the case when it cannot. */
static inline void test_write_file(const char *path, const void *data, size_t len) {
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (!f) return;
    CHECK_EQ(fwrite(data, 1, len, f), len);
    fclose(f);
}

/* The bytes of a whole file (malloc'd, the caller frees) with a NUL after them, so a text file
 * reads as a string, or NULL when it cannot be read. */
static inline unsigned char *test_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    *len = 0;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = n >= 0 ? (unsigned char *)malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        *len = (size_t)n;
    }
    return buf;
}

#endif
