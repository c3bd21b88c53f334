/* The vocabulary-parallel cross-entropy's CPU kernels (the op: ../vocab_parallel_cross_entropy.c).
 * Forward: each row's local maximum, their maximum
 * over the ranks (exact in any order), each rank's sum of exp(z - max) over its columns and its
 * logit of the label (0 where the label is another rank's), both summed over the ranks in one
 * all-reduce; the loss is the same on every rank. What forward keeps for backward is one
 * log-sum-exp per row, and backward, which communicates nothing, recomputes the softmax of the
 * rank's columns from it: dz = (softmax(z) - onehot(label)) dloss / N.
 *
 * The sum over the vocabulary is where the group's order of addition enters (the maximum and
 * the label's logit are exact): under deterministic tensor parallelism (attr.vocab.shards) each
 * fixed shard of the vocabulary is summed alone and the shards' sums go up the pairwise tree,
 * its levels above the ranks in td_comm_allreduce_tree, so the loss and its gradient are the
 * same bits at any group size.
 * Computes in f32 (mixed precision casts the logits to it); CPU kernels. */
#include <math.h>
#include <string.h>

#include "ops/backend.h"
#include "ops/collective.h"

typedef struct {
    float *lse; /* (N) log-sum-exp of each row over the whole vocabulary */
    float *red; /* (2N) the maxima, then the sums and label logits */
} vce_state;

static td_status vce_compile(td__op_ctx *ctx, td__node *n) {
    const td_tensor *z = n->in[0];
    int64_t N = z->shape.dim[0];
    vce_state *s = td__op_alloc(ctx, sizeof *s);
    if (s) s->lse = td__op_alloc(ctx, (size_t)N * sizeof(float));
    if (s && s->lse) s->red = td__op_alloc(ctx, (size_t)(2 * N) * sizeof(float));
    if (!s || !s->lse || !s->red) return td__fail(TD_ENOMEM, "%s: out of memory", n->what);
    n->state = s;
    return td__coll_agree(ctx, n, &z->shape, z->dtype, n->out->requires_grad);
}

/* The column of row i's label in this rank's slice, or -1 where another rank holds it. */
static int64_t label_column(const td__node *n, int64_t i, int64_t Vr) {
    int64_t c = ((const int64_t *)n->in[1]->data)[i] - n->attr.vocab.first;
    return c >= 0 && c < Vr ? c : -1;
}

static td_status all_reduce(td__op_ctx *ctx, td__node *n, float *buf, size_t count,
                            td_reduce_op op) {
    if (td__coll_size(ctx) == 1) return TD_OK;
    td_status st = op == TD_OP_SUM && n->attr.vocab.shards
                       ? td_comm_allreduce_tree(ctx->comm, buf, buf, count, TD_F32)
                       : td_comm_allreduce(ctx->comm, buf, buf, count, TD_F32, op);
    return st == TD_OK ? TD_OK : td__coll_fail(n, "forward", st);
}

/* sum_v exp(row[v] - max) over the rank's columns: in one pass, or with shards each shard's
 * sum alone and the shards' sums added in the pairwise tree (whose levels above the rank the
 * all-reduce adds). */
static float sum_exp(const float *row, int64_t Vr, float max, int shards) {
    float part[64];
    int L = shards > 0 ? shards : 1;
    int64_t width = Vr / L;
    for (int l = 0; l < L; l++) {
        float sum = 0.f;
        for (int64_t v = (int64_t)l * width; v < (int64_t)(l + 1) * width; v++)
            sum += expf(row[v] - max);
        part[l] = sum;
    }
    for (int stride = 1; stride < L; stride *= 2)
        for (int l = 0; l + stride < L; l += 2 * stride) part[l] = part[l] + part[l + stride];
    return part[0];
}

static td_status vce_forward(td__op_ctx *ctx, td__node *n) {
    const td_tensor *zt = n->in[0];
    const float *z = zt->data;
    const int64_t *lab = n->in[1]->data;
    int64_t N = zt->shape.dim[0], Vr = zt->shape.dim[1], V = Vr * n->attr.vocab.world_size;
    vce_state *s = n->state;
    for (int64_t i = 0; i < N; i++) {
        if (lab[i] < 0 || lab[i] >= V)
            return td__fail(TD_EINVAL, "%s: label %lld of row %lld is outside [0, %lld)", n->what,
                            (long long)lab[i], (long long)i, (long long)V);
        float m = -INFINITY;
        for (int64_t v = 0; v < Vr; v++) m = fmaxf(m, z[i * Vr + v]);
        s->red[i] = m;
    }
    TD__TRY(all_reduce(ctx, n, s->red, (size_t)N, TD_OP_MAX));
    memcpy(s->lse, s->red, (size_t)N * sizeof(float)); /* the maxima, until the sums come */
    for (int64_t i = 0; i < N; i++) {
        const float *row = z + i * Vr;
        int64_t c = label_column(n, i, Vr);
        s->red[i] = sum_exp(row, Vr, s->lse[i], n->attr.vocab.shards);
        s->red[N + i] = c >= 0 ? row[c] : 0.f;
    }
    TD__TRY(all_reduce(ctx, n, s->red, (size_t)(2 * N), TD_OP_SUM));
    double loss = 0;
    for (int64_t i = 0; i < N; i++) {
        s->lse[i] += logf(s->red[i]);
        loss += (double)s->lse[i] - s->red[N + i];
    }
    if (n->attr.vocab.reduction == TD_REDUCTION_MEAN) loss /= (double)N;
    *(float *)n->out->data = (float)loss;
    return TD_OK;
}

static td_status vce_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *zt = n->in[0];
    if (!zt->requires_grad) return TD_OK;
    const float *z = zt->data;
    int64_t N = zt->shape.dim[0], Vr = zt->shape.dim[1];
    const vce_state *s = n->state;
    float gy = ((const float *)n->out->grad)[0];
    float scale = n->attr.vocab.reduction == TD_REDUCTION_MEAN ? gy / (float)N : gy;
    float *dz = td__grad_begin(ctx, zt, 0);
    for (int64_t i = 0; i < N; i++) {
        const float *row = z + i * Vr;
        float *d = dz + i * Vr;
        for (int64_t v = 0; v < Vr; v++) d[v] = expf(row[v] - s->lse[i]) * scale;
        int64_t c = label_column(n, i, Vr);
        if (c >= 0) d[c] -= scale;
    }
    return td__grad_end(ctx, zt);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_vocab_parallel_cross_entropy = {
    .compile = vce_compile,
    .forward = vce_forward,
    .backward = vce_backward,
};
