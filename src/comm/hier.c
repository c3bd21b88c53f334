/* The hierarchical backend: a group whose ranks span hosts, run as NCCL and Horovod run theirs.
 * It composes three groups of other backends and moves no byte itself:
 *   flat:  every rank, over the inter-host transport (mpi or ucx): point-to-point to other
 *          hosts, and the collectives with no hierarchical form;
 *   local: this host's ranks, over shared memory (shm): point-to-point inside the host;
 *   cross: the ranks of equal local rank, one per host (a split of flat).
 * All-reduce is a reduce-scatter over local (each local rank owns 1/L of the buffer), an
 * all-reduce of that shard over cross, and an all-gather over local: each host sends its
 * buffer once over the network, in L parallel streams, instead of once per rank. Broadcast
 * spreads the root's buffer over its host, sends 1/L over each cross group and gathers it on
 * the other hosts; all-gather goes across in the cross groups and then around each host.
 * Small buffers skip the scatter: every local rank carries the whole (tiny) buffer across.
 *
 * Every collective starts with a step on the local group that carries the user's call (sig),
 * so that ranks of one host calling different collectives get TD_EMISMATCH there, and its
 * second step crosses hosts carrying it too, so that hosts calling different ones do; any
 * failure is told to the other hosts (a cross step carrying the error) and to the host's other
 * ranks (the local group is aborted with the message), so that nobody waits for its timeout.
 * Rejected arguments reach every rank naming the lowest rejecting rank (comm_impl.h).
 *
 * A group is hierarchical when every host has the same number of its ranks; otherwise its
 * collectives are flat (p2p still takes shared memory inside a host). A group on one host
 * runs everything on local. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm_impl.h"
#include "core/core_impl.h"

/* Buffers up to this size cross hosts whole, on every local rank: one local step fewer. */
#define HIER_SMALL (32u << 10)

typedef struct {
    const td__backend_ops *self, *flat_ops, *local_ops;
    void *flat, *local, *cross; /* cross (flat_ops): NULL on one host or when not uniform */
    td__group_shape shape;
    int L, H;        /* ranks per host (when uniform), hosts */
    int *node_of;    /* (size) the host of each rank */
    int *local_of;   /* (size) its local rank */
    int *host_ranks; /* (local size) this host's ranks, in local order */
    /* How the inner groups' messages name their members: by world rank, as this group's. */
    td__names local_names, cross_names;
} hier_ctx;

/* One point-to-point request: which group carries it. */
typedef struct {
    int local;
    void *req;
} hier_req;

static const td__backend_ops hier_mpi_ops, hier_ucx_ops;

static void hier_free(hier_ctx *h) {
    if (!h) return;
    if (h->cross) h->flat_ops->destroy(h->cross);
    if (h->local) h->local_ops->destroy(h->local);
    if (h->flat) h->flat_ops->destroy(h->flat);
    free(h->node_of);
    free(h->local_of);
    free(h->host_ranks);
    td__names_free(&h->local_names);
    td__names_free(&h->cross_names);
    free(h);
}

/* ---------------------------------------------------------------- steps */

/* Steps on the host wait a little longer than the timeout: a local rank that does not come is
 * most often waiting across hosts itself, and its failure, which names the host it lost,
 * should reach the others before their own timeout does. */
static double local_timeout(double timeout_s) {
    return timeout_s + (timeout_s / 10 > 1 ? timeout_s / 10 : 1);
}

#define LOCAL(kind, send, recv, count, dtype, op, root, timeout_s)                     \
    td__coll_step(h->local_ops, h->local, c, kind, send, recv, count, dtype, op, root, \
                  local_timeout(timeout_s))
#define CROSS(...) td__coll_step(h->flat_ops, h->cross, c, __VA_ARGS__)

static int usable(td_status s) { return s == TD_EINVAL || s == TD_EDTYPE; }


/* What every rank of a host says about its arguments, to find the lowest rejecting rank. */
typedef struct {
    int32_t error, rank;
    char why[184];
} rejection;

/* The first step, on this host, failed with `s`. Rejected arguments: the host learns the
 * lowest rejecting rank and tells the other hosts, and every rank returns that error. Anything
 * else ends the group: the other hosts hear of it in their cross step. */
static td_status first_step_failed(hier_ctx *h, const td__coll *c, td_status s, double timeout_s) {
    char msg[768];
    snprintf(msg, sizeof msg, "%s", td_last_error());
    td__coll tell = {.kind = TD__COLL_BARRIER,
                     .seq = c->seq,
                     .sig = td__coll_sig(c),
                     .error = s,
                     .error_rank = c->error_rank,
                     .error_msg = msg};
    if (usable(s)) {
        int L = h->shape.local_size;
        rejection mine = {.error = c->error, .rank = c->error_rank},
                  *all = calloc((size_t)L, sizeof *all);
        if (!all) return td__fail(TD_ENOMEM, "hier: out of memory");
        if (c->error) snprintf(mine.why, sizeof mine.why, "%s", c->error_msg ? c->error_msg : "");
        td__coll quiet = *c; /* the same call, its rejection now carried in `mine` */
        quiet.error = TD_OK;
        td_status t = td__coll_step(h->local_ops, h->local, &quiet, TD__COLL_ALLGATHER, &mine, all,
                                    sizeof mine, TD_U8, TD_OP_SUM, 0, timeout_s);
        int low = -1;
        for (int i = 0; t == TD_OK && i < L; i++)
            if (all[i].error && (low < 0 || all[i].rank < all[low].rank)) low = i;
        if (t == TD_OK && low >= 0) {
            tell.error = all[low].error;
            tell.error_rank = all[low].rank;
            all[low].why[sizeof all[low].why - 1] = 0;
            snprintf(msg, sizeof msg, "%s", all[low].why);
        }
        free(all);
        if (t != TD_OK) return t;
        if (!h->cross) return td__fail(tell.error, "rank %d: %s", tell.error_rank, msg);
        /* Every host returns the lowest rejecting rank's error, from the cross step. */
        return h->flat_ops->collective(h->cross, &tell, timeout_s);
    }
    if (h->cross) (void)h->flat_ops->collective(h->cross, &tell, timeout_s);
    return td__fail(s, "%s", msg);
}

/* A step after the first failed with `s`: the host's other ranks may wait in the next local
 * step, so the local group is aborted with the message. */
static td_status later_step_failed(hier_ctx *h, td_status s) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", td_last_error());
    if (!usable(s)) h->local_ops->abort(h->local, h->shape.local_rank, msg);
    return td__fail(s, "%s", msg);
}

/* p[0 .. n) /= the group's size, for AVG (summed over the steps). */
static void average(hier_ctx *h, void *p, size_t n, td_dtype dt) {
    const void *src[1] = {p};
    td__reduce(p, src, 1, n, dt, TD_OP_AVG, h->shape.size);
}

/* ---------------------------------------------------------------- collectives */

static td_status hier_allreduce(hier_ctx *h, const td__coll *c, double timeout_s) {
    size_t N = c->count, e = td_dtype_size(c->dtype), L = (size_t)h->L;
    int l = h->shape.local_rank, avg = c->op == TD_OP_AVG;
    td_reduce_op op = avg ? TD_OP_SUM : c->op;
    const unsigned char *send = c->send;
    unsigned char *recv = c->recv;
    td_status s;
    if (N * e <= HIER_SMALL || N < L) {
        s = LOCAL(TD__COLL_ALLREDUCE, send, recv, N, c->dtype, op, 0, timeout_s);
        if (s) return first_step_failed(h, c, s, timeout_s);
        s = CROSS(TD__COLL_ALLREDUCE, recv, recv, N, c->dtype, op, 0, timeout_s);
        if (s) return later_step_failed(h, s);
        if (avg) average(h, recv, N, c->dtype);
        return TD_OK;
    }
    /* Shards of k elements; the last local rank also owns the t left over. */
    size_t k = N / L, t = N - k * L, mine = k + ((size_t)l == L - 1 ? t : 0);
    unsigned char *shard = recv + (size_t)l * k * e;
    s = LOCAL(TD__COLL_REDUCE_SCATTER, send, shard, k, c->dtype, op, 0, timeout_s);
    if (!s && t)
        s = LOCAL(TD__COLL_ALLREDUCE, send + L * k * e, recv + L * k * e, t, c->dtype, op, 0,
                  timeout_s);
    if (s) return first_step_failed(h, c, s, timeout_s);
    s = CROSS(TD__COLL_ALLREDUCE, shard, shard, mine, c->dtype, op, 0, timeout_s);
    if (s) return later_step_failed(h, s);
    if (avg) average(h, shard, mine, c->dtype);
    s = LOCAL(TD__COLL_ALLGATHER, shard, recv, k, c->dtype, TD_OP_SUM, 0, timeout_s);
    if (!s && t)
        s = LOCAL(TD__COLL_BROADCAST, recv + L * k * e, recv + L * k * e, t, c->dtype, TD_OP_SUM,
                  (int)L - 1, timeout_s);
    return s;
}

static td_status hier_broadcast(hier_ctx *h, const td__coll *c, double timeout_s) {
    size_t N = c->count, e = td_dtype_size(c->dtype), L = (size_t)h->L;
    int root_host = h->node_of[c->root], here = root_host == h->shape.node, l = h->shape.local_rank;
    unsigned char *buf = c->recv;
    td_status s = here ? LOCAL(TD__COLL_BROADCAST, buf, buf, N, c->dtype, TD_OP_SUM,
                               h->local_of[c->root], timeout_s)
                       : LOCAL(TD__COLL_BARRIER, NULL, NULL, 0, TD_U8, TD_OP_SUM, 0, timeout_s);
    if (s) return first_step_failed(h, c, s, timeout_s);
    if (N * e <= HIER_SMALL || N < L) {
        s = CROSS(TD__COLL_BROADCAST, buf, buf, N, c->dtype, TD_OP_SUM, root_host, timeout_s);
        return s ? later_step_failed(h, s) : TD_OK;
    }
    size_t k = N / L, t = N - k * L, mine = k + ((size_t)l == L - 1 ? t : 0);
    unsigned char *part = buf + (size_t)l * k * e;
    s = CROSS(TD__COLL_BROADCAST, part, part, mine, c->dtype, TD_OP_SUM, root_host, timeout_s);
    if (s) return later_step_failed(h, s);
    if (here) return TD_OK; /* the root's host has had it all since the first step */
    s = LOCAL(TD__COLL_ALLGATHER, part, buf, k, c->dtype, TD_OP_SUM, 0, timeout_s);
    if (!s && t)
        s = LOCAL(TD__COLL_BROADCAST, buf + L * k * e, buf + L * k * e, t, c->dtype, TD_OP_SUM,
                  (int)L - 1, timeout_s);
    return s;
}

/* Across hosts within each cross group (rank (h, l) gets the blocks of every (h', l)), then
 * around each host (every rank gets every block), then into rank order. */
static td_status hier_allgather(hier_ctx *h, const td__coll *c, double timeout_s) {
    size_t b = c->count * td_dtype_size(c->dtype), H = (size_t)h->H, L = (size_t)h->L;
    td_status s = LOCAL(TD__COLL_BARRIER, NULL, NULL, 0, TD_U8, TD_OP_SUM, 0, timeout_s);
    if (s) return first_step_failed(h, c, s, timeout_s);
    unsigned char *across = malloc(H * b + 1), *all = malloc(L * H * b + 1);
    s = across && all
            ? CROSS(TD__COLL_ALLGATHER, c->send, across, b, TD_U8, TD_OP_SUM, 0, timeout_s)
            : td__fail(TD_ENOMEM, "hier allgather: out of memory for %zu bytes", (L + 1) * H * b);
    if (s) {
        free(across);
        free(all);
        return later_step_failed(h, s);
    }
    s = LOCAL(TD__COLL_ALLGATHER, across, all, H * b, TD_U8, TD_OP_SUM, 0, timeout_s);
    for (int r = 0; s == TD_OK && r < h->shape.size; r++)
        memcpy((unsigned char *)c->recv + (size_t)r * b,
               all + ((size_t)h->local_of[r] * H + (size_t)h->node_of[r]) * b, b);
    free(across);
    free(all);
    return s;
}

static td_status hier_barrier(hier_ctx *h, const td__coll *c, double timeout_s) {
    td_status s = LOCAL(TD__COLL_BARRIER, NULL, NULL, 0, TD_U8, TD_OP_SUM, 0, timeout_s);
    if (s) return first_step_failed(h, c, s, timeout_s);
    s = CROSS(TD__COLL_BARRIER, NULL, NULL, 0, TD_U8, TD_OP_SUM, 0, timeout_s);
    return s ? later_step_failed(h, s) : TD_OK;
}

/* The collectives with no hierarchical form: a check on this host and one across hosts (so
 * that a mismatch with any other collective is caught like theirs), then the flat one. */
static td_status checked_flat(hier_ctx *h, const td__coll *c, double timeout_s) {
    td_status s = hier_barrier(h, c, timeout_s);
    if (s) return s;
    s = h->flat_ops->collective(h->flat, c, timeout_s);
    return s ? later_step_failed(h, s) : TD_OK;
}

static td_status hier_collective(void *vctx, const td__coll *c, double timeout_s) {
    hier_ctx *h = vctx;
    if (h->H == 1) return h->local_ops->collective(h->local, c, timeout_s);
    if (!h->cross) return h->flat_ops->collective(h->flat, c, timeout_s);
    if (c->error) { /* rejected here: only the first step, to tell everyone */
        td_status s = LOCAL(TD__COLL_BARRIER, NULL, NULL, 0, TD_U8, TD_OP_SUM, 0, timeout_s);
        return first_step_failed(h, c, s ? s : TD_ESTATE, timeout_s);
    }
    int wide = c->op == TD_OP_AVG && !td__is_float(c->dtype) && c->dtype != TD_F64;
    switch (c->kind) {
    case TD__COLL_ALLREDUCE:
        return wide ? checked_flat(h, c, timeout_s) : hier_allreduce(h, c, timeout_s);
    case TD__COLL_BROADCAST:
        return hier_broadcast(h, c, timeout_s);
    case TD__COLL_ALLGATHER:
        return hier_allgather(h, c, timeout_s);
    case TD__COLL_BARRIER:
        return hier_barrier(h, c, timeout_s);
    default:
        return checked_flat(h, c, timeout_s);
    }
}

/* ---------------------------------------------------------------- point-to-point */

static td_status hier_post(hier_ctx *h, int send, void *buf, size_t bytes, int peer, int tag,
                           void **req) {
    hier_req *r = malloc(sizeof *r);
    if (!r) return td__fail(TD_ENOMEM, "hier: out of memory for a request");
    r->local = h->node_of[peer] == h->shape.node;
    const td__backend_ops *ops = r->local ? h->local_ops : h->flat_ops;
    void *g = r->local ? h->local : h->flat;
    int to = r->local ? h->local_of[peer] : peer;
    td_status s = send ? ops->isend(g, buf, bytes, to, tag, &r->req)
                       : ops->irecv(g, buf, bytes, to, tag, &r->req);
    if (s) {
        free(r);
        return s;
    }
    *req = r;
    return TD_OK;
}

static td_status hier_isend(void *ctx, const void *buf, size_t bytes, int dst, int tag,
                            void **req) {
    return hier_post(ctx, 1, (void *)buf, bytes, dst, tag, req);
}

static td_status hier_irecv(void *ctx, void *buf, size_t bytes, int src, int tag, void **req) {
    return hier_post(ctx, 0, buf, bytes, src, tag, req);
}

static td_status hier_p2p_wait(void *ctx, void *req, double timeout_s) {
    hier_ctx *h = ctx;
    hier_req *r = req;
    td_status s = r->local ? h->local_ops->p2p_wait(h->local, r->req, timeout_s)
                           : h->flat_ops->p2p_wait(h->flat, r->req, timeout_s);
    free(r);
    return s;
}

static td_status hier_p2p_test(void *ctx, void *req, int *done) {
    hier_ctx *h = ctx;
    hier_req *r = req;
    td_status s = r->local ? h->local_ops->p2p_test(h->local, r->req, done)
                           : h->flat_ops->p2p_test(h->flat, r->req, done);
    if (*done) free(r);
    return s;
}

/* ---------------------------------------------------------------- building */

/* Where every rank is, learned over flat; then the cross group when every host has L ranks. */
static td_status learn_hosts(hier_ctx *h, double timeout_s) {
    int n = h->shape.size;
    int32_t mine[3] = {h->shape.node, h->shape.local_rank, h->shape.local_size};
    int32_t *all = malloc((size_t)n * sizeof mine);
    h->node_of = malloc((size_t)n * sizeof *h->node_of);
    h->local_of = malloc((size_t)n * sizeof *h->local_of);
    h->host_ranks = malloc((size_t)h->shape.local_size * sizeof *h->host_ranks);
    if (!all || !h->node_of || !h->local_of || !h->host_ranks) {
        free(all);
        return td__fail(TD_ENOMEM, "hier: out of memory for %d ranks", n);
    }
    td__coll c = {.kind = TD__COLL_ALLGATHER,
                  .send = mine,
                  .recv = all,
                  .count = 3,
                  .dtype = TD_I32,
                  .error_rank = h->shape.rank};
    td_status s = h->flat_ops->collective(h->flat, &c, timeout_s);
    int uniform = 1;
    h->H = h->shape.nodes;
    h->L = h->shape.local_size;
    for (int r = 0; s == TD_OK && r < n; r++) {
        h->node_of[r] = all[3 * r];
        h->local_of[r] = all[3 * r + 1];
        uniform &= all[3 * r + 2] == h->L;
        if (h->node_of[r] == h->shape.node && h->local_of[r] < h->shape.local_size)
            h->host_ranks[h->local_of[r]] = r;
    }
    free(all);
    if (s == TD_OK && uniform && h->H > 1) {
        td__group_shape cs;
        int *members = malloc((size_t)n * sizeof *members);
        s = members ? h->flat_ops->split(h->flat, h->shape.local_rank, h->shape.node, timeout_s,
                                         &h->cross, &cs, members)
                    : td__fail(TD_ENOMEM, "hier: out of memory");
        free(members);
    }
    return s;
}

/* Rank 0 of each host names its segment over flat (an all-gather of every rank's 96 bytes,
 * each rank taking its host's first rank's). */
static td_status share_over_flat(void *arg, int rank, char name[96], double timeout_s) {
    hier_ctx *h = arg;
    int n = h->shape.size;
    char *all = malloc((size_t)n * 96);
    if (!all) return td__fail(TD_ENOMEM, "hier: out of memory");
    char mine[96] = "";
    if (rank == 0) memcpy(mine, name, 96);
    td__coll c = {.kind = TD__COLL_ALLGATHER,
                  .send = mine,
                  .recv = all,
                  .count = 96,
                  .dtype = TD_U8,
                  .error_rank = h->shape.rank};
    td_status s = h->flat_ops->collective(h->flat, &c, timeout_s);
    if (s == TD_OK && rank > 0) memcpy(name, all + (size_t)h->host_ranks[0] * 96, 96);
    free(all);
    return s;
}

static hier_ctx *hier_new(const td__backend_ops *flat_ops, void *flat,
                          const td__group_shape *shape) {
    hier_ctx *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->self = strcmp(flat_ops->name, "mpi") == 0 ? &hier_mpi_ops : &hier_ucx_ops;
    h->flat_ops = flat_ops;
    h->flat = flat;
    h->shape = *shape;
    return h;
}

td_status td__hier_create(const td__backend_ops *flat_ops, void *flat_ctx,
                          const td__group_shape *flat_shape, double timeout_s, void **ctx,
                          td__group_shape *shape, const td__backend_ops **ops) {
    hier_ctx *h = hier_new(flat_ops, flat_ctx, flat_shape);
    if (!h) return td__fail(TD_ENOMEM, "hier: out of memory");
    td_status s = learn_hosts(h, timeout_s);
    td__group_shape ls;
    if (s == TD_OK)
        s = td__shm_create_local(flat_shape->local_rank, flat_shape->local_size, share_over_flat, h,
                                 timeout_s, &h->local, &ls, &h->local_ops);
    if (s) {
        h->flat = NULL; /* the caller's still */
        hier_free(h);
        return s;
    }
    *ctx = h;
    *shape = h->shape;
    *ops = h->self;
    return TD_OK;
}

static td_status hier_split(void *vctx, int color, int key, double timeout_s, void **child,
                            td__group_shape *child_shape, int *members) {
    hier_ctx *h = vctx;
    void *flat = NULL, *local = NULL;
    td__group_shape fs, ls;
    *child = NULL;
    int *local_members = malloc((size_t)h->shape.local_size * sizeof *local_members);
    if (!local_members) return td__fail(TD_ENOMEM, "hier split: out of memory");
    /* flat's ranks are this group's, so its members are the child's */
    td_status s = h->flat_ops->split(h->flat, color, key, timeout_s, &flat, &fs, members);
    if (s == TD_OK)
        s = h->local_ops->split(h->local, color, key, timeout_s, &local, &ls, local_members);
    free(local_members);
    if (s == TD_OK && !flat) return TD_OK; /* not a member (no local child either) */
    hier_ctx *k = s == TD_OK ? hier_new(h->flat_ops, flat, &fs) : NULL;
    if (s == TD_OK && !k) s = td__fail(TD_ENOMEM, "hier split: out of memory");
    if (k) {
        k->local = local, k->local_ops = h->local_ops;
        s = learn_hosts(k, timeout_s);
    }
    if (s) {
        if (k) {
            hier_free(k);
        } else {
            if (flat) h->flat_ops->destroy(flat);
            if (local) h->local_ops->destroy(local);
        }
        return s;
    }
    *child = k;
    *child_shape = k->shape;
    return TD_OK;
}

static td_status hier_split_host(void *vctx, double timeout_s, void **child,
                                 td__group_shape *child_shape, const td__backend_ops **child_ops,
                                 int *members) {
    hier_ctx *h = vctx;
    *child_ops = h->local_ops;
    td_status s = h->local_ops->split(h->local, 0, h->shape.local_rank, timeout_s, child,
                                      child_shape, members);
    for (int i = 0; s == TD_OK && *child && i < child_shape->size; i++)
        members[i] = h->host_ranks[members[i]]; /* local ranks -> this group's */
    return s;
}

/* The inner groups name their members as this group does: the host's ranks and the ranks of
 * equal local rank across hosts, each by its world rank. */
static void hier_set_names(void *vctx, const td__names *names) {
    hier_ctx *h = vctx;
    int L = h->shape.local_size;
    if (h->flat_ops->set_names) h->flat_ops->set_names(h->flat, names);
    int *local = malloc((size_t)L * sizeof *local);
    if (local) {
        for (int i = 0; i < L; i++) local[i] = td__names_world(names, h->host_ranks[i]);
        td__names_free(&h->local_names);
        td__names_init(&h->local_names, L, local);
        if (h->local_ops->set_names) h->local_ops->set_names(h->local, &h->local_names);
    }
    int *cross = h->cross ? malloc((size_t)h->H * sizeof *cross) : NULL;
    if (cross) {
        for (int r = 0; r < h->shape.size; r++)
            if (h->local_of[r] == h->shape.local_rank) cross[h->node_of[r]] = td__names_world(names, r);
        td__names_free(&h->cross_names);
        td__names_init(&h->cross_names, h->H, cross);
        if (h->flat_ops->set_names) h->flat_ops->set_names(h->cross, &h->cross_names);
    }
}

static void hier_abort(void *vctx, int rank, const char *why) {
    hier_ctx *h = vctx;
    if (h->flat_ops->abort) h->flat_ops->abort(h->flat, rank, why);
    if (h->cross && h->flat_ops->abort) h->flat_ops->abort(h->cross, rank, why);
    h->local_ops->abort(h->local, h->shape.local_rank, why);
}

static void hier_destroy(void *vctx) { hier_free(vctx); }

#define HIER_OPS(label)                                                                         \
    {                                                                                           \
        .name = label, .collective = hier_collective, .isend = hier_isend, .irecv = hier_irecv, \
        .p2p_wait = hier_p2p_wait, .p2p_test = hier_p2p_test, .split = hier_split,              \
        .split_host = hier_split_host, .abort = hier_abort, .set_names = hier_set_names,        \
        .destroy = hier_destroy,                                                                \
    }
static const td__backend_ops hier_mpi_ops = HIER_OPS("mpi+shm");
static const td__backend_ops hier_ucx_ops = HIER_OPS("ucx+shm");
