/* Parameters tied across pipeline stages, on the GPT whose output projection is its token
 * embedding: a 1F1B pipeline of 2 stages (embedding | head) and of 3 (embedding | blocks | head,
 * the middle stage holding no copy) trains to the loss and parameters of one process on the same
 * batch (AdamW and a gradient norm clipped over the whole model, <= 1e-5 relative per tensor
 * after a few steps), with the copies of transformer.wte.weight on the first and last stage the
 * same bits. A name held with two shapes by two stages is refused on every rank, naming both;
 * so are tied parameters under ZeRO stage 2, whose gradients end sharded.
 * Ranks are forked (td_spawn), over the shm backend. */
#include <string.h>
#include <sys/mman.h>

#include "tandem/tandem.h"

#include "test.h"
#include "test_comm_util.h"

#define B 8      /* sequences per step */
#define STEPS 4  /* optimizer steps */
#define TOL 1e-5 /* relative difference of a parameter tensor */
#define WTE "transformer.wte.weight"

static td_gpt_params tiny(void) {
    td_gpt_params p = {.layers = 2, .heads = 2, .width = 16, .context = 8, .vocab = 64};
    return p;
}

/* B sequences of token ids and their next tokens (one label per position). */
static void make_batch(const td_gpt_params *p, float *x, int64_t *y) {
    td_rng r;
    td_rng_init(&r, 77);
    for (int64_t i = 0; i < B * p->context; i++) {
        x[i] = (float)(td_rng_u32(&r) % (uint32_t)p->vocab);
        y[i] = (int64_t)(td_rng_u32(&r) % (uint32_t)p->vocab);
    }
}

static td_adamw_params adamw(void) {
    td_adamw_params a = td_adamw_default_params();
    a.lr = 1e-2;
    a.beta2 = 0.95;
    a.weight_decay = 0.1;
    return a;
}

/* A clip that bites: the first steps' gradient norms are above it, so the test sees the norm
 * summed over the stages (a per-stage norm would scale by other factors). */
#define MAX_NORM 0.5

/* ||a - b|| / ||b|| over a parameter's elements, leaving out the key third of each
 * attn.c_attn.bias: its gradient is exactly zero in exact arithmetic (softmax ignores what adds
 * to every score of a row), so what AdamW steps it by is float noise normalised, which differs
 * with any order of summation; its query and value thirds are compared. */
static double rel_diff(const char *name, const float *a, const float *b, size_t n) {
    size_t skip_from = n, skip_to = n;
    const char *at = strstr(name, "attn.c_attn.bias");
    if (at && at[strlen("attn.c_attn.bias")] == 0) skip_from = n / 3, skip_to = 2 * n / 3;
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (i >= skip_from && i < skip_to) continue;
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

typedef struct {
    int stages;
    const char *split;
    double *worst; /* (world) shared with the parent: largest relative difference per rank */
} gpt_job;

static void gpt_rank(int rank, int size, int port, void *arg) {
    gpt_job *j = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    td_gpt_params gp = tiny();
    td_sequential *s;
    CHECK_OK(td_gpt_sequential(&gp, &s));
    float x[B * 8];
    int64_t y[B * 8];
    make_batch(&gp, x, y);
    td_pipeline_params pp = td_pipeline_default_params();
    pp.schedule = TD_SCHEDULE_1F1B;
    pp.stages = j->stages;
    pp.micro_batches = 4;
    pp.batch = B;
    pp.split = j->split;
    pp.seed = 3;
    td_pipeline *pipe = NULL;
    CHECK_OK(td_pipeline_create(&pipe, comm, s, &pp));
    if (!pipe) return;
    td_pipeline_info info = td_pipeline_get_info(pipe);
    int first = info.stage == 0, last = info.stage + 1 == j->stages;
    CHECK_EQ(info.tied_params, first || last ? 1 : 0);
    td_param *p;
    size_t n;
    CHECK_OK(td_pipeline_parameters(pipe, &p, &n));
    size_t wte = n;
    for (size_t i = 0; i < n; i++) {
        if (!strcmp(p[i].name, WTE)) wte = i;
        CHECK_EQ(td_pipeline_param_owner(pipe, i), strcmp(p[i].name, WTE) ? info.stage : 0);
    }
    CHECK_EQ(td_pipeline_param_owner(pipe, n), -1);
    CHECK(first || last ? wte < n : wte == n);
    td_adamw_params ap = adamw();
    td_optim *opt;
    CHECK_OK(td_optim_create_adamw(&opt, p, n, &ap));
    float loss = 0;
    double norm = 0, norms[STEPS];
    for (int step = 0; step < STEPS; step++) {
        CHECK_OK(td_pipeline_step(pipe, x, y, &loss));
        CHECK_OK(td_pipeline_clip_grad_norm(pipe, MAX_NORM, &norm));
        norms[step] = norm;
        CHECK_OK(td_optim_step(opt));
    }

    /* One process on the same batch, the same optimizer and clip. */
    td_graph *g;
    td_model m;
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_model_build_sequential(g, s, B, pp.seed, &m));
    td_param *rp;
    size_t rn;
    CHECK_OK(td_graph_parameters(g, &rp, &rn));
    td_optim *ropt;
    CHECK_OK(td_optim_create_adamw(&ropt, rp, rn, &ap));
    float rloss = 0;
    double rnorm = 0;
    int clipped = 0;
    for (int step = 0; step < STEPS; step++) {
        CHECK_OK(td_tensor_write(m.input, x));
        CHECK_OK(td_tensor_write(m.labels, y));
        CHECK_OK(td_graph_forward(g));
        rloss = *(float *)td_tensor_data(m.loss);
        CHECK_OK(td_graph_zero_grad(g));
        CHECK_OK(td_graph_backward(g, m.loss));
        CHECK_OK(td_clip_grad_norm(rp, rn, MAX_NORM, &rnorm));
        CHECK_NEAR(norms[step], rnorm, 1e-5 * rnorm);
        clipped += rnorm > MAX_NORM;
        CHECK_OK(td_optim_step(ropt));
    }
    CHECK(clipped > 0);
    if (last) CHECK_NEAR(loss, rloss, 1e-5 * rloss);
    double worst = 0;
    size_t found = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t k = 0; k < rn; k++) {
            if (strcmp(p[i].name, rp[k].name)) continue;
            CHECK_EQ(p[i].count, rp[k].count);
            double d = rel_diff(p[i].name, p[i].data, rp[k].data, p[i].count);
            if (d > TOL) TEST_FAIL_AT("stage %d: %s differs by %.3g", info.stage, p[i].name, d);
            worst = d > worst ? d : worst;
            found++;
        }
    CHECK_EQ(found, n);
    j->worst[rank] = worst;

    /* The copies of the tied weight are the same bits on the first and the last stage. */
    if (last) CHECK_OK(td_comm_send(comm, p[wte].data, p[wte].count, TD_F32, 0, 9));
    if (first) {
        float *theirs = malloc(p[wte].count * sizeof *theirs);
        CHECK_OK(td_comm_recv(comm, theirs, p[wte].count, TD_F32, j->stages - 1, 9));
        if (memcmp(theirs, p[wte].data, p[wte].count * sizeof *theirs))
            TEST_FAIL_AT("the last stage's %s differs from the first stage's", WTE);
        free(theirs);
    }
    td_optim_destroy(ropt);
    td_graph_destroy(g);
    td_optim_destroy(opt);
    td_pipeline_destroy(pipe);
    td_sequential_destroy(s);
    td_comm_destroy(comm);
}

static void gpt_pipeline(int stages, const char *split) {
    gpt_job j = {stages, split,
                 mmap(NULL, (size_t)stages * sizeof(double), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS, -1, 0)};
    for (int r = 0; r < stages; r++) j.worst[r] = -1;
    CHECK_EQ(test_run_ranks(stages, gpt_rank, &j, 120, 0), 0);
    double worst = 0;
    for (int r = 0; r < stages; r++) {
        CHECK(j.worst[r] >= 0);
        worst = j.worst[r] > worst ? j.worst[r] : worst;
    }
    printf("    1f1b P=%d (stages at embed %s): largest relative difference %.2e\n", stages, split,
           worst);
    munmap(j.worst, (size_t)stages * sizeof(double));
}

static void gpt_two_stages_equal_one_process(void) { gpt_pipeline(2, "h.1"); }

static void gpt_three_stages_equal_one_process(void) { gpt_pipeline(3, "h.0,head"); }

/* ---- a name on two stages with two shapes ------------------------------------------- */

/* A linear layer on the weight called "shared": the graph's own when it has one, as a GPT's
 * head reuses the token embedding, else a new one of (out, in). Built whole, the model's two
 * layers use the first one's (4, 4); the second layer built alone makes a (3, 4) copy, which
 * is what a tied weight's copy of the wrong shape looks like. */
static td_status shared_layer(td_graph *g, const char *name, td_tensor *x, td_rng *rng,
                              const void *arg, td_tensor **y) {
    (void)name, (void)rng;
    int64_t out = *(const int64_t *)arg;
    td_param *ps;
    size_t n;
    td_status s = td_graph_parameters(g, &ps, &n);
    if (s) return s;
    td_tensor *w = NULL;
    for (size_t i = 0; i < n; i++)
        if (!strcmp(ps[i].name, "shared")) w = td_graph_param_tensor(g, i);
    if (!w) {
        s = td_graph_param(g, "shared", td_shape_2d(out, td_tensor_shape(x).dim[1]), &w);
        if (s) return s;
        memset(td_tensor_data(w), 0, (size_t)td_tensor_numel(w) * sizeof(float));
    }
    return td_graph_linear(g, x, w, NULL, y);
}

static void mismatch_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    td_sequential *s;
    int64_t four = 4, three = 3;
    CHECK_OK(td_sequential_create(&s, td_shape_1d(4)));
    CHECK_OK(td_sequential_add(s, "a", shared_layer, &four, sizeof four));
    CHECK_OK(td_sequential_add(s, "b", shared_layer, &three, sizeof three));
    td_pipeline_params pp = td_pipeline_default_params();
    pp.stages = 2;
    pp.batch = 4;
    pp.micro_batches = 2;
    pp.split = "b";
    td_pipeline *pipe = NULL;
    CHECK_STATUS(td_pipeline_create(&pipe, comm, s, &pp), TD_ESHAPE);
    CHECK(pipe == NULL);
    const char *e = td_last_error();
    if (!strstr(e, "stage 0 holds 'shared' of shape (4, 4)") ||
        !strstr(e, "stage 1 holds 'shared' of shape (3, 4)"))
        TEST_FAIL_AT("rank %d: %s", rank, e);
    td_sequential_destroy(s);
    td_comm_destroy(comm);
}

static void a_name_with_two_shapes_is_refused(void) {
    CHECK_EQ(test_run_ranks(2, mismatch_rank, NULL, 60, 0), 0);
}

/* 2 stages x 2 replicas of the GPT with ZeRO stage 2: refused on every rank (the head's stage
 * and the embedding's both hold the tied weight and name it). */
static void sharded_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 60));
    if (!comm) return;
    td_gpt_params gp = tiny();
    td_sequential *s;
    CHECK_OK(td_gpt_sequential(&gp, &s));
    td_pipeline_params pp = td_pipeline_default_params();
    pp.stages = 2;
    pp.micro_batches = 2;
    pp.batch = B;
    pp.split = "h.1";
    pp.zero_stage = 2;
    td_pipeline *pipe = NULL;
    CHECK_STATUS(td_pipeline_create(&pipe, comm, s, &pp), TD_EINVAL);
    CHECK(pipe == NULL);
    const char *e = td_last_error();
    if (!strstr(e, "tied parameter such as '" WTE "'") || !strstr(e, "ZeRO stage 2"))
        TEST_FAIL_AT("rank %d: %s", rank, e);
    td_sequential_destroy(s);
    td_comm_destroy(comm);
}

static void tied_parameters_under_sharded_gradients_are_refused(void) {
    CHECK_EQ(test_run_ranks(4, sharded_rank, NULL, 60, 0), 0);
}

int main(void) {
    RUN(gpt_two_stages_equal_one_process);
    RUN(gpt_three_stages_equal_one_process);
    RUN(a_name_with_two_shapes_is_refused);
    RUN(tied_parameters_under_sharded_gradients_are_refused);
    TEST_END();
}
