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
#include <string.h>

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
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(usage, stdout);
            return 0;
        } else if (strcmp(argv[i], "--trace") == 0 && i + 1 < argc) {
            trace = argv[++i];
        } else if (argv[i][0] == '-' || dir) {
            fprintf(stderr, "tandem-doctor: unexpected argument '%s'\n%s", argv[i], usage);
            return 2;
        } else {
            dir = argv[i];
        }
    }
    if (!dir) {
        fprintf(stderr, "tandem-doctor: which directory holds the dumps?\n%s", usage);
        return 2;
    }
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
