/* Spawns the ranks of a job and supervises them until every one is gone.
 *
 * Each rank is a fork/exec of the program in its own process group (so that a signal
 * reaches the rank and anything it started, and so that the terminal's Ctrl-C reaches
 * only the launcher, which forwards it once). Children die with the launcher
 * (PR_SET_PDEATHSIG) even if it is killed outright. One loop polls the ranks' output
 * pipes and a self-pipe fed by the signal handlers; a td_job (tandem/launch.h, what td_spawn
 * is built on too) reaps the ranks and, when one fails, gives the others SIGTERM and, after the
 * grace period, SIGKILL. The final report names a rank that is stopped (SIGSTOP) as the one
 * the others waited for. In a job across hosts (--nnodes) the nodes meet first (rendezvous.c),
 * ranks are numbered node by node, the first failure on any node ends the job on every node,
 * and reports name the host. It runs one start of the job: restarts after a failure are
 * main.c's loop around it (restart.c), on one node. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tandem/launch.h"

#include "tandemrun.h"

static int self_pipe[2] = {-1, -1};
static volatile sig_atomic_t interrupted; /* SIGINT, SIGTERM or SIGHUP reached the launcher */

int tr_interrupted(void) { return interrupted != 0; }

/* A byte on the self-pipe that is no signal: the watcher learned the job's end. */
#define WAKE_END 0

static double now_s(void) { return (double)td_time_ns() * 1e-9; }

static void on_signal(int sig) {
    int saved = errno;
    if (sig != SIGCHLD && sig != SIGUSR1) interrupted = 1; /* SIGUSR1 asks for a diagnosis */
    unsigned char b = (unsigned char)sig;
    ssize_t unused = write(self_pipe[1], &b, 1); /* full pipe: a wake-up is already queued */
    (void)unused;
    errno = saved;
}

/* Runs in the forked child; never returns. */
static void exec_rank(const tr_options *o, const td_rank_env *env, int out_w, int err_w,
                      pid_t launcher, const char *doctor_dir) {
    if (o->nnodes > 1) setenv("TANDEM_STORE_HOSTED", "1", 1); /* node 0's tandemrun hosts it */
    setenv("TANDEM_DOCTOR_DIR", doctor_dir, 1);
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != launcher) _exit(1); /* the launcher died before prctl took effect */
    int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE, SIGQUIT, SIGUSR1};
    for (size_t k = 0; k < sizeof sigs / sizeof *sigs; k++) signal(sigs[k], SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);

    if (out_w >= 0) {
        dup2(out_w, 1);
        dup2(err_w, 2);
    }
    /* Ranks other than 0 (and every rank, when stdin is a terminal: they are not in its
     * foreground group) read nothing. */
    if (env->rank != 0 || isatty(0)) {
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0) {
            dup2(devnull, 0);
            close(devnull);
        }
    }
    int cores[CPU_SETSIZE];
    int ncores = td_rank_cpus(env->local_rank, env->local_world_size, cores, CPU_SETSIZE);
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int k = 0; k < ncores; k++) CPU_SET(cores[k], &set);
    sched_setaffinity(0, sizeof set, &set);

    if (td_rank_env_apply(env, ncores) != TD_OK) {
        dprintf(2, "tandemrun: %s\n", td_last_error());
        _exit(127);
    }
    char attempt[16];
    snprintf(attempt, sizeof attempt, "%d", o->attempt);
    setenv("TANDEM_RESTART_COUNT", attempt, 1); /* torchrun's TORCHELASTIC_RESTART_COUNT */
    if (o->have_devices) {
        char dev[16];
        snprintf(dev, sizeof dev, "%d", o->devices[env->local_rank]);
        setenv("CUDA_VISIBLE_DEVICES", dev, 1);
    }

    execv(o->program, o->argv);
    dprintf(2, "tandemrun: cannot run '%s': %s\n", o->program, strerror(errno));
    _exit(127);
}

/* A failure of this node's that may end the job on every node: a rank that exited with a
 * status is most often one that gave up because a rank elsewhere failed first, so its claim
 * waits SETTLE_S for another node's (a killed rank claims at once). */
#define SETTLE_S 0.5
typedef struct {
    int pending;
    double at;
    int code, others;
    char what[256];
    int job_code; /* the job's exit code as another node's end decided it, or -1 */
} tr_claim;

/* Reports this node's first failure as the job's end, or as what followed another node's. */
static void claim_end(tr_rdzv *z, tr_claim *c) {
    char job[512];
    int code;
    c->pending = 0;
    if (tr_rdzv_end_job(z, c->code, c->what, &code, job, sizeof job)) {
        fprintf(stderr, "tandemrun: %s; stopping the other %d rank%s here and the other nodes\n",
                c->what, c->others, c->others == 1 ? "" : "s");
        return;
    }
    fprintf(stderr, "tandemrun: %s; then %s; stopping the other %d rank%s on this node\n", job,
            c->what, c->others, c->others == 1 ? "" : "s");
    c->job_code = code;
}

/* Settles a pending claim: another node ended the job meanwhile, or its time has come (with
 * `wait`, after waiting for that). */
static void settle(tr_rdzv *z, tr_claim *c, int wait) {
    while (c->pending) {
        int code;
        char job[512];
        if (tr_rdzv_ended(z, &code, job, sizeof job)) {
            c->pending = 0;
            fprintf(stderr, "tandemrun: %s; then %s; stopping the other %d rank%s on this node\n",
                    job, c->what, c->others, c->others == 1 ? "" : "s");
            c->job_code = code;
        } else if (now_s() >= c->at) {
            claim_end(z, c);
        } else if (!wait) {
            return;
        } else {
            struct timespec pause = {0, 10000000};
            nanosleep(&pause, NULL);
        }
    }
}

/* Reaps ended ranks and reports the job's first failure, naming any rank that is stopped:
 * the others usually failed because they gave up waiting for it. Across hosts the report
 * names this host, and the failure ends the job on every node (see tr_claim). Returns the
 * failed rank's index in the job, or -1. */
static int reap(td_job *j, tr_rdzv *z, tr_claim *claim) {
    int f = td_job_reap(j);
    if (f < 0) return -1;
    td_job_proc p = td_job_get(j, f);
    char how[96], stopped[256];
    td_exit_describe(p.status, how, sizeof how);
    int others = td_job_running(j);
    if (z) {
        claim->pending = 1;
        claim->code = td_exit_code(p.status);
        claim->others = others;
        claim->at = now_s() + (WIFSIGNALED(p.status) ? 0 : SETTLE_S);
        snprintf(claim->what, sizeof claim->what, "rank %d (pid %d) on %s (node %d) %s", p.rank,
                 (int)p.pid, z->host, z->node_rank, how);
        settle(z, claim, 0);
    } else if (others > 0) {
        fprintf(stderr, "tandemrun: rank %d (pid %d) %s; stopping the other %d rank%s\n", p.rank,
                (int)p.pid, how, others, others == 1 ? "" : "s");
    } else {
        fprintf(stderr, "tandemrun: rank %d (pid %d) %s\n", p.rank, (int)p.pid, how);
    }
    if (td_job_stopped_ranks(j, stopped, sizeof stopped) > 0)
        fprintf(stderr,
                "tandemrun: %s stopped (SIGSTOP) and never arrived: the job was stuck on it; "
                "rank %d gave up waiting\n",
                stopped, p.rank);
    return f;
}

/* Reads what a stream has now; closes it at EOF. */
static void pump(tr_rank *rk, tr_stream *s, int prefix) {
    char buf[65536];
    for (;;) {
        ssize_t n = read(s->fd, buf, sizeof buf);
        if (n > 0) {
            tr_relay_bytes(rk, s, buf, (size_t)n, prefix);
            if ((size_t)n < sizeof buf) return;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        tr_relay_flush(rk, s, prefix);
        close(s->fd);
        s->fd = -1;
        return;
    }
}

static int open_pipe(int p[2]) {
    if (pipe2(p, O_CLOEXEC) != 0) return -1;
    fcntl(p[0], F_SETFL, fcntl(p[0], F_GETFL) | O_NONBLOCK);
    return 0;
}

int tr_run_job(const tr_options *o, int *failed_rank) {
    *failed_rank = -1;
    char token[TD_JOB_TOKEN_LEN + 1] = "";
    int port = o->master_port;
    if ((o->nnodes == 1 && td_job_token(token) != TD_OK) || (!port && td_free_port(&port))) {
        fprintf(stderr, "tandemrun: %s\n", td_last_error());
        return 1;
    }
    if (o->tee && mkdir(o->log_dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "tandemrun: cannot create log directory '%s': %s\n", o->log_dir,
                strerror(errno));
        return 1;
    }
    tr_doctor doc;
    if (tr_doctor_open(o, &doc) != 0) return 1;
    td_job_params jp = td_job_default_params();
    jp.grace_s = o->grace_s;
    jp.own_groups = 1;
    jp.stop_on_failure = 0; /* the ranks dump first (tr_doctor_request), then the job stops */
    td_job *j = NULL;
    tr_rank *ranks = calloc((size_t)o->nproc, sizeof *ranks);
    if (!ranks || td_job_create(&j, &jp) != TD_OK || open_pipe(self_pipe) != 0) {
        fprintf(stderr, "tandemrun: cannot start the job: %s\n", strerror(errno));
        free(ranks);
        td_job_destroy(j);
        tr_doctor_close(&doc, 0);
        return 1;
    }
    fcntl(self_pipe[1], F_SETFL, fcntl(self_pipe[1], F_GETFL) | O_NONBLOCK);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    int handled[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGUSR1};
    for (size_t k = 0; k < sizeof handled / sizeof *handled; k++) sigaction(handled[k], &sa, NULL);
    signal(SIGPIPE, SIG_IGN); /* a closed stdout must not kill the launcher before its ranks */

    /* A job across hosts: meet the other nodes first. */
    tr_rdzv rdzv, *z = NULL;
    if (o->nnodes > 1) {
        int rc = tr_rdzv_join(o, self_pipe[1], self_pipe[0], &rdzv);
        if (rc) { /* it failed before its watcher started: only the connections to close */
            td_store_destroy(rdzv.watch);
            td_store_destroy(rdzv.store);
            close(self_pipe[0]);
            close(self_pipe[1]);
            self_pipe[0] = self_pipe[1] = -1;
            free(ranks);
            td_job_destroy(j);
            tr_doctor_close(&doc, 0);
            return rc;
        }
        z = &rdzv;
    }
    int rank0 = z ? z->rank_offset : 0, world = z ? z->world_size : o->nproc;
    tr_claim claim = {.job_code = -1};
    const char *job_token = z ? o->token : token;

    int capture = o->prefix || o->tee;
    pid_t self = getpid();
    fflush(NULL);
    for (int r = 0; r < o->nproc; r++) { /* the ranks never started have no streams */
        ranks[r] = (tr_rank){.rank = rank0 + r,
                             .out = {.fd = -1, .out_fd = 1},
                             .err = {.fd = -1, .out_fd = 2},
                             .log_fd = -1};
    }
    for (int r = 0; r < o->nproc; r++) {
        tr_rank *rk = &ranks[r];
        if (o->tee) {
            char path[4096];
            snprintf(path, sizeof path, "%s/rank_%d.log", o->log_dir, rank0 + r);
            /* a restart adds to what the earlier starts wrote */
            rk->log_fd = open(
                path, O_WRONLY | O_CREAT | O_CLOEXEC | (o->attempt ? O_APPEND : O_TRUNC), 0666);
            if (rk->log_fd < 0)
                fprintf(stderr, "tandemrun: cannot write '%s': %s\n", path, strerror(errno));
        }
        int po[2] = {-1, -1}, pe[2] = {-1, -1};
        if (capture && (open_pipe(po) != 0 || open_pipe(pe) != 0)) {
            fprintf(stderr, "tandemrun: pipe for rank %d: %s\n", r, strerror(errno));
            td_job_stop(j, SIGKILL, 1);
            break;
        }
        td_rank_env env = {rank0 + r,    world,          r,    o->nproc,
                           o->node_rank, o->master_addr, port, job_token};
        pid_t pid = fork();
        if (pid == 0) exec_rank(o, &env, po[1], pe[1], self, doc.dir);
        if (capture) {
            close(po[1]);
            close(pe[1]);
        }
        if (pid > 0) setpgid(pid, pid); /* also here, so that kill(-pid) works before it runs */
        if (pid < 0 || td_job_add(j, rank0 + r, pid) != TD_OK) {
            fprintf(stderr, "tandemrun: cannot start rank %d: %s\n", r,
                    pid < 0 ? strerror(errno) : td_last_error());
            if (pid > 0) {
                kill(-pid, SIGKILL);
                waitpid(pid, NULL, 0);
            }
            if (capture) {
                close(po[0]);
                close(pe[0]);
            }
            td_job_stop(j, SIGKILL, 1);
            break;
        }
        rk->out.fd = po[0];
        rk->err.fd = pe[0];
    }

    double deadline = o->timeout_s > 0 ? now_s() + o->timeout_s : 0;
    struct pollfd *fds = calloc(2 * (size_t)o->nproc + 1, sizeof *fds);
    tr_stream **owners = calloc(2 * (size_t)o->nproc + 1, sizeof *owners);
    tr_rank **owner_ranks = calloc(2 * (size_t)o->nproc + 1, sizeof *owner_ranks);
    if (!fds || !owners || !owner_ranks) {
        fprintf(stderr, "tandemrun: out of memory\n");
        td_job_stop(j, SIGKILL, 1);
    }
    while (td_job_running(j) > 0) {
        int nfds = 0;
        if (fds) {
            fds[nfds++] = (struct pollfd){.fd = self_pipe[0], .events = POLLIN};
            for (int r = 0; r < o->nproc; r++) {
                tr_stream *ss[2] = {&ranks[r].out, &ranks[r].err};
                for (int k = 0; k < 2; k++) {
                    if (ss[k]->fd < 0) continue;
                    owners[nfds] = ss[k];
                    owner_ranks[nfds] = &ranks[r];
                    fds[nfds++] = (struct pollfd){.fd = ss[k]->fd, .events = POLLIN};
                }
            }
        }
        double t = now_s(), kill_in = td_job_tick(j), wake = 0;
        if (kill_in >= 0) wake = t + kill_in;
        if (!td_job_stopping(j) && deadline > 0) wake = deadline;
        if (claim.pending && (wake == 0 || claim.at < wake)) wake = claim.at;
        if (doc.pending && (wake == 0 || t + 0.01 < wake)) wake = t + 0.01; /* dumps coming */
        int ms = -1;
        if (wake > 0) ms = wake <= t ? 0 : (int)((wake - t) * 1000) + 1;
        if (!fds) ms = ms < 0 || ms > 100 ? 100 : ms;
        int n = fds ? poll(fds, (nfds_t)nfds, ms) : poll(NULL, 0, ms);
        if (n < 0 && errno != EINTR) {
            fprintf(stderr, "tandemrun: poll: %s\n", strerror(errno));
            td_job_stop(j, SIGKILL, 1);
        }
        for (int k = 1; n > 0 && k < nfds; k++)
            if (fds[k].revents) pump(owner_ranks[k], owners[k], o->prefix);
        if (n > 0 && fds[0].revents) {
            unsigned char sigs[64];
            ssize_t got;
            while ((got = read(self_pipe[0], sigs, sizeof sigs)) > 0) {
                for (ssize_t k = 0; k < got; k++) {
                    int sig = sigs[k], code;
                    char what[512];
                    if (sig == SIGCHLD) continue;
                    if (sig == SIGUSR1) { /* a diagnosis, asked for: the job goes on */
                        if (!td_job_stopping(j) && !doc.pending) tr_doctor_request(&doc, j, 0, 1);
                        continue;
                    }
                    if (sig == WAKE_END) {
                        settle(z, &claim, 0);
                        if (!td_job_stopping(j) && tr_rdzv_ended(z, &code, what, sizeof what)) {
                            int left = td_job_running(j);
                            fprintf(stderr, "tandemrun: %s; stopping the %d rank%s on this node\n",
                                    what, left, left == 1 ? "" : "s");
                            td_job_stop(j, SIGTERM, code ? code : 1);
                        }
                        continue;
                    }
                    if (!td_job_stopping(j)) {
                        char name[16];
                        int left = td_job_running(j);
                        fprintf(stderr, "tandemrun: received %s; stopping %d rank%s\n",
                                td_signal_name(sig, name), left, left == 1 ? "" : "s");
                        if (z) {
                            char job[512];
                            snprintf(what, sizeof what, "tandemrun on %s (node %d) received %s",
                                     z->host, z->node_rank, name);
                            tr_rdzv_end_job(z, 128 + sig, what, &code, job, sizeof job);
                        }
                        td_job_stop(j, sig, 128 + sig);
                    } else if (sig == SIGINT) { /* a second Ctrl-C: do not wait out the grace */
                        td_job_signal(j, SIGKILL);
                    }
                }
            }
        }
        int f = reap(j, z, &claim);
        if (f >= 0 && !td_job_stopping(j) && !doc.stop_code) /* dumps first, then the stop */
            tr_doctor_request(&doc, j, td_exit_code(td_job_get(j, f).status), 0);
        if (z) settle(z, &claim, 0);
        if (doc.pending && tr_doctor_ready(&doc, j)) {
            doc.pending = 0;
            tr_doctor_note(&doc, j);
            if (doc.stop_code && !td_job_stopping(j))
                td_job_stop(j, SIGTERM, doc.stop_code);
            else if (doc.report)
                tr_doctor_report(&doc, 0);
        }
        if (!td_job_stopping(j) && !doc.stop_code && deadline > 0 && now_s() >= deadline) {
            char stopped[256];
            int left = td_job_running(j);
            fprintf(stderr, "tandemrun: job timed out after %g s; stopping %d rank%s\n",
                    o->timeout_s, left, left == 1 ? "" : "s");
            if (z) {
                char what[128], job[512];
                int code;
                snprintf(what, sizeof what, "the job timed out after %g s on %s (node %d)",
                         o->timeout_s, z->host, z->node_rank);
                tr_rdzv_end_job(z, 124, what, &code, job, sizeof job);
            }
            if (td_job_stopped_ranks(j, stopped, sizeof stopped) > 0)
                fprintf(stderr, "tandemrun: %s stopped (SIGSTOP): the job was stuck on it\n",
                        stopped);
            tr_doctor_request(&doc, j, 124, 0);
        }
    }
    /* Every rank is gone; what they wrote last is still in the pipes. Something a rank left
     * running may hold a pipe open, so read only what is there now. */
    for (int r = 0; r < o->nproc; r++) {
        tr_stream *ss[2] = {&ranks[r].out, &ranks[r].err};
        for (int k = 0; k < 2; k++) {
            if (ss[k]->fd >= 0) pump(&ranks[r], ss[k], o->prefix);
            tr_relay_flush(&ranks[r], ss[k], o->prefix);
            if (ss[k]->fd >= 0) close(ss[k]->fd);
            free(ss[k]->buf);
        }
        if (ranks[r].log_fd >= 0) close(ranks[r].log_fd);
    }
    if (td_job_first_failure(j) >= 0) *failed_rank = td_job_get(j, td_job_first_failure(j)).rank;
    if (doc.pending) { /* every rank ended before the dumps were all in */
        doc.pending = 0;
        tr_doctor_note(&doc, j);
    }
    if (doc.stop_code && td_job_exit_code(j) < 0) td_job_stop(j, SIGTERM, doc.stop_code);
    /* A failed or timed-out job: which rank held it up, from the dumps. */
    int diagnose = doc.stop_code != 0 && !tr_interrupted();
    if (diagnose) tr_doctor_report(&doc, 1);
    tr_doctor_close(&doc, doc.stop_code != 0);
    free(fds);
    free(owners);
    free(owner_ranks);
    free(ranks);
    if (z) settle(z, &claim, 1);
    int rc = claim.job_code >= 0 ? claim.job_code : td_job_exit_code(j);
    if (rc < 0) rc = 0;
    td_job_destroy(j);
    if (z) tr_rdzv_leave(z, rc == 0);
    close(self_pipe[0]);
    close(self_pipe[1]);
    self_pipe[0] = self_pipe[1] = -1;
    return rc;
}
