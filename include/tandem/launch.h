/* The pieces a launcher is made of: the env contract a rank starts with, the job's token and
 * rendezvous port, a rank's share of the cores, and the supervision of the processes of a job
 * on one host (the first failure, then SIGTERM to the others and SIGKILL after a grace period,
 * and which ranks are stopped). tandemrun and td_spawn are built from them, as torchrun is
 * from torch.distributed.elastic; a launcher of your own (a batch system's agent, a test
 * harness) gets the same contract and stop protocol from them, and the job's trace from what
 * its ranks kept when they did not all finish.
 *
 * Nothing here forks, prints or installs signal handlers: the launcher starts its processes
 * its own way, hands their pids to a td_job and turns the descriptions into its own messages.
 * Linux only (waitpid, /proc). */
#ifndef TANDEM_LAUNCH_H
#define TANDEM_LAUNCH_H

#include <stddef.h>
#include <sys/types.h>

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The torchrun environment of one rank. */
typedef struct {
    int rank, world_size, local_rank, local_world_size, node_rank;
    const char *master_addr;
    int master_port;
    const char *token; /* the job's token (TANDEM_TOKEN) */
} td_rank_env;

/* Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR,
 * MASTER_PORT and TANDEM_TOKEN in this process (a rank just forked, before it execs or runs
 * its entry function), and OMP_NUM_THREADS to `threads` unless the user set it. */
td_status td_rank_env_apply(const td_rank_env *env, int threads);

/* Characters of a job token, without the NUL. */
#define TD_JOB_TOKEN_LEN 32

/* A fresh job token: 128 random bits as 32 hex digits. */
td_status td_job_token(char out[TD_JOB_TOKEN_LEN + 1]);

/* A TCP port nothing in this network namespace is bound to now, picked at random from 20000
 * to 65535 outside the kernel's ephemeral range (net.ipv4.ip_local_port_range), so that no
 * outgoing connection can take it before the store binds it, here or in another namespace
 * (an emulated host). Where the range leaves no such port, the kernel's choice. */
td_status td_free_port(int *port);

/* The cores of local rank `local_rank` of `local_world_size` among those this process may run
 * on (in order): a disjoint run each, or, with more ranks than cores, core local_rank % cores.
 * Writes at most `cap` core ids to `cpus` and returns how many: at least one, or 0 when
 * local_rank is not in [0, local_world_size) or cap is 0. */
int td_rank_cpus(int local_rank, int local_world_size, int *cpus, int cap);

/* How a process ended, from its waitpid status: "exited with status 3", "was killed by signal
 * 9 (SIGKILL)". */
void td_exit_describe(int status, char *out, size_t cap);

/* A launcher's exit code for a rank's waitpid status: its exit status, or 128 + the signal. */
int td_exit_code(int status);

/* "SIGKILL" for 9; `buf` holds the text. */
const char *td_signal_name(int sig, char buf[16]);

/* 1 when process `pid` catches signal `sig` (has a handler for it): a launcher asks a rank for
 * its flight recorder's dump (SIGUSR1) only when it does, as the signal would kill it otherwise. */
int td_process_catches(pid_t pid, int sig);

/* The processes of a job on this host under the stop protocol. */
typedef struct td_job td_job;

/* Options of td_job_create; fill with td_job_default_params. */
typedef struct {
    double grace_s;      /* seconds between SIGTERM and SIGKILL when stopping (5) */
    int stop_on_failure; /* 1: the first rank that fails stops the others (1) */
    int own_groups;      /* 1: each rank leads its own process group; signals go to it (0) */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_job_params;

/* 5 s grace, stop on failure, signals to the ranks' pids. */
td_job_params td_job_default_params(void);

/* A job with no processes yet; free with td_job_destroy. */
td_status td_job_create(td_job **out, const td_job_params *params);

/* Frees the job; its processes are neither signalled nor reaped. */
void td_job_destroy(td_job *job);

/* Supervises `pid`, a running child of this process, as rank `rank`; its index is the number
 * of processes added before it. */
td_status td_job_add(td_job *job, int rank, pid_t pid);

/* One process of a job. */
typedef struct {
    int rank;
    pid_t pid;
    int running; /* not reaped yet */
    int status;  /* waitpid status once reaped */
} td_job_proc;

/* Process `index` (0 <= index < the number added). */
td_job_proc td_job_get(const td_job *job, int index);

/* Reaps every rank that ended, never another child of the caller. Returns the index of the
 * rank whose failure is the job's first, else -1; with stop_on_failure the job is then stopping
 * (SIGTERM) with that rank's exit code, and the ranks it stops are reaped by later calls. Of
 * several that failed since the last call, one killed by a signal comes first: the others most
 * often gave up because of it. */
int td_job_reap(td_job *job);

/* Ranks not reaped yet. */
int td_job_running(const td_job *job);

/* Begins stopping the job with `sig` (SIGKILL follows after the grace period) and sets its
 * exit code unless one is set. */
void td_job_stop(td_job *job, int sig, int exit_code);

/* 1 once the job is stopping. */
int td_job_stopping(const td_job *job);

/* Sends `sig` to every running rank now. */
void td_job_signal(td_job *job, int sig);

/* Escalates to SIGKILL once the grace period is over. Returns the seconds until it is due
 * again (a launcher's poll timeout), or -1 when nothing is due. */
double td_job_tick(td_job *job);

/* The exit code the job ended with (the first failure's, or td_job_stop's), or -1. */
int td_job_exit_code(const td_job *job);

/* The index of the rank whose failure was the job's first, or -1. */
int td_job_first_failure(const td_job *job);

/* Names the ranks still running that are stopped (SIGSTOP, or traced), the usual reason why
 * the others gave up waiting: "rank 1 (pid 42), rank 3 (pid 44)"; returns how many. */
int td_job_stopped_ranks(const td_job *job, char *out, size_t cap);

/* The job trace (TANDEM_TRACE=dir, docs/tracing.md) from the spans its ranks kept: rank R keeps
 * its own in dir/rank<R>.trace as it records them (td_trace_keep), and they stay there when the
 * ranks could not gather them at td_comm_destroy (a rank died, or the job was stopped), up to
 * where each rank got. Merges every one into dir/trace.json, as the gather would have, and
 * removes them; *ranks says how many there were. TD_ENOTFOUND when there are none; a file
 * that is not a kept trace is TD_EFORMAT naming it (the others are merged, and it stays). */
td_status td_job_trace_collect(const char *dir, int *ranks);

/* Removes what a traced job leaves in dir (its ranks' kept files and trace.json), so that a job
 * starting there reports only its own. */
td_status td_job_trace_clear(const char *dir);

#ifdef __cplusplus
}
#endif
#endif
