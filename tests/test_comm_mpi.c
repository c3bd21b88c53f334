/* The mpi backend through the public td_comm API, on 1 to 4 real MPI processes.
 *
 * Run plainly (as tests/run.sh does), the program re-executes itself under
 * `mpirun -np N` for N = 1..4 and checks what every rank reported. Under mpirun, each rank
 * checks its place against Open MPI's variables and runs the collective matrix
 * (test_comm_matrix.h). Built without MPI, it checks that asking for the mpi backend says
 * so. */
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tandem/comm.h"

#include "test_comm_util.h"

#ifdef TD_HAVE_MPI

#include "test_comm_matrix.h"

static void world_matches_mpi_launcher(void) {
    CHECK_EQ(rank, atoi(getenv("OMPI_COMM_WORLD_RANK")));
    CHECK_EQ(size, atoi(getenv("OMPI_COMM_WORLD_SIZE")));
    CHECK_EQ(td_comm_local_rank(world), atoi(getenv("OMPI_COMM_WORLD_LOCAL_RANK")));
    CHECK_EQ(td_comm_local_size(world), atoi(getenv("OMPI_COMM_WORLD_LOCAL_SIZE")));
    CHECK(strcmp(td_comm_backend_name(world), "mpi") == 0);
}

static int run_rank(void) {
    td_comm_params p = td_comm_default_params();
    p.backend = TD_BACKEND_MPI;
    p.timeout_s = 60;
    td_status st = td_comm_create(&world, &p);
    if (st != TD_OK) {
        printf("rank ?: td_comm_create: %s: %s\n", td_status_string(st), td_last_error());
        return 1;
    }
    rank = td_comm_rank(world);
    size = td_comm_size(world);
    RUN(world_matches_mpi_launcher);
    int rc = test_comm_matrix_run(world);
    td_comm_destroy(world);
    return rc;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int have_mpirun(void) { return system("command -v mpirun >/dev/null 2>&1") == 0; }

/* Runs this program under mpirun -np `np`; every rank must report all cases passed. */
static void run_under_mpirun(int np) {
    char self[4096], npstr[16];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    CHECK(len > 0);
    if (len <= 0) return;
    self[len] = '\0';
    snprintf(npstr, sizeof npstr, "%d", np);
    int pfd[2];
    CHECK_EQ(pipe(pfd), 0);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pfd[1], 1);
        dup2(pfd[1], 2);
        close(pfd[0]);
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
        setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1); /* containers lack CMA */
        setenv("OMPI_MCA_mpi_yield_when_idle", "1", 1);
        setenv("OMPI_MCA_btl", "self,vader", 1); /* one host: no network probing */
        setenv("TD_TEST_MPI_CHILD", "1", 1);
        /* ranks take their place from MPI, not from a torchrun-style outer environment */
        const char *outer[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
        for (size_t k = 0; k < sizeof outer / sizeof *outer; k++) unsetenv(outer[k]);
        /* Open MPI frees little at exit, from components it has already unloaded, so leak
         * reports under AddressSanitizer would name MPI, not us. */
        const char *asan = getenv("ASAN_OPTIONS");
        char opts[512];
        snprintf(opts, sizeof opts, "%s%sdetect_leaks=0", asan ? asan : "",
                 asan && *asan ? ":" : "");
        setenv("ASAN_OPTIONS", opts, 1);
        execlp("mpirun", "mpirun", "--oversubscribe", "--bind-to", "none", "-np", npstr, self,
               (char *)NULL);
        _exit(127);
    }
    close(pfd[1]);
    size_t cap = 1 << 16, n = 0;
    char *out = malloc(cap);
    double t0 = now_s();
    int timed_out = 0;
    for (;;) {
        struct pollfd p = {pfd[0], POLLIN, 0};
        int ready = poll(&p, 1, 1000);
        if (ready > 0) {
            if (n + 4096 > cap) out = realloc(out, cap *= 2);
            ssize_t r = read(pfd[0], out + n, cap - n - 1);
            if (r <= 0) break;
            n += (size_t)r;
        }
        if (now_s() - t0 > 240) {
            timed_out = 1;
            kill(pid, SIGTERM);
            break;
        }
    }
    out[n] = '\0';
    close(pfd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(!timed_out);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    int reported = 0;
    for (int r = 0; r < np; r++) {
        char want[64];
        snprintf(want, sizeof want, "rank %d of %d: ", r, np);
        const char *line = strstr(out, want);
        int passed = -1, failed = -1;
        if (line && sscanf(line + strlen(want), "%d passed, %d failed", &passed, &failed) == 2)
            reported++;
        CHECK_EQ(failed, 0);
        CHECK(passed >= 10);
    }
    CHECK_EQ(reported, np);
    printf("--- mpirun -np %d (%.1f s) ---\n", np, now_s() - t0);
    /* show only what explains a failure: the children's FAIL lines and messages */
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"))
        if (test_case_failed || strncmp(line, "ok  ", 4) != 0) printf("  %s\n", line);
    free(out);
}

static void one_rank(void) { run_under_mpirun(1); }
static void two_ranks(void) { run_under_mpirun(2); }
static void three_ranks(void) { run_under_mpirun(3); }
static void four_ranks(void) { run_under_mpirun(4); }

int main(void) {
    if (getenv("TD_TEST_MPI_CHILD") && getenv("OMPI_COMM_WORLD_SIZE")) return run_rank();
    if (!have_mpirun()) {
        printf("mpirun not found: the mpi backend's multi-process cases are skipped\n");
        TEST_END();
    }
    RUN(one_rank);
    RUN(two_ranks);
    RUN(three_ranks);
    RUN(four_ranks);
    TEST_END();
}

#else /* built without MPI */

static void mpi_backend_is_unsupported(void) {
    td_comm_params p = td_comm_default_params();
    p.backend = TD_BACKEND_MPI;
    p.rank = 0; /* a complete job description, so that only the backend can refuse */
    p.world_size = 1;
    td_comm *comm = NULL;
    CHECK_STATUS(td_comm_create(&comm, &p), TD_EUNSUPPORTED);
    CHECK(comm == NULL);
    CHECK(strstr(td_last_error(), "mpi") != NULL);
}

int main(void) {
    RUN(mpi_backend_is_unsupported);
    TEST_END();
}

#endif
