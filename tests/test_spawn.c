/* td_spawn, PyTorch's mp.spawn: examples/mnist --spawn N trains to the same weights as one
 * process on the global batch (world 2 and 4, within 1e-5), and a failing child is named the way
 * tandemrun names one ("rank 1 (pid N) was killed by signal 9 (SIGKILL)"), the others stopped,
 * nothing left behind; bad options are refused. */
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tandem/tandem.h"

#include "test.h"
#include "test_checkpoint_diff.h"
#include "test_comm_util.h"
#include "test_run_util.h"

static char example[PATH_MAX], dir[64];

static void spawn_equals_one_process(void) {
    const char *args = "--model mlp --epochs 1 --max-steps 4 --no-eval";
    char cmd[2 * PATH_MAX], one[128];
    snprintf(one, sizeof one, "%s/one.st", dir);
    snprintf(cmd, sizeof cmd, "%s %s --checkpoint %s", example, args, one);
    char *argv[] = {"sh", "-c", cmd, NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 0);
    release(&r);
    int worlds[] = {2, 4};
    for (int i = 0; i < 2; i++) {
        char path[128];
        snprintf(path, sizeof path, "%s/spawn%d.st", dir, worlds[i]);
        snprintf(cmd, sizeof cmd, "%s --spawn %d %s --checkpoint %s", example, worlds[i], args, path);
        r = run(argv);
        CHECK_EQ(r.status, 0);
        char want[64];
        snprintf(want, sizeof want, "%d rank(s)", worlds[i]);
        CHECK(strstr(r.out, want) != NULL);
        if (r.status) fprintf(stderr, "%s%s\n", r.out, r.err);
        release(&r);
        double diff = checkpoint_difference(one, path);
        printf("    --spawn %d vs one process: largest relative difference %.2e\n", worlds[i], diff);
        CHECK(diff <= 1e-5);
    }
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* Rank 1 is killed in the middle of a stream of all-reduces. */
static int doomed(int rank, int world, void *arg) {
    (void)world, (void)arg;
    td_comm *w = NULL;
    if (td_comm_create(&w, NULL) != TD_OK) return 2;
    float x[256] = {0};
    for (int i = 0;; i++) {
        if (rank == 1 && i == 10) raise(SIGKILL);
        if (td_comm_allreduce(w, x, x, 256, TD_F32, TD_OP_SUM) != TD_OK) break;
    }
    td_comm_destroy(w);
    return 1;
}

static void failing_child_is_named(void) {
    int status[3] = {0};
    td_spawn_params p = td_spawn_default_params();
    p.nprocs = 3;
    p.pin = 0;
    p.grace_s = 1;
    p.timeout_s = 60;
    p.exit_status = status;
    double t0 = now_s();
    CHECK_STATUS(td_spawn(doomed, NULL, &p), TD_EPEER);
    const char *e = td_last_error();
    CHECK(strstr(e, "rank 1 (pid ") != NULL);
    CHECK(strstr(e, "was killed by signal 9 (SIGKILL)") != NULL);
    if (test_case_failed) fprintf(stderr, "%s\n", e);
    CHECK(WIFSIGNALED(status[1]) && WTERMSIG(status[1]) == SIGKILL);
    for (int r = 0; r < 3; r += 2) CHECK(!(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0));
    CHECK(now_s() - t0 < 30);
    CHECK_EQ(test_shm_leftovers(), 0);
}

static void failing_child_of_the_example_is_named(void) {
    char cmd[PATH_MAX + 128];
    snprintf(cmd, sizeof cmd, "%s --spawn 2 --model mlp --epochs 1 --data /nonexistent-dir", example);
    char *argv[] = {"sh", "-c", cmd, NULL};
    run_result r = run(argv);
    CHECK_EQ(r.status, 1);
    CHECK(strstr(r.err, "/nonexistent-dir") != NULL);      /* the rank's own error */
    CHECK(strstr(r.err, "exited with status 1") != NULL); /* and td_spawn's report */
    if (test_case_failed) fprintf(stderr, "%s\n", r.err);
    release(&r);
}

static int ok_rank(int rank, int world, void *arg) {
    (void)arg;
    return rank < world ? 0 : 1;
}

static void bad_options_are_refused(void) {
    td_spawn_params p = td_spawn_default_params();
    p.nprocs = 0;
    CHECK_STATUS(td_spawn(ok_rank, NULL, &p), TD_EINVAL);
    CHECK(strstr(td_last_error(), "nprocs is 0") != NULL);
    p.nprocs = 2;
    CHECK_STATUS(td_spawn(NULL, NULL, &p), TD_EINVAL);
    p.pin = 0;
    CHECK_OK(td_spawn(ok_rank, NULL, &p));
}

int main(int argc, char **argv) {
    (void)argc;
    char self[PATH_MAX];
    if (!realpath(argv[0], self)) return 1;
    char *bin = dirname(dirname(self)); /* BUILD/tests/x -> BUILD */
    snprintf(example, sizeof example, "%s/examples/mnist", bin);
    snprintf(dir, sizeof dir, "/tmp/tandem-spawn-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    RUN(spawn_equals_one_process);
    RUN(failing_child_is_named);
    RUN(failing_child_of_the_example_is_named);
    RUN(bad_options_are_refused);
    test_remove_dir(dir);
    TEST_END();
}
