/* tandemrun's pieces: the parsed command line, the per-rank output state, the rendezvous of
 * the nodes of a multi-node job, and the functions that spawn, relay output for and supervise
 * the ranks of one host, and the restart policy. Private to the launcher; the library knows
 * nothing of it (the supervision it uses is the library's public tandem/launch.h, which
 * td_spawn is built on too). */
#ifndef TANDEMRUN_H
#define TANDEMRUN_H

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sys/types.h>

#include "tandem/launch.h"
#include "tandem/store.h"

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
    double timeout_s;      /* 0: no limit on the job's wall-clock time */
    double grace_s;        /* SIGTERM -> SIGKILL delay when stopping ranks */
    int nnodes;            /* hosts of the job, each running one tandemrun (1) */
    int node_rank;         /* this host's index, 0 .. nnodes-1 */
    const char *token;     /* the job's token, the same on every node (nnodes > 1) */
    double rdzv_timeout_s; /* how long the nodes wait for each other */
    const char *program;   /* resolved path of the program */
    char **argv;           /* program's argv (argv[0] as the user wrote it) */
    int max_restarts;      /* starts after a rank failed (torchrun's --max-restarts) */
    int restart_nproc;     /* ranks of a restart: 0 as before, -1 the ones left, or a count */
    int attempt;           /* 0 for the first start, then the restart's number */
    const char *trace_dir; /* --trace: the ranks get TANDEM_TRACE=<its absolute path> */
    const char *merge_dir; /* --trace-merge DIR: merge what its ranks kept there, then exit */
    int trace_ops;         /* --trace-ops: and TANDEM_TRACE_OPS=1 */
    int tp, pp;            /* --tp, --pp: the mesh's sizes (TANDEM_TP, TANDEM_PP); 0: unset */
    const char *dump_dir;  /* --doctor-dir: where the ranks dump (kept after the job) */
} tr_options;

/* Restarts after a rank failed (restart.c, torchrun's --max-restarts). */
enum { TR_RESTART_SAME = 0, TR_RESTART_LEFT = -1 };
typedef struct {
    int max_restarts; /* starts allowed after the first */
    int done;         /* restarts so far */
    int nproc;        /* ranks of a restart: TR_RESTART_SAME as the run before, TR_RESTART_LEFT
                         the ones that did not fail, or a count */
} tr_restart;

/* After a run of `nproc` ranks ended with rank `failed_rank` failing first (-1: none failed, as
 * when it finished, was interrupted or timed out): 1 when the job starts again, with
 * *next_nproc ranks (the restart is counted); else 0, and when restarts were asked for and a
 * rank failed, why none follows in `why` (else it is empty). */
int tr_restart_next(tr_restart *r, int failed_rank, int nproc, int *next_nproc, char *why,
                    size_t cap);

/* The mesh a restart of at most `ranks` ranks runs on: tp and pp as they were when tp x pp
 * ranks fit, else tp halved (an odd one to 1) until they do, then pp; the data-parallel
 * replicas are what the ranks leave, whole ones only. Returns the ranks to start, the largest
 * multiple of the new tp x pp that fits. */
int tr_restart_layout(int ranks, int *tp, int *pp);

/* One captured output stream of a rank (stdout or stderr). */
typedef struct {
    int fd;     /* read end of the pipe, -1 once at EOF */
    int out_fd; /* where prefixed lines go: 1 or 2 */
    char *buf;  /* bytes of the current, unfinished line */
    size_t len, cap;
} tr_stream;

/* The output of one rank of the job (its process is in the job's td_job). */
typedef struct {
    int rank;
    tr_stream out, err;
    int log_fd; /* --tee file, or -1 */
} tr_rank;

/* The nodes' rendezvous and the job's end, for a job across hosts (rendezvous.c). */
typedef struct {
    int nnodes, node_rank;
    int world_size, rank_offset; /* ranks of the whole job; this node's first rank */
    const char *addr;
    int port;
    char host[64];
    td_store *store, *watch; /* the supervisor's connection, the watcher thread's */
    pthread_t thread;
    int thread_started;
    _Atomic int stop;
    int wake_fd; /* written to when the job's end is known */
    pthread_mutex_t lock;
    char end[512]; /* "code|message" of the job's end, once known */
} tr_rdzv;

/* Joins the job's rendezvous (node 0 hosts the store) and starts watching for its end, which
 * it reports by writing to wake_fd; a signal byte on sig_fd (the supervisor's self-pipe) stops
 * the waiting. 0, or the exit status after printing why not. */
int tr_rdzv_join(const tr_options *opts, int wake_fd, int sig_fd, tr_rdzv *z);

/* Records the job's end (a rank of this node failed with exit `code`), unless another node
 * ended it first; returns 1 when this was the job's end, else 0 with the earlier end's code
 * and message in *job_code, job_what (which otherwise repeat this one). */
int tr_rdzv_end_job(tr_rdzv *z, int code, const char *what, int *job_code, char *job_what,
                    size_t cap);

/* 1 when the job has ended (here or elsewhere): its exit code and message. */
int tr_rdzv_ended(tr_rdzv *z, int *code, char *what, size_t cap);

/* Leaves the rendezvous; with ok, says this node finished, and node 0 first waits for every
 * node to have finished (or failed, or fallen silent). */
void tr_rdzv_leave(tr_rdzv *z, int ok);

/* --trace DIR (trace.c): makes the directory and checks that the ranks can write there, then
 * sets TANDEM_TRACE (and TANDEM_TRACE_OPS) to its absolute path `dir`; 0, or -1 after printing
 * why not. */
int tr_trace_prepare(const tr_options *opts, char dir[PATH_MAX]);

/* Removes an earlier job's trace files from dir before an attempt; 0, or -1 after printing why
 * not. */
int tr_trace_clear(const char *dir);

/* After the job: says where its trace is (merging what the ranks kept when they could not
 * gather it; rank failed_rank, if >= 0, failed), or why there is none; 0 when there is one. */
int tr_trace_report(const char *dir, int failed_rank);

/* The hang doctor's side of one start of the job (doctor.c): where the ranks dump, and a
 * request for their dumps under way. */
typedef struct {
    char dir[4096]; /* TANDEM_DOCTOR_DIR, absolute */
    int kept;       /* the user named it: kept after the job */
    int pending;    /* dumps asked for, not all in yet */
    double since;   /* when they were asked (CLOCK_REALTIME, as file times are) */
    double until;   /* td_time_ns seconds: when to go on without the missing ones */
    int stop_code;  /* then stop the job with this code (0: it goes on) */
    int report;     /* then print the diagnosis */
    int asked[TR_MAX_RANKS], nasked;
} tr_doctor;

/* Sets up the dump directory (the --doctor-dir, TANDEM_DOCTOR_DIR, else /tmp/tandemrun-<pid>),
 * emptied of an earlier start's dumps; -1 after printing why it cannot. */
int tr_doctor_open(const tr_options *o, tr_doctor *doc);

/* Removes the directory after a job that went well, unless the user named it. */
void tr_doctor_close(tr_doctor *doc, int keep);

/* Asks every running rank that has the flight recorder for its dump (SIGUSR1); once they are in
 * (tr_doctor_ready), the job is stopped with stop_code (unless 0) and, with report, the
 * diagnosis printed. */
void tr_doctor_request(tr_doctor *doc, td_job *j, int stop_code, int report);

/* 1 when every rank asked has written its dump or ended, or the wait is over. */
int tr_doctor_ready(const tr_doctor *doc, td_job *j);

/* Writes what became of each rank's process so far (DIR/launcher.json). */
void tr_doctor_note(const tr_doctor *doc, td_job *j);

/* Prints the diagnosis of the dumps (each line after "tandemrun: ") and keeps it in
 * DIR/diagnosis.txt; `final`: the start failed, its dumps kept for tr_doctor_trace. */
void tr_doctor_report(const tr_doctor *doc, int final);

/* After the job's trace is written (tr_trace_report): the calls the dumps of the last failed
 * start hold, as the last events of trace_dir/trace.json. */
void tr_doctor_trace(const char *trace_dir);

/* tandemrun --dump [PID]: asks the job's tandemrun for a diagnosis and prints it. */
int tr_dump_main(int argc, char **argv);

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
