/* Uneven inputs for td_ddp (PyTorch's Join): ranks whose data runs out first keep answering the
 * collectives of the ranks that still train, so nobody hangs, and each step's gradients are the
 * average over the samples that took part.
 *
 * Every synchronised step begins with an all-gather of each rank's samples for the step (1 by
 * default, 0 for a rank that has joined). From it every rank knows the step's total N and the
 * lowest rank with data, whose buffers everybody takes. A rank's gradients are weighted by
 * n_r * world_size / N before the usual average, which makes the result sum_r n_r g_r / N: with
 * n_r the samples behind rank r's mean gradient g_r, the mean over all of them, as one process
 * on the same samples. When every rank has the same n_r the weights are all 1 and nothing is
 * scaled. A joined rank runs the backward's collectives with zero gradients and weight 0. Once
 * every rank has joined, the last rank to have had data broadcasts its parameters and buffers. */
#include <math.h>
#include <stdlib.h>

#include "core/core_impl.h"
#include "parallel/ddp_impl.h"

td_status td__ddp_join_create(td_ddp *d) {
    ddp_join *j = calloc(1, sizeof *j);
    if (j) j->all = calloc((size_t)d->size, sizeof *j->all);
    if (!j || !j->all) {
        free(j);
        return td__fail(TD_ENOMEM, "ddp rank %d: out of memory", d->rank);
    }
    j->samples = 1;
    j->weight = 1;
    j->uniform = 1;
    d->join = j;
    return TD_OK;
}

void td__ddp_join_destroy(td_ddp *d) {
    if (!d->join) return;
    free(d->join->all);
    free(d->join);
    d->join = NULL;
}

td_status td__ddp_join_prepare(td_ddp *d, double samples) {
    ddp_join *j = d->join;
    TD__TRY(td_comm_allgather(d->comm, &samples, j->all, 1, TD_F64));
    double total = 0;
    int first = -1, uniform = 1;
    for (int r = 0; r < d->size; r++) {
        total += j->all[r];
        if (j->all[r] > 0 && first < 0) first = r;
        uniform &= j->all[r] == j->all[0];
    }
    j->total = total;
    if (first >= 0) j->authority = first;
    j->uniform = uniform && total > 0;
    j->weight = total > 0 ? (float)(samples * d->size / total) : 0.0f;
    return TD_OK;
}

td_status td_ddp_set_samples(td_ddp *d, double samples) {
    if (!d) return td__fail(TD_EINVAL, "td_ddp_set_samples: ddp is NULL");
    if (!d->join)
        return td__fail(TD_ESTATE,
                        "ddp rank %d: td_ddp_set_samples needs join mode (td_ddp_params.join = 1)",
                        d->rank);
    if (!(samples >= 0) || !isfinite(samples))
        return td__fail(TD_EINVAL, "ddp rank %d: td_ddp_set_samples(%g): expected a count >= 0",
                        d->rank, samples);
    d->join->samples = samples;
    return TD_OK;
}

td_status td_ddp_join(td_ddp *d, int *done) {
    if (!d || !done) return td__fail(TD_EINVAL, "td_ddp_join: ddp or done is NULL");
    *done = 0;
    if (!d->join)
        return td__fail(TD_ESTATE,
                        "ddp rank %d: td_ddp_join needs join mode (td_ddp_params.join = "
                        "1) on every rank",
                        d->rank);
    if (!d->sync || d->n_ready > 0)
        return td__fail(TD_ESTATE,
                        "ddp rank %d: td_ddp_join inside a step (finish the backward and turn "
                        "sync back on first)",
                        d->rank);
    TD__TRY(td__ddp_join_prepare(d, 0));
    if (d->join->total == 0) {
        /* Everybody has joined: the last rank with data hands out the final model. */
        TD__TRY(td__ddp_broadcast_tensors(d, d->params, d->n_params, d->join->authority));
        TD__TRY(td__ddp_broadcast_tensors(d, d->buffers, d->n_buffers, d->join->authority));
        *done = 1;
        return TD_OK;
    }
    if (d->opt.broadcast_buffers)
        TD__TRY(td__ddp_broadcast_tensors(d, d->buffers, d->n_buffers, d->join->authority));
    /* The others' backward, shadowed: zero gradients, every bucket in order. */
    d->open = 1;
    td_ddp_zero_grad(d);
    for (size_t i = d->n_params; i-- > 0;) td_ddp_grad_ready_hook(i, d); /* errors kept */
    return td_ddp_finish_backward(d);
}
