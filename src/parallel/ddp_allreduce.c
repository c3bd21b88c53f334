/* td_ddp's default reducer: gradients in flat buckets, each all-reduced on the comm's progress
 * thread as soon as its parameters are all ready, while backward goes on. Buckets are launched
 * in bucket order on every rank, whatever order the gradients arrive in, so ranks always issue
 * the same collectives; the step waits for the last bucket. All buckets live in one
 * td_comm_alloc block, so the all-reduces run in place without staging copies; f32 gradients
 * may travel in half width (comm_dtype) and widen back when their bucket is done. After the
 * first synchronised step the buckets are rebuilt once in the order gradients became ready.
 *
 * Every bucket carries DDP_SLOTS extra elements reduced with it: the number of parameters no
 * backward reached (in the last bucket, so every rank learns whether any rank missed one) and
 * the step's loss (in the last bucket too, which td_ddp_finish_backward launches, so the loss
 * may be set until then; in an all-reduce of its own when that bucket travels narrower than f32).
 * It knows nothing of graphs and does not step the optimizer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "parallel/ddp_impl.h"

#define DDP_TRACE_TID_BASE 0x7f000000 /* one trace track per bucket, apart from threads */

typedef struct {
    void *grad_mem;     /* every bucket's buf and wire, from td_comm_alloc */
    size_t next_bucket; /* buckets [0, next_bucket) are launched */
    float unready;      /* what the last bucket carries: parameters no backward reached */
    size_t *seen;       /* (n_params) the ready order of the first synchronised backward */
    size_t n_seen;
} ar_state;

/* Bytes of a bucket's (count + DDP_SLOTS) elements of dtype, rounded up to 64. */
static size_t ddp_span(size_t count, td_dtype dt) {
    return ((count + DDP_SLOTS) * td_dtype_size(dt) + 63) / 64 * 64;
}

/* The dtype a bucket of `dt` travels in: comm_dtype for f32 gradients (half-width
 * communication), the gradients' own otherwise. */
static td_dtype ddp_wire_dtype(const td_ddp *d, td_dtype dt) {
    return dt == TD_F32 ? d->opt.comm_dtype : dt;
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
        td_status s = td__ddp_mem_alloc(d, total, &mem);
        if (s != TD_OK) {
            td__ddp_free_buckets(nb, n_buckets);
            free(bucket_of);
            free(offset_of);
            return s;
        }
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
    ar_state *st = d->state;
    td__ddp_free_buckets(d->buckets, d->n_buckets);
    d->moved_mem = st->grad_mem; /* NULL at creation: the trainer's own memory stays its own */
    free(d->bucket_of);
    free(d->offset_of);
    st->grad_mem = mem;
    d->buckets = nb;
    d->n_buckets = n_buckets;
    d->bucket_of = bucket_of;
    d->offset_of = offset_of;
    d->stats.n_buckets = n_buckets;
    return TD_OK;
}

/* A bucket's all-reduce is over: its span ends, and narrow gradients widen back. */
static void ddp_done(td_ddp *d, size_t k, td_status s) {
    ddp_bucket *b = &d->buckets[k];
    if (b->wire && s == TD_OK)
        s = td__ddp_mem_convert(d, b->buf, b->dtype, b->wire, d->opt.comm_dtype,
                                b->count + DDP_SLOTS);
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

/* Uneven inputs: this rank's share of the step's samples weights its gradients and loss. */
static float ddp_weight(const td_ddp *d) {
    return d->join && !d->join->uniform ? d->join->weight : 1.0f;
}

/* Whether the loss rides in the last bucket: only where that travels in f32, as half width would
 * round it to three digits; otherwise it has an all-reduce of its own in ar_finish. */
static int ddp_loss_in_bucket(const td_ddp *d) {
    return d->n_buckets && ddp_wire_dtype(d, d->buckets[d->n_buckets - 1].dtype) == TD_F32;
}

static void ddp_launch(td_ddp *d, size_t k) {
    ar_state *st = d->state;
    ddp_bucket *b = &d->buckets[k];
    float weight = ddp_weight(d);
    if (weight != 1.0f)
        td__ddp_note_error(d, td__ddp_mem_scale(d, b->buf, b->dtype, b->count, weight));
    int last = k + 1 == d->n_buckets, loss = last && ddp_loss_in_bucket(d);
    td__ddp_note_error(d, td__ddp_mem_put(d, b->buf, b->dtype, b->count, last ? st->unready : 0));
    td__ddp_note_error(
        d, td__ddp_mem_put(d, b->buf, b->dtype, b->count + 1, loss ? d->loss * weight : 0.0f));
    b->t_launch = td_time_ns();
    /* Half-width communication: the bucket travels narrow and the reduction adds in f32. */
    void *data = b->buf;
    if (b->wire) {
        td__ddp_note_error(d, td__ddp_mem_convert(d, b->wire, d->opt.comm_dtype, b->buf, b->dtype,
                                                  b->count + DDP_SLOTS));
        data = b->wire;
    }
    /* AVG divides inside the reduction, so averaging costs no extra pass over the gradients. */
    td_reduce_op op = d->opt.average ? TD_OP_AVG : TD_OP_SUM;
    td_comm_tag(d->comm, "ddp bucket %zu", k);
    td__ddp_bucket_started(d, k,
                           td_comm_iallreduce(d->comm, data, data, b->count + DDP_SLOTS,
                                              ddp_wire_dtype(d, b->dtype), op, &b->req));
}

static void ar_wait(td_ddp *d) { td__ddp_complete_buckets(d, d->n_buckets, 1, ddp_done); }

/* Ready for the next backward: every bucket waits for all its members again. */
static void ar_reset(td_ddp *d) {
    ar_state *st = d->state;
    for (size_t k = 0; k < d->n_buckets; k++) d->buckets[k].pending = d->buckets[k].n_members;
    st->next_bucket = 0;
    st->unready = 0;
    st->n_seen = 0;
    td__ddp_end_iteration(d);
}

static td_status ar_create(td_ddp *d) {
    ar_state *st = calloc(1, sizeof *st);
    if (st) st->seen = malloc((d->n_params ? d->n_params : 1) * sizeof *st->seen);
    if (!st || !st->seen) {
        free(st);
        return td__fail(TD_ENOMEM, "ddp rank %d: out of memory", d->rank);
    }
    d->state = st;
    return ddp_build_buckets(d, d->order);
}

static void ar_grad_ready(td_ddp *d, size_t i) {
    ar_state *st = d->state;
    if (d->opt.rebuild_buckets && d->stats.rebuilds == 0) st->seen[st->n_seen++] = i;
    d->buckets[d->bucket_of[i]].pending--;
    /* The last bucket waits for td_ddp_finish_backward, as it carries the step's loss, which
     * may be set after backward; its gradients are the first layers', final at the very end of
     * backward anyway. */
    td__ddp_launch_ready(d, &st->next_bucket, d->n_buckets ? d->n_buckets - 1 : 0, ddp_launch);
    td__ddp_complete_buckets(d, st->next_bucket, 0, ddp_done);
}

static td_status ddp_rebuild(td_ddp *d) {
    ar_state *st = d->state;
    size_t n = d->n_params;
    unsigned char *placed = calloc(n ? n : 1, 1);
    int64_t *order = malloc((n ? n : 1) * sizeof *order);
    if (!placed || !order) {
        free(placed);
        free(order);
        return td__fail(TD_ENOMEM, "ddp rank %d: out of memory rebuilding buckets", d->rank);
    }
    size_t m = 0;
    for (size_t j = 0; j < st->n_seen; j++) {
        order[m++] = (int64_t)st->seen[j];
        placed[st->seen[j]] = 1;
    }
    for (size_t i = n; i-- > 0;)
        if (!placed[i]) order[m++] = (int64_t)i;
    /* Ranks may have seen different orders; rank 0's decides, as the layout must match. */
    td_status s = d->size > 1 ? td_comm_broadcast(d->comm, order, n, TD_I64, 0) : TD_OK;
    if (s == TD_OK) {
        memset(placed, 0, n ? n : 1);
        for (size_t j = 0; j < n; j++) {
            if (order[j] < 0 || (size_t)order[j] >= n || placed[order[j]]) {
                s = td__fail(TD_EFORMAT,
                             "ddp rank %d: rank 0's bucket order is not a permutation at %zu",
                             d->rank, j);
                break;
            }
            placed[order[j]] = 1;
            d->order[j] = (size_t)order[j];
        }
    }
    if (s == TD_OK) s = ddp_build_buckets(d, d->order);
    if (s == TD_OK) d->stats.rebuilds++;
    free(placed);
    free(order);
    return s;
}

static td_status ar_finish(td_ddp *d) {
    ar_state *st = d->state;
    /* Unready parameters go in as zeros (or as what no_sync micro-batches accumulated), and
     * every remaining bucket is launched anyway: all ranks run the same all-reduces even
     * when one of them missed a gradient, so the error below never becomes a hang. */
    size_t n_unready = 0;
    for (size_t i = 0; i < d->n_params; i++) {
        if (d->ready[i]) continue;
        n_unready++;
        if (!d->touched[i])
            td__ddp_note_error(
                d, td__ddp_mem_zero(d, d->params[i].grad,
                                    d->params[i].count * td_dtype_size(d->params[i].dtype)));
    }
    st->unready = (float)n_unready;
    while (st->next_bucket < d->n_buckets) ddp_launch(d, st->next_bucket++);
    ar_wait(d);
    /* Every rank takes the same path here (bucket dtypes agree), whatever went wrong before. */
    float loss = d->loss * ddp_weight(d);
    if (!ddp_loss_in_bucket(d))
        td__ddp_note_error(d, td_comm_allreduce(d->comm, &loss, &loss, 1, TD_F32,
                                                d->opt.average ? TD_OP_AVG : TD_OP_SUM));
    if (d->err == TD_OK) td__ddp_note_error(d, td__ddp_check_moved(d));
    if (d->err != TD_OK) {
        td_status s = td__ddp_take_error(d);
        ar_reset(d);
        return s;
    }
    /* The last bucket is always launched last, so its slot holds every rank's count (their
     * mean when averaging). */
    const ddp_bucket *last = d->n_buckets ? &d->buckets[d->n_buckets - 1] : NULL;
    double unready_all = last ? td__ddp_mem_get(d, last->buf, last->dtype, last->count) : 0;
    if (d->opt.average) unready_all *= d->size;
    d->loss_all = ddp_loss_in_bucket(d)
                      ? (float)td__ddp_mem_get(d, last->buf, last->dtype, last->count + 1)
                      : loss;
    d->stats.sync_steps++;
    td_status s = TD_OK;
    if (unready_all > 0.5 && !d->opt.find_unused_parameters)
        s = td__ddp_unused_error(d, n_unready, unready_all);
    else if (d->opt.rebuild_buckets && d->stats.rebuilds == 0)
        s = ddp_rebuild(d);
    ar_reset(d);
    return s;
}

static void ar_zero_grad(td_ddp *d) {
    for (size_t k = 0; k < d->n_buckets; k++)
        td__ddp_note_error(
            d, td__ddp_mem_zero(d, d->buckets[k].buf,
                                d->buckets[k].count * td_dtype_size(d->buckets[k].dtype)));
}

static void ar_destroy(td_ddp *d) {
    ar_state *st = d->state;
    if (!st) return;
    td__ddp_mem_free(d, st->grad_mem);
    free(st->seen);
    free(st);
    d->state = NULL;
}

const td__ddp_reducer td__ddp_allreduce = {
    .name = "allreduce",
    .create = ar_create,
    .prepare = td__ddp_sync_buffers,
    .grad_ready = ar_grad_ready,
    .finish = ar_finish,
    .zero_grad = ar_zero_grad,
    .wait = ar_wait,
    .destroy = ar_destroy,
};
