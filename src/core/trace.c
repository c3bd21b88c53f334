/* td_trace: spans recorded under a mutex into a growing array, written as Chrome trace JSON.
 *
 * Recording is cheap enough for tens of spans per step (one lock, two small strdup); it is
 * not meant for per-element events. It does not write anything until td_trace_write. */
#include "tandem/trace.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core_impl.h"

struct td_trace {
    pthread_mutex_t lock;
    int rank;
    td_trace_event *events; /* (cap) of which (count) are recorded */
    size_t count, cap;
};

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
    *out = trace;
    return TD_OK;
}

void td_trace_destroy(td_trace *trace) {
    if (!trace) return;
    for (size_t i = 0; i < trace->count; i++) {
        free((char *)trace->events[i].name);
        free((char *)trace->events[i].category);
    }
    free(trace->events);
    pthread_mutex_destroy(&trace->lock);
    free(trace);
}

td_status td_trace_span_on(td_trace *trace, const char *name, const char *category, int tid,
                           uint64_t t0_ns, uint64_t t1_ns) {
    if (!trace || !name) return td__fail(TD_EINVAL, "td_trace_span: trace or name is NULL");
    char *n = trace_strdup(name);
    char *c = trace_strdup(category ? category : "");
    if (!n || !c) {
        free(n);
        free(c);
        return td__fail(TD_ENOMEM, "td_trace_span: out of memory recording '%s'", name);
    }
    td_trace_event ev = {n, c, tid, t0_ns, t1_ns >= t0_ns ? t1_ns - t0_ns : 0};
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
    pthread_mutex_unlock(&trace->lock);
    return TD_OK;
}

td_status td_trace_span(td_trace *trace, const char *name, const char *category, uint64_t t0_ns,
                        uint64_t t1_ns) {
    return td_trace_span_on(trace, name, category, trace_tid(), t0_ns, t1_ns);
}

uint64_t td_trace_begin(td_trace *trace) {
    (void)trace;
    return td_time_ns();
}

td_status td_trace_end(td_trace *trace, const char *name, const char *category, uint64_t t0_ns) {
    return td_trace_span(trace, name, category, t0_ns, td_time_ns());
}

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

/* A name as a JSON string. */
static void trace_put_string(FILE *f, const char *s) {
    char small[256], *text = small;
    size_t n = strlen(s), need = td__json_escape(small, sizeof small, s, n);
    if (need >= sizeof small && (text = malloc(need + 1)) != NULL)
        td__json_escape(text, need + 1, s, n);
    fprintf(f, "\"%s\"", text ? text : small);
    if (text != small) free(text);
}

td_status td_trace_write(const td_trace *trace, const char *path) {
    if (!trace || !path) return td__fail(TD_EINVAL, "td_trace_write: trace or path is NULL");
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 32);
    if (!tmp) return td__fail(TD_ENOMEM, "td_trace_write: out of memory");
    snprintf(tmp, plen + 32, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) {
        free(tmp);
        return td__fail(TD_EIO, "td_trace_write: cannot create %s.tmp", path);
    }
    pthread_mutex_lock((pthread_mutex_t *)&trace->lock);
    fprintf(f, "{\"traceEvents\":[\n");
    fprintf(f,
            "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":"
            "\"rank %d\"}}",
            trace->rank, trace->rank);
    for (size_t i = 0; i < trace->count; i++) {
        const td_trace_event *e = &trace->events[i];
        fprintf(f, ",\n{\"name\":");
        trace_put_string(f, e->name);
        fprintf(f, ",\"cat\":");
        trace_put_string(f, e->category);
        /* Microseconds with nanosecond decimals: Chrome's unit, without losing precision. */
        fprintf(f, ",\"ph\":\"X\",\"ts\":%llu.%03u,\"dur\":%llu.%03u,\"pid\":%d,\"tid\":%d}",
                (unsigned long long)(e->start_ns / 1000), (unsigned)(e->start_ns % 1000),
                (unsigned long long)(e->dur_ns / 1000), (unsigned)(e->dur_ns % 1000), trace->rank,
                e->tid);
    }
    fprintf(f, "\n],\"displayTimeUnit\":\"ms\"}\n");
    pthread_mutex_unlock((pthread_mutex_t *)&trace->lock);
    int bad = ferror(f);
    if (fclose(f) != 0) bad = 1;
    if (bad || rename(tmp, path) != 0) {
        remove(tmp);
        free(tmp);
        return td__fail(TD_EIO, "td_trace_write: cannot write %s", path);
    }
    free(tmp);
    return TD_OK;
}
