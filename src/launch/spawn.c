/* td_spawn: forks the calling program's ranks, gives each the env contract and its cores,
 * runs the entry function and supervises the job with a td_job, as tandemrun does (job.c).
 * The ranks stay in the caller's process group, so a Ctrl-C at the terminal reaches them too,
 * and die with the caller (PR_SET_PDEATHSIG). It installs no signal handlers. */
#include "tandem/spawn.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tandem/launch.h"

#include "core/core_impl.h"

td_spawn_params td_spawn_default_params(void) {
    td_spawn_params p = {.nprocs = 2,
                         .master_addr = NULL,
                         .master_port = 0,
                         .pin = 1,
                         .timeout_s = 0,
                         .grace_s = 5.0,
                         .stop_on_failure = 1,
                         .exit_status = NULL};
    return p;
}

/* The forked rank: never returns. */
static void run_rank(td_spawn_fn fn, void *arg, const td_rank_env *env, int pin, pid_t parent) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1); /* the caller died before prctl took effect */
    int cores[CPU_SETSIZE];
    int n = td_rank_cpus(env->local_rank, env->local_world_size, cores, CPU_SETSIZE);
    if (pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int k = 0; k < n; k++) CPU_SET(cores[k], &set);
        sched_setaffinity(0, sizeof set, &set);
    }
    if (td_rank_env_apply(env, n) != TD_OK) _exit(1);
    int rc = fn(env->rank, env->world_size, arg);
    fflush(NULL);
    _exit(rc & 0xff);
}

td_status td_spawn(td_spawn_fn fn, void *arg, const td_spawn_params *params) {
    td_spawn_params p = params ? *params : td_spawn_default_params();
    if (!fn) return td__fail(TD_EINVAL, "td_spawn: the entry function is NULL");
    if (p.nprocs < 1 || p.nprocs > 4096)
        return td__fail(TD_EINVAL, "td_spawn: nprocs is %d, expected 1 to 4096", p.nprocs);
    if (!(p.grace_s > 0) || p.timeout_s < 0)
        return td__fail(TD_EINVAL, "td_spawn: grace_s must be > 0 and timeout_s >= 0");
    char token[TD_JOB_TOKEN_LEN + 1];
    TD__TRY(td_job_token(token));
    int port = p.master_port;
    if (!port) TD__TRY(td_free_port(&port));
    td_job_params jp = td_job_default_params();
    jp.grace_s = p.grace_s;
    jp.stop_on_failure = p.stop_on_failure;
    td_job *j = NULL;
    TD__TRY(td_job_create(&j, &jp));
    pid_t self = getpid();
    td_status st = TD_OK;
    fflush(NULL);
    for (int r = 0; r < p.nprocs; r++) {
        td_rank_env env = {
            r, p.nprocs, r, p.nprocs, 0, p.master_addr ? p.master_addr : "127.0.0.1", port, token};
        pid_t pid = fork();
        if (pid == 0) run_rank(fn, arg, &env, p.pin, self);
        if (pid < 0)
            st = td__fail(TD_EIO, "td_spawn: cannot start rank %d: %s", r, strerror(errno));
        else
            st = td_job_add(j, r, pid);
        if (st != TD_OK) {
            if (pid > 0) { /* started, but the job could not take it */
                kill(pid, SIGKILL);
                waitpid(pid, NULL, 0);
            }
            td_job_stop(j, SIGKILL, 1);
            break;
        }
    }
    uint64_t deadline = p.timeout_s > 0 ? td_time_ns() + (uint64_t)(p.timeout_s * 1e9) : 0;
    int timed_out = 0;
    char stopped[256] = "";
    while (td_job_running(j) > 0) {
        if (td_job_reap(j) >= 0) td_job_stopped_ranks(j, stopped, sizeof stopped);
        if (!td_job_stopping(j) && deadline && td_time_ns() >= deadline) {
            timed_out = 1;
            td_job_stopped_ranks(j, stopped, sizeof stopped);
            td_job_stop(j, SIGTERM, 124);
        }
        td_job_tick(j);
        if (td_job_running(j) > 0) nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
    for (int r = 0; p.exit_status && r < p.nprocs; r++) p.exit_status[r] = td_job_get(j, r).status;
    if (st == TD_OK && timed_out) {
        st = td__fail(TD_ETIMEOUT, "td_spawn: the job of %d ranks outlived %g s%s%s%s", p.nprocs,
                      p.timeout_s, *stopped ? "; stopped: " : "", stopped,
                      *stopped ? " (SIGSTOP?)" : "");
    } else if (st == TD_OK && td_job_first_failure(j) >= 0) {
        td_job_proc f = td_job_get(j, td_job_first_failure(j));
        char how[96];
        td_exit_describe(f.status, how, sizeof how);
        st = td__fail(TD_EPEER, "td_spawn: rank %d (pid %d) %s%s%s%s", f.rank, (int)f.pid, how,
                      *stopped ? "; the others were waiting for " : "", stopped,
                      *stopped ? ", which is stopped" : "");
    }
    td_job_destroy(j);
    return st;
}
