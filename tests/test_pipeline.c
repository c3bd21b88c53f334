/* Pipeline parallelism across forked ranks (td_spawn, the shm backend). GPipe, 1F1B and the
 * naive split with P = 2 and 3 stages and M = 1, 4, 8 micro-batches train a small conv model to
 * the same parameters as one process on the same batch (relative difference <= 1e-5 after K
 * steps); with batch norm, the same as one process run micro-batch by micro-batch (parameters
 * and running statistics). Pipeline x DDP (2 stages x 2 replicas) equals one process on the
 * global batch; mixed precision (O1, bf16) inside stages stays close to one process at O1;
 * stages on a GPU (skipped where none is visible) equal one process on it.
 * Dropout masks are the same in every schedule and replay bit for bit; the stage evaluation
 * equals one process's; 1F1B keeps at most P - stage micro-batches alive. Faults: a stage that
 * dies (in the middle or at the end) gives every other rank an error naming it, stages built
 * from different models are refused at creation naming both shapes, and ranks that disagree on
 * options or on what they run are told so. Also the balanced split. */
#include <signal.h>
#include <string.h>
#include <sys/mman.h>

#include "tandem/tandem.h"

#include "test.h"
#include "test_comm_util.h"

#define B 16         /* global batch */
#define STEPS 3      /* K */
#define IMG 8        /* the conv model's images are 1 x IMG x IMG */
#define TOL 1e-5     /* relative difference of a parameter tensor */
#define AMP_TOL 1e-2 /* the same in bf16, where micro-batches round differently */
/* bf16 with batch norm and a residual path across the cut: one process sums the gradient of the
 * cut's activation in bf16 where a pipeline receives it in f32, and batch norm's backward
 * carries that rounding on; how far depends on the CPU's bf16 kernels (2.6e-2 after 3 steps on
 * a CPU without avx512_bf16, under 1e-2 on one with it, 5.8e-3 with no micro-batches at all). */
#define AMP_BN_TOL 5e-2

/* ---- models ------------------------------------------------------------------------- */

#define TRY(call)                  \
    do {                           \
        td_status try_s_ = (call); \
        if (try_s_) return try_s_; \
    } while (0)

typedef struct {
    int64_t out;
    int stride, relu;
} conv_arg;

static td_status conv_layer(td_graph *g, const char *name, td_tensor *x, td_rng *rng,
                            const void *arg, td_tensor **y) {
    const conv_arg *a = arg;
    td_conv2d_params cp = td_conv2d_default_params();
    cp.stride[0] = cp.stride[1] = a->stride;
    cp.padding[0] = cp.padding[1] = 1;
    td_tensor *t;
    TRY(td_nn_conv2d(g, name, x, a->out, 3, &cp, 1, rng, &t));
    return td_graph_relu(g, t, y);
}

typedef struct {
    int64_t out;
    int relu;
} fc_arg;

static td_status fc_layer(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                          td_tensor **y) {
    const fc_arg *a = arg;
    td_tensor *t = x;
    if (td_tensor_shape(t).ndim > 2) TRY(td_graph_flatten(g, t, 1, &t));
    TRY(td_nn_linear(g, name, t, a->out, 1, rng, &t));
    if (!a->relu) {
        *y = t;
        return TD_OK;
    }
    return td_graph_relu(g, t, y);
}

/* conv1 (1 -> 4, 3x3) | conv2 (4 -> 6, 3x3 stride 2) | fc1 (96 -> hidden) | fc2 (-> 10): no
 * batch norm, no dropout. `hidden` differs only to build a wrong model on purpose. */
static td_sequential *conv_model(int64_t hidden) {
    td_sequential *s = NULL;
    conv_arg c1 = {4, 1, 1}, c2 = {6, 2, 1};
    fc_arg f1 = {hidden, 1}, f2 = {10, 0};
    CHECK_OK(td_sequential_create(&s, td_shape_make(3, (const int64_t[]){1, IMG, IMG})));
    CHECK_OK(td_sequential_add(s, "conv1", conv_layer, &c1, sizeof c1));
    CHECK_OK(td_sequential_add(s, "conv2", conv_layer, &c2, sizeof c2));
    CHECK_OK(td_sequential_add(s, "fc1", fc_layer, &f1, sizeof f1));
    CHECK_OK(td_sequential_add(s, "fc2", fc_layer, &f2, sizeof f2));
    return s;
}

/* A tiny ResNet (batch norm in every layer): stem, layer1.0, layer2.0, fc on 12 x 12. */
static td_sequential *bn_model(void) {
    td_resnet_params rp = td_resnet_default_params();
    rp.stages = 2;
    rp.base_width = 4;
    rp.image_size = 12;
    td_sequential *s = NULL;
    CHECK_OK(td_resnet_sequential(&rp, &s));
    return s;
}

/* The batch: B samples of the model's sample shape and labels 0..9. */
static void make_batch(const td_sequential *s, float **x, int64_t *y) {
    td_shape sh = td_sequential_sample_shape(s);
    size_t n = (size_t)td_shape_numel(&sh) * B;
    *x = malloc(n * sizeof **x);
    td_rng r;
    td_rng_init(&r, 2024);
    for (size_t i = 0; i < n; i++) (*x)[i] = td_rng_normal(&r);
    for (int i = 0; i < B; i++) y[i] = (i * 7 + 3) % 10;
}

static td_sgd_params sgd(void) {
    td_sgd_params p = td_sgd_default_params();
    p.lr = 0.05;
    p.momentum = 0.9;
    return p;
}

/* ---- the one-process reference ------------------------------------------------------- */

typedef struct {
    td_graph *g;
    td_model m;
    td_optim *opt;
    float loss;
} reference;

/* STEPS steps on the whole batch in micro-batches of B / micro (1: the batch at once),
 * accumulating the micro-batch gradients scaled by 1 / micro. */
static void reference_train(reference *r, const td_sequential *s, int micro, const float *x,
                            const int64_t *y, uint64_t seed, td_amp_level amp, td_device device) {
    int64_t b = B / micro;
    td_shape sh = td_sequential_sample_shape(s);
    size_t sample = (size_t)td_shape_numel(&sh);
    td_graph_params gp = td_graph_default_params();
    gp.amp.level = amp;
    gp.device = device;
    CHECK_OK(td_graph_create(&r->g, &gp));
    CHECK_OK(td_model_build_sequential(r->g, s, b, seed, &r->m));
    td_param *p;
    size_t n;
    CHECK_OK(td_graph_parameters(r->g, &p, &n));
    td_sgd_params hp = sgd();
    CHECK_OK(td_optim_create_sgd(&r->opt, p, n, &hp));
    float scale = 1.0f / (float)micro;
    for (int step = 0; step < STEPS; step++) {
        r->loss = 0;
        for (int m = 0; m < micro; m++) {
            CHECK_OK(td_tensor_write(r->m.input, x + (size_t)m * (size_t)b * sample));
            CHECK_OK(td_tensor_write(r->m.labels, y + m * b));
            CHECK_OK(td_graph_forward(r->g));
            float l = NAN;
            CHECK_OK(td_tensor_read(r->m.loss, &l));
            r->loss += l / (float)micro;
            CHECK_OK(td_graph_backward_from(r->g, r->m.loss, &scale));
        }
        CHECK_OK(td_optim_step(r->opt));
        CHECK_OK(td_graph_zero_grad(r->g));
    }
}

static void reference_free(reference *r) {
    td_optim_destroy(r->opt);
    td_graph_destroy(r->g);
}

static double rel_diff(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* An f32 tensor's values in host memory, wherever it lives. */
static float *host_copy(const td_param *p) {
    float *h = malloc(p->count * sizeof *h);
    CHECK_OK(td_device_copy(td_device_cpu(), h, p->device, p->data, p->count * sizeof *h));
    return h;
}

/* Largest relative difference of the stage's tensors from the reference's of the same name;
 * `found` counts the matches. */
static double stage_vs_reference(const td_param *mine, size_t n, td_param *ref, size_t nref,
                                 size_t *found) {
    double worst = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < nref; j++) {
            if (strcmp(mine[i].name, ref[j].name)) continue;
            CHECK_EQ(mine[i].count, ref[j].count);
            float *a = host_copy(&mine[i]), *b = host_copy(&ref[j]);
            double d = rel_diff(a, b, mine[i].count);
            free(a);
            free(b);
            if (d > worst) worst = d;
            (*found)++;
        }
    return worst;
}

/* ---- equivalence -------------------------------------------------------------------- */

typedef struct {
    td_pipeline_schedule schedule;
    int stages, micro, bn;
    const char *split; /* NULL: balanced */
    double *worst;     /* (world) shared with the parent */
    td_amp_level amp;  /* mixed precision of both the stages and the reference */
    td_device device;  /* where the stages and the reference train */
} equiv_job;

static void equiv_rank(int rank, int size, int port, void *arg) {
    equiv_job *j = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    td_sequential *s = j->bn ? bn_model() : conv_model(16);
    float *x;
    int64_t y[B];
    make_batch(s, &x, y);
    int D = size / j->stages;
    td_pipeline_params pp = td_pipeline_default_params();
    pp.schedule = j->schedule;
    pp.stages = j->stages;
    pp.micro_batches = j->micro;
    pp.batch = B / D;
    pp.split = j->split;
    pp.seed = 5;
    pp.balance_reps = 1;
    pp.graph.amp.level = j->amp;
    pp.graph.device = j->device;
    td_pipeline *pipe = NULL;
    CHECK_OK(td_pipeline_create(&pipe, comm, s, &pp));
    if (!pipe) return;
    td_pipeline_info info = td_pipeline_get_info(pipe);
    CHECK_EQ(info.stage, rank % j->stages);
    CHECK_EQ(info.replica, rank / j->stages);
    int M = j->schedule == TD_SCHEDULE_NAIVE ? 1 : j->micro;
    int expect_graphs =
        j->schedule == TD_SCHEDULE_1F1B && j->stages - info.stage < M ? j->stages - info.stage : M;
    CHECK_EQ(info.graphs, expect_graphs);
    /* Raised where this process may, left alone where it may not. */
    CHECK(info.transfer_nice == -10 || info.transfer_nice == 0);
    td_param *p, *buf;
    size_t n, nbuf;
    CHECK_OK(td_pipeline_parameters(pipe, &p, &n));
    CHECK_OK(td_pipeline_buffers(pipe, &buf, &nbuf));
    td_sgd_params hp = sgd();
    td_optim *opt;
    CHECK_OK(td_optim_create_sgd(&opt, p, n, &hp));
    td_shape sh = td_sequential_sample_shape(s);
    size_t sample = (size_t)td_shape_numel(&sh);
    const float *xs = x + (size_t)info.replica * (size_t)pp.batch * sample;
    const int64_t *ys = y + info.replica * pp.batch;
    float loss = 0;
    for (int step = 0; step < STEPS; step++) {
        CHECK_OK(td_pipeline_step(pipe, xs, ys, &loss));
        CHECK_OK(td_optim_step(opt));
    }
    td_pipeline_stats st = td_pipeline_get_stats(pipe);
    CHECK_EQ(st.steps, STEPS);
    CHECK_EQ(st.peak_in_flight, expect_graphs);
    CHECK(st.activation_bytes > 0 && st.busy_ns > 0 && st.end_ns > st.start_ns);
    /* One process on the same (global) batch; with batch norm, micro-batch by micro-batch. */
    reference r;
    reference_train(&r, s, j->bn ? M : 1, x, y, pp.seed, j->amp, j->device);
    td_param *rp, *rb;
    size_t rn, rbn, found = 0, found_buf = 0;
    CHECK_OK(td_graph_parameters(r.g, &rp, &rn));
    CHECK_OK(td_graph_buffers(r.g, &rb, &rbn));
    double worst = stage_vs_reference(p, n, rp, rn, &found);
    double worst_buf = stage_vs_reference(buf, nbuf, rb, rbn, &found_buf);
    CHECK_EQ(found, n);
    CHECK_EQ(found_buf, nbuf);
    CHECK(n > 0);
    double tol = !j->amp ? TOL : j->bn ? AMP_BN_TOL : AMP_TOL;
    if (worst > tol || worst_buf > tol)
        TEST_FAIL_AT("rank %d (stage %d): parameters differ by %.3g, buffers by %.3g", rank,
                     info.stage, worst, worst_buf);
    if (info.stage + 1 == j->stages && D == 1) CHECK_NEAR(loss, r.loss, j->amp ? 1e-2 : 1e-5);
    if (info.stage + 1 != j->stages) CHECK(isnan(loss));
    j->worst[rank] = worst > worst_buf ? worst : worst_buf;
    /* The stage evaluation equals one process's, with a short last micro-batch. */
    if (!j->bn && D == 1 && !j->amp) {
        double lsum = -1;
        int64_t correct = -1;
        CHECK_OK(td_pipeline_evaluate(pipe, x, y, 13, &lsum, &correct));
        td_graph_set_training(r.g, 0);
        int64_t b = B, hits = 0;
        CHECK_OK(td_tensor_write(r.m.input, x));
        CHECK_OK(td_tensor_write(r.m.labels, y));
        CHECK_OK(td_graph_forward(r.g));
        float lp[B * 10];
        CHECK_OK(td_tensor_read(r.m.output, lp));
        double want = 0;
        for (int64_t i = 0; i < 13 && i < b; i++) {
            int best = 0;
            for (int c = 1; c < 10; c++)
                if (lp[i * 10 + c] > lp[i * 10 + best]) best = c;
            hits += best == y[i];
            want -= lp[i * 10 + y[i]];
        }
        if (info.stage + 1 == j->stages) {
            CHECK_EQ(correct, hits);
            CHECK_NEAR(lsum, want, 1e-4 * fabs(want) + 1e-5);
        } else {
            CHECK(correct == 0 && lsum == 0);
        }
        /* Training goes on after an evaluation. */
        CHECK_OK(td_pipeline_step(pipe, xs, ys, &loss));
    }
    reference_free(&r);
    td_optim_destroy(opt);
    td_pipeline_destroy(pipe);
    td_sequential_destroy(s);
    free(x);
    td_comm_destroy(comm);
}

static double *shared_doubles(int n) {
    double *d = mmap(NULL, (size_t)n * sizeof *d, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    for (int i = 0; i < n; i++) d[i] = -1;
    return d;
}

static void equiv_on(td_pipeline_schedule schedule, int stages, int replicas, int micro, int bn,
                     const char *split, td_amp_level amp, td_device device) {
    int world = stages * replicas;
    equiv_job j = {schedule, stages, micro, bn, split, shared_doubles(world), amp, device};
    CHECK_EQ(test_run_ranks(world, equiv_rank, &j, 120, 0), 0);
    double worst = 0;
    for (int r = 0; r < world; r++) worst = j.worst[r] > worst ? j.worst[r] : worst;
    printf("    %s P=%d D=%d M=%d%s%s%s: largest relative difference %.2e\n",
           td_pipeline_schedule_name(schedule), stages, replicas, micro,
           bn ? " (batch norm, per micro-batch)" : "", amp ? " (bf16, O1)" : "",
           device.type == TD_DEVICE_CPU ? "" : " (every rank on cuda:0)", worst);
    munmap(j.worst, (size_t)world * sizeof(double));
}

static void equiv(td_pipeline_schedule schedule, int stages, int replicas, int micro, int bn,
                  const char *split) {
    equiv_on(schedule, stages, replicas, micro, bn, split, TD_AMP_O0, td_device_cpu());
}

static void gpipe_equals_one_process(void) {
    int ms[] = {1, 4, 8};
    for (int i = 0; i < 3; i++) {
        equiv(TD_SCHEDULE_GPIPE, 2, 1, ms[i], 0, "conv2");
        equiv(TD_SCHEDULE_GPIPE, 3, 1, ms[i], 0, i == 1 ? NULL : "conv2,fc2");
    }
}

static void one_f_one_b_equals_one_process(void) {
    int ms[] = {1, 4, 8};
    for (int i = 0; i < 3; i++) {
        equiv(TD_SCHEDULE_1F1B, 2, 1, ms[i], 0, i == 2 ? NULL : "fc1");
        equiv(TD_SCHEDULE_1F1B, 3, 1, ms[i], 0, "conv2,fc1");
    }
}

static void naive_split_equals_one_process(void) { equiv(TD_SCHEDULE_NAIVE, 2, 1, 4, 0, "fc1"); }

static void batch_norm_per_micro_batch(void) {
    equiv(TD_SCHEDULE_GPIPE, 2, 1, 4, 1, "layer2");
    equiv(TD_SCHEDULE_1F1B, 2, 1, 4, 1, "layer1");
}

static void pipeline_times_ddp_equals_one_process(void) {
    equiv(TD_SCHEDULE_1F1B, 2, 2, 4, 0, "conv2");
    equiv(TD_SCHEDULE_GPIPE, 2, 2, 2, 0, "fc1");
}

/* Mixed precision inside the stages, f32 between them: O1 computes the convolutions and linears
 * in bf16; the pipeline stays close to one process at O1 (micro-batches round differently). */
static void mixed_precision_stages(void) {
    equiv_on(TD_SCHEDULE_1F1B, 2, 1, 4, 0, "conv2", TD_AMP_O1, td_device_cpu());
    equiv_on(TD_SCHEDULE_GPIPE, 2, 1, 2, 1, "layer2", TD_AMP_O1, td_device_cpu());
}

static int gpus; /* visible to the ranks (counted in a child: the ranks are forked) */

/* Stages on a GPU, the ranks sharing cuda:0: activations and gradients cross between stages
 * through host memory, the replicas' DDP takes the group's device path (CUDA IPC), and the
 * result is one process's on the same GPU. */
static void stages_on_a_gpu_equal_one_process(void) {
    if (!gpus) {
        SKIP("no CUDA device");
        return;
    }
    equiv_on(TD_SCHEDULE_1F1B, 2, 1, 4, 0, "fc1", TD_AMP_O0, td_device_cuda(0));
    equiv_on(TD_SCHEDULE_GPIPE, 3, 1, 4, 0, "conv2,fc1", TD_AMP_O0, td_device_cuda(0));
    equiv_on(TD_SCHEDULE_1F1B, 2, 2, 4, 0, "conv2", TD_AMP_O0, td_device_cuda(0));
}

/* ---- dropout, trace ------------------------------------------------------------------ */

/* PyTorch's MNIST example Net (dropout2d and dropout) trained by 1F1B, GPipe and 1F1B again: the
 * same bits each time, because each micro-batch's masks depend on (seed, stage, step and
 * micro-batch). */
static void dropout_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    td_sequential *s;
    CHECK_OK(td_model_sequential(TD_MODEL_NET, &s));
    float *x;
    int64_t y[B];
    make_batch(s, &x, y);
    td_pipeline_schedule order[3] = {TD_SCHEDULE_1F1B, TD_SCHEDULE_GPIPE, TD_SCHEDULE_1F1B};
    float *first = NULL;
    size_t total = 0;
    td_trace *trace = NULL;
    CHECK_OK(td_trace_create(&trace, rank));
    for (int run = 0; run < 3; run++) {
        td_pipeline_params pp = td_pipeline_default_params();
        pp.schedule = order[run];
        pp.stages = 2;
        pp.micro_batches = 4;
        pp.batch = B;
        pp.split = "fc1";
        pp.seed = 9;
        pp.trace = run == 0 ? trace : NULL;
        td_pipeline *pipe = NULL;
        CHECK_OK(td_pipeline_create(&pipe, comm, s, &pp));
        if (!pipe) break;
        td_param *p;
        size_t n;
        CHECK_OK(td_pipeline_parameters(pipe, &p, &n));
        td_sgd_params hp = sgd();
        td_optim *opt;
        CHECK_OK(td_optim_create_sgd(&opt, p, n, &hp));
        for (int step = 0; step < STEPS; step++) {
            CHECK_OK(td_pipeline_step(pipe, x, y, NULL));
            CHECK_OK(td_optim_step(opt));
        }
        if (!first) {
            for (size_t i = 0; i < n; i++) total += p[i].count;
            first = malloc(total * sizeof *first);
        }
        size_t at = 0, differ = 0;
        for (size_t i = 0; i < n; i++) {
            if (run == 0)
                memcpy(first + at, p[i].data, p[i].count * sizeof(float));
            else
                differ += memcmp(first + at, p[i].data, p[i].count * sizeof(float)) != 0;
            at += p[i].count;
        }
        if (differ)
            TEST_FAIL_AT("rank %d: %s run %d differs from the first run in %zu tensors", rank,
                         td_pipeline_schedule_name(order[run]), run, differ);
        td_optim_destroy(opt);
        td_pipeline_destroy(pipe);
    }
    /* The trace holds the schedule: forwards, backwards and transfers of every micro-batch. */
    int fwd = 0, bwd = 0, sends = 0;
    for (size_t i = 0; i < td_trace_count(trace); i++) {
        td_trace_event e;
        CHECK_OK(td_trace_event_get(trace, i, &e));
        fwd += strncmp(e.name, "forward ", 8) == 0;
        bwd += strncmp(e.name, "backward ", 9) == 0;
        sends += strncmp(e.name, "send ", 5) == 0;
    }
    CHECK_EQ(fwd, 4 * STEPS);
    CHECK_EQ(bwd, 4 * STEPS);
    CHECK_EQ(sends, 4 * STEPS);
    td_trace_destroy(trace);
    free(first);
    free(x);
    td_sequential_destroy(s);
    td_comm_destroy(comm);
}

static void dropout_masks_replay_in_every_schedule(void) {
    CHECK_EQ(test_run_ranks(2, dropout_rank, NULL, 120, 0), 0);
}

/* ---- faults ------------------------------------------------------------------------- */

typedef struct {
    int dying;       /* this rank is killed at the start of step 1 */
    int mode;        /* 0: a rank dies; 1: rank 1 is built from another model; 2: rank 1 has
                        other options; 3: rank 1 evaluates while rank 0 trains; 4: rank 0 calls
                        an all-reduce on the pipeline's group while rank 1 steps */
    double *seconds; /* (world) how long the failing call took, shared */
} fault_job;

static void fault_rank(int rank, int size, int port, void *arg) {
    fault_job *j = arg;
    td_comm *comm = NULL;
    /* Told, not timed out: a failure that waited for the group's timeout shows in the seconds. */
    CHECK_OK(test_comm_create(&comm, rank, size, port, 20));
    if (!comm) return;
    td_sequential *s = conv_model(j->mode == 1 && rank == 1 ? 12 : 16);
    float *x;
    int64_t y[B];
    make_batch(s, &x, y);
    td_pipeline_params pp = td_pipeline_default_params();
    pp.stages = size;
    pp.micro_batches = j->mode == 2 && rank == 1 ? 2 : 4;
    pp.batch = B;
    pp.split = size == 3 ? "conv2,fc1" : j->mode == 1 ? "fc2" : "fc1";
    td_pipeline *pipe = NULL;
    uint64_t t0 = td_time_ns();
    td_status st = td_pipeline_create(&pipe, comm, s, &pp);
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", td_last_error());
    if (j->mode == 1) {
        CHECK_EQ(st, TD_ESHAPE);
        CHECK(strstr(msg,
                     "rank 0 has activations of shape (4, 16) between 'fc1' and 'fc2' but "
                     "rank 1 has activations of shape (4, 12) between 'fc1' and 'fc2'") != NULL);
    } else if (j->mode == 2) {
        CHECK_EQ(st, TD_EMISMATCH);
        CHECK(strstr(msg, "rank 0 has micro_batches = 4 but rank 1 has micro_batches = 2") != NULL);
    } else {
        CHECK_OK(st);
    }
    if (st != TD_OK) {
        if (test_case_failed) fprintf(stderr, "rank %d: %s\n", rank, msg);
        goto done;
    }
    for (int step = 0; step < 3; step++) {
        if (j->mode == 0 && step == 1 && rank == j->dying) raise(SIGKILL);
        t0 = td_time_ns();
        if (j->mode == 4 && step == 1 && rank == 0) {
            float v[4] = {0};
            st = td_comm_allreduce(comm, v, v, 4, TD_F32, TD_OP_SUM);
        } else if (j->mode == 3 && rank == 1) {
            double l;
            int64_t c;
            st = td_pipeline_evaluate(pipe, x, y, B, &l, &c);
        } else {
            st = td_pipeline_step(pipe, x, y, NULL);
        }
        if (st != TD_OK) break;
    }
    j->seconds[rank] = (double)(td_time_ns() - t0) * 1e-9;
    snprintf(msg, sizeof msg, "%s", td_last_error());
    CHECK(st != TD_OK);
    char me[64];
    snprintf(me, sizeof me, "pipeline stage %d (rank %d) of %d, step 1", rank, rank, size);
    if (j->mode == 0) {
        /* The group names the rank that died, in the caller's numbering. */
        char dead[64];
        snprintf(dead, sizeof dead, "peer rank %d (pid", j->dying);
        CHECK(st == TD_EPEER);
        CHECK(strstr(msg, me) != NULL);
        CHECK(strstr(msg, dead) != NULL && strstr(msg, "died") != NULL);
    } else if (j->mode == 3) {
        /* Both ranks, at once, with what each was starting. */
        CHECK_EQ(st, TD_EMISMATCH);
        CHECK(strstr(msg, "rank 0 has training step 0 but rank 1 has evaluation 0 of 16 "
                          "samples") != NULL);
    } else {
        /* The collective issued against the step is named, on both ranks. */
        CHECK_EQ(st, TD_EMISMATCH);
        CHECK(strstr(msg, "allreduce #") != NULL && strstr(msg, "(f32, 4 elements, sum)") != NULL);
        if (rank == 1) CHECK(strstr(msg, me) != NULL);
    }
    printf("    rank %d: %s\n", rank, msg);
    fflush(stdout);
    /* The pipeline is over: later calls say why at once. */
    CHECK(td_pipeline_step(pipe, x, y, NULL) == st);
    if (test_case_failed) fprintf(stderr, "rank %d: %s\n", rank, msg);
done:
    td_pipeline_destroy(pipe);
    td_sequential_destroy(s);
    free(x);
    td_comm_destroy(comm);
}

static void fault(int world, int mode, int dying) {
    fault_job j = {dying, mode, shared_doubles(world)};
    CHECK_EQ(test_run_ranks(world, fault_rank, &j, 60, mode == 0 ? 1 : 0), 0);
    for (int r = 0; r < world; r++)
        if (r != dying || mode != 0) CHECK(j.seconds[r] < 10); /* told, not timed out */
    munmap(j.seconds, (size_t)world * sizeof(double));
}

static void a_dead_stage_is_named_on_every_rank(void) {
    fault(3, 0, 1); /* the middle stage: both neighbours see it */
    fault(3, 0, 2); /* the last: stage 0 hears it through stage 1 */
}

static void stages_of_different_models_are_refused(void) { fault(2, 1, -1); }

static void different_options_are_refused(void) { fault(2, 2, -1); }

static void ranks_out_of_step_are_told(void) { fault(2, 3, -1); }

static void a_collective_against_a_step_is_told(void) { fault(2, 4, -1); }

/* ---- the split ---------------------------------------------------------------------- */

static void balanced_split(void) {
    size_t first[4];
    double even[4] = {1, 1, 1, 1}, front[6] = {5, 1, 1, 1, 1, 1}, back[5] = {1, 1, 1, 1, 4};
    CHECK_OK(td_pipeline_balance(even, 4, 2, first));
    CHECK(first[0] == 0 && first[1] == 2);
    CHECK_OK(td_pipeline_balance(front, 6, 2, first));
    CHECK(first[0] == 0 && first[1] == 1);
    CHECK_OK(td_pipeline_balance(back, 5, 3, first));
    CHECK(first[0] == 0 && first[2] == 4 && first[1] >= 1 && first[1] <= 3);
    CHECK_OK(td_pipeline_balance(even, 4, 4, first));
    CHECK(first[1] == 1 && first[2] == 2 && first[3] == 3);
    CHECK_STATUS(td_pipeline_balance(even, 4, 5, first), TD_EINVAL);
    td_sequential *s = conv_model(16);
    double t[4] = {0};
    CHECK_OK(td_pipeline_profile_layers(s, 4, 2, t));
    for (int i = 0; i < 4; i++) CHECK(t[i] > 0 && t[i] < 1);
    td_sequential_destroy(s);
    td_pipeline_schedule sch;
    CHECK_OK(td_pipeline_schedule_parse("1f1b", &sch));
    CHECK_EQ(sch, TD_SCHEDULE_1F1B);
    CHECK_STATUS(td_pipeline_schedule_parse("pipedream", &sch), TD_EINVAL);
}

typedef struct {
    int world;
    const char *split;
    int stages, micro;
    int64_t batch;
    td_status want;
    const char *text;
} bad_case;

static void bad_rank(int rank, int size, int port, void *arg) {
    const bad_case *c = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    td_sequential *s = conv_model(16);
    td_pipeline_params pp = td_pipeline_default_params();
    pp.split = c->split;
    pp.stages = c->stages;
    pp.micro_batches = c->micro;
    pp.batch = c->batch;
    td_pipeline *pipe = NULL;
    CHECK_STATUS(td_pipeline_create(&pipe, comm, s, &pp), c->want);
    if (!strstr(td_last_error(), c->text))
        TEST_FAIL_AT("rank %d: '%s' lacks '%s'", rank, td_last_error(), c->text);
    CHECK(pipe == NULL);
    td_sequential_destroy(s);
    td_comm_destroy(comm);
}

static void bad_options_fail_on_every_rank(void) {
    bad_case cases[] = {
        {3, "fc2,conv2", 3, 4, 16, TD_EINVAL, "not after stage 1's start"},
        {2, "fc9", 2, 4, 16, TD_ENOTFOUND, "no layer 'fc9'"},
        {2, "fc1", 3, 4, 16, TD_EINVAL, "not a multiple of 3 stages"},
        {2, "fc1", 2, 3, 16, TD_EINVAL, "batch 16 does not split into 3 micro-batches"},
        {2, "conv2,fc1", 2, 4, 16, TD_EINVAL, "2 stages need 1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        CHECK_EQ(test_run_ranks(cases[i].world, bad_rank, &cases[i], 60, 0), 0);
}

int main(void) {
    gpus = test_count_gpus();
    RUN(balanced_split);
    RUN(gpipe_equals_one_process);
    RUN(one_f_one_b_equals_one_process);
    RUN(naive_split_equals_one_process);
    RUN(batch_norm_per_micro_batch);
    RUN(pipeline_times_ddp_equals_one_process);
    RUN(mixed_precision_stages);
    RUN(stages_on_a_gpu_equal_one_process);
    RUN(dropout_masks_replay_in_every_schedule);
    RUN(a_dead_stage_is_named_on_every_rank);
    RUN(stages_of_different_models_are_refused);
    RUN(different_options_are_refused);
    RUN(ranks_out_of_step_are_told);
    RUN(a_collective_against_a_step_is_told);
    RUN(bad_options_fail_on_every_rank);
    TEST_END();
}
