/* Running a launcher (tandemrun, mpirun, a shell command) as a child with its stdout and
 * stderr captured in temporary files, and its exit status and wall time: what the launcher
 * tests check their outcomes on. Header-only. */
#ifndef TANDEM_TEST_RUN_UTIL_H
#define TANDEM_TEST_RUN_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    int status;  /* the launcher's exit status, or 128 + signal */
    char *out;   /* its stdout */
    char *err;   /* its stderr */
    double secs; /* wall time */
} run_result;

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline char *slurp(int fd) {
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    lseek(fd, 0, SEEK_SET);
    for (;;) {
        if (len + 1024 > cap) buf = realloc(buf, cap *= 2);
        ssize_t n = read(fd, buf + len, cap - len - 1);
        if (n <= 0) break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    close(fd);
    return buf;
}

static inline int temp_file(void) {
    char path[] = "/tmp/td_tandemrun_XXXXXX";
    int fd = mkstemp(path);
    if (fd >= 0) unlink(path);
    return fd;
}

/* Starts argv (found on PATH, as execvp finds it) with stdout/stderr going to temp files;
 * OMP_NUM_THREADS is removed from its environment so that a launcher's default shows. */
static inline pid_t start(char *const argv[], int *out_fd, int *err_fd) {
    *out_fd = temp_file();
    *err_fd = temp_file();
    pid_t pid = fork();
    if (pid == 0) {
        dup2(*out_fd, 1);
        dup2(*err_fd, 2);
        unsetenv("OMP_NUM_THREADS");
        execvp(argv[0], argv);
        _exit(126);
    }
    return pid;
}

static inline run_result finish(pid_t pid, int out_fd, int err_fd, double t0) {
    run_result r;
    int st = 0;
    waitpid(pid, &st, 0);
    r.secs = now_s() - t0;
    r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    r.out = slurp(out_fd);
    r.err = slurp(err_fd);
    return r;
}

static inline run_result run(char *const argv[]) {
    int o, e;
    double t0 = now_s();
    pid_t pid = start(argv, &o, &e);
    return finish(pid, o, e, t0);
}

static inline void release(run_result *r) {
    free(r->out);
    free(r->err);
}

/* How many times `needle` occurs in `text`. */
static inline int count_lines_with(const char *text, const char *needle) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p++) n++;
    return n;
}

#endif
