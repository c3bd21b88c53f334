/* td_trace: a thread-safe recorder of timed spans, written as Chrome trace JSON.
 *
 * A span is (name, category, thread, start, duration) on td_time_ns's monotonic clock, which
 * every process of one host shares, so the traces of several ranks line up when merged.
 * td_trace_write produces {"traceEvents": [...]} with complete events ("ph":"X", ts and dur in
 * microseconds, pid = the rank given at creation, tid = the kernel thread id) that Perfetto
 * (ui.perfetto.dev) and chrome://tracing open; rows are named after the rank (and its host,
 * td_trace_set_host) and after the threads (td_trace_name_thread). It does not sample or flush
 * on its own.
 *
 * One trace of a whole job: every rank records into its own td_trace, td_trace_pack turns it
 * into bytes that travel to one process (td_comm_trace_write in comm.h gathers them over the
 * group), and td_trace_write_merged writes them as one file, a process row per rank. Spans of
 * one collective call carry the same link on every rank (td_trace_span_linked): the merged
 * file joins them with flow arrows from the rank that arrived last, the one the others waited
 * for, to each of the others. tandemrun --trace DIR (TANDEM_TRACE=DIR, also under mpirun) has
 * the job's process groups do all of this (docs/tracing.md). */
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
    uint64_t link;        /* 0, or the key of the collective call this span is on every rank */
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

/* Records a span of one collective call on the calling thread. `link` (not 0) is the same on
 * every rank for the same call, and different for different calls (the process group and the
 * call's sequence number), so that a merged trace joins the ranks' spans of the call. */
td_status td_trace_span_linked(td_trace *trace, const char *name, const char *category,
                               uint64_t link, uint64_t t0_ns, uint64_t t1_ns);

/* Names the calling thread's row ("compute", "communication"); the name is copied. */
td_status td_trace_name_thread(td_trace *trace, const char *name);

/* Names the row of `tid` (a thread, or a track of td_trace_span_on). A row without a name is
 * called after its spans' category and id ("ddp 2130706432"). */
td_status td_trace_name_track(td_trace *trace, int tid, const char *name);

/* The name of `tid`'s row, or NULL; owned by the trace, valid until the next naming call. */
const char *td_trace_track_name(const td_trace *trace, int tid);

/* Says which host the trace's clock belongs to: the rank's row reads "rank R (host)", and a
 * merged trace moves other hosts' spans onto the first trace's clock (below). */
td_status td_trace_set_host(td_trace *trace, const char *host);

/* The rank given at creation. */
int td_trace_rank(const td_trace *trace);

/* Number of spans recorded so far. */
size_t td_trace_count(const td_trace *trace);

/* Copies span `index` (in recording order) into *out; TD_EINVAL when out of range. */
td_status td_trace_event_get(const td_trace *trace, size_t index, td_trace_event *out);

/* Writes the Chrome trace JSON to `path` atomically (a temporary file, then rename). */
td_status td_trace_write(const td_trace *trace, const char *path);

/* The trace as bytes (its rank, host, row names and spans) for td_trace_unpack in another
 * process of the same architecture; *bytes is malloc'd, the caller frees it. */
td_status td_trace_pack(const td_trace *trace, void **bytes, size_t *len);

/* A new trace from td_trace_pack's bytes (the caller destroys it); TD_EFORMAT when they are
 * not a packed trace, or are cut short. */
td_status td_trace_unpack(td_trace **out, const void *bytes, size_t len);

/* Keeps the trace in the file `path` from now on: what it holds, then every span and name as
 * it is recorded (one write each, about a microsecond), so that a process killed mid-run
 * leaves what it recorded there for td_trace_read. NULL ends the keeping (the file is then
 * whole, and stays). A write that fails (a full disk) stops the keeping and leaves the file
 * with the records before it; td_trace_keep_error says so. */
td_status td_trace_keep(td_trace *trace, const char *path);

/* NULL while the kept file holds every record, else why it stopped growing (the path, how far
 * it got, the system's reason); owned by the trace. */
const char *td_trace_keep_error(const td_trace *trace);

/* A new trace from a file td_trace_keep kept (the caller destroys it), up to its last whole
 * record when its process was killed while writing; TD_EFORMAT when it is not one. */
td_status td_trace_read(td_trace **out, const char *path);

/* Writes n traces (of different ranks) as one Chrome trace at `path`, atomically: a process row
 * per trace, ordered by rank, its threads and tracks as rows beneath. Spans with the same link
 * in several traces are one collective call: each gets args saying who arrived last and how
 * long this rank waited for it, and a flow arrow runs from the last arrival's span to every
 * other rank's. Traces from another host than the first trace's (td_trace_set_host) are
 * shifted by the median difference of their linked spans' ends from the first trace's (the
 * ranks leave a collective together), as their clocks share no origin. */
td_status td_trace_write_merged(const td_trace *const *traces, size_t n, const char *path);

#ifdef __cplusplus
}
#endif
#endif
