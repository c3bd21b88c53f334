/* Exact sums of squares added across ranks (grad_norm.h): the accumulators' digits are 64-bit
 * integers below 2^32, so td_comm's I64 SUM adds them exactly in whatever order a backend
 * takes, and one carry pass after each group restores the digits. */
#include "parallel/grad_norm.h"

td_status td__sumsq_allreduce(td__sumsq *acc, td_comm *const *groups, int n) {
    for (int k = 0; k < n; k++) {
        if (!groups[k] || td_comm_size(groups[k]) < 2) continue;
        td__sumsq_normalize(acc);
        TD__TRY(td_comm_allreduce(groups[k], acc->d, acc->d, TD__SUMSQ_WORDS, TD_I64, TD_OP_SUM));
    }
    td__sumsq_normalize(acc);
    return TD_OK;
}
