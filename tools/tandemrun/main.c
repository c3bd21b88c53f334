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

#include "tandem/args.h"

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
    "                       one fewer, without the rank that failed; with --tp and --pp,\n"
    "                       the largest mesh that fits: tp, then pp, halved until tp x pp\n"
    "                       ranks fit, data parallel over what is left)\n"
    "  --trace DIR          one Chrome/Perfetto trace of the job in DIR/trace.json: a row\n"
    "                       per rank, collectives linked across ranks (TANDEM_TRACE=DIR;\n"
    "                       docs/tracing.md)\n"
    "  --trace-ops          with --trace: every op of the graph too (TANDEM_TRACE_OPS=1)\n"
    "  --trace-merge DIR    merge the spans a traced job's ranks kept in DIR (under mpirun,\n"
    "                       when they could not gather them) into DIR/trace.json, and exit\n"
    "  --tp N, --pp N       the device mesh: N-way tensor and pipeline parallel, the rest\n"
    "                       of the ranks data parallel (TANDEM_TP, TANDEM_PP; td_mesh,\n"
    "                       docs/parallelism.md)\n"
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

/* "0,1,3" -> devices: distinct non-negative ids. */
static void devices_option(td_args *a, tr_options *o) {
    int n = 0;
    if (!td_args_int_list(a, "--devices", 0, INT_MAX, o->devices, TR_MAX_RANKS, &n) || a->failed)
        return;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (o->devices[i] == o->devices[j]) {
                td_args_error(a, "--devices names GPU %d twice", o->devices[i]);
                return;
            }
    o->have_devices = n;
}

/* --nnodes N, or torchrun's MIN:MAX with MIN = MAX (elastic ranges are not supported). */
static void nnodes_option(td_args *a, tr_options *o) {
    if (!td_args_is(a, "--nnodes")) return;
    const char *v = td_args_value(a);
    if (!v) return;
    char lo[32] = "", hi[32] = "", *end;
    if (sscanf(v, "%31[0-9]:%31[0-9]", lo, hi) == 2 && strcmp(lo, hi)) {
        td_args_bad_value(a, v, "a number of hosts (or N:N; elastic ranges are not supported)");
        return;
    }
    long n = strtol(lo[0] ? lo : v, &end, 10);
    if (end == (lo[0] ? lo : v) || *end || n < 1 || n > TR_MAX_RANKS)
        td_args_bad_value(a, v, "a number of hosts from 1 to 1024 (or N:N)");
    else
        o->nnodes = (int)n;
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
    const char *nproc_arg = NULL, *restart_arg = NULL, *program = NULL;
    int ignored = 0;
    td_args a;
    td_args_init(&a, "tandemrun", argc, argv);
    while (td_args_next(&a)) {
        if (td_args_positional(&a, &program)) break; /* the program; the rest are its */
        td_args_string(&a, "--nproc-per-node", &nproc_arg);
        devices_option(&a, o);
        td_args_string(&a, "--master-addr", &o->master_addr);
        td_args_int(&a, "--master-port", 1, 65535, &o->master_port);
        td_args_positive(&a, "--timeout", 1e9, &o->timeout_s);
        td_args_positive(&a, "--grace-period", 1e9, &o->grace_s);
        td_args_int(&a, "--max-restarts", 0, 1000000, &o->max_restarts);
        td_args_string(&a, "--restart-nproc-per-node", &restart_arg);
        td_args_string(&a, "--trace", &o->trace_dir);
        td_args_flag(&a, "--trace-ops", &o->trace_ops);
        td_args_string(&a, "--trace-merge", &o->merge_dir);
        td_args_string(&a, "--doctor-dir", &o->dump_dir);
        td_args_string(&a, "--log-dir", &o->log_dir);
        if (td_args_is(&a, "--tee")) o->tee = 1; /* torchrun's --tee=3 picks streams: both */
        td_args_set(&a, "--prefix", &o->prefix, 1);
        td_args_set(&a, "--no-prefix", &o->prefix, 0);
        /* one host is all tandemrun does, and it always runs the program directly */
        td_args_flag(&a, "--standalone", &ignored);
        td_args_flag(&a, "--no-python", &ignored);
        nnodes_option(&a, o);
        td_args_int(&a, "--node-rank", 0, TR_MAX_RANKS, &o->node_rank);
        td_args_string(&a, "--token", &o->token);
        td_args_string(&a, "--rdzv-id", &o->token);
        td_args_positive(&a, "--rdzv-timeout", 1e9, &o->rdzv_timeout_s);
        td_args_int(&a, "--tp", 1, TR_MAX_RANKS, &o->tp);
        td_args_int(&a, "--pp", 1, TR_MAX_RANKS, &o->pp);
    }
    int program_at = a.index;
    if (!a.failed && !a.help) {
        if (!*o->master_addr) td_args_error(&a, "--master-addr is empty");
        if (o->token && !*o->token) td_args_error(&a, "--token is empty");
        if (o->trace_dir && !*o->trace_dir) td_args_error(&a, "--trace wants a directory");
    }
    if (restart_arg && !strcmp(restart_arg, "left")) {
        o->restart_nproc = TR_RESTART_LEFT;
    } else if (restart_arg) {
        char *end;
        long v = strtol(restart_arg, &end, 10);
        if (end == restart_arg || *end || v < 1 || v > TR_MAX_RANKS)
            td_args_error(&a,
                          "--restart-nproc-per-node %s: expected left or an integer from 1 "
                          "to 1024",
                          restart_arg);
        else
            o->restart_nproc = (int)v;
    }
    if (!nproc_arg) {
        o->nproc = o->have_devices ? o->have_devices : 1;
    } else if (!strcmp(nproc_arg, "auto")) {
        o->nproc = o->have_devices ? o->have_devices : allowed_cpu_count();
    } else {
        char *end;
        long v = strtol(nproc_arg, &end, 10);
        if (end == nproc_arg || *end || v < 1 || v > TR_MAX_RANKS)
            td_args_error(&a, "--nproc-per-node %s: expected an integer from 1 to 1024 or auto",
                          nproc_arg);
        else
            o->nproc = (int)v;
    }
    if (o->have_devices && o->have_devices != o->nproc)
        td_args_error(&a,
                      "--nproc-per-node %d but --devices lists %d devices; give one device per "
                      "rank",
                      o->nproc, o->have_devices);
    if (o->node_rank >= o->nnodes)
        td_args_error(&a, "--node-rank %d is not below --nnodes %d (nodes are 0 to %d)",
                      o->node_rank, o->nnodes, o->nnodes - 1);
    if (o->nnodes > 1) {
        if (!o->token) o->token = getenv("TANDEM_TOKEN");
        if (!o->token || !*o->token)
            td_args_error(&a, "a job on several hosts (--nnodes > 1) needs the job's token, the "
                              "same on every node: pass --token T or set TANDEM_TOKEN (see "
                              "docs/multihost.md)");
        if (!o->master_port) o->master_port = 29500; /* torchrun's default: nodes must agree */
        if (o->max_restarts)
            td_args_error(&a, "--max-restarts restarts the ranks of one node; a job on several "
                              "hosts (--nnodes > 1) cannot restart yet");
    }
    if (o->trace_ops && !o->trace_dir) td_args_error(&a, "--trace-ops needs --trace DIR");
    long mesh = (long)(o->tp ? o->tp : 1) * (o->pp ? o->pp : 1), world = (long)o->nnodes * o->nproc;
    if (!a.failed && world % mesh)
        td_args_error(&a,
                      "--tp %d x --pp %d = %ld ranks does not divide the job's %ld ranks (the "
                      "rest are data parallel)",
                      o->tp ? o->tp : 1, o->pp ? o->pp : 1, mesh, world);
    if (!program && !o->merge_dir) td_args_error(&a, "no program to run");
    char *path = program ? resolve_program(program) : NULL;
    if (program && !path) td_args_error(&a, "program '%s' not found or not executable", program);
    int rc = td_args_finish(&a, usage_text);
    if (rc >= 0) {
        free(path);
        return rc == 0 ? 1 : rc;
    }
    o->program = path;
    o->argv = argv + program_at;
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "--dump") == 0) return tr_dump_main(argc, argv);
    tr_options opts;
    int rc = tr_parse_args(argc, argv, &opts);
    if (rc == 1) return 0;
    if (rc != 0) return rc;
    if (opts.merge_dir) {
        free((char *)opts.program);
        return tr_trace_report(opts.merge_dir, -1);
    }
    if (opts.have_devices && opts.restart_nproc) {
        fprintf(stderr, "tandemrun: --restart-nproc-per-node cannot change the world size with "
                        "--devices (one device per rank)\n");
        free((char *)opts.program);
        return 2;
    }
    char trace_dir[PATH_MAX];
    if (opts.trace_dir && tr_trace_prepare(&opts, trace_dir) != 0) {
        free((char *)opts.program);
        return 2;
    }
    char size[16];
    if (opts.tp) snprintf(size, sizeof size, "%d", opts.tp), setenv("TANDEM_TP", size, 1);
    if (opts.pp) snprintf(size, sizeof size, "%d", opts.pp), setenv("TANDEM_PP", size, 1);
    tr_restart restart = {opts.max_restarts, 0, opts.restart_nproc};
    int failed = -1;
    for (;;) {
        int next;
        char why[256];
        if (opts.trace_dir && tr_trace_clear(trace_dir) != 0) {
            free((char *)opts.program);
            return 2;
        }
        rc = tr_run_job(&opts, &failed);
        if (tr_interrupted()) break;
        if (!tr_restart_next(&restart, failed, opts.nproc, &next, why, sizeof why)) {
            if (*why)
                fprintf(stderr, "tandemrun: not restarting: %s; exiting with status %d\n", why, rc);
            break;
        }
        char layout[80] = "";
        if ((opts.tp || opts.pp) && next != opts.nproc) { /* a mesh that fits the ranks */
            int tp = opts.tp ? opts.tp : 1, pp = opts.pp ? opts.pp : 1;
            next = tr_restart_layout(next, &tp, &pp);
            snprintf(layout, sizeof layout, " as tp %d x pp %d x dp %d", tp, pp, next / (tp * pp));
            if (opts.tp)
                snprintf(size, sizeof size, "%d", opts.tp = tp), setenv("TANDEM_TP", size, 1);
            if (opts.pp)
                snprintf(size, sizeof size, "%d", opts.pp = pp), setenv("TANDEM_PP", size, 1);
        }
        fprintf(stderr, "tandemrun: restart %d of %d after rank %d failed: starting %d rank%s%s\n",
                restart.done, restart.max_restarts, failed, next, next == 1 ? "" : "s", layout);
        opts.nproc = next;
        opts.attempt = restart.done;
    }
    if (opts.trace_dir) {
        tr_trace_report(trace_dir, failed);
        tr_doctor_trace(trace_dir);
    }
    free((char *)opts.program);
    return rc;
}
