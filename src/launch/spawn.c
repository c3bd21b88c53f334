/* td_spawn: forks the calling program's ranks, gives each the env contract and its cores,
 * runs the entry function and supervises the job with the same core as tandemrun (job.c).
 * The ranks stay in the caller's process group, so a Ctrl-C at the terminal reaches them too,
 * and die with the caller (PR_SET_PDEATHSIG). It installs no signal handlers. */
#include "tandem/spawn.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "launch/launch_impl.h"

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
static void run_rank(td_spawn_fn fn, void *arg, const td__rank_env *env, const cpu_set_t *cpus,
                     int pin, pid_t parent) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1); /* the caller died before prctl took effect */
    if (pin) sched_setaffinity(0, sizeof *cpus, cpus);
    td__rank_env_apply(env, CPU_COUNT(cpus));
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
    char token[33];
    TD__TRY(td__job_token(token));
    int port = p.master_port ? p.master_port : td__free_port();
    if (port <= 0) return td__fail(TD_EIO, "td_spawn: no free port for MASTER_PORT");
    int cpus[CPU_SETSIZE];
    int ncpus = td__allowed_cpus(cpus, CPU_SETSIZE);
    td__proc *procs = calloc((size_t)p.nprocs, sizeof *procs);
    if (!procs) return td__fail(TD_ENOMEM, "td_spawn: out of memory");
    pid_t self = getpid();
    td__job j;
    td__job_init(&j, procs, 0, 0, p.grace_s);
    j.stop_on_failure = p.stop_on_failure;
    td_status st = TD_OK;
    fflush(NULL);
    for (int r = 0; r < p.nprocs; r++) {
        td__rank_env env = {
            r, p.nprocs, r, p.nprocs, 0, p.master_addr ? p.master_addr : "127.0.0.1", port, token};
        cpu_set_t set;
        td__rank_cpus(r, p.nprocs, cpus, ncpus, &set);
        pid_t pid = fork();
        if (pid == 0) run_rank(fn, arg, &env, &set, p.pin, self);
        if (pid < 0) {
            st = td__fail(TD_EIO, "td_spawn: cannot start rank %d: %s", r, strerror(errno));
            td__job_stop(&j, SIGKILL, 1);
            break;
        }
        procs[r] = (td__proc){.rank = r, .pid = pid, .running = 1};
        td__job_add(&j);
    }
    double deadline = p.timeout_s > 0 ? td__now_s() + p.timeout_s : 0;
    int timed_out = 0;
    char stopped[256] = "";
    while (j.running > 0) {
        if (td__job_reap(&j) >= 0) td__job_stopped_ranks(&j, stopped, sizeof stopped);
        if (!j.stopping && deadline > 0 && td__now_s() >= deadline) {
            timed_out = 1;
            td__job_stopped_ranks(&j, stopped, sizeof stopped);
            td__job_stop(&j, SIGTERM, 124);
        }
        td__job_tick(&j);
        if (j.running > 0) nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
    for (int r = 0; p.exit_status && r < j.n; r++) p.exit_status[r] = procs[r].status;
    if (st == TD_OK && timed_out) {
        st = td__fail(TD_ETIMEOUT, "td_spawn: the job of %d ranks outlived %g s%s%s%s", p.nprocs,
                      p.timeout_s, *stopped ? "; stopped: " : "", stopped,
                      *stopped ? " (SIGSTOP?)" : "");
    } else if (st == TD_OK && j.first_failed >= 0) {
        const td__proc *f = &procs[j.first_failed];
        char how[96];
        td__describe_exit(f->status, how, sizeof how);
        st = td__fail(TD_EPEER, "td_spawn: rank %d (pid %d) %s%s%s%s", f->rank, (int)f->pid, how,
                      *stopped ? "; the others were waiting for " : "", stopped,
                      *stopped ? ", which is stopped" : "");
    }
    free(procs);
    return st;
}
