/* tandemrun's multi-node form on one machine: two tandemruns, node 0 and node 1, meet through
 * node 0's store and start one world between them (the env contract across nodes, a group
 * that runs hierarchically over UCX and shared memory); a rank failing on one node stops the
 * other naming the rank and its host; and the rendezvous refuses what it must, saying why: a
 * wrong token, a node that never comes, a second job on the same port, a node rank given twice,
 * nodes that disagree on --nnodes. Real hosts (network namespaces) are test_multihost's. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/comm.h"

#include "test.h"
#include "test_comm_util.h"
#include "test_run_util.h"

static char self[4096];

/* A rank of the job: joins the world and all-reduces its rank. */
static int rank_main(void) {
    td_comm *w = NULL;
    if (td_comm_create(&w, NULL) != TD_OK) {
        fprintf(stderr, "td_comm_create: %s\n", td_last_error());
        return 1;
    }
    int64_t mine = td_comm_rank(w), sum = 0;
    td_status s = td_comm_allreduce(w, &mine, &sum, 1, TD_I64, TD_OP_SUM);
    printf("GROUP %d %d %lld %d %d %s\n", td_comm_rank(w), td_comm_size(w), (long long)sum,
           td_comm_node_rank(w), td_comm_local_rank(w), td_comm_backend_name(w));
    fflush(stdout);
    td_comm_destroy(w);
    return s == TD_OK ? 0 : 1;
}

/* A rank that fails on purpose: the last one is killed once everyone has joined. */
static int failing_main(void) {
    td_comm *w = NULL;
    if (td_comm_create(&w, NULL) != TD_OK) return 1;
    td_status s = td_comm_barrier(w);
    if (s == TD_OK && td_comm_rank(w) == td_comm_size(w) - 1) kill(getpid(), SIGKILL);
    float x[64] = {0};
    while (s == TD_OK) s = td_comm_allreduce(w, x, x, 64, TD_F32, TD_OP_SUM);
    fprintf(stderr, "rank %d: %s\n", td_comm_rank(w), td_last_error());
    td_comm_destroy(w);
    return 1;
}

typedef struct {
    pid_t pid;
    int out, err;
    double t0;
} launched;

/* Starts tandemrun for node `node` of `nnodes` on `port` with `token` and extra options. */
static launched node(int nnodes, int node_rank, int port, const char *token, const char *timeout,
                     const char *mode) {
    char n[16], r[16], p[16];
    snprintf(n, sizeof n, "%d", nnodes);
    snprintf(r, sizeof r, "%d", node_rank);
    snprintf(p, sizeof p, "%d", port);
    char *argv[] = {"tandemrun",
                    "--nnodes",
                    n,
                    "--node-rank",
                    r,
                    "--master-port",
                    p,
                    "--token",
                    (char *)token,
                    "--rdzv-timeout",
                    (char *)timeout,
                    "--nproc-per-node",
                    "2",
                    "--grace-period",
                    "1",
                    "--timeout",
                    "60",
                    self,
                    (char *)mode,
                    NULL};
    launched l = {.t0 = now_s()};
    l.pid = start(argv, &l.out, &l.err);
    return l;
}

static run_result done(launched l) { return finish(l.pid, l.out, l.err, l.t0); }

static void two_nodes_form_one_world(void) {
    int port = test_free_port();
    launched b = node(2, 1, port, "job", "30", "--rank");
    launched a = node(2, 0, port, "job", "30", "--rank");
    run_result ra = done(a), rb = done(b);
    CHECK_EQ(ra.status, 0);
    CHECK_EQ(rb.status, 0);
    for (int k = 0; k < 4; k++) {
        char want[96];
        snprintf(want, sizeof want, "[rank %d] GROUP %d 4 6 %d %d ucx+shm", k, k, k / 2, k % 2);
        if (!strstr(k < 2 ? ra.out : rb.out, want))
            TEST_FAIL_AT("no '%s' in:\n%s%s\n%s%s", want, ra.out, ra.err, rb.out, rb.err);
    }
    release(&ra);
    release(&rb);
}

static void failure_on_one_node_stops_the_other(void) {
    int port = test_free_port();
    char host[64] = "";
    gethostname(host, sizeof host - 1);
    launched b = node(2, 1, port, "job", "30", "--fail");
    launched a = node(2, 0, port, "job", "30", "--fail");
    run_result ra = done(a), rb = done(b);
    char want[128];
    CHECK_EQ(rb.status, 128 + SIGKILL);
    CHECK_EQ(ra.status, 128 + SIGKILL); /* the failed rank's status, on every node */
    snprintf(want, sizeof want, "on %s (node 1) was killed by signal 9", host);
    if (!strstr(rb.err, want) || !strstr(ra.err, want))
        TEST_FAIL_AT("'%s' missing:\nnode 0: %s\nnode 1: %s", want, ra.err, rb.err);
    CHECK(strstr(ra.err, "on this node") != NULL);
    CHECK(ra.secs < 30 && rb.secs < 30);
    release(&ra);
    release(&rb);
}

/* A node with another token is refused, and the nodes waiting for it learn so at once (not
 * after the rendezvous timeout), naming its address; whichever node starts first. */
static void wrong_token_is_refused(void) {
    for (int node1_first = 0; node1_first < 2; node1_first++) {
        int port = test_free_port();
        launched a, b;
        if (node1_first) b = node(2, 1, port, "another-job", "30", "--rank");
        a = node(2, 0, port, "job", "30", "--rank");
        test_sleep_ms(300);
        if (!node1_first) b = node(2, 1, port, "another-job", "30", "--rank");
        run_result ra = done(a), rb = done(b);
        CHECK_EQ(rb.status, 1);
        CHECK(strstr(rb.err, "refused node 1's token") != NULL);
        CHECK_EQ(ra.status, 1);
        CHECK(strstr(ra.err, "refused a connection from 127.0.0.1:") != NULL);
        CHECK(strstr(ra.err, "presented another token, and node 1 has not arrived") != NULL);
        CHECK(ra.secs < 10); /* the rendezvous timeout is 30 s */
        if (test_case_failed)
            fprintf(stderr, "node 1 first: %d\nnode 0 (%.1f s): %s\nnode 1: %s\n", node1_first,
                    ra.secs, ra.err, rb.err);
        release(&ra);
        release(&rb);
    }
}

static void missing_node_is_named(void) {
    launched a = node(3, 0, test_free_port(), "job", "1.5", "--rank");
    run_result ra = done(a);
    CHECK_EQ(ra.status, 1);
    CHECK(strstr(ra.err, "1 of 3 nodes arrived, missing node 1, node 2") != NULL);
    CHECK(ra.secs < 20);
    if (test_case_failed) fprintf(stderr, "%s\n", ra.err);
    release(&ra);
    /* and a node whose node 0 never comes */
    launched b = node(2, 1, test_free_port(), "job", "1.5", "--rank");
    run_result rb = done(b);
    CHECK_EQ(rb.status, 1);
    CHECK(strstr(rb.err, "cannot reach the rendezvous store") != NULL);
    if (test_case_failed) fprintf(stderr, "%s\n", rb.err);
    release(&rb);
}

static void second_job_on_the_port_is_refused(void) {
    int port = test_free_port();
    launched first = node(2, 0, port, "job-a", "30", "--rank");
    test_sleep_ms(500);
    launched second = node(2, 0, port, "job-b", "30", "--rank");
    run_result r2 = done(second);
    CHECK_EQ(r2.status, 1);
    CHECK(strstr(r2.err, "cannot host the rendezvous store") != NULL);
    CHECK(strstr(r2.err, "another job") != NULL);
    if (test_case_failed) fprintf(stderr, "%s\n", r2.err);
    release(&r2);
    kill(first.pid, SIGTERM);
    run_result r1 = done(first);
    release(&r1);
}

static void node_rank_given_twice_is_refused(void) {
    int port = test_free_port();
    launched a = node(2, 0, port, "job", "3", "--rank");
    launched b = node(2, 1, port, "job", "3", "--rank");
    test_sleep_ms(300);
    launched c = node(2, 1, port, "job", "3", "--rank");
    run_result ra = done(a), rb = done(b), rc = done(c);
    int twice = (rb.status == 2 && strstr(rb.err, "node rank 1 is already taken")) +
                (rc.status == 2 && strstr(rc.err, "node rank 1 is already taken"));
    CHECK_EQ(twice, 1);
    CHECK_EQ(ra.status, 0);
    if (test_case_failed) fprintf(stderr, "%s\n%s\n%s\n", ra.err, rb.err, rc.err);
    release(&ra);
    release(&rb);
    release(&rc);
}

static void nodes_must_agree_on_nnodes(void) {
    int port = test_free_port();
    launched a = node(2, 0, port, "job", "3", "--rank");
    launched b = node(3, 1, port, "job", "3", "--rank");
    run_result ra = done(a), rb = done(b);
    CHECK(ra.status == 2 || rb.status == 2);
    CHECK(strstr(ra.err, "--nnodes") != NULL || strstr(rb.err, "--nnodes") != NULL);
    release(&ra);
    release(&rb);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--rank") == 0) return rank_main();
    if (argc > 1 && strcmp(argv[1], "--fail") == 0) return failing_main();
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    self[len > 0 ? len : 0] = '\0';
    RUN(two_nodes_form_one_world);
    RUN(failure_on_one_node_stops_the_other);
    RUN(wrong_token_is_refused);
    RUN(missing_node_is_named);
    RUN(second_job_on_the_port_is_refused);
    RUN(node_rank_given_twice_is_refused);
    RUN(nodes_must_agree_on_nnodes);
    TEST_END();
}
