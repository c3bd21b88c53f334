/* td_ddp's bucket layout, shared by its reducers: which parameters share a bucket and where
 * each gradient lies in it (reverse registration order at first, the observed ready order after
 * a rebuild), and moving gradients into the reducer's memory with a canary left behind, so that
 * a trainer writing through a stale gradient pointer is caught. It allocates no gradient memory
 * (the reducers do) and communicates nothing. */
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "parallel/ddp_impl.h"

#define DDP_ALIGN_BYTES 64 /* gradient offsets inside a bucket */
/* What memory a gradient left holds: a signalling NaN of its dtype, so that reading it poisons
 * the result and any arithmetic on it (a `+=` through a stale pointer) quiets it and changes its
 * bits. */
#define DDP_CANARY_F32 0x7fa0ddadu
#define DDP_CANARY_BF16 0x7fa0u
#define DDP_CANARY_F16 0x7d00u

void td__ddp_free_buckets(ddp_bucket *b, size_t n) {
    for (size_t k = 0; k < n; k++) free(b[k].members);
    free(b);
}

/* The bit pattern of the canary in a dtype, and its size (2 or 4 bytes). */
static uint32_t ddp_canary(td_dtype dt, size_t *size) {
    *size = td_dtype_size(dt);
    return dt == TD_BF16 ? DDP_CANARY_BF16 : dt == TD_F16 ? DDP_CANARY_F16 : DDP_CANARY_F32;
}

void td__ddp_move_gradient(td_ddp *d, size_t i, void *dst) {
    void *old = d->params[i].grad;
    if (old) {
        size_t es;
        uint32_t bits = ddp_canary(d->params[i].dtype, &es);
        td__ddp_note_error(
            d,
            td__ddp_mem_copy(d, dst, old, d->params[i].count * td_dtype_size(d->params[i].dtype)));
        td__ddp_note_error(d, td__ddp_mem_fill(d, old, bits, (int)es, d->params[i].count));
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
        if (p && !td__ddp_mem_holds(d, p, bits, (int)es, d->params[i].count))
            s = td__fail(TD_ESTATE,
                         "ddp rank %d: the gradient of '%s' was written at its old address %p "
                         "after DDP moved it to %p: re-read params[%zu].grad after "
                         "td_ddp_create and after each synchronised step",
                         d->rank, d->params[i].name, (const void *)p, d->params[i].grad, i);
    }
    memset(d->moved_from, 0, d->n_params * sizeof *d->moved_from);
    td__ddp_mem_free(d, d->moved_mem);
    d->moved_mem = NULL;
    return s;
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
        size_t cap = k == 0 && d->opt.first_bucket_bytes < d->opt.bucket_bytes
                         ? d->opt.first_bucket_bytes
                         : d->opt.bucket_bytes;
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
