/* The process-wide log sink. The library never prints unless a sink is installed. */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>

#include "core_impl.h"

static td_log_fn log_fn;
static void *log_ctx;
static _Atomic int log_max_level = -1;

void td_log_set_callback(td_log_fn fn, void *ctx, td_log_level max_level) {
    log_fn = fn;
    log_ctx = ctx;
    atomic_store(&log_max_level, fn ? (int)max_level : -1);
}

void td_log_stderr(td_log_level level, const char *message, void *ctx) {
    static const char *names[] = {"error", "warn", "info", "debug"};
    (void)ctx;
    fprintf(stderr, "[tandem %s] %s\n", names[level], message);
}

void td__log(td_log_level level, const char *fmt, ...) {
    if ((int)level > atomic_load(&log_max_level)) return;
    char message[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    td_log_fn fn = log_fn;
    if (fn) fn(level, message, log_ctx);
}
