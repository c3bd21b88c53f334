/* Deterministic mode's reducer for td_ddp (reducer.h): the shards' gradients summed in one fixed
 * pairwise tree, folded on each rank as its shards finish and carried across ranks bucket by
 * bucket (an all-to-all, the pairwise sums, an all-gather; an in-place all-reduce at two ranks),
 * so that every element is added in the same order at any world size. The tree, why it gives the
 * same bits and what it holds in memory are in docs/reproducibility.md ("How"). Here: the node
 * buffers (log2 L + 2 in the bucket layout; the root in td_comm_alloc memory, where the in-place
 * all-reduce needs no staging), the buffers and the loss averaged by the same tree, and a GPU's
 * gradients copied down to their host leaves as they become ready. One rank alone may hold any
 * number of shards (its root adds the subtrees the count's one bits leave); across ranks each
 * holds a power of two. It does not decide bucket membership (ddp_layout.c) and knows nothing of
 * graphs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/device.h"

#include "core/core_impl.h"
#include "parallel/ddp_impl.h"

#define TREE_ALIGN 16  /* floats: every bucket and every segment starts on 64 bytes */
#define TREE_CHUNK 512 /* floats folded per pass up the levels */
#define TREE_TRACE_TID_BASE 0x7f000000

/* The tree's node buffers: each holds the layout of every bucket, padded to world_size segments,
 * and after them the tail: the buffers, the unready count and the loss of a shard, summed by
 * the same tree. */
typedef struct {
    size_t shards;      /* S */
    size_t local;       /* L = S / world_size: this rank's shards, leaves [rank L, rank L + L) */
    int levels;         /* floor(log2 L) */
    int n_bufs;         /* levels + 2 */
    size_t shard;       /* this rank's shard of the step under way, 0 .. L-1 */
    size_t flat;        /* floats per buffer */
    size_t *base, *seg; /* (n_buckets + 1) where bucket k starts, its per-rank segment; tail last */
    float **buf;        /* (n_bufs): buf[0] in td_comm_alloc memory, the others in `mem` */
    float *mem;         /* (n_bufs - 1) * flat */
    int *pending;       /* (levels + 1): the buffer of the node waiting at level l, or -1 */
    int leaf;           /* the buffer the current shard's gradients go to */
    int root;           /* the buffer the step's result lies in */
    int recv;           /* a buffer the last shard's fold frees, for the all-to-all to receive */
    float *buffers0;    /* (n_buffer_floats) the buffers at the start of the step */
    size_t n_buffer_floats;
    td_request **req;   /* (n_buckets + 1) */
    size_t next_launch; /* buckets [0, next_launch) have their all-to-all queued */
    /* On a GPU: (flat) device memory where each shard's backward writes its gradients and where
     * the step's result is put back; each gradient comes down into the shard's host leaf when
     * it is ready, and the tree runs on the host as on the CPU. NULL on the CPU. */
    float *dev;
} ddp_tree;

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* Where parameter i's gradient lies in a buffer. */
static size_t param_at(const td_ddp *d, size_t i) {
    const ddp_tree *t = d->state;
    return t->base[d->bucket_of[i]] + d->offset_of[i];
}

/* Where the current shard's gradients are summed. */
static float *shard_target(const ddp_tree *t) { return t->buf[t->leaf]; }

/* Where the graph writes them: the host leaf, or on a GPU the device copy. */
static float *shard_grads(const ddp_tree *t) { return t->dev ? t->dev : shard_target(t); }

static int power_of_two(size_t n) { return (n & (n - 1)) == 0; }

/* The buffer shard j's gradients go to: buffer 0 for the last shard when L is a power of two
 * (its node becomes the root), else the lowest buffer no waiting node holds. After j shards
 * popcount(j) nodes wait, at most levels of them (j <= L - 1 < 2^(levels + 1) - 1), so one of
 * buffers 1 .. levels + 1 is always free. */
static int leaf_for(const ddp_tree *t, size_t j) {
    if (j + 1 == t->local && power_of_two(t->local)) return 0;
    for (int b = 1; b < t->n_bufs; b++) {
        int held = 0;
        for (int l = 0; l <= t->levels; l++) held |= t->pending[l] == b;
        if (!held) return b;
    }
    return -1; /* not reached */
}

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

/* The factor a parameter's gradients are averaged by where the root is written: one rank alone
 * writes the root itself; across ranks, the segments are averaged after the last additions. */
static float root_factor(const td_ddp *d) {
    return d->size == 1 && d->opt.average ? 1.0f / (float)d->opt.shards : 1.0f;
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
    t->n_bufs = t->levels + 2;
    t->buf = calloc((size_t)t->n_bufs, sizeof *t->buf);
    t->pending = malloc(((size_t)t->levels + 1) * sizeof *t->pending);
    t->buffers0 = malloc((t->n_buffer_floats ? t->n_buffer_floats : 1) * sizeof(float));
    if (!t->base || !t->seg || !t->req || !t->buf || !t->pending || !t->buffers0)
        return td__fail(TD_ENOMEM, "ddp rank %d: out of memory", d->rank);
    for (int l = 0; l <= t->levels; l++) t->pending[l] = -1;
    for (size_t k = 0; k < nb; k++) {
        size_t count = k < d->n_buckets ? d->buckets[k].count : t->n_buffer_floats + DDP_SLOTS;
        t->seg[k] = round_up((count + w - 1) / w, TREE_ALIGN);
        t->base[k] = t->flat;
        t->flat += w * t->seg[k];
    }
    /* collective: every rank gets here with the same layout, before anything local can fail */
    TD__TRY(td_comm_alloc(d->comm, t->flat * sizeof(float), (void **)&t->buf[0]));
    memset(t->buf[0], 0, t->flat * sizeof(float));
    size_t bytes = ((size_t)t->n_bufs - 1) * t->flat * sizeof(float);
    t->mem = aligned_alloc(64, bytes);
    if (!t->mem)
        return td__fail(
            TD_ENOMEM,
            "ddp rank %d: out of memory for the %d buffers of the shard tree (%zu bytes)", d->rank,
            t->n_bufs, bytes);
    memset(t->mem, 0, bytes);
    for (int b = 1; b < t->n_bufs; b++) t->buf[b] = t->mem + (size_t)(b - 1) * t->flat;
    t->root = 0;
    t->leaf = leaf_for(t, 0);
    if (d->device.type != TD_DEVICE_CPU)
        TD__TRY(td__ddp_mem_alloc(d, t->flat * sizeof(float), (void **)&t->dev));
    for (size_t k = 0; k < d->n_buckets; k++) /* where the step's result lands */
        d->buckets[k].buf = (t->dev ? t->dev : t->buf[0]) + t->base[k];
    for (size_t i = 0; i < d->n_params; i++) {
        td__ddp_move_gradient(d, i, shard_grads(t) + param_at(d, i));
        d->params[i].shard_sum_scale = root_factor(d); /* a producer that sums may average */
    }
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
    for (size_t i = 0; i < d->n_params; i++) d->params[i].shard_sum_scale = 0;
    free(t->base);
    free(t->seg);
    free(t->req);
    free(t->buffers0);
    free(t->mem);
    td__ddp_mem_free(d, t->dev);
    if (t->buf) td_comm_free(d->comm, t->buf[0]);
    free(t->buf);
    free(t->pending);
    free(t);
    d->state = NULL;
}

static td_status tree_prepare(td_ddp *d) {
    ddp_tree *t = d->state;
    /* Every shard starts from the buffers the step started with. */
    float *b0 = t->buffers0;
    td_device cpu = td_device_cpu(), on = d->device;
    for (size_t i = 0; i < d->n_buffers; i++) {
        size_t bytes = d->buffers[i].count * sizeof(float);
        if (t->shard == 0)
            TD__TRY(td_device_copy(cpu, b0, on, d->buffers[i].data, bytes));
        else
            TD__TRY(td_device_copy(on, d->buffers[i].data, cpu, b0, bytes));
        b0 += d->buffers[i].count;
    }
    t->leaf = leaf_for(t, t->shard);
    if (t->shard + 1 == t->local) t->recv = t->local > 1 ? t->pending[0] : 1;
    float *dst = shard_grads(t);
    for (size_t i = 0; i < d->n_params; i++) d->params[i].grad = dst + param_at(d, i);
    return TD_OK;
}

static void tree_zero_grad(td_ddp *d) {
    ddp_tree *t = d->state;
    memset(shard_target(t), 0, t->flat * sizeof(float));
    if (t->dev) td__ddp_note_error(d, td__ddp_mem_zero(d, t->dev, t->flat * sizeof(float)));
}

/* The loops below run in blocks of TREE_VEC floats: a fixed trip count over restrict pointers
 * is what -O2 vectorizes (a loop of unknown length it leaves scalar). Each element's additions
 * keep their order, so the bits are the scalar loop's. */
#define TREE_VEC 16

/* acc = x + acc */
static void add_to(float *restrict acc, const float *restrict x, size_t n) {
    size_t e = 0;
    for (; e + TREE_VEC <= n; e += TREE_VEC)
        for (size_t k = 0; k < TREE_VEC; k++) acc[e + k] = x[e + k] + acc[e + k];
    for (; e < n; e++) acc[e] = x[e] + acc[e];
}

/* acc = b + (a + acc) */
static void add2_to(float *restrict acc, const float *restrict a, const float *restrict b,
                    size_t n) {
    size_t e = 0;
    for (; e + TREE_VEC <= n; e += TREE_VEC)
        for (size_t k = 0; k < TREE_VEC; k++) acc[e + k] = b[e + k] + (a[e + k] + acc[e + k]);
    for (; e < n; e++) acc[e] = b[e] + (a[e] + acc[e]);
}

/* x = x * by */
static void scale(float *restrict x, size_t n, float by) {
    size_t e = 0;
    for (; e + TREE_VEC <= n; e += TREE_VEC)
        for (size_t k = 0; k < TREE_VEC; k++) x[e + k] = x[e + k] * by;
    for (; e < n; e++) x[e] = x[e] * by;
}

/* upper = (upper + below) * f */
static void add_scaled(float *restrict upper, const float *restrict below, size_t n, float f) {
    size_t e = 0;
    for (; e + TREE_VEC <= n; e += TREE_VEC)
        for (size_t k = 0; k < TREE_VEC; k++) upper[e + k] = (upper[e + k] + below[e + k]) * f;
    for (; e < n; e++) upper[e] = (upper[e] + below[e]) * f;
}

/* leaf = lower[up-1] + (... + (lower[0] + leaf)), times `by` (1 leaves it), element by element
 * and in place: the new node of an odd shard that climbs `up` levels, each addition with the
 * earlier leaves' sum first, in one pass over memory. */
static void climb(float *leaf, float *const *lower, int up, size_t n, float by) {
    if (up == 1 && by == 1.0f) {
        add_to(leaf, lower[0], n);
        return;
    }
    if (up == 2 && by == 1.0f) {
        add2_to(leaf, lower[0], lower[1], n);
        return;
    }
    float acc[TREE_CHUNK];
    for (size_t c = 0; c < n; c += TREE_CHUNK) {
        size_t m = n - c < TREE_CHUNK ? n - c : TREE_CHUNK;
        memcpy(acc, leaf + c, m * sizeof *acc);
        for (int l = 0; l < up; l++) add_to(acc, lower[l] + c, m);
        scale(acc, m, by);
        memcpy(leaf + c, acc, m * sizeof *acc);
    }
}

/* Folds floats [off, off + n) of the current shard into the tree. An even shard's values wait
 * in its buffer as a leaf; an odd shard j climbs as many levels as j has trailing one bits: its
 * leaf is added to the waiting lower sibling at each level, lower subtree first. After the last
 * shard, a count L that is not a power of two (one rank alone) leaves a node at each of its one
 * bits; the tree's root adds them from the lowest up, each time the earlier leaves first. One
 * rank alone averages as it writes the root (`by`): the same product the ranks take of their
 * segments of it. */
static void tree_fold(ddp_tree *t, size_t off, size_t n, float by) {
    size_t j = t->shard, L = t->local;
    int last = j + 1 == L, power = power_of_two(L), up = 0;
    float *leaf = t->buf[t->leaf] + off, *lower[64];
    while ((j >> up) & 1) up++;
    if (up > 0) {
        for (int l = 0; l < up; l++) lower[l] = t->buf[t->pending[l]] + off;
        climb(leaf, lower, up, n, last && power ? by : 1.0f);
    }
    if (!last || (power && (L > 1 || by == 1.0f))) return;
    if (power) { /* a single shard: its leaf is the root */
        scale(leaf, n, by);
        return;
    }
    /* The new node sits at L's lowest one bit (L - 1 has `up` trailing ones); the others wait. */
    float *below = leaf;
    for (int l = up + 1; l <= t->levels; l++) {
        if (!((L >> l) & 1)) continue;
        float *upper = t->buf[t->pending[l]] + off;
        add_scaled(upper, below, n, l == t->levels ? by : 1.0f);
        below = upper;
    }
}

/* After shard j's fold: its node waits at the level it climbed to, in its leaf's buffer, and
 * the nodes it absorbed free theirs; after the last, the root is known and the counter empties. */
static void tree_advance(ddp_tree *t) {
    size_t j = t->shard;
    int up = 0;
    while ((j >> up) & 1) up++;
    if (j + 1 == t->local) {
        t->root = power_of_two(t->local) ? t->leaf : t->pending[t->levels];
        for (int l = 0; l <= t->levels; l++) t->pending[l] = -1;
        return;
    }
    for (int l = 0; l < up; l++) t->pending[l] = -1;
    t->pending[up] = t->leaf;
}

/* Queues bucket k's all-to-all (k == n_buckets: the tail): rank r receives every rank's segment
 * r of the bucket, in rank order, into a buffer the fold freed. Two ranks all-reduce the bucket
 * in place. Across ranks L is a power of two, so the root is buffer 0. */
static void tree_launch(td_ddp *d, size_t k) {
    ddp_tree *t = d->state;
    if (k < d->n_buckets) d->buckets[k].t_launch = td_time_ns();
    if (d->size == 1) return;
    float *top = t->buf[0] + t->base[k];
    td_status s = d->size == 2 ? td_comm_iallreduce(d->comm, top, top, 2 * t->seg[k], TD_F32,
                                                    TD_OP_SUM, &t->req[k])
                               : td_comm_ialltoall(d->comm, top, t->buf[t->recv] + t->base[k],
                                                   t->seg[k], TD_F32, &t->req[k]);
    if (s != TD_OK) {
        t->req[k] = NULL;
        td__ddp_note_error(d, s);
    }
}

/* A gradient its producer summed over this rank's shards itself (td_param.shard_sum), reported
 * at the last shard: it is already this rank's node of the tree, in the last leaf's buffer; the
 * root's buffer gets it, averaged where one rank alone writes the root (unless the producer
 * multiplied it by shard_sum_scale, root_factor's, as it wrote it: the same bits). */
static void tree_place_sum(td_ddp *d, size_t i, size_t at, size_t n) {
    ddp_tree *t = d->state;
    float *leaf = shard_target(t) + at, by = d->params[i].shard_sum_scaled ? 1.0f : root_factor(d);
    if (power_of_two(t->local)) { /* the last leaf's buffer is the root's */
        if (by != 1.0f) scale(leaf, n, by);
        return;
    }
    float *root = t->buf[t->pending[t->levels]] + at;
    for (size_t e = 0; e < n; e++) root[e] = leaf[e] * by;
}

static void tree_grad_ready(td_ddp *d, size_t i) {
    ddp_tree *t = d->state;
    size_t at = param_at(d, i), n = d->params[i].count;
    if (d->params[i].shard_sum && t->shard + 1 < t->local) {
        td__ddp_note_error(d, td__fail(TD_ESTATE,
                                       "ddp rank %d: parameter '%s' sums its shards itself "
                                       "(shard_sum) but was reported ready at shard %zu of %zu; "
                                       "it is reported at the last shard only",
                                       d->rank, d->params[i].name, t->shard, t->local));
        return;
    }
    /* On a GPU the gradient is final once the compute stream has passed its kernels: the copy
     * follows them. */
    if (t->dev)
        td__ddp_note_error(d, td_device_copy(td_device_cpu(), shard_target(t) + at, d->device,
                                             t->dev + at, n * sizeof(float)));
    if (d->params[i].shard_sum)
        tree_place_sum(d, i, at, n);
    else
        tree_fold(t, at, n, root_factor(d));
    if (t->shard + 1 < t->local) return;
    /* The last shard: once a bucket's subtree sums are final it may go across ranks. All-to-alls
     * go out in bucket order on every rank, so every rank queues the same collectives. */
    d->buckets[d->bucket_of[i]].pending--;
    td__ddp_launch_ready(d, &t->next_launch, d->n_buckets, tree_launch);
}

/* The levels above the ranks: for each bucket, the w segments this rank received are added in
 * pairs (stride 1, 2, 4, ...: the aligned pairwise tree over ranks, as over leaves), averaged
 * over the shards when asked, and all-gathered into the root's buffer. All-gathers are queued in
 * bucket order after every all-to-all, so the collectives match on every rank. */
static td_status tree_across_ranks(td_ddp *d) {
    ddp_tree *t = d->state;
    float *top = t->buf[0], inv = 1.0f / (float)t->shards;
    int average = d->opt.average && t->shards > 1;
    size_t w = (size_t)d->size, nb = d->n_buckets + 1;
    td_status s = d->err;
    if (w == 1) return s; /* the root was written averaged (root_factor) */
    if (w == 2) {         /* all-reduced in place: the root */
        for (size_t k = 0; k < nb; k++) {
            td_status r = t->req[k] ? td_request_wait(t->req[k]) : TD_OK;
            t->req[k] = NULL;
            if (s == TD_OK) s = r;
            if (s == TD_OK && k < d->n_buckets && average)
                scale(top + t->base[k], 2 * t->seg[k], inv);
        }
        return s;
    }
    for (size_t k = 0; k < nb; k++) {
        td_status r = t->req[k] ? td_request_wait(t->req[k]) : TD_OK;
        t->req[k] = NULL;
        if (s == TD_OK) s = r;
        if (s != TD_OK) continue;
        float *x = t->buf[t->recv] + t->base[k];
        size_t seg = t->seg[k];
        for (size_t stride = 1; stride < w; stride *= 2)
            for (size_t i = 0; i + stride < w; i += 2 * stride) {
                add_to(x + i * seg, x + (i + stride) * seg, seg); /* lo + hi, as hi + lo */
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
        /* one summed over the shards comes at the last shard only */
        if (d->ready[i] || (d->params[i].shard_sum && t->shard + 1 < t->local)) continue;
        n_unready++;
        size_t bytes = d->params[i].count * sizeof(float);
        memset(dst + param_at(d, i), 0, bytes);
        /* on a GPU the fold copies the device's slot down over the host's */
        if (t->dev) td__ddp_note_error(d, td__ddp_mem_zero(d, t->dev + param_at(d, i), bytes));
        tree_grad_ready(d, i);
    }
    /* The tail: this shard's buffers, its unready count and its loss, into the same tree. */
    float *tail = dst + t->base[d->n_buckets];
    for (size_t i = 0; i < d->n_buffers; i++) {
        td__ddp_note_error(d, td_device_copy(td_device_cpu(), tail, d->device, d->buffers[i].data,
                                             d->buffers[i].count * sizeof(float)));
        tail += d->buffers[i].count;
    }
    tail[0] = (float)n_unready;
    tail[1] = d->loss;
    d->loss = 0; /* the next shard sets its own */
    tree_fold(t, t->base[d->n_buckets], t->n_buffer_floats + DDP_SLOTS, 1.0f);
    tree_advance(t);
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
    float *top = t->buf[t->root], inv = 1.0f / (float)t->shards;
    td_device cpu = td_device_cpu();
    td_status up = TD_OK;
    if (t->dev) /* the result goes back to where the optimizer reads it */
        up = td_device_copy(d->device, t->dev, cpu, top, t->base[d->n_buckets] * sizeof(float));
    for (size_t i = 0; i < d->n_params; i++)
        d->params[i].grad = (t->dev ? t->dev : top) + param_at(d, i);
    const float *sum = top + t->base[d->n_buckets];
    for (size_t i = 0; i < d->n_buffers && up == TD_OK; i++) {
        size_t n = d->buffers[i].count;
        for (size_t e = 0; e < n; e++) t->buffers0[e] = sum[e] * inv;
        up = td_device_copy(d->device, d->buffers[i].data, cpu, t->buffers0, n * sizeof(float));
        sum += n;
    }
    if (up != TD_OK) return up;
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
