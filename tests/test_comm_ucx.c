/* The ucx backend through the public td_comm API, on real forked ranks of this host: the
 * collective matrix (test_comm_matrix.h) on a flat world, and on a world whose ranks say they
 * are on two hosts (NODE_RANK 0 and 1), which runs hierarchically over shared memory inside
 * each "host" and UCX between them, and flat when asked. Then the failures: a rank killed in a
 * collective turns into TD_EPEER naming it on the others within the timeout, a rank that never
 * comes is named by the rendezvous, and a stranger's token is refused. Several real hosts are
 * test_multihost's. Built without UCX, it checks that asking for the backend says so. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/comm.h"

#include "test_comm_util.h"

#ifdef TD_HAVE_UCX

#include "test_comm_matrix.h"

typedef struct {
    int hosts;        /* ranks are spread over this many pretend hosts, in blocks */
    int hierarchical; /* td_comm_params.hierarchical */
    const char *want; /* the backend name every rank must see */
} layout;

static td_status ucx_world(td_comm **out, int rank, int size, int port, int hosts, int hier,
                           double timeout_s) {
    td_comm_params p = td_comm_default_params();
    p.backend = TD_BACKEND_UCX;
    p.rank = rank;
    p.world_size = size;
    p.local_world_size = size / hosts;
    p.local_rank = rank % p.local_world_size;
    p.node_rank = rank / p.local_world_size;
    p.master_addr = "127.0.0.1";
    p.master_port = port;
    p.token = "test-token";
    p.timeout_s = timeout_s;
    p.hierarchical = hier;
    return td_comm_create(out, &p);
}

static void matrix_rank(int r, int n, int port, void *arg) {
    const layout *l = arg;
    td_comm *w = NULL;
    CHECK_OK(ucx_world(&w, r, n, port, l->hosts, l->hierarchical, 20));
    if (!w) return;
    CHECK(strcmp(td_comm_backend_name(w), l->want) == 0);
    CHECK_EQ(td_comm_num_nodes(w), l->hosts);
    CHECK_EQ(td_comm_node_rank(w), r / (n / l->hosts));
    test_comm_matrix_run(w);
    td_comm_destroy(w);
}

static void run_matrix(int n, layout l) {
    CHECK_EQ(test_run_ranks(n, matrix_rank, &l, 120, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

static void flat_world_of_three(void) { run_matrix(3, (layout){1, 1, "ucx"}); }
static void two_hosts_of_two_hierarchical(void) { run_matrix(4, (layout){2, 1, "ucx+shm"}); }
static void two_hosts_of_two_flat(void) { run_matrix(4, (layout){2, 0, "ucx"}); }

/* Rank 3 dies in the middle of a stream of all-reduces: the others fail within the timeout
 * with an error that names it, and none of them names another survivor, however the ranks
 * are scheduled. */
static void killed_rank_rank(int r, int n, int port, void *arg) {
    int hier = *(int *)arg;
    td_comm *w = NULL;
    CHECK_OK(ucx_world(&w, r, n, port, 2, hier, 10));
    if (!w) return;
    float buf[4096] = {0};
    uint64_t t0 = 0;
    td_status s = TD_OK;
    for (int i = 0; i < 100000 && s == TD_OK; i++) {
        if (r == 3 && i == 20) kill(getpid(), SIGKILL);
        if (i == 20) t0 = td_time_ns();
        s = td_comm_allreduce(w, buf, buf, 4096, TD_F32, TD_OP_SUM);
    }
    double secs = (double)(td_time_ns() - t0) * 1e-9;
    CHECK(s == TD_EPEER || s == TD_ETIMEOUT);
    /* The cause named is rank 3's death, never a survivor that left after it (its endpoint may
     * be seen failing before its notice is read, or before rank 3's endpoint fails here). */
    const char *why = td_last_error();
    CHECK(strstr(why, hier ? "rank 3" : "the connection to rank 3 ") != NULL);
    for (int q = 0; q < 3; q++) {
        char blamed[40];
        snprintf(blamed, sizeof blamed, "connection to rank %d ", q);
        CHECK(strstr(why, blamed) == NULL);
    }
    CHECK(secs < 10.5);
    if (test_case_failed) fprintf(stderr, "rank %d after %.2f s: %s\n", r, secs, td_last_error());
    td_comm_destroy(w);
}

static void killed_rank_is_named(int hier) {
    CHECK_EQ(test_run_ranks(4, killed_rank_rank, &hier, 60, 1), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}
static void killed_rank_is_named_flat(void) { killed_rank_is_named(0); }
static void killed_rank_is_named_hierarchical(void) { killed_rank_is_named(1); }

/* World size 3 but rank 2 never starts: the rendezvous names it. */
static void missing_rank(int r, int n, int port, void *arg) {
    (void)arg, (void)n;
    td_comm *w = NULL;
    td_status s = ucx_world(&w, r, 3, port, 1, 1, 1.5);
    /* Rank 0 hosts the store: rank 1 may see it close before its own wait ends. */
    if (r == 0) CHECK_EQ(s, TD_ETIMEOUT);
    else CHECK(s == TD_ETIMEOUT || s == TD_EPEER);
    CHECK(strstr(td_last_error(), "rank 2") != NULL);
    td_comm_destroy(w);
}

static void missing_rank_is_named(void) { CHECK_EQ(test_run_ranks(2, missing_rank, NULL, 30, 0), 0); }

/* A rank with another job's token is refused by the store. */
static void stranger(int r, int n, int port, void *arg) {
    (void)arg;
    td_comm_params p = td_comm_default_params();
    p.backend = TD_BACKEND_UCX;
    p.rank = r;
    p.world_size = n;
    p.local_world_size = n;
    p.master_addr = "127.0.0.1";
    p.master_port = port;
    p.token = r == 1 ? "another-job" : "test-token";
    p.timeout_s = 2;
    td_comm *w = NULL;
    td_status s = td_comm_create(&w, &p);
    if (r == 1) {
        CHECK_EQ(s, TD_EAUTH);
        CHECK(strstr(td_last_error(), "token") != NULL);
    } else {
        CHECK(s != TD_OK);
    }
    td_comm_destroy(w);
}

static void wrong_token_is_refused(void) { CHECK_EQ(test_run_ranks(2, stranger, NULL, 30, 0), 0); }

int main(void) {
    RUN(flat_world_of_three);
    RUN(two_hosts_of_two_hierarchical);
    RUN(two_hosts_of_two_flat);
    RUN(killed_rank_is_named_flat);
    RUN(killed_rank_is_named_hierarchical);
    RUN(missing_rank_is_named);
    RUN(wrong_token_is_refused);
    TEST_END();
}

#else /* built without UCX */

static void ucx_backend_is_unsupported(void) {
    td_comm_params p = td_comm_default_params();
    p.backend = TD_BACKEND_UCX;
    p.rank = 0;
    p.world_size = 1;
    td_comm *comm = NULL;
    CHECK_STATUS(td_comm_create(&comm, &p), TD_EUNSUPPORTED);
    CHECK(comm == NULL);
    CHECK(strstr(td_last_error(), "ucx") != NULL);
}

int main(void) {
    RUN(ucx_backend_is_unsupported);
    TEST_END();
}

#endif
