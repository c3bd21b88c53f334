/* td_comm_alloc and the zero-copy all-reduce on the shm backend, with real forked ranks:
 * in-place all-reduces on registered buffers at offset 0 and an unaligned offset, for world
 * sizes 1-4, sizes 0, 1, 7, 1009 and over 1 MiB, f32/bf16/i32 and sum/avg/max, against a
 * serial reference, with the bytes around the range checked untouched; the fallback when the
 * ranks disagree (other offsets, other allocations, plain buffers); reduce-scatters from and
 * allgathers into registered buffers, in place or not, and their fallbacks; non-blocking calls
 * on registered buffers; the size mismatch check; and nothing left in /dev/shm afterwards. */
#include <signal.h>
#include <stdlib.h>

#include "test_comm_util.h"

#define BIG_BYTES (1100u * 1024u) /* over two of the backend's 512 KiB chunks */
#define GUARD 64                  /* bytes checked on each side of the reduced range */

static const td_dtype dtypes[] = {TD_F32, TD_BF16, TD_I32};
static const td_reduce_op ops[] = {TD_OP_SUM, TD_OP_AVG, TD_OP_MAX};

/* The test value of rank r at element i: small integers, so float sums are exact. */
static double gen(int r, size_t i) { return (double)((r * 37 + i * 11) % 61) - 30.0; }

static double rounded(td_dtype t, double v) {
    unsigned char tmp[8];
    test_elem_put(t, tmp, 0, v);
    return test_elem_get(t, tmp, 0);
}

/* Serial reference: floats folded in f32 in rank order, integers in int64 (AVG truncates). */
static double reference(td_dtype t, td_reduce_op op, int n, size_t i) {
    if (t != TD_I32) {
        float acc = (float)rounded(t, gen(0, i));
        for (int r = 1; r < n; r++) {
            float x = (float)rounded(t, gen(r, i));
            acc = op == TD_OP_MAX ? (x > acc ? x : acc) : acc + x;
        }
        if (op == TD_OP_AVG) acc /= (float)n;
        return rounded(t, acc);
    }
    int64_t acc = (int64_t)gen(0, i);
    for (int r = 1; r < n; r++) {
        int64_t x = (int64_t)gen(r, i);
        acc = op == TD_OP_MAX ? (x > acc ? x : acc) : acc + x;
    }
    return (double)(op == TD_OP_AVG ? acc / n : acc);
}

static double tolerance(td_dtype t, double ref) {
    double mag = ref < 0 ? -ref : ref;
    return t == TD_F32 ? 1e-5 * (1 + mag) : t == TD_BF16 ? 1e-2 * (1 + mag) : 0;
}

static void fill(td_dtype t, void *buf, size_t count, int rank) {
    for (size_t i = 0; i < count; i++) test_elem_put(t, buf, i, gen(rank, i));
}

/* Returns 1 when every element matches the reference (and reports only the first miss). */
static int compare(const char *what, td_dtype t, td_reduce_op op, int n, const void *got,
                   size_t count) {
    for (size_t i = 0; i < count; i++) {
        double ref = reference(t, op, n, i), g = test_elem_get(t, got, i);
        if (!(g - ref <= tolerance(t, ref) && ref - g <= tolerance(t, ref))) {
            TEST_FAIL_AT("%s %s %s n=%d count=%zu: element %zu is %.9g, expected %.9g", what,
                         td_dtype_name(t), td_reduce_op_name(op), n, count, i, g, ref);
            return 0;
        }
    }
    return 1;
}

/* All-reduces `count` elements in place at byte `off` of `buf` and checks the result and that
 * GUARD bytes on either side (which must lie inside buf) kept their pattern. */
static void reduce_at(td_comm *c, unsigned char *buf, size_t off, size_t count, td_dtype t,
                      td_reduce_op op, const char *what) {
    int r = td_comm_rank(c), n = td_comm_size(c);
    size_t bytes = count * td_dtype_size(t);
    unsigned char *p = buf + off;
    memset(p - GUARD, 0xA5, GUARD);
    memset(p + bytes, 0x5A, GUARD);
    fill(t, p, count, r);
    CHECK_OK(td_comm_allreduce(c, p, p, count, t, op));
    compare(what, t, op, n, p, count);
    for (size_t i = 0; i < GUARD; i++) {
        if (p[-1 - (long)i] != 0xA5 || p[bytes + i] != 0x5A) {
            TEST_FAIL_AT("%s: bytes around the range were written (count %zu)", what, count);
            break;
        }
    }
}

static size_t cap_bytes(void) { return BIG_BYTES + 64 * 1024; }

static void matrix_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 60));
    if (!c) return;
    void *mem = NULL;
    CHECK_OK(td_comm_alloc(c, cap_bytes(), &mem));
    CHECK(mem && ((uintptr_t)mem & 63) == 0);
    if (!mem) return;
    for (size_t ti = 0; ti < sizeof dtypes / sizeof *dtypes; ti++) {
        td_dtype t = dtypes[ti];
        size_t es = td_dtype_size(t);
        size_t counts[] = {0, 1, 7, 1009, BIG_BYTES / es + 7};
        for (size_t oi = 0; oi < sizeof ops / sizeof *ops; oi++)
            for (size_t ci = 0; ci < sizeof counts / sizeof *counts; ci++) {
                reduce_at(c, mem, GUARD, counts[ci], t, ops[oi], "registered, offset 64");
                reduce_at(c, mem, GUARD + 4 * 1000 + 12, counts[ci], t, ops[oi],
                          "registered, offset 4076");
            }
    }
    td_comm_free(c, mem);
    td_comm_destroy(c);
}

static void run_matrix(int n) {
    CHECK_EQ(test_run_ranks(n, matrix_rank, NULL, 240, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

static void world_1(void) { run_matrix(1); }
static void world_2(void) { run_matrix(2); }
static void world_3(void) { run_matrix(3); }
static void world_4(void) { run_matrix(4); }

/* Ranks that do not all post the same (allocation, offset) take the copying path, and the
 * zero-copy path still works between such calls. */
static void mixed_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 60));
    if (!c) return;
    void *a = NULL, *b = NULL;
    CHECK_OK(td_comm_alloc(c, cap_bytes(), &a));
    CHECK_OK(td_comm_alloc(c, cap_bytes(), &b));
    unsigned char *plain = malloc(cap_bytes());
    if (!a || !b || !plain) return;
    size_t counts[] = {1009, 8192, BIG_BYTES / 4 + 7};
    for (size_t ci = 0; ci < sizeof counts / sizeof *counts; ci++) {
        size_t n = counts[ci];
        reduce_at(c, a, rank == 0 ? 128 : GUARD, n, TD_F32, TD_OP_SUM, "other offset on rank 0");
        reduce_at(c, a, GUARD, n, TD_F32, TD_OP_SUM, "same offset after a fallback");
        reduce_at(c, rank == size - 1 ? b : a, GUARD, n, TD_BF16, TD_OP_AVG,
                  "other allocation on the last rank");
        reduce_at(c, rank == 0 ? plain : b, GUARD, n, TD_I32, TD_OP_MAX, "plain buffer on rank 0");
        reduce_at(c, b, GUARD, n, TD_I32, TD_OP_SUM, "same offset again");
        /* Out of place from a registered buffer is an ordinary all-reduce. */
        unsigned char *src = (unsigned char *)a + GUARD;
        fill(TD_F32, src, n, rank);
        CHECK_OK(td_comm_allreduce(c, src, plain + GUARD, n, TD_F32, TD_OP_SUM));
        compare("out of place from registered", TD_F32, TD_OP_SUM, size, plain + GUARD, n);
    }
    free(plain);
    td_comm_free(c, a);
    td_comm_free(c, NULL);
    td_comm_destroy(c); /* frees b */
}

static void mixed(void) {
    for (int n = 2; n <= 3; n++) {
        CHECK_EQ(test_run_ranks(n, mixed_rank, NULL, 120, 0), 0);
        CHECK_EQ(test_shm_leftovers(), 0);
    }
}

/* Several non-blocking all-reduces on registered buffers outstanding at once. */
static void nonblocking_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 60));
    if (!c) return;
    enum { K = 5 };
    size_t count = 100003, stride = (count * sizeof(float) + 63) / 64 * 64;
    void *mem = NULL;
    CHECK_OK(td_comm_alloc(c, K * stride, &mem));
    float *plain = malloc(count * sizeof(float));
    if (!mem || !plain) return;
    td_request *reqs[K + 1];
    for (int k = 0; k < K; k++) {
        float *buf = (float *)((unsigned char *)mem + k * stride);
        for (size_t i = 0; i < count; i++) buf[i] = (float)(rank + k + (i % 7));
        CHECK_OK(td_comm_iallreduce(c, buf, buf, count, TD_F32, TD_OP_SUM, &reqs[k]));
    }
    for (size_t i = 0; i < count; i++) plain[i] = (float)(rank + (i % 5));
    CHECK_OK(td_comm_iallreduce(c, plain, plain, count, TD_F32, TD_OP_SUM, &reqs[K]));
    /* An allocation queues behind the pending work. */
    void *late = NULL;
    CHECK_OK(td_comm_alloc(c, 4096, &late));
    CHECK(late != NULL);
    for (int k = K; k >= 0; k--) CHECK_OK(td_request_wait(reqs[k]));
    for (int k = 0; k < K; k++) {
        const float *buf = (const float *)((unsigned char *)mem + k * stride);
        for (size_t i = 0; i < count; i += 97) {
            float want = 0;
            for (int r = 0; r < size; r++) want += (float)(r + k + (i % 7));
            CHECK_NEAR(buf[i], want, 0);
        }
    }
    for (size_t i = 0; i < count; i += 97) {
        float want = 0;
        for (int r = 0; r < size; r++) want += (float)(r + (i % 5));
        CHECK_NEAR(plain[i], want, 0);
    }
    free(plain);
    td_comm_free(c, late);
    td_comm_free(c, mem);
    td_comm_destroy(c);
}

static void nonblocking(void) {
    for (int n = 2; n <= 3; n++) {
        CHECK_EQ(test_run_ranks(n, nonblocking_rank, NULL, 120, 0), 0);
        CHECK_EQ(test_shm_leftovers(), 0);
    }
}

/* Reduce-scatter of `count` elements per rank from byte `off` of `reg` (registered, or plain when
 * the caller passes plain memory), into the rank's own part in place or into `out`; then the
 * allgather of the results back, into `reg` in place or from `out`. GUARD bytes around the
 * ranges keep their pattern. */
static void scatter_gather_at(td_comm *c, unsigned char *reg, size_t off, size_t count,
                              unsigned char *out, td_dtype t, td_reduce_op op, const char *what) {
    int r = td_comm_rank(c), n = td_comm_size(c);
    size_t es = td_dtype_size(t), bytes = (size_t)n * count * es;
    unsigned char *p = reg + off, *mine = out ? out : p + (size_t)r * count * es;
    memset(p - GUARD, 0xA5, GUARD);
    memset(p + bytes, 0x5A, GUARD);
    fill(t, p, (size_t)n * count, r);
    CHECK_OK(td_comm_reduce_scatter(c, p, mine, count, t, op));
    for (size_t i = 0; i < count; i++) {
        size_t e = (size_t)r * count + i;
        double ref = reference(t, op, n, e), g = test_elem_get(t, mine, i);
        if (!(g - ref <= tolerance(t, ref) && ref - g <= tolerance(t, ref))) {
            TEST_FAIL_AT("%s reduce_scatter %s %s n=%d count=%zu: element %zu is %.9g, expected "
                         "%.9g",
                         what, td_dtype_name(t), td_reduce_op_name(op), n, count, e, g, ref);
            break;
        }
    }
    /* Every rank's result, gathered: the whole reduced vector on every rank. */
    if (!out) memset(p, 0, (size_t)r * count * es); /* what the gather must bring back */
    CHECK_OK(td_comm_allgather(c, mine, p, count, t));
    compare(what, t, op, n, p, (size_t)n * count);
    for (size_t i = 0; i < GUARD; i++) {
        if (p[-1 - (long)i] != 0xA5 || p[bytes + i] != 0x5A) {
            TEST_FAIL_AT("%s: bytes around the range were written (count %zu)", what, count);
            break;
        }
    }
}

static void scatter_gather_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 60));
    if (!c) return;
    void *a = NULL, *b = NULL;
    CHECK_OK(td_comm_alloc(c, 4 * cap_bytes(), &a));
    CHECK_OK(td_comm_alloc(c, 4 * cap_bytes(), &b));
    unsigned char *plain = malloc(4 * cap_bytes()), *out = malloc(cap_bytes());
    if (!a || !b || !plain || !out) return;
    for (size_t ti = 0; ti < sizeof dtypes / sizeof *dtypes; ti++) {
        td_dtype t = dtypes[ti];
        size_t es = td_dtype_size(t);
        size_t counts[] = {0, 7, 1009, BIG_BYTES / es / 4 + 7};
        /* Every op on f32; the other dtypes one op each. */
        size_t n_ops = t == TD_F32 ? sizeof ops / sizeof *ops : 1;
        for (size_t oi = 0; oi < n_ops; oi++)
            for (size_t ci = 0; ci < sizeof counts / sizeof *counts; ci++) {
                size_t n = counts[ci];
                td_reduce_op op = t == TD_F32 ? ops[oi] : ops[ti];
                scatter_gather_at(c, a, GUARD, n, NULL, t, op, "registered in place");
                scatter_gather_at(c, a, GUARD + 4 * 1000 + 12, n, out, t, op,
                                  "registered, out of place");
                /* The ranks disagree: the copying path, and the zero-copy one after it. */
                scatter_gather_at(c, rank == 0 ? plain : a, GUARD, n, NULL, t, op,
                                  "plain on rank 0");
                scatter_gather_at(c, a, rank == size - 1 ? 128 : GUARD, n, NULL, t, op,
                                  "another offset on the last rank");
                scatter_gather_at(c, rank == 0 ? b : a, GUARD, n, out, t, op,
                                  "another allocation on rank 0");
                scatter_gather_at(c, b, GUARD, n, NULL, t, op, "registered again");
            }
    }
    free(plain);
    free(out);
    td_comm_free(c, a);
    td_comm_free(c, b);
    td_comm_destroy(c);
}

static void scatter_gather(void) {
    for (int n = 1; n <= 4; n++) {
        CHECK_EQ(test_run_ranks(n, scatter_gather_rank, NULL, 240, 0), 0);
        CHECK_EQ(test_shm_leftovers(), 0);
    }
}

/* Zero bytes still give a distinct pointer; different sizes are a mismatch on every rank. */
static void sizes_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c = NULL;
    CHECK_OK(test_comm_create(&c, rank, size, port, 20));
    if (!c) return;
    void *z = NULL;
    CHECK_OK(td_comm_alloc(c, 0, &z));
    CHECK(z != NULL);
    td_comm_free(c, z);
    void *m = NULL;
    CHECK_STATUS(td_comm_alloc(c, rank == 0 ? 100 : 200, &m), TD_EMISMATCH);
    CHECK(m == NULL);
    CHECK_STATUS(td_comm_alloc(NULL, 1, &m), TD_EINVAL);
    td_comm_destroy(c);
}

static void sizes(void) {
    CHECK_EQ(test_run_ranks(2, sizes_rank, NULL, 60, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    RUN(world_1);
    RUN(world_2);
    RUN(world_3);
    RUN(world_4);
    RUN(mixed);
    RUN(scatter_gather);
    RUN(nonblocking);
    RUN(sizes);
    TEST_END();
}
