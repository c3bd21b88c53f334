/* What the tests that drive the real programs share (examples under tandemrun): running a
 * command and keeping its output, reading a number the program printed, and a Fashion-MNIST
 * directory with a short training set (short epochs); checkpoints are compared with
 * test_checkpoint_diff.h. Header-only; include it after test.h. */
#ifndef TANDEM_TEST_PROGRAM_H
#define TANDEM_TEST_PROGRAM_H

#include <dirent.h>
#include <libgen.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <zlib.h>

#include "tandem/data.h"

#include "test.h"
#include "test_checkpoint_diff.h" /* checkpoint_difference, checkpoint_distance */

static char output[1 << 16]; /* the last run's stdout and stderr */

/* Runs a shell command, keeping its output in `output`; returns its exit status. With `loud`, a
 * command that fails is shown on stderr with its output. */
static inline int run_va(int loud, const char *fmt, va_list ap) {
    char cmd[8192];
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    strcat(cmd, " 2>&1");
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(output, 1, sizeof output - 1, p);
    output[n] = 0;
    int status = pclose(p);
    if (loud && (!WIFEXITED(status) || WEXITSTATUS(status)))
        fprintf(stderr, "$ %s\n%s\n", cmd, output);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

static inline int run(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline int run(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int status = run_va(1, fmt, ap);
    va_end(ap);
    return status;
}

/* run() for a poll, which fails until what it waits for is there: a failure is not shown. */
static inline int run_quiet(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline int run_quiet(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int status = run_va(0, fmt, ap);
    va_end(ap);
    return status;
}

/* The parameter digest the last run printed last ("params_sha256 " and 64 hex digits) into hex,
 * empty when it printed none. */
static inline void printed_sha256(char hex[65]) {
    const char *at = NULL;
    for (const char *p = strstr(output, "params_sha256 "); p; p = strstr(p + 1, "params_sha256 "))
        at = p;
    hex[0] = 0;
    if (at) snprintf(hex, 65, "%.64s", at + 14);
}

/* The live processes whose parent is `pid`, up to max; returns how many. */
static inline int children_of(pid_t pid, pid_t *kids, int max) {
    DIR *d = opendir("/proc");
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) && n < max) {
        int child = atoi(e->d_name);
        if (child <= 0) continue;
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%d/stat", child);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t len = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[len] = 0;
        const char *close_paren = strrchr(buf, ')');
        int ppid = 0;
        char state = 0;
        if (close_paren && sscanf(close_paren + 2, "%c %d", &state, &ppid) == 2 && ppid == pid &&
            state != 'Z') /* a rank that already ended cannot be killed any more */
            kids[n++] = child;
    }
    if (d) closedir(d);
    return n;
}

/* 40 KB of English into `path` (enough windows of 33 bytes for any rank's batch of the GPT
 * tests); returns 0, or -1 when it cannot be written. */
static inline int write_english_text(const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    for (int i = 0; i < 400; i++)
        fprintf(f,
                "It is a truth universally acknowledged, that a single man in possession of a "
                "good fortune, must be in want of a wife. (%d)\n",
                i);
    return fclose(f);
}

/* The start of a test of examples/<name> at argv0 (BUILD/tests/x): the example's and tandemrun's
 * paths (BUILD/examples/<name>, BUILD/bin/tandemrun), a new directory /tmp/tandem-<tag>-XXXXXX
 * in dir and, unless text is NULL, 40 KB of English in dir/text.txt named in text; returns 0,
 * or -1 when one cannot be found or made. */
static inline int program_test_start(const char *argv0, const char *name, const char *tag,
                                     char example[PATH_MAX], char launcher[PATH_MAX], char dir[64],
                                     char text[128]) {
    char self[PATH_MAX];
    if (!realpath(argv0, self)) return -1;
    char *bin = dirname(dirname(self)); /* BUILD/tests/x -> BUILD */
    snprintf(example, PATH_MAX, "%s/examples/%s", bin, name);
    snprintf(launcher, PATH_MAX, "%s/bin/tandemrun", bin);
    snprintf(dir, 64, "/tmp/tandem-%s-XXXXXX", tag);
    if (!mkdtemp(dir)) return -1;
    if (!text) return 0;
    snprintf(text, 128, "%s/text.txt", dir);
    return write_english_text(text);
}

/* The number after `name` in the last run's output, or -1. */
static inline double field(const char *name) {
    const char *at = strstr(output, name);
    return at ? atof(at + strlen(name)) : -1;
}

/* Writes the first `n` of an IDX file's samples (dims[0] cut to n) to path, gzip-compressed as
 * the dataset's own files are; 0 on success. */
static inline int write_idx_head(const char *path, const td_idx *idx, size_t n) {
    unsigned char h[4 + 4 * TD_MAX_DIMS] = {0, 0, 0x08, (unsigned char)idx->ndim};
    size_t sample = idx->count / (size_t)idx->dims[0], bytes = n * sample;
    for (int i = 0; i < idx->ndim; i++)
        for (int k = 0; k < 4; k++)
            h[4 + 4 * i + k] = (unsigned char)((i ? (uint64_t)idx->dims[i] : n) >> (24 - 8 * k));
    gzFile f = gzopen(path, "wb");
    if (!f) return -1;
    int head = 4 + 4 * idx->ndim;
    int ok = idx->dtype == TD_U8 && gzwrite(f, h, (unsigned)head) == head &&
             gzwrite(f, idx->data, (unsigned)bytes) == (int)bytes;
    return gzclose(f) == Z_OK && ok ? 0 : -1;
}

/* Makes `dir` a Fashion-MNIST directory (for --data) whose training set is the first n images
 * of the real one and whose test set is the real one (linked): epochs of a few steps, for tests
 * of what happens across them. Fails the case and returns -1 when it cannot. */
static inline int fashion_mnist_subset(const char *dir, size_t n) {
    const char *real = getenv("TD_FASHION_MNIST_DIR");
    if (!real || !*real) real = "/usr/share/datasets/fashion-mnist";
    char from[4096], abs[4096], to[4096];
    int rc = mkdir(dir, 0700);
    static const char *const kinds[2] = {"images-idx3", "labels-idx1"};
    for (int k = 0; k < 2 && rc == 0; k++) {
        td_idx idx;
        snprintf(from, sizeof from, "%s/train-%s-ubyte.gz", real, kinds[k]);
        snprintf(to, sizeof to, "%s/train-%s-ubyte.gz", dir, kinds[k]);
        rc = td_idx_read(from, &idx) == TD_OK && (size_t)idx.dims[0] >= n ? 0 : -1;
        if (rc == 0) rc = write_idx_head(to, &idx, n);
        td_idx_free(&idx);
        snprintf(from, sizeof from, "%s/t10k-%s-ubyte.gz", real, kinds[k]);
        snprintf(to, sizeof to, "%s/t10k-%s-ubyte.gz", dir, kinds[k]);
        if (rc == 0) rc = realpath(from, abs) ? symlink(abs, to) : -1;
    }
    if (rc != 0) TEST_FAIL_AT("cannot make a Fashion-MNIST subset of %zu in %s", n, dir);
    return rc;
}

#endif
