/* Spawns the ranks of a job and supervises them until every one is gone.
 *
 * Each rank is a fork/exec of the program in its own process group (so that a signal
 * reaches the rank and anything it started, and so that the terminal's Ctrl-C reaches
 * only the launcher, which forwards it once). Children die with the launcher
 * (PR_SET_PDEATHSIG) even if it is killed outright. One loop polls the ranks' output
 * pipes and a self-pipe fed by the signal handlers; when a rank fails, the others get
 * SIGTERM and, after the grace period, SIGKILL. It does not restart ranks (no elastic
 * training) and does not span hosts. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tandemrun.h"

static int self_pipe[2] = {-1, -1};

static void on_signal(int sig) {
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    ssize_t unused = write(self_pipe[1], &b, 1); /* full pipe: a wake-up is already queued */
    (void)unused;
    errno = saved;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *sig_name(int sig) {
    const char *abbrev = sigabbrev_np(sig);
    static char buf[16];
    if (abbrev) {
        snprintf(buf, sizeof buf, "SIG%s", abbrev);
        return buf;
    }
    return "unknown signal";
}

/* A fresh job token: 128 random bits as hex. */
static int make_token(char out[33]) {
    unsigned char raw[16];
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t got = 0;
    while (got < sizeof raw) {
        ssize_t r = read(fd, raw + got, sizeof raw - got);
        if (r <= 0) {
            if (r < 0 && errno == EINTR) continue;
            close(fd);
            return -1;
        }
        got += (size_t)r;
    }
    close(fd);
    for (size_t k = 0; k < sizeof raw; k++) snprintf(out + 2 * k, 3, "%02x", raw[k]);
    return 0;
}

/* A port that was free a moment ago; rank 0 binds it soon after, so a clash is unlikely. */
static int pick_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof addr;
    int port = -1;
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) == 0 &&
        getsockname(fd, (struct sockaddr *)&addr, &len) == 0)
        port = ntohs(addr.sin_port);
    close(fd);
    return port;
}

/* The allowed cores, split into nproc disjoint runs; with more ranks than cores, rank i
 * shares core i % ncores. */
static void rank_cpus(int rank, int nproc, const int *cpus, int ncpus, cpu_set_t *set) {
    CPU_ZERO(set);
    if (nproc <= ncpus) {
        int lo = (int)((long)rank * ncpus / nproc), hi = (int)((long)(rank + 1) * ncpus / nproc);
        for (int c = lo; c < hi; c++) CPU_SET(cpus[c], set);
    } else {
        CPU_SET(cpus[rank % ncpus], set);
    }
}

static void set_env_int(const char *name, long v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%ld", v);
    setenv(name, buf, 1);
}

/* Runs in the forked child; never returns. */
static void exec_rank(const tr_options *o, int rank, int out_w, int err_w, const cpu_set_t *cpus,
                      const char *token, int port, pid_t launcher) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != launcher) _exit(1); /* the launcher died before prctl took effect */
    int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE, SIGQUIT};
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
    if (rank != 0 || isatty(0)) {
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0) {
            dup2(devnull, 0);
            close(devnull);
        }
    }
    sched_setaffinity(0, sizeof *cpus, cpus);

    set_env_int("RANK", rank);
    set_env_int("WORLD_SIZE", o->nproc);
    set_env_int("LOCAL_RANK", rank);
    set_env_int("LOCAL_WORLD_SIZE", o->nproc);
    set_env_int("GROUP_RANK", 0);
    set_env_int("NODE_RANK", 0);
    setenv("MASTER_ADDR", o->master_addr, 1);
    set_env_int("MASTER_PORT", port);
    setenv("TANDEM_TOKEN", token, 1);
    if (!getenv("OMP_NUM_THREADS")) set_env_int("OMP_NUM_THREADS", CPU_COUNT(cpus));
    if (o->have_devices) set_env_int("CUDA_VISIBLE_DEVICES", o->devices[rank]);

    execv(o->program, o->argv);
    dprintf(2, "tandemrun: cannot run '%s': %s\n", o->program, strerror(errno));
    _exit(127);
}

typedef struct {
    const tr_options *o;
    tr_rank *ranks;
    int running;    /* ranks not yet reaped */
    int stopping;   /* the job is being torn down */
    int exit_code;  /* -1 until something decides it */
    double kill_at; /* when stopping: SIGKILL the survivors at this time */
} job;

static void signal_all(job *j, int sig) {
    for (int r = 0; r < j->o->nproc; r++)
        if (j->ranks[r].running) kill(-j->ranks[r].pid, sig);
}

static void stop_job(job *j, int sig, int exit_code) {
    if (j->exit_code < 0) j->exit_code = exit_code;
    if (j->stopping) return;
    j->stopping = 1;
    signal_all(j, sig);
    j->kill_at = now_s() + j->o->grace_s;
}

static void reap(job *j) {
    for (;;) {
        int st;
        pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid <= 0) return;
        tr_rank *rk = NULL;
        for (int r = 0; r < j->o->nproc; r++)
            if (j->ranks[r].running && j->ranks[r].pid == pid) rk = &j->ranks[r];
        if (!rk) continue;
        rk->running = 0;
        rk->status = st;
        j->running--;
        int failed = !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        if (!failed || j->stopping) continue;
        int others = j->running;
        char what[96];
        int code;
        if (WIFSIGNALED(st)) {
            snprintf(what, sizeof what, "was killed by signal %d (%s)", WTERMSIG(st),
                     sig_name(WTERMSIG(st)));
            code = 128 + WTERMSIG(st);
        } else {
            snprintf(what, sizeof what, "exited with status %d", WEXITSTATUS(st));
            code = WEXITSTATUS(st);
        }
        if (others > 0)
            fprintf(stderr, "tandemrun: rank %d (pid %d) %s; stopping the other %d rank%s\n",
                    rk->rank, (int)pid, what, others, others == 1 ? "" : "s");
        else
            fprintf(stderr, "tandemrun: rank %d (pid %d) %s\n", rk->rank, (int)pid, what);
        stop_job(j, SIGTERM, code);
    }
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

int tr_run_job(const tr_options *o) {
    char token[33];
    if (make_token(token) != 0) {
        fprintf(stderr, "tandemrun: cannot read /dev/urandom for the job token: %s\n",
                strerror(errno));
        return 1;
    }
    int port = o->master_port ? o->master_port : pick_free_port();
    if (port <= 0) {
        fprintf(stderr, "tandemrun: cannot find a free port for MASTER_PORT: %s\n",
                strerror(errno));
        return 1;
    }
    cpu_set_t allowed;
    int cpus[CPU_SETSIZE], ncpus = 0;
    if (sched_getaffinity(0, sizeof allowed, &allowed) == 0)
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &allowed)) cpus[ncpus++] = c;
    if (ncpus == 0) cpus[ncpus++] = 0;

    if (open_pipe(self_pipe) != 0) {
        fprintf(stderr, "tandemrun: pipe: %s\n", strerror(errno));
        return 1;
    }
    fcntl(self_pipe[1], F_SETFL, fcntl(self_pipe[1], F_GETFL) | O_NONBLOCK);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    int handled[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};
    for (size_t k = 0; k < sizeof handled / sizeof *handled; k++) sigaction(handled[k], &sa, NULL);
    signal(SIGPIPE, SIG_IGN); /* a closed stdout must not kill the launcher before its ranks */

    if (o->tee && mkdir(o->log_dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "tandemrun: cannot create log directory '%s': %s\n", o->log_dir,
                strerror(errno));
        return 1;
    }
    tr_rank *ranks = calloc((size_t)o->nproc, sizeof *ranks);
    if (!ranks) {
        fprintf(stderr, "tandemrun: out of memory\n");
        return 1;
    }
    job j = {.o = o, .ranks = ranks, .exit_code = -1};
    int capture = o->prefix || o->tee;
    pid_t self = getpid();
    fflush(NULL);
    for (int r = 0; r < o->nproc; r++) {
        tr_rank *rk = &ranks[r];
        rk->rank = r;
        rk->out.fd = rk->err.fd = rk->log_fd = -1;
        rk->out.out_fd = 1;
        rk->err.out_fd = 2;
        if (o->tee) {
            char path[4096];
            snprintf(path, sizeof path, "%s/rank_%d.log", o->log_dir, r);
            rk->log_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
            if (rk->log_fd < 0)
                fprintf(stderr, "tandemrun: cannot write '%s': %s\n", path, strerror(errno));
        }
        int po[2] = {-1, -1}, pe[2] = {-1, -1};
        if (capture && (open_pipe(po) != 0 || open_pipe(pe) != 0)) {
            fprintf(stderr, "tandemrun: pipe for rank %d: %s\n", r, strerror(errno));
            stop_job(&j, SIGKILL, 1);
            break;
        }
        cpu_set_t set;
        rank_cpus(r, o->nproc, cpus, ncpus, &set);
        pid_t pid = fork();
        if (pid == 0) exec_rank(o, r, po[1], pe[1], &set, token, port, self);
        if (capture) {
            close(po[1]);
            close(pe[1]);
        }
        if (pid < 0) {
            fprintf(stderr, "tandemrun: cannot start rank %d: %s\n", r, strerror(errno));
            if (capture) {
                close(po[0]);
                close(pe[0]);
            }
            stop_job(&j, SIGKILL, 1);
            break;
        }
        setpgid(pid, pid); /* also here, so that kill(-pid) works before the child runs */
        rk->pid = pid;
        rk->running = 1;
        rk->out.fd = po[0];
        rk->err.fd = pe[0];
        j.running++;
    }

    double deadline = o->timeout_s > 0 ? now_s() + o->timeout_s : 0;
    struct pollfd *fds = calloc(2 * (size_t)o->nproc + 1, sizeof *fds);
    tr_stream **owners = calloc(2 * (size_t)o->nproc + 1, sizeof *owners);
    tr_rank **owner_ranks = calloc(2 * (size_t)o->nproc + 1, sizeof *owner_ranks);
    if (!fds || !owners || !owner_ranks) {
        fprintf(stderr, "tandemrun: out of memory\n");
        stop_job(&j, SIGKILL, 1);
    }
    while (j.running > 0) {
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
        double t = now_s(), wake = 0;
        if (j.stopping && j.kill_at > 0) wake = j.kill_at;
        if (!j.stopping && deadline > 0) wake = deadline;
        int ms = -1;
        if (wake > 0) ms = wake <= t ? 0 : (int)((wake - t) * 1000) + 1;
        if (!fds) ms = ms < 0 || ms > 100 ? 100 : ms;
        int n = fds ? poll(fds, (nfds_t)nfds, ms) : poll(NULL, 0, ms);
        if (n < 0 && errno != EINTR) {
            fprintf(stderr, "tandemrun: poll: %s\n", strerror(errno));
            stop_job(&j, SIGKILL, 1);
        }
        for (int k = 1; n > 0 && k < nfds; k++)
            if (fds[k].revents) pump(owner_ranks[k], owners[k], o->prefix);
        if (n > 0 && fds[0].revents) {
            unsigned char sigs[64];
            ssize_t got;
            while ((got = read(self_pipe[0], sigs, sizeof sigs)) > 0) {
                for (ssize_t k = 0; k < got; k++) {
                    int sig = sigs[k];
                    if (sig == SIGCHLD) continue;
                    if (!j.stopping) {
                        fprintf(stderr, "tandemrun: received %s; stopping %d rank%s\n",
                                sig_name(sig), j.running, j.running == 1 ? "" : "s");
                        stop_job(&j, sig, 128 + sig);
                    } else if (sig == SIGINT) { /* a second Ctrl-C: do not wait out the grace */
                        signal_all(&j, SIGKILL);
                    }
                }
            }
        }
        reap(&j);
        t = now_s();
        if (j.stopping && j.kill_at > 0 && t >= j.kill_at) {
            signal_all(&j, SIGKILL);
            j.kill_at = t + 1.0;
        }
        if (!j.stopping && deadline > 0 && t >= deadline) {
            fprintf(stderr, "tandemrun: job timed out after %g s; stopping %d rank%s\n",
                    o->timeout_s, j.running, j.running == 1 ? "" : "s");
            stop_job(&j, SIGTERM, 124);
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
    free(fds);
    free(owners);
    free(owner_ranks);
    free(ranks);
    return j.exit_code < 0 ? 0 : j.exit_code;
}
