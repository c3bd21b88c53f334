/* Helpers for the multi-process tests: the GPUs a forked rank may use, a free TCP port, running a
 * function as N real ranks (td_spawn, the library's own rank runner), a world group for a rank,
 * and elements of any dtype as doubles. A child's failed CHECKs make it exit non-zero, which
 * fails the case in the parent; a child that hangs is killed at the deadline. */
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
#include "tandem/device.h"
#include "tandem/launch.h"
#include "tandem/spawn.h"

#include "test.h"

/* The visible GPUs, counted in a child so that the calling process keeps CUDA unstarted: CUDA
 * does not survive a fork, and the ranks are forked. */
static inline int test_count_gpus(void) {
    pid_t pid = fork();
    if (pid == 0) {
        int n = 0;
        td_cuda_device_count(&n);
        _exit(n > 100 ? 100 : n);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
    return WEXITSTATUS(status);
}

/* A port nothing is bound to, outside the ephemeral range (td_free_port): a test may pick it
 * here and bind it in another network namespace (an emulated host). */
static inline int test_free_port(void) {
    int port = 0;
    if (td_free_port(&port) != TD_OK) {
        fprintf(stderr, "test_free_port: %s\n", td_last_error());
        return 20000 + (int)(getpid() % 10000);
    }
    return port;
}

static inline void test_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

typedef void (*test_rank_fn)(int rank, int size, int port, void *arg);

static int test_last_port; /* MASTER_PORT of the last test_run_ranks */

typedef struct {
    test_rank_fn fn;
    void *arg;
} test_rank_job;

/* A rank of test_run_ranks: its failed CHECKs become its exit status. */
static inline int test_rank_entry(int rank, int size, void *arg) {
    const test_rank_job *job = arg;
    test_case_failed = 0;
    job->fn(rank, size, test_last_port, job->arg);
    if (test_case_failed) fprintf(stderr, "  (rank %d of %d failed)\n", rank, size);
    return test_case_failed ? 1 : 0;
}

/* Runs fn as `n` ranks forked by td_spawn (the env contract set, not pinned, not stopped when
 * one fails); returns how many exited non-zero or were still running at the deadline
 * (`expect_killed` of them may die from a signal on purpose). */
static inline int test_run_ranks(int n, test_rank_fn fn, void *arg, double deadline_s,
                                 int expect_killed) {
    test_rank_job job = {fn, arg};
    int status[64] = {0};
    td_spawn_params p = td_spawn_default_params();
    p.nprocs = n;
    p.master_port = test_last_port = test_free_port();
    p.pin = 0;
    p.timeout_s = deadline_s;
    p.grace_s = 1;
    p.stop_on_failure = 0;
    p.exit_status = status;
    td_status s = td_spawn(test_rank_entry, &job, &p);
    if (s == TD_ETIMEOUT) {
        fprintf(stderr, "%s\n", td_last_error());
        return n;
    }
    if (s != TD_OK && s != TD_EPEER) {
        fprintf(stderr, "test_run_ranks: %s\n", td_last_error());
        return n;
    }
    int bad = 0, killed = 0;
    for (int r = 0; r < n; r++) {
        if (WIFSIGNALED(status[r]))
            killed++;
        else if (WEXITSTATUS(status[r]) != 0)
            bad++;
    }
    return bad + (killed > expect_killed ? killed - expect_killed : expect_killed - killed);
}

/* Names in /dev/shm that start with "tandem-": the shm backend names none (its segments are
 * anonymous memory files), so any is a leak. */
static inline int test_shm_leftovers(void) {
    int found = 0;
    DIR *d = opendir("/dev/shm");
    if (!d) return 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strncmp(e->d_name, "tandem-", 7) == 0) {
            fprintf(stderr, "left behind: /dev/shm/%s\n", e->d_name);
            found++;
        }
    closedir(d);
    return found;
}

/* A world group for one forked rank, with everything explicit. */
static inline td_status test_comm_create(td_comm **out, int rank, int size, int port,
                                         double timeout_s) {
    td_comm_params p = td_comm_default_params();
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


/* Rank r's element i for op in the collective tests; small integers, so every sum, product and
 * average is exact in every dtype and the reduction order cannot change a bit. */
static inline double test_coll_gen(int r, size_t i, td_reduce_op op, td_dtype dt) {
    if (op == TD_OP_PROD) return (double)(1 + (i + (size_t)r) % 2);
    double v = (double)((i * 7 + (size_t)r * 13) % 51);
    if (dt != TD_U8 && (i + (size_t)r) % 3 == 0) v = -v;
    return v;
}

/* The reduction of element i over `size` ranks, rounded to dt the way the result must be. */
static inline double test_coll_reference(int size, size_t i, td_dtype dt, td_reduce_op op) {
    double acc = test_coll_gen(0, i, op, dt);
    for (int r = 1; r < size; r++) {
        double v = test_coll_gen(r, i, op, dt);
        switch (op) {
        case TD_OP_PROD:
            acc *= v;
            break;
        case TD_OP_MIN:
            acc = v < acc ? v : acc;
            break;
        case TD_OP_MAX:
            acc = v > acc ? v : acc;
            break;
        default:
            acc += v;
            break;
        }
    }
    if (op == TD_OP_AVG) {
        if (dt == TD_F32 || dt == TD_BF16 || dt == TD_F16)
            acc = (float)acc / (float)size;
        else if (dt == TD_F64)
            acc /= size;
        else
            acc = (double)((int64_t)acc / size); /* integer division truncates */
    }
    unsigned char tmp[8];
    test_elem_put(dt, tmp, 0, acc);
    return test_elem_get(dt, tmp, 0);
}

#endif
