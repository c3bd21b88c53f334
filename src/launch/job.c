/* Supervision of the processes of one job on one host: reaping, the first failure, the stop
 * protocol (SIGTERM, then SIGKILL once the grace period is over) and, for the report, which
 * of the ranks still running are stopped. Shared by tandemrun and td_spawn; it never prints. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "launch/launch_impl.h"

const char *td__signal_name(int sig, char buf[16]) {
    const char *abbrev = sigabbrev_np(sig);
    if (!abbrev) return "unknown signal";
    snprintf(buf, 16, "SIG%s", abbrev);
    return buf;
}

void td__describe_exit(int status, char *out, size_t cap) {
    char name[16];
    if (WIFSIGNALED(status))
        snprintf(out, cap, "was killed by signal %d (%s)", WTERMSIG(status),
                 td__signal_name(WTERMSIG(status), name));
    else
        snprintf(out, cap, "exited with status %d", WEXITSTATUS(status));
}

int td__exit_code(int status) {
    return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

void td__job_init(td__job *j, td__proc *procs, int n, int own_groups, double grace_s) {
    memset(j, 0, sizeof *j);
    j->procs = procs;
    j->n = n;
    j->own_groups = own_groups;
    j->grace_s = grace_s;
    j->stop_on_failure = 1;
    j->exit_code = -1;
    j->first_failed = -1;
    for (int i = 0; i < n; i++) j->running += procs[i].running;
}

void td__job_add(td__job *j) {
    j->running += j->procs[j->n].running;
    j->n++;
}

void td__job_signal(td__job *j, int sig) {
    for (int i = 0; i < j->n; i++)
        if (j->procs[i].running) kill(j->own_groups ? -j->procs[i].pid : j->procs[i].pid, sig);
}

void td__job_stop(td__job *j, int sig, int exit_code) {
    if (j->exit_code < 0) j->exit_code = exit_code;
    if (j->stopping) return;
    j->stopping = 1;
    td__job_signal(j, sig);
    j->kill_at = td__now_s() + j->grace_s;
}

int td__job_reap(td__job *j) {
    int first = -1;
    for (int i = 0; i < j->n; i++) {
        td__proc *p = &j->procs[i];
        int st;
        /* Only our ranks: a library must not reap the caller's other children. */
        if (!p->running || waitpid(p->pid, &st, WNOHANG) != p->pid) continue;
        p->running = 0;
        p->status = st;
        j->running--;
        int failed = !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        if (!failed || j->stopping || j->first_failed >= 0) continue;
        first = i;
        j->first_failed = i;
        if (j->stop_on_failure) td__job_stop(j, SIGTERM, td__exit_code(st));
        /* Return now: the ranks just signalled are reaped by the next call, so `running`
         * still counts the ones this failure stops. */
        break;
    }
    return first;
}

void td__job_tick(td__job *j) {
    if (!j->stopping || j->kill_at <= 0) return;
    double t = td__now_s();
    if (t < j->kill_at) return;
    td__job_signal(j, SIGKILL);
    j->kill_at = t + 1.0;
}

/* 1 when /proc says the process is stopped by a signal (T) or traced (t). */
static int is_stopped(pid_t pid) {
    char state = td__proc_state((int)pid);
    return state == 'T' || state == 't';
}

int td__job_stopped_ranks(const td__job *j, char *out, size_t cap) {
    int found = 0;
    size_t len = 0;
    if (cap) out[0] = 0;
    for (int i = 0; i < j->n; i++) {
        const td__proc *p = &j->procs[i];
        if (!p->running || !is_stopped(p->pid)) continue;
        if (len < cap)
            len += (size_t)snprintf(out + len, cap - len, "%srank %d (pid %d)", found ? ", " : "",
                                    p->rank, (int)p->pid);
        found++;
    }
    return found;
}
