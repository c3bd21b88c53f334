/* A process's scheduling state as /proc shows it, whether it has died, and which signals a
 * thread of it catches or blocks, for the supervisors that must tell a dead, stopped or running
 * peer apart (the launcher, the shm backend's liveness checks) and for the flight recorder's
 * signals (whether a rank has its dump handler, whether a thread can answer for its stack). */
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

int td__proc_signal(int pid, int tid, const char *field, int sig) {
    char path[96], line[256], key[32];
    if (tid > 0)
        snprintf(path, sizeof path, "/proc/%d/task/%d/status", pid, tid);
    else
        snprintf(path, sizeof path, "/proc/%d/status", pid);
    snprintf(key, sizeof key, "%s: %%llx", field);
    FILE *f = fopen(path, "r");
    unsigned long long mask = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, key, &mask) == 1) break;
    if (f) fclose(f);
    return sig >= 1 && sig <= 64 ? (int)((mask >> (sig - 1)) & 1) : 0;
}

int td__pid_dead(int pid) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    /* A killed child stays a zombie until its parent reaps it; it is dead all the same. */
    char state = td__proc_state(pid);
    return state == 'Z' || state == 'X';
}
