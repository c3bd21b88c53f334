/* tandemrun: starts the ranks of a job on one host, torchrun style, or on several hosts when
 * started once on each (torchrun's multi-node form).
 *
 *   tandemrun --nproc-per-node 4 ./train --epochs 3
 *   tandemrun --nnodes 2 --node-rank R --master-addr A --master-port P --token T \
 *       --nproc-per-node 2 ./train
 *
 * This file reads and checks the command line (torchrun's spellings included) and hands
 * the job to supervise.c; rendezvous.c joins the nodes of a multi-node job. */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tandemrun.h"

static const char usage_text[] =
    "usage: tandemrun [options] program [args...]\n"
    "\n"
    "Starts N ranks of `program` on this host with the env contract RANK, WORLD_SIZE,\n"
    "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TANDEM_TOKEN, OMP_NUM_THREADS.\n"
    "\n"
    "  --nproc-per-node N   ranks to start (default 1, or one per --devices entry;\n"
    "                       'auto': one per device, else one per allowed CPU core)\n"
    "  --devices 0,1,3      GPU ids: local rank i gets CUDA_VISIBLE_DEVICES=<i-th id>\n"
    "  --master-addr A      rendezvous address (default 127.0.0.1)\n"
    "  --master-port P      rendezvous port (default: a free port)\n"
    "  --timeout S          stop the job after S seconds and exit 124\n"
    "  --grace-period S     seconds between SIGTERM and SIGKILL when stopping (default 5)\n"
    "  --tee                also write rank K's output to <log-dir>/rank_K.log\n"
    "  --log-dir DIR        directory for --tee (default tandemrun-logs)\n"
    "  --prefix, --no-prefix  prefix each output line with \"[rank K] \" (default on)\n"
    "  --nnodes N           hosts of the job, each running tandemrun with its --node-rank\n"
    "  --node-rank R        this host's index, 0 .. N-1; node 0 hosts the rendezvous store\n"
    "                       on --master-addr:--master-port (default port 29500 then)\n"
    "  --token T            the job's token, the same on every node (or TANDEM_TOKEN;\n"
    "                       torchrun's --rdzv-id works too)\n"
    "  --rdzv-timeout S     seconds the nodes wait for each other (default 300)\n"
    "  --standalone, --no-python  accepted for torchrun users\n"
    "  --max-restarts K     when a rank fails, stop the others and start the job again,\n"
    "                       up to K times (the program resumes from its checkpoint; one node)\n"
    "  --restart-nproc-per-node N|left  ranks of a restart (default: as before; 'left':\n"
    "                       one fewer, without the rank that failed)\n"
    "  --trace DIR          one Chrome/Perfetto trace of the job in DIR/trace.json: a row\n"
    "                       per rank, collectives linked across ranks (TANDEM_TRACE=DIR;\n"
    "                       docs/tracing.md)\n"
    "  --trace-ops          with --trace: every op of the graph too (TANDEM_TRACE_OPS=1)\n"
    "  --doctor-dir DIR     where the ranks write their dumps (TANDEM_DOCTOR_DIR), kept\n"
    "                       after the job (default: a directory in /tmp, removed when the\n"
    "                       job succeeds; docs/doctor.md)\n"
    "\n"
    "  tandemrun --dump [PID]   from another terminal: the diagnosis of a running job\n"
    "                       (PID: its tandemrun's, when several run); or kill -USR1 <tandemrun>\n"
    "\n"
    "Options also take torchrun's forms: --nproc_per_node=4, --master_port 29500.\n"
    "When a rank fails, the ranks write their dumps, the others get SIGTERM, then SIGKILL\n"
    "after the grace period, tandemrun prints which rank held the job up, doing what, and\n"
    "exits with the failed rank's status (128 + signal when it was killed), or restarts the\n"
    "job while --max-restarts allows.\n";

static int usage_error(const char *fmt, const char *arg) {
    fputs("tandemrun: ", stderr);
    fprintf(stderr, fmt, arg);
    fputs("\nrun 'tandemrun --help' for usage\n", stderr);
    return 2;
}

static int parse_int(const char *s, long lo, long hi, long *out) {
    if (!s || !*s) return 0;
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return 0;
    *out = v;
    return 1;
}

static int parse_seconds(const char *s, double *out) {
    if (!s || !*s) return 0;
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !(v > 0) || v > 1e9) return 0;
    *out = v;
    return 1;
}

/* "0,1,3" -> devices; every id a non-negative integer, no duplicates. */
static int parse_devices(const char *s, tr_options *o) {
    int n = 0;
    const char *p = s;
    while (*p) {
        if (!isdigit((unsigned char)*p)) return -1;
        char *end = NULL;
        long v = strtol(p, &end, 10);
        if (v > INT_MAX || n == TR_MAX_RANKS) return -1;
        for (int i = 0; i < n; i++)
            if (o->devices[i] == v) return -1;
        o->devices[n++] = (int)v;
        p = end;
        if (*p == ',') {
            p++;
            if (!*p) return -1;
        } else if (*p) {
            return -1;
        }
    }
    return n;
}

static int allowed_cpu_count(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    int n = CPU_COUNT(&set);
    return n > 0 ? n : 1;
}

/* Finds `name` the way execvp would; NULL when there is no executable of that name. */
static char *resolve_program(const char *name) {
    if (!*name) return NULL;
    if (strchr(name, '/')) return access(name, X_OK) == 0 ? strdup(name) : NULL;
    const char *path = getenv("PATH");
    if (!path || !*path) path = "/usr/local/bin:/usr/bin:/bin";
    size_t nlen = strlen(name);
    while (*path) {
        const char *colon = strchr(path, ':');
        size_t dlen = colon ? (size_t)(colon - path) : strlen(path);
        char *full = malloc(dlen + nlen + 3);
        if (!full) return NULL;
        if (dlen == 0) {
            snprintf(full, nlen + 3, "./%s", name);
        } else {
            memcpy(full, path, dlen);
            full[dlen] = '/';
            memcpy(full + dlen + 1, name, nlen + 1);
        }
        if (access(full, X_OK) == 0) return full;
        free(full);
        if (!colon) break;
        path = colon + 1;
    }
    return NULL;
}

int tr_parse_args(int argc, char **argv, tr_options *o) {
    memset(o, 0, sizeof *o);
    o->master_addr = "127.0.0.1";
    o->prefix = 1;
    o->log_dir = "tandemrun-logs";
    o->grace_s = 5.0;
    o->nnodes = 1;
    o->rdzv_timeout_s = 300;
    const char *nproc_arg = NULL;
    int i = 1;
    for (; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--") == 0) {
            i++;
            break;
        }
        if (arg[0] != '-' || arg[1] == '\0') break; /* the program */
        /* Normalise "--nproc_per_node=4" to name "nproc-per-node", value "4". */
        const char *body = arg + (arg[1] == '-' ? 2 : 1);
        char name[64];
        const char *eq = strchr(body, '=');
        size_t nlen = eq ? (size_t)(eq - body) : strlen(body);
        if (nlen >= sizeof name) return usage_error("unknown option '%s'", arg);
        for (size_t k = 0; k < nlen; k++) name[k] = body[k] == '_' ? '-' : body[k];
        name[nlen] = '\0';
        const char *value = eq ? eq + 1 : NULL;
#define TAKES_VALUE()                                                                \
    do {                                                                             \
        if (!value) {                                                                \
            if (i + 1 >= argc) return usage_error("option '%s' needs a value", arg); \
            value = argv[++i];                                                       \
        }                                                                            \
    } while (0)
        if (strcmp(name, "h") == 0 || strcmp(name, "help") == 0) {
            fputs(usage_text, stdout);
            return 1;
        } else if (strcmp(name, "nproc-per-node") == 0) {
            TAKES_VALUE();
            nproc_arg = value;
        } else if (strcmp(name, "devices") == 0) {
            TAKES_VALUE();
            int n = parse_devices(value, o);
            if (n <= 0)
                return usage_error("--devices wants distinct GPU ids like 0,1,3, got '%s'", value);
            o->have_devices = n;
        } else if (strcmp(name, "master-addr") == 0) {
            TAKES_VALUE();
            if (!*value) return usage_error("--master-addr is empty%s", "");
            o->master_addr = value;
        } else if (strcmp(name, "master-port") == 0) {
            TAKES_VALUE();
            long v;
            if (!parse_int(value, 1, 65535, &v))
                return usage_error("--master-port must be a port from 1 to 65535, got '%s'", value);
            o->master_port = (int)v;
        } else if (strcmp(name, "timeout") == 0) {
            TAKES_VALUE();
            if (!parse_seconds(value, &o->timeout_s))
                return usage_error("--timeout must be a positive number of seconds, got '%s'",
                                   value);
        } else if (strcmp(name, "grace-period") == 0) {
            TAKES_VALUE();
            if (!parse_seconds(value, &o->grace_s))
                return usage_error("--grace-period must be a positive number of seconds, got '%s'",
                                   value);
        } else if (strcmp(name, "max-restarts") == 0) {
            TAKES_VALUE();
            long v;
            if (!parse_int(value, 0, 1000000, &v))
                return usage_error("--max-restarts must be a count from 0, got '%s'", value);
            o->max_restarts = (int)v;
        } else if (strcmp(name, "restart-nproc-per-node") == 0) {
            TAKES_VALUE();
            long v;
            if (strcmp(value, "left") == 0)
                o->restart_nproc = TR_RESTART_LEFT;
            else if (parse_int(value, 1, TR_MAX_RANKS, &v))
                o->restart_nproc = (int)v;
            else
                return usage_error("--restart-nproc-per-node must be 'left' or an integer from 1 "
                                   "to 1024, got '%s'",
                                   value);
        } else if (strcmp(name, "trace") == 0) {
            TAKES_VALUE();
            if (!*value) return usage_error("--trace wants a directory%s", "");
            o->trace_dir = value;
        } else if (strcmp(name, "trace-ops") == 0) {
            o->trace_ops = 1;
        } else if (strcmp(name, "doctor-dir") == 0) {
            TAKES_VALUE();
            if (!*value) return usage_error("--doctor-dir wants a directory%s", "");
            o->dump_dir = value;
        } else if (strcmp(name, "log-dir") == 0) {
            TAKES_VALUE();
            o->log_dir = value;
        } else if (strcmp(name, "tee") == 0) {
            o->tee = 1; /* torchrun's --tee=3 picks streams; we always tee both */
        } else if (strcmp(name, "prefix") == 0) {
            o->prefix = 1;
        } else if (strcmp(name, "no-prefix") == 0) {
            o->prefix = 0;
        } else if (strcmp(name, "standalone") == 0 || strcmp(name, "no-python") == 0) {
            /* one host is all tandemrun does, and it always runs the program directly */
        } else if (strcmp(name, "nnodes") == 0) {
            TAKES_VALUE();
            /* torchrun's MIN:MAX is elastic; a fixed count may be written N:N. */
            char lo[32] = "", hi[32] = "";
            long v = 0;
            int fixed = sscanf(value, "%31[0-9]:%31[0-9]", lo, hi) == 2 ? strcmp(lo, hi) == 0 : 1;
            if (!fixed || !parse_int(lo[0] ? lo : value, 1, TR_MAX_RANKS, &v))
                return usage_error("--nnodes wants a number of hosts (or N:N; elastic ranges "
                                   "are not supported), got '%s'",
                                   value);
            o->nnodes = (int)v;
        } else if (strcmp(name, "node-rank") == 0) {
            TAKES_VALUE();
            long v;
            if (!parse_int(value, 0, TR_MAX_RANKS, &v))
                return usage_error("--node-rank wants a host index from 0, got '%s'", value);
            o->node_rank = (int)v;
        } else if (strcmp(name, "token") == 0 || strcmp(name, "rdzv-id") == 0) {
            TAKES_VALUE();
            if (!*value) return usage_error("--token is empty%s", "");
            o->token = value;
        } else if (strcmp(name, "rdzv-timeout") == 0) {
            TAKES_VALUE();
            if (!parse_seconds(value, &o->rdzv_timeout_s))
                return usage_error("--rdzv-timeout must be a positive number of seconds, got '%s'",
                                   value);
        } else {
            return usage_error("unknown option '%s'", arg);
        }
#undef TAKES_VALUE
    }
    if (nproc_arg) {
        long v;
        if (strcmp(nproc_arg, "auto") == 0) {
            o->nproc = o->have_devices ? o->have_devices : allowed_cpu_count();
        } else if (parse_int(nproc_arg, 1, TR_MAX_RANKS, &v)) {
            o->nproc = (int)v;
        } else {
            return usage_error("--nproc-per-node must be an integer from 1 to 1024 or 'auto', "
                               "got '%s'",
                               nproc_arg);
        }
    } else {
        o->nproc = o->have_devices ? o->have_devices : 1;
    }
    if (o->have_devices && o->have_devices != o->nproc) {
        fprintf(stderr,
                "tandemrun: --nproc-per-node %d but --devices lists %d devices; "
                "give one device per rank\n",
                o->nproc, o->have_devices);
        return 2;
    }
    if (o->node_rank >= o->nnodes) {
        fprintf(stderr, "tandemrun: --node-rank %d is not below --nnodes %d (nodes are 0 to %d)\n",
                o->node_rank, o->nnodes, o->nnodes - 1);
        return 2;
    }
    if (o->nnodes > 1) {
        if (!o->token) o->token = getenv("TANDEM_TOKEN");
        if (!o->token || !*o->token)
            return usage_error("a job on several hosts (--nnodes > 1) needs the job's token, the "
                               "same on every node: pass --token T or set TANDEM_TOKEN (see "
                               "docs/multihost.md)%s",
                               "");
        if (!o->master_port) o->master_port = 29500; /* torchrun's default: nodes must agree */
        if (o->max_restarts)
            return usage_error("--max-restarts restarts the ranks of one node; a job on several "
                               "hosts (--nnodes > 1) cannot restart yet%s",
                               "");
    }
    if (o->trace_ops && !o->trace_dir) return usage_error("--trace-ops needs --trace DIR%s", "");
    if (i >= argc) return usage_error("no program to run%s", "");
    char *path = resolve_program(argv[i]);
    if (!path) return usage_error("program '%s' not found or not executable", argv[i]);
    o->program = path;
    o->argv = argv + i;
    return 0;
}

/* --trace DIR: the directory made, and its absolute path in the ranks' environment. */
static int trace_env(const tr_options *o, char dir[PATH_MAX]) {
    if (mkdir(o->trace_dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "tandemrun: --trace %s: cannot make the directory: %s\n", o->trace_dir,
                strerror(errno));
        return -1;
    }
    if (!realpath(o->trace_dir, dir)) {
        fprintf(stderr, "tandemrun: --trace %s: %s\n", o->trace_dir, strerror(errno));
        return -1;
    }
    setenv("TANDEM_TRACE", dir, 1);
    if (o->trace_ops) setenv("TANDEM_TRACE_OPS", "1", 1);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "--dump") == 0) return tr_dump_main(argc, argv);
    tr_options opts;
    int rc = tr_parse_args(argc, argv, &opts);
    if (rc == 1) return 0;
    if (rc != 0) return rc;
    if (opts.have_devices && opts.restart_nproc) {
        fprintf(stderr, "tandemrun: --restart-nproc-per-node cannot change the world size with "
                        "--devices (one device per rank)\n");
        return 2;
    }
    char trace_dir[PATH_MAX];
    if (opts.trace_dir && trace_env(&opts, trace_dir) != 0) return 2;
    tr_restart restart = {opts.max_restarts, 0, opts.restart_nproc};
    for (;;) {
        int failed, next;
        char why[256];
        rc = tr_run_job(&opts, &failed);
        if (tr_interrupted()) break;
        if (!tr_restart_next(&restart, failed, opts.nproc, &next, why, sizeof why)) {
            if (*why)
                fprintf(stderr, "tandemrun: not restarting: %s; exiting with status %d\n", why, rc);
            break;
        }
        fprintf(stderr, "tandemrun: restart %d of %d after rank %d failed: starting %d rank%s\n",
                restart.done, restart.max_restarts, failed, next, next == 1 ? "" : "s");
        opts.nproc = next;
        opts.attempt = restart.done;
    }
    if (opts.trace_dir) {
        char path[PATH_MAX + 16];
        snprintf(path, sizeof path, "%s/trace.json", trace_dir);
        if (access(path, R_OK) == 0)
            fprintf(stderr, "tandemrun: the job's trace is %s (open it in ui.perfetto.dev)\n",
                    path);
        else
            fprintf(stderr,
                    "tandemrun: no trace in %s: the ranks write it when they destroy "
                    "their process group\n",
                    trace_dir);
    }
    free((char *)opts.program);
    return rc;
}
