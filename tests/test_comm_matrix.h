/* The collective matrix every backend must pass, run by each rank of a real group: every
 * collective x dtype x op x size (0, 1, 7, 1009; 100003 for f32 and bf16 with SUM and AVG)
 * against a serial reference computed from the same generator, in-place variants,
 * non-blocking collectives, point-to-point order and tags, splits, the host topology,
 * mismatched collectives, arguments rejected on one rank, and bounded waits.
 * test_comm_matrix_run(world) runs them all on the calling rank and prints
 * "rank R of N: P passed, F failed" (not at the start of a line: the program that launched
 * the ranks counts them). Used by test_comm_mpi (mpirun), test_comm_ucx (td_spawn) and
 * test_multihost (several hosts). */
#ifndef TANDEM_TEST_COMM_MATRIX_H
#define TANDEM_TEST_COMM_MATRIX_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/comm.h"

#include "test_comm_util.h"
static td_comm *world;
static int rank, size;

static const size_t sizes[] = {0, 1, 7, 1009, 100003};
#define NSIZES (sizeof sizes / sizeof *sizes)

/* Fails the case once, naming the first wrong element. */
static int expect(const char *what, td_dtype dt, td_reduce_op op, size_t n, size_t i, double got,
                  double want) {
    if (got == want) return 1;
    TEST_FAIL_AT("rank %d: %s %s %s n=%zu: [%zu] = %g, want %g", rank, what, td_dtype_name(dt),
                 td_reduce_op_name(op), n, i, got, want);
    return 0;
}

/* The largest size runs for a few cases only, to keep the suite quick on 2 cores. */
static int big_case(int dt, int op) {
    return (dt == TD_F32 || dt == TD_BF16) && (op == TD_OP_SUM || op == TD_OP_AVG);
}

static void *alloc(size_t n, td_dtype dt) { return calloc(n ? n : 1, td_dtype_size(dt)); }

static void allreduce_reduce_every_dtype_op_size(void) {
    for (int dt = 0; dt < TD_DTYPE_COUNT; dt++)
        for (int op = 0; op < TD_OP_COUNT; op++)
            for (size_t s = 0; s < NSIZES; s++) {
                size_t n = sizes[s];
                if (n > 10000 && !big_case(dt, op)) continue; /* time */
                void *send = alloc(n, dt), *recv = alloc(n, dt);
                for (size_t i = 0; i < n; i++)
                    test_elem_put(dt, send, i, test_coll_gen(rank, i, op, dt));
                CHECK_OK(td_comm_allreduce(world, send, recv, n, dt, op));
                for (size_t i = 0; i < n; i++)
                    if (!expect("allreduce", dt, op, n, i, test_elem_get(dt, recv, i),
                                test_coll_reference(size, i, dt, op)))
                        break;
                /* in place */
                CHECK_OK(td_comm_allreduce(world, send, send, n, dt, op));
                for (size_t i = 0; i < n; i++)
                    if (!expect("allreduce in place", dt, op, n, i, test_elem_get(dt, send, i),
                                test_coll_reference(size, i, dt, op)))
                        break;
                /* reduce to a root that moves around */
                int root = (int)((s + (size_t)op) % (size_t)size);
                for (size_t i = 0; i < n; i++)
                    test_elem_put(dt, send, i, test_coll_gen(rank, i, op, dt));
                memset(recv, 0, n * td_dtype_size(dt));
                CHECK_OK(td_comm_reduce(world, send, recv, n, dt, op, root));
                if (rank == root)
                    for (size_t i = 0; i < n; i++)
                        if (!expect("reduce", dt, op, n, i, test_elem_get(dt, recv, i),
                                    test_coll_reference(size, i, dt, op)))
                            break;
                free(send);
                free(recv);
            }
}

static void reduce_scatter_every_dtype_op_size(void) {
    for (int dt = 0; dt < TD_DTYPE_COUNT; dt++)
        for (int op = 0; op < TD_OP_COUNT; op++)
            for (size_t s = 0; s < NSIZES; s++) {
                size_t n = sizes[s], total = n * (size_t)size;
                if (n > 10000 && !big_case(dt, op)) continue; /* time */
                void *send = alloc(total, dt), *recv = alloc(n, dt);
                for (size_t i = 0; i < total; i++)
                    test_elem_put(dt, send, i, test_coll_gen(rank, i, op, dt));
                CHECK_OK(td_comm_reduce_scatter(world, send, recv, n, dt, op));
                for (size_t i = 0; i < n; i++) {
                    size_t g = (size_t)rank * n + i;
                    if (!expect("reduce_scatter", dt, op, n, i, test_elem_get(dt, recv, i),
                                test_coll_reference(size, g, dt, op)))
                        break;
                }
                /* in place: the result lands at the front of the buffer */
                CHECK_OK(td_comm_reduce_scatter(world, send, send, n, dt, op));
                for (size_t i = 0; i < n; i++) {
                    size_t g = (size_t)rank * n + i;
                    if (!expect("reduce_scatter in place", dt, op, n, i, test_elem_get(dt, send, i),
                                test_coll_reference(size, g, dt, op)))
                        break;
                }
                free(send);
                free(recv);
            }
}

/* Value j of rank r's contribution in the data-movement collectives; fits every dtype. */
static double mv(int r, size_t j) { return (double)((r * 31 + (int)(j % 97)) % 120); }

/* Checks b (total elements) holds every rank's mv(r, i) in rank order, naming `what`. */
static void expect_gathered(const char *what, td_dtype dt, size_t n, size_t total, const void *b) {
    for (size_t i = 0; i < total; i++)
        if (!expect(what, dt, 0, n, i, test_elem_get(dt, b, i), mv((int)(i / n), i % n))) break;
}

static void data_movement_every_dtype_size(void) {
    for (int dt = 0; dt < TD_DTYPE_COUNT; dt++)
        for (size_t s = 0; s < NSIZES; s++) {
            size_t n = sizes[s], total = n * (size_t)size;
            if (n > 10000 && !big_case(dt, TD_OP_SUM)) continue; /* time */
            int root = (int)(s % (size_t)size);
            void *a = alloc(total, dt), *b = alloc(total, dt);
            /* broadcast */
            for (size_t i = 0; i < n; i++) test_elem_put(dt, a, i, rank == root ? mv(root, i) : -1);
            CHECK_OK(td_comm_broadcast(world, a, n, dt, root));
            for (size_t i = 0; i < n; i++)
                if (!expect("broadcast", dt, 0, n, i, test_elem_get(dt, a, i), mv(root, i))) break;
            /* allgather, then NCCL-style in place (own part already at rank * n) */
            for (size_t i = 0; i < n; i++) test_elem_put(dt, a, i, mv(rank, i));
            CHECK_OK(td_comm_allgather(world, a, b, n, dt));
            expect_gathered("allgather", dt, n, total, b);
            memset(b, 0, total * td_dtype_size(dt));
            for (size_t i = 0; i < n; i++) test_elem_put(dt, b, (size_t)rank * n + i, mv(rank, i));
            CHECK_OK(td_comm_allgather(world, (char *)b + (size_t)rank * n * td_dtype_size(dt), b,
                                       n, dt));
            expect_gathered("allgather in place", dt, n, total, b);
            /* send == recv: the input is where send points, recv's first block (comm.h) */
            memset(b, 0, total * td_dtype_size(dt));
            for (size_t i = 0; i < n; i++) test_elem_put(dt, b, i, mv(rank, i));
            CHECK_OK(td_comm_allgather(world, b, b, n, dt));
            expect_gathered("allgather send == recv", dt, n, total, b);
            memset(b, 0, total * td_dtype_size(dt));
            for (size_t i = 0; i < n; i++) test_elem_put(dt, b, i, mv(rank, i));
            CHECK_OK(td_comm_gather(world, b, b, n, dt, root));
            if (rank == root) expect_gathered("gather send == recv", dt, n, total, b);
            /* gather */
            memset(b, 0, total * td_dtype_size(dt));
            CHECK_OK(td_comm_gather(world, a, b, n, dt, root));
            if (rank == root) expect_gathered("gather", dt, n, total, b);
            /* scatter: root's part j goes to rank j */
            for (size_t i = 0; i < total; i++) test_elem_put(dt, b, i, mv((int)(i / n) + 5, i % n));
            memset(a, 0, total * td_dtype_size(dt));
            CHECK_OK(td_comm_scatter(world, b, a, n, dt, root));
            for (size_t i = 0; i < n; i++)
                if (!expect("scatter", dt, 0, n, i, test_elem_get(dt, a, i), mv(rank + 5, i)))
                    break;
            /* alltoall: my part for rank j is mv(rank * size + j); then in place */
            for (size_t i = 0; i < total; i++)
                test_elem_put(dt, a, i, mv(rank * size + (int)(i / n), i % n));
            CHECK_OK(td_comm_alltoall(world, a, b, n, dt));
            for (size_t i = 0; i < total; i++)
                if (!expect("alltoall", dt, 0, n, i, test_elem_get(dt, b, i),
                            mv((int)(i / n) * size + rank, i % n)))
                    break;
            CHECK_OK(td_comm_alltoall(world, a, a, n, dt));
            for (size_t i = 0; i < total; i++)
                if (!expect("alltoall in place", dt, 0, n, i, test_elem_get(dt, a, i),
                            mv((int)(i / n) * size + rank, i % n)))
                    break;
            CHECK_OK(td_comm_barrier(world));
            free(a);
            free(b);
        }
}

static void nonblocking_collectives_complete_in_order(void) {
    enum { N = 1009, K = 4 };
    float bufs[K][N];
    td_request *reqs[K];
    for (int k = 0; k < K; k++) {
        for (int i = 0; i < N; i++) bufs[k][i] = (float)(rank + k + i % 5);
        CHECK_OK(td_comm_iallreduce(world, bufs[k], bufs[k], N, TD_F32, TD_OP_SUM, &reqs[k]));
    }
    for (int k = K - 1; k >= 0; k--) CHECK_OK(td_request_wait(reqs[k]));
    for (int k = 0; k < K; k++)
        for (int i = 0; i < N; i++) {
            float want = (float)(size * (size - 1) / 2 + size * (k + i % 5));
            if (bufs[k][i] != want) {
                TEST_FAIL_AT("iallreduce %d [%d] = %g, want %g", k, i, bufs[k][i], want);
                break;
            }
        }
}

/* Messages between a pair with the same tag arrive in order; tags keep streams apart. */
static void p2p_keeps_order_per_tag(void) {
    if (size < 2) return;
    enum { M = 5, N = 1009 };
    int dst = (rank + 1) % size, src = (rank + size - 1) % size;
    static int out[2][M][N], in[2][M][N];
    td_request *sends[2 * M], *recvs[2 * M];
    for (int t = 0; t < 2; t++)
        for (int m = 0; m < M; m++) {
            for (int i = 0; i < N; i++) out[t][m][i] = rank * 100000 + t * 10000 + m * 1000 + i;
            CHECK_OK(td_comm_isend(world, out[t][m], N, TD_I32, dst, 7 + t, &sends[t * M + m]));
        }
    /* receive tag 8 before tag 7 */
    for (int t = 1; t >= 0; t--)
        for (int m = 0; m < M; m++)
            CHECK_OK(td_comm_irecv(world, in[t][m], N, TD_I32, src, 7 + t, &recvs[t * M + m]));
    for (int k = 0; k < 2 * M; k++) CHECK_OK(td_request_wait(recvs[k]));
    for (int k = 0; k < 2 * M; k++) {
        int done = 0;
        td_status st;
        while ((st = td_request_test(sends[k], &done)) == TD_OK && !done) {
        }
        CHECK_OK(st);
    }
    for (int t = 0; t < 2; t++)
        for (int m = 0; m < M; m++)
            for (int i = 0; i < N; i += 97)
                CHECK_EQ(in[t][m][i], src * 100000 + t * 10000 + m * 1000 + i);
    /* blocking send/recv, rank 0 <-> rank 1, and a count the sender does not match */
    double x[3] = {1.5, 2.5, 3.5}, y[4] = {0};
    if (rank == 0) {
        CHECK_OK(td_comm_send(world, x, 3, TD_F64, 1, 11));
        CHECK_OK(td_comm_send(world, x, 3, TD_F64, 1, 12));
        CHECK_OK(td_comm_send(world, x, 3, TD_F64, 1, 13));
    } else if (rank == 1) {
        CHECK_OK(td_comm_recv(world, y, 3, TD_F64, 0, 11));
        CHECK(y[0] == 1.5 && y[2] == 3.5);
        CHECK_STATUS(td_comm_recv(world, y, 4, TD_F64, 0, 12), TD_EMISMATCH);
        CHECK(strstr(td_last_error(), "rank 0") != NULL);
        CHECK_STATUS(td_comm_recv(world, y, 2, TD_F64, 0, 13), TD_EMISMATCH); /* too short */
    }
    CHECK_OK(td_comm_barrier(world));
}

static void split_by_parity(void) {
    td_comm *sub = NULL;
    int color = rank % 2;
    CHECK_OK(td_comm_split(world, color, -rank, &sub)); /* key reverses the order */
    CHECK(sub != NULL);
    if (!sub) return;
    int members = (size - color + 1) / 2;
    CHECK_EQ(td_comm_size(sub), members);
    /* ranks of this colour, largest first */
    int expect_rank = 0;
    for (int r = rank + 2; r < size; r += 2) expect_rank++;
    CHECK_EQ(td_comm_rank(sub), expect_rank);
    int64_t mine = rank, sum = -1;
    CHECK_OK(td_comm_allreduce(sub, &mine, &sum, 1, TD_I64, TD_OP_SUM));
    int64_t want = 0;
    for (int r = color; r < size; r += 2) want += r;
    CHECK_EQ(sum, want);
    td_comm_destroy(sub);
    /* a negative colour opts out */
    td_comm *none = (td_comm *)&none;
    CHECK_OK(td_comm_split(world, rank == 0 ? -1 : 0, 0, &none));
    CHECK((rank == 0) == (none == NULL));
    if (none) {
        CHECK_EQ(td_comm_size(none), size - 1);
        CHECK_OK(td_comm_barrier(none));
        td_comm_destroy(none);
    }
}

/* A copy of the world that a failing case may poison (a failed group stays failed). */
static td_comm *scratch_group(void) {
    td_comm *g = NULL;
    CHECK_OK(td_comm_split(world, 0, rank, &g));
    CHECK(g != NULL);
    return g;
}

/* Different collectives on different ranks: an error naming both, on every rank. */
static void mismatched_collectives_are_reported(void) {
    if (size < 2) return;
    float buf[6] = {0};
    td_comm *g = scratch_group();
    if (!g) return;
    td_status st = rank == 0 ? td_comm_broadcast(g, buf, 6, TD_F32, 0)
                             : td_comm_allreduce(g, buf, buf, 6, TD_F32, TD_OP_SUM);
    CHECK_EQ(st, TD_EMISMATCH);
    CHECK(strstr(td_last_error(), "broadcast") != NULL);
    CHECK(strstr(td_last_error(), "allreduce") != NULL);
    td_comm_destroy(g);
    /* same collective, different counts */
    g = scratch_group();
    if (!g) return;
    st = td_comm_allreduce(g, buf, buf, rank == 0 ? 5 : 6, TD_F32, TD_OP_SUM);
    CHECK_EQ(st, TD_EMISMATCH);
    CHECK(strstr(td_last_error(), "5 elements") != NULL &&
          strstr(td_last_error(), "6 elements") != NULL);
    td_comm_destroy(g);
    /* the world was not involved and still works */
    float one = 1, total = 0;
    CHECK_OK(td_comm_allreduce(world, &one, &total, 1, TD_F32, TD_OP_SUM));
    CHECK_EQ(total, size);
}

/* Arguments rejected on the last rank only: every rank reports that rank and the call, and
 * the group still works afterwards. */
static void argument_error_on_one_rank_is_told_to_all(void) {
    if (size < 2) return;
    float x[3] = {1, 1, 1}, y[3];
    CHECK_STATUS(td_comm_allreduce(world, x, rank == size - 1 ? NULL : y, 3, TD_F32, TD_OP_SUM),
                 TD_EINVAL);
    char want[64];
    snprintf(want, sizeof want, "rank %d: allreduce #", size - 1);
    CHECK(strstr(td_last_error(), want) != NULL);
    CHECK(strstr(td_last_error(), "recv is NULL") != NULL);
    CHECK_OK(td_comm_allreduce(world, x, y, 3, TD_F32, TD_OP_SUM));
    CHECK_EQ(y[2], size);
}

/* A receive nobody sends to ends in TD_ETIMEOUT, not a hang. */
static void waits_are_bounded(void) {
    if (size < 2) return;
    td_comm *g = scratch_group();
    if (!g) return;
    if (rank == 0) {
        CHECK_OK(td_comm_set_timeout(g, 0.3));
        int x = 0;
        uint64_t t0 = td_time_ns();
        CHECK_STATUS(td_comm_recv(g, &x, 1, TD_I32, 1, 99), TD_ETIMEOUT);
        double secs = (double)(td_time_ns() - t0) * 1e-9;
        CHECK(secs >= 0.25 && secs < 10);
        CHECK(strstr(td_last_error(), "recv") != NULL);
    }
    td_comm_destroy(g);
    CHECK_OK(td_comm_barrier(world));
}

/* A collective that the other ranks never join ends in TD_ETIMEOUT naming it. */
static void collective_timeout_names_the_collective(void) {
    if (size < 2) return;
    td_comm *g = scratch_group();
    if (!g) return;
    if (rank == 0) {
        CHECK_OK(td_comm_set_timeout(g, 0.3));
        uint64_t t0 = td_time_ns();
        CHECK_STATUS(td_comm_barrier(g), TD_ETIMEOUT);
        double secs = (double)(td_time_ns() - t0) * 1e-9;
        CHECK(secs >= 0.25 && secs < 10);
        CHECK(strstr(td_last_error(), "barrier") != NULL);
        CHECK(strstr(td_last_error(), "rank 0") != NULL);
    }
    td_comm_destroy(g);
    CHECK_OK(td_comm_barrier(world));
}

/* Ranks on each host and the split by host: consistent on every rank, and the host's group
 * reduces over its ranks only. */
static void hosts_are_consistent(void) {
    int me[3] = {td_comm_node_rank(world), td_comm_local_rank(world), td_comm_local_size(world)};
    int nodes = td_comm_num_nodes(world);
    int *all = calloc((size_t)size * 3, sizeof *all);
    CHECK_OK(td_comm_allgather(world, me, all, 3, TD_I32));
    CHECK(nodes >= 1 && me[0] >= 0 && me[0] < nodes);
    for (int r = 0; r < size; r++) {
        int same = all[3 * r] == me[0];
        if (r < rank && same) CHECK(all[3 * r + 1] < me[1]);
        if (same) CHECK_EQ(all[3 * r + 2], me[2]);
    }
    td_comm *host = NULL;
    CHECK_OK(td_comm_split_host(world, &host));
    CHECK(host != NULL);
    if (host) {
        CHECK_EQ(td_comm_size(host), me[2]);
        CHECK_EQ(td_comm_rank(host), me[1]);
        int64_t one = 1, n = 0;
        CHECK_OK(td_comm_allreduce(host, &one, &n, 1, TD_I64, TD_OP_SUM));
        CHECK_EQ(n, me[2]);
        td_comm_destroy(host);
    }
    free(all);
}

/* Runs every case on `w` (this rank's world group) and prints the rank's tally. */
static int test_comm_matrix_run(td_comm *w) {
    world = w;
    rank = td_comm_rank(w);
    size = td_comm_size(w);
    RUN(allreduce_reduce_every_dtype_op_size);
    RUN(reduce_scatter_every_dtype_op_size);
    RUN(data_movement_every_dtype_size);
    RUN(nonblocking_collectives_complete_in_order);
    RUN(p2p_keeps_order_per_tag);
    RUN(split_by_parity);
    RUN(hosts_are_consistent);
    RUN(mismatched_collectives_are_reported);
    RUN(argument_error_on_one_rank_is_told_to_all);
    RUN(waits_are_bounded);
    RUN(collective_timeout_names_the_collective);
    /* Not "P passed, F failed" at the start of a line: only the launcher's counts count. */
    printf("rank %d of %d: %d passed, %d failed\n", rank, size, test_passed, test_failed);
    fflush(stdout);
    return test_failed ? 1 : 0;
}

#endif
