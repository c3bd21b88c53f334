/* Status strings and the per-thread "last error" message that names what went wrong. */
#include <stdarg.h>
#include <stdio.h>

#include "core_impl.h"

static _Thread_local char last_error[1024];

const char *td_status_string(td_status status) {
    switch (status) {
#define TD_STATUS_CASE(name, value, text) \
    case TD_##name:                       \
        return text;
        TD_STATUS_MAP(TD_STATUS_CASE)
#undef TD_STATUS_CASE
    }
    return "unknown status";
}

const char *td_last_error(void) { return last_error[0] ? last_error : "no error"; }

td_status td__fail(td_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    td__log(TD_LOG_DEBUG, "%s (%s)", last_error, td_status_string(status));
    return status;
}
