/* Helpers for the multi-process comm and store tests: a free TCP port, running a function
 * as N real ranks in forked children, and elements of any dtype as doubles. A child's failed
 * CHECKs make it exit non-zero, which fails the case in the parent; a child that hangs is
 * killed at the deadline. */
#ifndef TANDEM_TEST_COMM_UTIL_H
#define TANDEM_TEST_COMM_UTIL_H

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tandem/comm.h"

#include "test.h"

/* A port the kernel just handed out and took back; good enough for one test. */
static inline int test_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        if (fd >= 0) close(fd);
        return 20000 + (int)(getpid() % 40000);
    }
    close(fd);
    return ntohs(a.sin_port);
}

static inline void test_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

typedef void (*test_rank_fn)(int rank, int size, int port, void *arg);

static pid_t test_last_pids[16];
static int test_last_port;

/* Runs fn as `n` forked ranks; returns how many exited non-zero or were killed at the
 * deadline (`expect_killed` of them may die from a signal on purpose). */
static inline int test_run_ranks(int n, test_rank_fn fn, void *arg, double deadline_s,
                                 int expect_killed) {
    int port = test_free_port();
    test_last_port = port;
    fflush(stdout);
    fflush(stderr);
    pid_t pids[16];
    for (int r = 0; r < n; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            test_case_failed = 0;
            fn(r, n, port, arg);
            fflush(stdout);
            fflush(stderr);
            _exit(test_case_failed ? 1 : 0);
        }
        test_last_pids[r] = pids[r];
    }
    int bad = 0, killed = 0, left = n;
    uint64_t end = td_time_ns() + (uint64_t)(deadline_s * 1e9);
    while (left > 0) {
        int st;
        pid_t p = waitpid(-1, &st, WNOHANG);
        if (p > 0) {
            left--;
            if (WIFSIGNALED(st))
                killed++;
            else if (WEXITSTATUS(st) != 0)
                bad++;
            continue;
        }
        if (td_time_ns() > end) {
            fprintf(stderr, "ranks still running after %.0f s: killing them\n", deadline_s);
            for (int r = 0; r < n; r++) kill(pids[r], SIGKILL);
            while (left > 0 && waitpid(-1, &st, 0) > 0) left--;
            return bad + n;
        }
        test_sleep_ms(2);
    }
    if (killed != expect_killed)
        bad += killed > expect_killed ? killed - expect_killed : expect_killed - killed;
    return bad;
}

/* Names in /dev/shm that start with "tandem-" and mention one of the last ranks' pids or the
 * port (segments this test created and failed to unlink). */
static inline int test_shm_leftovers(int n, int port) {
    int found = 0;
    DIR *d = opendir("/dev/shm");
    if (!d) return 0;
    struct dirent *e;
    char pat[32];
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, "tandem-", 7) != 0) continue;
        snprintf(pat, sizeof pat, "tandem-%d-", port);
        int mine = port && strncmp(e->d_name, pat, strlen(pat)) == 0;
        for (int r = 0; r < n && !mine; r++) {
            snprintf(pat, sizeof pat, "-%d-", (int)test_last_pids[r]);
            mine = strstr(e->d_name, pat) != NULL;
        }
        if (mine) {
            fprintf(stderr, "left behind: /dev/shm/%s\n", e->d_name);
            found++;
        }
    }
    closedir(d);
    return found;
}

/* A world group for one forked rank, with everything explicit. */
static inline td_status test_comm_create(td_comm **out, int rank, int size, int port,
                                         double timeout_s) {
    td_comm_params p;
    td_comm_default_params(&p);
    p.backend = TD_BACKEND_SHM;
    p.rank = rank;
    p.world_size = size;
    p.local_rank = rank;
    p.local_world_size = size;
    p.master_addr = "127.0.0.1";
    p.master_port = port;
    p.token = "test-token";
    p.timeout_s = timeout_s;
    return td_comm_create(out, &p);
}

/* Stores v as element i of a td_dtype buffer; integers go through int64, so u8 wraps. */
static inline void test_elem_put(td_dtype t, void *buf, size_t i, double v) {
    switch (t) {
    case TD_F32:
        ((float *)buf)[i] = (float)v;
        break;
    case TD_F64:
        ((double *)buf)[i] = v;
        break;
    case TD_BF16:
        ((uint16_t *)buf)[i] = td_f32_to_bf16((float)v);
        break;
    case TD_F16:
        ((uint16_t *)buf)[i] = td_f32_to_f16((float)v);
        break;
    case TD_I32:
        ((int32_t *)buf)[i] = (int32_t)(int64_t)v;
        break;
    case TD_I64:
        ((int64_t *)buf)[i] = (int64_t)v;
        break;
    case TD_U8:
        ((uint8_t *)buf)[i] = (uint8_t)(int64_t)v;
        break;
    default:
        break;
    }
}

/* Element i of a td_dtype buffer as a double. */
static inline double test_elem_get(td_dtype t, const void *buf, size_t i) {
    switch (t) {
    case TD_F32:
        return ((const float *)buf)[i];
    case TD_F64:
        return ((const double *)buf)[i];
    case TD_BF16:
        return td_bf16_to_f32(((const uint16_t *)buf)[i]);
    case TD_F16:
        return td_f16_to_f32(((const uint16_t *)buf)[i]);
    case TD_I32:
        return ((const int32_t *)buf)[i];
    case TD_I64:
        return (double)((const int64_t *)buf)[i];
    case TD_U8:
        return ((const uint8_t *)buf)[i];
    default:
        return 0;
    }
}

#endif
