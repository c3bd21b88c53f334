/* td_ddp: the reducer. Registration check and rank 0 broadcast at creation, gradient
 * buckets (layout, launch in bucket order, rebuild from the observed ready order), the
 * unused-parameter rule, no_sync and the all-reduce trace spans.
 *
 * It does not compute gradients or step the optimizer, and it knows nothing of graphs: the
 * caller says when a gradient is final. Collectives go through comm.h only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "parallel/ddp_impl.h"

#define DDP_ALIGN_BYTES 64                /* gradient offsets inside a bucket */
#define DDP_BCAST_CHUNK ((size_t)8 << 20) /* staging size of the coalesced broadcasts */
#define DDP_UNUSED_NAMES 10               /* names listed in a TD_EUNUSED message */
#define DDP_TRACE_TID_BASE 0x7f000000     /* one trace track per bucket, apart from threads */
/* What memory a gradient left holds: a signalling NaN of its dtype, so that reading it poisons
 * the result and any arithmetic on it (a `+=` through a stale pointer) quiets it and changes its
 * bits. */
#define DDP_CANARY_F32 0x7fa0ddadu
#define DDP_CANARY_BF16 0x7fa0u
#define DDP_CANARY_F16 0x7d00u

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

/* ---- helpers ----------------------------------------------------------------------- */

static void ddp_shape_str(char *out, size_t cap, int64_t ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(out, cap, "[");
    for (int64_t d = 0; d < ndim && d < TD_MAX_DIMS && n < cap; d++)
        n += (size_t)snprintf(out + n, cap - n, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (n < cap) snprintf(out + n, cap - n, "]");
}

void td__ddp_note_error(td_ddp *d, td_status s) {
    if (s == TD_OK || d->err != TD_OK) return;
    d->err = s;
    snprintf(d->err_msg, sizeof d->err_msg, "%s", td_last_error());
}

/* Broadcasts the listed byte ranges from rank 0 through one staging buffer, so a model with
 * hundreds of small tensors costs a few collectives, not hundreds. */
typedef struct {
    void *ptr;
    size_t bytes;
} ddp_segment;

static td_status ddp_broadcast_segments(td_ddp *d, const ddp_segment *seg, size_t n_seg,
                                        int root) {
    size_t total = 0;
    for (size_t i = 0; i < n_seg; i++) total += seg[i].bytes;
    if (d->size == 1 || total == 0) return TD_OK;
    size_t cap = total < DDP_BCAST_CHUNK ? total : DDP_BCAST_CHUNK;
    unsigned char *stage = malloc(cap);
    if (!stage)
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
                memcpy(stage + k, (unsigned char *)seg[gi].ptr + go, take);
                k += take;
                go += take;
                if (go == seg[gi].bytes) gi++, go = 0;
                while (gi < n_seg && seg[gi].bytes == 0) gi++;
            }
        }
        s = td_comm_broadcast(d->comm, stage, len, TD_U8, root);
        if (s == TD_OK) {
            for (size_t k = 0; k < len;) {
                while (si < n_seg && seg[si].bytes == 0) si++;
                size_t take = seg[si].bytes - so < len - k ? seg[si].bytes - so : len - k;
                if (d->rank != root) memcpy((unsigned char *)seg[si].ptr + so, stage + k, take);
                k += take;
                so += take;
                if (so == seg[si].bytes) si++, so = 0;
            }
        }
        done += len;
    }
    free(stage);
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

/* ---- registration check ------------------------------------------------------------ */

typedef struct {
    char name[96];
    int64_t kind; /* 0 parameter, 1 buffer */
    int64_t dtype, ndim, shape[TD_MAX_DIMS];
} ddp_sig;

typedef struct {
    int64_t index; /* first position that differs from rank 0, -1 when none */
    ddp_sig mine, rank0;
} ddp_diff;

static void ddp_sig_fill(ddp_sig *s, const td_param *p, int kind) {
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "%s", p->name ? p->name : "");
    s->kind = kind;
    s->dtype = p->dtype;
    s->ndim = p->ndim;
    for (int d = 0; d < p->ndim && d < TD_MAX_DIMS; d++) s->shape[d] = p->shape[d];
}

static uint64_t ddp_fnv(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static const char *ddp_kind(int64_t kind) { return kind ? "buffer" : "parameter"; }

/* Local checks whose failure every rank must learn about, or the others would wait. */
static td_status ddp_check_local(td_ddp *d) {
    if (d->opt.deterministic) {
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
    }
    for (size_t i = 0; i < d->n_params; i++) {
        const td_param *p = &d->params[i];
        if (!p->name)
            return td__fail(TD_EINVAL, "ddp rank %d: parameter %zu has no name", d->rank, i);
        if (!td__is_float(p->dtype))
            return td__fail(TD_EDTYPE,
                            "ddp rank %d: parameter '%s' is %s; DDP reduces f32, bf16 and f16 "
                            "gradients",
                            d->rank, p->name, td_dtype_name(p->dtype));
        if (d->opt.deterministic && p->dtype != TD_F32)
            return td__fail(TD_EDTYPE,
                            "ddp rank %d: parameter '%s' is %s; deterministic mode sums f32 "
                            "gradients (mixed precision O2/O3 is not supported there)",
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
        if (d->opt.deterministic && b->dtype != TD_F32)
            return td__fail(TD_EDTYPE,
                            "ddp rank %d: buffer '%s' is %s; deterministic mode averages f32 "
                            "buffers over shards",
                            d->rank, b->name, td_dtype_name(b->dtype));
    }
    return TD_OK;
}

static td_status ddp_check_registration(td_ddp *d) {
    td_status local = ddp_check_local(d);
    char local_msg[512];
    snprintf(local_msg, sizeof local_msg, "%s", local ? td_last_error() : "");
    size_t n = d->n_params + d->n_buffers;
    ddp_sig *mine = calloc(n ? n : 1, sizeof *mine);
    if (!mine) return td__fail(TD_ENOMEM, "ddp rank %d: out of memory", d->rank);
    uint64_t hash = 14695981039346656037ull;
    for (size_t i = 0; i < n; i++) {
        if (i < d->n_params)
            ddp_sig_fill(&mine[i], &d->params[i], 0);
        else
            ddp_sig_fill(&mine[i], &d->buffers[i - d->n_params], 1);
        hash = ddp_fnv(hash, &mine[i], sizeof mine[i]);
    }
    /* The options that change which collectives run must agree too. */
    int64_t modes = (int64_t)(d->opt.deterministic ? d->opt.shards : 0) << 1 | (d->opt.join != 0);
    int64_t summary[5] = {(int64_t)d->n_params, (int64_t)d->n_buffers, (int64_t)hash, local, modes};
    int64_t *all = calloc((size_t)d->size * 5, sizeof *all);
    ddp_sig *theirs = NULL;
    ddp_diff *diffs = NULL;
    td_status s = all ? td_comm_allgather(d->comm, summary, all, 5, TD_I64) : TD_ENOMEM;
    if (s != TD_OK) {
        if (s == TD_ENOMEM) td__fail(s, "ddp rank %d: out of memory", d->rank);
        goto done;
    }
    if (local != TD_OK) {
        s = td__fail(local, "%s", local_msg);
        goto done;
    }
    for (int r = 0; r < d->size; r++) {
        if (all[r * 5 + 3] != 0) {
            s = (td_status)all[r * 5 + 3];
            td__fail(s,
                     "ddp rank %d: rank %d rejected its parameters (%s; its error names the "
                     "problem)",
                     d->rank, r, td_status_string(s));
            goto done;
        }
        if (all[r * 5 + 4] != modes) {
            s = td__fail(TD_EINVAL,
                         "ddp rank %d: rank %d created DDP with deterministic shards %lld and join "
                         "%lld, this rank with %lld and %lld; every rank must pass the same",
                         d->rank, r, (long long)(all[r * 5 + 4] >> 1),
                         (long long)(all[r * 5 + 4] & 1), (long long)(modes >> 1),
                         (long long)(modes & 1));
            goto done;
        }
    }
    /* Different counts: say so per kind, without comparing entries that do not correspond. */
    for (int r = 1; r < d->size; r++) {
        const int64_t *x = &all[r * 5];
        if (x[0] == all[0] && x[1] == all[1]) continue;
        s = td__fail(TD_ESHAPE,
                     "ddp rank %d: rank %d registered %lld parameter%s and %lld buffer%s, rank 0 "
                     "registered %lld parameter%s and %lld buffer%s; every rank must register the "
                     "same parameters and buffers in the same order",
                     d->rank, r, (long long)x[0], x[0] == 1 ? "" : "s", (long long)x[1],
                     x[1] == 1 ? "" : "s", (long long)all[0], all[0] == 1 ? "" : "s",
                     (long long)all[1], all[1] == 1 ? "" : "s");
        goto done;
    }
    int same = 1;
    for (int r = 1; r < d->size; r++) same &= all[r * 5 + 2] == all[2];
    if (same) goto done;

    /* Names or shapes differ somewhere: each rank compares itself with rank 0's list and the
     * first difference found in rank order is reported, identically, on every rank. */
    theirs = calloc(n ? n : 1, sizeof *theirs);
    diffs = calloc((size_t)d->size, sizeof *diffs);
    if (!theirs || !diffs) {
        s = td__fail(TD_ENOMEM, "ddp rank %d: out of memory", d->rank);
        goto done;
    }
    if (d->rank == 0) memcpy(theirs, mine, n * sizeof *mine);
    s = td_comm_broadcast(d->comm, theirs, n * sizeof *theirs, TD_U8, 0);
    if (s != TD_OK) goto done;
    ddp_diff me;
    memset(&me, 0, sizeof me);
    me.index = -1;
    for (size_t i = 0; i < n && me.index < 0; i++)
        if (memcmp(&mine[i], &theirs[i], sizeof *mine) != 0) me.index = (int64_t)i;
    if (me.index >= 0) {
        me.mine = mine[me.index];
        me.rank0 = theirs[me.index];
    }
    s = td_comm_allgather(d->comm, &me, diffs, sizeof me, TD_U8);
    if (s != TD_OK) goto done;
    for (int r = 1; r < d->size; r++) {
        const ddp_diff *x = &diffs[r];
        if (x->index < 0) continue;
        int64_t within = x->index - (x->rank0.kind ? (int64_t)d->n_params : 0);
        char a[160], b[160];
        ddp_shape_str(a, sizeof a, x->rank0.ndim, x->rank0.shape);
        ddp_shape_str(b, sizeof b, x->mine.ndim, x->mine.shape);
        s = td__fail(TD_ESHAPE,
                     "ddp rank %d: registrations differ at %s %lld: rank 0 has '%s' %s %s but rank "
                     "%d has '%s' %s %s; every rank must register the same parameters in the same "
                     "order",
                     d->rank, ddp_kind(x->rank0.kind), (long long)within, x->rank0.name,
                     td_dtype_name((td_dtype)x->rank0.dtype), a, r, x->mine.name,
                     td_dtype_name((td_dtype)x->mine.dtype), b);
        goto done;
    }
    s = td__fail(
        TD_ESHAPE,
        "ddp rank %d: parameter signatures differ between ranks but no difference was found",
        d->rank);
done:
    free(mine);
    free(all);
    free(theirs);
    free(diffs);
    return s;
}

/* ---- buckets ----------------------------------------------------------------------- */

void td__ddp_free_buckets(ddp_bucket *b, size_t n) {
    for (size_t k = 0; k < n; k++) free(b[k].members);
    free(b);
}

/* The bit pattern of the canary in a dtype, and its size (2 or 4 bytes). */
static uint32_t ddp_canary(td_dtype dt, size_t *size) {
    *size = td_dtype_size(dt);
    return dt == TD_BF16 ? DDP_CANARY_BF16 : dt == TD_F16 ? DDP_CANARY_F16 : DDP_CANARY_F32;
}

static void ddp_fill_canary(void *p, td_dtype dt, size_t n) {
    size_t es;
    uint32_t bits = ddp_canary(dt, &es);
    uint16_t half = (uint16_t)bits;
    for (size_t i = 0; i < n; i++)
        memcpy((unsigned char *)p + i * es, es == 2 ? (void *)&half : (void *)&bits, es);
}

void td__ddp_move_gradient(td_ddp *d, size_t i, void *dst) {
    void *old = d->params[i].grad;
    if (old) {
        memcpy(dst, old, d->params[i].count * td_dtype_size(d->params[i].dtype));
        ddp_fill_canary(old, d->params[i].dtype, d->params[i].count);
    }
    d->moved_from[i] = old;
    d->params[i].grad = dst;
    d->moved = 1;
}

td_status td__ddp_check_moved(td_ddp *d) {
    td_status s = TD_OK;
    if (!d->moved) return TD_OK;
    d->moved = 0;
    for (size_t i = 0; i < d->n_params && s == TD_OK; i++) {
        const unsigned char *p = d->moved_from[i];
        size_t es;
        uint32_t bits = ddp_canary(d->params[i].dtype, &es);
        uint16_t half = (uint16_t)bits;
        const void *want = es == 2 ? (const void *)&half : (const void *)&bits;
        for (size_t k = 0; p && k < d->params[i].count; k++)
            if (memcmp(p + k * es, want, es) != 0) {
                s = td__fail(TD_ESTATE,
                             "ddp rank %d: the gradient of '%s' was written at its old address "
                             "%p after DDP moved it to %p: re-read params[%zu].grad after "
                             "td_ddp_create and after each synchronised step",
                             d->rank, d->params[i].name, (const void *)p, d->params[i].grad, i);
                break;
            }
    }
    memset(d->moved_from, 0, d->n_params * sizeof *d->moved_from);
    td_comm_free(d->comm, d->moved_mem);
    d->moved_mem = NULL;
    return s;
}

/* Bytes of a bucket's (count + DDP_SLOTS) elements of dtype, rounded up to 64. */
static size_t ddp_span(size_t count, td_dtype dt) {
    return ((count + DDP_SLOTS) * td_dtype_size(dt) + 63) / 64 * 64;
}

/* The dtype a bucket of `dt` travels in: comm_dtype for f32 gradients (half-width
 * communication), the gradients' own otherwise. */
static td_dtype ddp_wire_dtype(const td_ddp *d, td_dtype dt) {
    return dt == TD_F32 ? d->opt.comm_dtype : dt;
}

td_status td__ddp_plan_buckets(td_ddp *d, const size_t *order, ddp_bucket **buckets,
                               size_t *n_buckets, size_t **bucket_of_out, size_t **offset_of_out) {
    size_t n = d->n_params;
    size_t *bucket_of = malloc((n ? n : 1) * sizeof *bucket_of);
    size_t *offset_of = malloc((n ? n : 1) * sizeof *offset_of);
    ddp_bucket *nb = calloc(n ? n : 1, sizeof *nb);
    if (!bucket_of || !offset_of || !nb) goto oom;
    size_t k = 0, fill = 0;
    for (size_t j = 0; j < n; j++) {
        size_t i = order[j];
        td_dtype dt = d->params[i].dtype;
        size_t es = td_dtype_size(dt), align = DDP_ALIGN_BYTES / es;
        size_t off = (fill + align - 1) / align * align;
        bucket_of[i] = k;
        offset_of[i] = off;
        fill = off + d->params[i].count;
        nb[k].dtype = dt;
        nb[k].n_members++;
        size_t cap = k == 0 ? d->opt.first_bucket_bytes : d->opt.bucket_bytes;
        if (fill * es >= cap || j + 1 == n || d->params[order[j + 1]].dtype != dt) {
            nb[k].count = fill;
            k++;
            fill = 0;
        }
    }
    for (size_t m = 0; m < k; m++) {
        nb[m].members = malloc(nb[m].n_members * sizeof(size_t));
        if (!nb[m].members) goto oom;
        nb[m].n_members = 0;
    }
    for (size_t j = 0; j < n; j++) {
        ddp_bucket *b = &nb[bucket_of[order[j]]];
        b->members[b->n_members++] = order[j];
    }
    for (size_t m = 0; m < k; m++) nb[m].pending = nb[m].n_members;
    *buckets = nb;
    *n_buckets = k;
    *bucket_of_out = bucket_of;
    *offset_of_out = offset_of;
    return TD_OK;
oom:
    if (nb) td__ddp_free_buckets(nb, n);
    free(bucket_of);
    free(offset_of);
    return td__fail(TD_ENOMEM, "ddp rank %d: out of memory laying out gradient buckets", d->rank);
}

/* Lays the parameters out in `order`, copies the current gradients in and re-points
 * params[i].grad; what the gradients left holds NaN (see td__ddp_check_moved). All buckets, and
 * their half-width copies when gradients travel narrower, live in one td_comm_alloc block, so
 * this is collective: every rank builds at creation and at the one rebuild, which every rank
 * decides alike (from all-reduced counts). */
static td_status ddp_build_buckets(td_ddp *d, const size_t *order) {
    ddp_bucket *nb;
    size_t n_buckets, *bucket_of, *offset_of;
    TD__TRY(td__ddp_plan_buckets(d, order, &nb, &n_buckets, &bucket_of, &offset_of));
    size_t total = 0;
    for (size_t k = 0; k < n_buckets; k++) {
        td_dtype wire = ddp_wire_dtype(d, nb[k].dtype);
        total += ddp_span(nb[k].count, nb[k].dtype);
        if (wire != nb[k].dtype) total += ddp_span(nb[k].count, wire);
    }
    void *mem = NULL;
    if (n_buckets) {
        td_status s = td_comm_alloc(d->comm, total, &mem);
        if (s != TD_OK) {
            td__ddp_free_buckets(nb, n_buckets);
            free(bucket_of);
            free(offset_of);
            return s;
        }
        memset(mem, 0, total);
    }
    total = 0;
    for (size_t k = 0; k < n_buckets; k++) {
        td_dtype wire = ddp_wire_dtype(d, nb[k].dtype);
        nb[k].buf = (unsigned char *)mem + total;
        total += ddp_span(nb[k].count, nb[k].dtype);
        if (wire != nb[k].dtype) {
            nb[k].wire = (unsigned char *)mem + total;
            total += ddp_span(nb[k].count, wire);
        }
    }
    for (size_t i = 0; i < d->n_params; i++) {
        ddp_bucket *b = &nb[bucket_of[i]];
        td__ddp_move_gradient(d, i,
                              (unsigned char *)b->buf + offset_of[i] * td_dtype_size(b->dtype));
    }
    td__ddp_free_buckets(d->buckets, d->n_buckets);
    d->moved_mem = d->grad_mem; /* NULL at creation: the trainer's own memory stays its own */
    free(d->bucket_of);
    free(d->offset_of);
    d->grad_mem = mem;
    d->buckets = nb;
    d->n_buckets = n_buckets;
    d->bucket_of = bucket_of;
    d->offset_of = offset_of;
    d->stats.n_buckets = n_buckets;
    return TD_OK;
}

/* ---- creation ---------------------------------------------------------------------- */

td_status td_ddp_create(td_ddp **out, td_comm *comm, td_param *params, size_t n_params,
                        td_param *buffers, size_t n_buffers, const td_ddp_params *p) {
    if (!out || !comm || (n_params && !params) || (n_buffers && !buffers))
        return td__fail(TD_EINVAL, "td_ddp_create: out, comm, params or buffers is NULL");
    *out = NULL;
    td_ddp *d = calloc(1, sizeof *d);
    if (!d) return td__fail(TD_ENOMEM, "td_ddp_create: out of memory");
    d->comm = comm;
    d->rank = td_comm_rank(comm);
    d->size = td_comm_size(comm);
    d->params = params;
    d->n_params = n_params;
    d->buffers = buffers;
    d->n_buffers = n_buffers;
    if (p)
        d->opt = *p;
    else
        d->opt = td_ddp_default_params();
    if (!td__is_float(d->opt.comm_dtype)) {
        td_dtype bad = d->opt.comm_dtype;
        free(d);
        return td__fail(TD_EINVAL, "td_ddp_create: comm_dtype %s, expected f32, bf16 or f16",
                        td_dtype_name(bad));
    }
    d->sync = 1;
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

    td_status s = ddp_check_registration(d);
    if (s == TD_OK) s = td__ddp_broadcast_tensors(d, params, n_params, 0);
    if (s == TD_OK) s = td__ddp_broadcast_tensors(d, buffers, n_buffers, 0);
    if (s == TD_OK) {
        /* Reverse registration order: the last layers' gradients are ready first. */
        for (size_t i = 0; i < n_params; i++) d->order[i] = n_params - 1 - i;
        s = d->opt.deterministic ? td__ddp_tree_create(d) : ddp_build_buckets(d, d->order);
    }
    if (s == TD_OK && d->opt.join) s = td__ddp_join_create(d);
    if (s != TD_OK) {
        char msg[768];
        snprintf(msg, sizeof msg, "%s", td_last_error());
        td_ddp_destroy(d);
        return td__fail(s, "%s", msg);
    }
    td__log(TD_LOG_INFO, "ddp rank %d/%d: %zu parameters, %zu buffers, %zu buckets", d->rank,
            d->size, n_params, n_buffers, d->n_buckets);
    *out = d;
    return TD_OK;
}

/* ---- one backward ------------------------------------------------------------------ */

/* A bucket's all-reduce is over: its span ends, and narrow gradients widen back. */
static void ddp_done(td_ddp *d, size_t k, td_status s) {
    ddp_bucket *b = &d->buckets[k];
    b->req = NULL;
    if (b->wire && s == TD_OK)
        td__convert(b->buf, b->dtype, b->wire, d->opt.comm_dtype, b->count + DDP_SLOTS);
    if (d->opt.trace) {
        char name[80];
        snprintf(name, sizeof name, "allreduce bucket %zu (%zu bytes %s)", k,
                 b->count * td_dtype_size(ddp_wire_dtype(d, b->dtype)),
                 td_dtype_name(ddp_wire_dtype(d, b->dtype)));
        (void)td_trace_span_on(d->opt.trace, name, "ddp", DDP_TRACE_TID_BASE + (int)k, b->t_launch,
                               td_time_ns());
    }
    td__ddp_note_error(d, s);
}

static void ddp_launch(td_ddp *d, size_t k, float unready) {
    ddp_bucket *b = &d->buckets[k];
    /* Uneven inputs: this rank's share of the step's samples weights its gradients and loss. */
    float weight = d->join && !d->join->uniform ? d->join->weight : 1.0f;
    if (weight != 1.0f)
        for (size_t e = 0; e < b->count; e++)
            td__store(b->buf, b->dtype, e, td__load(b->buf, b->dtype, e) * weight);
    td__store(b->buf, b->dtype, b->count, unready);
    td__store(b->buf, b->dtype, b->count + 1, k + 1 == d->n_buckets ? d->loss * weight : 0.0f);
    b->t_launch = td_time_ns();
    /* Half-width communication: the bucket travels narrow and the reduction adds in f32. */
    void *data = b->buf;
    if (b->wire) {
        td__convert(b->wire, d->opt.comm_dtype, b->buf, b->dtype, b->count + DDP_SLOTS);
        data = b->wire;
    }
    /* AVG divides inside the reduction, so averaging costs no extra pass over the gradients. */
    td_reduce_op op = d->opt.average ? TD_OP_AVG : TD_OP_SUM;
    td_status s = td_comm_iallreduce(d->comm, data, data, b->count + DDP_SLOTS,
                                     ddp_wire_dtype(d, b->dtype), op, &b->req);
    if (s != TD_OK) {
        b->req = NULL;
        td__ddp_note_error(d, s);
    }
}

/* Notices finished all-reduces, so their trace spans end close to the real completion. */
static void ddp_poll(td_ddp *d) {
    for (size_t k = 0; k < d->next_bucket; k++) {
        ddp_bucket *b = &d->buckets[k];
        if (!b->req) continue;
        int done = 0;
        td_status s = td_request_test(b->req, &done);
        if (!done && s == TD_OK) break; /* they complete in launch order */
        ddp_done(d, k, s);
    }
}

static void ddp_wait_all(td_ddp *d) {
    for (size_t k = 0; k < d->n_buckets; k++) {
        ddp_bucket *b = &d->buckets[k];
        if (!b->req) continue;
        ddp_done(d, k, td_request_wait(b->req));
    }
}

static void ddp_reset_iteration(td_ddp *d) {
    memset(d->ready, 0, d->n_params ? d->n_params : 1);
    memset(d->touched, 0, d->n_params ? d->n_params : 1);
    for (size_t k = 0; k < d->n_buckets; k++) d->buckets[k].pending = d->buckets[k].n_members;
    d->next_bucket = 0;
    d->n_ready = 0;
    d->n_order = 0;
    d->err = TD_OK;
    d->err_msg[0] = 0;
    d->open = 0;
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
    if (d->tree) {
        td__ddp_note_error(d, td__ddp_tree_grad_ready(d, i));
        return d->err != TD_OK ? td__fail(d->err, "%s", d->err_msg) : TD_OK;
    }
    if (d->opt.rebuild_buckets && d->stats.rebuilds == 0) d->order[d->n_order++] = i;
    d->buckets[d->bucket_of[i]].pending--;
    /* Launch strictly in bucket order: a complete bucket waits for the ones before it, so
     * every rank queues the same all-reduces in the same order. */
    while (d->next_bucket < d->n_buckets && d->buckets[d->next_bucket].pending == 0) {
        ddp_launch(d, d->next_bucket++, 0.0f);
        d->stats.buckets_early++;
    }
    ddp_poll(d);
    if (d->err != TD_OK) return td__fail(d->err, "%s", d->err_msg);
    return TD_OK;
}

void td_ddp_grad_ready_hook(size_t param_index, void *ddp) {
    if (ddp) td__ddp_note_error(ddp, td_ddp_grad_ready(ddp, param_index));
}

static td_status ddp_rebuild(td_ddp *d) {
    size_t n = d->n_params;
    unsigned char *seen = calloc(n ? n : 1, 1);
    int64_t *order = malloc((n ? n : 1) * sizeof *order);
    if (!seen || !order) {
        free(seen);
        free(order);
        return td__fail(TD_ENOMEM, "ddp rank %d: out of memory rebuilding buckets", d->rank);
    }
    size_t m = 0;
    for (size_t j = 0; j < d->n_order; j++) {
        order[m++] = (int64_t)d->order[j];
        seen[d->order[j]] = 1;
    }
    for (size_t i = n; i-- > 0;)
        if (!seen[i]) order[m++] = (int64_t)i;
    /* Ranks may have seen different orders; rank 0's decides, as the layout must match. */
    td_status s = d->size > 1 ? td_comm_broadcast(d->comm, order, n, TD_I64, 0) : TD_OK;
    if (s == TD_OK) {
        memset(seen, 0, n ? n : 1);
        for (size_t j = 0; j < n; j++) {
            if (order[j] < 0 || (size_t)order[j] >= n || seen[order[j]]) {
                s = td__fail(TD_EFORMAT,
                             "ddp rank %d: rank 0's bucket order is not a permutation at %zu",
                             d->rank, j);
                break;
            }
            seen[order[j]] = 1;
            d->order[j] = (size_t)order[j];
        }
    }
    if (s == TD_OK) s = ddp_build_buckets(d, d->order);
    if (s == TD_OK) d->stats.rebuilds++;
    free(seen);
    free(order);
    return s;
}

td_status td_ddp_finish_backward(td_ddp *d) {
    if (!d) return td__fail(TD_EINVAL, "td_ddp_finish_backward: ddp is NULL");
    if (!d->open)
        return td__fail(TD_ESTATE,
                        "ddp rank %d: td_ddp_finish_backward without a backward since the last "
                        "one (call td_ddp_prepare_forward, run backward, then finish once)",
                        d->rank);
    if (d->tree) return td__ddp_tree_finish(d);
    if (!d->sync) {
        d->open = 0;
        return TD_OK;
    }
    /* Unready parameters go in as zeros (or as what no_sync micro-batches accumulated), and
     * every remaining bucket is launched anyway: all ranks run the same all-reduces even
     * when one of them missed a gradient, so the error below never becomes a hang. */
    size_t n_unready = 0;
    for (size_t i = 0; i < d->n_params; i++) {
        if (d->ready[i]) continue;
        n_unready++;
        if (!d->touched[i])
            memset(d->params[i].grad, 0, d->params[i].count * td_dtype_size(d->params[i].dtype));
    }
    while (d->next_bucket < d->n_buckets) {
        size_t k = d->next_bucket++;
        ddp_launch(d, k, k + 1 == d->n_buckets ? (float)n_unready : 0.0f);
    }
    ddp_wait_all(d);
    if (d->err == TD_OK) td__ddp_note_error(d, td__ddp_check_moved(d));
    if (d->err != TD_OK) {
        td_status s = d->err;
        char msg[768];
        snprintf(msg, sizeof msg, "%s", d->err_msg);
        ddp_reset_iteration(d);
        return td__fail(s, "%s", msg);
    }
    /* The last bucket is always launched last, so its slot holds every rank's count (their
     * mean when averaging). */
    const ddp_bucket *last = d->n_buckets ? &d->buckets[d->n_buckets - 1] : NULL;
    double unready_all = last ? td__load(last->buf, last->dtype, last->count) : 0;
    if (d->opt.average) unready_all *= d->size;
    d->loss_all = last ? td__load(last->buf, last->dtype, last->count + 1) : 0.0f;
    d->stats.sync_steps++;
    td_status s = TD_OK;
    if (unready_all > 0.5 && !d->opt.find_unused_parameters) {
        char names[512];
        size_t len = 0, listed = 0;
        names[0] = 0;
        for (size_t i = 0; i < d->n_params && len < sizeof names; i++) {
            if (d->ready[i]) continue;
            if (listed == DDP_UNUSED_NAMES) {
                len += (size_t)snprintf(names + len, sizeof names - len, ", ... (%zu in all)",
                                        n_unready);
                break;
            }
            len += (size_t)snprintf(names + len, sizeof names - len, "%s'%s'", listed ? ", " : "",
                                    d->params[i].name);
            listed++;
        }
        if (n_unready)
            s = td__fail(
                TD_EUNUSED,
                "ddp rank %d: %zu parameter(s) received no gradient (no td_ddp_grad_ready) in this "
                "backward: %s; set find_unused_parameters = 1 if parts of the model are unused in "
                "some "
                "iterations",
                d->rank, n_unready, names);
        else
            s = td__fail(TD_EUNUSED,
                         "ddp rank %d: %.0f parameter(s) on other ranks received no gradient in "
                         "this backward (their "
                         "errors name them); set find_unused_parameters = 1 if parts of the model "
                         "are unused in some "
                         "iterations",
                         d->rank, unready_all);
    } else if (d->opt.rebuild_buckets && d->stats.rebuilds == 0) {
        s = ddp_rebuild(d);
    }
    ddp_reset_iteration(d);
    return s;
}

/* ---- iteration control ------------------------------------------------------------- */

td_status td_ddp_prepare_forward(td_ddp *d) {
    if (!d) return td__fail(TD_EINVAL, "td_ddp_prepare_forward: ddp is NULL");
    if (d->sync && (d->n_ready > 0 || d->next_bucket > 0))
        return td__fail(
            TD_ESTATE,
            "ddp rank %d: the previous backward was not ended with td_ddp_finish_backward",
            d->rank);
    if (d->tree) return td__ddp_tree_prepare(d);
    d->open = 1;
    if (!d->sync) return TD_OK;
    int root = 0;
    if (d->join) {
        TD__TRY(td__ddp_join_prepare(d, d->join->samples));
        root = d->join->authority;
    }
    if (!d->opt.broadcast_buffers) return TD_OK;
    return td__ddp_broadcast_tensors(d, d->buffers, d->n_buffers, root);
}

void td_ddp_zero_grad(td_ddp *d) {
    if (!d) return;
    if (d->tree) {
        td__ddp_tree_zero_grad(d);
        return;
    }
    for (size_t k = 0; k < d->n_buckets; k++)
        memset(d->buckets[k].buf, 0, d->buckets[k].count * td_dtype_size(d->buckets[k].dtype));
}

td_status td_ddp_set_sync(td_ddp *d, int sync) {
    if (!d) return td__fail(TD_EINVAL, "td_ddp_set_sync: ddp is NULL");
    if (d->sync && (d->n_ready > 0 || d->next_bucket > 0))
        return td__fail(TD_ESTATE, "ddp rank %d: td_ddp_set_sync in the middle of a backward",
                        d->rank);
    if (d->tree && !sync)
        return td__fail(TD_EUNSUPPORTED,
                        "ddp rank %d: no_sync in deterministic mode: its shards already are the "
                        "accumulated micro-batches; make the global batch larger instead",
                        d->rank);
    d->sync = sync != 0;
    return TD_OK;
}

void td_ddp_set_loss(td_ddp *d, float loss) {
    if (d) d->loss = loss;
}

float td_ddp_loss(const td_ddp *d) { return d ? d->loss_all : 0.0f; }

void td_ddp_shards(const td_ddp *d, size_t *first, size_t *count) {
    *first = d && d->tree ? (size_t)d->rank * d->tree->local : 0;
    *count = d && d->tree ? d->tree->local : 1;
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

void td_ddp_destroy(td_ddp *d) {
    if (!d) return;
    if (d->buckets) {
        ddp_wait_all(d);
        td__ddp_tree_wait(d);
        for (size_t i = 0; i < d->n_params; i++) {
            void *orig = d->orig_grad[i];
            if (orig && d->params[i].grad)
                memcpy(orig, d->params[i].grad,
                       d->params[i].count * td_dtype_size(d->params[i].dtype));
            d->params[i].grad = orig;
        }
    }
    td__ddp_tree_destroy(d);
    td__ddp_join_destroy(d);
    td__ddp_free_buckets(d->buckets, d->n_buckets);
    td_comm_free(d->comm, d->grad_mem);
    td_comm_free(d->comm, d->moved_mem);
    free(d->moved_from);
    free(d->bucket_of);
    free(d->offset_of);
    free(d->orig_grad);
    free(d->ready);
    free(d->touched);
    free(d->order);
    free(d);
}
