/* tandemrun's pieces: the parsed command line, the per-rank output state, and the functions
 * that spawn, relay output for and supervise the ranks of one job on one host. Private to the
 * launcher; the library knows nothing of it (the supervision core it uses is the library's,
 * shared with td_spawn: src/launch). */
#ifndef TANDEMRUN_H
#define TANDEMRUN_H

#include <stddef.h>
#include <sys/types.h>

#define TR_MAX_RANKS 1024

/* The command line, after validation. */
typedef struct {
    int nproc;                 /* ranks on this host */
    int devices[TR_MAX_RANKS]; /* GPU id of each local rank when have_devices */
    int have_devices;
    const char *master_addr;
    int master_port; /* 0: pick a free one */
    int prefix;      /* "[rank K] " before every output line */
    int tee;         /* also write each rank's output to log_dir/rank_K.log */
    const char *log_dir;
    double timeout_s;    /* 0: no limit on the job's wall-clock time */
    double grace_s;      /* SIGTERM -> SIGKILL delay when stopping ranks */
    const char *program; /* resolved path of the program */
    char **argv;         /* program's argv (argv[0] as the user wrote it) */
    int max_restarts;    /* starts after a rank failed (torchrun's --max-restarts) */
    int restart_nproc;   /* ranks of a restart: 0 as before, -1 the ones left, or a count */
    int attempt;         /* 0 for the first start, then the restart's number */
} tr_options;

/* One captured output stream of a rank (stdout or stderr). */
typedef struct {
    int fd;     /* read end of the pipe, -1 once at EOF */
    int out_fd; /* where prefixed lines go: 1 or 2 */
    char *buf;  /* bytes of the current, unfinished line */
    size_t len, cap;
} tr_stream;

/* The output of one rank of the job (its process is a td__proc of the job). */
typedef struct {
    int rank;
    tr_stream out, err;
    int log_fd; /* --tee file, or -1 */
} tr_rank;

/* Parses argv into opts; on a usage error prints why and returns 2, on --help returns 1. */
int tr_parse_args(int argc, char **argv, tr_options *opts);

/* Launches every rank, relays output and supervises them until all are gone; returns the
 * launcher's exit status and in *failed_rank the rank whose failure stopped the job (-1 when
 * none did: it finished, or the launcher was interrupted or timed out). */
int tr_run_job(const tr_options *opts, int *failed_rank);

/* 1 once SIGINT, SIGTERM or SIGHUP reached the launcher (then no restart follows). */
int tr_interrupted(void);

/* Appends bytes read from a rank's stream and writes out every complete line (prefixed). */
void tr_relay_bytes(tr_rank *rank, tr_stream *s, const char *data, size_t n, int prefix);

/* Writes out what is left of an unfinished line when the stream ends. */
void tr_relay_flush(tr_rank *rank, tr_stream *s, int prefix);

/* Writes all of buf to fd, retrying short writes; errors (a closed pipe) are ignored. */
void tr_write_all(int fd, const char *buf, size_t n);

#endif
