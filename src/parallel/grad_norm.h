/* The whole model's gradient norm from parts that many ranks hold (a tensor-parallel slice,
 * ZeRO's shards, a pipeline's stage): each rank's squares summed exactly (td__grads_sumsq) and
 * the exact sums added over the groups that split the model, so the norm is the same bits at
 * every layout. Not installed. */
#ifndef TANDEM_PARALLEL_GRAD_NORM_H
#define TANDEM_PARALLEL_GRAD_NORM_H

#include "tandem/comm.h"

#include "core/core_impl.h"

/* acc summed over each of groups[0 .. n) in turn (NULL or single-rank groups skipped): on return
 * every rank of them holds the sum of all their accumulators. Collective over each. */
td_status td__sumsq_allreduce(td__sumsq *acc, td_comm *const *groups, int n);

#endif
