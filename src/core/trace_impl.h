/* What trace.c (recording, rows, packing) and trace_json.c (writing) share: the recorder's
 * layout. Not installed. */
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
};

#endif
