/* How a reducer's bucket collectives run, the same for DDP's all-reduce and ZeRO's
 * reduce-scatter: complete buckets go out strictly in bucket order as backward makes them
 * ready, finished collectives are noticed as backward goes on, and the rest are waited for at
 * its end. The reducer says how one bucket's collective starts and what follows when it ends;
 * this file communicates nothing itself. */
#include "core/core_impl.h"
#include "parallel/ddp_impl.h"

void td__ddp_launch_ready(td_ddp *d, size_t *next, size_t upto,
                          void (*launch)(td_ddp *d, size_t k)) {
    /* A complete bucket waits for the ones before it, so every rank queues the same
     * collectives in the same order whatever order its gradients arrive in. */
    while (*next < upto && *next < d->n_buckets && d->buckets[*next].pending == 0) {
        launch(d, (*next)++);
        d->stats.buckets_early++;
    }
}

void td__ddp_bucket_started(td_ddp *d, size_t k, td_status s) {
    if (s == TD_OK) return;
    d->buckets[k].req = NULL;
    td__ddp_note_error(d, s);
}

void td__ddp_complete_buckets(td_ddp *d, size_t upto, int wait,
                              void (*done)(td_ddp *d, size_t k, td_status s)) {
    for (size_t k = 0; k < upto && k < d->n_buckets; k++) {
        ddp_bucket *b = &d->buckets[k];
        if (!b->req) continue;
        td_status s;
        if (wait) {
            s = td_request_wait(b->req);
        } else {
            int finished = 0;
            s = td_request_test(b->req, &finished);
            if (!finished && s == TD_OK) break; /* they complete in launch order */
        }
        b->req = NULL;
        done(d, k, s);
    }
}
