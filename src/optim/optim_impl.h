/* What the strategies use of the optimizers' layer beyond the public optim.h. Not installed. */
#ifndef TANDEM_OPTIM_IMPL_H
#define TANDEM_OPTIM_IMPL_H

#include "tandem/param.h"

#include "core/core_impl.h"

/* Every gradient of params times c, where the gradients are: one multi-tensor launch on a GPU
 * (every parameter on params[0]'s), a loop through f32 on the CPU. `what` names the caller in
 * errors. */
td_status td__grads_scale(td_param *params, size_t n, float c, const char *what);

/* Adds the squares of params' gradients (on the CPU; TD_EUNSUPPORTED names one on a GPU) to acc,
 * exactly: this rank's part of a norm that a strategy sums further over the ranks that hold the
 * rest (adding accumulators), which gives the same bits however the model is split. */
td_status td__grads_sumsq(const td_param *params, size_t n, td__sumsq *acc, const char *what);

/* clip_grad_norm_'s rule once the whole model's sum of squares is known (over ranks, shards or
 * stages, as the caller's gradients are spread): *total_norm = sqrt(sumsq) when total_norm is
 * not NULL, and params' gradients scaled by max_norm / (norm + 1e-6) where that is below 1. */
td_status td__grads_clip(td_param *params, size_t n, double max_norm, double sumsq,
                         double *total_norm, const char *what);

#endif
