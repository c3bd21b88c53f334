/* Restarting a job after a rank failed, as torchrun's elastic agent does on one host: the
 * launcher has stopped the other ranks and waited for them; this decides whether the job starts
 * again and with how many ranks. A job that ended because the launcher was interrupted or timed
 * out never restarts. The restarted program resumes from its own checkpoint (a rank has no
 * state the launcher could carry over). */
#include "tandemrun.h"

int tr_restart_next(tr_restart *r, int failed_rank, int nproc, int *next_nproc) {
    if (failed_rank < 0 || r->done >= r->max_restarts) return 0;
    int n = r->nproc == TR_RESTART_SAME   ? nproc
            : r->nproc == TR_RESTART_LEFT ? nproc - 1
                                          : r->nproc;
    if (n < 1) return 0;
    r->done++;
    *next_nproc = n;
    return 1;
}
