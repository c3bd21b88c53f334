/* td_ddp's deterministic mode over real forked ranks: shard gradients, buffers and losses summed
 * in one fixed pairwise tree over the shards, the same bits at every world size.
 *
 * A hand-written "trainer" gives shard j of step s gradients whose magnitudes span 2^-20..2^20,
 * so that the order of the additions shows in the last bits; every rank checks its result
 * against the aligned pairwise tree computed here, bit for bit, at world sizes 1, 2, 4 and 8
 * with 8 shards and at 1 and 3 with 12 (the tree over three ranks' subtrees); a plain
 * left-to-right sum of the same numbers differs, so the check can fail. The same holds when
 * the trainer sums one parameter's shards itself (td_param.shard_sum, as a graph's linear layers
 * do under td_graph_set_shard) and reports it at the last shard only. Also: a world size
 * that does not divide the shards into a power of two, bf16 parameters, no_sync and half-width
 * communication are refused on every rank with a message naming the problem, and a parameter
 * that no backward reached counts as zero when asked. */
#include <math.h>
#include <string.h>

#include "tandem/ddp.h"

#include "test.h"
#include "test_comm_util.h" /* test_run_ranks, test_comm_create, test_shm_leftovers */

enum { NPAR = 3, NBUF = 6, STEPS = 3 };
static const size_t SIZES[NPAR] = {1000, 37, 5000};

/* Element e of parameter i's gradient in shard j of step s: magnitudes 2^-20 .. 2^20. */
static float leaf(int s, size_t j, size_t i, size_t e) {
    uint32_t w[4];
    td_philox4x32_stream(1000 + (uint64_t)s * 7 + i, j, e, w);
    float u = (float)(w[0] >> 8) * (1.0f / 16777216.0f) - 0.5f;
    return ldexpf(u, (int)(w[1] % 41) - 20);
}

/* What a shard's forward leaves in the buffers, from the step's start values, and its loss. */
static float buffer_after(float start, size_t j, size_t e) {
    return 0.9f * start + 0.1f * leaf(99, j, 7, e);
}
static float shard_loss(int s, size_t j) { return 2.0f + leaf(s, j, 11, 0); }

/* The aligned pairwise tree over v[0..n): v[i] += v[i + stride], stride 1, 2, 4, ... */
static float tree(float *v, size_t n) {
    for (size_t stride = 1; stride < n; stride *= 2)
        for (size_t i = 0; i + stride < n; i += 2 * stride) v[i] = v[i] + v[i + stride];
    return v[0];
}

typedef struct {
    size_t shards;
    int summed; /* the last parameter sums the rank's shards itself (shard_sum) */
} det_cfg;

typedef struct {
    td_param p[NPAR], b[1];
    float *data[NPAR], *grad[NPAR], buf[NBUF];
} det_model;

static void det_model_init(det_model *m) {
    static const char *names[NPAR] = {"a.weight", "b.bias", "c.weight"};
    memset(m, 0, sizeof *m);
    for (size_t i = 0; i < NPAR; i++) {
        m->data[i] = calloc(SIZES[i], sizeof(float));
        m->grad[i] = calloc(SIZES[i], sizeof(float));
        m->p[i] = (td_param){.name = names[i],
                             .data = m->data[i],
                             .grad = m->grad[i],
                             .count = SIZES[i],
                             .dtype = TD_F32,
                             .ndim = 1,
                             .shape = {(int64_t)SIZES[i]}};
    }
    for (size_t e = 0; e < NBUF; e++) m->buf[e] = 1.0f + (float)e;
    m->b[0] = (td_param){.name = "bn.running_mean", .data = m->buf, .count = NBUF,
                         .dtype = TD_F32, .ndim = 1, .shape = {NBUF}};
}

static void det_model_free(det_model *m) {
    for (size_t i = 0; i < NPAR; i++) {
        free(m->data[i]);
        free(m->grad[i]);
    }
}

/* One step: this rank's shards one by one, as a trainer runs them. A parameter with shard_sum
 * set gets its gradient once, at the last shard: the tree's sum of this rank's leaves. */
static void run_shards(td_ddp *ddp, det_model *m, int s, size_t first, size_t count) {
    float v[64];
    for (size_t k = 0; k < count; k++) {
        size_t j = first + k;
        CHECK_OK(td_ddp_prepare_forward(ddp));
        td_ddp_zero_grad(ddp);
        for (size_t e = 0; e < NBUF; e++) m->buf[e] = buffer_after(m->buf[e], j, e);
        td_ddp_set_loss(ddp, shard_loss(s, j));
        for (size_t i = NPAR; i-- > 0;) {
            float *g = m->p[i].grad; /* re-read: it moves from shard to shard */
            if (!m->p[i].shard_sum) {
                for (size_t e = 0; e < SIZES[i]; e++) g[e] += leaf(s, j, i, e);
            } else if (k + 1 == count) {
                for (size_t e = 0; e < SIZES[i]; e++) {
                    for (size_t l = 0; l < count; l++) v[l] = leaf(s, first + l, i, e);
                    g[e] = tree(v, count);
                }
            } else {
                continue;
            }
            CHECK_OK(td_ddp_grad_ready(ddp, i));
        }
        CHECK_OK(td_ddp_finish_backward(ddp));
    }
}

static void tree_rank(td_comm *comm, int rank, int world, const det_cfg *cfg) {
    size_t S = cfg->shards;
    det_model m;
    det_model_init(&m);
    m.p[NPAR - 1].shard_sum = cfg->summed;
    td_ddp_params dp = td_ddp_default_params();
    dp.deterministic = 1;
    dp.shards = S;
    dp.first_bucket_bytes = 512; /* several buckets: 1000 floats alone, then the rest */
    dp.bucket_bytes = 4096;
    td_ddp *ddp = NULL;
    CHECK_OK(td_ddp_create(&ddp, comm, m.p, NPAR, m.b, 1, &dp));
    if (!ddp) return;
    size_t first, count;
    td_ddp_shards(ddp, &first, &count);
    CHECK_EQ(first, (size_t)rank * S / (size_t)world);
    CHECK_EQ(count, S / (size_t)world);
    float ref_buf[NBUF], v[64], w[64];
    for (size_t e = 0; e < NBUF; e++) ref_buf[e] = 1.0f + (float)e;
    size_t wrong = 0, differs_from_a_plain_sum = 0;
    for (int s = 0; s < STEPS; s++) {
        run_shards(ddp, &m, s, first, count);
        for (size_t i = 0; i < NPAR; i++) {
            const float *g = m.p[i].grad;
            for (size_t e = 0; e < SIZES[i]; e++) {
                float plain = 0;
                for (size_t j = 0; j < S; j++) {
                    v[j] = leaf(s, j, i, e);
                    plain += v[j];
                }
                float want = tree(v, S) * (1.0f / (float)S);
                wrong += memcmp(&want, &g[e], sizeof want) != 0;
                differs_from_a_plain_sum += plain * (1.0f / (float)S) != want;
            }
        }
        for (size_t e = 0; e < NBUF; e++) {
            for (size_t j = 0; j < S; j++) w[j] = buffer_after(ref_buf[e], j, e);
            ref_buf[e] = tree(w, S) * (1.0f / (float)S);
            wrong += memcmp(&ref_buf[e], &m.buf[e], sizeof(float)) != 0;
        }
        for (size_t j = 0; j < S; j++) v[j] = shard_loss(s, j);
        float want_loss = tree(v, S) * (1.0f / (float)S), loss = td_ddp_loss(ddp);
        wrong += memcmp(&want_loss, &loss, sizeof loss) != 0;
    }
    if (wrong)
        TEST_FAIL_AT("world %d, %zu shards%s: %zu values differ from the fixed tree", world, S,
                     cfg->summed ? ", one parameter summed by the trainer" : "", wrong);
    CHECK(differs_from_a_plain_sum > 100); /* the order shows in the bits */
    CHECK_EQ(td_ddp_get_stats(ddp).sync_steps, STEPS);
    CHECK(td_ddp_get_stats(ddp).n_buckets >= 2);
    /* no_sync has no meaning here. */
    CHECK_STATUS(td_ddp_set_sync(ddp, 0), TD_EUNSUPPORTED);
    td_ddp_destroy(ddp);
    /* The gradients went back to the trainer's memory, with the last step's values. */
    CHECK(m.p[0].grad == m.grad[0]);
    det_model_free(&m);
}

static void tree_rank_job(int rank, int size, int port, void *arg) {
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 30));
    if (!comm) return;
    tree_rank(comm, rank, size, arg);
    td_comm_destroy(comm);
}

static void run_world(int world, size_t shards, int summed) {
    det_cfg cfg = {shards, summed};
    CHECK_EQ(test_run_ranks(world, tree_rank_job, &cfg, 60, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

static void same_bits_at_world_1_2_4_8(void) {
    for (int summed = 0; summed <= 1; summed++) {
        run_world(1, 8, summed);
        run_world(2, 8, summed);
        run_world(4, 8, summed);
        run_world(8, 8, summed);
    }
}

static void same_bits_at_world_1_and_3_with_12_shards(void) {
    for (int summed = 0; summed <= 1; summed++) {
        run_world(1, 12, summed);
        run_world(3, 12, summed);
    }
}

/* ---- refusals ------------------------------------------------------------------------- */

typedef struct {
    size_t shards;
    td_dtype dtype, comm_dtype;
    td_status want;
    const char *words; /* the message must hold this */
} refusal;

static void refusal_rank(int rank, int size, int port, void *arg) {
    const refusal *r = arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 30));
    if (!comm) return;
    det_model m;
    det_model_init(&m);
    for (size_t i = 0; i < NPAR; i++) m.p[i].dtype = r->dtype;
    td_ddp_params dp = td_ddp_default_params();
    dp.deterministic = 1;
    dp.shards = r->shards;
    dp.comm_dtype = r->comm_dtype;
    td_ddp *ddp = NULL;
    CHECK_STATUS(td_ddp_create(&ddp, comm, m.p, NPAR, m.b, 1, &dp), r->want);
    if (!strstr(td_last_error(), r->words))
        TEST_FAIL_AT("rank %d: '%s' does not say '%s'", rank, td_last_error(), r->words);
    CHECK(ddp == NULL);
    det_model_free(&m);
    td_comm_destroy(comm);
}

static void bad_world_sizes_and_dtypes_are_refused_on_every_rank(void) {
    refusal cases[] = {
        {8, TD_F32, TD_F32, TD_EINVAL, "8 shards at world size 3"},
        {8, TD_BF16, TD_F32, TD_EDTYPE, "deterministic mode sums f32"},
        {8, TD_F32, TD_BF16, TD_EINVAL, "comm_dtype is bf16"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        CHECK_EQ(test_run_ranks(c == 0 ? 3 : 2, refusal_rank, &cases[c], 30, 0), 0);
    CHECK_EQ(test_shm_leftovers(), 0);
}

/* A parameter that one shard's backward never reached is a zero gradient for that shard when
 * find_unused_parameters is set, and an error naming the count otherwise. */
static void unused_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 30));
    if (!comm) return;
    for (int tolerate = 0; tolerate < 2; tolerate++) {
        det_model m;
        det_model_init(&m);
        td_ddp_params dp = td_ddp_default_params();
        dp.deterministic = 1;
        dp.shards = 4;
        dp.find_unused_parameters = tolerate;
        td_ddp *ddp = NULL;
        CHECK_OK(td_ddp_create(&ddp, comm, m.p, NPAR, m.b, 1, &dp));
        if (!ddp) break;
        size_t first, count;
        td_ddp_shards(ddp, &first, &count);
        td_status last = TD_OK;
        for (size_t k = 0; k < count; k++) {
            size_t j = first + k;
            CHECK_OK(td_ddp_prepare_forward(ddp));
            td_ddp_zero_grad(ddp);
            for (size_t i = NPAR; i-- > 0;) {
                if (j == 1 && i == 1) continue; /* shard 1 never reaches b.bias */
                float *g = m.p[i].grad;
                for (size_t e = 0; e < SIZES[i]; e++) g[e] = leaf(0, j, i, e);
                CHECK_OK(td_ddp_grad_ready(ddp, i));
            }
            last = td_ddp_finish_backward(ddp);
        }
        if (tolerate) {
            CHECK_OK(last);
            float v[4];
            size_t wrong = 0;
            for (size_t e = 0; e < SIZES[1]; e++) {
                for (size_t j = 0; j < 4; j++) v[j] = j == 1 ? 0.0f : leaf(0, j, 1, e);
                float want = tree(v, 4) * 0.25f;
                wrong += memcmp(&want, &((float *)m.p[1].grad)[e], sizeof want) != 0;
            }
            CHECK_EQ(wrong, 0);
        } else {
            CHECK_STATUS(last, TD_EUNUSED);
        }
        td_ddp_destroy(ddp);
        det_model_free(&m);
    }
    td_comm_destroy(comm);
}

static void unreached_parameters_count_as_zero_when_asked(void) {
    CHECK_EQ(test_run_ranks(2, unused_rank, NULL, 30, 0), 0);
}

int main(void) {
    RUN(same_bits_at_world_1_2_4_8);
    RUN(same_bits_at_world_1_and_3_with_12_shards);
    RUN(bad_world_sizes_and_dtypes_are_refused_on_every_rank);
    RUN(unreached_parameters_count_as_zero_when_asked);
    TEST_END();
}
