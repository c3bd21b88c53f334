/* What trace.c (recording, rows), trace_pack.c (packing, keeping) and trace_json.c (writing)
 * share: the recorder's layout. Not installed. */
#ifndef TANDEM_TRACE_IMPL_H
#define TANDEM_TRACE_IMPL_H

#include <pthread.h>

#include "tandem/trace.h"

/* A named row: a thread, or a track of td_trace_span_on. */
typedef struct {
    int tid;
    char *name;
} td__trace_row;

struct td_trace {
    pthread_mutex_t lock;
    int rank;
    char *host;             /* NULL until td_trace_set_host */
    td_trace_event *events; /* (cap) of which (count) are recorded */
    size_t count, cap;
    td__trace_row *rows; /* (cap_rows) of which (nrows), in naming order */
    size_t nrows, cap_rows;
    int keep_fd;      /* -1, or the file each record is appended to as it comes (td_trace_keep) */
    long long kept;   /* bytes of whole records in that file */
    char *keep_path;  /* its path, for the message when it cannot grow */
    char *keep_error; /* NULL, or why the keeping stopped early (a full disk, say) */
};

/* Records a span from t0_ns to t1_ns on row `tid` with `link` (0: none); what the public
 * td_trace_span* calls and unpacking go through. */
td_status td__trace_record(td_trace *trace, const char *name, const char *category, int tid,
                           uint64_t link, uint64_t t0_ns, uint64_t t1_ns);

/* Append one record to the kept file (the caller holds the lock and keep_fd >= 0); a write
 * that fails cuts the file back to its whole records and stops the keeping, saying why. */
void td__trace_keep_span(td_trace *trace, const td_trace_event *event);
void td__trace_keep_row(td_trace *trace, const td__trace_row *row);
void td__trace_keep_host(td_trace *trace);

#endif
