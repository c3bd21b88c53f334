/* The training loop's guard against a diverged run: a loss that is not finite stops it, naming
 * the step, where training on would only spread the NaN into every parameter (PyTorch leaves
 * this to the user's loop; Lightning's detect_anomaly and apex's loss scaler are the models). */
#include <math.h>

#include "tandem/optim.h"

#include "core/core_impl.h"

td_status td_loss_check(double loss, int64_t step) {
    if (isfinite(loss)) return TD_OK;
    return td__fail(TD_EINVAL,
                    "step %lld: the loss is %s, not finite: training diverged (a learning rate "
                    "too large, or bad data?)",
                    (long long)step,
                    isnan(loss) ? "NaN"
                    : loss > 0  ? "inf"
                                : "-inf");
}
