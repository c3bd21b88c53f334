/* Chrome trace JSON from one or several traces: process and thread rows named, spans as
 * complete events, and for the spans of one collective call on several ranks the args and flow
 * arrows that show who arrived last. One rank's file is the merged file of one trace.
 *
 * The file is written to a temporary name and renamed, so a reader never sees half of it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core_impl.h"
#include "trace_impl.h"

/* A name as a JSON string. */
static void trace_put_string(FILE *f, const char *s) {
    char small[256], *text = small;
    size_t n = strlen(s), need = td__json_escape(small, sizeof small, s, n);
    if (need >= sizeof small && (text = malloc(need + 1)) != NULL)
        td__json_escape(text, need + 1, s, n);
    fprintf(f, "\"%s\"", text ? text : small);
    if (text != small) free(text);
}

/* Microseconds with nanosecond decimals: Chrome's unit, without losing precision. */
static void put_us(FILE *f, const char *key, int64_t ns) {
    if (ns < 0) ns = 0;
    fprintf(f, ",\"%s\":%lld.%03d", key, (long long)(ns / 1000), (int)(ns % 1000));
}

/* One linked span of the merged traces. */
typedef struct {
    uint64_t link;
    size_t trace, event;
    int64_t start, end; /* on the first trace's clock */
} linked;

static int by_link(const void *a, const void *b) {
    const linked *x = a, *y = b;
    if (x->link != y->link) return x->link < y->link ? -1 : 1;
    return x->trace < y->trace ? -1 : x->trace > y->trace;
}

static int by_value(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Of each call, the span of the rank that arrived last, and how long each span waited for it. */
typedef struct {
    int last_rank; /* -1: not joined to another rank's span */
    int64_t waited;
} arrival;

/* How far trace i's clock is from trace 0's: 0 on the same host; else the median difference
 * of the ends of the calls both recorded (a sorted copy of trace 0's links to search). */
static int64_t clock_offset(const td_trace *const *traces, size_t i, const linked *first,
                            size_t nfirst) {
    const td_trace *t = traces[i], *t0 = traces[0];
    if (!t->host || !t0->host || strcmp(t->host, t0->host) == 0) return 0;
    int64_t *diffs = malloc((t->count + 1) * sizeof *diffs);
    size_t n = 0;
    for (size_t e = 0; diffs && e < t->count; e++) {
        const td_trace_event *ev = &t->events[e];
        if (!ev->link) continue;
        linked key = {.link = ev->link};
        const linked *hit = bsearch(&key, first, nfirst, sizeof *first, by_link);
        if (hit) diffs[n++] = hit->end - (int64_t)(ev->start_ns + ev->dur_ns);
    }
    int64_t offset = 0;
    if (n) {
        qsort(diffs, n, sizeof *diffs, by_value);
        offset = diffs[n / 2];
    }
    free(diffs);
    return offset;
}

/* Fills arrivals[i][e] for every linked span; `all` holds every linked span, sorted by link. */
static void find_arrivals(const linked *all, size_t nall, const td_trace *const *traces,
                          arrival **arrivals) {
    for (size_t a = 0; a < nall;) {
        size_t b = a, last = a;
        while (b < nall && all[b].link == all[a].link) {
            if (all[b].start > all[last].start) last = b;
            b++;
        }
        if (b - a > 1) {
            for (size_t k = a; k < b; k++) {
                arrival *ar = &arrivals[all[k].trace][all[k].event];
                ar->last_rank = traces[all[last].trace]->rank;
                ar->waited = all[last].start - all[k].start;
            }
        }
        a = b;
    }
}

/* The name of a row nobody named: its first span's category and the id. Kernel thread ids are
 * small; the tracks of td_trace_span_on are far above them. */
static void fallback_name(const td_trace *t, int tid, char *out, size_t cap) {
    const char *cat = "";
    for (size_t e = 0; e < t->count; e++)
        if (t->events[e].tid == tid) {
            cat = t->events[e].category;
            break;
        }
    if (tid >= 0x10000000)
        snprintf(out, cap, "%s%strack %d", cat, *cat ? " " : "", tid & 0xffff);
    else
        snprintf(out, cap, "%s%sthread %d", cat, *cat ? " " : "", tid);
}

/* The metadata events naming t's rows; the file's first event is written without a comma. */
static void write_rows(FILE *f, const td_trace *t, int first) {
    char name[160];
    if (t->host)
        snprintf(name, sizeof name, "rank %d (%s)", t->rank, t->host);
    else
        snprintf(name, sizeof name, "rank %d", t->rank);
    fprintf(f, "%s{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":",
            first ? "" : ",\n", t->rank);
    trace_put_string(f, name);
    fprintf(f, "}}");
    fprintf(f,
            ",\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{"
            "\"sort_index\":%d}}",
            t->rank, t->rank);
    /* Named rows first, in the order they were named; then the others by first appearance. */
    for (size_t i = 0; i < t->nrows; i++) {
        fprintf(f,
                ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{"
                "\"name\":",
                t->rank, t->rows[i].tid);
        trace_put_string(f, t->rows[i].name);
        fprintf(f, "}}");
        fprintf(f,
                ",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{"
                "\"sort_index\":%zu}}",
                t->rank, t->rows[i].tid, i);
    }
    int *seen = malloc((t->count + 1) * sizeof *seen); /* unnamed rows written so far */
    size_t nseen = 0;
    for (size_t e = 0; seen && e < t->count; e++) {
        int tid = t->events[e].tid, known = 0;
        for (size_t i = 0; i < t->nrows && !known; i++) known = t->rows[i].tid == tid;
        for (size_t k = 0; k < nseen && !known; k++) known = seen[k] == tid;
        if (known) continue;
        seen[nseen++] = tid;
        fallback_name(t, tid, name, sizeof name);
        fprintf(f,
                ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{"
                "\"name\":",
                t->rank, tid);
        trace_put_string(f, name);
        fprintf(f, "}}");
    }
    free(seen);
}

static void write_flows(FILE *f, const linked *all, size_t nall, const td_trace *const *traces) {
    long id = 0;
    for (size_t a = 0; a < nall;) {
        size_t b = a, last = a;
        while (b < nall && all[b].link == all[a].link) {
            if (all[b].start > all[last].start) last = b;
            b++;
        }
        const td_trace *lt = traces[all[last].trace];
        const td_trace_event *le = &lt->events[all[last].event];
        for (size_t k = a; b - a > 1 && k < b; k++) {
            if (k == last) continue;
            const td_trace *t = traces[all[k].trace];
            const td_trace_event *e = &t->events[all[k].event];
            /* From the last arrival's start to the moment it reached this rank's span. */
            int64_t at = all[last].start;
            if (at < all[k].start) at = all[k].start;
            if (at > all[k].end) at = all[k].end;
            id++;
            fprintf(f,
                    ",\n{\"name\":\"waited for rank %d\",\"cat\":\"wait\",\"ph\":\"s\",\"id\":%ld,"
                    "\"pid\":%d,\"tid\":%d",
                    lt->rank, id, lt->rank, le->tid);
            put_us(f, "ts", all[last].start);
            fprintf(f, "}");
            fprintf(
                f,
                ",\n{\"name\":\"waited for rank %d\",\"cat\":\"wait\",\"ph\":\"f\",\"bp\":\"e\","
                "\"id\":%ld,\"pid\":%d,\"tid\":%d",
                lt->rank, id, t->rank, e->tid);
            put_us(f, "ts", at);
            fprintf(f, "}");
        }
        a = b;
    }
}

static td_status write_all(FILE *f, const td_trace *const *traces, size_t n, const linked *all,
                           size_t nall, int64_t *const offsets, arrival *const *arrivals) {
    fprintf(f, "{\"traceEvents\":[\n");
    for (size_t i = 0; i < n; i++) write_rows(f, traces[i], i == 0);
    for (size_t i = 0; i < n; i++) {
        const td_trace *t = traces[i];
        for (size_t e = 0; e < t->count; e++) {
            const td_trace_event *ev = &t->events[e];
            fprintf(f, ",\n{\"name\":");
            trace_put_string(f, ev->name);
            fprintf(f, ",\"cat\":");
            trace_put_string(f, ev->category);
            fprintf(f, ",\"ph\":\"X\"");
            put_us(f, "ts", (int64_t)ev->start_ns + offsets[i]);
            put_us(f, "dur", (int64_t)ev->dur_ns);
            fprintf(f, ",\"pid\":%d,\"tid\":%d", t->rank, ev->tid);
            const arrival *ar = &arrivals[i][e];
            if (ev->link && ar->last_rank >= 0) {
                fprintf(f, ",\"args\":{\"last to arrive\":\"rank %d\",\"waited (us)\":%.3f}",
                        ar->last_rank, (double)ar->waited / 1e3);
            }
            fprintf(f, "}");
        }
    }
    write_flows(f, all, nall, traces);
    fprintf(f, "\n],\"displayTimeUnit\":\"ms\"}\n");
    return ferror(f) ? TD_EIO : TD_OK;
}

td_status td_trace_write_merged(const td_trace *const *traces, size_t n, const char *path) {
    if (!traces || !n || !path) return td__fail(TD_EINVAL, "td_trace_write: no traces or no path");
    for (size_t i = 0; i < n; i++) {
        if (!traces[i]) return td__fail(TD_EINVAL, "td_trace_write: trace %zu is NULL", i);
        for (size_t j = 0; j < i; j++)
            if (traces[j] == traces[i])
                return td__fail(TD_EINVAL, "td_trace_write: traces %zu and %zu are the same", j, i);
    }
    for (size_t i = 0; i < n; i++) pthread_mutex_lock((pthread_mutex_t *)&traces[i]->lock);
    td_status s = TD_OK;
    size_t nall = 0, nfirst = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t e = 0; e < traces[i]->count; e++) nall += traces[i]->events[e].link != 0;
    linked *all = malloc((nall + 1) * sizeof *all), *first = malloc((nall + 1) * sizeof *first);
    int64_t *offsets = calloc(n, sizeof *offsets);
    arrival **arrivals = calloc(n, sizeof *arrivals);
    if (!all || !first || !offsets || !arrivals) s = TD_ENOMEM;
    for (size_t i = 0; !s && i < n; i++) {
        arrivals[i] = malloc((traces[i]->count + 1) * sizeof **arrivals);
        if (!arrivals[i]) s = TD_ENOMEM;
        for (size_t e = 0; !s && e < traces[i]->count; e++) arrivals[i][e].last_rank = -1;
    }
    if (!s) {
        for (size_t e = 0; e < traces[0]->count; e++) {
            const td_trace_event *ev = &traces[0]->events[e];
            if (ev->link)
                first[nfirst++] = (linked){ev->link, 0, e, (int64_t)ev->start_ns,
                                           (int64_t)(ev->start_ns + ev->dur_ns)};
        }
        qsort(first, nfirst, sizeof *first, by_link);
        nall = 0;
        for (size_t i = 0; i < n; i++) {
            offsets[i] = clock_offset(traces, i, first, nfirst);
            for (size_t e = 0; e < traces[i]->count; e++) {
                const td_trace_event *ev = &traces[i]->events[e];
                int64_t start = (int64_t)ev->start_ns + offsets[i];
                if (ev->link)
                    all[nall++] = (linked){ev->link, i, e, start, start + (int64_t)ev->dur_ns};
            }
        }
        qsort(all, nall, sizeof *all, by_link);
        find_arrivals(all, nall, traces, arrivals);
    }
    char *tmp = NULL;
    FILE *f = NULL;
    int err = 0; /* the system's reason when the file could not be written */
    if (!s) {
        size_t plen = strlen(path);
        tmp = malloc(plen + 32);
        if (!tmp) s = TD_ENOMEM;
        if (tmp) snprintf(tmp, plen + 32, "%s.tmp.%ld", path, (long)getpid());
        if (tmp && !(f = fopen(tmp, "w"))) s = TD_EIO, err = errno;
    }
    if (f) {
        errno = 0;
        s = write_all(f, traces, n, all, nall, offsets, arrivals);
        if (s) err = errno;
        if (fclose(f) != 0 && !s) s = TD_EIO, err = errno;
        if (!s && rename(tmp, path) != 0) s = TD_EIO, err = errno;
        if (s) remove(tmp);
    }
    for (size_t i = 0; i < n; i++) pthread_mutex_unlock((pthread_mutex_t *)&traces[i]->lock);
    for (size_t i = 0; arrivals && i < n; i++) free(arrivals[i]);
    free(arrivals);
    free(offsets);
    free(first);
    free(all);
    free(tmp);
    if (s == TD_ENOMEM) return td__fail(s, "td_trace_write: out of memory writing %s", path);
    if (s) return td__fail(s, "cannot write %s: %s", path, err ? strerror(err) : "write error");
    return TD_OK;
}

td_status td_trace_write(const td_trace *trace, const char *path) {
    if (!trace || !path) return td__fail(TD_EINVAL, "td_trace_write: trace or path is NULL");
    return td_trace_write_merged(&trace, 1, path);
}
