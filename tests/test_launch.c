/* The launcher's pieces (tandem/launch.h) on real processes: a job of forked children stops
 * the others when one fails (SIGTERM, then SIGKILL after the grace period for one that ignores
 * it) and names the first failure; a stopped rank is named; the allowed cores are split
 * among the local ranks; the env contract is set; a port picked for the store lies outside the
 * kernel's ephemeral range, so that no connection, in this network namespace or another one,
 * can take it before it is bound. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tandem/launch.h"

#include "test.h"
#include "test_comm_util.h"
#include "test_run_util.h"

/* The kernel's ephemeral port range. */
static void ephemeral_range(int *lo, int *hi) {
    *lo = 32768, *hi = 60999;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f) {
        if (fscanf(f, "%d %d", lo, hi) != 2) *lo = 32768, *hi = 60999;
        fclose(f);
    }
}

static int bindable(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    int ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    if (fd >= 0) close(fd);
    return ok;
}

/* Every port the tests and the launchers pick: test_free_port is td_free_port. */
static void free_port_is_outside_the_ephemeral_range(void) {
    int lo, hi;
    ephemeral_range(&lo, &hi);
    if (lo <= 20000 && hi >= 65535) {
        SKIP("the ephemeral range %d-%d leaves no port to pick outside it", lo, hi);
        return;
    }
    for (int i = 0; i < 200 && !test_case_failed; i++) {
        int port = test_free_port();
        if (port >= lo && port <= hi)
            TEST_FAIL_AT("port %d is in the ephemeral range %d-%d", port, lo, hi);
        CHECK(port >= 20000 && port <= 65535);
        CHECK(bindable(port));
    }
}

static pid_t child(int exit_after_ms, int ignore_term) {
    pid_t pid = fork();
    if (pid == 0) {
        if (ignore_term) signal(SIGTERM, SIG_IGN);
        if (exit_after_ms >= 0) {
            test_sleep_ms(exit_after_ms);
            _exit(3);
        }
        for (;;) pause();
    }
    return pid;
}

/* Runs the job to its end the way a launcher does; returns the seconds it took. */
static double supervise(td_job *job) {
    double t0 = now_s();
    while (td_job_running(job) > 0 && now_s() - t0 < 30) {
        td_job_reap(job);
        td_job_tick(job);
        test_sleep_ms(5);
    }
    return now_s() - t0;
}

static void first_failure_stops_the_others(void) {
    td_job_params p = td_job_default_params();
    p.grace_s = 0.3;
    td_job *job = NULL;
    CHECK_OK(td_job_create(&job, &p));
    if (!job) return;
    CHECK_OK(td_job_add(job, 10, child(-1, 0)));  /* stops on SIGTERM */
    CHECK_OK(td_job_add(job, 11, child(100, 0))); /* fails: exit 3 */
    CHECK_OK(td_job_add(job, 12, child(-1, 1)));  /* ignores SIGTERM: SIGKILL after the grace */
    CHECK_EQ(td_job_running(job), 3);
    double secs = supervise(job);
    CHECK_EQ(td_job_running(job), 0);
    CHECK_EQ(td_job_first_failure(job), 1);
    CHECK_EQ(td_job_exit_code(job), 3);
    td_job_proc f = td_job_get(job, 1), a = td_job_get(job, 0), b = td_job_get(job, 2);
    CHECK_EQ(f.rank, 11);
    char how[96];
    td_exit_describe(f.status, how, sizeof how);
    CHECK(strcmp(how, "exited with status 3") == 0);
    CHECK(WIFSIGNALED(a.status) && WTERMSIG(a.status) == SIGTERM);
    CHECK(WIFSIGNALED(b.status) && WTERMSIG(b.status) == SIGKILL);
    td_exit_describe(b.status, how, sizeof how);
    CHECK(strcmp(how, "was killed by signal 9 (SIGKILL)") == 0);
    CHECK_EQ(td_exit_code(b.status), 128 + SIGKILL);
    CHECK(secs >= 0.3 && secs < 10);
    td_job_destroy(job);
}

/* A rank that is stopped is named; td_job_stop ends it all, with the exit code given. */
static void stopped_rank_is_named(void) {
    td_job *job = NULL;
    CHECK_OK(td_job_create(&job, NULL));
    if (!job) return;
    pid_t stopped = fork();
    if (stopped == 0) {
        raise(SIGSTOP);
        _exit(0);
    }
    CHECK_OK(td_job_add(job, 0, child(-1, 0)));
    CHECK_OK(td_job_add(job, 1, stopped));
    char names[128] = "", want[64];
    int n = 0;
    for (int i = 0; i < 2000 && n == 0; i++) {
        n = td_job_stopped_ranks(job, names, sizeof names);
        if (n == 0) test_sleep_ms(1);
    }
    snprintf(want, sizeof want, "rank 1 (pid %d)", (int)stopped);
    CHECK_EQ(n, 1);
    CHECK(strcmp(names, want) == 0);
    td_job_stop(job, SIGKILL, 124);
    CHECK(td_job_stopping(job));
    supervise(job);
    CHECK_EQ(td_job_running(job), 0);
    CHECK_EQ(td_job_exit_code(job), 124);
    CHECK_EQ(td_job_first_failure(job), -1); /* stopped by the launcher: no rank failed first */
    td_job_destroy(job);
}

static void rank_cpus_split_the_allowed_cores(void) {
    cpu_set_t allowed;
    CHECK(sched_getaffinity(0, sizeof allowed, &allowed) == 0);
    int ncpus = CPU_COUNT(&allowed);
    for (int nlocal = 1; nlocal <= 2 * ncpus + 1; nlocal++) {
        cpu_set_t seen;
        CPU_ZERO(&seen);
        int total = 0;
        for (int r = 0; r < nlocal; r++) {
            int cpus[CPU_SETSIZE];
            int n = td_rank_cpus(r, nlocal, cpus, CPU_SETSIZE);
            CHECK(n >= 1);
            if (nlocal > ncpus) CHECK_EQ(n, 1);
            for (int k = 0; k < n; k++) {
                CHECK(CPU_ISSET(cpus[k], &allowed));
                if (nlocal <= ncpus) CHECK(!CPU_ISSET(cpus[k], &seen)); /* disjoint */
                CPU_SET(cpus[k], &seen);
            }
            total += n;
        }
        CHECK_EQ(CPU_COUNT(&seen), ncpus); /* every core used */
        CHECK_EQ(total, nlocal <= ncpus ? ncpus : nlocal);
    }
    int cpus[4];
    CHECK_EQ(td_rank_cpus(2, 2, cpus, 4), 0);
    CHECK_EQ(td_rank_cpus(-1, 2, cpus, 4), 0);
}

static void rank_env_is_the_contract(void) {
    pid_t pid = fork();
    if (pid == 0) {
        unsetenv("OMP_NUM_THREADS");
        td_rank_env e = {5, 8, 1, 4, 1, "10.0.0.1", 29511, "tok"};
        if (td_rank_env_apply(&e, 3) != TD_OK) _exit(2);
        const char *want[][2] = {{"RANK", "5"},
                                 {"WORLD_SIZE", "8"},
                                 {"LOCAL_RANK", "1"},
                                 {"LOCAL_WORLD_SIZE", "4"},
                                 {"GROUP_RANK", "1"},
                                 {"NODE_RANK", "1"},
                                 {"MASTER_ADDR", "10.0.0.1"},
                                 {"MASTER_PORT", "29511"},
                                 {"TANDEM_TOKEN", "tok"},
                                 {"OMP_NUM_THREADS", "3"}};
        for (size_t k = 0; k < sizeof want / sizeof *want; k++) {
            const char *v = getenv(want[k][0]);
            if (!v || strcmp(v, want[k][1]) != 0) {
                fprintf(stderr, "%s is '%s', expected '%s'\n", want[k][0], v ? v : "(unset)",
                        want[k][1]);
                _exit(1);
            }
        }
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    char token[TD_JOB_TOKEN_LEN + 1], other[TD_JOB_TOKEN_LEN + 1];
    CHECK_OK(td_job_token(token));
    CHECK_OK(td_job_token(other));
    CHECK_EQ(strlen(token), TD_JOB_TOKEN_LEN);
    CHECK(strspn(token, "0123456789abcdef") == TD_JOB_TOKEN_LEN);
    CHECK(strcmp(token, other) != 0);
}

static void bad_arguments_are_refused(void) {
    td_job_params p = td_job_default_params();
    p.grace_s = 0;
    td_job *job = NULL;
    CHECK_STATUS(td_job_create(&job, &p), TD_EINVAL);
    CHECK(strstr(td_last_error(), "grace_s") != NULL);
    CHECK_OK(td_job_create(&job, NULL));
    CHECK_STATUS(td_job_add(job, 0, 0), TD_EINVAL);
    CHECK_EQ(td_job_running(job), 0);
    CHECK_EQ(td_job_get(job, 0).rank, -1);
    CHECK(td_job_tick(job) < 0);
    td_job_destroy(job);
}

int main(void) {
    RUN(free_port_is_outside_the_ephemeral_range);
    RUN(first_failure_stops_the_others);
    RUN(stopped_rank_is_named);
    RUN(rank_cpus_split_the_allowed_cores);
    RUN(rank_env_is_the_contract);
    RUN(bad_arguments_are_refused);
    TEST_END();
}
