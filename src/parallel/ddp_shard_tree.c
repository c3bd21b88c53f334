/* Deterministic mode of td_ddp: the same bits at any world size.
 *
 * A global batch is S fixed shards; rank r of w holds the L = S / w shards [rL, rL + L) and runs
 * them one after another, each as its own forward and backward. The shard gradients are summed
 * in one fixed pairwise tree whose leaves are the S shards: node (level l, index i) is node
 * (l-1, 2i) + node (l-1, 2i+1), the lower subtree on the left. A rank's L leaves form the
 * subtree (log2 L, r), which it folds as its shards finish, the way a binary counter carries:
 * after shard j, j's trailing one bits say how many levels the new node climbs. The upper levels
 * run across ranks: an all-to-all hands each rank every rank's subtree sum of one segment of a
 * bucket, the rank adds those w values in the same pairwise order, and an all-gather spreads the
 * segments back. So every element is summed in the same order at every world size, and every
 * rank ends with the same bits. Buffers (batch norm's running statistics) start each shard from
 * the step's values and their per-shard results are averaged by the same tree, as is the loss.
 *
 * One rank alone may hold any number of shards (the root then adds the subtrees its count's one
 * bits leave); across ranks, L must be a power of two so that each rank's leaves are a subtree.
 *
 * Memory: levels 0 .. log2 L (one node each, in the bucket layout) and a spare of the same size
 * that holds an odd shard's gradients and, at the end of the step, what the all-to-all receives.
 * An even shard's gradients go straight to level 0. This file is td_ddp's reducer for
 * deterministic mode (reducer.h); it does not decide bucket membership (ddp_layout.c plans it)
 * and knows nothing of graphs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "parallel/ddp_impl.h"

#define TREE_ALIGN 16  /* floats: every bucket and every segment starts on 64 bytes */
#define TREE_CHUNK 512 /* floats folded per pass up the levels */
#define TREE_TRACE_TID_BASE 0x7f000000

/* The levels of the tree: each holds the layout of every bucket, padded to world_size segments,
 * and after them the tail: the buffers, the unready count and the loss of a shard, summed by
 * the same tree. */
typedef struct {
    size_t shards;      /* S */
    size_t local;       /* L = S / world_size: this rank's shards, leaves [rank L, rank L + L) */
    int levels;         /* floor(log2 L) */
    size_t shard;       /* this rank's shard of the step under way, 0 .. L-1 */
    size_t flat;        /* floats per level */
    size_t *base, *seg; /* (n_buckets + 1) where bucket k starts, its per-rank segment; tail last */
    float *mem;         /* (levels + 2) * flat */
    float **level;      /* (levels + 1): level[l] holds a node of 2^l leaves */
    float *spare;       /* an odd shard's gradients; at the step's end, the all-to-all's receive */
    float *buffers0;    /* (n_buffer_floats) the buffers at the start of the step */
    size_t n_buffer_floats;
    td_request **req;   /* (n_buckets + 1) */
    size_t next_launch; /* buckets [0, next_launch) have their all-to-all queued */
} ddp_tree;

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* Where parameter i's gradient lies in a level (or the spare). */
static size_t param_at(const td_ddp *d, size_t i) {
    const ddp_tree *t = d->state;
    return t->base[d->bucket_of[i]] + d->offset_of[i];
}

/* Where the current shard's gradients go: level 0 for an even shard, the spare for an odd one. */
static float *shard_target(const ddp_tree *t) { return t->shard & 1 ? t->spare : t->level[0]; }

/* The shards must split into equal subtrees over the ranks, and the tree sums f32. */
static td_status tree_check(const td_ddp *d) {
    size_t S = d->opt.shards, w = (size_t)d->size, L = S / w;
    if (S == 0 || S % w != 0 || (w > 1 && (L & (L - 1)) != 0))
        return td__fail(TD_EINVAL,
                        "ddp rank %d: deterministic mode with %zu shards at world size %d: "
                        "each rank must hold the same power of two of them (1, 2, 4, ...), so "
                        "the world size must be 1 or %zu divided by a power of two",
                        d->rank, S, d->size, S);
    if (d->opt.join)
        return td__fail(TD_EINVAL,
                        "ddp rank %d: deterministic mode and join exclude each other: every "
                        "rank holds S / world_size shards of every global batch",
                        d->rank);
    if (d->opt.comm_dtype != TD_F32)
        return td__fail(TD_EINVAL,
                        "ddp rank %d: deterministic mode sums f32 gradients; comm_dtype is %s",
                        d->rank, td_dtype_name(d->opt.comm_dtype));
    for (size_t i = 0; i < d->n_params; i++)
        if (d->params[i].dtype != TD_F32)
            return td__fail(TD_EDTYPE,
                            "ddp rank %d: parameter '%s' is %s; deterministic mode sums f32 "
                            "gradients (mixed precision O2/O3 is not supported there)",
                            d->rank, d->params[i].name, td_dtype_name(d->params[i].dtype));
    for (size_t i = 0; i < d->n_buffers; i++)
        if (d->buffers[i].dtype != TD_F32)
            return td__fail(TD_EDTYPE,
                            "ddp rank %d: buffer '%s' is %s; deterministic mode averages f32 "
                            "buffers over shards",
                            d->rank, d->buffers[i].name, td_dtype_name(d->buffers[i].dtype));
    return TD_OK;
}

static td_status tree_create(td_ddp *d) {
    ddp_tree *t = calloc(1, sizeof *t);
    if (!t) return td__fail(TD_ENOMEM, "ddp rank %d: out of memory", d->rank);
    d->state = t;
    t->shards = d->opt.shards;
    t->local = t->shards / (size_t)d->size;
    d->shard_first = (size_t)d->rank * t->local;
    d->shard_count = t->local;
    for (size_t l = t->local; l > 1; l >>= 1) t->levels++;
    for (size_t i = 0; i < d->n_buffers; i++) t->n_buffer_floats += d->buffers[i].count;
    TD__TRY(td__ddp_plan_buckets(d, d->order, &d->buckets, &d->n_buckets, &d->bucket_of,
                                 &d->offset_of));
    size_t nb = d->n_buckets + 1, w = (size_t)d->size;
    t->base = calloc(nb, sizeof *t->base);
    t->seg = calloc(nb, sizeof *t->seg);
    t->req = calloc(nb, sizeof *t->req);
    t->level = calloc((size_t)t->levels + 1, sizeof *t->level);
    t->buffers0 = malloc((t->n_buffer_floats ? t->n_buffer_floats : 1) * sizeof(float));
    if (!t->base || !t->seg || !t->req || !t->level || !t->buffers0)
        return td__fail(TD_ENOMEM, "ddp rank %d: out of memory", d->rank);
    for (size_t k = 0; k < nb; k++) {
        size_t count = k < d->n_buckets ? d->buckets[k].count : t->n_buffer_floats + DDP_SLOTS;
        t->seg[k] = round_up((count + w - 1) / w, TREE_ALIGN);
        t->base[k] = t->flat;
        t->flat += w * t->seg[k];
    }
    size_t bytes = ((size_t)t->levels + 2) * t->flat * sizeof(float);
    t->mem = aligned_alloc(64, bytes);
    if (!t->mem)
        return td__fail(
            TD_ENOMEM, "ddp rank %d: out of memory for the %d levels of the shard tree (%zu bytes)",
            d->rank, t->levels + 1, bytes);
    memset(t->mem, 0, bytes);
    for (int l = 0; l <= t->levels; l++) t->level[l] = t->mem + (size_t)l * t->flat;
    t->spare = t->mem + ((size_t)t->levels + 1) * t->flat;
    for (size_t k = 0; k < d->n_buckets; k++)
        d->buckets[k].buf = t->level[t->levels] + t->base[k]; /* where the step's result lands */
    for (size_t i = 0; i < d->n_params; i++)
        td__ddp_move_gradient(d, i, t->level[0] + param_at(d, i));
    return TD_OK;
}

static void tree_wait(td_ddp *d) {
    ddp_tree *t = d->state;
    for (size_t k = 0; t && t->req && k <= d->n_buckets; k++)
        if (t->req[k]) {
            (void)td_request_wait(t->req[k]);
            t->req[k] = NULL;
        }
}

static void tree_destroy(td_ddp *d) {
    ddp_tree *t = d->state;
    if (!t) return;
    tree_wait(d);
    free(t->base);
    free(t->seg);
    free(t->req);
    free(t->level);
    free(t->buffers0);
    free(t->mem);
    free(t);
    d->state = NULL;
}

static td_status tree_prepare(td_ddp *d) {
    ddp_tree *t = d->state;
    /* Every shard starts from the buffers the step started with. */
    float *b0 = t->buffers0;
    for (size_t i = 0; i < d->n_buffers; i++) {
        size_t bytes = d->buffers[i].count * sizeof(float);
        if (t->shard == 0)
            memcpy(b0, d->buffers[i].data, bytes);
        else
            memcpy(d->buffers[i].data, b0, bytes);
        b0 += d->buffers[i].count;
    }
    float *dst = shard_target(t);
    for (size_t i = 0; i < d->n_params; i++) d->params[i].grad = dst + param_at(d, i);
    return TD_OK;
}

static void tree_zero_grad(td_ddp *d) {
    ddp_tree *t = d->state;
    memset(shard_target(t), 0, t->flat * sizeof(float));
}

/* The loops below run in blocks of TREE_VEC floats: a fixed trip count over restrict pointers
 * is what -O2 vectorizes (a loop of unknown length it leaves scalar). Each element's additions
 * keep their order, so the bits are the scalar loop's. */
#define TREE_VEC 16

/* dst = a + b */
static void add2(float *restrict dst, const float *restrict a, const float *restrict b, size_t n) {
    size_t e = 0;
    for (; e + TREE_VEC <= n; e += TREE_VEC)
        for (size_t k = 0; k < TREE_VEC; k++) dst[e + k] = a[e + k] + b[e + k];
    for (; e < n; e++) dst[e] = a[e] + b[e];
}

/* dst = b + (a + leaf) */
static void add3(float *restrict dst, const float *restrict a, const float *restrict b,
                 const float *restrict leaf, size_t n) {
    size_t e = 0;
    for (; e + TREE_VEC <= n; e += TREE_VEC)
        for (size_t k = 0; k < TREE_VEC; k++) dst[e + k] = b[e + k] + (a[e + k] + leaf[e + k]);
    for (; e < n; e++) dst[e] = b[e] + (a[e] + leaf[e]);
}

/* acc = x + acc */
static void add_to(float *restrict acc, const float *restrict x, size_t n) {
    size_t e = 0;
    for (; e + TREE_VEC <= n; e += TREE_VEC)
        for (size_t k = 0; k < TREE_VEC; k++) acc[e + k] = x[e + k] + acc[e + k];
    for (; e < n; e++) acc[e] = x[e] + acc[e];
}

/* upper = (upper + below) * f */
static void add_scaled(float *restrict upper, const float *restrict below, size_t n, float f) {
    size_t e = 0;
    for (; e + TREE_VEC <= n; e += TREE_VEC)
        for (size_t k = 0; k < TREE_VEC; k++) upper[e + k] = (upper[e + k] + below[e + k]) * f;
    for (; e < n; e++) upper[e] = (upper[e] + below[e]) * f;
}

/* dst = lower[up-1] + (... + (lower[0] + leaf)), times `by` (1 leaves it), element by element:
 * the new node of an odd shard that climbs `up` levels, each addition with the earlier leaves'
 * sum first, in one pass over memory. */
static void climb(float *dst, float *const *lower, int up, const float *leaf, size_t n, float by) {
    if (up == 1 && by == 1.0f) {
        add2(dst, lower[0], leaf, n);
        return;
    }
    if (up == 2 && by == 1.0f) {
        add3(dst, lower[0], lower[1], leaf, n);
        return;
    }
    float acc[TREE_CHUNK];
    for (size_t c = 0; c < n; c += TREE_CHUNK) {
        size_t m = n - c < TREE_CHUNK ? n - c : TREE_CHUNK;
        memcpy(acc, leaf + c, m * sizeof *acc);
        for (int l = 0; l < up; l++) add_to(acc, lower[l] + c, m);
        for (size_t e = 0; e < m; e++) dst[c + e] = acc[e] * by;
    }
}

/* Folds floats [off, off + n) of the current shard into the tree. An even shard's values stay
 * in level 0 as a leaf; an odd shard j climbs as many levels as j has trailing one bits: its
 * leaf is added to the waiting lower sibling at each level, lower subtree first. After the last
 * shard, a count L that is not a power of two (one rank alone) leaves a node at each of its one
 * bits; the tree's root adds them from the lowest up, each time the earlier leaves first. One
 * rank alone averages as it writes the root (`by`): the same product the ranks take of their
 * segments of it. */
static void tree_fold(ddp_tree *t, size_t off, size_t n, float by) {
    size_t j = t->shard, L = t->local;
    int last = j + 1 == L, power = (L & (L - 1)) == 0;
    float *lower[64];
    if (j & 1) {
        int up = 0;
        while ((j >> up) & 1) up++;
        for (int l = 0; l < up; l++) lower[l] = t->level[l] + off;
        climb(t->level[up] + off, lower, up, t->spare + off, n, last && power ? by : 1.0f);
    }
    if (!last || (power && (L > 1 || by == 1.0f))) return;
    if (power) { /* a single shard: its leaf is the root */
        float *top = t->level[0] + off;
        for (size_t e = 0; e < n; e++) top[e] *= by;
        return;
    }
    int low = 0, high = t->levels;
    while (!((L >> low) & 1)) low++;
    for (int l = low + 1; l <= high; l++) {
        if (!((L >> l) & 1)) continue;
        add_scaled(t->level[l] + off, t->level[low] + off, n, l == high ? by : 1.0f);
        low = l;
    }
}

/* Queues bucket k's all-to-all (k == n_buckets: the tail): rank r receives every rank's segment
 * r of the bucket, in rank order, into the spare. */
static void tree_launch(td_ddp *d, size_t k) {
    ddp_tree *t = d->state;
    if (k < d->n_buckets) d->buckets[k].t_launch = td_time_ns();
    if (d->size == 1) return;
    td_status s = td_comm_ialltoall(d->comm, t->level[t->levels] + t->base[k],
                                    t->spare + t->base[k], t->seg[k], TD_F32, &t->req[k]);
    if (s != TD_OK) {
        t->req[k] = NULL;
        td__ddp_note_error(d, s);
    }
}

/* The factor a parameter's gradients are averaged by where the root is written: one rank alone
 * writes the root itself; across ranks, the segments are averaged after the last additions. */
static float root_factor(const td_ddp *d) {
    return d->size == 1 && d->opt.average ? 1.0f / (float)d->opt.shards : 1.0f;
}

static void tree_grad_ready(td_ddp *d, size_t i) {
    ddp_tree *t = d->state;
    tree_fold(t, param_at(d, i), d->params[i].count, root_factor(d));
    if (t->shard + 1 < t->local) return;
    /* The last shard: once a bucket's subtree sums are final it may go across ranks. All-to-alls
     * go out in bucket order on every rank, so every rank queues the same collectives. */
    d->buckets[d->bucket_of[i]].pending--;
    while (t->next_launch < d->n_buckets && d->buckets[t->next_launch].pending == 0) {
        tree_launch(d, t->next_launch++);
        d->stats.buckets_early++;
    }
}

static void scale(float *x, size_t n, float by) {
    for (size_t e = 0; e < n; e++) x[e] *= by;
}

/* The levels above the ranks: for each bucket, the w segments this rank received are added in
 * pairs (stride 1, 2, 4, ...: the aligned pairwise tree over ranks, as over leaves), averaged
 * over the shards when asked, and all-gathered into the top level. All-gathers are queued in
 * bucket order after every all-to-all, so the collectives match on every rank. */
static td_status tree_across_ranks(td_ddp *d) {
    ddp_tree *t = d->state;
    float *top = t->level[t->levels], inv = 1.0f / (float)t->shards;
    int average = d->opt.average && t->shards > 1;
    size_t w = (size_t)d->size, nb = d->n_buckets + 1;
    td_status s = d->err;
    if (w == 1) return s; /* the root was written averaged (root_factor) */
    for (size_t k = 0; k < nb; k++) {
        td_status r = t->req[k] ? td_request_wait(t->req[k]) : TD_OK;
        t->req[k] = NULL;
        if (s == TD_OK) s = r;
        if (s != TD_OK) continue;
        float *x = t->spare + t->base[k];
        size_t seg = t->seg[k];
        for (size_t stride = 1; stride < w; stride *= 2)
            for (size_t i = 0; i + stride < w; i += 2 * stride) {
                float *lo = x + i * seg;
                const float *hi = x + (i + stride) * seg;
                for (size_t e = 0; e < seg; e++) lo[e] = lo[e] + hi[e];
            }
        if (k < d->n_buckets && average) scale(x, seg, inv);
        s = td_comm_iallgather(d->comm, x, top + t->base[k], seg, TD_F32, &t->req[k]);
        if (s != TD_OK) t->req[k] = NULL;
    }
    for (size_t k = 0; k < nb; k++) {
        if (!t->req[k]) continue;
        td_status r = td_request_wait(t->req[k]);
        t->req[k] = NULL;
        if (s == TD_OK) s = r;
    }
    return s;
}

static void tree_trace(td_ddp *d) {
    if (!d->opt.trace) return;
    uint64_t end = td_time_ns();
    for (size_t k = 0; k < d->n_buckets; k++) {
        char name[80];
        snprintf(name, sizeof name, "tree allreduce bucket %zu (%zu bytes f32)", k,
                 d->buckets[k].count * sizeof(float));
        (void)td_trace_span_on(d->opt.trace, name, "ddp", TREE_TRACE_TID_BASE + (int)k,
                               d->buckets[k].t_launch, end);
    }
}

static td_status tree_finish(td_ddp *d) {
    ddp_tree *t = d->state;
    /* A parameter no backward reached has a zero gradient in this shard. */
    float *dst = shard_target(t);
    size_t n_unready = 0;
    for (size_t i = 0; i < d->n_params; i++) {
        if (d->ready[i]) continue;
        n_unready++;
        memset(dst + param_at(d, i), 0, d->params[i].count * sizeof(float));
        tree_grad_ready(d, i);
    }
    /* The tail: this shard's buffers, its unready count and its loss, into the same tree. */
    float *tail = dst + t->base[d->n_buckets];
    for (size_t i = 0; i < d->n_buffers; i++) {
        memcpy(tail, d->buffers[i].data, d->buffers[i].count * sizeof(float));
        tail += d->buffers[i].count;
    }
    tail[0] = (float)n_unready;
    tail[1] = d->loss;
    tree_fold(t, t->base[d->n_buckets], t->n_buffer_floats + DDP_SLOTS, 1.0f);
    memset(d->ready, 0, d->n_params ? d->n_params : 1);
    d->n_ready = 0;
    d->open = 0;
    if (t->shard + 1 < t->local) {
        t->shard++;
        if (d->err == TD_OK) return TD_OK;
        /* keep going to the step's end so that every rank runs the same collectives */
        return td__fail(d->err, "%s", d->err_msg);
    }

    /* The step's last shard: what is left goes across ranks, then the result is read out. */
    while (t->next_launch < d->n_buckets) tree_launch(d, t->next_launch++);
    tree_launch(d, d->n_buckets);
    td__ddp_note_error(d, tree_across_ranks(d));
    tree_trace(d);
    t->shard = 0;
    t->next_launch = 0;
    for (size_t k = 0; k < d->n_buckets; k++) d->buckets[k].pending = d->buckets[k].n_members;
    if (d->err != TD_OK) return td__ddp_take_error(d);
    float *top = t->level[t->levels], inv = 1.0f / (float)t->shards;
    for (size_t i = 0; i < d->n_params; i++) d->params[i].grad = top + param_at(d, i);
    const float *sum = top + t->base[d->n_buckets];
    for (size_t i = 0; i < d->n_buffers; i++) {
        float *b = d->buffers[i].data;
        for (size_t e = 0; e < d->buffers[i].count; e++) b[e] = sum[e] * inv;
        sum += d->buffers[i].count;
    }
    double unready_all = sum[0];
    d->loss_all = d->opt.average ? sum[1] * inv : sum[1];
    d->stats.sync_steps++;
    td_status s = td__ddp_check_moved(d);
    if (s == TD_OK && unready_all > 0.5 && !d->opt.find_unused_parameters)
        s = td__fail(TD_EUNUSED,
                     "ddp rank %d: %.0f shard backward(s) left parameters without a gradient (no "
                     "td_ddp_grad_ready) in this step, %zu on this rank's last shard; set "
                     "find_unused_parameters = 1 if parts of the model are unused in some "
                     "iterations",
                     d->rank, unready_all, n_unready);
    return s;
}

static td_status tree_refuse_no_sync(const td_ddp *d) {
    return td__fail(TD_EUNSUPPORTED,
                    "ddp rank %d: no_sync in deterministic mode: its shards already are the "
                    "accumulated micro-batches; make the global batch larger instead",
                    d->rank);
}

const td__ddp_reducer td__ddp_shard_tree = {
    .name = "shard tree",
    .check = tree_check,
    .create = tree_create,
    .prepare = tree_prepare,
    .grad_ready = tree_grad_ready,
    .finish = tree_finish,
    .zero_grad = tree_zero_grad,
    .refuse_no_sync = tree_refuse_no_sync,
    .wait = tree_wait,
    .destroy = tree_destroy,
};
