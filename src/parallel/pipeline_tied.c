/* Parameters tied across stages, as Megatron-LM keeps a GPT's word embedding on its first and
 * last stage: a parameter of one name on several stages is one weight (a layer that reuses a
 * weight finds it by name when the model is built whole, and builds its own copy when built
 * alone), so each copy is made equal to the lowest stage's at creation, and after every
 * step's backward the stages that hold it sum their gradients of it: each copy then holds the
 * whole model's gradient and steps the same. Also the gradient norm of the whole model across
 * stages (torch's clip_grad_norm_ over every stage, Megatron's model-parallel clipping), which
 * counts a tied parameter once. Nothing here runs between micro-batches. */
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
        td_status s = td_comm_allreduce(pp->tied_groups[pp->tied[i].group], p->grad, p->grad,
                                        p->count, p->dtype, TD_OP_SUM);
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
