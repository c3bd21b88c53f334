/* A process's scheduling state as /proc shows it, for the supervisors that must tell a dead,
 * stopped or running peer apart (the launcher, the shm backend's liveness checks). */
#include <stdio.h>
#include <string.h>

#include "core/core_impl.h"

char td__proc_state(int pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    /* "pid (comm) S ...": comm may hold spaces and parentheses, the last ')' ends it. */
    char *p = strrchr(buf, ')');
    return p && p[1] == ' ' ? p[2] : 0;
}
