/* One trace of a whole job: every rank's trace gathered over the group to rank 0, which writes
 * them as one Chrome trace (td_comm_trace_write); and the job trace TANDEM_TRACE=DIR asks for
 * (tandemrun --trace DIR, or mpirun -x TANDEM_TRACE=DIR), which a td_comm_create'd group keeps
 * from creation and writes at td_comm_destroy. Recording a group's collectives is comm.c's. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "comm/comm_impl.h"
#include "core/core_impl.h"

td_status td_comm_trace_write(td_comm *comm, const td_trace *trace, const char *path) {
    if (!comm) return td__fail(TD_EINVAL, "td_comm_trace_write: the group is NULL");
    int rank = td_comm_rank(comm), n = td_comm_size(comm);
    if (rank == 0 && !path) return td__fail(TD_EINVAL, "td_comm_trace_write: rank 0 has no path");
    /* Every rank takes part in both collectives whatever went wrong here: a rank whose trace
     * did not pack sends length -1, and rank 0 names it. */
    void *bytes = NULL;
    size_t len = 0;
    int64_t mine = trace && td_trace_pack(trace, &bytes, &len) != TD_OK ? -1 : (int64_t)len;
    int64_t *lens = malloc((size_t)n * sizeof *lens);
    if (!lens) {
        free(bytes);
        return td__fail(TD_ENOMEM, "td_comm_trace_write: rank %d: out of memory", rank);
    }
    td_status s = td_comm_allgather(comm, &mine, lens, 1, TD_I64);
    size_t max = 0;
    for (int r = 0; !s && r < n; r++)
        if (lens[r] > 0 && (size_t)lens[r] > max) max = (size_t)lens[r];
    unsigned char *send = NULL, *recv = NULL;
    if (!s) {
        send = calloc(max + 1, 1);
        recv = rank == 0 ? malloc(max * (size_t)n + 1) : NULL;
        if (send && mine > 0) memcpy(send, bytes, len);
        /* The ranks agree that every buffer is there before the gather needs them. */
        int32_t ok = send && (rank != 0 || recv), all_ok = 0;
        s = td_comm_allreduce(comm, &ok, &all_ok, 1, TD_I32, TD_OP_MIN);
        if (!s && !all_ok)
            s = td__fail(TD_ENOMEM, "td_comm_trace_write: rank %d: %s", rank,
                         ok ? "another rank is out of memory" : "out of memory");
        if (!s) s = td_comm_gather(comm, send, recv, max, TD_U8, 0);
    }
    free(bytes);
    free(send);
    if (s || rank != 0) {
        free(lens);
        free(recv);
        return s;
    }
    td_trace **traces = calloc((size_t)n + 1, sizeof *traces);
    char missing[256] = "";
    size_t count = 0, at = 0;
    for (int r = 0; traces && r < n; r++) {
        if (lens[r] == 0) continue; /* no trace on that rank */
        if (lens[r] < 0 ||
            td_trace_unpack(&traces[count], recv + (size_t)r * max, (size_t)lens[r]) != TD_OK) {
            if (at < sizeof missing)
                at +=
                    (size_t)snprintf(missing + at, sizeof missing - at, "%s%d", at ? ", " : "", r);
            continue;
        }
        count++;
    }
    if (!traces)
        s = td__fail(TD_ENOMEM, "td_comm_trace_write: out of memory");
    else if (count)
        s = td_trace_write_merged((const td_trace *const *)traces, count, path);
    if (!s && missing[0])
        s = td__fail(TD_EIO, "td_comm_trace_write: %s lacks the trace of rank(s) %s", path,
                     missing);
    for (size_t i = 0; traces && i < count; i++) td_trace_destroy(traces[i]);
    free(traces);
    free(lens);
    free(recv);
    return s;
}

/* DIR/rank<R>.trace: where rank R keeps its spans as it records them (td_trace_keep), so that
 * a rank killed mid-run leaves them for tandemrun to merge (td_job_trace_collect). */
static char *kept_path(const char *dir, int rank) {
    size_t cap = strlen(dir) + 32;
    char *path = malloc(cap);
    if (path) snprintf(path, cap, "%s/rank%d.trace", dir, rank);
    return path;
}

td_trace *td__comm_job_trace_open(td_comm *comm, char **dir) {
    *dir = NULL;
    const char *env = getenv("TANDEM_TRACE");
    if (!env || !*env) return NULL;
    char host[256] = "";
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "?");
    int rank = td_comm_rank(comm);
    td_trace *trace = NULL;
    if (td_trace_create(&trace, rank) != TD_OK || td_trace_set_host(trace, host) != TD_OK ||
        !(*dir = strdup(env))) {
        td__log(TD_LOG_WARN, "rank %d: TANDEM_TRACE=%s: cannot start the trace: %s", rank, env,
                td_last_error());
        td_trace_destroy(trace);
        return NULL;
    }
    /* The thread that makes the group runs the program's steps: its blocking collectives sit on
     * the "compute" row (the program may name it otherwise). */
    (void)td_trace_name_thread(trace, "compute");
    /* mpirun users name a directory that may not exist yet; tandemrun has made its own. */
    if (mkdir(env, 0777) != 0 && errno != EEXIST)
        td__log(TD_LOG_WARN, "rank %d: TANDEM_TRACE=%s: cannot make the directory: %s", rank, env,
                strerror(errno));
    char *kept = kept_path(env, rank);
    if (!kept || td_trace_keep(trace, kept) != TD_OK)
        td__log(TD_LOG_WARN, "rank %d: TANDEM_TRACE=%s: a killed rank will leave no spans: %s",
                rank, env, kept ? td_last_error() : "out of memory");
    free(kept);
    td_comm_set_trace(comm, trace);
    return trace;
}

void td__comm_job_trace_close(td_comm *comm, td_trace *trace, char *dir) {
    int rank = td_comm_rank(comm);
    size_t cap = strlen(dir) + 32;
    char *path = malloc(cap), *kept = kept_path(dir, rank);
    td_status s = path && kept ? TD_OK : TD_ENOMEM;
    if (!s) {
        snprintf(path, cap, "%s/trace.json", dir);
        s = td_comm_trace_write(comm, trace, path);
        /* The kept files go once every rank knows the job's file was written. */
        int32_t ok = s == TD_OK, all = 0;
        if (td_comm_allreduce(comm, &ok, &all, 1, TD_I32, TD_OP_MIN) != TD_OK) all = 0;
        if (all) {
            (void)td_trace_keep(trace, NULL);
            unlink(kept);
            if (rank == 0) td__log(TD_LOG_INFO, "wrote the job's trace to %s", path);
        } else {
            /* A rank died, say: each rank's spans stay in its kept file, which tandemrun (or
             * tandemrun --trace-merge DIR, after mpirun) merges. */
            td__log(TD_LOG_WARN,
                    "rank %d: the job's trace was not gathered (%s); %s keeps this "
                    "rank's spans",
                    rank, s ? td_last_error() : "another rank failed", kept);
            (void)td_trace_keep(trace, NULL);
        }
    }
    free(path);
    free(kept);
    td_trace_destroy(trace);
    free(dir);
}
