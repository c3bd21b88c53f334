/* What tandemrun and td_spawn share: the env contract a rank is started with, the job token
 * and port, how the allowed cores are split among ranks, and the supervision of a job's
 * processes (reaping, the first failure, SIGTERM then SIGKILL after a grace period, and naming
 * a rank that is stopped). Not installed; tools/tandemrun includes it. Nothing here prints:
 * callers turn the descriptions into their own messages. */
#ifndef TANDEM_LAUNCH_IMPL_H
#define TANDEM_LAUNCH_IMPL_H

#include <sched.h>
#include <sys/types.h>

#include "core/core_impl.h"

/* The torchrun environment of one rank. */
typedef struct {
    int rank, world_size, local_rank, local_world_size, node_rank;
    const char *master_addr;
    int master_port;
    const char *token;
} td__rank_env;

/* Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR,
 * MASTER_PORT and TANDEM_TOKEN in this process (a freshly forked rank), and OMP_NUM_THREADS
 * to `threads` unless the user set it. */
void td__rank_env_apply(const td__rank_env *e, int threads);

/* A fresh job token: 128 random bits as 32 hex digits. */
td_status td__job_token(char out[33]);

/* A TCP port that was free a moment ago, or -1. */
int td__free_port(void);

/* The cores this process may run on, in order; at least one. */
int td__allowed_cpus(int *cpus, int cap);

/* Rank `local_rank` of `nlocal` gets a disjoint run of the allowed cores; with more ranks
 * than cores, rank i shares core i % ncpus. */
void td__rank_cpus(int local_rank, int nlocal, const int *cpus, int ncpus, cpu_set_t *set);

/* Monotonic seconds. */
double td__now_s(void);

/* "SIGKILL" for signal 9 (buf holds it). */
const char *td__signal_name(int sig, char buf[16]);

/* "exited with status 3", "was killed by signal 9 (SIGKILL)" for a waitpid status. */
void td__describe_exit(int status, char *out, size_t cap);

/* The launcher exit code for a rank's waitpid status: its status, or 128 + signal. */
int td__exit_code(int status);

/* One process of a job. */
typedef struct {
    int rank;
    pid_t pid;
    int running;
    int status; /* waitpid status once reaped */
} td__proc;

/* The processes of a job on this host and the stop protocol. */
typedef struct {
    td__proc *procs;
    int n;
    int running;         /* not yet reaped */
    int own_groups;      /* each rank leads its own process group: signals go to -pid */
    int stop_on_failure; /* the first failure stops the others */
    double grace_s;      /* SIGTERM -> SIGKILL */
    int stopping;        /* the job is being torn down */
    double kill_at;      /* when stopping: SIGKILL the survivors at this time (0: done) */
    int exit_code;       /* -1 until something decides it */
    int first_failed;    /* index into procs of the first rank that failed, or -1 */
} td__job;

/* Starts supervising procs[0..n) (pids and ranks filled, all running); more may be added by
 * filling procs[n] and calling td__job_add. */
void td__job_init(td__job *j, td__proc *procs, int n, int own_groups, double grace_s);

/* Counts procs[j->n] (filled, running) in. */
void td__job_add(td__job *j);

/* Sends sig to every running rank. */
void td__job_signal(td__job *j, int sig);

/* Begins stopping the job with `sig` (SIGKILL follows after the grace period) and sets the
 * exit code unless one is set. */
void td__job_stop(td__job *j, int sig, int exit_code);

/* Reaps every rank that ended; returns the index of a rank whose failure is the job's first
 * (then, with stop_on_failure, the job is stopping with SIGTERM and its exit code set, and the
 * ranks it stops are left for the next call, so `running` counts them), or -1. Of several
 * that failed since the last call, one killed by a signal comes first. */
int td__job_reap(td__job *j);

/* Escalates to SIGKILL once the grace period is over. */
void td__job_tick(td__job *j);

/* Names the ranks still running that are stopped (SIGSTOP: state T in /proc), the usual
 * reason why the others gave up waiting: "rank 1 (pid 42)"; returns how many. */
int td__job_stopped_ranks(const td__job *j, char *out, size_t cap);

/* Restarts after a rank failed (restart.c, torchrun's --max-restarts). */
enum { TD__RESTART_SAME = 0, TD__RESTART_LEFT = -1 };
typedef struct {
    int max_restarts; /* starts allowed after the first */
    int done;         /* restarts so far */
    int nproc;        /* ranks of a restart: TD__RESTART_SAME as the run before, TD__RESTART_LEFT
                         the ones that did not fail, or a count */
} td__restart;

/* After a run of `nproc` ranks ended with rank `failed_rank` failing first (-1: none failed, as
 * when it finished, was interrupted or timed out): 1 when the job starts again, with
 * *next_nproc ranks (the restart is counted), else 0. */
int td__restart_next(td__restart *r, int failed_rank, int nproc, int *next_nproc);

#endif
