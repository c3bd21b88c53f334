/* The job trace from what the ranks kept: after a job whose ranks did not all reach
 * td_comm_destroy together (one was killed, the launcher stopped the rest), each rank's spans
 * are in TANDEM_TRACE's dir/rank<R>.trace, and the launcher merges them into dir/trace.json,
 * the file the gather would have written; and the clearing of such files before a job. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/launch.h"
#include "tandem/trace.h"

#include "core/core_impl.h"

/* The rank a kept file's name gives ("rank12.trace" -> 12), or -1 when it is no such name. */
static int kept_rank(const char *name) {
    int rank = -1, end = 0;
    if (sscanf(name, "rank%d.trace%n", &rank, &end) != 1 || name[end] || rank < 0) return -1;
    return rank;
}

static int by_rank(const void *a, const void *b) {
    int x = td_trace_rank(*(td_trace *const *)a), y = td_trace_rank(*(td_trace *const *)b);
    return (x > y) - (x < y);
}

td_status td_job_trace_collect(const char *dir, int *ranks) {
    if (!dir || !ranks) return td__fail(TD_EINVAL, "td_job_trace_collect: NULL argument");
    *ranks = 0;
    DIR *d = opendir(dir);
    if (!d) return td__fail(TD_EIO, "%s: cannot read the directory: %s", dir, strerror(errno));
    td_trace **traces = NULL;
    char **paths = NULL, bad[1024] = "";
    size_t n = 0, cap = 0;
    td_status s = TD_OK;
    for (struct dirent *e; !s && (e = readdir(d));) {
        if (kept_rank(e->d_name) < 0) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            td_trace **t = realloc(traces, cap * sizeof *t);
            if (t) traces = t;
            char **p = realloc(paths, cap * sizeof *p);
            if (p) paths = p;
            if (!t || !p) {
                s = td__fail(TD_ENOMEM, "td_job_trace_collect: out of memory");
                break;
            }
        }
        size_t len = strlen(dir) + strlen(e->d_name) + 2;
        if (!(paths[n] = malloc(len))) {
            s = td__fail(TD_ENOMEM, "td_job_trace_collect: out of memory");
            break;
        }
        snprintf(paths[n], len, "%s/%s", dir, e->d_name);
        if (td_trace_read(&traces[n], paths[n]) != TD_OK) { /* named below, and left there */
            if (!bad[0]) snprintf(bad, sizeof bad, "%s", td_last_error());
            free(paths[n]);
            continue;
        }
        n++;
    }
    closedir(d);
    if (!s && !n && !bad[0])
        s = td__fail(TD_ENOTFOUND, "%s holds no rank's kept trace (rank<R>.trace)", dir);
    /* The merged file orders the ranks itself; rank 0 first makes its host's clock the one the
     * others are put on. */
    if (n) qsort(traces, n, sizeof *traces, by_rank);
    char *out = NULL;
    if (!s && n) {
        size_t len = strlen(dir) + 16;
        if (!(out = malloc(len)))
            s = td__fail(TD_ENOMEM, "td_job_trace_collect: out of memory");
        else
            snprintf(out, len, "%s/trace.json", dir);
    }
    if (!s && n) s = td_trace_write_merged((const td_trace *const *)traces, n, out);
    for (size_t i = 0; i < n; i++) {
        if (!s) unlink(paths[i]);
        td_trace_destroy(traces[i]);
        free(paths[i]);
    }
    if (!s) *ranks = (int)n;
    if (!s && bad[0]) s = td__fail(TD_EFORMAT, "%s", bad);
    free(traces);
    free(paths);
    free(out);
    return s;
}

td_status td_job_trace_clear(const char *dir) {
    if (!dir) return td__fail(TD_EINVAL, "td_job_trace_clear: dir is NULL");
    DIR *d = opendir(dir);
    if (!d) return td__fail(TD_EIO, "%s: cannot read the directory: %s", dir, strerror(errno));
    td_status s = TD_OK;
    for (struct dirent *e; (e = readdir(d));) {
        if (kept_rank(e->d_name) < 0 && strcmp(e->d_name, "trace.json")) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (unlink(path) != 0 && errno != ENOENT && !s)
            s = td__fail(TD_EIO, "%s: cannot remove it: %s", path, strerror(errno));
    }
    closedir(d);
    return s;
}
