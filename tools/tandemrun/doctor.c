/* tandemrun's side of the hang doctor (tandem/doctor.h): the directory the ranks dump into
 * (TANDEM_DOCTOR_DIR), asking the ranks for their dumps (SIGUSR1, only to a rank that catches
 * it: one that never created a process group would die of it), the note on what became of each
 * rank's process, and the diagnosis printed when a job fails or times out, or when someone asks
 * (SIGUSR1 to tandemrun, or tandemrun --dump from another terminal, which is tr_dump_main). */
#include "tandem/doctor.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tandem/launch.h"

#include "tandemrun.h"

/* How long the ranks get to write their dumps before a failed job is stopped regardless. */
#define DUMP_WAIT_S 1.5

static double wall_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The flight recorder's thread in process `pid` (named "tandem-doctor"), or 0. */
static pid_t doctor_thread(pid_t pid) {
    char path[96], name[32];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    struct dirent *e;
    pid_t found = 0;
    while (d && !found && (e = readdir(d))) {
        int tid = atoi(e->d_name);
        if (tid <= 0) continue;
        snprintf(path, sizeof path, "/proc/%d/task/%d/comm", (int)pid, tid);
        FILE *f = fopen(path, "r");
        if (f && fgets(name, sizeof name, f) && strncmp(name, "tandem-doctor", 13) == 0)
            found = tid;
        if (f) fclose(f);
    }
    if (d) closedir(d);
    return found;
}

static int is_dump(const char *name) {
    size_t n = strlen(name);
    return strncmp(name, "rank", 4) == 0 && n > 5 && strcmp(name + n - 5, ".json") == 0;
}

/* Removes the dumps and notes of an earlier start from the directory; returns how many dumps
 * (only_count: counts them and removes nothing). */
static int clear_dir(const char *dir, int only_count) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    char path[PATH_MAX];
    int dumps = 0;
    while ((e = readdir(d))) {
        dumps += is_dump(e->d_name);
        int ours = is_dump(e->d_name) || strcmp(e->d_name, "launcher.json") == 0 ||
                   strcmp(e->d_name, "diagnosis.txt") == 0;
        if (!ours || only_count) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
    }
    closedir(d);
    return dumps;
}

int tr_doctor_open(const tr_options *o, tr_doctor *doc) {
    memset(doc, 0, sizeof *doc);
    const char *env = getenv("TANDEM_DOCTOR_DIR");
    const char *want = o->dump_dir ? o->dump_dir : env && *env ? env : NULL;
    if (want)
        snprintf(doc->dir, sizeof doc->dir, "%s", want);
    else
        snprintf(doc->dir, sizeof doc->dir, "/tmp/tandemrun-%d", (int)getpid());
    doc->kept = want != NULL;
    if (mkdir(doc->dir, 0700) != 0 && errno != EEXIST) {
        fprintf(stderr, "tandemrun: cannot make the dump directory %s: %s\n", doc->dir,
                strerror(errno));
        return -1;
    }
    char abs[PATH_MAX];
    if (realpath(doc->dir, abs)) snprintf(doc->dir, sizeof doc->dir, "%s", abs);
    clear_dir(doc->dir, 0);
    return 0;
}

void tr_doctor_close(tr_doctor *doc, int keep) {
    /* A job whose ranks wrote no dump (they never created a process group) leaves nothing. */
    if (doc->dir[0] && !doc->kept && (!keep || clear_dir(doc->dir, 1) == 0)) {
        clear_dir(doc->dir, 0);
        rmdir(doc->dir);
    }
}

void tr_doctor_request(tr_doctor *doc, td_job *j, int stop_code, int report) {
    double now = td_time_ns() * 1e-9;
    doc->since = wall_s();
    doc->until = now + DUMP_WAIT_S;
    doc->pending = 1;
    doc->stop_code = stop_code;
    doc->report = report;
    doc->nasked = 0;
    for (int i = 0; i < TR_MAX_RANKS; i++) doc->asked[i] = -1;
    for (int i = 0;; i++) {
        td_job_proc p = td_job_get(j, i);
        if (p.rank < 0) break;
        if (!p.running || !td_process_catches(p.pid, SIGUSR1)) continue;
        /* To the recorder's own thread, so that no other thread's sleep is cut short (else the
         * rank's pid, never its process group: what it started may not catch SIGUSR1). */
        pid_t tid = doctor_thread(p.pid);
        int sent = tid ? syscall(SYS_tgkill, (int)p.pid, (int)tid, SIGUSR1) == 0
                       : kill(p.pid, SIGUSR1) == 0;
        if (sent && doc->nasked < TR_MAX_RANKS) doc->asked[doc->nasked++] = p.rank;
    }
}

/* Whether the dump at path is the recorder's second writing, the one with the stacks (the
 * first ends with an empty list of threads). */
static int has_stacks(const char *path) {
    static const char first[] = "\"threads\": []}}\n";
    char tail[sizeof first] = "";
    FILE *f = fopen(path, "r");
    int done = f && fseek(f, -(long)(sizeof first - 1), SEEK_END) == 0 &&
               fread(tail, 1, sizeof first - 1, f) == sizeof first - 1;
    if (f) fclose(f);
    return done && strcmp(tail, first) != 0;
}

int tr_doctor_ready(const tr_doctor *doc, td_job *j) {
    if (td_time_ns() * 1e-9 >= doc->until) return 1;
    for (int i = 0; i < doc->nasked; i++) {
        int running = 0;
        for (int k = 0;; k++) {
            td_job_proc p = td_job_get(j, k);
            if (p.rank < 0) break;
            if (p.rank == doc->asked[i]) running = p.running;
        }
        if (!running) continue; /* it ended: whatever it wrote is all there will be */
        char path[PATH_MAX + 32];
        struct stat sb;
        snprintf(path, sizeof path, "%s/rank%d.json", doc->dir, doc->asked[i]);
        /* A dump from just before the request (the rank's own failure) will do, once it holds
         * the threads' stacks (the recorder writes the calls first, then again with them). */
        if (stat(path, &sb) != 0 ||
            (double)sb.st_mtim.tv_sec + (double)sb.st_mtim.tv_nsec * 1e-9 < doc->since - 0.25 ||
            !has_stacks(path))
            return 0;
    }
    return 1;
}

void tr_doctor_note(const tr_doctor *doc, td_job *j) {
    td_doctor_proc procs[TR_MAX_RANKS];
    char host[64] = "";
    gethostname(host, sizeof host - 1);
    int n = 0;
    for (int i = 0; n < TR_MAX_RANKS; i++) {
        td_job_proc p = td_job_get(j, i);
        if (p.rank < 0) break;
        td_doctor_proc *d = &procs[n++];
        memset(d, 0, sizeof *d);
        d->rank = p.rank;
        d->pid = (int)p.pid;
        d->ended = !p.running;
        d->signaled = d->ended && WIFSIGNALED(p.status);
        d->code = !d->ended ? 0 : d->signaled ? WTERMSIG(p.status) : WEXITSTATUS(p.status);
        d->recorder = p.running && td_process_catches(p.pid, SIGUSR1);
        snprintf(d->host, sizeof d->host, "%s", host);
    }
    if (td_doctor_write_procs(doc->dir, procs, n) != TD_OK)
        fprintf(stderr, "tandemrun: %s\n", td_last_error());
}

/* The dump directory of the last start that failed, for tr_doctor_trace. */
static char failed_dir[4096];

void tr_doctor_report(const tr_doctor *doc, int final) {
    char *text = NULL;
    if (clear_dir(doc->dir, 1) == 0) {
        /* No rank has the recorder: a failed job of other programs gets no word of it, a
         * question gets its answer. */
        if (final) return;
        text = strdup("no rank has written a dump: none has created a process group\n");
        if (!text) return;
    } else if (td_doctor_diagnose(doc->dir, &text) != TD_OK) {
        fprintf(stderr, "tandemrun: no diagnosis: %s\n", td_last_error());
        return;
    }
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/diagnosis.txt", doc->dir);
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
    for (char *line = text, *end; *line; line = end + 1) {
        end = strchr(line, '\n');
        if (!end) end = line + strlen(line);
        fprintf(stderr, "tandemrun: %.*s\n", (int)(end - line), line);
        if (!*end) break;
    }
    free(text);
    if (final) {
        snprintf(failed_dir, sizeof failed_dir, "%s", doc->dir);
        fprintf(stderr, "tandemrun: the ranks' dumps are in %s (tandem-doctor %s)\n", doc->dir,
                doc->dir);
    }
}

void tr_doctor_trace(const char *trace_dir) {
    if (!failed_dir[0]) return;
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/trace.json", trace_dir);
    if (td_doctor_trace(failed_dir, path) == TD_OK)
        fprintf(stderr, "tandemrun: the calls the ranks were waiting in end %s\n", path);
    else
        fprintf(stderr, "tandemrun: %s\n", td_last_error());
}

/* ---------------------------------------------------------------- tandemrun --dump [PID] */

/* The dump directory of the tandemrun with `pid`: its --doctor-dir, else its default. */
static void dir_of(pid_t pid, char *out, size_t cap) {
    char path[64], args[8192];
    snprintf(out, cap, "/tmp/tandemrun-%d", (int)pid);
    snprintf(path, sizeof path, "/proc/%d/cmdline", (int)pid);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(args, 1, sizeof args - 1, f) : 0;
    if (f) fclose(f);
    args[n] = 0;
    for (size_t at = 0; at < n; at += strlen(args + at) + 1) {
        const char *a = args + at, *value = NULL;
        if (strncmp(a, "--doctor-dir=", 13) == 0) value = a + 13;
        if (strcmp(a, "--doctor-dir") == 0 && at + strlen(a) + 1 < n) value = a + strlen(a) + 1;
        if (strcmp(a, "--") == 0) break;
        if (!value) continue;
        char cwd[PATH_MAX] = "";
        snprintf(path, sizeof path, "/proc/%d/cwd", (int)pid);
        ssize_t len = readlink(path, cwd, sizeof cwd - 1);
        cwd[len > 0 ? len : 0] = 0;
        int w = value[0] == '/' || !cwd[0] ? snprintf(out, cap, "%s", value)
                                           : snprintf(out, cap, "%s/%s", cwd, value);
        if (w < 0 || (size_t)w >= cap) out[0] = 0; /* no such directory: nothing will be found */
        return;
    }
}

/* The tandemrun processes running a job here, other than this one. */
static int find_jobs(pid_t *out, int cap) {
    char self[PATH_MAX], exe[PATH_MAX], path[64], args[256];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) return 0;
    self[len] = 0;
    DIR *d = opendir("/proc");
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) && n < cap) {
        pid_t pid = (pid_t)atoi(e->d_name);
        if (pid <= 0 || pid == getpid()) continue;
        snprintf(path, sizeof path, "/proc/%d/exe", (int)pid);
        len = readlink(path, exe, sizeof exe - 1);
        if (len <= 0) continue;
        exe[len] = 0;
        if (strcmp(exe, self) != 0) continue;
        snprintf(path, sizeof path, "/proc/%d/cmdline", (int)pid);
        FILE *f = fopen(path, "r");
        size_t got = f ? fread(args, 1, sizeof args - 1, f) : 0;
        if (f) fclose(f);
        args[got] = 0;
        if (got > strlen(args) && strcmp(args + strlen(args) + 1, "--dump") == 0) continue;
        out[n++] = pid;
    }
    if (d) closedir(d);
    return n;
}

int tr_dump_main(int argc, char **argv) {
    pid_t pid = 0, jobs[16];
    if (argc > 3 || (argc == 3 && (pid = (pid_t)atoi(argv[2])) <= 0)) {
        fprintf(stderr, "usage: tandemrun --dump [PID]   (PID: the tandemrun of the job)\n");
        return 2;
    }
    if (!pid) {
        int n = find_jobs(jobs, 16);
        if (n == 0) {
            fprintf(stderr, "tandemrun: --dump: no tandemrun job runs on this host\n");
            return 1;
        }
        if (n > 1) {
            fprintf(stderr,
                    "tandemrun: --dump: %d jobs run here; say which: tandemrun --dump PID,"
                    " PID one of",
                    n);
            for (int i = 0; i < n; i++) fprintf(stderr, " %d", (int)jobs[i]);
            fputc('\n', stderr);
            return 2;
        }
        pid = jobs[0];
    }
    char dir[PATH_MAX], path[PATH_MAX + 32];
    dir_of(pid, dir, sizeof dir);
    snprintf(path, sizeof path, "%s/diagnosis.txt", dir);
    double asked = wall_s();
    if (kill(pid, SIGUSR1) != 0) {
        fprintf(stderr, "tandemrun: --dump: cannot signal tandemrun %d: %s\n", (int)pid,
                strerror(errno));
        return 1;
    }
    /* The job's tandemrun asks its ranks, waits for their dumps and writes the diagnosis. */
    for (int k = 0; k < 1000; k++) {
        struct stat sb;
        if (stat(path, &sb) == 0 &&
            (double)sb.st_mtim.tv_sec + (double)sb.st_mtim.tv_nsec * 1e-9 >= asked - 0.01) {
            nanosleep(&(struct timespec){0, 20000000}, NULL); /* let it finish writing */
            FILE *f = fopen(path, "r");
            char buf[4096];
            size_t n;
            while (f && (n = fread(buf, 1, sizeof buf, f)) > 0) fwrite(buf, 1, n, stdout);
            if (f) fclose(f);
            return 0;
        }
        nanosleep(&(struct timespec){0, 10000000}, NULL);
    }
    fprintf(stderr, "tandemrun: --dump: no diagnosis from tandemrun %d in %s within 10 s\n",
            (int)pid, dir);
    return 1;
}
