/* The flight recorder: what every rank keeps so that a job that stops moving, or crawls, can
 * be diagnosed (docs/doctor.md). Every process group keeps a ring of its last calls (2048 by
 * default, TANDEM_DOCTOR_CALLS) with their sequence numbers, sizes, the strategy's tag
 * (td_comm_tag in comm.h), their state and, for each call that had to wait, when it began
 * waiting, on whom, and when it ended. Recording is always on (TANDEM_DOCTOR=0 turns it off)
 * and costs a few stores per call. Besides the calls, a rank's progress marks say where it is:
 * the training step, the micro-batch and the op it computes; DDP, ZeRO, the pipeline and the
 * graph set them, and a hand-written trainer may too.
 *
 * With TANDEM_DOCTOR_DIR=DIR in the environment (tandemrun sets it; under mpirun or Slurm, set
 * it yourself), each rank writes DIR/rank<R>.json, its dump: every group's calls, its marks and
 * every thread's stack. It does so when one of its groups fails (a timeout, a dead peer,
 * mismatched calls), when another rank's dump appears in DIR (on one host), on SIGUSR1 (the job
 * goes on), on SIGTERM (then dies as before), and on td_recorder_dump. tandemrun and tandem-doctor (tandem/doctor.h) read the dumps of all ranks
 * and name the culprit. */
#ifndef TANDEM_RECORDER_H
#define TANDEM_RECORDER_H

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* td_recorder_step's "the next step". */
#define TD_RECORDER_NEXT (-1)

/* Marks the training step this rank is in: `step` (0, 1, ...), from then on numbered by the
 * program alone; or TD_RECORDER_NEXT, the one after the last, which DDP (each forward) and the
 * pipeline (each td_pipeline_step) mark unless the program numbers its steps. */
void td_recorder_step(int64_t step);

/* Marks the micro-batch this rank works on (-1: none). */
void td_recorder_micro_batch(int micro_batch);

/* Marks the op this rank computes from now on: `name` (its first 47 bytes are copied) in
 * `phase` ("forward", "backward": a string that outlives the process's groups); NULL: none. */
void td_recorder_op(const char *name, const char *phase);

/* Writes this rank's dump now, `why` in it, without stopping anything; TD_ESTATE when
 * TANDEM_DOCTOR_DIR is not set. */
td_status td_recorder_dump(const char *why);

#ifdef __cplusplus
}
#endif
#endif
