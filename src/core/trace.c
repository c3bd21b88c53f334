/* td_trace: spans recorded under a mutex into a growing array, the names of the rows they sit
 * on, and the packed form a trace travels in between processes. Writing JSON is
 * trace_json.c's.
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
    *out = trace;
    return TD_OK;
}

void td_trace_destroy(td_trace *trace) {
    if (!trace) return;
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

static td_status record(td_trace *trace, const char *name, const char *category, int tid,
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
    pthread_mutex_unlock(&trace->lock);
    return TD_OK;
}

td_status td_trace_span_on(td_trace *trace, const char *name, const char *category, int tid,
                           uint64_t t0_ns, uint64_t t1_ns) {
    return record(trace, name, category, tid, 0, t0_ns, t1_ns);
}

td_status td_trace_span(td_trace *trace, const char *name, const char *category, uint64_t t0_ns,
                        uint64_t t1_ns) {
    return record(trace, name, category, trace_tid(), 0, t0_ns, t1_ns);
}

td_status td_trace_span_linked(td_trace *trace, const char *name, const char *category,
                               uint64_t link, uint64_t t0_ns, uint64_t t1_ns) {
    return record(trace, name, category, trace_tid(), link, t0_ns, t1_ns);
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

/* ---- packing: "TDTRACE1", rank, host, rows, events; strings as a length and bytes -------- */

static const char pack_magic[8] = "TDTRACE1";
#define PACK_NULL 0xffffffffu /* the length of a NULL string */

typedef struct {
    unsigned char *p;
    size_t len, cap;
    int failed;
} packer;

static void put(packer *w, const void *data, size_t n) {
    if (w->failed) return;
    if (w->len + n > w->cap) {
        size_t cap = w->cap ? w->cap : 4096;
        while (cap < w->len + n) cap *= 2;
        unsigned char *grown = realloc(w->p, cap);
        if (!grown) {
            w->failed = 1;
            return;
        }
        w->p = grown;
        w->cap = cap;
    }
    memcpy(w->p + w->len, data, n);
    w->len += n;
}

static void put_str(packer *w, const char *s) {
    uint32_t n = s ? (uint32_t)strlen(s) : PACK_NULL;
    put(w, &n, sizeof n);
    if (s) put(w, s, n);
}

td_status td_trace_pack(const td_trace *trace, void **bytes, size_t *len) {
    if (!trace || !bytes || !len) return td__fail(TD_EINVAL, "td_trace_pack: NULL argument");
    packer w = {0};
    pthread_mutex_lock((pthread_mutex_t *)&trace->lock);
    put(&w, pack_magic, sizeof pack_magic);
    int32_t rank = trace->rank;
    put(&w, &rank, sizeof rank);
    put_str(&w, trace->host);
    uint64_t nrows = trace->nrows, nevents = trace->count;
    put(&w, &nrows, sizeof nrows);
    for (size_t i = 0; i < trace->nrows; i++) {
        int32_t tid = trace->rows[i].tid;
        put(&w, &tid, sizeof tid);
        put_str(&w, trace->rows[i].name);
    }
    put(&w, &nevents, sizeof nevents);
    for (size_t i = 0; i < trace->count; i++) {
        const td_trace_event *e = &trace->events[i];
        int32_t tid = e->tid;
        uint64_t times[3] = {e->start_ns, e->dur_ns, e->link};
        put_str(&w, e->name);
        put_str(&w, e->category);
        put(&w, &tid, sizeof tid);
        put(&w, times, sizeof times);
    }
    pthread_mutex_unlock((pthread_mutex_t *)&trace->lock);
    if (w.failed) {
        free(w.p);
        return td__fail(TD_ENOMEM, "td_trace_pack: out of memory packing %llu spans",
                        (unsigned long long)nevents);
    }
    *bytes = w.p;
    *len = w.len;
    return TD_OK;
}

typedef struct {
    const unsigned char *p, *end;
    int bad;
} unpacker;

static void get(unpacker *r, void *out, size_t n) {
    if (r->bad || (size_t)(r->end - r->p) < n) {
        r->bad = 1;
        memset(out, 0, n);
        return;
    }
    memcpy(out, r->p, n);
    r->p += n;
}

/* A malloc'd copy of the next string, or NULL (for a NULL string, or when bad). */
static char *get_str(unpacker *r) {
    uint32_t n;
    get(r, &n, sizeof n);
    if (r->bad || n == PACK_NULL) return NULL;
    if ((size_t)(r->end - r->p) < n) {
        r->bad = 1;
        return NULL;
    }
    char *s = malloc((size_t)n + 1);
    if (!s) {
        r->bad = 1;
        return NULL;
    }
    memcpy(s, r->p, n);
    s[n] = '\0';
    r->p += n;
    return s;
}

td_status td_trace_unpack(td_trace **out, const void *bytes, size_t len) {
    if (!out || (!bytes && len)) return td__fail(TD_EINVAL, "td_trace_unpack: NULL argument");
    *out = NULL;
    unpacker r = {bytes, (const unsigned char *)bytes + len, 0};
    char magic[sizeof pack_magic];
    get(&r, magic, sizeof magic);
    if (r.bad || memcmp(magic, pack_magic, sizeof magic) != 0)
        return td__fail(TD_EFORMAT, "td_trace_unpack: %zu bytes are not a packed trace", len);
    int32_t rank;
    get(&r, &rank, sizeof rank);
    td_trace *t;
    TD__TRY(td_trace_create(&t, rank));
    td_status s = TD_OK;
    char *host = get_str(&r);
    if (host) s = td_trace_set_host(t, host);
    free(host);
    uint64_t nrows = 0, nevents = 0;
    get(&r, &nrows, sizeof nrows);
    for (uint64_t i = 0; i < nrows && !r.bad && !s; i++) {
        int32_t tid;
        get(&r, &tid, sizeof tid);
        char *name = get_str(&r);
        if (name) s = td_trace_name_track(t, tid, name);
        free(name);
    }
    get(&r, &nevents, sizeof nevents);
    for (uint64_t i = 0; i < nevents && !r.bad && !s; i++) {
        char *name = get_str(&r), *cat = get_str(&r);
        int32_t tid;
        uint64_t times[3];
        get(&r, &tid, sizeof tid);
        get(&r, times, sizeof times);
        if (!r.bad && name)
            s = record(t, name, cat, tid, times[2], times[0], times[0] + times[1]);
        else
            r.bad = 1;
        free(name);
        free(cat);
    }
    if (!s && (r.bad || r.p != r.end))
        s = td__fail(TD_EFORMAT, "td_trace_unpack: rank %d's packed trace is %s", (int)rank,
                     r.bad ? "cut short or damaged" : "followed by stray bytes");
    if (s) {
        td_trace_destroy(t);
        return s;
    }
    *out = t;
    return TD_OK;
}
