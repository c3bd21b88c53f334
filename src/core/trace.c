/* td_trace: spans recorded under a mutex into a growing array, and the names of the rows they
 * sit on. The packed form a trace travels in between processes, and the file it is kept in as
 * it records, are trace_pack.c's; writing JSON is trace_json.c's.
 *
 * Recording is cheap enough for tens of spans per step and per op of a graph (one lock, two
 * small strdup); it is not meant for per-element events. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core_impl.h"
#include "trace_impl.h"

static int trace_tid(void) { return (int)syscall(SYS_gettid); }

static char *trace_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *copy = malloc(n);
    if (copy) memcpy(copy, s, n);
    return copy;
}

td_status td_trace_create(td_trace **out, int rank) {
    if (!out) return td__fail(TD_EINVAL, "td_trace_create: out is NULL");
    *out = NULL;
    td_trace *trace = calloc(1, sizeof *trace);
    if (!trace) return td__fail(TD_ENOMEM, "td_trace_create: out of memory");
    pthread_mutex_init(&trace->lock, NULL);
    trace->rank = rank;
    trace->keep_fd = -1;
    *out = trace;
    return TD_OK;
}

void td_trace_destroy(td_trace *trace) {
    if (!trace) return;
    if (trace->keep_fd >= 0) close(trace->keep_fd);
    free(trace->keep_path);
    free(trace->keep_error);
    for (size_t i = 0; i < trace->count; i++) {
        free((char *)trace->events[i].name);
        free((char *)trace->events[i].category);
    }
    for (size_t i = 0; i < trace->nrows; i++) free(trace->rows[i].name);
    free(trace->events);
    free(trace->rows);
    free(trace->host);
    pthread_mutex_destroy(&trace->lock);
    free(trace);
}

td_status td__trace_record(td_trace *trace, const char *name, const char *category, int tid,
                           uint64_t link, uint64_t t0_ns, uint64_t t1_ns) {
    if (!trace || !name) return td__fail(TD_EINVAL, "td_trace_span: trace or name is NULL");
    char *n = trace_strdup(name);
    char *c = trace_strdup(category ? category : "");
    if (!n || !c) {
        free(n);
        free(c);
        return td__fail(TD_ENOMEM, "td_trace_span: out of memory recording '%s'", name);
    }
    td_trace_event ev = {n, c, tid, t0_ns, t1_ns >= t0_ns ? t1_ns - t0_ns : 0, link};
    pthread_mutex_lock(&trace->lock);
    if (trace->count == trace->cap) {
        size_t cap = trace->cap ? trace->cap * 2 : 64;
        td_trace_event *grown = realloc(trace->events, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&trace->lock);
            free(n);
            free(c);
            return td__fail(TD_ENOMEM, "td_trace_span: out of memory growing to %zu events", cap);
        }
        trace->events = grown;
        trace->cap = cap;
    }
    trace->events[trace->count++] = ev;
    if (trace->keep_fd >= 0) td__trace_keep_span(trace, &ev);
    pthread_mutex_unlock(&trace->lock);
    return TD_OK;
}

td_status td_trace_span_on(td_trace *trace, const char *name, const char *category, int tid,
                           uint64_t t0_ns, uint64_t t1_ns) {
    return td__trace_record(trace, name, category, tid, 0, t0_ns, t1_ns);
}

td_status td_trace_span(td_trace *trace, const char *name, const char *category, uint64_t t0_ns,
                        uint64_t t1_ns) {
    return td__trace_record(trace, name, category, trace_tid(), 0, t0_ns, t1_ns);
}

td_status td_trace_span_linked(td_trace *trace, const char *name, const char *category,
                               uint64_t link, uint64_t t0_ns, uint64_t t1_ns) {
    return td__trace_record(trace, name, category, trace_tid(), link, t0_ns, t1_ns);
}

uint64_t td_trace_begin(td_trace *trace) {
    (void)trace;
    return td_time_ns();
}

td_status td_trace_end(td_trace *trace, const char *name, const char *category, uint64_t t0_ns) {
    return td_trace_span(trace, name, category, t0_ns, td_time_ns());
}

td_status td_trace_name_track(td_trace *trace, int tid, const char *name) {
    if (!trace || !name) return td__fail(TD_EINVAL, "td_trace_name_track: trace or name is NULL");
    char *copy = trace_strdup(name);
    if (!copy) return td__fail(TD_ENOMEM, "td_trace_name_track: out of memory");
    pthread_mutex_lock(&trace->lock);
    for (size_t i = 0; i < trace->nrows; i++)
        if (trace->rows[i].tid == tid) {
            free(trace->rows[i].name);
            trace->rows[i].name = copy;
            if (trace->keep_fd >= 0) td__trace_keep_row(trace, &trace->rows[i]);
            pthread_mutex_unlock(&trace->lock);
            return TD_OK;
        }
    if (trace->nrows == trace->cap_rows) {
        size_t cap = trace->cap_rows ? trace->cap_rows * 2 : 8;
        td__trace_row *grown = realloc(trace->rows, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&trace->lock);
            free(copy);
            return td__fail(TD_ENOMEM, "td_trace_name_track: out of memory");
        }
        trace->rows = grown;
        trace->cap_rows = cap;
    }
    trace->rows[trace->nrows++] = (td__trace_row){tid, copy};
    if (trace->keep_fd >= 0) td__trace_keep_row(trace, &trace->rows[trace->nrows - 1]);
    pthread_mutex_unlock(&trace->lock);
    return TD_OK;
}

td_status td_trace_name_thread(td_trace *trace, const char *name) {
    return td_trace_name_track(trace, trace_tid(), name);
}

const char *td_trace_track_name(const td_trace *trace, int tid) {
    if (!trace) return NULL;
    const char *name = NULL;
    pthread_mutex_lock((pthread_mutex_t *)&trace->lock);
    for (size_t i = 0; i < trace->nrows && !name; i++)
        if (trace->rows[i].tid == tid) name = trace->rows[i].name;
    pthread_mutex_unlock((pthread_mutex_t *)&trace->lock);
    return name;
}

td_status td_trace_set_host(td_trace *trace, const char *host) {
    if (!trace || !host) return td__fail(TD_EINVAL, "td_trace_set_host: trace or host is NULL");
    char *copy = trace_strdup(host);
    if (!copy) return td__fail(TD_ENOMEM, "td_trace_set_host: out of memory");
    pthread_mutex_lock(&trace->lock);
    free(trace->host);
    trace->host = copy;
    if (trace->keep_fd >= 0) td__trace_keep_host(trace);
    pthread_mutex_unlock(&trace->lock);
    return TD_OK;
}

int td_trace_rank(const td_trace *trace) { return trace ? trace->rank : -1; }

size_t td_trace_count(const td_trace *trace) {
    if (!trace) return 0;
    pthread_mutex_lock((pthread_mutex_t *)&trace->lock);
    size_t n = trace->count;
    pthread_mutex_unlock((pthread_mutex_t *)&trace->lock);
    return n;
}

td_status td_trace_event_get(const td_trace *trace, size_t index, td_trace_event *out) {
    if (!trace || !out) return td__fail(TD_EINVAL, "td_trace_event_get: trace or out is NULL");
    pthread_mutex_lock((pthread_mutex_t *)&trace->lock);
    size_t n = trace->count;
    if (index < n) *out = trace->events[index];
    pthread_mutex_unlock((pthread_mutex_t *)&trace->lock);
    if (index >= n)
        return td__fail(TD_EINVAL, "td_trace_event_get: index %zu >= %zu events", index, n);
    return TD_OK;
}
