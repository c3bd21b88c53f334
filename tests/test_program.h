/* What the tests that drive the real programs share (examples under tandemrun): running a
 * command and keeping its output, and reading a number the program printed; checkpoints are
 * compared with test_checkpoint_diff.h. Header-only; include it after test.h. */
#ifndef TANDEM_TEST_PROGRAM_H
#define TANDEM_TEST_PROGRAM_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "test.h"
#include "test_checkpoint_diff.h" /* checkpoint_difference, checkpoint_distance */

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

#endif
