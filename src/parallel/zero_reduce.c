/* ZeRO's gradient reducer (stages 2 and 3), a td_ddp reducer (reducer.h): one bucket per flat of
 * ZeRO's layout (zero_impl.h, the front's reducer_ctx), last unit first, each reduce-scattered on
 * the progress thread into the rank's gradient shard as soon as its gradients are final. Where a
 * synchronised backward writes the whole gradients (the ring of slots reused as backward moves
 * through the model, or a flat's home in the gradient region) is in docs/zero.md ("How it is laid
 * out", Gradients); here are the slots' bookkeeping, the half-width copies of f32 flats when
 * comm_dtype is narrower, and the loss and unused-parameter count all-reduced once at the end (the
 * shards cannot carry them to every rank). It knows nothing of graphs and does not step the
 * optimizer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "parallel/zero_impl.h"

#define RS_TRACE_TID_BASE 0x7e000000 /* one trace track per bucket, apart from DDP's */

typedef struct {
    td__zero_layout *lay;
    td__zero_region grads;    /* every flat's home: its whole gradient at the flat's `at` */
    td__zero_region ring;     /* the slots, resident: bucket k's at slot_at[k] */
    td__zero_region wire;     /* half-width copies, at the flats' `at`, or none */
    unsigned char *shards;    /* every flat's gradient shard, back to back */
    size_t next;              /* buckets [0, next) are launched */
    unsigned char *live;      /* (n_flats) its whole gradient at home is counted as held */
    size_t *slot_at;          /* (n_buckets) bucket k's slot in the ring */
    size_t *after;            /* (n_buckets) bucket k's slot is free once buckets [0, after[k]) are
                                 done: the last earlier bucket whose slot overlaps it, plus one */
    unsigned char *in_slot;   /* (n_buckets) this backward writes bucket k in its slot */
    unsigned char *decided;   /* (n_buckets) slot or home is settled for this backward */
    unsigned char *home_held; /* (n_buckets) its home holds gradients not yet reduced */
    int zero_slots;           /* td_zero_zero_grad since the last backward: slots start at 0 */
    int ring_counted;         /* the ring's bytes are counted as held */
} rs_state;

/* Bucket k holds flat n_flats - 1 - k: the last unit's gradients are ready first. */
static td__zero_flat *flat_of_bucket(const td_ddp *d, size_t k) {
    const rs_state *st = d->state;
    return &st->lay->flats[st->lay->n_flats - 1 - k];
}

static td_dtype wire_dtype(const td_ddp *d, const td__zero_flat *f) {
    return f->dtype == TD_F32 ? d->opt.comm_dtype : f->dtype;
}

static td_status rs_check(const td_ddp *d) {
    if (d->opt.join)
        return td__fail(TD_EINVAL,
                        "zero rank %d: join (uneven inputs) is not supported with "
                        "sharded gradients",
                        d->rank);
    for (size_t i = 0; i < d->n_params; i++)
        if (d->params[i].device.type != TD_DEVICE_CPU)
            return td__fail(TD_EUNSUPPORTED,
                            "zero rank %d: parameter '%s' lives on a device; ZeRO shards host "
                            "memory only",
                            d->rank, d->params[i].name);
    return TD_OK;
}

/* The ring's bytes, and each bucket's slot in it: buckets in order, wrapping to the start when
 * the next one does not fit, each waiting for the last earlier one it overlaps. max(bucket_bytes,
 * two of the largest flats), and never more than every flat's home together (then no two slots
 * overlap). */
static size_t plan_ring(td_ddp *d) {
    rs_state *st = d->state;
    size_t nb = st->lay->n_flats, largest = 0, total = 0;
    for (size_t k = 0; k < nb; k++) {
        size_t span = flat_of_bucket(d, k)->span;
        largest = span > largest ? span : largest;
        total += span;
    }
    size_t cap = td__zero_pages(d->opt.bucket_bytes);
    if (cap < 2 * largest) cap = 2 * largest;
    if (cap > total) cap = total;
    size_t pos = 0;
    for (size_t k = 0; k < nb; k++) {
        size_t span = flat_of_bucket(d, k)->span;
        if (pos + span > cap) pos = 0;
        st->slot_at[k] = pos;
        pos += span;
        st->after[k] = 0;
        for (size_t j = 0; j < k; j++) {
            size_t a = st->slot_at[j], b = a + flat_of_bucket(d, j)->span;
            if (a < st->slot_at[k] + span && st->slot_at[k] < b) st->after[k] = j + 1;
        }
    }
    return cap;
}

static td_status rs_create(td_ddp *d) {
    td__zero_layout *lay = d->reducer_ctx;
    rs_state *st = calloc(1, sizeof *st);
    if (!st) return td__fail(TD_ENOMEM, "zero rank %d: out of memory", d->rank);
    d->state = st;
    st->lay = lay;
    size_t nf = lay->n_flats, n = d->n_params ? d->n_params : 1, shard_bytes = 0;
    int narrow = 0;
    for (size_t f = 0; f < nf; f++) {
        shard_bytes += (lay->flats[f].chunk * td_dtype_size(lay->flats[f].dtype) + 63) / 64 * 64;
        narrow |= wire_dtype(d, &lay->flats[f]) != lay->flats[f].dtype;
    }
    size_t m = nf ? nf : 1;
    st->live = calloc(m, 1);
    st->in_slot = calloc(m, 1);
    st->decided = calloc(m, 1);
    st->home_held = calloc(m, 1);
    st->slot_at = calloc(m, sizeof *st->slot_at);
    st->after = calloc(m, sizeof *st->after);
    st->shards = aligned_alloc(64, shard_bytes ? shard_bytes : 64);
    d->buckets = calloc(m, sizeof *d->buckets);
    d->bucket_of = calloc(n, sizeof *d->bucket_of);
    d->offset_of = calloc(n, sizeof *d->offset_of);
    if (!st->live || !st->in_slot || !st->decided || !st->home_held || !st->slot_at || !st->after ||
        !st->shards || !d->buckets || !d->bucket_of || !d->offset_of)
        return td__fail(TD_ENOMEM, "zero rank %d: out of memory", d->rank);
    memset(st->shards, 0, shard_bytes);
    st->zero_slots = 1; /* the first backward starts at zeros, as the trainer's gradients did */
    TD__TRY(td__zero_region_alloc(&st->grads, d->comm, lay->region_bytes, d->rank, "gradients"));
    TD__TRY(td__zero_region_alloc(&st->ring, d->comm, plan_ring(d), d->rank, "the gradient ring"));
    if (narrow)
        TD__TRY(td__zero_region_alloc(&st->wire, d->comm, lay->region_bytes, d->rank,
                                      "half-width gradients"));
    d->n_buckets = nf;
    unsigned char *shard = st->shards;
    for (size_t k = 0; k < nf; k++) {
        td__zero_flat *f = flat_of_bucket(d, k);
        ddp_bucket *b = &d->buckets[k];
        b->buf = st->grads.base + f->at;
        b->dtype = f->dtype;
        b->count = f->count;
        b->n_members = b->pending = f->n_members;
        b->members = malloc(f->n_members * sizeof *b->members);
        if (!b->members) return td__fail(TD_ENOMEM, "zero rank %d: out of memory", d->rank);
        memcpy(b->members, f->members, f->n_members * sizeof *b->members);
        size_t es = td_dtype_size(f->dtype);
        for (size_t m = 0; m < f->n_members; m++) {
            size_t i = f->members[m];
            d->bucket_of[i] = k;
            d->offset_of[i] = f->offset[m];
            td__ddp_move_gradient(d, i, (unsigned char *)b->buf + f->offset[m] * es);
        }
        f->grad_shard = shard;
        shard += (f->chunk * es + 63) / 64 * 64;
        td__zero_account_add(&lay->acct, ZERO_GRADS, (long long)(f->chunk * es));
    }
    /* Gradients the trainer had are at home now: the first backward adds to them there. Zeros
     * need no pages. */
    for (size_t k = 0; k < nf; k++) {
        const td__zero_flat *f = flat_of_bucket(d, k);
        const unsigned char *g = st->grads.base + f->at;
        size_t bytes = f->count * td_dtype_size(f->dtype), e = 0;
        while (e < bytes && !g[e]) e++;
        if (e == bytes)
            td__zero_release(st->grads.base + f->at, f->span);
        else
            st->home_held[k] = 1;
    }
    return TD_OK;
}

/* Points bucket k's members' gradients, and the bucket, at `base` (its slot or its home). */
static void point_bucket(td_ddp *d, size_t k, unsigned char *base) {
    const td__zero_flat *f = flat_of_bucket(d, k);
    size_t es = td_dtype_size(f->dtype);
    d->buckets[k].buf = base;
    for (size_t m = 0; m < f->n_members; m++)
        d->params[f->members[m]].grad = base + f->offset[m] * es;
}

/* The whole gradient of bucket k is counted as held from its first final gradient on. */
static void rs_hold(td_ddp *d, size_t k) {
    rs_state *st = d->state;
    size_t f = st->lay->n_flats - 1 - k;
    if (st->live[f] || st->in_slot[k]) return;
    st->live[f] = 1;
    td__zero_account_add(&st->lay->acct, ZERO_REDUCING, (long long)st->lay->flats[f].span);
}

/* Bucket k's reduce-scatter is over: the shard takes its chunk and the whole gradient goes. */
static void rs_done(td_ddp *d, size_t k, td_status s) {
    rs_state *st = d->state;
    td__zero_flat *f = flat_of_bucket(d, k);
    ddp_bucket *b = &d->buckets[k];
    td_dtype wire = wire_dtype(d, f);
    if (wire != f->dtype) {
        unsigned char *w = st->wire.base + f->at;
        if (s == TD_OK)
            td__convert(f->grad_shard, f->dtype, w + d->rank * f->chunk * td_dtype_size(wire), wire,
                        f->chunk);
        td__zero_release(w, f->span);
        td__zero_account_add(
            &st->lay->acct, ZERO_REDUCING,
            -(long long)td__zero_pages(f->chunk * (size_t)d->size * td_dtype_size(wire)));
    }
    if (!st->in_slot[k]) { /* home: its pages go back; a slot stays for the next flat */
        td__zero_release(b->buf, f->span);
        st->home_held[k] = 0;
    }
    size_t fi = st->lay->n_flats - 1 - k;
    if (st->live[fi]) {
        st->live[fi] = 0;
        td__zero_account_add(&st->lay->acct, ZERO_REDUCING, -(long long)f->span);
    }
    if (d->opt.trace) {
        char name[96];
        snprintf(name, sizeof name, "reduce_scatter bucket %zu (%zu bytes %s)", k,
                 f->chunk * (size_t)d->size * td_dtype_size(wire), td_dtype_name(wire));
        (void)td_trace_span_on(d->opt.trace, name, "zero", RS_TRACE_TID_BASE + (int)k, b->t_launch,
                               td_time_ns());
    }
    td__ddp_note_error(d, s);
}

static void rs_launch(td_ddp *d, size_t k) {
    rs_state *st = d->state;
    td__zero_flat *f = flat_of_bucket(d, k);
    ddp_bucket *b = &d->buckets[k];
    rs_hold(d, k);
    b->t_launch = td_time_ns();
    td_dtype wire = wire_dtype(d, f);
    size_t padded = f->chunk * (size_t)d->size;
    const void *send = b->buf;
    void *recv = f->grad_shard;
    if (wire != f->dtype) {
        unsigned char *w = st->wire.base + f->at;
        td__convert(w, wire, b->buf, f->dtype, padded);
        td__zero_account_add(&st->lay->acct, ZERO_REDUCING,
                             (long long)td__zero_pages(padded * td_dtype_size(wire)));
        send = w;
        recv = w + (size_t)d->rank * f->chunk * td_dtype_size(wire); /* in place */
    }
    td_reduce_op op = d->opt.average ? TD_OP_AVG : TD_OP_SUM;
    td_comm_tag(d->comm, "zero reduce-scatter bucket %zu", k);
    td__ddp_bucket_started(
        d, k, td_comm_ireduce_scatter(d->comm, send, recv, f->chunk, wire, op, &b->req));
}

static void rs_wait(td_ddp *d) {
    if (d->state) td__ddp_complete_buckets(d, d->n_buckets, 1, rs_done);
}

static void rs_before_backward(td_ddp *d, size_t i) {
    rs_state *st = d->state;
    size_t k = d->bucket_of[i];
    if (st->decided[k]) return;
    st->decided[k] = 1;
    const td__zero_flat *f = flat_of_bucket(d, k);
    int home = st->home_held[k];
    for (size_t m = 0; m < f->n_members && !home; m++) home = d->touched[f->members[m]];
    /* The slot's earlier tenant must be launched to be waited for; a backward that reaches
     * this flat first (another order than the buckets') writes it at home. */
    if (home || st->after[k] > st->next) return;
    td__ddp_complete_buckets(d, st->after[k], 1, rs_done);
    unsigned char *slot = st->ring.base + st->slot_at[k];
    size_t es = td_dtype_size(f->dtype), bytes = f->chunk * (size_t)d->size * es;
    /* A trainer that adds into its gradients asked for zeros; padding is zero either way. */
    if (st->zero_slots)
        memset(slot, 0, bytes);
    else
        for (size_t m = 0; m <= f->n_members; m++) {
            size_t lo = m ? f->offset[m - 1] + d->params[f->members[m - 1]].count : 0;
            size_t hi = m < f->n_members ? f->offset[m] : bytes / es;
            if (hi > lo) memset(slot + lo * es, 0, (hi - lo) * es);
        }
    st->in_slot[k] = 1;
    point_bucket(d, k, slot);
    if (!st->ring_counted) {
        st->ring_counted = 1;
        td__zero_account_add(&st->lay->acct, ZERO_CACHED, (long long)st->ring.bytes);
    }
}

static void rs_grad_ready(td_ddp *d, size_t i) {
    rs_state *st = d->state;
    size_t k = d->bucket_of[i];
    rs_hold(d, k);
    d->buckets[k].pending--;
    td__ddp_launch_ready(d, &st->next, d->n_buckets, rs_launch);
    td__ddp_complete_buckets(d, st->next, 0, rs_done);
}

/* Ready for the next backward: gradients point home again (what the slots hold is no one's). */
static void rs_reset(td_ddp *d) {
    rs_state *st = d->state;
    for (size_t k = 0; k < d->n_buckets; k++) {
        d->buckets[k].pending = d->buckets[k].n_members;
        if (st->in_slot[k]) point_bucket(d, k, st->grads.base + flat_of_bucket(d, k)->at);
        st->in_slot[k] = st->decided[k] = 0;
    }
    st->next = 0;
    st->zero_slots = 0;
    td__ddp_end_iteration(d);
}

static td_status rs_finish(td_ddp *d) {
    rs_state *st = d->state;
    size_t n_unready = 0;
    for (size_t i = 0; i < d->n_params; i++) {
        if (d->ready[i]) continue;
        n_unready++;
        if (!d->touched[i])
            memset(d->params[i].grad, 0, d->params[i].count * td_dtype_size(d->params[i].dtype));
    }
    while (st->next < d->n_buckets) rs_launch(d, st->next++);
    rs_wait(d);
    if (d->err == TD_OK) td__ddp_note_error(d, td__ddp_check_moved(d));
    /* Every rank reaches this all-reduce, whatever went wrong before, so none waits for it. */
    float slots[DDP_SLOTS] = {(float)n_unready, d->loss};
    td_status s = td_comm_allreduce(d->comm, slots, slots, DDP_SLOTS, TD_F32,
                                    d->opt.average ? TD_OP_AVG : TD_OP_SUM);
    td__ddp_note_error(d, s);
    if (d->err != TD_OK) {
        s = td__ddp_take_error(d);
        rs_reset(d);
        return s;
    }
    double unready_all = slots[0];
    if (d->opt.average) unready_all *= d->size;
    d->loss_all = slots[1];
    d->stats.sync_steps++;
    s = TD_OK;
    if (unready_all > 0.5 && !d->opt.find_unused_parameters)
        s = td__ddp_unused_error(d, n_unready, unready_all);
    rs_reset(d);
    return s;
}

static void rs_zero_grad(td_ddp *d) {
    rs_state *st = d->state;
    if (st->grads.base) td__zero_release(st->grads.base, st->grads.bytes);
    memset(st->home_held, 0, d->n_buckets ? d->n_buckets : 1);
    st->zero_slots = 1;
}

static void rs_destroy(td_ddp *d) {
    rs_state *st = d->state;
    if (!st) return;
    for (size_t f = 0; st->lay && f < st->lay->n_flats; f++) st->lay->flats[f].grad_shard = NULL;
    td__zero_region_free(&st->grads);
    td__zero_region_free(&st->ring);
    td__zero_region_free(&st->wire);
    free(st->shards);
    free(st->live);
    free(st->in_slot);
    free(st->decided);
    free(st->home_held);
    free(st->slot_at);
    free(st->after);
    free(st);
    d->state = NULL;
}

const td__ddp_reducer td__ddp_reduce_scatter = {
    .name = "reduce-scatter",
    .check = rs_check,
    .create = rs_create,
    .prepare = td__ddp_sync_buffers,
    .grad_ready = rs_grad_ready,
    .finish = rs_finish,
    .zero_grad = rs_zero_grad,
    .before_backward = rs_before_backward,
    .wait = rs_wait,
    .destroy = rs_destroy,
};
