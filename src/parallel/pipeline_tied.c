/* Parameters tied across stages, as Megatron-LM keeps a GPT's word embedding on its first and
 * last stage: a parameter of one name on several stages is one weight (a layer that reuses a
 * weight finds it by name when the model is built whole, and builds its own copy when built
 * alone), so each copy is made equal to the lowest stage's at creation, and after every
 * step's backward the stages that hold it sum their gradients of it: each copy then holds the
 * whole model's gradient and steps the same. Also the gradient norm of the whole model across
 * stages (torch's clip_grad_norm_ over every stage, Megatron's model-parallel clipping), which
 * counts a tied parameter once. In deterministic mode each micro-batch's gradient of a tied
 * weight is handed down the stages that hold it (pp_chain), as one process's backward adds its
 * uses, so that the lowest stage's shard tree sums what one process's would. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "optim/optim_impl.h"
#include "parallel/grad_norm.h"
#include "parallel/pipeline_impl.h"

/* One parameter as the other stages see it. */
typedef struct {
    uint64_t key; /* the first 8 bytes of the SHA-256 of the whole name */
    int64_t ndim, dims[TD_MAX_DIMS];
    char name[96]; /* as given, cut at 95 bytes (for messages) */
} pp_entry;

static void entry_of(const td_param *p, pp_entry *e) {
    memset(e, 0, sizeof *e);
    uint8_t d[32];
    td_sha256(p->name, strlen(p->name), d);
    memcpy(&e->key, d, sizeof e->key);
    e->ndim = p->ndim;
    for (int i = 0; i < p->ndim; i++) e->dims[i] = p->shape[i];
    snprintf(e->name, sizeof e->name, "%s", p->name);
}

static int same_shape(const pp_entry *a, const pp_entry *b) {
    return a->ndim == b->ndim && memcmp(a->dims, b->dims, sizeof a->dims) == 0;
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static int cmp_tied(const void *a, const void *b) {
    const pp_tied *x = a, *y = b;
    if (x->group != y->group) return x->group < y->group ? -1 : 1;
    return x->key < y->key ? -1 : x->key > y->key;
}

/* Every stage's entries: all[s * max + i] is stage s's parameter i (i < count[s]). Every rank
 * of the replica computes the same from them. */
typedef struct {
    int P;
    int64_t count[TD_PIPELINE_MAX_STAGES], max;
    pp_entry *all;
} pp_census;

/* The stages holding a parameter with stage s's entry i's name, as a bit mask; a holder of
 * another shape is TD_ESHAPE. */
static td_status holders(const pp_census *c, int s, int64_t i, uint32_t *mask) {
    const pp_entry *e = &c->all[(size_t)s * (size_t)c->max + (size_t)i];
    *mask = 0;
    for (int t = 0; t < c->P; t++)
        for (int64_t j = 0; j < c->count[t]; j++) {
            const pp_entry *f = &c->all[(size_t)t * (size_t)c->max + (size_t)j];
            if (f->key != e->key) continue;
            if (!same_shape(e, f)) {
                char a[128], b[128];
                return td__fail(TD_ESHAPE,
                                "pipeline: stage %d holds '%s' of shape %s but stage %d holds "
                                "'%s' of shape %s (a parameter of one name on two stages is one "
                                "weight tied across them)",
                                s, e->name, td__dims_str(a, sizeof a, e->ndim, e->dims), t, f->name,
                                td__dims_str(b, sizeof b, f->ndim, f->dims));
            }
            *mask |= 1u << t;
        }
    return TD_OK;
}

/* Which parameters of this stage are tied, and the distinct sets of stages that tie some, in
 * ascending order of their masks (the same list on every stage). */
static td_status find_tied(td_pipeline *pp, const pp_census *c, uint32_t *sets, int *n_sets) {
    pp_slot *s0 = &pp->slots[0];
    *n_sets = 0;
    for (int s = 0; s < c->P; s++)
        for (int64_t i = 0; i < c->count[s]; i++) {
            uint32_t mask;
            TD__TRY(holders(c, s, i, &mask));
            if (s == pp->stage) pp->owner[i] = __builtin_ctz(mask);
            if (mask == 1u << s) continue;
            int known = 0;
            for (int k = 0; k < *n_sets; k++) known |= sets[k] == mask;
            if (!known) sets[(*n_sets)++] = mask;
        }
    qsort(sets, (size_t)*n_sets, sizeof *sets, cmp_u32);
    pp->tied = calloc(s0->n_params ? s0->n_params : 1, sizeof *pp->tied);
    if (!pp->tied) return td__fail(TD_ENOMEM, "pipeline: out of memory for tied parameters");
    for (size_t i = 0; i < s0->n_params; i++) {
        uint32_t mask;
        TD__TRY(holders(c, pp->stage, (int64_t)i, &mask));
        if (mask == 1u << pp->stage) continue;
        int k = 0;
        while (sets[k] != mask) k++;
        pp_tied *t = &pp->tied[pp->n_tied++];
        t->param = i;
        t->group = k;
        t->key = c->all[(size_t)pp->stage * (size_t)c->max + i].key;
    }
    qsort(pp->tied, (size_t)pp->n_tied, sizeof *pp->tied, cmp_tied);
    return TD_OK;
}

static td_status census(td_pipeline *pp, pp_census *c) {
    pp_slot *s0 = &pp->slots[0];
    c->P = pp->P;
    int64_t mine = (int64_t)s0->n_params;
    TD__TRY(td_comm_allgather(pp->pipe, &mine, c->count, 1, TD_I64));
    c->max = 1;
    for (int s = 0; s < pp->P; s++) c->max = c->count[s] > c->max ? c->count[s] : c->max;
    size_t row = (size_t)c->max * sizeof(pp_entry);
    pp_entry *own = calloc((size_t)c->max, sizeof *own);
    c->all = calloc((size_t)pp->P * (size_t)c->max, sizeof *c->all);
    if (!own || !c->all) {
        free(own);
        return td__fail(TD_ENOMEM, "pipeline: out of memory");
    }
    for (size_t i = 0; i < s0->n_params; i++) entry_of(&s0->params[i], &own[i]);
    td_status s = td_comm_allgather(pp->pipe, own, c->all, row, TD_U8);
    free(own);
    return s;
}

td_status td__pp_tie(td_pipeline *pp) {
    pp_slot *s0 = &pp->slots[0];
    pp->owner = calloc(s0->n_params ? s0->n_params : 1, sizeof *pp->owner);
    pp->counted = calloc(s0->n_params ? s0->n_params : 1, sizeof *pp->counted);
    if (!pp->owner || !pp->counted) return td__fail(TD_ENOMEM, "pipeline: out of memory");
    for (size_t i = 0; i < s0->n_params; i++) pp->owner[i] = pp->stage;
    if (pp->P == 1) return TD_OK;
    pp_census c;
    memset(&c, 0, sizeof c);
    uint32_t *sets = NULL; /* at most one new set per parameter of any stage */
    int n_sets = 0;
    td_status s = census(pp, &c);
    if (s == TD_OK && !(sets = calloc((size_t)(c.max * pp->P), sizeof *sets)))
        s = td__fail(TD_ENOMEM, "pipeline: out of memory");
    if (s == TD_OK) s = find_tied(pp, &c, sets, &n_sets);
    free(c.all);
    if (s == TD_OK && n_sets > 0 &&
        !(pp->tied_groups = calloc((size_t)n_sets, sizeof *pp->tied_groups)))
        s = td__fail(TD_ENOMEM, "pipeline: out of memory");
    if (s == TD_OK) pp->n_tied_groups = n_sets;
    for (int k = 0; s == TD_OK && k < n_sets; k++) {
        int in = (int)(sets[k] >> pp->stage) & 1;
        s = td_comm_split(pp->pipe, in ? 0 : -1, pp->stage, &pp->tied_groups[k]);
    }
    free(sets);
    TD__TRY(s);
    /* Each copy starts as the lowest stage's: rank 0 of a group ordered by stage. */
    for (int i = 0; i < pp->n_tied; i++) {
        const td_param *p = &s0->params[pp->tied[i].param];
        TD__TRY(
            td_comm_broadcast(pp->tied_groups[pp->tied[i].group], p->data, p->count, p->dtype, 0));
    }
    return TD_OK;
}

td_status td__pp_reduce_tied(td_pipeline *pp) {
    pp_slot *s0 = &pp->slots[0];
    for (int i = 0; i < pp->n_tied; i++) {
        const td_param *p = &s0->params[pp->tied[i].param];
        td_comm *group = pp->tied_groups[pp->tied[i].group];
        /* deterministic mode: the lowest stage's shard tree summed the whole gradients */
        td_status s =
            pp->det ? td_comm_broadcast(group, p->grad, p->count, p->dtype, 0)
                    : td_comm_allreduce(group, p->grad, p->grad, p->count, p->dtype, TD_OP_SUM);
        if (s) {
            char msg[768];
            snprintf(msg, sizeof msg, "%s", td_last_error());
            return td__pp_fail(pp, s, "summing the gradient of the tied parameter '%s': %s",
                               p->name, msg);
        }
    }
    return TD_OK;
}

static td_status pp_norm_failed(td_pipeline *pp, td_status s) {
    char msg[768];
    snprintf(msg, sizeof msg, "%s", td_last_error());
    return td__pp_fail(pp, s, "summing the gradient norm over the stages: %s", msg);
}

td_status td_pipeline_clip_grad_norm(td_pipeline *pp, double max_norm, double *total_norm) {
    if (!pp) return td__fail(TD_EINVAL, "td_pipeline_clip_grad_norm: pipeline is NULL");
    if (!(max_norm > 0))
        return td__fail(TD_EINVAL, "td_pipeline_clip_grad_norm: max_norm %g, expected > 0",
                        max_norm);
    if (pp->failed) return td__fail(pp->failed, "%s", pp->failed_msg);
    /* Each stage's sum of squares: ZeRO's shards summed over the replicas (creation refused tied
     * parameters then), else the whole gradients of the parameters this stage owns; of a
     * tensor-parallel stage, the slices on every tp rank and the whole tensors (which every tp
     * rank holds alike) on tp rank 0, summed over tp too. */
    int tp_rank = pp->tp ? td_comm_rank(pp->tp) : 0, tp_size = pp->tp ? td_comm_size(pp->tp) : 1;
    td_param *shards = NULL;
    size_t n = 0;
    if (pp->replicas_impl) TD__TRY(pp->replicas->norm_grads(pp->replicas_impl, &shards, &n));
    pp_slot *s0 = &pp->slots[0];
    const td_param *from = shards ? shards : s0->params;
    size_t count = shards ? n : s0->n_params;
    n = 0;
    for (size_t i = 0; i < count; i++)
        if ((shards || pp->owner[i] == pp->stage) && (from[i].split.ranks > 0 || tp_rank == 0))
            pp->counted[n++] = from[i];
    const char *what = "td_pipeline_clip_grad_norm";
    td__sumsq acc;
    td__sumsq_init(&acc);
    td_status s = td__grads_sumsq(pp->counted, n, &acc, what);
    td_comm *groups[3] = {shards ? pp->dp : NULL, pp->pipe, tp_size > 1 ? pp->tp : NULL};
    if (s == TD_OK) s = td__sumsq_allreduce(&acc, groups, 3);
    if (s) return pp_norm_failed(pp, s);
    double sum = td__sumsq_value(&acc);
    /* The same coefficient on every stage, so the copies of a tied weight stay equal. */
    return shards ? td__grads_clip(shards, count, max_norm, sum, total_norm, what)
                  : td__grads_clip(s0->params, s0->n_params, max_norm, sum, total_norm, what);
}

int td_pipeline_param_owner(const td_pipeline *pp, size_t i) {
    if (!pp || !pp->owner || i >= pp->slots[0].n_params) return -1;
    return pp->owner[i];
}

/* ---- deterministic mode: each micro-batch's tied gradients handed down -------------------- */

/* The stage number of each rank of a tied group (its ranks are the stages in order). */
static td_status chain_stages(td_comm *group, int stage, int *stages) {
    return td_comm_allgather(group, &stage, stages, 1, TD_I32);
}

static td_status chain_start(td_pipeline *pp, pp_chain *c, int k) {
    c->group = pp->tied_groups[k];
    c->up = c->down = -1;
    if (!c->group) return TD_OK;
    pp_slot *s0 = &pp->slots[0];
    for (int i = 0; i < pp->n_tied; i++)
        if (pp->tied[i].group == k) c->floats += s0->params[pp->tied[i].param].count;
    int r = td_comm_rank(c->group), G = td_comm_size(c->group);
    int stages[TD_PIPELINE_MAX_STAGES];
    TD__TRY(chain_stages(c->group, pp->stage, stages));
    if (r + 1 < G) c->up = r + 1;
    if (r > 0) c->down = r - 1;
    size_t bytes = PP_HDR + c->floats * sizeof(float);
    c->buf_in = calloc((size_t)pp->K, sizeof *c->buf_in);
    c->buf_out = calloc((size_t)pp->K, sizeof *c->buf_out);
    c->j_in = calloc((size_t)pp->K, sizeof *c->j_in);
    c->j_out = calloc((size_t)pp->K, sizeof *c->j_out);
    if (!c->buf_in || !c->buf_out || !c->j_in || !c->j_out)
        return td__fail(TD_ENOMEM, "pipeline: out of memory for tied gradients");
    for (int s = 0; s < pp->K; s++) {
        if (c->up >= 0 && !(c->buf_in[s] = aligned_alloc(64, (bytes + 63) / 64 * 64)))
            return td__fail(TD_ENOMEM, "pipeline: out of memory for tied gradients");
        if (c->down >= 0 && !(c->buf_out[s] = aligned_alloc(64, (bytes + 63) / 64 * 64)))
            return td__fail(TD_ENOMEM, "pipeline: out of memory for tied gradients");
        c->j_in[s] = (pp_job){.buf = c->buf_in[s], .bytes = bytes};
        c->j_out[s] = (pp_job){.buf = c->buf_out[s], .bytes = bytes};
    }
    td_trace *tr = pp->opt.trace;
    if (c->up >= 0)
        TD__TRY(td__pp_channel_start(&c->in, c->group, c->up, PP_TAG_TIED, 0, "recv tied gradients",
                                     tr, pp->opt.transfer_nice));
    if (c->down >= 0)
        TD__TRY(td__pp_channel_start(&c->out, c->group, c->down, PP_TAG_TIED, 1,
                                     "send tied gradients", tr, pp->opt.transfer_nice));
    c->up = c->up >= 0 ? stages[c->up] : -1; /* from now on: the neighbours' stages */
    c->down = c->down >= 0 ? stages[c->down] : -1;
    return TD_OK;
}

td_status td__pp_chains_start(td_pipeline *pp) {
    if (!pp->det || !pp->n_tied_groups) return TD_OK;
    pp->chains = calloc((size_t)pp->n_tied_groups, sizeof *pp->chains);
    if (!pp->chains) return td__fail(TD_ENOMEM, "pipeline: out of memory for tied gradients");
    for (int k = 0; k < pp->n_tied_groups; k++) TD__TRY(chain_start(pp, &pp->chains[k], k));
    return TD_OK;
}

void td__pp_chains_stop(td_pipeline *pp) {
    for (int k = 0; pp->chains && k < pp->n_tied_groups; k++) {
        pp_chain *c = &pp->chains[k];
        td__pp_channel_stop(&c->in);
        td__pp_channel_stop(&c->out);
        for (int s = 0; s < pp->K; s++) {
            if (c->buf_in) free(c->buf_in[s]);
            if (c->buf_out) free(c->buf_out[s]);
        }
        free(c->buf_in);
        free(c->buf_out);
        free(c->j_in);
        free(c->j_out);
    }
    free(pp->chains);
    pp->chains = NULL;
}

void td__pp_chains_post(td_pipeline *pp, int m) {
    for (int k = 0; pp->chains && k < pp->n_tied_groups; k++) {
        pp_chain *c = &pp->chains[k];
        if (c->up < 0) continue;
        c->j_in[m % pp->K].micro_batch = m;
        td__pp_channel_submit(&c->in, &c->j_in[m % pp->K]);
    }
}

/* Fails the pipeline with a tied transfer's error, naming the peer. */
static td_status chain_failed(td_pipeline *pp, td_status s, const char *doing, int m, int peer) {
    char msg[768];
    snprintf(msg, sizeof msg, "%s", td_last_error());
    return td__pp_fail(pp, s, "%s of micro-batch %d with stage %d: %s", doing, m, peer, msg);
}

td_status td__pp_chains_seed(td_pipeline *pp, int m) {
    pp_slot *s0 = &pp->slots[0], *sl = &pp->slots[m % pp->K];
    pp->cur_m = m;
    for (int k = 0; pp->chains && k < pp->n_tied_groups; k++) {
        pp_chain *c = &pp->chains[k];
        c->captured = 0;
        td_status s;
        if (c->down >= 0 && (s = td__pp_job_wait(&c->out, &c->j_out[m % pp->K])))
            return chain_failed(pp, s, "sending tied gradients", m - pp->K, c->down);
        if (c->up < 0) continue;
        pp_job *j = &c->j_in[m % pp->K];
        if ((s = td__pp_job_wait(&c->in, j)))
            return chain_failed(pp, s, "receiving tied gradients", m, c->up);
        td_shape shape = td_shape_1d((int64_t)c->floats);
        TD__TRY(td__pp_check_header(pp, j->buf, PP_TIED, m, c->up, &shape));
        const float *from = (const float *)(j->buf + PP_HDR);
        for (int i = 0; i < pp->n_tied; i++) {
            if (pp->tied[i].group != k) continue;
            size_t at = pp->tied[i].param;
            const td_param *p = &s0->params[at];
            memcpy(p->grad, from, p->count * sizeof(float));
            from += p->count;
            if ((s = td_graph_accumulate_param_grad(sl->g, at)))
                return td__pp_fail(pp, s, "seeding the tied gradient of '%s'", p->name);
        }
        if (m + pp->K < pp->M) {
            j->micro_batch = m + pp->K;
            td__pp_channel_submit(&c->in, j);
        }
    }
    return TD_OK;
}

void td__pp_chains_grad_ready(size_t param_index, void *pipeline) {
    td_pipeline *pp = pipeline;
    pp_slot *s0 = &pp->slots[0];
    for (int i = 0; pp->chains && i < pp->n_tied; i++) {
        if (pp->tied[i].param != param_index) continue;
        int k = pp->tied[i].group;
        pp_chain *c = &pp->chains[k];
        if (c->down < 0) break;
        /* its place in the message: after the set's tied parameters before it */
        size_t at = 0;
        int total = 0;
        for (int t = 0; t < pp->n_tied; t++) {
            if (pp->tied[t].group != k) continue;
            total++;
            if (t < i) at += s0->params[pp->tied[t].param].count;
        }
        int m = pp->cur_m;
        unsigned char *buf = c->buf_out[m % pp->K];
        const td_param *p = &s0->params[param_index];
        memcpy((float *)(buf + PP_HDR) + at, p->grad, p->count * sizeof(float));
        if (++c->captured == total) {
            td_shape shape = td_shape_1d((int64_t)c->floats);
            td__pp_put_header(pp, buf, PP_TIED, m, &shape);
            c->j_out[m % pp->K].micro_batch = m;
            td__pp_channel_submit(&c->out, &c->j_out[m % pp->K]);
        }
        break;
    }
    pp->replicas->grad_ready(param_index, pp->replicas_impl);
}

td_status td__pp_chains_drain(td_pipeline *pp) {
    for (int k = 0; pp->chains && k < pp->n_tied_groups; k++) {
        pp_chain *c = &pp->chains[k];
        for (int s = 0; c->down >= 0 && s < pp->K; s++) {
            td_status st = td__pp_job_wait(&c->out, &c->j_out[s]);
            if (st)
                return chain_failed(pp, st, "sending tied gradients", c->j_out[s].micro_batch,
                                    c->down);
        }
    }
    return TD_OK;
}
