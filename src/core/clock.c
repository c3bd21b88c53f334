/* The monotonic clock every timing in tandem reads. */
#define _POSIX_C_SOURCE 200809L
#include <time.h>

#include "tandem/core.h"

uint64_t td_time_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
