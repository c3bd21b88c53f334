/* The hang doctor: from the dumps the ranks of a job wrote (tandem/recorder.h), says which rank
 * holds the job up, doing what, and why: the chain of waits across groups down to the rank that
 * is not in any call (in compute, at step S, op O, for how long), a dead rank and how it died,
 * the first call at which the ranks' calls differ (or a rank skipped one), a rank that never
 * created its process group, a deadlock between point-to-point calls; and, in a job that is not
 * stuck, the rank the others keep waiting for. tandemrun runs it when a job fails or is asked
 * (tandemrun --dump); tandem-doctor DIR runs it on the dumps of any launcher (mpirun, Slurm,
 * the torch backend). docs/doctor.md shows each fault as it reads. */
#ifndef TANDEM_DOCTOR_H
#define TANDEM_DOCTOR_H

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a launcher knows of one rank's process. */
typedef struct {
    int rank;
    int pid;
    int ended;    /* 0: it still runs */
    int code;     /* when ended: its exit status, or the signal that killed it */
    int signaled; /* when ended: 1 when a signal killed it */
    int recorder; /* it catches SIGUSR1, so it has the flight recorder's dump handler */
    char host[64];
} td_doctor_proc;

/* Writes what a launcher knows of the job's n processes to DIR/launcher.json, which
 * td_doctor_diagnose reads beside the dumps. */
td_status td_doctor_write_procs(const char *dir, const td_doctor_proc *procs, int n);

/* Reads every dump in `dir` (rank<R>.json, and launcher.json when there is one) and writes the
 * diagnosis to *text (malloc'd, the caller frees it): its first line the root cause, then how
 * the ranks wait on each other, then one line per rank. TD_EIO when `dir` holds no dump and no
 * launcher's note. */
td_status td_doctor_diagnose(const char *dir, char **text);

/* Writes the calls the dumps in `dir` hold that waited, a span per call and rank joined across
 * the ranks, as a Chrome/Perfetto trace: appended as the last events of `path` when that is a
 * trace tandem wrote (tandemrun --trace), else as a new file. */
td_status td_doctor_trace(const char *dir, const char *path);

#ifdef __cplusplus
}
#endif
#endif
