/* tandemrun --trace DIR: the directory checked before the ranks start (a file, a read-only or
 * full file system is refused then, saying which), cleared of an earlier job's files before
 * each attempt, and the job's trace reported after it: the one the ranks gathered, or the one
 * merged here from what each rank kept when they could not (a rank was killed), or why there
 * is none. tandemrun --trace-merge DIR does the last for a job that ran under mpirun. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tandem/launch.h"

#include "tandemrun.h"

int tr_trace_prepare(const tr_options *o, char dir[PATH_MAX]) {
    if (mkdir(o->trace_dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "tandemrun: --trace %s: cannot make the directory: %s\n", o->trace_dir,
                strerror(errno));
        return -1;
    }
    struct stat st;
    if (stat(o->trace_dir, &st) != 0) {
        fprintf(stderr, "tandemrun: --trace %s: %s\n", o->trace_dir, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(st.st_mode)) {
        fprintf(stderr, "tandemrun: --trace %s: is %s, not a directory\n", o->trace_dir,
                S_ISREG(st.st_mode) ? "a file" : "something else");
        return -1;
    }
    if (!realpath(o->trace_dir, dir)) {
        fprintf(stderr, "tandemrun: --trace %s: %s\n", o->trace_dir, strerror(errno));
        return -1;
    }
    /* Each rank writes its file there as it records: a directory nothing can be written in
     * would only say so at the end. A page of bytes tells a full file system too. */
    char probe[PATH_MAX + 64], page[4096] = {0};
    snprintf(probe, sizeof probe, "%s/.tandemrun-probe-%d", dir, (int)getpid());
    int fd = open(probe, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600), err = 0;
    if (fd < 0 || write(fd, page, sizeof page) != (ssize_t)sizeof page || fsync(fd) != 0)
        err = errno ? errno : ENOSPC;
    if (fd >= 0) close(fd);
    unlink(probe);
    if (err) {
        fprintf(stderr, "tandemrun: --trace %s: cannot write in it: %s\n", dir, strerror(err));
        return -1;
    }
    setenv("TANDEM_TRACE", dir, 1);
    if (o->trace_ops) setenv("TANDEM_TRACE_OPS", "1", 1);
    return 0;
}

int tr_trace_clear(const char *dir) {
    if (td_job_trace_clear(dir) == TD_OK) return 0;
    fprintf(stderr, "tandemrun: --trace: %s\n", td_last_error());
    return -1;
}

int tr_trace_report(const char *dir, int failed_rank) {
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/trace.json", dir);
    int ranks = 0;
    td_status s = td_job_trace_collect(dir, &ranks);
    if (s == TD_OK) {
        char why[64] = "";
        if (failed_rank >= 0) snprintf(why, sizeof why, ", rank %d up to its failure", failed_rank);
        fprintf(stderr,
                "tandemrun: the job's trace is %s (open it in ui.perfetto.dev), from what %d "
                "rank%s kept%s\n",
                path, ranks, ranks == 1 ? "" : "s", why);
        return 0;
    }
    if (s == TD_ENOTFOUND && access(path, R_OK) == 0) {
        fprintf(stderr, "tandemrun: the job's trace is %s (open it in ui.perfetto.dev)\n", path);
        return 0;
    }
    if (s == TD_ENOTFOUND)
        fprintf(stderr,
                "tandemrun: no trace in %s: no rank recorded one (a rank records from "
                "td_comm_create on, under TANDEM_TRACE)\n",
                dir);
    else
        fprintf(
            stderr,
            "tandemrun: the job's trace: %s (what the ranks recorded stays in %s/rank<R>.trace; "
            "tandemrun --trace-merge %s merges it)\n",
            td_last_error(), dir, dir);
    return 1;
}
