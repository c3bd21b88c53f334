/* tandem-doctor: the diagnosis of a job from the dumps its ranks wrote (TANDEM_DOCTOR_DIR), for
 * jobs started by mpirun, srun, the torch backend's launchers or any other; tandemrun prints the
 * same by itself. The first line is the root cause, then how the ranks wait on each other, then
 * a line per rank.
 *
 *   mpirun -x TANDEM_DOCTOR_DIR=/tmp/job -np 4 ./train     (the job hangs, times out, or is
 *   tandem-doctor /tmp/job                                   asked with kill -USR1)
 *   tandem-doctor --trace /tmp/job/doctor.json /tmp/job     (also the calls as a trace) */
#include <stdio.h>
#include <stdlib.h>

#include "tandem/args.h"
#include "tandem/doctor.h"

static const char usage[] =
    "usage: tandem-doctor [--trace FILE] DIR\n"
    "\n"
    "Reads the dumps the ranks of a job wrote to DIR (TANDEM_DOCTOR_DIR: on a timeout, a dead\n"
    "peer, mismatched calls, SIGUSR1 or SIGTERM) and prints which rank holds the job up, doing\n"
    "what, and why; in a job that is not stuck, the rank the others wait for.\n"
    "\n"
    "  --trace FILE   also write the calls that waited as a Chrome/Perfetto trace: appended to\n"
    "                 FILE when it is a trace of tandemrun --trace, else a new file\n";

int main(int argc, char **argv) {
    const char *dir = NULL, *trace = NULL;
    td_args a;
    td_args_init(&a, "tandem-doctor", argc, argv);
    while (td_args_next(&a)) {
        td_args_string(&a, "--trace", &trace);
        if (!dir) td_args_positional(&a, &dir);
    }
    if (!a.failed && !a.help && !dir) td_args_error(&a, "which directory holds the dumps?");
    int rc = td_args_finish(&a, usage);
    if (rc >= 0) return rc;
    char *text = NULL;
    if (td_doctor_diagnose(dir, &text) != TD_OK) {
        fprintf(stderr, "tandem-doctor: %s\n", td_last_error());
        return 1;
    }
    fputs(text, stdout);
    free(text);
    if (trace && td_doctor_trace(dir, trace) != TD_OK) {
        fprintf(stderr, "tandem-doctor: %s\n", td_last_error());
        return 1;
    }
    return 0;
}
