/* A process's scheduling state as /proc shows it, and whether it has died, for the supervisors
 * that must tell a dead, stopped or running peer apart (the launcher, the shm backend's liveness
 * checks). */
#include <errno.h>
#include <signal.h>
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

int td__pid_dead(int pid) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    /* A killed child stays a zombie until its parent reaps it; it is dead all the same. */
    char state = td__proc_state(pid);
    return state == 'Z' || state == 'X';
}
