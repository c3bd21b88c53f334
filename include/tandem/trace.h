/* td_trace: a thread-safe recorder of timed spans, written as Chrome trace JSON.
 *
 * A span is (name, category, thread, start, duration) on td_time_ns's monotonic clock, which
 * every process of one host shares, so the files of several ranks line up when loaded
 * together. td_trace_write produces {"traceEvents": [...]} with complete events ("ph":"X",
 * ts and dur in microseconds, pid = the rank given at creation, tid = the kernel thread id)
 * that Perfetto (ui.perfetto.dev) and chrome://tracing open. It does not sample, flush on
 * its own, or merge files of different ranks. */
#ifndef TANDEM_TRACE_H
#define TANDEM_TRACE_H

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An opaque span recorder; its owner creates and destroys it. */
typedef struct td_trace td_trace;

/* One recorded span as td_trace_event returns it. */
typedef struct {
    const char *name;     /* owned by the trace, valid until td_trace_destroy */
    const char *category; /* owned by the trace; "" when none was given */
    int tid;              /* kernel thread id of the recording thread */
    uint64_t start_ns;    /* td_time_ns at the start */
    uint64_t dur_ns;      /* end - start */
} td_trace_event;

/* Creates an empty recorder whose events carry pid = `rank` (use 0 in one process). */
td_status td_trace_create(td_trace **out, int rank);

/* Frees the recorder and every event it holds. */
void td_trace_destroy(td_trace *trace);

/* Records a span from t0_ns to t1_ns (td_time_ns values) on the calling thread; the name and
 * category (NULL for none) are copied. */
td_status td_trace_span(td_trace *trace, const char *name, const char *category, uint64_t t0_ns,
                        uint64_t t1_ns);

/* Starts a span on the calling thread; returns the start time to pass to td_trace_end. */
uint64_t td_trace_begin(td_trace *trace);

/* Ends the span started at t0_ns (from td_trace_begin) now, and records it. */
td_status td_trace_end(td_trace *trace, const char *name, const char *category, uint64_t t0_ns);

/* Records a span from t0_ns to t1_ns attributed to thread `tid` instead of the caller. */
td_status td_trace_span_on(td_trace *trace, const char *name, const char *category, int tid,
                           uint64_t t0_ns, uint64_t t1_ns);

/* Number of spans recorded so far. */
size_t td_trace_count(const td_trace *trace);

/* Copies span `index` (in recording order) into *out; TD_EINVAL when out of range. */
td_status td_trace_event_get(const td_trace *trace, size_t index, td_trace_event *out);

/* Writes the Chrome trace JSON to `path` atomically (a temporary file, then rename). */
td_status td_trace_write(const td_trace *trace, const char *path);

#ifdef __cplusplus
}
#endif
#endif
