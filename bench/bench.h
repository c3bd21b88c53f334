/* What every benchmark shares: CHECK (print the failed call and leave), running a function as
 * N ranks forked and pinned by td_spawn with each rank's result in shared memory, counting
 * the GPUs those ranks may use, medians, re-running
 * the program with one OpenMP thread (or another count), the CPU's name and the load average
 * for the table's heading, and a process's proportional share of memory.
 * Header-only; each bench/<name>.c includes it once. */
#ifndef TANDEM_BENCH_H
#define TANDEM_BENCH_H

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tandem/args.h"
#include "tandem/comm.h"
#include "tandem/device.h"
#include "tandem/graph.h"
#include "tandem/spawn.h"

/* A tandem call that must succeed; otherwise prints it and the error, and leaves. */
#define CHECK(call)                                                           \
    do {                                                                      \
        td_status check_s_ = (call);                                          \
        if (check_s_ != TD_OK) {                                              \
            fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call, \
                    td_status_string(check_s_), td_last_error());             \
            _exit(1);                                                         \
        }                                                                     \
    } while (0)

/* Ends a benchmark's option parse (td_args): returns when the run goes on, else exits after
 * the usage (--help, status 0) or the error (status 2). */
static inline void bench_args_finish(td_args *a, const char *usage) {
    int rc = td_args_finish(a, usage);
    if (rc >= 0) exit(rc);
}

/* --name a,b,c: a comma-separated list whose every item `ok` accepts (else the option's
 * error says it `takes`); *out points into argv. 1 when the argument was this option. */
static inline int bench_list_option(td_args *a, const char *name, const char **out,
                                    int (*ok)(const char *item), const char *takes) {
    if (!td_args_string(a, name, out)) return 0;
    if (a->failed) return 1;
    char buf[256];
    int good = snprintf(buf, sizeof buf, "%s", *out) < (int)sizeof buf && **out;
    for (char *save = NULL, *l = strtok_r(buf, ",", &save); good && l;
         l = strtok_r(NULL, ",", &save))
        good = ok(l);
    if (!good) td_args_bad_value(a, *out, takes);
    return 1;
}

/* A rank: fills `result` (the bytes bench_ranks was given) and returns 0 on success. */
typedef int (*bench_rank_fn)(int rank, int world, void *result, void *arg);

typedef struct {
    bench_rank_fn fn;
    void *arg;
    unsigned char *slots; /* (world, bytes), shared with the parent */
    size_t bytes;
} bench_job;

static inline int bench_rank_entry(int rank, int world, void *arg) {
    bench_job *j = arg;
    return j->fn(rank, world, j->slots + (size_t)rank * j->bytes, j->arg);
}

/* Runs fn as `world` ranks (td_spawn: the env contract set, so td_comm_create with the
 * defaults joins them; `pin`: each on its own core) and copies rank r's result into
 * results + r * bytes. Returns 0 when every rank succeeded. */
static inline int bench_ranks(int world, int pin, bench_rank_fn fn, void *arg, void *results,
                              size_t bytes) {
    size_t total = (size_t)world * bytes;
    void *shared =
        mmap(NULL, total ? total : 1, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) return 1;
    bench_job job = {fn, arg, shared, bytes};
    td_spawn_params p = td_spawn_default_params();
    p.nprocs = world;
    p.pin = pin;
    td_status s = td_spawn(bench_rank_entry, &job, &p);
    if (s != TD_OK) fprintf(stderr, "%s\n", td_last_error());
    if (results) memcpy(results, shared, total);
    munmap(shared, total ? total : 1);
    return s != TD_OK;
}

/* qsort's comparison of doubles, ascending. */
static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v's n values (sorted in place; the mean of the middle two when n is even). */
static inline double bench_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* The GPUs a forked rank may use, counted in a child so that the calling process keeps CUDA
 * unstarted (CUDA does not survive a fork); where there are none, the child prints
 * "<who>: no GPU can be used here (why); nothing measured". */
static inline int bench_gpus(const char *who) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        int n = 0;
        td_cuda_device_count(&n);
        if (n == 0)
            printf("%s: no GPU can be used here (%s); nothing measured\n", who,
                   td_cuda_unavailable() ? td_cuda_unavailable() : "no device");
        fflush(stdout);
        _exit(n > 100 ? 100 : n);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
    return WEXITSTATUS(status);
}

/* The shm world group of a rank started by bench_ranks. */
static inline td_comm *bench_comm(void) {
    td_comm_params p = td_comm_default_params();
    p.backend = TD_BACKEND_SHM;
    td_comm *c = NULL;
    CHECK(td_comm_create(&c, &p));
    return c;
}

/* OpenMP reads OMP_NUM_THREADS when the program loads: unless it is n, sets it and runs the
 * program again (returns only if that fails). */
static inline void bench_threads(char **argv, int n) {
    char want[16];
    snprintf(want, sizeof want, "%d", n);
    const char *threads = getenv("OMP_NUM_THREADS");
    if (threads && strcmp(threads, want) == 0) return;
    setenv("OMP_NUM_THREADS", want, 1);
    execv("/proc/self/exe", argv);
    perror("execv /proc/self/exe with OMP_NUM_THREADS set");
}

static inline void bench_one_thread(char **argv) { bench_threads(argv, 1); }

/* The CPU as /proc/cpuinfo names it, with what tells machines of one name apart: family and
 * model, and the vector features the kernels choose by (avx512f, avx512_bf16, amx_bf16,
 * avx512_fp16); then the CPU kernels' library, its version and the instruction set it
 * dispatches ("oneDNN 2.6.3, ISA avx512_core_bf16"). "unknown CPU" when there is no
 * /proc/cpuinfo. */
static inline const char *bench_cpu_name(char *buf, size_t cap) {
    static const char *const features[] = {"avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"};
    char name[256] = "unknown CPU", family[16] = "?", model[16] = "?", found[128] = "";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        static char line[1 << 14];
        while (fgets(line, sizeof line, f)) {
            char *colon = strchr(line, ':');
            if (!colon) continue;
            colon += colon[1] == ' ' ? 2 : 1;
            colon[strcspn(colon, "\n")] = 0;
            if (!strncmp(line, "model name", 10))
                snprintf(name, sizeof name, "%s", colon);
            else if (!strncmp(line, "cpu family", 10))
                snprintf(family, sizeof family, "%s", colon);
            else if (!strncmp(line, "model\t", 6))
                snprintf(model, sizeof model, "%s", colon);
            else if (!strncmp(line, "flags", 5)) {
                for (size_t i = 0; i < sizeof features / sizeof *features; i++) {
                    char want[32];
                    snprintf(want, sizeof want, " %s ", features[i]);
                    size_t n = strlen(colon);
                    colon[n] = ' '; /* so the last flag has a space after it too */
                    colon[n + 1] = 0;
                    if (strstr(colon - 1, want))
                        snprintf(found + strlen(found), sizeof found - strlen(found), " %s",
                                 features[i]);
                    colon[n] = 0;
                }
                break; /* the first processor says it all */
            }
        }
        fclose(f);
    }
    char kernels[128] = "";
    td_graph_backend_info(td_device_cpu(), kernels, sizeof kernels);
    int n = snprintf(buf, cap, "%s (family %s model %s;%s); %s", name, family, model,
                     *found ? found : " no avx512", kernels);
    if (n >= (int)cap && cap > 4) memcpy(buf + cap - 4, "...", 4); /* say it was cut */
    return buf;
}

/* The interpreter of the second PyTorch peer, a current 2.x from PyPI (scripts/deps.sh torch2). */
#define BENCH_TORCH2 ".venv/torch2/bin/python"

/* The version of the second PyTorch peer under `python` into v ("2.5.1"); where torch does not
 * import there, prints the one line that says its column is left out, and returns 0. */
static inline int bench_torch2(const char *python, char *v, size_t cap) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s -c 'import torch; print(torch.__version__)' 2>/dev/null", python);
    FILE *p = popen(cmd, "r");
    v[0] = 0;
    if (p && !fgets(v, (int)cap, p)) v[0] = 0;
    v[strcspn(v, "\n")] = 0;
    if (p && pclose(p) == 0 && v[0]) return 1;
    printf("PyTorch 2.x: not run (no torch imports under %s; sh scripts/deps.sh torch2 installs it "
           "in %s)\n",
           python, BENCH_TORCH2);
    return 0;
}

/* The 1, 5 and 15-minute load averages from /proc/loadavg ("" when unreadable): on a machine
 * shared with other work, what a table's reader needs to judge its timings by. */
static inline const char *bench_load_average(char *buf, size_t cap) {
    float a = 0, b = 0, c = 0;
    FILE *f = fopen("/proc/loadavg", "r");
    buf[0] = 0;
    if (f && fscanf(f, "%f %f %f", &a, &b, &c) == 3) snprintf(buf, cap, "%.2f %.2f %.2f", a, b, c);
    if (f) fclose(f);
    return buf;
}

/* The CPU time of every thread of this process so far, in seconds. */
static inline double bench_cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The process's proportional share of its anonymous and shared memory, in bytes: a page mapped
 * by k processes counts 1/k (the ranks map each other's regions of the group's memory, which the
 * resident size would count once per rank). Files (the libraries, whose share moves with
 * whatever else on the machine maps them) are left out. Linux's smaps_rollup. */
static inline size_t bench_pss_bytes(void) {
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    size_t kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "Pss_Anon:", 9) || !strncmp(line, "Pss_Shmem:", 10))
            kb += (size_t)atol(strchr(line, ':') + 1);
    if (f) fclose(f);
    return kb << 10;
}

#endif
