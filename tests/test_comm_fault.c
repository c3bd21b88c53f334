/* Failures on the shm backend, with real processes: a rank SIGKILLed in the middle of an
 * allreduce (and of a receive) turns into an error naming it on every survivor within the
 * timeout; mismatched collectives give TD_EMISMATCH on every rank, naming both calls; a
 * rank that never arrives gives TD_ETIMEOUT; a failed group fails fast afterwards; and no
 * segment is left in /dev/shm. */
#include <stdlib.h>

#include "test_comm_util.h"

#define BIG (4u * 1000u * 1000u)

static double seconds_since(uint64_t t0) { return (double)(td_time_ns() - t0) / 1e9; }

static void killed_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 2.0));
    if (!c) return;
    float *buf = malloc(BIG * sizeof(float));
    for (size_t i = 0; i < BIG; i++) buf[i] = 1;
    for (int k = 0; k < 2; k++) CHECK_OK(td_comm_allreduce(c, buf, buf, BIG, TD_F32, TD_OP_SUM));
    if (rank == size - 1) {
        /* Die with the collective under way on the progress thread. */
        td_request *r;
        CHECK_OK(td_comm_iallreduce(c, buf, buf, BIG, TD_F32, TD_OP_SUM, &r));
        test_sleep_ms(2);
        raise(SIGKILL);
    }
    /* The dying rank takes part in one more all-reduce at most (it may finish before the
     * kill), so the survivors' second one cannot complete. */
    uint64_t t0 = td_time_ns();
    td_status s = td_comm_allreduce(c, buf, buf, BIG, TD_F32, TD_OP_SUM);
    if (s == TD_OK) s = td_comm_allreduce(c, buf, buf, BIG, TD_F32, TD_OP_SUM);
    double took = seconds_since(t0);
    CHECK(s == TD_EPEER || s == TD_ETIMEOUT);
    char want[32];
    snprintf(want, sizeof want, "rank %d", size - 1);
    if (!strstr(td_last_error(), want))
        TEST_FAIL_AT("the error does not name %s: %s", want, td_last_error());
    CHECK(took < 3.0);
    /* The group is poisoned: the next call fails at once. */
    t0 = td_time_ns();
    CHECK(td_comm_barrier(c) != TD_OK);
    CHECK(seconds_since(t0) < 0.5);
    int32_t x = 1;
    CHECK(td_comm_send(c, &x, 1, TD_I32, 0 == rank ? 1 : 0, 0) != TD_OK);
    td_comm_destroy(c);
    free(buf);
}

static void rank_killed_mid_allreduce(void) {
    CHECK_EQ(test_run_ranks(3, killed_rank, NULL, 30, 1), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
    CHECK_EQ(test_run_ranks(2, killed_rank, NULL, 30, 1), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

static void killed_sender(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 2.0));
    if (!c) return;
    CHECK_OK(td_comm_barrier(c));
    if (rank == 1) {
        test_sleep_ms(50);
        raise(SIGKILL);
    }
    int32_t v;
    uint64_t t0 = td_time_ns();
    CHECK_STATUS(td_comm_recv(c, &v, 1, TD_I32, 1, 0), TD_EPEER);
    CHECK(strstr(td_last_error(), "rank 1") != NULL);
    CHECK(seconds_since(t0) < 3.0);
    td_comm_destroy(c);
}

static void rank_killed_mid_recv(void) {
    CHECK_EQ(test_run_ranks(2, killed_sender, NULL, 30, 1), 0);
}

/* The survivors of a rank killed in the middle of a large all-reduce name that all-reduce,
 * whichever of its pipelined phases they were waiting in when the peer died. */
#define HUGE_COUNT (8u * 1000u * 1000u)

static void killed_mid_phases(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 5.0));
    if (!c) return;
    float *buf = calloc(HUGE_COUNT, sizeof(float));
    CHECK_OK(td_comm_barrier(c));
    if (rank == size - 1) {
        /* The others wait in the all-reduce's first phase; this rank's arrival lets them into
         * the later ones, where it dies. */
        test_sleep_ms(100);
        td_request *r;
        CHECK_OK(td_comm_iallreduce(c, buf, buf, HUGE_COUNT, TD_F32, TD_OP_SUM, &r));
        test_sleep_ms(3);
        raise(SIGKILL);
    }
    CHECK_STATUS(td_comm_allreduce(c, buf, buf, HUGE_COUNT, TD_F32, TD_OP_SUM), TD_EPEER);
    if (!strstr(td_last_error(), "allreduce #1 (f32, 8000000 elements, sum)"))
        TEST_FAIL_AT("rank %d does not name the all-reduce it was in: %s", rank, td_last_error());
    td_comm_destroy(c);
    free(buf);
}

static void dead_peer_named_in_every_phase(void) {
    for (int trial = 0; trial < 4; trial++)
        CHECK_EQ(test_run_ranks(3, killed_mid_phases, NULL, 30, 1), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* Groups A = {0,1} and B = {1,2,3} of four ranks, B named "stage1"; world rank 3 does not come
 * to B's all-reduce. Its peers in B name it by its world rank, with its rank in B and B's name
 * beside. A name of no or too many characters is refused. */
static void sub_group_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL, *a = NULL, *b = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 0.5));
    if (!c) return;
    static const int A[] = {0, 1}, B[] = {1, 2, 3};
    CHECK_OK(td_comm_new_group(c, A, 2, &a));
    CHECK_OK(td_comm_new_group(c, B, 3, &b));
    if (b) {
        CHECK_STATUS(td_comm_set_name(b, ""), TD_EINVAL);
        CHECK_STATUS(td_comm_set_name(b, "a-name-longer-than-thirty-two-chars"), TD_EINVAL);
        CHECK(strstr(td_last_error(), "35 characters") != NULL);
        CHECK_STATUS(td_comm_set_name(b, NULL), TD_EINVAL);
        CHECK_OK(td_comm_set_name(b, "stage1"));
    }
    float x = 1;
    if (rank == 1 || rank == 2) {
        td_status s = td_comm_allreduce(b, &x, &x, 1, TD_F32, TD_OP_SUM);
        CHECK(s == TD_ETIMEOUT || s == TD_EPEER); /* the first to give up tells the other */
        const char *want = "world rank 3 (rank 2 of group stage1 = {1,2,3}) did not arrive";
        if (!strstr(td_last_error(), want))
            TEST_FAIL_AT("rank %d: no \"%s\" in: %s", rank, want, td_last_error());
    }
    if (rank == 3) test_sleep_ms(800);
    td_comm_destroy(a);
    td_comm_destroy(b);
    td_comm_destroy(c);
}

static void sub_group_peer_named_by_world_rank(void) {
    CHECK_EQ(test_run_ranks(4, sub_group_rank, NULL, 30, 0), 0);
}

typedef struct {
    int variant;
} mismatch_arg;

static void mismatch_rank(int rank, int size, int port, void *arg) {
    const mismatch_arg *m = arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 5.0));
    if (!c) return;
    float buf[1024] = {0};
    for (int k = 0; k < 3; k++) CHECK_OK(td_comm_allreduce(c, buf, buf, 1024, TD_F32, TD_OP_SUM));
    td_status s;
    const char *a = NULL, *b = NULL;
    if (m->variant == 0) { /* rank 1 calls a different collective */
        s = rank == 1 ? td_comm_broadcast(c, buf, 1024, TD_F32, 0)
                      : td_comm_allreduce(c, buf, buf, 1024, TD_F32, TD_OP_SUM);
        a = "allreduce #3 (f32, 1024 elements, sum)";
        b = "broadcast #3 (f32, 1024 elements, root 0)";
    } else if (m->variant == 1) { /* the last rank uses another op */
        s = td_comm_allreduce(c, buf, buf, 1024, TD_F32, rank == size - 1 ? TD_OP_MAX : TD_OP_SUM);
        a = "(f32, 1024 elements, sum)";
        b = "(f32, 1024 elements, max)";
    } else { /* rank 0 has another count, large enough for the pipelined path */
        float *big = calloc(300000, sizeof(float));
        s = td_comm_allreduce(c, big, big, rank == 0 ? 300000 : 299999, TD_F32, TD_OP_SUM);
        free(big);
        a = "300000 elements";
        b = "299999 elements";
    }
    CHECK_EQ(s, TD_EMISMATCH);
    const char *msg = td_last_error();
    if (!strstr(msg, a) || !strstr(msg, b))
        TEST_FAIL_AT("rank %d: message does not name both calls: %s", rank, msg);
    if (m->variant == 0 && !(strstr(msg, "rank 0 called") || strstr(msg, "rank 1 called")))
        TEST_FAIL_AT("message does not name the ranks: %s", msg);
    /* Later calls fail fast. */
    uint64_t t0 = td_time_ns();
    CHECK(td_comm_barrier(c) != TD_OK);
    CHECK(seconds_since(t0) < 0.5);
    td_comm_destroy(c);
}

static void mismatched_collectives(void) {
    mismatch_arg m = {0};
    CHECK_EQ(test_run_ranks(2, mismatch_rank, &m, 30, 0), 0);
    m.variant = 1;
    CHECK_EQ(test_run_ranks(3, mismatch_rank, &m, 30, 0), 0);
    m.variant = 2;
    CHECK_EQ(test_run_ranks(2, mismatch_rank, &m, 30, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

static void late_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 0.5));
    if (!c) return;
    if (rank == 1) {
        test_sleep_ms(1500);
        CHECK_STATUS(td_comm_barrier(c), TD_EPEER); /* rank 0 gave up and said so */
        CHECK(strstr(td_last_error(), "aborted by rank 0") != NULL);
    } else {
        uint64_t t0 = td_time_ns();
        CHECK_STATUS(td_comm_barrier(c), TD_ETIMEOUT);
        double took = seconds_since(t0);
        CHECK(took >= 0.45 && took < 2.0);
        CHECK(strstr(td_last_error(), "rank 1") != NULL);
    }
    td_comm_destroy(c);
}

static void missing_rank_times_out(void) { CHECK_EQ(test_run_ranks(2, late_rank, NULL, 30, 0), 0); }

/* A rank whose peer never creates the group: creation itself times out. */
static void lonely_rank(int rank, int size, int port, void *arg) {
    (void)size;
    (void)arg;
    if (rank == 1) return;
    td_comm *c = NULL;
    uint64_t t0 = td_time_ns();
    CHECK(test_comm_create(&c, rank, 2, port, 0.5) != TD_OK);
    CHECK(c == NULL);
    CHECK(seconds_since(t0) < 2);
}

static void creation_times_out(void) {
    CHECK_EQ(test_run_ranks(2, lonely_rank, NULL, 30, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    RUN(rank_killed_mid_allreduce);
    RUN(rank_killed_mid_recv);
    RUN(dead_peer_named_in_every_phase);
    RUN(sub_group_peer_named_by_world_rank);
    RUN(mismatched_collectives);
    RUN(missing_rank_times_out);
    RUN(creation_times_out);
    TEST_END();
}
