/* Internal helpers shared by every subsystem: setting the thread's error message and
 * logging, and the early-return macro every layer uses. Not installed. */
#ifndef TANDEM_CORE_IMPL_H
#define TANDEM_CORE_IMPL_H

#include "tandem/core.h"

#if defined(__GNUC__)
#define TD__PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define TD__PRINTF(a, b)
#endif

/* Records a formatted message as this thread's last error and returns `status`, so that
 * failures read `return td__fail(TD_EFORMAT, "%s: truncated", path);`. */
td_status td__fail(td_status status, const char *fmt, ...) TD__PRINTF(2, 3);

/* Returns from the calling function with the status of `call` when it is an error. */
#define TD__TRY(call)                     \
    do {                                  \
        td_status td_t_ = (call);         \
        if (td_t_ != TD_OK) return td_t_; \
    } while (0)

/* Sends a formatted message to the installed log sink, if any accepts `level`. */
void td__log(td_log_level level, const char *fmt, ...) TD__PRINTF(2, 3);

#endif
