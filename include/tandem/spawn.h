/* td_spawn: torch.multiprocessing.spawn for C programs. The calling program forks its own
 * ranks, each runs an entry function with the same environment tandemrun gives (RANK,
 * WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TANDEM_TOKEN), pinned to
 * its share of the cores, so td_comm_create(NULL defaults) in the entry function joins one
 * world with no launcher at all. One host only; for several use tandemrun --nnodes, mpirun or
 * srun.
 *
 * As with tandemrun, the first rank that fails stops the others (SIGTERM, then SIGKILL after
 * the grace period) and td_spawn names it. Each rank leaves with _exit(the entry function's
 * return value), so the caller's atexit handlers and stdio buffers are not run twice; flush
 * what a rank prints. OpenMP reads OMP_NUM_THREADS when the program loads, before any fork:
 * set it (1 for one core per rank) in the environment of the program itself. */
#ifndef TANDEM_SPAWN_H
#define TANDEM_SPAWN_H

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A rank's entry function: its return value is the rank's exit status (0: success). */
typedef int (*td_spawn_fn)(int rank, int world_size, void *arg);

/* Options of td_spawn; fill with td_spawn_default_params. */
typedef struct {
    int nprocs;              /* ranks to start, >= 1 (2) */
    const char *master_addr; /* NULL: 127.0.0.1 */
    int master_port;         /* 0: a free port */
    int pin;                 /* 1: pin each rank to its share of the allowed cores (1) */
    double timeout_s;        /* 0: none; else the job is stopped and TD_ETIMEOUT returned (0) */
    double grace_s;          /* SIGTERM -> SIGKILL when stopping (5) */
    int stop_on_failure;     /* 1: a failing rank stops the others; 0: wait for every rank (1) */
    int *exit_status;        /* NULL, or (nprocs) waitpid statuses of the ranks on return */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_spawn_params;

/* nprocs 2, 127.0.0.1, a free port, pinned, no timeout, 5 s grace, stop on failure. */
td_spawn_params td_spawn_default_params(void);

/* Forks p->nprocs ranks that each run fn(rank, nprocs, arg) and waits for all of them.
 * TD_OK when every rank returned 0; TD_EPEER naming the first rank that failed and how
 * ("rank 1 (pid 4242) exited with status 3", "... was killed by signal 9 (SIGKILL)") and any
 * rank that was stopped; TD_ETIMEOUT when the job outlived timeout_s. */
td_status td_spawn(td_spawn_fn fn, void *arg, const td_spawn_params *p);

#ifdef __cplusplus
}
#endif
#endif
