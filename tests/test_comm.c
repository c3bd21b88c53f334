/* Process groups on the shm backend, with real forked ranks: every collective against a serial
 * reference over dtypes, ops, odd sizes (0, 1, 7, 1009, larger than a shared-memory chunk,
 * several MB) and world sizes 1-4; in-place calls; non-blocking calls with several outstanding;
 * point-to-point ordering, tags and large two-way isend/irecv; sub-groups working
 * concurrently with their parent; parameter checks and the environment contract. */
#include <math.h>
#include <sched.h>
#include <stdlib.h>

#include "test_comm_util.h"

#define BIG_BYTES (1100u * 1024u) /* over two of the backend's 512 KiB chunks */

static const td_dtype all_dtypes[] = {TD_F32, TD_F64, TD_BF16, TD_F16, TD_I32, TD_I64, TD_U8};

/* The test value of rank r at element i: small integers, so float sums are exact. */
static double gen(int r, size_t i, td_reduce_op op) {
    if (op == TD_OP_PROD)
        return (double)((r * 7 + i * 13) % 5) - 2.0 + (((r + i) % 5) == 2 ? 0.5 : 0.0);
    return (double)((r * 37 + i * 11) % 61) - 30.0;
}

static int is_float(td_dtype t) {
    return t == TD_F32 || t == TD_F64 || t == TD_BF16 || t == TD_F16;
}

/* The element as the collective sees it (after rounding to the dtype). */
static double input(td_dtype t, int r, size_t i, td_reduce_op op) {
    unsigned char tmp[8];
    test_elem_put(t, tmp, 0, gen(r, i, op));
    return test_elem_get(t, tmp, 0);
}

/* Serial reference of op over ranks 0..n-1 at element i, folded in rank order with the
 * documented semantics: floats in f32 (f64 for f64), integers wrapping, AVG truncating. */
static double reference(td_dtype t, td_reduce_op op, int n, size_t i) {
    if (is_float(t) && t != TD_F64) {
        float acc = (float)input(t, 0, i, op);
        for (int r = 1; r < n; r++) {
            float x = (float)input(t, r, i, op);
            acc = op == TD_OP_PROD  ? acc * x
                  : op == TD_OP_MIN ? (x < acc ? x : acc)
                  : op == TD_OP_MAX ? (x > acc ? x : acc)
                                    : acc + x;
        }
        if (op == TD_OP_AVG) acc /= (float)n;
        unsigned char tmp[8];
        test_elem_put(t, tmp, 0, acc);
        return test_elem_get(t, tmp, 0);
    }
    if (t == TD_F64) {
        double acc = input(t, 0, i, op);
        for (int r = 1; r < n; r++) {
            double x = input(t, r, i, op);
            acc = op == TD_OP_PROD  ? acc * x
                  : op == TD_OP_MIN ? (x < acc ? x : acc)
                  : op == TD_OP_MAX ? (x > acc ? x : acc)
                                    : acc + x;
        }
        return op == TD_OP_AVG ? acc / n : acc;
    }
    int64_t acc = (int64_t)input(t, 0, i, op);
    for (int r = 1; r < n; r++) {
        int64_t x = (int64_t)input(t, r, i, op);
        acc = op == TD_OP_PROD  ? acc * x
              : op == TD_OP_MIN ? (x < acc ? x : acc)
              : op == TD_OP_MAX ? (x > acc ? x : acc)
                                : acc + x;
    }
    if (op == TD_OP_AVG) acc /= n;
    unsigned char tmp[8];
    test_elem_put(t, tmp, 0, (double)acc);
    return test_elem_get(t, tmp, 0);
}

static double tolerance(td_dtype t, double ref) {
    double mag = ref < 0 ? -ref : ref;
    if (t == TD_F32) return 1e-5 * (1 + mag);
    if (t == TD_F64) return 1e-12 * (1 + mag);
    if (t == TD_BF16 || t == TD_F16) return 1e-2 * (1 + mag);
    return 0;
}

static size_t big_count(td_dtype t) { return BIG_BYTES / td_dtype_size(t) + 7; }

static void *fill(td_dtype t, size_t count, int rank, td_reduce_op op, size_t offset) {
    unsigned char *b = malloc(count * td_dtype_size(t) + 1);
    for (size_t i = 0; i < count; i++) test_elem_put(t, b, i, gen(rank, offset + i, op));
    return b;
}

/* Returns 1 when every element matches (and reports only the first miss). */
static int compare(const char *what, td_dtype t, td_reduce_op op, int n, const void *got,
                   size_t count, size_t offset) {
    for (size_t i = 0; i < count; i++) {
        double ref = reference(t, op, n, offset + i), g = test_elem_get(t, got, i);
        if (!(g - ref <= tolerance(t, ref) && ref - g <= tolerance(t, ref))) {
            TEST_FAIL_AT("%s %s %s n=%d count=%zu: element %zu is %.9g, expected %.9g", what,
                         td_dtype_name(t), td_reduce_op_name(op), n, count, i, g, ref);
            return 0;
        }
    }
    return 1;
}

static void check_allreduce(td_comm *c, td_dtype t, td_reduce_op op, size_t count, int in_place) {
    int r = td_comm_rank(c), n = td_comm_size(c);
    void *send = fill(t, count, r, op, 0);
    void *recv = in_place ? send : malloc(count * td_dtype_size(t) + 1);
    CHECK_OK(td_comm_allreduce(c, send, recv, count, t, op));
    compare(in_place ? "allreduce in place" : "allreduce", t, op, n, recv, count, 0);
    if (!in_place) {
        /* The send buffer is left alone. */
        void *again = fill(t, count, r, op, 0);
        CHECK(memcmp(again, send, count * td_dtype_size(t)) == 0);
        free(again);
        free(recv);
    }
    free(send);
}

static void check_reductions(td_comm *c, td_dtype t, td_reduce_op op, size_t count) {
    int r = td_comm_rank(c), n = td_comm_size(c);
    size_t es = td_dtype_size(t);
    /* reduce to the last rank */
    int root = n - 1;
    void *send = fill(t, count, r, op, 0), *recv = malloc(count * es + 1);
    CHECK_OK(td_comm_reduce(c, send, r == root ? recv : NULL, count, t, op, root));
    if (r == root) compare("reduce", t, op, n, recv, count, 0);
    free(send);
    free(recv);
    /* reduce_scatter: rank r gets block r of the n * count reduction */
    send = fill(t, (size_t)n * count, r, op, 0);
    recv = malloc(count * es + 1);
    CHECK_OK(td_comm_reduce_scatter(c, send, recv, count, t, op));
    compare("reduce_scatter", t, op, n, recv, count, (size_t)r * count);
    /* and in place, NCCL style: recv is this rank's block of send */
    void *send2 = fill(t, (size_t)n * count, r, op, 0);
    CHECK_OK(
        td_comm_reduce_scatter(c, send2, (char *)send2 + (size_t)r * count * es, count, t, op));
    compare("reduce_scatter in place", t, op, n, (char *)send2 + (size_t)r * count * es, count,
            (size_t)r * count);
    free(send);
    free(send2);
    free(recv);
}

/* Data movers: the value of rank r's element i is gen(r, i) regardless of dtype. */
static void check_movers(td_comm *c, td_dtype t, size_t count) {
    int r = td_comm_rank(c), n = td_comm_size(c);
    size_t es = td_dtype_size(t);
    unsigned char tmp[8];
    for (int root = 0; root < n; root += (n > 2 ? n - 1 : 1)) {
        /* broadcast */
        void *buf = r == root ? fill(t, count, root, TD_OP_SUM, 0) : calloc(count + 1, es);
        CHECK_OK(td_comm_broadcast(c, buf, count, t, root));
        void *want = fill(t, count, root, TD_OP_SUM, 0);
        CHECK(memcmp(buf, want, count * es) == 0);
        free(buf);
        free(want);
        /* scatter: root's block i goes to rank i */
        void *send = r == root ? fill(t, (size_t)n * count, root, TD_OP_SUM, 0) : NULL;
        void *recv = calloc(count + 1, es);
        CHECK_OK(td_comm_scatter(c, send, recv, count, t, root));
        for (size_t i = 0; i < count; i++) {
            test_elem_put(t, tmp, 0, gen(root, (size_t)r * count + i, TD_OP_SUM));
            if (memcmp(tmp, (char *)recv + i * es, es) != 0) {
                TEST_FAIL_AT("scatter %s count %zu root %d: rank %d element %zu wrong",
                             td_dtype_name(t), count, root, r, i);
                break;
            }
        }
        free(send);
        free(recv);
        /* gather */
        send = fill(t, count, r, TD_OP_SUM, 0);
        recv = r == root ? calloc((size_t)n * count + 1, es) : NULL;
        CHECK_OK(td_comm_gather(c, send, recv, count, t, root));
        for (int j = 0; r == root && j < n; j++) {
            void *w = fill(t, count, j, TD_OP_SUM, 0);
            if (memcmp(w, (char *)recv + (size_t)j * count * es, count * es) != 0)
                TEST_FAIL_AT("gather %s count %zu root %d: block %d wrong", td_dtype_name(t), count,
                             root, j);
            free(w);
        }
        free(send);
        free(recv);
    }
    /* allgather, then in place (send is this rank's block of recv), then with send == recv
     * (the input is where send points: recv's first block, on every rank) */
    void *send = fill(t, count, r, TD_OP_SUM, 0);
    void *recv = calloc((size_t)n * count + 1, es), *recv2 = calloc((size_t)n * count + 1, es);
    void *recv3 = calloc((size_t)n * count + 1, es);
    CHECK_OK(td_comm_allgather(c, send, recv, count, t));
    memcpy((char *)recv2 + (size_t)r * count * es, send, count * es);
    CHECK_OK(td_comm_allgather(c, (char *)recv2 + (size_t)r * count * es, recv2, count, t));
    memcpy(recv3, send, count * es);
    CHECK_OK(td_comm_allgather(c, recv3, recv3, count, t));
    for (int j = 0; j < n; j++) {
        void *w = fill(t, count, j, TD_OP_SUM, 0);
        if (memcmp(w, (char *)recv + (size_t)j * count * es, count * es) != 0)
            TEST_FAIL_AT("allgather %s count %zu: rank %d block %d wrong", td_dtype_name(t), count,
                         r, j);
        if (memcmp(w, (char *)recv2 + (size_t)j * count * es, count * es) != 0)
            TEST_FAIL_AT("allgather in place %s count %zu: rank %d block %d wrong",
                         td_dtype_name(t), count, r, j);
        if (memcmp(w, (char *)recv3 + (size_t)j * count * es, count * es) != 0)
            TEST_FAIL_AT("allgather send == recv %s count %zu: rank %d block %d wrong",
                         td_dtype_name(t), count, r, j);
        free(w);
    }
    /* gather with send == recv at every rank, root n - 1 */
    memset(recv3, 0, (size_t)n * count * es);
    memcpy(recv3, send, count * es);
    CHECK_OK(td_comm_gather(c, recv3, recv3, count, t, n - 1));
    for (int j = 0; r == n - 1 && j < n; j++) {
        void *w = fill(t, count, j, TD_OP_SUM, 0);
        if (memcmp(w, (char *)recv3 + (size_t)j * count * es, count * es) != 0)
            TEST_FAIL_AT("gather send == recv %s count %zu: block %d wrong", td_dtype_name(t),
                         count, j);
        free(w);
    }
    free(send);
    free(recv);
    free(recv2);
    free(recv3);
    /* alltoall: rank r's recv block j = rank j's send block r; and in place */
    send = fill(t, (size_t)n * count, r, TD_OP_SUM, 0);
    recv = calloc((size_t)n * count + 1, es);
    CHECK_OK(td_comm_alltoall(c, send, recv, count, t));
    CHECK_OK(td_comm_alltoall(c, send, send, count, t));
    for (int j = 0; j < n; j++) {
        void *w = fill(t, count, j, TD_OP_SUM, (size_t)r * count);
        if (memcmp(w, (char *)recv + (size_t)j * count * es, count * es) != 0)
            TEST_FAIL_AT("alltoall %s count %zu: rank %d block %d wrong", td_dtype_name(t), count,
                         r, j);
        if (memcmp(w, (char *)send + (size_t)j * count * es, count * es) != 0)
            TEST_FAIL_AT("alltoall in place %s count %zu: rank %d block %d wrong", td_dtype_name(t),
                         count, r, j);
        free(w);
    }
    free(send);
    free(recv);
    CHECK_OK(td_comm_barrier(c));
}

typedef struct {
    int full; /* every dtype x op for allreduce */
} matrix_arg;

static void matrix_rank(int rank, int size, int port, void *arg) {
    const matrix_arg *m = arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 30));
    if (!c) return;
    CHECK_EQ(td_comm_rank(c), rank);
    CHECK_EQ(td_comm_size(c), size);
    CHECK(strcmp(td_comm_backend_name(c), "shm") == 0);
    size_t sizes[] = {0, 1, 7, 1009, 0};
    for (size_t d = 0; d < sizeof all_dtypes / sizeof *all_dtypes; d++) {
        td_dtype t = all_dtypes[d];
        sizes[4] = big_count(t);
        int small_dtype = t == TD_F32 || t == TD_I32 || t == TD_BF16;
        for (int op = 0; op < TD_OP_COUNT; op++) {
            if (!m->full &&
                !(small_dtype && (op == TD_OP_SUM || op == TD_OP_MAX || op == TD_OP_AVG)))
                continue;
            for (size_t s = 0; s < 5; s++) {
                /* The big size runs SUM and AVG for every dtype, the rest of the ops at 1009. */
                if (s == 4 && op != TD_OP_SUM && op != TD_OP_AVG &&
                    !(op == TD_OP_MAX && t == TD_F32))
                    continue;
                check_allreduce(c, t, (td_reduce_op)op, sizes[s], 0);
            }
            check_allreduce(c, t, (td_reduce_op)op, 1009, 1);
        }
    }
    check_allreduce(c, TD_F32, TD_OP_SUM, big_count(TD_F32), 1);
    td_dtype red_types[] = {TD_F32, TD_I64, TD_BF16, TD_U8};
    for (int d = 0; d < 4; d++)
        for (int op = 0; op < TD_OP_COUNT; op += (m->full ? 1 : 2)) {
            size_t counts[] = {0, 1, 1009, big_count(red_types[d]) / (size_t)size};
            for (int s = 0; s < 4; s++) {
                if (s == 3 && op != TD_OP_SUM) continue;
                check_reductions(c, red_types[d], (td_reduce_op)op, counts[s]);
            }
        }
    td_dtype move_types[] = {TD_F32, TD_U8, TD_F64};
    for (int d = 0; d < 3; d++) {
        size_t counts[] = {0, 1, 7, 1009, big_count(move_types[d]) / (size_t)size};
        for (int s = 0; s < 5; s++) check_movers(c, move_types[d], counts[s]);
    }
    td_comm_destroy(c);
}

static void run_matrix(int n, int full) {
    matrix_arg m = {full};
    CHECK_EQ(test_run_ranks(n, matrix_rank, &m, 120, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

static void world_1(void) { run_matrix(1, 1); }
static void world_2_full_matrix(void) { run_matrix(2, 1); }
static void world_3_full_matrix(void) { run_matrix(3, 1); }
static void world_4(void) { run_matrix(4, 0); }

/* Buffers of several MB, where the pipeline cuts chunks above its 512 KiB minimum (an eighth
 * of the stream) with a short last one: every collective still matches the reference. */
static void large_chunks_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 60));
    if (!c) return;
    size_t count = (9u << 20) / sizeof(float) + 7;
    check_allreduce(c, TD_F32, TD_OP_SUM, count, 0);
    check_allreduce(c, TD_F32, TD_OP_MAX, count, 1);
    check_reductions(c, TD_F32, TD_OP_SUM, count);
    check_movers(c, TD_F32, count);
    td_comm_destroy(c);
}

static void large_chunks(void) {
    for (int n = 2; n <= 3; n++) CHECK_EQ(test_run_ranks(n, large_chunks_rank, NULL, 120, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* Rank r's value at element i for the fixed-tree sums: magnitudes spread over 2^-12 .. 2^12,
 * so that the order of addition shows in the bits. */
static float tree_value(int r, size_t i) {
    td_rng g;
    td_rng_init(&g, 7919u * (uint64_t)r + i);
    return (td_rng_uniform(&g) - 0.5f) * ldexpf(1.0f, (int)(td_rng_u32(&g) % 25) - 12);
}

/* The pairwise tree over the ranks, as one process adds it, and the left-to-right sum. */
static float tree_want(int w, size_t i, int pairwise) {
    float v[8] = {0};
    for (int r = 0; r < w && r < 8; r++) v[r] = tree_value(r, i);
    if (!pairwise) {
        float s = v[0];
        for (int r = 1; r < w; r++) s += v[r];
        return s;
    }
    for (int stride = 1; stride < w; stride *= 2)
        for (int r = 0; r + stride < w; r += 2 * stride) v[r] = v[r] + v[r + stride];
    return v[0];
}

static void tree_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 30));
    if (!c) return;
    size_t counts[] = {1, 1037, 4096}; /* uneven and even among 3 and 4 ranks */
    for (int k = 0; k < 3; k++) {
        size_t n = counts[k] * (size_t)size;
        float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
        for (size_t i = 0; i < n; i++) x[i] = tree_value(rank, i);
        CHECK_OK(td_comm_allreduce_tree(c, x, y, counts[k], TD_F32));
        size_t wrong = 0, differs = 0;
        for (size_t i = 0; i < counts[k]; i++) {
            wrong += memcmp(&y[i], &(float){tree_want(size, i, 1)}, 4) != 0;
            differs += tree_want(size, i, 1) != tree_want(size, i, 0);
        }
        CHECK_EQ(wrong, 0);
        CHECK_OK(td_comm_allreduce_tree(c, x, x, counts[k], TD_F32)); /* in place */
        CHECK(memcmp(x, y, counts[k] * sizeof *x) == 0);
        for (size_t i = 0; i < n; i++) x[i] = tree_value(rank, i);
        CHECK_OK(td_comm_reduce_scatter_tree(c, x, y, counts[k], TD_F32));
        for (size_t i = 0; i < counts[k]; i++)
            wrong += memcmp(&y[i], &(float){tree_want(size, (size_t)rank * counts[k] + i, 1)}, 4);
        CHECK_EQ(wrong, 0);
        /* at 4 ranks the tree is not the left-to-right order of a plain reduction */
        if (size == 4 && counts[k] > 1) CHECK(differs > 0);
        free(x);
        free(y);
    }
    CHECK_EQ(td_comm_allreduce_tree(c, &(double){1}, &(double){1}, 1, TD_F64), TD_EDTYPE);
    td_comm_destroy(c);
}

/* td_comm_allreduce_tree and td_comm_reduce_scatter_tree add in the pairwise tree over the ranks
 * one process computes, bit for bit, at 1 to 4 ranks. */
static void tree_sums_are_one_processs_pairwise_tree(void) {
    for (int n = 1; n <= 4; n++) CHECK_EQ(test_run_ranks(n, tree_rank, NULL, 60, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* Several non-blocking collectives outstanding at once, completed out of order. */
static void nonblocking_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 30));
    if (!c) return;
    enum { K = 6 };
    size_t count = 100003;
    float *bufs[K];
    td_request *reqs[K];
    for (int k = 0; k < K; k++) {
        bufs[k] = malloc(count * sizeof(float));
        for (size_t i = 0; i < count; i++) bufs[k][i] = (float)(rank + k + (i % 7));
        CHECK_OK(td_comm_iallreduce(c, bufs[k], bufs[k], count, TD_F32, TD_OP_SUM, &reqs[k]));
    }
    int32_t gathered[8] = {0}, mine = 100 + rank;
    td_request *g, *b;
    CHECK_OK(td_comm_iallgather(c, &mine, gathered, 1, TD_I32, &g));
    CHECK_OK(td_comm_ibarrier(c, &b));
    /* A blocking call queues behind the pending ones. */
    double x = rank, sum = 0;
    CHECK_OK(td_comm_allreduce(c, &x, &sum, 1, TD_F64, TD_OP_SUM));
    CHECK_NEAR(sum, size * (size - 1) / 2.0, 0);
    int done = 0;
    for (int spins = 0; !done && spins < 100000; spins++) {
        CHECK_OK(td_request_test(b, &done));
        if (!done) test_sleep_ms(1);
    }
    CHECK(done);
    CHECK_OK(td_request_wait(g));
    for (int j = 0; j < size; j++) CHECK_EQ(gathered[j], 100 + j);
    for (int k = K - 1; k >= 0; k--) {
        CHECK_OK(td_request_wait(reqs[k]));
        for (size_t i = 0; i < count; i += 997) {
            float want = 0;
            for (int r = 0; r < size; r++) want += (float)(r + k + (i % 7));
            CHECK_NEAR(bufs[k][i], want, 0);
        }
        free(bufs[k]);
    }
    /* Destroy waits for work still queued. */
    float last = 1, out = 0;
    td_request *tail;
    CHECK_OK(td_comm_iallreduce(c, &last, &out, 1, TD_F32, TD_OP_SUM, &tail));
    CHECK_OK(td_request_wait(tail));
    CHECK_NEAR(out, size, 0);
    td_comm_destroy(c);
}

static void nonblocking(void) {
    CHECK_EQ(test_run_ranks(3, nonblocking_rank, NULL, 60, 0), 0);
    CHECK_EQ(test_run_ranks(2, nonblocking_rank, NULL, 60, 0), 0);
}

static void p2p_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 30));
    if (!c) return;
    /* Ordering and tags: rank 0 sends tag 1 five times, then tag 2 three times; rank 1 takes
     * tag 2 first (so tag 1 waits as unexpected data), then tag 1 in order. */
    if (rank == 0) {
        for (int i = 0; i < 5; i++) CHECK_OK(td_comm_send(c, &i, 1, TD_I32, 1, 1));
        for (int i = 0; i < 3; i++) {
            int v = 100 + i;
            CHECK_OK(td_comm_send(c, &v, 1, TD_I32, 1, 2));
        }
    } else if (rank == 1) {
        for (int i = 0; i < 3; i++) {
            int v = -1;
            CHECK_OK(td_comm_recv(c, &v, 1, TD_I32, 0, 2));
            CHECK_EQ(v, 100 + i);
        }
        for (int i = 0; i < 5; i++) {
            int v = -1;
            CHECK_OK(td_comm_recv(c, &v, 1, TD_I32, 0, 1));
            CHECK_EQ(v, i);
        }
    }
    /* Large messages both ways at once, isend before irecv on every rank (a ring). */
    size_t count = 3 * 1000 * 1000 + 7; /* 12 MB: much larger than a mailbox */
    float *out = malloc(count * sizeof(float)), *in = malloc(count * sizeof(float));
    for (size_t i = 0; i < count; i++) out[i] = (float)(rank * 1000003 + i % 65536);
    int to = (rank + 1) % size, from = (rank + size - 1) % size;
    td_request *s, *r;
    CHECK_OK(td_comm_isend(c, out, count, TD_F32, to, 7, &s));
    CHECK_OK(td_comm_irecv(c, in, count, TD_F32, from, 7, &r));
    CHECK_OK(td_request_wait(s));
    CHECK_OK(td_request_wait(r));
    size_t bad = 0;
    for (size_t i = 0; i < count; i++) bad += in[i] != (float)(from * 1000003 + i % 65536);
    CHECK_EQ(bad, 0);
    /* Zero-byte messages and a size mismatch that the receiver reports. */
    if (rank == 0) {
        CHECK_OK(td_comm_send(c, NULL, 0, TD_F32, 1, 9));
        int64_t two[2] = {1, 2};
        CHECK_OK(td_comm_send(c, two, 2, TD_I64, 1, 10));
    } else if (rank == 1) {
        CHECK_OK(td_comm_recv(c, NULL, 0, TD_F32, 0, 9));
        int64_t one;
        CHECK_STATUS(td_comm_recv(c, &one, 1, TD_I64, 0, 10), TD_EMISMATCH);
        CHECK(strstr(td_last_error(), "16") != NULL);
    }
    /* Point-to-point while a collective runs on the progress thread, completed by polling. */
    td_request *coll;
    CHECK_OK(td_comm_iallreduce(c, out, in, count, TD_F32, TD_OP_MAX, &coll));
    int64_t token = rank * 10, got = -1;
    CHECK_OK(td_comm_isend(c, &token, 1, TD_I64, to, 11, &s));
    CHECK_OK(td_comm_irecv(c, &got, 1, TD_I64, from, 11, &r));
    int sent = 0, recvd = 0;
    uint64_t give_up = td_time_ns() + 20000000000ull;
    while ((!sent || !recvd) && td_time_ns() < give_up) {
        if (!sent) CHECK_OK(td_request_test(s, &sent));
        if (!recvd) CHECK_OK(td_request_test(r, &recvd));
        if (!sent || !recvd) sched_yield();
    }
    CHECK(sent && recvd);
    CHECK_EQ(got, from * 10);
    CHECK_OK(td_request_wait(coll));
    CHECK_NEAR(in[5], (float)((size - 1) * 1000003 + 5), 0);
    CHECK_STATUS(td_comm_send(c, out, 1, TD_F32, size, 0), TD_EINVAL);
    CHECK_OK(td_comm_barrier(c));
    free(out);
    free(in);
    td_comm_destroy(c);
}

static void point_to_point(void) {
    CHECK_EQ(test_run_ranks(2, p2p_rank, NULL, 60, 0), 0);
    CHECK_EQ(test_run_ranks(3, p2p_rank, NULL, 60, 0), 0);
}

/* As MPI users expect: a rank sends to itself, before or after posting the receive and at any
 * size; a negative tag is refused; waitall completes a mixed set and names a failure. */
static void p2p_mpi_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 30));
    if (!c) return;
    size_t big = 1u << 20; /* 4 MB: far over the 256 KiB mailbox of a pair */
    float *out = malloc(big * sizeof(float)), *in = calloc(big, sizeof(float));
    for (size_t i = 0; i < big; i++) out[i] = (float)(rank + i % 977);
    CHECK_OK(td_comm_send(c, out, big, TD_F32, rank, 3)); /* blocking, nobody receiving yet */
    CHECK_OK(td_comm_recv(c, in, big, TD_F32, rank, 3));
    CHECK(memcmp(in, out, big * sizeof(float)) == 0);
    int32_t a = -1, b = -1, one = 1, two = 2;
    td_request *reqs[5] = {NULL};
    CHECK_OK(td_comm_irecv(c, &a, 1, TD_I32, rank, 4, &reqs[0])); /* receive posted first */
    CHECK_OK(td_comm_isend(c, &one, 1, TD_I32, rank, 4, &reqs[1]));
    CHECK_OK(td_comm_isend(c, &two, 1, TD_I32, rank, 4, &reqs[2]));
    CHECK_OK(td_comm_irecv(c, &b, 1, TD_I32, rank, 4, &reqs[3]));
    int to = (rank + 1) % size, from = (rank + size - 1) % size, got = -1;
    CHECK_OK(td_comm_isend(c, &rank, 1, TD_I32, to, 5, &reqs[4]));
    CHECK_OK(td_comm_recv(c, &got, 1, TD_I32, from, 5));
    CHECK_OK(td_request_waitall(5, reqs));
    for (int i = 0; i < 5; i++) CHECK(reqs[i] == NULL);
    CHECK_EQ(a, 1);
    CHECK_EQ(b, 2); /* in the order sent */
    CHECK_EQ(got, from);
    CHECK_STATUS(td_comm_send(c, &one, 1, TD_I32, to, -1), TD_EINVAL);
    CHECK(strstr(td_last_error(), "tag -1") != NULL);
    /* A size mismatch to oneself, reported by waitall with the request's index. */
    int64_t wide = 0;
    td_request *mixed[2] = {NULL};
    CHECK_OK(td_comm_isend(c, &one, 1, TD_I32, rank, 6, &mixed[0]));
    CHECK_OK(td_comm_irecv(c, &wide, 1, TD_I64, rank, 6, &mixed[1]));
    CHECK_STATUS(td_request_waitall(2, mixed), TD_EMISMATCH);
    CHECK(strstr(td_last_error(), "request 1") != NULL);
    CHECK_OK(td_comm_barrier(c)); /* still a working group */
    free(out);
    free(in);
    td_comm_destroy(c);
}

static void point_to_point_as_in_mpi(void) {
    CHECK_EQ(test_run_ranks(2, p2p_mpi_rank, NULL, 60, 0), 0);
}

/* Arguments rejected on one rank only: every rank learns what failed, from whom and in which
 * call, and the group goes on working. */
static void one_bad_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 30));
    if (!c) return;
    float x[4] = {1, 2, 3, 4}, y[4];
    CHECK_STATUS(td_comm_allreduce(c, x, rank == 1 ? NULL : y, 4, TD_F32, TD_OP_SUM), TD_EINVAL);
    CHECK(strstr(td_last_error(), "rank 1: allreduce #0") != NULL);
    CHECK(strstr(td_last_error(), "recv is NULL") != NULL);
    float s[8] = {0}, r = -1;
    /* scatter with send = NULL on the root: the other ranks are told, not left waiting */
    CHECK_STATUS(td_comm_scatter(c, rank == 0 ? NULL : s, &r, 1, TD_F32, 0), TD_EINVAL);
    CHECK(strstr(td_last_error(), "rank 0: scatter #1") != NULL);
    CHECK_OK(td_comm_allreduce(c, x, y, 4, TD_F32, TD_OP_SUM));
    CHECK_NEAR(y[3], 4.0 * size, 0);
    td_comm_destroy(c);
}

static void argument_error_on_one_rank_is_told_to_all(void) {
    CHECK_EQ(test_run_ranks(3, one_bad_rank, NULL, 30, 0), 0);
}

/* td_comm_agree: the same verdict on every rank, naming the rank that differs or failed. */
typedef struct {
    int64_t micro_batches, seed;
} agree_sig;

static void describe_agree_sig(const void *sig, const void *other, char *out, size_t cap,
                               void *ctx) {
    const agree_sig *a = sig, *b = other;
    (void)ctx;
    if (a->micro_batches != b->micro_batches)
        snprintf(out, cap, "micro_batches = %lld", (long long)a->micro_batches);
    else
        snprintf(out, cap, "seed %lld", (long long)a->seed);
}

static void agree_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 30));
    if (!c) return;
    agree_sig sig = {4, 7};
    td_comm_agreement a = {.what = "demo",
                           .sig = &sig,
                           .bytes = sizeof sig,
                           .describe = describe_agree_sig,
                           .hint = "; pass the same"};
    CHECK_OK(td_comm_agree(c, &a));
    /* Two ranks differ: the lowest is named, with what each side has. */
    if (rank >= 2) sig.micro_batches = 2;
    CHECK_STATUS(td_comm_agree(c, &a), TD_EMISMATCH);
    CHECK(strstr(td_last_error(),
                 "demo: rank 0 has micro_batches = 4 but rank 2 has micro_batches = 2; pass the "
                 "same") != NULL);
    sig.micro_batches = 4;
    if (rank == 1) sig.seed = 9;
    a.mismatch = TD_ESHAPE;
    CHECK_STATUS(td_comm_agree(c, &a), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "rank 0 has seed 7 but rank 1 has seed 9") != NULL);
    /* A rank that failed getting ready: its status and message reach every rank, before any
     * difference in the signatures. */
    const char *why = "td_comm_set_timeout: need a group and seconds > 0";
    if (rank == 2) {
        a.local = td_comm_set_timeout(c, -1);
        CHECK_STATUS(td_comm_agree(c, &a), TD_EINVAL);
        CHECK_EQ(strcmp(td_last_error(), why), 0);
    } else {
        CHECK_STATUS(td_comm_agree(c, &a), TD_EINVAL);
        char want[128];
        snprintf(want, sizeof want, "demo: rank 2: %s", why);
        CHECK_EQ(strcmp(td_last_error(), want), 0);
    }
    /* The group is still in step. */
    a.local = TD_OK;
    sig.seed = 7;
    CHECK_OK(td_comm_agree(c, &a));
    td_comm_destroy(c);
}

static void agreement_is_the_same_verdict_everywhere(void) {
    CHECK_EQ(test_run_ranks(4, agree_rank, NULL, 30, 0), 0);
}

/* td_comm_abort ends the group for every rank at once, naming who ended it. */
static void abort_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 30));
    if (!c) return;
    CHECK_OK(td_comm_barrier(c));
    if (rank == 1) {
        CHECK_OK(td_comm_abort(c));
        CHECK_STATUS(td_comm_barrier(c), TD_ESTATE);
    } else {
        uint64_t t0 = td_time_ns();
        CHECK_STATUS(td_comm_barrier(c), TD_EPEER); /* rank 1 never comes */
        CHECK(strstr(td_last_error(), "aborted by rank 1") != NULL);
        CHECK((double)(td_time_ns() - t0) < 5e9); /* at once, not at the 30 s timeout */
    }
    td_comm_destroy(c);
}

static void abort_ends_the_group_everywhere(void) {
    CHECK_EQ(test_run_ranks(3, abort_rank, NULL, 30, 0), 0);
}

static void subgroup_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *world = NULL, *half = NULL, *pair = NULL, *none = NULL;
    CHECK_OK(test_comm_create(&world, rank, size, port, 30));
    if (!world) return;
    /* Split by parity, ordered by descending key. */
    CHECK_OK(td_comm_split(world, rank % 2, -rank, &half));
    CHECK(half != NULL);
    if (!half) return;
    CHECK_EQ(td_comm_size(half), size / 2);
    CHECK_EQ(td_comm_rank(half), (size - 1 - rank) / 2);
    /* new_group in list order; the ranks outside get NULL. */
    int list[2] = {3, 1};
    CHECK_OK(td_comm_new_group(world, list, 2, &pair));
    CHECK((pair != NULL) == (rank == 1 || rank == 3));
    if (pair) CHECK_EQ(td_comm_rank(pair), rank == 3 ? 0 : 1);
    CHECK_OK(td_comm_split(world, -1, 0, &none));
    CHECK(none == NULL);
    /* The parent and the child groups run at the same time. */
    size_t count = 400000;
    float *a = malloc(count * sizeof(float)), *b = malloc(count * sizeof(float));
    for (size_t i = 0; i < count; i++) {
        a[i] = (float)(rank + 1);
        b[i] = (float)(rank * 2);
    }
    td_request *ra;
    CHECK_OK(td_comm_iallreduce(world, a, a, count, TD_F32, TD_OP_SUM, &ra));
    CHECK_OK(td_comm_allreduce(half, b, b, count, TD_F32, TD_OP_MAX));
    int32_t v = rank, got = -1;
    if (pair) {
        CHECK_OK(td_comm_allreduce(pair, &v, &got, 1, TD_I32, TD_OP_MIN));
        CHECK_EQ(got, 1);
    }
    CHECK_OK(td_request_wait(ra));
    float want_a = (float)(size * (size + 1) / 2);
    float want_b = (float)(2 * (rank % 2 ? size - 1 : size - 2));
    size_t bad = 0;
    for (size_t i = 0; i < count; i++) bad += a[i] != want_a || b[i] != want_b;
    CHECK_EQ(bad, 0);
    /* A grandchild group, and destroying children before the parent. */
    td_comm *solo = NULL;
    CHECK_OK(td_comm_split(half, td_comm_rank(half), 0, &solo));
    CHECK(solo && td_comm_size(solo) == 1);
    double one = 2.5, out = 0;
    CHECK_OK(td_comm_allreduce(solo, &one, &out, 1, TD_F64, TD_OP_AVG));
    CHECK_NEAR(out, 2.5, 0);
    td_comm_destroy(solo);
    td_comm_destroy(pair);
    td_comm_destroy(half);
    CHECK_OK(td_comm_barrier(world));
    td_comm_destroy(world);
    free(a);
    free(b);
}

static void subgroups(void) {
    CHECK_EQ(test_run_ranks(4, subgroup_rank, NULL, 60, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

static void bad_arguments_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 30));
    if (!c) return;
    float x[4] = {0};
    CHECK_STATUS(td_comm_allreduce(c, NULL, x, 4, TD_F32, TD_OP_SUM), TD_EINVAL);
    CHECK(strstr(td_last_error(), "send") != NULL);
    CHECK_STATUS(td_comm_allreduce(c, x, x, 4, (td_dtype)42, TD_OP_SUM), TD_EDTYPE);
    CHECK_STATUS(td_comm_allreduce(c, x, x, 4, TD_F32, (td_reduce_op)9), TD_EINVAL);
    CHECK_STATUS(td_comm_broadcast(c, x, 4, TD_F32, size), TD_EINVAL);
    CHECK(strstr(td_last_error(), "root") != NULL);
    CHECK_STATUS(td_comm_reduce(c, x, x, 4, TD_F32, TD_OP_SUM, -1), TD_EINVAL);
    CHECK_STATUS(td_comm_iallreduce(c, x, x, 4, TD_F32, TD_OP_SUM, NULL), TD_EINVAL);
    /* Zero elements need no buffers; the rejected calls above counted on every rank alike, so
     * the ranks still agree afterwards. */
    CHECK_OK(td_comm_allreduce(c, NULL, NULL, 0, TD_F32, TD_OP_SUM));
    CHECK_OK(td_comm_set_timeout(c, 10));
    CHECK_STATUS(td_comm_set_timeout(c, 0), TD_EINVAL);
    td_comm_destroy(c);
}

static void argument_checks(void) {
    CHECK_EQ(test_run_ranks(2, bad_arguments_rank, NULL, 30, 0), 0);
}

/* The env contract: torchrun's variables give the shape; a missing one is named. */
static void env_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    char v[32];
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("PMIX_RANK");
    snprintf(v, sizeof v, "%d", rank);
    setenv("RANK", v, 1);
    setenv("LOCAL_RANK", v, 1);
    snprintf(v, sizeof v, "%d", size);
    setenv("WORLD_SIZE", v, 1);
    setenv("LOCAL_WORLD_SIZE", v, 1);
    snprintf(v, sizeof v, "%d", port);
    setenv("MASTER_PORT", v, 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("TANDEM_TOKEN", "env-token", 1);
    setenv("TANDEM_TIMEOUT", "20", 1);
    td_comm *c = NULL;
    CHECK_OK(td_comm_create(&c, NULL));
    if (!c) return;
    CHECK_EQ(td_comm_rank(c), rank);
    CHECK_EQ(td_comm_size(c), size);
    CHECK_EQ(td_comm_local_rank(c), rank);
    CHECK_EQ(td_comm_local_size(c), size);
    int32_t one = 1, total = 0;
    CHECK_OK(td_comm_allreduce(c, &one, &total, 1, TD_I32, TD_OP_SUM));
    CHECK_EQ(total, size);
    td_comm_destroy(c);
    /* Missing and malformed variables are named. */
    unsetenv("RANK");
    unsetenv("SLURM_PROCID");
    unsetenv("OMPI_COMM_WORLD_RANK");
    CHECK_STATUS(td_comm_create(&c, NULL), TD_EINVAL);
    CHECK(strstr(td_last_error(), "RANK") != NULL);
    setenv("RANK", "zero", 1);
    CHECK_STATUS(td_comm_create(&c, NULL), TD_EINVAL);
    CHECK(strstr(td_last_error(), "RANK='zero'") != NULL);
    setenv("RANK", "0", 1);
    setenv("TANDEM_TIMEOUT", "-3", 1);
    CHECK_STATUS(td_comm_create(&c, NULL), TD_EINVAL);
    CHECK(strstr(td_last_error(), "TANDEM_TIMEOUT") != NULL);
#ifndef TD_HAVE_MPI
    td_comm_params p = td_comm_default_params();
    p.backend = TD_BACKEND_MPI;
    p.rank = 0;
    p.world_size = 1;
    p.timeout_s = 5;
    CHECK_STATUS(td_comm_create(&c, &p), TD_EUNSUPPORTED);
#endif
}

static void environment(void) { CHECK_EQ(test_run_ranks(2, env_rank, NULL, 30, 0), 0); }

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    RUN(argument_checks);
    RUN(environment);
    RUN(world_1);
    RUN(world_2_full_matrix);
    RUN(world_3_full_matrix);
    RUN(world_4);
    RUN(large_chunks);
    RUN(tree_sums_are_one_processs_pairwise_tree);
    RUN(nonblocking);
    RUN(point_to_point);
    RUN(point_to_point_as_in_mpi);
    RUN(argument_error_on_one_rank_is_told_to_all);
    RUN(agreement_is_the_same_verdict_everywhere);
    RUN(abort_ends_the_group_everywhere);
    RUN(subgroups);
    TEST_END();
}
