/* Supervision of the processes of one job on one host: reaping, the first failure, the stop
 * protocol (SIGTERM, then SIGKILL once the grace period is over) and, for the report, which
 * of the ranks still running are stopped. Shared by tandemrun and td_spawn; it never prints. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "tandem/launch.h"

#include "core/core_impl.h"

struct td_job {
    td_job_proc *procs; /* (cap) in order of td_job_add */
    int n, cap;
    int running; /* not yet reaped */
    td_job_params p;
    int stopping;     /* the job is being torn down */
    double kill_at;   /* when stopping: SIGKILL the survivors at this time (0: done) */
    int exit_code;    /* -1 until something decides it */
    int first_failed; /* index of the first rank that failed, or -1 */
};

static double now_s(void) { return (double)td_time_ns() * 1e-9; }

const char *td_signal_name(int sig, char buf[16]) {
    const char *abbrev = sigabbrev_np(sig);
    if (!abbrev) return "unknown signal";
    snprintf(buf, 16, "SIG%s", abbrev);
    return buf;
}

void td_exit_describe(int status, char *out, size_t cap) {
    char name[16];
    if (WIFSIGNALED(status))
        snprintf(out, cap, "was killed by signal %d (%s)", WTERMSIG(status),
                 td_signal_name(WTERMSIG(status), name));
    else
        snprintf(out, cap, "exited with status %d", WEXITSTATUS(status));
}

int td_process_catches(pid_t pid, int sig) { return td__proc_signal((int)pid, 0, "SigCgt", sig); }

int td_exit_code(int status) {
    return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

td_job_params td_job_default_params(void) {
    return (td_job_params){.grace_s = 5.0, .stop_on_failure = 1, .own_groups = 0};
}

td_status td_job_create(td_job **out, const td_job_params *params) {
    if (!out) return td__fail(TD_EINVAL, "td_job_create: out is NULL");
    *out = NULL;
    td_job_params p = params ? *params : td_job_default_params();
    if (!(p.grace_s > 0))
        return td__fail(TD_EINVAL, "td_job_create: grace_s is %g, expected > 0", p.grace_s);
    td_job *j = calloc(1, sizeof *j);
    if (!j) return td__fail(TD_ENOMEM, "td_job_create: out of memory");
    j->p = p;
    j->exit_code = -1;
    j->first_failed = -1;
    *out = j;
    return TD_OK;
}

void td_job_destroy(td_job *j) {
    if (!j) return;
    free(j->procs);
    free(j);
}

td_status td_job_add(td_job *j, int rank, pid_t pid) {
    if (pid <= 0) return td__fail(TD_EINVAL, "td_job_add: rank %d has pid %d", rank, (int)pid);
    if (j->n == j->cap) {
        int cap = j->cap ? 2 * j->cap : 16;
        td_job_proc *grown = realloc(j->procs, (size_t)cap * sizeof *grown);
        if (!grown) return td__fail(TD_ENOMEM, "td_job_add: out of memory for %d ranks", cap);
        j->procs = grown;
        j->cap = cap;
    }
    j->procs[j->n++] = (td_job_proc){.rank = rank, .pid = pid, .running = 1};
    j->running++;
    return TD_OK;
}

td_job_proc td_job_get(const td_job *j, int index) {
    if (index < 0 || index >= j->n) return (td_job_proc){.rank = -1};
    return j->procs[index];
}

int td_job_running(const td_job *j) { return j->running; }

int td_job_stopping(const td_job *j) { return j->stopping; }

int td_job_exit_code(const td_job *j) { return j->exit_code; }

int td_job_first_failure(const td_job *j) { return j->first_failed; }

void td_job_signal(td_job *j, int sig) {
    for (int i = 0; i < j->n; i++)
        if (j->procs[i].running) kill(j->p.own_groups ? -j->procs[i].pid : j->procs[i].pid, sig);
}

void td_job_stop(td_job *j, int sig, int exit_code) {
    if (j->exit_code < 0) j->exit_code = exit_code;
    if (j->stopping) return;
    j->stopping = 1;
    td_job_signal(j, sig);
    j->kill_at = now_s() + j->p.grace_s;
}

int td_job_reap(td_job *j) {
    int first = -1;
    for (int i = 0; i < j->n; i++) {
        td_job_proc *p = &j->procs[i];
        int st;
        /* Only our ranks: a library must not reap the caller's other children. */
        if (!p->running || waitpid(p->pid, &st, WNOHANG) != p->pid) continue;
        p->running = 0;
        p->status = st;
        j->running--;
        int failed = !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        if (!failed || j->stopping || j->first_failed >= 0) continue;
        /* Of the ranks that ended in one pass, one killed by a signal is the likelier cause:
         * the others most often gave up because of it. */
        if (first < 0 || (WIFSIGNALED(st) && !WIFSIGNALED(j->procs[first].status))) first = i;
    }
    if (first >= 0) {
        j->first_failed = first;
        /* Signalled after the pass: the ranks this failure stops are reaped by later calls,
         * so `running` still counts them. */
        if (j->p.stop_on_failure) td_job_stop(j, SIGTERM, td_exit_code(j->procs[first].status));
    }
    return first;
}

double td_job_tick(td_job *j) {
    if (!j->stopping || j->kill_at <= 0 || j->running == 0) return -1;
    double t = now_s();
    if (t >= j->kill_at) {
        td_job_signal(j, SIGKILL);
        j->kill_at = t + 1.0; /* again while any is left: a rank may have forked meanwhile */
    }
    return j->kill_at - t;
}

/* 1 when /proc says the process is stopped by a signal (T) or traced (t). */
static int is_stopped(pid_t pid) {
    char state = td__proc_state((int)pid);
    return state == 'T' || state == 't';
}

int td_job_stopped_ranks(const td_job *j, char *out, size_t cap) {
    int found = 0;
    size_t len = 0;
    if (cap) out[0] = 0;
    for (int i = 0; i < j->n; i++) {
        const td_job_proc *p = &j->procs[i];
        if (!p->running || !is_stopped(p->pid)) continue;
        if (len < cap)
            len += (size_t)snprintf(out + len, cap - len, "%srank %d (pid %d)", found ? ", " : "",
                                    p->rank, (int)p->pid);
        found++;
    }
    return found;
}
