/* What the strategies use of the optimizers' layer beyond the public optim.h. Not installed. */
#ifndef TANDEM_OPTIM_IMPL_H
#define TANDEM_OPTIM_IMPL_H

#include "tandem/param.h"

/* Every gradient of params times c, where the gradients are: one multi-tensor launch on a GPU
 * (every parameter on params[0]'s), a loop through f32 on the CPU. `what` names the caller in
 * errors. */
td_status td__grads_scale(td_param *params, size_t n, float c, const char *what);

#endif
