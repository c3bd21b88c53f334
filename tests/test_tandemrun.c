/* The launcher, end to end: runs tandemrun (found on PATH; tests/run.sh puts build/bin
 * there) on small sh scripts and checks the env contract of every rank, the output
 * prefixes, --devices, exit statuses of failing and killed ranks, that no rank outlives
 * a failed job, signal forwarding, torchrun's spellings and usage errors, that ranks
 * started by it form a tandem process group from the env contract alone, and restarts after a
 * failure (--max-restarts, at the same or another world size, never after an interruption). */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tandem/comm.h"

#include "test.h"
#include "test_run_util.h"

/* Every "PID <n>" in text names a process that must no longer exist. */
static void check_pids_gone(const char *text, int expected) {
    int seen = 0;
    for (const char *p = text; (p = strstr(p, "PID ")); p += 4) {
        int pid = atoi(p + 4);
        CHECK(pid > 1);
        if (pid <= 1) continue;
        seen++;
        errno = 0;
        int alive = kill(pid, 0) == 0;
        if (alive)
            TEST_FAIL_AT("rank process %d is still alive", pid);
        else
            CHECK_EQ(errno, ESRCH);
    }
    CHECK_EQ(seen, expected);
}

static const char env_script[] =
    "echo \"ENV $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT "
    "$TANDEM_TOKEN $OMP_NUM_THREADS ${CUDA_VISIBLE_DEVICES:-none}\"; echo \"ERR $RANK\" >&2";

typedef struct {
    int rank, world, local_rank, local_world, port, omp;
    char addr[64], token[128], cuda[32];
} rank_env;

/* Parses the "[rank K] ENV ..." lines; returns how many ranks were seen (each once). */
static int parse_env(const char *out, rank_env *envs, int max) {
    int seen = 0;
    for (int k = 0; k < max; k++) envs[k].rank = -1;
    for (const char *p = out; (p = strstr(p, "[rank ")); p++) {
        int k;
        rank_env e;
        if (sscanf(p, "[rank %d] ENV %d %d %d %d %63s %d %127s %d %31s", &k, &e.rank, &e.world,
                   &e.local_rank, &e.local_world, e.addr, &e.port, e.token, &e.omp, e.cuda) != 10)
            continue;
        if (k < 0 || k >= max || envs[k].rank != -1) {
            TEST_FAIL_AT("unexpected or repeated line for rank %d", k);
            continue;
        }
        envs[k] = e;
        seen++;
    }
    return seen;
}

static void env_contract_for_every_rank(void) {
    char *argv[] = {"tandemrun", "--nproc-per-node", "4", "sh", "-c", (char *)env_script, NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 0);
    rank_env e[4];
    CHECK_EQ(parse_env(r.out, e, 4), 4);
    for (int k = 0; k < 4; k++) {
        CHECK_EQ(e[k].rank, k);
        CHECK_EQ(e[k].world, 4);
        CHECK_EQ(e[k].local_rank, k);
        CHECK_EQ(e[k].local_world, 4);
        CHECK(strcmp(e[k].addr, "127.0.0.1") == 0);
        CHECK(e[k].port > 0 && e[k].port < 65536);
        CHECK_EQ(e[k].port, e[0].port);
        CHECK_EQ(strlen(e[k].token), 32);
        CHECK(strspn(e[k].token, "0123456789abcdef") == 32);
        CHECK(strcmp(e[k].token, e[0].token) == 0);
        CHECK(e[k].omp >= 1);
        CHECK(strcmp(e[k].cuda, "none") == 0);
    }
    /* stderr is relayed to stderr, prefixed, and not to stdout */
    for (int k = 0; k < 4; k++) {
        char line[64];
        snprintf(line, sizeof line, "[rank %d] ERR %d\n", k, k);
        CHECK(strstr(r.err, line) != NULL);
    }
    CHECK(strstr(r.out, "ERR") == NULL);
    /* every output line carries a prefix */
    for (const char *p = r.out; *p; p = strchr(p, '\n') + 1) {
        CHECK(strncmp(p, "[rank ", 6) == 0);
        if (!strchr(p, '\n')) break;
    }
    /* a second job gets a different token */
    run_result r2 = run(argv);
    rank_env e2[4];
    CHECK_EQ(parse_env(r2.out, e2, 4), 4);
    CHECK(strcmp(e2[0].token, e[0].token) != 0);
    release(&r);
    release(&r2);
}

static void ranks_get_disjoint_cores(void) {
    cpu_set_t set;
    CHECK_EQ(sched_getaffinity(0, sizeof set, &set), 0);
    int ncpus = CPU_COUNT(&set);
    int nproc = ncpus >= 2 ? 2 : 1;
    char n[8];
    snprintf(n, sizeof n, "%d", nproc);
    char *argv[] = {
        "tandemrun",
        "--nproc-per-node",
        n,
        "sh",
        "-c",
        "echo \"CPUS $(grep Cpus_allowed_list /proc/self/status | cut -f2) $OMP_NUM_THREADS\"",
        NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 0);
    char cpus[2][64] = {"", ""};
    int omp[2] = {0, 0};
    for (int k = 0; k < nproc; k++) {
        char head[32];
        snprintf(head, sizeof head, "[rank %d] CPUS ", k);
        const char *p = strstr(r.out, head);
        CHECK(p != NULL);
        if (p) CHECK_EQ(sscanf(p + strlen(head), "%63s %d", cpus[k], &omp[k]), 2);
    }
    if (nproc == 2) {
        CHECK(strcmp(cpus[0], cpus[1]) != 0); /* the halves of the allowed cores */
        CHECK_EQ(omp[0] + omp[1], ncpus);
    }
    release(&r);
}

static void torchrun_spellings_and_explicit_master(void) {
    char *argv[] = {"tandemrun",
                    "--standalone",
                    "--nproc_per_node=2",
                    "--master_port",
                    "29555",
                    "--master-addr=10.1.2.3",
                    "--nnodes=1",
                    "sh",
                    "-c",
                    (char *)env_script,
                    NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 0);
    rank_env e[2];
    CHECK_EQ(parse_env(r.out, e, 2), 2);
    for (int k = 0; k < 2; k++) {
        CHECK_EQ(e[k].port, 29555);
        CHECK(strcmp(e[k].addr, "10.1.2.3") == 0);
        CHECK_EQ(e[k].world, 2);
    }
    release(&r);
}

static void devices_map_to_cuda_visible_devices(void) {
    char *argv[] = {"tandemrun", "--devices", "0,1,3", "sh", "-c", (char *)env_script, NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 0);
    rank_env e[3];
    CHECK_EQ(parse_env(r.out, e, 3), 3);
    const char *want[3] = {"0", "1", "3"};
    for (int k = 0; k < 3; k++) {
        CHECK_EQ(e[k].local_rank, k);
        CHECK_EQ(e[k].world, 3);
        CHECK(strcmp(e[k].cuda, want[k]) == 0);
    }
    release(&r);
    char *bad[] = {"tandemrun", "--nproc-per-node", "2", "--devices", "0,1,3", "true", NULL};
    r = run(bad);
    CHECK_EQ(r.status, 2);
    CHECK(strstr(r.err, "--devices") != NULL);
    release(&r);
}

static void no_prefix_passes_lines_through(void) {
    char *argv[] = {"tandemrun", "--no-prefix", "--nproc-per-node", "2",
                    "sh",        "-c",          "echo plain",       NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 0);
    CHECK(strcmp(r.out, "plain\nplain\n") == 0);
    release(&r);
}

/* Lines of different ranks never mix; a last line without a newline still arrives, and a
 * huge line arrives in prefixed pieces. */
static void lines_stay_whole(void) {
    char *argv[] = {"tandemrun",
                    "--nproc-per-node",
                    "3",
                    "sh",
                    "-c",
                    "i=0; while [ $i -lt 300 ]; do echo \"line $RANK $i end\"; i=$((i+1)); done; "
                    "head -c 100000 /dev/zero | tr '\\0' x; echo; printf 'tail'",
                    NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 0);
    int lines = 0, bad = 0, tails = 0;
    size_t xs = 0;
    for (char *line = strtok(r.out, "\n"); line; line = strtok(NULL, "\n")) {
        int k = -1, k2 = -1, i = -1, end = 0;
        if (sscanf(line, "[rank %d] line %d %d end%n", &k, &k2, &i, &end) == 3 && end > 0 &&
            line[end] == '\0' && k == k2)
            lines++;
        else if (sscanf(line, "[rank %d] tail%n", &k, &end) == 1 && end > 0 && line[end] == '\0')
            tails++;
        else if (strncmp(line, "[rank ", 6) == 0 && strchr(line, ']') &&
                 strspn(strchr(line, ']') + 2, "x") == strlen(strchr(line, ']') + 2))
            xs += strlen(strchr(line, ']') + 2);
        else if (bad++ == 0)
            TEST_FAIL_AT("malformed line: %.80s", line);
    }
    CHECK_EQ(lines, 900);
    CHECK_EQ(tails, 3);
    CHECK_EQ(xs, 300000);
    CHECK_EQ(bad, 0);
    release(&r);
}

/* Rank 1 fails; the others sleep and must be stopped, not waited for. */
static void failing_rank_sets_the_exit_status(void) {
    char *argv[] = {
        "tandemrun", "--nproc-per-node",
        "3",         "sh",
        "-c",        "echo PID $$; if [ $RANK = 1 ]; then sleep 0.3; exit 3; fi; exec sleep 30",
        NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 3);
    CHECK(strstr(r.err, "rank 1 (pid ") != NULL);
    CHECK(strstr(r.err, "exited with status 3") != NULL);
    CHECK(strstr(r.err, "stopping the other 2 ranks") != NULL);
    CHECK(r.secs < 5);
    check_pids_gone(r.out, 3);
    release(&r);
}

static void killed_rank_is_named_with_its_signal(void) {
    char *argv[] = {
        "tandemrun", "--nproc-per-node",
        "4",         "sh",
        "-c",        "echo PID $$; if [ $RANK = 2 ]; then sleep 0.3; kill -9 $$; fi; exec sleep 30",
        NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 128 + SIGKILL);
    CHECK(strstr(r.err, "rank 2 (pid ") != NULL);
    CHECK(strstr(r.err, "killed by signal 9 (SIGKILL)") != NULL);
    CHECK(r.secs < 5);
    check_pids_gone(r.out, 4);
    release(&r);
}

/* Ranks that ignore SIGTERM get SIGKILL after the grace period. */
static void stubborn_ranks_get_sigkill(void) {
    char *argv[] = {"tandemrun",
                    "--grace-period",
                    "1",
                    "--nproc-per-node",
                    "3",
                    "sh",
                    "-c",
                    "trap '' TERM; echo PID $$; if [ $RANK = 0 ]; then sleep 0.3; exit 5; fi; "
                    "while :; do sleep 0.05; done",
                    NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 5);
    CHECK(r.secs >= 1.0 && r.secs < 5);
    check_pids_gone(r.out, 3);
    release(&r);
}

/* Waits until `fd` holds `n` occurrences of needle (the ranks have started). */
static int wait_for(int fd, const char *needle, int n, double limit_s) {
    double t0 = now_s();
    while (now_s() - t0 < limit_s) {
        char buf[8192];
        ssize_t got = pread(fd, buf, sizeof buf - 1, 0);
        buf[got > 0 ? got : 0] = '\0';
        if (count_lines_with(buf, needle) >= n) return 1;
        usleep(20000);
    }
    return 0;
}

/* Starts `nproc` ranks that print their pid and sleep, waits until all have started, then
 * sends the launcher `sig` and collects how it ended (secs counted from the start). */
static run_result signal_launcher(int nproc, int sig) {
    char n[16];
    snprintf(n, sizeof n, "%d", nproc);
    char *argv[] = {"tandemrun", "--nproc-per-node",           n,   "sh",
                    "-c",        "echo PID $$; exec sleep 30", NULL};
    int o, e;
    double t0 = now_s();
    pid_t pid = start(argv, &o, &e);
    CHECK(wait_for(o, "PID ", nproc, 10));
    kill(pid, sig);
    return finish(pid, o, e, t0);
}

static void sigterm_to_launcher_stops_everything(void) {
    run_result r = signal_launcher(3, SIGTERM);
    CHECK_EQ(r.status, 128 + SIGTERM);
    CHECK(strstr(r.err, "received SIGTERM") != NULL);
    CHECK(r.secs < 8);
    check_pids_gone(r.out, 3);
    release(&r);
}

/* Even a launcher killed outright leaves no rank behind (PR_SET_PDEATHSIG). */
static void sigkill_to_launcher_takes_the_ranks_along(void) {
    run_result r = signal_launcher(2, SIGKILL);
    CHECK_EQ(r.status, 128 + SIGKILL);
    /* the ranks are now orphans that init reaps; give it a moment */
    double t1 = now_s();
    int alive = 1;
    while (alive && now_s() - t1 < 5) {
        alive = 0;
        for (const char *p = r.out; (p = strstr(p, "PID ")); p += 4) {
            int rank_pid = atoi(p + 4);
            char path[64], state = 0;
            snprintf(path, sizeof path, "/proc/%d/stat", rank_pid);
            FILE *f = fopen(path, "r");
            if (!f) continue;
            /* a zombie nobody has reaped yet is dead too */
            if (fscanf(f, "%*d %*s %c", &state) == 1 && state != 'Z') alive = 1;
            fclose(f);
        }
        if (alive) usleep(20000);
    }
    CHECK(!alive);
    CHECK_EQ(count_lines_with(r.out, "PID "), 2);
    release(&r);
}

static void job_timeout_exits_124(void) {
    char *argv[] = {"tandemrun", "--timeout", "0.5", "--nproc-per-node",
                    "2",         "sh",        "-c",  "echo PID $$; exec sleep 30",
                    NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 124);
    CHECK(strstr(r.err, "timed out") != NULL);
    CHECK(r.secs < 5);
    check_pids_gone(r.out, 2);
    release(&r);
}

static void usage_errors_exit_2_and_say_why(void) {
    struct {
        char *argv[10];
        const char *message;
    } cases[] = {
        {{"tandemrun", "--nproc-per-node", "2", NULL}, "no program"},
        {{"tandemrun", "--nproc-per-node", "0", "true", NULL}, "--nproc-per-node"},
        {{"tandemrun", "--nproc-per-node", "x", "true", NULL}, "--nproc-per-node x: expected"},
        {{"tandemrun", "--nproc-per-node", NULL}, "needs a value"},
        {{"tandemrun", "td_no_such_program_x", NULL}, "td_no_such_program_x"},
        {{"tandemrun", "--bogus", "true", NULL}, "--bogus"},
        {{"tandemrun", "--nnodes", "2", "true", NULL}, "--token T"},
        {{"tandemrun", "--nnodes", "2", "--node-rank", "2", "true", NULL}, "--node-rank 2"},
        {{"tandemrun", "--nnodes", "1:4", "true", NULL}, "elastic"},
        {{"tandemrun", "--max-restarts", "-1", "true", NULL}, "--max-restarts"},
        {{"tandemrun", "--nnodes", "2", "--token", "t", "--max-restarts", "1", "true", NULL},
         "cannot restart"},
        {{"tandemrun", "--restart-nproc-per-node", "some", "true", NULL},
         "--restart-nproc-per-node some: expected left"},
        {{"tandemrun", "--timeout", "soon", "true", NULL}, "--timeout soon: expected a number > 0"},
        {{"tandemrun", "--devices", "0,0", "true", NULL}, "GPU 0 twice"},
        {{"tandemrun", "--master_port=70000", "true", NULL},
         "--master_port 70000: expected an integer from 1 to 65535"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        run_result r = run(cases[k].argv);
        CHECK_EQ(r.status, 2);
        if (!strstr(r.err, cases[k].message))
            TEST_FAIL_AT("case %zu: stderr lacks '%s': %s", k, cases[k].message, r.err);
        release(&r);
    }
    char *help[] = {"tandemrun", "--help", NULL};
    run_result r = run(help);
    CHECK_EQ(r.status, 0);
    CHECK(strstr(r.out, "--nproc-per-node") != NULL);
    release(&r);
}

static void tee_writes_per_rank_logs(void) {
    char dir[] = "/tmp/td_tandemrun_logs_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char opt[64];
    snprintf(opt, sizeof opt, "--log-dir=%s", dir);
    char *argv[] = {"tandemrun",        "--tee", opt, "--nproc-per-node", "2", "sh", "-c",
                    "echo hello $RANK", NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 0);
    for (int k = 0; k < 2; k++) {
        char path[128], want[32];
        snprintf(path, sizeof path, "%s/rank_%d.log", dir, k);
        snprintf(want, sizeof want, "hello %d\n", k);
        int fd = open(path, O_RDONLY);
        CHECK(fd >= 0);
        if (fd < 0) continue;
        char *text = slurp(fd);
        CHECK(strcmp(text, want) == 0);
        free(text);
        unlink(path);
    }
    rmdir(dir);
    release(&r);
}

/* Rank side of ranks_form_a_process_group: the library's own rendezvous, from the env
 * contract alone. */
static int rank_main(void) {
    td_comm *comm = NULL;
    td_status st = td_comm_create(&comm, NULL);
    if (st != TD_OK) {
        printf("create failed: %s\n", td_last_error());
        return 1;
    }
    int64_t mine = td_comm_rank(comm) + 1, sum = 0;
    st = td_comm_allreduce(comm, &mine, &sum, 1, TD_I64, TD_OP_SUM);
    printf("GROUP %d %d %lld %s\n", td_comm_rank(comm), td_comm_size(comm), (long long)sum,
           st == TD_OK ? td_comm_backend_name(comm) : td_last_error());
    td_comm_destroy(comm);
    return st == TD_OK ? 0 : 1;
}

/* A rank that stops itself (SIGSTOP) once in the group: the others give up waiting for it. */
static int stuck_rank_main(void) {
    td_comm *comm = NULL;
    if (td_comm_create(&comm, NULL) != TD_OK) return 1;
    if (td_comm_rank(comm) == 1) raise(SIGSTOP);
    td_status st = td_comm_barrier(comm);
    fprintf(stderr, "barrier: %s\n", st == TD_OK ? "ok" : td_last_error());
    td_comm_destroy(comm);
    return st == TD_OK ? 0 : 1;
}

/* Rank 1 fails 0.3 s after start, before the group exists; rank 0 is mid-rendezvous. */
static int early_failure_main(void) {
    if (atoi(getenv("RANK")) == 1) {
        nanosleep(&(struct timespec){0, 300000000}, NULL);
        return 3;
    }
    td_comm *comm = NULL;
    td_comm_create(&comm, NULL);
    td_comm_destroy(comm);
    return 0;
}

/* Entries of /dev/shm that tandem could have made. */
static int shm_entries(void) {
    FILE *p = popen("ls /dev/shm 2>/dev/null | grep -c '^tandem'", "r");
    int n = 0;
    if (p && fscanf(p, "%d", &n) != 1) n = 0;
    if (p) pclose(p);
    return n;
}

static void self_path(char *out, size_t cap) {
    ssize_t len = readlink("/proc/self/exe", out, cap - 1);
    out[len > 0 ? len : 0] = '\0';
}

/* The launcher's summary names the rank the job was stuck on, not the one that gave up. */
static void stopped_rank_is_named_as_the_stuck_one(void) {
    char self[4096];
    self_path(self, sizeof self);
    setenv("TANDEM_TIMEOUT", "2", 1);
    char *argv[] = {"tandemrun", "--nproc-per-node", "3", "--grace-period", "1", "--timeout", "60",
                    self,        "--stuck",          NULL};
    run_result r = run(argv);
    unsetenv("TANDEM_TIMEOUT");
    CHECK(r.status != 0);
    CHECK(strstr(r.err, "rank 1 (pid") != NULL);
    CHECK(strstr(r.err, "stopped (SIGSTOP) and never arrived: the job was stuck on it") != NULL);
    if (!strstr(r.err, "stuck on it")) fprintf(stderr, "%s\n", r.err);
    CHECK(r.secs < 30);
    release(&r);
}

/* A job that fails before its rendezvous completes leaves no shared memory behind. */
static void failure_before_rendezvous_leaves_no_segment(void) {
    char self[4096];
    self_path(self, sizeof self);
    int before = shm_entries();
    for (int k = 0; k < 3; k++) {
        char *argv[] = {"tandemrun", "--nproc-per-node", "2", "--grace-period", "1",
                        self,        "--early",          NULL};
        run_result r = run(argv);
        CHECK_EQ(r.status, 3);
        release(&r);
    }
    CHECK_EQ(shm_entries(), before);
}

/* A rank fails on the first start only: the job starts again and finishes; each start is
 * numbered in TANDEM_RESTART_COUNT, and rank processes of the first start are gone. */
static void a_failed_job_restarts_and_finishes(void) {
    char marker[] = "/tmp/td_restart_XXXXXX";
    int fd = mkstemp(marker);
    close(fd);
    unlink(marker);
    /* Rank 1 fails once rank 0 has written its lines (%s.up), however late rank 0 starts. */
    char script[768];
    snprintf(script, sizeof script,
             "echo PID $$; echo \"START $TANDEM_RESTART_COUNT $RANK $WORLD_SIZE\"; "
             "if [ $RANK = 0 ]; then touch %s.up; fi; "
             "if [ $RANK = 1 ] && [ ! -e %s ]; then touch %s; i=0; "
             "while [ ! -e %s.up ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; exit 3; fi; "
             "sleep 0.3",
             marker, marker, marker, marker);
    char *argv[] = {"tandemrun", "--max-restarts", "2", "--nproc-per-node", "2", "sh",
                    "-c",        script,           NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 0);
    CHECK(strstr(r.err, "rank 1 (pid ") != NULL);
    CHECK(strstr(r.err, "restart 1 of 2 after rank 1 failed: starting 2 ranks") != NULL);
    CHECK_EQ(count_lines_with(r.out, "START 0 "), 2);
    CHECK_EQ(count_lines_with(r.out, "START 1 "), 2);
    check_pids_gone(r.out, 4);
    release(&r);
    unlink(marker);
    char up[sizeof marker + 3];
    snprintf(up, sizeof up, "%s.up", marker);
    unlink(up);
}

/* A rank that always fails: 1 + K starts, then the rank's status. */
static void restarts_stop_at_the_limit(void) {
    char *argv[] = {
        "tandemrun",
        "--max-restarts",
        "2",
        "--nproc-per-node",
        "2",
        "sh",
        "-c",
        "echo \"START $TANDEM_RESTART_COUNT\"; if [ $RANK = 0 ]; then sleep 0.2; exit 5; fi; "
        "exec sleep 30",
        NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 5);
    CHECK_EQ(count_lines_with(r.out, "START "), 6);
    CHECK(strstr(r.err, "restart 2 of 2") != NULL);
    CHECK(strstr(r.err, "restart 3") == NULL);
    CHECK(strstr(r.err, "not restarting: rank 0 failed and all 2 restarts are used "
                        "(--max-restarts 2); exiting with status 5") != NULL);
    CHECK(r.secs < 10);
    if (test_case_failed) fprintf(stderr, "%s\n", r.err);
    release(&r);
}

/* --restart-nproc-per-node left shrinks the job by one rank per failure: when the last rank
 * fails, restarts still allowed, tandemrun says why it does not go on. */
static void shrinking_to_no_rank_says_why(void) {
    char *argv[] = {
        "tandemrun", "--max-restarts",
        "5",         "--restart-nproc-per-node",
        "left",      "--nproc-per-node",
        "2",         "sh",
        "-c",        "echo \"WORLD $WORLD_SIZE\"; if [ $RANK = 0 ]; then exit 4; fi; exec sleep 30",
        NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 4);
    CHECK_EQ(count_lines_with(r.out, "WORLD 1"), 1);
    CHECK(strstr(r.err, "restart 1 of 5 after rank 0 failed: starting 1 rank") != NULL);
    CHECK(strstr(r.err, "not restarting: rank 0, the last one left, failed: "
                        "--restart-nproc-per-node left restarts without the rank that failed, "
                        "which leaves none (1 of 5 restarts used); exiting with status 4") != NULL);
    CHECK(r.secs < 10);
    if (test_case_failed) fprintf(stderr, "%s\n", r.err);
    release(&r);
}

/* --restart-nproc-per-node left starts the ranks that did not fail; a number, that many. */
static void a_restart_may_change_the_world_size(void) {
    char *left[] = {"tandemrun",
                    "--max-restarts",
                    "1",
                    "--restart-nproc-per-node",
                    "left",
                    "--nproc-per-node",
                    "3",
                    "sh",
                    "-c",
                    "echo \"WORLD $WORLD_SIZE\"; if [ $WORLD_SIZE = 3 ] && [ $RANK = 2 ]; then "
                    "sleep 0.2; exit 1; fi; sleep 0.4",
                    NULL};
    run_result r = run(left);
    CHECK_EQ(r.status, 0);
    CHECK_EQ(count_lines_with(r.out, "WORLD 3"), 3);
    CHECK_EQ(count_lines_with(r.out, "WORLD 2"), 2);
    CHECK(strstr(r.err, "starting 2 ranks") != NULL);
    release(&r);
    char *four[] = {"tandemrun",
                    "--max-restarts=1",
                    "--restart_nproc_per_node=4",
                    "--nproc-per-node",
                    "2",
                    "sh",
                    "-c",
                    "echo \"WORLD $WORLD_SIZE\"; if [ $WORLD_SIZE = 2 ]; then exit 1; fi",
                    NULL};
    r = run(four);
    CHECK_EQ(r.status, 0);
    CHECK_EQ(count_lines_with(r.out, "WORLD 4"), 4);
    release(&r);
}

/* A job on a mesh restarted with the ranks left runs on a mesh that fits them: tp 2 of 4 ranks
 * less one is tp 2 x dp 1 on 2 ranks; tp 2 x pp 2 less one is tp 1 x pp 2 on 2 ranks. */
static void a_restart_with_the_ranks_left_fits_the_mesh(void) {
    const char *script = "echo \"MESH $WORLD_SIZE $TANDEM_TP $TANDEM_PP\"; "
                         "if [ $WORLD_SIZE = 4 ]; then if [ $RANK = 3 ]; then exit 1; fi; "
                         "exec sleep 30; fi";
    char *tp[] = {"tandemrun", "--max-restarts",
                  "1",         "--restart-nproc-per-node",
                  "left",      "--nproc-per-node",
                  "4",         "--tp",
                  "2",         "sh",
                  "-c",        (char *)script,
                  NULL};
    run_result r = run(tp);
    CHECK_EQ(r.status, 0);
    CHECK(strstr(r.err, "restart 1 of 1 after rank 3 failed: starting 2 ranks as tp 2 x pp 1 x "
                        "dp 1") != NULL);
    CHECK_EQ(count_lines_with(r.out, "MESH 2 2 "), 2);
    if (test_case_failed) fprintf(stderr, "%s\n", r.err);
    release(&r);
    char *tp_pp[] = {"tandemrun", "--max-restarts",
                     "1",         "--restart-nproc-per-node",
                     "left",      "--nproc-per-node",
                     "4",         "--tp",
                     "2",         "--pp",
                     "2",         "sh",
                     "-c",        (char *)script,
                     NULL};
    r = run(tp_pp);
    CHECK_EQ(r.status, 0);
    CHECK(strstr(r.err, "starting 2 ranks as tp 1 x pp 2 x dp 1") != NULL);
    CHECK_EQ(count_lines_with(r.out, "MESH 2 1 2"), 2);
    if (test_case_failed) fprintf(stderr, "%s\n", r.err);
    release(&r);
}

/* SIGTERM to the launcher ends the job for good, restarts left or not. */
static void an_interrupted_job_does_not_restart(void) {
    char *argv[] = {"tandemrun", "--max-restarts",
                    "3",         "--nproc-per-node",
                    "2",         "sh",
                    "-c",        "echo START; exec sleep 30",
                    NULL};
    int o, e;
    double t0 = now_s();
    pid_t pid = start(argv, &o, &e);
    struct timespec ts = {0, 400 * 1000000L};
    nanosleep(&ts, NULL);
    kill(pid, SIGTERM);
    run_result r = finish(pid, o, e, t0);
    CHECK_EQ(r.status, 128 + SIGTERM);
    CHECK(strstr(r.err, "restart") == NULL);
    CHECK_EQ(count_lines_with(r.out, "START"), 2);
    release(&r);
}

static void ranks_form_a_process_group(void) {
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    CHECK(len > 0);
    if (len <= 0) return;
    self[len] = '\0';
    char *argv[] = {"tandemrun", "--nproc-per-node", "3", "--timeout", "60", self, "--rank", NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 0);
    for (int k = 0; k < 3; k++) {
        char want[64];
        snprintf(want, sizeof want, "[rank %d] GROUP %d 3 6 ", k, k);
        if (!strstr(r.out, want)) TEST_FAIL_AT("no '%s' in: %s %s", want, r.out, r.err);
    }
    release(&r);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--rank") == 0) return rank_main();
    if (argc > 1 && strcmp(argv[1], "--stuck") == 0) return stuck_rank_main();
    if (argc > 1 && strcmp(argv[1], "--early") == 0) return early_failure_main();
    RUN(env_contract_for_every_rank);
    RUN(ranks_get_disjoint_cores);
    RUN(torchrun_spellings_and_explicit_master);
    RUN(devices_map_to_cuda_visible_devices);
    RUN(no_prefix_passes_lines_through);
    RUN(lines_stay_whole);
    RUN(failing_rank_sets_the_exit_status);
    RUN(killed_rank_is_named_with_its_signal);
    RUN(stubborn_ranks_get_sigkill);
    RUN(sigterm_to_launcher_stops_everything);
    RUN(sigkill_to_launcher_takes_the_ranks_along);
    RUN(job_timeout_exits_124);
    RUN(usage_errors_exit_2_and_say_why);
    RUN(tee_writes_per_rank_logs);
    RUN(ranks_form_a_process_group);
    RUN(stopped_rank_is_named_as_the_stuck_one);
    RUN(failure_before_rendezvous_leaves_no_segment);
    RUN(a_failed_job_restarts_and_finishes);
    RUN(restarts_stop_at_the_limit);
    RUN(a_restart_may_change_the_world_size);
    RUN(shrinking_to_no_rank_says_why);
    RUN(a_restart_with_the_ranks_left_fits_the_mesh);
    RUN(an_interrupted_job_does_not_restart);
    TEST_END();
}
