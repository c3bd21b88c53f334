/* td_ddp's front: creation (the ranks' agreement on options and registrations, rank 0's
 * parameters and buffers broadcast, a reducer chosen and built), the public API of an iteration
 * (prepare_forward, grad_ready, finish_backward, no_sync, zero_grad) and what every reducer
 * shares: the error of a backward, the buffer broadcast, the unused-parameter rule.
 *
 * How gradients are reduced is the reducer's business (reducer.h): the buckets all-reduced
 * while backward runs (ddp_allreduce.c) or deterministic mode's shard tree (ddp_shard_tree.c).
 * It does not compute gradients or step the optimizer, and it knows nothing of graphs: the
 * caller says when a gradient is final. Collectives go through comm.h only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/recorder.h"

#include "core/core_impl.h"
#include "parallel/ddp_impl.h"

#define DDP_BCAST_CHUNK ((size_t)8 << 20) /* staging size of the coalesced broadcasts */
#define DDP_UNUSED_NAMES 10               /* names listed in a TD_EUNUSED message */

td_ddp_params td_ddp_default_params(void) {
    td_ddp_params p = {
        .first_bucket_bytes = (size_t)1 << 20,
        .bucket_bytes = (size_t)25 << 20,
        .average = 1,
        .find_unused_parameters = 0,
        .broadcast_buffers = 1,
        .rebuild_buckets = 1,
        .trace = NULL,
        .comm_dtype = TD_F32,
        .deterministic = 0,
        .shards = 8,
        .join = 0,
    };
    return p;
}

/* ---- what every reducer shares ------------------------------------------------------ */

void td__ddp_note_error(td_ddp *d, td_status s) {
    if (s == TD_OK || d->err != TD_OK) return;
    d->err = s;
    snprintf(d->err_msg, sizeof d->err_msg, "%s", td_last_error());
}

td_status td__ddp_take_error(td_ddp *d) {
    td_status s = d->err;
    d->err = TD_OK;
    return td__fail(s, "%s", d->err_msg);
}

void td__ddp_end_iteration(td_ddp *d) {
    memset(d->ready, 0, d->n_params ? d->n_params : 1);
    memset(d->touched, 0, d->n_params ? d->n_params : 1);
    d->n_ready = 0;
    d->err = TD_OK;
    d->err_msg[0] = 0;
    d->open = 0;
    d->loss = 0; /* reported; the next step sets its own */
}

/* Broadcasts the listed byte ranges from rank 0 through one staging buffer, so a model with
 * hundreds of small tensors costs a few collectives, not hundreds. */
typedef struct {
    void *ptr;
    size_t bytes;
} ddp_segment;

static td_status ddp_broadcast_segments(td_ddp *d, const ddp_segment *seg, size_t n_seg, int root) {
    size_t total = 0;
    for (size_t i = 0; i < n_seg; i++) total += seg[i].bytes;
    if (d->size == 1 || total == 0) return TD_OK;
    size_t cap = total < DDP_BCAST_CHUNK ? total : DDP_BCAST_CHUNK;
    unsigned char *stage = NULL;
    if (td__ddp_mem_scratch(d, cap, (void **)&stage) != TD_OK)
        return td__fail(TD_ENOMEM, "ddp rank %d: out of memory for a %zu-byte broadcast buffer",
                        d->rank, cap);
    td_status s = TD_OK;
    size_t si = 0, so = 0; /* read position: segment, offset */
    for (size_t done = 0; done < total && s == TD_OK;) {
        size_t len = total - done < cap ? total - done : cap;
        size_t gi = si, go = so;
        if (d->rank == root) {
            for (size_t k = 0; k < len;) {
                size_t take = seg[gi].bytes - go < len - k ? seg[gi].bytes - go : len - k;
                if (s == TD_OK)
                    s = td__ddp_mem_copy(d, stage + k, (unsigned char *)seg[gi].ptr + go, take);
                k += take;
                go += take;
                if (go == seg[gi].bytes) gi++, go = 0;
                while (gi < n_seg && seg[gi].bytes == 0) gi++;
            }
        }
        if (s == TD_OK) s = td_comm_broadcast(d->comm, stage, len, TD_U8, root);
        if (s == TD_OK) {
            for (size_t k = 0; k < len;) {
                while (si < n_seg && seg[si].bytes == 0) si++;
                size_t take = seg[si].bytes - so < len - k ? seg[si].bytes - so : len - k;
                if (d->rank != root && s == TD_OK)
                    s = td__ddp_mem_copy(d, (unsigned char *)seg[si].ptr + so, stage + k, take);
                k += take;
                so += take;
                if (so == seg[si].bytes) si++, so = 0;
            }
        }
        done += len;
    }
    td__ddp_mem_scratch_free(d, stage);
    return s;
}

td_status td__ddp_broadcast_tensors(td_ddp *d, td_param *t, size_t n, int root) {
    if (n == 0 || d->size == 1) return TD_OK;
    ddp_segment *seg = calloc(n, sizeof *seg);
    if (!seg) return td__fail(TD_ENOMEM, "ddp rank %d: out of memory", d->rank);
    for (size_t i = 0; i < n; i++)
        seg[i] = (ddp_segment){t[i].data, t[i].count * td_dtype_size(t[i].dtype)};
    td_status s = ddp_broadcast_segments(d, seg, n, root);
    free(seg);
    return s;
}

td_status td__ddp_sync_buffers(td_ddp *d) {
    int root = 0;
    if (d->join) {
        TD__TRY(td__ddp_join_prepare(d, d->join->samples));
        root = d->join->authority;
    }
    if (!d->opt.broadcast_buffers) return TD_OK;
    return td__ddp_broadcast_tensors(d, d->buffers, d->n_buffers, root);
}

td_status td__ddp_unused_error(const td_ddp *d, size_t n_unready, double unready_all) {
    if (!n_unready)
        return td__fail(TD_EUNUSED,
                        "ddp rank %d: %.0f parameter(s) on other ranks received no gradient in "
                        "this backward (their errors name them); set find_unused_parameters = 1 "
                        "if parts of the model are unused in some iterations",
                        d->rank, unready_all);
    char names[512];
    size_t len = 0, listed = 0;
    names[0] = 0;
    for (size_t i = 0; i < d->n_params && len < sizeof names; i++) {
        if (d->ready[i]) continue;
        if (listed == DDP_UNUSED_NAMES) {
            len +=
                (size_t)snprintf(names + len, sizeof names - len, ", ... (%zu in all)", n_unready);
            break;
        }
        len += (size_t)snprintf(names + len, sizeof names - len, "%s'%s'", listed ? ", " : "",
                                d->params[i].name);
        listed++;
    }
    return td__fail(TD_EUNUSED,
                    "ddp rank %d: %zu parameter(s) received no gradient (no td_ddp_grad_ready) in "
                    "this backward: %s; set find_unused_parameters = 1 if parts of the model are "
                    "unused in some iterations",
                    d->rank, n_unready, names);
}

/* ---- the ranks' agreement ------------------------------------------------------------ */

/* Checks that involve no other rank; every rank must learn of a failure, or the others wait. */
static td_status ddp_check_local(const td_ddp *d) {
    for (size_t i = 0; i < d->n_params; i++) {
        const td_param *p = &d->params[i];
        if (!p->name)
            return td__fail(TD_EINVAL, "ddp rank %d: parameter %zu has no name", d->rank, i);
        if (!td__is_float(p->dtype))
            return td__fail(TD_EDTYPE,
                            "ddp rank %d: parameter '%s' is %s; DDP reduces f32, bf16 and f16 "
                            "gradients",
                            d->rank, p->name, td_dtype_name(p->dtype));
        if (!p->data && p->count)
            return td__fail(TD_EINVAL, "ddp rank %d: parameter '%s' has no data", d->rank, p->name);
        if (p->ndim < 0 || p->ndim > TD_MAX_DIMS)
            return td__fail(TD_EINVAL, "ddp rank %d: parameter '%s' has ndim %d", d->rank, p->name,
                            p->ndim);
    }
    for (size_t i = 0; i < d->n_buffers; i++) {
        const td_param *b = &d->buffers[i];
        if (!b->name || (!b->data && b->count) || td_dtype_size(b->dtype) == 0)
            return td__fail(TD_EINVAL,
                            "ddp rank %d: buffer %zu (%s) has no name, no data or a bad dtype",
                            d->rank, i, b->name ? b->name : "unnamed");
    }
    return d->reducer->check ? d->reducer->check(d) : TD_OK;
}

/* The options that decide which collectives run, and how many tensors each rank registered. */
typedef struct {
    int64_t shards, join; /* shards 0: not deterministic */
} ddp_modes;

typedef struct {
    int64_t n_params, n_buffers;
} ddp_counts;

/* One registered tensor as the ranks compare it. */
typedef struct {
    char name[96];
    int64_t kind; /* 0 parameter, 1 buffer */
    int64_t dtype, ndim, shape[TD_MAX_DIMS];
} ddp_entry;

/* Where a rank's registrations first differ from rank 0's (index -1: nowhere), and its entry. */
typedef struct {
    int64_t index;
    ddp_entry entry;
} ddp_diff;

static void describe_modes(const void *sig, const void *other, char *out, size_t cap, void *ctx) {
    const ddp_modes *m = sig;
    (void)other, (void)ctx;
    if (m->shards)
        snprintf(out, cap, "deterministic mode with %lld shards and join %s", (long long)m->shards,
                 m->join ? "on" : "off");
    else
        snprintf(out, cap, "deterministic mode off and join %s", m->join ? "on" : "off");
}

static void describe_counts(const void *sig, const void *other, char *out, size_t cap, void *ctx) {
    const ddp_counts *c = sig;
    (void)other, (void)ctx;
    snprintf(out, cap, "%lld parameter%s and %lld buffer%s", (long long)c->n_params,
             c->n_params == 1 ? "" : "s", (long long)c->n_buffers, c->n_buffers == 1 ? "" : "s");
}

/* Rank 0's registrations, for describe_diff. */
typedef struct {
    const ddp_entry *entries;
    size_t n_params;
} ddp_rank0;

/* An entry in words: "parameter 5 'fc3.weight' f32 (12, 16)", numbered within its kind. A rank
 * that agrees with rank 0 stands for rank 0's entry where the other rank differs. */
static void describe_diff(const void *sig, const void *other, char *out, size_t cap, void *ctx) {
    const ddp_diff *a = sig, *b = other;
    const ddp_rank0 *rank0 = ctx;
    int64_t at = a->index >= 0 ? a->index : b->index;
    const ddp_entry *e = a->index >= 0 ? &a->entry : &rank0->entries[at];
    int64_t within = at - (e->kind ? (int64_t)rank0->n_params : 0);
    char dims[160];
    snprintf(out, cap, "%s %lld '%s' %s %s", e->kind ? "buffer" : "parameter", (long long)within,
             e->name, td_dtype_name((td_dtype)e->dtype),
             td__dims_str(dims, sizeof dims, e->ndim, e->shape));
}

static void ddp_entry_fill(ddp_entry *e, const td_param *p, int kind) {
    memset(e, 0, sizeof *e);
    snprintf(e->name, sizeof e->name, "%s", p->name ? p->name : "");
    e->kind = kind;
    e->dtype = p->dtype;
    e->ndim = p->ndim;
    for (int k = 0; k < p->ndim && k < TD_MAX_DIMS; k++) e->shape[k] = p->shape[k];
}

/* Every rank checks its own registration, then all agree on the options, the counts and, entry
 * by entry against rank 0's list, the names, dtypes and shapes; every rank returns the same
 * error naming the first difference. */
static td_status ddp_agree(td_ddp *d) {
    char what[32];
    snprintf(what, sizeof what, "ddp rank %d", d->rank);
    ddp_modes modes = {d->opt.deterministic ? (int64_t)d->opt.shards : 0, d->opt.join != 0};
    td_comm_agreement a = {.what = what,
                           .local = ddp_check_local(d),
                           .sig = &modes,
                           .bytes = sizeof modes,
                           .mismatch = TD_EINVAL,
                           .describe = describe_modes,
                           .hint = "; every rank must create DDP with the same options"};
    TD__TRY(td_comm_agree(d->comm, &a));
    ddp_counts counts = {(int64_t)d->n_params, (int64_t)d->n_buffers};
    a = (td_comm_agreement){.what = what,
                            .sig = &counts,
                            .bytes = sizeof counts,
                            .mismatch = TD_ESHAPE,
                            .describe = describe_counts,
                            .hint = "; every rank must register the same parameters and buffers "
                                    "in the same order"};
    TD__TRY(td_comm_agree(d->comm, &a));
    size_t n = d->n_params + d->n_buffers;
    ddp_entry *mine = calloc(n ? n : 1, sizeof *mine), *rank0 = calloc(n ? n : 1, sizeof *rank0);
    if (!mine || !rank0) {
        free(mine);
        free(rank0);
        return td__fail(TD_ENOMEM, "ddp rank %d: out of memory", d->rank);
    }
    for (size_t i = 0; i < n; i++)
        if (i < d->n_params)
            ddp_entry_fill(&mine[i], &d->params[i], 0);
        else
            ddp_entry_fill(&mine[i], &d->buffers[i - d->n_params], 1);
    if (d->rank == 0) memcpy(rank0, mine, n * sizeof *mine);
    td_status s = td_comm_broadcast(d->comm, rank0, n * sizeof *rank0, TD_U8, 0);
    ddp_diff diff;
    memset(&diff, 0, sizeof diff);
    diff.index = -1;
    for (size_t i = 0; i < n && diff.index < 0; i++)
        if (memcmp(&mine[i], &rank0[i], sizeof *mine) != 0) {
            diff.index = (int64_t)i;
            diff.entry = mine[i];
        }
    ddp_rank0 ctx = {rank0, d->n_params};
    a.sig = &diff;
    a.bytes = sizeof diff;
    a.describe = describe_diff;
    a.describe_ctx = &ctx;
    if (s == TD_OK) s = td_comm_agree(d->comm, &a);
    free(mine);
    free(rank0);
    return s;
}

/* ---- creation ---------------------------------------------------------------------- */

td_status td_ddp_create(td_ddp **out, td_comm *comm, td_param *params, size_t n_params,
                        td_param *buffers, size_t n_buffers, const td_ddp_params *p) {
    int deterministic = p && p->deterministic;
    return td__ddp_create_with(out, comm, params, n_params, buffers, n_buffers, p,
                               deterministic ? &td__ddp_shard_tree : &td__ddp_allreduce, NULL);
}

td_status td__ddp_create_with(td_ddp **out, td_comm *comm, td_param *params, size_t n_params,
                              td_param *buffers, size_t n_buffers, const td_ddp_params *p,
                              const td__ddp_reducer *reducer, void *reducer_ctx) {
    if (!out || !comm || (n_params && !params) || (n_buffers && !buffers))
        return td__fail(TD_EINVAL, "td_ddp_create: out, comm, params or buffers is NULL");
    *out = NULL;
    td_ddp_params opt = p ? *p : td_ddp_default_params();
    if (!td__is_float(opt.comm_dtype))
        return td__fail(TD_EINVAL, "td_ddp_create: comm_dtype %s, expected f32, bf16 or f16",
                        td_dtype_name(opt.comm_dtype));
    td_device on;
    TD__TRY(td__ddp_device(params, n_params, buffers, n_buffers, &on));
    td_ddp *d = calloc(1, sizeof *d);
    if (!d) return td__fail(TD_ENOMEM, "td_ddp_create: out of memory");
    d->comm = comm;
    d->device = on;
    d->rank = td_comm_rank(comm);
    d->size = td_comm_size(comm);
    d->params = params;
    d->n_params = n_params;
    d->buffers = buffers;
    d->n_buffers = n_buffers;
    d->opt = opt;
    d->reducer = reducer;
    d->reducer_ctx = reducer_ctx;
    d->sync = 1;
    d->shard_count = 1;
    size_t n = n_params ? n_params : 1;
    d->orig_grad = calloc(n, sizeof *d->orig_grad);
    d->ready = calloc(n, 1);
    d->touched = calloc(n, 1);
    d->order = calloc(n, sizeof *d->order);
    d->moved_from = calloc(n, sizeof *d->moved_from);
    if (!d->orig_grad || !d->ready || !d->touched || !d->order || !d->moved_from) {
        td_ddp_destroy(d);
        return td__fail(TD_ENOMEM, "td_ddp_create: out of memory");
    }
    for (size_t i = 0; i < n_params; i++) d->orig_grad[i] = params[i].grad;
    /* Reverse registration order: the last layers' gradients are ready first. */
    for (size_t i = 0; i < n_params; i++) d->order[i] = n_params - 1 - i;
    td_status s = ddp_agree(d);
    if (s == TD_OK) s = td__ddp_broadcast_tensors(d, params, n_params, 0);
    if (s == TD_OK) s = td__ddp_broadcast_tensors(d, buffers, n_buffers, 0);
    if (s == TD_OK) s = d->reducer->create(d);
    if (s == TD_OK && d->opt.join) s = td__ddp_join_create(d);
    if (s != TD_OK) {
        char msg[768];
        snprintf(msg, sizeof msg, "%s", td_last_error());
        td_ddp_destroy(d);
        return td__fail(s, "%s", msg);
    }
    d->stats.n_buckets = d->n_buckets;
    td__log(TD_LOG_INFO, "ddp rank %d/%d: %zu parameters, %zu buffers, %zu buckets (%s)", d->rank,
            d->size, n_params, n_buffers, d->n_buckets, d->reducer->name);
    *out = d;
    return TD_OK;
}

void td_ddp_destroy(td_ddp *d) {
    if (!d) return;
    if (d->state) d->reducer->wait(d);
    /* The gradients go back where the trainer had them, with their current values. */
    for (size_t i = 0; i < d->n_params && d->orig_grad; i++) {
        void *orig = d->orig_grad[i], *now = d->params[i].grad;
        if (orig && now && now != orig)
            td__ddp_mem_copy(d, orig, now, d->params[i].count * td_dtype_size(d->params[i].dtype));
        d->params[i].grad = orig;
    }
    if (d->state) d->reducer->destroy(d);
    td__ddp_join_destroy(d);
    td__ddp_free_buckets(d->buckets, d->n_buckets);
    td__ddp_mem_free(d, d->moved_mem);
    free(d->moved_from);
    free(d->bucket_of);
    free(d->offset_of);
    free(d->orig_grad);
    free(d->ready);
    free(d->touched);
    free(d->order);
    free(d);
}

/* ---- one iteration ------------------------------------------------------------------ */

td_status td_ddp_prepare_forward(td_ddp *d) {
    if (!d) return td__fail(TD_EINVAL, "td_ddp_prepare_forward: ddp is NULL");
    if (d->sync && d->n_ready > 0)
        return td__fail(
            TD_ESTATE,
            "ddp rank %d: the previous backward was not ended with td_ddp_finish_backward",
            d->rank);
    d->open = 1;
    td_recorder_step(TD_RECORDER_NEXT);
    return d->sync ? d->reducer->prepare(d) : TD_OK;
}

void td_ddp_zero_grad(td_ddp *d) {
    if (d) d->reducer->zero_grad(d);
}

void td__ddp_before_backward(td_ddp *d, size_t i) {
    if (d && d->sync && i < d->n_params && d->reducer->before_backward)
        d->reducer->before_backward(d, i);
}

td_status td_ddp_grad_ready(td_ddp *d, size_t i) {
    if (!d) return td__fail(TD_EINVAL, "td_ddp_grad_ready: ddp is NULL");
    if (i >= d->n_params)
        return td__fail(TD_EINVAL,
                        "ddp rank %d: grad_ready for parameter index %zu, but %zu are registered",
                        d->rank, i, d->n_params);
    d->touched[i] = 1;
    d->open = 1;
    if (!d->sync) return TD_OK; /* no_sync: the gradient just accumulates where it is */
    if (d->ready[i])
        return td__fail(
            TD_ESTATE,
            "ddp rank %d: parameter '%s' (index %zu) was marked ready twice in one backward; call "
            "td_ddp_finish_backward after every backward",
            d->rank, d->params[i].name, i);
    d->ready[i] = 1;
    d->n_ready++;
    d->reducer->grad_ready(d, i);
    return d->err != TD_OK ? td__fail(d->err, "%s", d->err_msg) : TD_OK;
}

void td_ddp_grad_ready_hook(size_t param_index, void *ddp) {
    if (ddp) td__ddp_note_error(ddp, td_ddp_grad_ready(ddp, param_index));
}

td_status td_ddp_finish_backward(td_ddp *d) {
    if (!d) return td__fail(TD_EINVAL, "td_ddp_finish_backward: ddp is NULL");
    if (!d->open)
        return td__fail(TD_ESTATE,
                        "ddp rank %d: td_ddp_finish_backward without a backward since the last "
                        "one (call td_ddp_prepare_forward, run backward, then finish once)",
                        d->rank);
    if (!d->sync) {
        d->open = 0;
        return TD_OK;
    }
    return d->reducer->finish(d);
}

td_status td_ddp_set_sync(td_ddp *d, int sync) {
    if (!d) return td__fail(TD_EINVAL, "td_ddp_set_sync: ddp is NULL");
    if (d->sync && d->n_ready > 0)
        return td__fail(TD_ESTATE, "ddp rank %d: td_ddp_set_sync in the middle of a backward",
                        d->rank);
    if (!sync && d->reducer->refuse_no_sync) return d->reducer->refuse_no_sync(d);
    d->sync = sync != 0;
    return TD_OK;
}

/* ---- accessors ---------------------------------------------------------------------- */

void td_ddp_set_loss(td_ddp *d, float loss) {
    if (d) d->loss = loss;
}

float td_ddp_loss(const td_ddp *d) { return d ? d->loss_all : 0.0f; }

void td_ddp_shards(const td_ddp *d, size_t *first, size_t *count) {
    *first = d ? d->shard_first : 0;
    *count = d ? d->shard_count : 1;
}

td_ddp_stats td_ddp_get_stats(const td_ddp *d) {
    td_ddp_stats none = {0, 0, 0, 0};
    return d ? d->stats : none;
}

size_t td_ddp_bucket_params(const td_ddp *d, size_t bucket, size_t *indices, size_t max) {
    if (!d || bucket >= d->n_buckets) return 0;
    const ddp_bucket *b = &d->buckets[bucket];
    for (size_t j = 0; j < b->n_members && j < max && indices; j++) indices[j] = b->members[j];
    return b->n_members;
}
