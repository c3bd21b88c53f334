/* Collectives on device memory through the public td_comm API, on real forked ranks that all
 * use cuda:0: NCCL at world 1, CUDA IPC at worlds 2 and 4 (the ranks share the GPU, which
 * NCCL refuses). Every collective x dtype x op x size (0, 1, 7, 1009, and 100003 for f32 and
 * bf16 sums and averages) in and out of place against the serial reference of the host
 * matrix (test_comm_util.h), the values going to the GPU and back through host copies; a
 * collective large enough to take the IPC path in several pieces; and two ranks that call
 * different collectives on device buffers, which both name; point-to-point on device buffers
 * and sub-groups; a rank killed between collectives, named on every survivor within the
 * timeout; DDP over 2 and 4 ranks sharing the GPU equal to one process on the same global
 * batch; deterministic DDP on the same bits at worlds 1, 2 and 4; and SyncBatchNorm on the GPU
 * equal to the CPU's over the same group. Every case skips with one
 * line where no GPU is visible. The parent never starts CUDA itself (a child counts the GPUs): CUDA
 * does not survive a fork, and the ranks are forked. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tandem/tandem.h"

#include "test_comm_util.h"

static int gpus;

/* A buffer on the host and its mirror on the GPU. */
typedef struct {
    void *host, *dev;
    size_t bytes;
} mirror;

static mirror mirror_make(size_t n, td_dtype dt) {
    mirror m = {calloc(n ? n : 1, td_dtype_size(dt)), NULL, n * td_dtype_size(dt)};
    CHECK_OK(td_device_alloc(td_device_cuda(0), m.bytes ? m.bytes : 1, &m.dev));
    return m;
}

static void push(mirror *m) {
    if (m->bytes)
        CHECK_OK(td_device_copy(td_device_cuda(0), m->dev, td_device_cpu(), m->host, m->bytes));
}

static void pull(mirror *m) {
    if (m->bytes)
        CHECK_OK(td_device_copy(td_device_cpu(), m->host, td_device_cuda(0), m->dev, m->bytes));
}

static void mirror_free(mirror *m) {
    free(m->host);
    td_device_free(td_device_cuda(0), m->dev);
}

static int rank, size, bad;

/* Runs fn as n ranks, or skips the case where no GPU is visible. */
static void ranks_on_gpu(int n, test_rank_fn fn, double deadline_s) {
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    CHECK_EQ(test_run_ranks(n, fn, NULL, deadline_s, 0), 0);
}

static void expect(const char *what, td_dtype dt, td_reduce_op op, size_t n, size_t i, double got,
                   double want) {
    if (got == want || bad > 5) return;
    bad++;
    TEST_FAIL_AT("rank %d of %d: %s %s %s n=%zu: [%zu] = %g, want %g", rank, size, what,
                 td_dtype_name(dt), td_reduce_op_name(op), n, i, got, want);
}

static const size_t sizes[] = {0, 1, 7, 1009, 100003};

/* allreduce, reduce (root size - 1), reduce_scatter: out of place and in place. */
static void reductions(td_comm *w) {
    for (int dt = 0; dt < TD_DTYPE_COUNT; dt++)
        for (int op = 0; op < TD_OP_COUNT; op++)
            for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
                size_t n = sizes[s];
                if (n > 10000 &&
                    !((dt == TD_F32 || dt == TD_BF16) && (op == TD_OP_SUM || op == TD_OP_AVG)))
                    continue;
                for (int in_place = 0; in_place < 2; in_place++) {
                    mirror a = mirror_make(n * (size_t)size, (td_dtype)dt);
                    mirror b = mirror_make(n * (size_t)size, (td_dtype)dt);
                    for (size_t i = 0; i < n * (size_t)size; i++)
                        test_elem_put(
                            (td_dtype)dt, a.host, i,
                            test_coll_gen(rank, i % (n ? n : 1), (td_reduce_op)op, (td_dtype)dt));
                    push(&a);
                    void *out = in_place ? a.dev : b.dev;
                    mirror *res = in_place ? &a : &b;
                    CHECK_OK(td_comm_allreduce(w, a.dev, out, n, (td_dtype)dt, (td_reduce_op)op));
                    pull(res);
                    for (size_t i = 0; i < n; i++)
                        expect(in_place ? "allreduce in place" : "allreduce", (td_dtype)dt,
                               (td_reduce_op)op, n, i, test_elem_get((td_dtype)dt, res->host, i),
                               test_coll_reference(size, i, (td_dtype)dt, (td_reduce_op)op));
                    push(&a); /* the inputs again */
                    CHECK_OK(
                        td_comm_reduce(w, a.dev, out, n, (td_dtype)dt, (td_reduce_op)op, size - 1));
                    pull(res);
                    for (size_t i = 0; rank == size - 1 && i < n; i++)
                        expect("reduce", (td_dtype)dt, (td_reduce_op)op, n, i,
                               test_elem_get((td_dtype)dt, res->host, i),
                               test_coll_reference(size, i, (td_dtype)dt, (td_reduce_op)op));
                    /* reduce_scatter: block r of every rank's send is element r*n.. of gen */
                    for (size_t i = 0; i < n * (size_t)size; i++)
                        test_elem_put((td_dtype)dt, a.host, i,
                                      test_coll_gen(rank, i, (td_reduce_op)op, (td_dtype)dt));
                    push(&a);
                    CHECK_OK(
                        td_comm_reduce_scatter(w, a.dev, out, n, (td_dtype)dt, (td_reduce_op)op));
                    pull(res);
                    for (size_t i = 0; i < n; i++)
                        expect("reduce_scatter", (td_dtype)dt, (td_reduce_op)op, n, i,
                               test_elem_get((td_dtype)dt, res->host, i),
                               test_coll_reference(size, (size_t)rank * n + i, (td_dtype)dt,
                                                   (td_reduce_op)op));
                    mirror_free(&a);
                    mirror_free(&b);
                }
            }
}

/* broadcast, allgather, gather, scatter, alltoall: element values say where they came from. */
static void movements(td_comm *w) {
    for (int dt = 0; dt < TD_DTYPE_COUNT; dt++)
        for (size_t s = 0; s < 4; s++) {
            size_t n = sizes[s], all = n * (size_t)size;
            td_dtype t = (td_dtype)dt;
            mirror a = mirror_make(all, t), b = mirror_make(all, t);
            /* value v(r, i) = (r * 31 + i) % 97: exact in every dtype */
#define V(r, i) ((double)(((size_t)(r)*31 + (i)) % 97))
            for (size_t i = 0; i < all; i++) test_elem_put(t, a.host, i, V(rank, i));
            push(&a);
            CHECK_OK(td_comm_broadcast(w, a.dev, n, t, 0));
            pull(&a);
            for (size_t i = 0; i < n; i++)
                expect("broadcast", t, 0, n, i, test_elem_get(t, a.host, i), V(0, i));
            for (size_t i = 0; i < all; i++) test_elem_put(t, a.host, i, V(rank, i));
            push(&a);
            CHECK_OK(td_comm_allgather(w, a.dev, b.dev, n, t));
            pull(&b);
            for (size_t i = 0; i < all; i++)
                expect("allgather", t, 0, n, i, test_elem_get(t, b.host, i),
                       V(i / (n ? n : 1), i % (n ? n : 1)));
            CHECK_OK(td_comm_gather(w, a.dev, b.dev, n, t, 0));
            pull(&b);
            for (size_t i = 0; rank == 0 && i < all; i++)
                expect("gather", t, 0, n, i, test_elem_get(t, b.host, i),
                       V(i / (n ? n : 1), i % (n ? n : 1)));
            CHECK_OK(td_comm_scatter(w, a.dev, b.dev, n, t, 0));
            pull(&b);
            for (size_t i = 0; i < n; i++)
                expect("scatter", t, 0, n, i, test_elem_get(t, b.host, i),
                       V(0, (size_t)rank * n + i));
            CHECK_OK(td_comm_alltoall(w, a.dev, b.dev, n, t));
            pull(&b);
            for (size_t i = 0; i < all; i++)
                expect("alltoall", t, 0, n, i, test_elem_get(t, b.host, i),
                       V(i / (n ? n : 1), (size_t)rank * n + i % (n ? n : 1)));
            /* In place as on every path (comm.h): the input is where send points. All-to-all
             * over its own input; all-gather and gather with send == recv (the input in recv's
             * first block) and with send at this rank's block of recv (NCCL's in place). */
            size_t es = td_dtype_size(t);
            CHECK_OK(td_comm_alltoall(w, a.dev, a.dev, n, t));
            pull(&a);
            for (size_t i = 0; i < all; i++)
                expect("alltoall in place", t, 0, n, i, test_elem_get(t, a.host, i),
                       V(i / (n ? n : 1), (size_t)rank * n + i % (n ? n : 1)));
            for (int form = 0; form < 2; form++) {
                char *mine = (char *)b.dev + (form ? (size_t)rank * n * es : 0);
                for (int root = -1; root < size;
                     root += size) { /* all-gather; gather to the last */
                    memset(b.host, 0, b.bytes);
                    for (size_t i = 0; i < n; i++)
                        test_elem_put(t, (char *)b.host + (mine - (char *)b.dev), i, V(rank, i));
                    push(&b);
                    if (root < 0)
                        CHECK_OK(td_comm_allgather(w, mine, b.dev, n, t));
                    else
                        CHECK_OK(td_comm_gather(w, mine, b.dev, n, t, root));
                    pull(&b);
                    for (size_t i = 0; (root < 0 || rank == root) && i < all; i++)
                        expect(form ? "(all)gather from this rank's block"
                                    : "(all)gather with send == recv",
                               t, 0, n, i, test_elem_get(t, b.host, i),
                               V(i / (n ? n : 1), i % (n ? n : 1)));
                }
            }
#undef V
            mirror_free(&a);
            mirror_free(&b);
        }
}

static void matrix_rank(int r, int n, int port, void *arg) {
    (void)arg;
    rank = r;
    size = n;
    td_comm *w = NULL;
    CHECK_OK(test_comm_create(&w, r, n, port, 60));
    if (!w) return;
    reductions(w);
    movements(w);
    CHECK(strcmp(td_comm_device_path(w), n == 1 ? "nccl" : "cuda-ipc") == 0);
    td_comm_destroy(w);
}

static void matrix(int n) { ranks_on_gpu(n, matrix_rank, 300); }

static void nccl_world_of_one(void) { matrix(1); }
static void ipc_world_of_two(void) { matrix(2); }
static void ipc_world_of_four(void) { matrix(4); }

/* 80 MiB of f32 per rank: more than the 64 MiB staging buffer, so the IPC path goes in pieces. */
static void large_rank(int r, int n, int port, void *arg) {
    (void)arg;
    rank = r;
    size = n;
    td_comm *w = NULL;
    CHECK_OK(test_comm_create(&w, r, n, port, 60));
    if (!w) return;
    size_t count = (size_t)20 << 20;
    mirror a = mirror_make(count, TD_F32);
    for (size_t i = 0; i < count; i++) ((float *)a.host)[i] = (float)((i + (size_t)r) % 7);
    push(&a);
    CHECK_OK(td_comm_allreduce(w, a.dev, a.dev, count, TD_F32, TD_OP_SUM));
    pull(&a);
    for (size_t i = 0; i < count; i += 4099) {
        double want = 0;
        for (int k = 0; k < n; k++) want += (double)((i + (size_t)k) % 7);
        expect("large allreduce", TD_F32, TD_OP_SUM, count, i, ((float *)a.host)[i], want);
    }
    mirror_free(&a);
    td_comm_destroy(w);
}

static void ipc_in_pieces(void) { ranks_on_gpu(2, large_rank, 300); }

/* Rank 0 all-reduces device buffers while rank 1 all-gathers them: both fail naming both. */
static void mismatch_rank(int r, int n, int port, void *arg) {
    (void)arg;
    td_comm *w = NULL;
    CHECK_OK(test_comm_create(&w, r, n, port, 20));
    if (!w) return;
    mirror a = mirror_make(8, TD_F32), b = mirror_make(16, TD_F32);
    td_status s = r == 0 ? td_comm_allreduce(w, a.dev, a.dev, 8, TD_F32, TD_OP_SUM)
                         : td_comm_allgather(w, a.dev, b.dev, 8, TD_F32);
    CHECK_EQ(s, TD_EMISMATCH);
    CHECK(strstr(td_last_error(), "allreduce") && strstr(td_last_error(), "allgather"));
    mirror_free(&a);
    mirror_free(&b);
    td_comm_destroy(w);
}

static void different_calls_are_named(void) { ranks_on_gpu(2, mismatch_rank, 120); }

/* Point-to-point on device buffers, which travel through host memory: a ring of sends (the
 * send's buffer overwritten as soon as the call returns, which must not change what arrives),
 * a message to oneself, and an all-reduce of device buffers in each half of a split group
 * (NCCL for a sub-group of one rank, CUDA IPC for two). */
static void p2p_rank(int r, int n, int port, void *arg) {
    (void)arg;
    rank = r;
    size = n;
    td_comm *w = NULL;
    CHECK_OK(test_comm_create(&w, r, n, port, 60));
    if (!w) return;
    const size_t count = 100003;
    mirror out = mirror_make(count, TD_F32), in = mirror_make(count, TD_F32),
           self = mirror_make(count, TD_F32);
    for (size_t i = 0; i < count; i++) ((float *)out.host)[i] = (float)(r * 1000 + (int)(i % 997));
    push(&out);
    int next = (r + 1) % n, prev = (r + n - 1) % n;
    td_request *req[2] = {NULL, NULL};
    CHECK_OK(td_comm_irecv(w, in.dev, count, TD_F32, prev, 7, &req[0]));
    CHECK_OK(td_comm_isend(w, out.dev, count, TD_F32, next, 7, &req[1]));
    memset(out.host, 0, out.bytes);
    push(&out);
    CHECK_OK(td_request_waitall(2, req));
    pull(&in);
    for (size_t i = 0; i < count; i++)
        expect("ring send", TD_F32, TD_OP_SUM, count, i, ((float *)in.host)[i],
               prev * 1000 + (int)(i % 997));
    td_request *own = NULL;
    CHECK_OK(td_comm_irecv(w, self.dev, count, TD_F32, r, 8, &own));
    CHECK_OK(td_comm_send(w, in.dev, count, TD_F32, r, 8));
    CHECK_OK(td_request_wait(own));
    pull(&self);
    CHECK_EQ(memcmp(self.host, in.host, self.bytes), 0);
    td_comm *half = NULL;
    CHECK_OK(td_comm_split(w, r % 2, r, &half));
    if (half) {
        for (size_t i = 0; i < count; i++) ((float *)out.host)[i] = (float)(r + 1);
        push(&out);
        CHECK_OK(td_comm_allreduce(half, out.dev, out.dev, count, TD_F32, TD_OP_SUM));
        pull(&out);
        double want = 0;
        for (int k = r % 2; k < n; k += 2) want += k + 1;
        for (size_t i = 0; i < count; i += 97)
            expect("split allreduce", TD_F32, TD_OP_SUM, count, i, ((float *)out.host)[i], want);
        CHECK(strcmp(td_comm_device_path(half), td_comm_size(half) == 1 ? "nccl" : "cuda-ipc") ==
              0);
        td_comm_destroy(half);
    }
    mirror_free(&out);
    mirror_free(&in);
    mirror_free(&self);
    td_comm_destroy(w);
}

/* fn at world 2 and at world 4, every rank on cuda:0. */
static void worlds_2_and_4(test_rank_fn fn) {
    ranks_on_gpu(2, fn, 120);
    ranks_on_gpu(4, fn, 120);
}

static void point_to_point_and_subgroups(void) { worlds_2_and_4(p2p_rank); }

/* kill -9 of a rank between all-reduces on device memory: every other rank's next call fails
 * within the group's timeout naming it, the group fails fast afterwards, and each survivor
 * gives back all of its device memory. */
static void killed_gpu_rank(int r, int n, int port, void *arg) {
    (void)arg;
    td_comm *w = NULL;
    CHECK_OK(test_comm_create(&w, r, n, port, 60));
    if (!w) return;
    size_t count = (size_t)1 << 20;
    mirror a = mirror_make(count, TD_F32);
    for (size_t i = 0; i < count; i++) ((float *)a.host)[i] = 1;
    push(&a);
    /* the first call sets the IPC path up (every rank's first CUDA start before it) */
    CHECK_OK(td_comm_allreduce(w, a.dev, a.dev, count, TD_F32, TD_OP_SUM));
    CHECK_OK(td_comm_set_timeout(w, 5));
    CHECK_OK(td_comm_barrier(w));
    if (r == n - 1) raise(SIGKILL);
    uint64_t t0 = td_time_ns();
    td_status s = td_comm_allreduce(w, a.dev, a.dev, count, TD_F32, TD_OP_SUM);
    if (s == TD_OK) s = td_comm_allreduce(w, a.dev, a.dev, count, TD_F32, TD_OP_SUM);
    double took = (double)(td_time_ns() - t0) / 1e9;
    CHECK(s == TD_EPEER || s == TD_ETIMEOUT);
    char want[32];
    snprintf(want, sizeof want, "rank %d", n - 1);
    if (!strstr(td_last_error(), want))
        TEST_FAIL_AT("rank %d: the error does not name %s: %s", r, want, td_last_error());
    CHECK(took < 8.0);
    t0 = td_time_ns();
    CHECK(td_comm_barrier(w) != TD_OK);
    CHECK((double)(td_time_ns() - t0) / 1e9 < 1.0);
    mirror_free(&a);
    td_comm_destroy(w);
    td_device_memory_stats m;
    CHECK_OK(td_device_memory(td_device_cuda(0), &m));
    CHECK_EQ(m.in_use, 0);
}

static void a_killed_rank_is_named(void) {
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    CHECK_EQ(test_run_ranks(2, killed_gpu_rank, NULL, 60, 1), 0);
    CHECK_EQ(test_run_ranks(3, killed_gpu_rank, NULL, 60, 1), 0);
}

/* The MLP on cuda:0 for a batch, and its parameters. */
static void mlp_on_gpu(int64_t batch, td_graph **g, td_model *m, td_param **p, size_t *np) {
    td_graph_params gp = td_graph_default_params();
    gp.device = td_device_cuda(0);
    CHECK_OK(td_graph_create(g, &gp));
    CHECK_OK(td_model_build(*g, TD_MODEL_MLP, batch, 3, m));
    CHECK_OK(td_graph_parameters(*g, p, np));
}

/* SGD with momentum 0.9 over p. */
static td_optim *sgd(td_param *p, size_t np) {
    td_sgd_params hp = td_sgd_default_params();
    hp.momentum = 0.9;
    td_optim *opt = NULL;
    CHECK_OK(td_optim_create_sgd(&opt, p, np, &hp));
    return opt;
}

/* DDP on GPUs: the MLP trained 3 SGD steps on a global batch of 16, by one rank (ranks = 1) or
 * by 2 ranks on 8 samples each, all on cuda:0; each writes its parameters to a file. */
static const char *ddp_dir;

static void ddp_rank(int r, int n, int port, void *arg) {
    (void)arg;
    td_comm *w = NULL;
    if (n > 1) CHECK_OK(test_comm_create(&w, r, n, port, 60));
    int64_t local = 16 / n;
    td_graph *g = NULL;
    td_model m;
    td_param *p;
    size_t np;
    mlp_on_gpu(local, &g, &m, &p, &np);
    td_optim *opt = sgd(p, np);
    td_ddp *ddp = NULL;
    if (w) {
        CHECK_OK(td_ddp_create(&ddp, w, p, np, NULL, 0, NULL));
        td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, ddp);
    }
    float *x = malloc(16 * 784 * sizeof *x);
    int64_t y[16];
    td_rng rng;
    td_rng_init(&rng, 9);
    for (int step = 0; step < 3 && opt && g; step++) {
        for (int i = 0; i < 16 * 784; i++) x[i] = td_rng_uniform(&rng);
        for (int i = 0; i < 16; i++) y[i] = td_rng_below(&rng, 10);
        CHECK_OK(td_tensor_write(m.input, x + (size_t)(r * local) * 784));
        CHECK_OK(td_tensor_write(m.labels, y + r * local));
        if (ddp) CHECK_OK(td_ddp_prepare_forward(ddp));
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_graph_backward(g, m.loss));
        if (ddp) CHECK_OK(td_ddp_finish_backward(ddp));
        CHECK_OK(td_optim_step(opt));
        CHECK_OK(td_graph_zero_grad(g));
    }
    if (w) CHECK(strcmp(td_comm_device_path(w), "cuda-ipc") == 0);
    char path[512];
    snprintf(path, sizeof path, "%s/params.%d.%d.safetensors", ddp_dir, n, r);
    CHECK_OK(td_checkpoint_save(path, p, np, NULL, 0));
    free(x);
    td_ddp_destroy(ddp);
    td_optim_destroy(opt);
    td_graph_destroy(g);
    td_comm_destroy(w);
}

static void ddp_equals_one_process(void) {
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    char dir[128];
    test_temp_dir(dir, sizeof dir, "cuda_ddp");
    ddp_dir = dir;
    CHECK_EQ(test_run_ranks(1, ddp_rank, NULL, 120, 0), 0);
    CHECK_EQ(test_run_ranks(2, ddp_rank, NULL, 120, 0), 0);
    CHECK_EQ(test_run_ranks(4, ddp_rank, NULL, 120, 0), 0);
    /* Read on the host: this process never starts CUDA. */
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/params.1.0.safetensors", dir);
    for (int k = 0; k < 6; k++) {
        int world = k < 2 ? 2 : 4, r = k < 2 ? k : k - 2;
        snprintf(b, sizeof b, "%s/params.%d.%d.safetensors", dir, world, r);
        td_checkpoint *ca = NULL, *cb = NULL;
        CHECK_OK(td_checkpoint_open(&ca, a));
        CHECK_OK(td_checkpoint_open(&cb, b));
        size_t n = ca ? td_checkpoint_count(ca) : 0;
        for (size_t i = 0; ca && cb && i < n; i++) {
            td_param ia, ib;
            CHECK_OK(td_checkpoint_tensor(ca, i, &ia));
            CHECK_OK(td_checkpoint_tensor(cb, i, &ib));
            float *va = malloc(ia.count * sizeof *va), *vb = malloc(ia.count * sizeof *vb);
            ia.data = va;
            ib.data = vb;
            CHECK_OK(td_checkpoint_read(ca, &ia, 1));
            CHECK_OK(td_checkpoint_read(cb, &ib, 1));
            for (size_t j = 0; j < ia.count; j++)
                if (fabs(va[j] - vb[j]) > 1e-5 * (1 + fabs(va[j]))) {
                    TEST_FAIL_AT("world %d rank %d %s[%zu]: ddp %g, one process %g", world, r,
                                 ia.name, j, (double)vb[j], (double)va[j]);
                    break;
                }
            free(va);
            free(vb);
        }
        td_checkpoint_close(ca);
        td_checkpoint_close(cb);
    }
    test_remove_dir(dir);
}

/* Deterministic DDP on the GPU: the MLP trained 3 SGD steps on a global batch of 16 in 8 shards
 * of 2 samples, by 1, 2 or 4 ranks on cuda:0, ends on the same parameter bits at every world
 * size. Rank 0 leaves its digest in digests[world / 2]. */
static char (*digests)[65];

static void deterministic_rank(int r, int n, int port, void *arg) {
    (void)arg;
    td_comm *w = NULL;
    CHECK_OK(test_comm_create(&w, r, n, port, 60));
    if (!w) return;
    const int64_t shard = 2;
    td_graph *g = NULL;
    td_model m;
    td_param *p;
    size_t np;
    mlp_on_gpu(shard, &g, &m, &p, &np);
    td_ddp_params dp = td_ddp_default_params();
    dp.deterministic = 1;
    dp.shards = 8;
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, w, p, np, NULL, 0, &dp));
    if (!ddp) return;
    td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, ddp);
    td_optim *opt = sgd(p, np);
    size_t first = 0, count = 0;
    td_ddp_shards(ddp, &first, &count);
    CHECK_EQ(count, 8 / n);
    float *x = malloc(16 * 784 * sizeof *x);
    int64_t y[16];
    td_rng rng;
    td_rng_init(&rng, 9);
    for (int step = 0; step < 3 && opt; step++) {
        for (int i = 0; i < 16 * 784; i++) x[i] = td_rng_uniform(&rng);
        for (int i = 0; i < 16; i++) y[i] = td_rng_below(&rng, 10);
        for (size_t j = 0; j < count; j++) {
            size_t at = (first + j) * (size_t)shard;
            CHECK_OK(td_ddp_prepare_forward(ddp));
            CHECK_OK(td_graph_set_rng_key(g, (uint64_t)step, at));
            CHECK_OK(td_tensor_write(m.input, x + at * 784));
            CHECK_OK(td_tensor_write(m.labels, y + at));
            CHECK_OK(td_graph_forward(g));
            CHECK_OK(td_graph_zero_grad(g));
            CHECK_OK(td_graph_backward(g, m.loss));
            CHECK_OK(td_ddp_finish_backward(ddp));
        }
        CHECK_OK(td_optim_step(opt));
        CHECK_OK(td_graph_zero_grad(g));
    }
    CHECK_OK(td_graph_parameters(g, &p, &np));
    char hex[65] = "";
    CHECK_OK(td_params_sha256(p, np, hex));
    if (r == 0) memcpy(digests[n / 2], hex, sizeof hex);
    free(x);
    td_optim_destroy(opt);
    td_ddp_destroy(ddp);
    td_graph_destroy(g);
    td_comm_destroy(w);
}

static void deterministic_same_bits_at_worlds_1_2_4(void) {
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    digests = mmap(NULL, 3 * 65, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    memset(digests, 0, 3 * 65);
    for (int n = 1; n <= 4; n *= 2)
        CHECK_EQ(test_run_ranks(n, deterministic_rank, NULL, 120, 0), 0);
    printf("    digests at worlds 1, 2, 4: %.16s %.16s %.16s\n", digests[0], digests[1],
           digests[2]);
    CHECK(digests[0][0] && strcmp(digests[0], digests[1]) == 0 &&
          strcmp(digests[0], digests[2]) == 0);
    munmap(digests, 3 * 65);
}

/* SyncBatchNorm on a GPU: each rank runs the same (N, C, H, W) = (3 + rank, 4, 5, 5) batch
 * through SyncBatchNorm twice, on the CPU and on cuda:0, over the same group; two training
 * steps and one in evaluation mode give the same output, input, weight and bias gradients and
 * running statistics on both devices (1e-5). */
static void sbn_twin(td_comm *w, td_device d, int64_t batch, td_graph **g, td_tensor **x,
                     td_tensor **y, td_tensor *t[4]) {
    td_graph_params gp = td_graph_default_params();
    gp.device = d;
    gp.comm = w;
    CHECK_OK(td_graph_create(g, &gp));
    CHECK_OK(td_graph_input(*g, "x", td_shape_4d(batch, 4, 5, 5), TD_F32, 1, x));
    CHECK_OK(td_graph_param(*g, "w", td_shape_1d(4), &t[0]));
    CHECK_OK(td_graph_param(*g, "b", td_shape_1d(4), &t[1]));
    CHECK_OK(td_graph_buffer(*g, "rm", td_shape_1d(4), &t[2]));
    CHECK_OK(td_graph_buffer(*g, "rv", td_shape_1d(4), &t[3]));
    const float wv[4] = {1.0f, 0.5f, 2.0f, -1.0f}, bv[4] = {0.1f, 0.0f, -0.2f, 0.3f},
                zeros[4] = {0}, ones[4] = {1, 1, 1, 1};
    CHECK_OK(td_tensor_write(t[0], wv));
    CHECK_OK(td_tensor_write(t[1], bv));
    CHECK_OK(td_tensor_write(t[2], zeros));
    CHECK_OK(td_tensor_write(t[3], ones));
    CHECK_OK(td_graph_sync_batch_norm2d(*g, *x, t[0], t[1], t[2], t[3], NULL, y));
    CHECK_OK(td_graph_compile(*g));
}

static void expect_close(const char *what, int step, const float *gpu, const float *cpu, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (fabs(gpu[i] - cpu[i]) > 1e-5 * (1 + fabs(cpu[i]))) {
            TEST_FAIL_AT("rank %d step %d %s[%zu]: cuda %g, cpu %g", rank, step, what, i,
                         (double)gpu[i], (double)cpu[i]);
            return;
        }
}

static void sbn_rank(int r, int n, int port, void *arg) {
    (void)arg;
    rank = r;
    size = n;
    td_comm *w = NULL;
    CHECK_OK(test_comm_create(&w, r, n, port, 60));
    if (!w) return;
    int64_t batch = 3 + r;
    size_t numel = (size_t)batch * 100;
    td_graph *g[2] = {NULL, NULL};
    td_tensor *x[2], *y[2], *t[2][4];
    sbn_twin(w, td_device_cpu(), batch, &g[0], &x[0], &y[0], t[0]);
    sbn_twin(w, td_device_cuda(0), batch, &g[1], &x[1], &y[1], t[1]);
    float *xs = malloc(numel * sizeof *xs), *dy = malloc(numel * sizeof *dy);
    float *out[2] = {malloc(numel * sizeof(float)), malloc(numel * sizeof(float))};
    float *dx[2] = {malloc(numel * sizeof(float)), malloc(numel * sizeof(float))};
    td_rng rng;
    td_rng_init(&rng, 100 + (uint64_t)r);
    for (int step = 0; step < 3 && g[0] && g[1]; step++) {
        for (size_t i = 0; i < numel; i++) xs[i] = 2.0f * td_rng_normal(&rng) + (float)(i % 4);
        for (size_t i = 0; i < numel; i++) dy[i] = td_rng_normal(&rng);
        float vals[2][4][4];
        for (int d = 0; d < 2; d++) {
            td_graph_set_training(g[d], step < 2);
            CHECK_OK(td_tensor_write(x[d], xs));
            CHECK_OK(td_graph_forward(g[d]));
            CHECK_OK(td_graph_zero_grad(g[d]));
            CHECK_OK(td_graph_backward_from(g[d], y[d], dy));
            CHECK_OK(td_tensor_read(y[d], out[d]));
            CHECK_OK(td_tensor_read_grad(x[d], dx[d]));
            for (int k = 0; k < 4; k++) {
                if (k < 2)
                    CHECK_OK(td_tensor_read_grad(t[d][k], vals[d][k]));
                else
                    CHECK_OK(td_tensor_read(t[d][k], vals[d][k]));
            }
        }
        expect_close("y", step, out[1], out[0], numel);
        expect_close("dx", step, dx[1], dx[0], numel);
        const char *names[4] = {"dweight", "dbias", "running mean", "running var"};
        for (int k = 0; k < 4; k++) expect_close(names[k], step, vals[1][k], vals[0][k], 4);
    }
    for (int d = 0; d < 2; d++) {
        free(out[d]);
        free(dx[d]);
        td_graph_destroy(g[d]);
    }
    free(xs);
    free(dy);
    td_comm_destroy(w);
}

static void sync_batch_norm_on_gpu_equals_cpu(void) { worlds_2_and_4(sbn_rank); }

/* The graph's all-gather on a GPU: each rank's (2, 3) rows stacked in rank order, and
 * backward's reduce-scatter sums every rank's gradient of its own rows; such a graph never
 * records its sweeps (the op waits for the group on the host) and says why. */
static void graph_gather_rank(int r, int n, int port, void *arg) {
    (void)arg;
    td_comm *w = NULL;
    CHECK_OK(test_comm_create(&w, r, n, port, 60));
    if (!w) return;
    td_graph_params gp = td_graph_default_params();
    gp.device = td_device_cuda(0);
    gp.comm = w;
    td_graph *g = NULL;
    td_tensor *x, *y;
    CHECK_OK(td_graph_create(&g, &gp));
    CHECK_OK(td_graph_input(g, "x", td_shape_2d(2, 3), TD_F32, 1, &x));
    CHECK_OK(td_graph_all_gather(g, x, &y));
    CHECK_OK(td_graph_compile(g));
    float xs[6], ys[12], dy[12], dx[6];
    for (int i = 0; i < 6; i++) xs[i] = (float)(r * 10 + i);
    for (int i = 0; i < 12; i++) dy[i] = (float)(i + 1);
    for (int step = 0; step < 3; step++) {
        CHECK_OK(td_tensor_write(x, xs));
        CHECK_OK(td_graph_forward(g));
        CHECK_OK(td_graph_backward_from(g, y, dy));
        CHECK_OK(td_graph_zero_grad(g));
    }
    CHECK_OK(td_tensor_read(y, ys));
    CHECK_OK(td_tensor_read_grad(x, dx));
    for (int i = 0; i < 12; i++) CHECK_EQ(ys[i], (i / 6) * 10 + i % 6);
    for (int i = 0; i < 6; i++) CHECK_EQ(dx[i], n * (r * 6 + i + 1));
    const char *why = NULL;
    CHECK_EQ(td_graph_replays(g, &why), 0);
    CHECK(why && strstr(why, "process group"));
    td_graph_destroy(g);
    td_comm_destroy(w);
}

static void graph_all_gather_on_gpu(void) { ranks_on_gpu(2, graph_gather_rank, 120); }

int main(void) {
    gpus = test_count_gpus();
    RUN(nccl_world_of_one);
    RUN(ipc_world_of_two);
    RUN(ipc_world_of_four);
    RUN(ipc_in_pieces);
    RUN(different_calls_are_named);
    RUN(point_to_point_and_subgroups);
    RUN(a_killed_rank_is_named);
    RUN(ddp_equals_one_process);
    RUN(deterministic_same_bits_at_worlds_1_2_4);
    RUN(graph_all_gather_on_gpu);
    RUN(sync_batch_norm_on_gpu_equals_cpu);
    TEST_END();
}
