/* Restarting a job after a rank failed, as torchrun's elastic agent does on one host: the
 * launcher has stopped the other ranks and waited for them; this decides whether the job starts
 * again and with how many ranks, and when it does not, says why. A job that ended because the
 * launcher was interrupted or timed out never restarts (its own message said why it ended).
 * The restarted program resumes from its own checkpoint (a rank has no state the launcher could
 * carry over). A job on a device mesh (--tp, --pp) restarts on a mesh that fits its ranks. */
#include <stdio.h>

#include "tandemrun.h"

int tr_restart_next(tr_restart *r, int failed_rank, int nproc, int *next_nproc, char *why,
                    size_t cap) {
    if (cap) why[0] = 0;
    if (failed_rank < 0 || r->max_restarts == 0) return 0;
    if (r->done >= r->max_restarts) {
        snprintf(why, cap, "rank %d failed and all %d restart%s are used (--max-restarts %d)",
                 failed_rank, r->max_restarts, r->max_restarts == 1 ? "" : "s", r->max_restarts);
        return 0;
    }
    int n = r->nproc == TR_RESTART_SAME   ? nproc
            : r->nproc == TR_RESTART_LEFT ? nproc - 1
                                          : r->nproc;
    if (n < 1) {
        snprintf(why, cap,
                 "rank %d, the last one left, failed: --restart-nproc-per-node left restarts "
                 "without the rank that failed, which leaves none (%d of %d restart%s used)",
                 failed_rank, r->done, r->max_restarts, r->max_restarts == 1 ? "" : "s");
        return 0;
    }
    r->done++;
    *next_nproc = n;
    return 1;
}

int tr_restart_layout(int ranks, int *tp, int *pp) {
    while (*tp * *pp > ranks) {
        if (*tp > 1)
            *tp = *tp % 2 ? 1 : *tp / 2;
        else
            *pp = *pp % 2 ? 1 : *pp / 2;
    }
    return ranks / (*tp * *pp) * (*tp * *pp);
}
