/* What the tests that drive the real programs share (examples under tandemrun): running a
 * command and keeping its output, reading a number the program printed, and comparing two
 * checkpoints of one model as a whole (N ranks against one process must land on the same
 * weights; test_checkpoint_diff.h's checkpoint_difference gives the worst single tensor).
 * Header-only; include it after test.h. */
#ifndef TANDEM_TEST_PROGRAM_H
#define TANDEM_TEST_PROGRAM_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "tandem/checkpoint.h"

#include "test.h"
#include "test_checkpoint_diff.h" /* checkpoint_difference */

static char output[1 << 16]; /* the last run's stdout and stderr */

/* Runs a shell command, keeping its output in `output`; returns its exit status. */
static inline int run(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline int run(const char *fmt, ...) {
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    strcat(cmd, " 2>&1");
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(output, 1, sizeof output - 1, p);
    output[n] = 0;
    int status = pclose(p);
    if (!WIFEXITED(status) || WEXITSTATUS(status)) fprintf(stderr, "$ %s\n%s\n", cmd, output);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

/* The number after `name` in the last run's output, or -1. */
static inline double field(const char *name) {
    const char *at = strstr(output, name);
    return at ? atof(at + strlen(name)) : -1;
}

/* ||a - b|| / ||a|| over all the f32 tensors of two checkpoints together, and in *worst the
 * largest relative difference of one tensor and its name (as checkpoint_difference). */
static inline double checkpoint_distance(const char *pa, const char *pb, double *worst,
                                         char *worst_name, size_t cap) {
    td_checkpoint *a, *b;
    CHECK_OK(td_checkpoint_open(&a, pa));
    CHECK_OK(td_checkpoint_open(&b, pb));
    double num_all = 0, den_all = 0;
    *worst = 0;
    size_t n = td_checkpoint_count(a), compared = 0;
    CHECK_EQ(n, td_checkpoint_count(b));
    for (size_t i = 0; i < n; i++) {
        td_param info;
        CHECK_OK(td_checkpoint_tensor(a, i, &info));
        if (info.dtype != TD_F32) continue;
        float *x = malloc(info.count * sizeof *x), *y = malloc(info.count * sizeof *y);
        td_param ta = info, tb = info;
        ta.data = x;
        tb.data = y;
        CHECK_OK(td_checkpoint_read(a, &ta, 1));
        CHECK_OK(td_checkpoint_read(b, &tb, 1));
        double num = 0, den = 0;
        for (size_t k = 0; k < info.count; k++) {
            num += ((double)x[k] - y[k]) * ((double)x[k] - y[k]);
            den += (double)x[k] * x[k];
        }
        double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        if (rel > *worst) {
            *worst = rel;
            snprintf(worst_name, cap, "%s", info.name);
        }
        num_all += num;
        den_all += den;
        compared++;
        free(x);
        free(y);
    }
    CHECK(compared >= 6);
    td_checkpoint_close(a);
    td_checkpoint_close(b);
    return den_all > 0 ? sqrt(num_all / den_all) : sqrt(num_all);
}

#endif
