/* One trace of a job, over real ranks: process groups record each collective as a span named
 * as in error messages, linked by the same key on every rank and by different keys in
 * different groups (sub-groups included), the progress thread's row named; every rank's trace
 * gathered into one file where the late rank is the one the others waited for; the job trace
 * TANDEM_TRACE asks for, written at td_comm_destroy, or rank by rank when a rank died; a
 * graph's every op as a span; and tandemrun --trace around the training example's DDP and
 * pipeline jobs, read back as Perfetto would: every rank's rows, spans nested and in order,
 * collectives linked. */
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#include "tandem/tandem.h"

#include "test.h"
#include "test_comm_util.h"
#include "test_program.h"    /* run, output, fashion_mnist_subset */
#include "test_trace_json.h" /* json_parse_file, find_event, find_meta, count_ph */

static char dir[64], launcher[PATH_MAX + 16], mnist[PATH_MAX + 16], short_set[96];
static char self[PATH_MAX];

/* The link of every span whose name starts with `prefix`, in recording order. */
static int links_of(td_trace *trace, const char *prefix, int64_t *out, int cap) {
    int n = 0;
    for (size_t i = 0; i < td_trace_count(trace) && n < cap; i++) {
        td_trace_event e;
        if (td_trace_event_get(trace, i, &e) == TD_OK && !strncmp(e.name, prefix, strlen(prefix)))
            out[n++] = (int64_t)e.link;
    }
    return n;
}

static void record_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    td_trace *trace = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 30));
    CHECK_OK(td_trace_create(&trace, rank));
    if (!comm || !trace) return;
    CHECK(td_comm_trace(comm) == NULL);
    CHECK_OK(td_comm_set_trace(comm, trace));
    CHECK(td_comm_trace(comm) == trace);
    float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    CHECK_OK(td_comm_allreduce(comm, x, x, 8, TD_F32, TD_OP_SUM)); /* inline */
    td_request *req[2];
    CHECK_OK(td_comm_iallreduce(comm, x, x, 8, TD_F32, TD_OP_MAX, &req[0]));
    CHECK_OK(td_comm_ibroadcast(comm, x, 8, TD_F32, 1, &req[1]));
    CHECK_OK(td_request_waitall(2, req)); /* both on the progress thread */
    CHECK_OK(td_comm_barrier(comm));
    CHECK_EQ(td_trace_count(trace), 4);
    td_trace_event e;
    CHECK_OK(td_trace_event_get(trace, 0, &e));
    CHECK(!strcmp(e.name, "allreduce #0 (f32, 8 elements, sum)") && !strcmp(e.category, "comm"));
    CHECK_EQ(e.tid, (int)syscall(SYS_gettid));
    CHECK_OK(td_trace_event_get(trace, 2, &e));
    CHECK(!strcmp(e.name, "broadcast #2 (f32, 8 elements, root 1)"));
    CHECK(e.tid != (int)syscall(SYS_gettid));
    const char *row = td_trace_track_name(trace, e.tid);
    CHECK(row && !strcmp(row, "communication"));
    /* The same call has the same link on every rank; different calls have different links. */
    int64_t mine[4] = {0}, all[4 * 8];
    CHECK_EQ(links_of(trace, "", mine, 4), 4);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < i; j++) CHECK(mine[i] != mine[j] && mine[i] != 0);
    CHECK_OK(td_comm_allgather(comm, mine, all, 4, TD_I64));
    for (int r = 0; r < size; r++)
        for (int i = 0; i < 4; i++) CHECK_EQ(all[r * 4 + i], mine[i]);
    /* Sub-groups by colour: {0, 2} and {1}; their first calls link within a group only. */
    td_comm *half = NULL;
    CHECK_OK(td_comm_split(comm, rank % 2, rank, &half));
    if (half) {
        CHECK(td_comm_trace(half) == trace);
        CHECK_OK(td_comm_allreduce(half, x, x, 8, TD_F32, TD_OP_SUM));
        int64_t link = 0, links[8];
        td_trace_event last;
        CHECK_OK(td_trace_event_get(trace, td_trace_count(trace) - 1, &last));
        link = (int64_t)last.link;
        CHECK(link != mine[0]); /* #0 of another group */
        CHECK_OK(td_comm_allgather(comm, &link, links, 1, TD_I64));
        CHECK_EQ(links[0], links[2]);
        CHECK(links[1] != links[0]);
        td_comm_destroy(half);
    }
    /* Without a trace nothing more is recorded. */
    size_t before = td_trace_count(trace);
    CHECK_OK(td_comm_set_trace(comm, NULL));
    CHECK_OK(td_comm_barrier(comm));
    CHECK_EQ(td_trace_count(trace), before);
    td_comm_destroy(comm);
    td_trace_destroy(trace);
}

static void collectives_are_recorded_and_linked(void) {
    CHECK_EQ(test_run_ranks(3, record_rank, NULL, 60, 0), 0);
}

/* Rank `late` arrives 60 ms after the others at allreduce #1. */
static void late_rank_calls(td_comm *comm, int rank, int late) {
    float x[1024] = {0};
    CHECK_OK(td_comm_allreduce(comm, x, x, 1024, TD_F32, TD_OP_SUM));
    if (rank == late) test_sleep_ms(60);
    CHECK_OK(td_comm_allreduce(comm, x, x, 1024, TD_F32, TD_OP_SUM));
    CHECK_OK(td_comm_barrier(comm));
}

/* In the merged file at `path`: a row per rank in `ranks` (n of them), the spans of `call`
 * ("allreduce #1 ") on each saying rank `late` arrived last, the others having waited at least
 * 40 ms, and an arrow from rank `late` to each other rank. */
static void check_merged(const char *path, const int *ranks, int n, const char *call, int late,
                         int hosts) {
    static json_reader r;
    CHECK(json_parse_file(path, &r));
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    for (int i = 0; i < n; i++) {
        const json_event *p = find_meta(&r, "process_name", ranks[i], 0);
        char want[300];
        if (hosts)
            snprintf(want, sizeof want, "rank %d (%s)", ranks[i], host);
        else
            snprintf(want, sizeof want, "rank %d", ranks[i]);
        if (!p || strcmp(p->arg_name, want) != 0)
            TEST_FAIL_AT("%s: no process row \"%s\"", path, want);
    }
    int spans = 0, arrows = 0;
    char last[32], waited[48];
    snprintf(last, sizeof last, "rank %d", late);
    snprintf(waited, sizeof waited, "waited for rank %d", late);
    for (int i = 0; i < r.n_events; i++) {
        const json_event *e = &r.events[i];
        if (!strcmp(e->ph, "X") && !strncmp(e->name, call, strlen(call))) {
            spans++;
            CHECK(!strcmp(e->arg_last, last));
            if (e->pid != late) CHECK(e->dur >= 40000); /* microseconds */
        }
        arrows += !strcmp(e->ph, "s") && !strcmp(e->name, waited) && e->pid == late;
    }
    CHECK_EQ(spans, n);
    CHECK(arrows >= n - 1);
    CHECK_EQ(count_ph(&r, "s"), count_ph(&r, "f"));
}

static void gather_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *comm = NULL;
    td_trace *trace = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 30));
    CHECK_OK(td_trace_create(&trace, rank));
    if (!comm || !trace) return;
    CHECK_OK(td_comm_set_trace(comm, trace));
    late_rank_calls(comm, rank, 2);
    CHECK_OK(td_comm_set_trace(comm, NULL));
    char path[128];
    snprintf(path, sizeof path, "%s/gathered.json", dir);
    CHECK_OK(td_comm_trace_write(comm, trace, path));
    CHECK_OK(td_comm_barrier(comm));
    if (rank == 0) check_merged(path, (const int[]){0, 1, 2}, 3, "allreduce #1 ", 2, 0);
    /* A rank without a trace adds no row. */
    snprintf(path, sizeof path, "%s/without1.json", dir);
    CHECK_OK(td_comm_trace_write(comm, rank == 1 ? NULL : trace, path));
    if (rank == 0) {
        static json_reader r;
        CHECK(json_parse_file(path, &r));
        CHECK(find_meta(&r, "process_name", 0, 0) && find_meta(&r, "process_name", 2, 0));
        CHECK(find_meta(&r, "process_name", 1, 0) == NULL);
    }
    td_comm_destroy(comm);
    td_trace_destroy(trace);
}

static void trace_write_gathers_every_rank(void) {
    CHECK_EQ(test_run_ranks(3, gather_rank, NULL, 60, 0), 0);
}

/* TANDEM_TRACE=DIR: no tracing code in the program, one file for the job. */
static void job_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    setenv("TANDEM_TRACE", dir, 1);
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 30));
    if (!comm) return;
    CHECK(td_comm_trace(comm) != NULL);
    td_request *req;
    float x[16] = {0};
    CHECK_OK(td_comm_iallreduce(comm, x, x, 16, TD_F32, TD_OP_SUM, &req));
    CHECK_OK(td_request_wait(req));
    late_rank_calls(comm, rank, 1);
    td_comm_destroy(comm);
}

static void job_trace_from_the_environment(void) {
    char path[128];
    snprintf(path, sizeof path, "%s/trace.json", dir);
    remove(path);
    CHECK_EQ(test_run_ranks(3, job_rank, NULL, 60, 0), 0);
    CHECK(access(path, R_OK) == 0);
    check_merged(path, (const int[]){0, 1, 2}, 3, "allreduce #2 ", 1, 1);
    static json_reader r;
    CHECK(json_parse_file(path, &r));
    int communication = 0;
    for (int i = 0; i < r.n_events; i++)
        communication += !strcmp(r.events[i].ph, "M") && !strcmp(r.events[i].name, "thread_name") &&
                         !strcmp(r.events[i].arg_name, "communication");
    CHECK_EQ(communication, 3); /* the progress thread of each rank */
    /* the thread that made the group, which names no row itself, is each rank's "compute" */
    int compute = 0;
    for (int i = 0; i < r.n_events; i++)
        compute += !strcmp(r.events[i].ph, "M") && !strcmp(r.events[i].name, "thread_name") &&
                   !strcmp(r.events[i].arg_name, "compute");
    CHECK_EQ(compute, 3);
    /* what the ranks kept as they recorded is gone once the job's file is written */
    for (int rank = 0; rank < 3; rank++) {
        snprintf(path, sizeof path, "%s/rank%d.trace", dir, rank);
        CHECK(access(path, F_OK) != 0);
    }
    snprintf(path, sizeof path, "%s/trace.json", dir);
    remove(path);
}

/* Rank 2 dies after the first call: the others' next call fails, and at destroy they cannot
 * gather the trace. What every rank recorded stays in its kept file, rank 2's too, and
 * tandemrun --trace-merge (td_job_trace_collect) makes the job's trace of them. */
static void dying_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    setenv("TANDEM_TRACE", dir, 1);
    td_comm *comm = NULL;
    CHECK_OK(test_comm_create(&comm, rank, size, port, 30));
    if (!comm) return;
    float x[16] = {0};
    CHECK_OK(td_comm_allreduce(comm, x, x, 16, TD_F32, TD_OP_SUM));
    if (rank == 2) _exit(3);
    CHECK(td_comm_allreduce(comm, x, x, 16, TD_F32, TD_OP_SUM) != TD_OK);
    td_comm_destroy(comm);
}

static void job_trace_survives_a_dead_rank(void) {
    char path[128];
    CHECK_EQ(test_run_ranks(3, dying_rank, NULL, 60, 0), 1); /* rank 2's exit status */
    snprintf(path, sizeof path, "%s/trace.json", dir);
    CHECK(access(path, F_OK) != 0);
    CHECK_EQ(run("%s --trace-merge %s", launcher, dir), 0); /* as after mpirun */
    CHECK(strstr(output, "the job's trace is") && strstr(output, "from what 3 ranks kept"));
    static json_reader r;
    CHECK(json_parse_file(path, &r));
    for (int rank = 0; rank < 3; rank++) {
        int found = 0;
        for (int i = 0; i < r.n_events; i++)
            found += r.events[i].pid == rank &&
                     !strcmp(r.events[i].name, "allreduce #0 (f32, 16 elements, sum)");
        if (found != 1) TEST_FAIL_AT("rank %d has %d spans of the first call", rank, found);
        snprintf(path, sizeof path, "%s/rank%d.trace", dir, rank);
        CHECK(access(path, F_OK) != 0); /* merged, then removed */
    }
    snprintf(path, sizeof path, "%s/trace.json", dir);
    remove(path);
    int ranks = -1;
    CHECK_STATUS(td_job_trace_collect(dir, &ranks), TD_ENOTFOUND);
    CHECK_EQ(ranks, 0);
}

/* td_graph_params.trace: each node's forward and backward, in order, on the calling thread,
 * whose row is named "compute". */
static void graph_records_every_op(void) {
    td_trace *trace = NULL;
    CHECK_OK(td_trace_create(&trace, 0));
    td_graph_params gp = td_graph_default_params();
    gp.trace = trace;
    td_graph *g = NULL;
    td_model m;
    CHECK_OK(td_graph_create(&g, &gp));
    CHECK_OK(td_model_build(g, TD_MODEL_MLP, 4, 1, &m));
    CHECK_OK(td_graph_compile(g));
    if (!g || !trace) return;
    CHECK_OK(td_graph_forward(g));
    size_t forward = td_trace_count(trace);
    CHECK(forward >= 5);
    CHECK_OK(td_graph_backward(g, m.loss));
    size_t all = td_trace_count(trace);
    CHECK(all > forward);
    td_trace_event first, last, back;
    CHECK_OK(td_trace_event_get(trace, 0, &first));
    CHECK_OK(td_trace_event_get(trace, forward - 1, &last));
    CHECK_OK(td_trace_event_get(trace, forward, &back));
    CHECK(!strcmp(first.category, "forward") && !strcmp(back.category, "backward"));
    CHECK(strchr(first.name, ':') != NULL); /* "linear:0" */
    CHECK(last.start_ns >= first.start_ns + first.dur_ns);
    CHECK(!strcmp(back.name, last.name) || back.start_ns >= last.start_ns); /* reverse order */
    const char *row = td_trace_track_name(trace, first.tid);
    CHECK(row && !strcmp(row, "compute"));
    CHECK_EQ(first.tid, (int)syscall(SYS_gettid));
    td_graph_destroy(g);
    td_trace_destroy(trace);
}

/* ---- what a job's merged trace must hold, read back from the file ---------------------- */

/* Microseconds with nanosecond decimals, read as doubles: ends may differ by a rounding. */
#define SAME_US 0.002

/* The row of rank `pid` named `name` (its thread id), or -1. */
static int row_named(const json_reader *r, int pid, const char *name) {
    for (int i = 0; i < r->n_events; i++) {
        const json_event *e = &r->events[i];
        if (e->pid == pid && !strcmp(e->ph, "M") && !strcmp(e->name, "thread_name") &&
            !strcmp(e->arg_name, name))
            return e->tid;
    }
    return -1;
}

static int by_start_then_longest(const void *a, const void *b) {
    const json_event *x = *(const json_event *const *)a, *y = *(const json_event *const *)b;
    if (x->ts != y->ts) return x->ts < y->ts ? -1 : 1;
    return (x->dur < y->dur) - (x->dur > y->dur);
}

/* Every span belongs to one of the job's `ranks` processes and to a named row, and the spans of
 * each row nest: a span that starts inside another ends inside it too (Perfetto draws a row's
 * spans as a stack and misdraws any that overlap otherwise). */
static void check_rows_nest(const json_reader *r, int ranks) {
    static const json_event *row[4096];
    static char done[4096];
    memset(done, 0, sizeof done);
    for (int i = 0; i < r->n_events; i++) {
        const json_event *e = &r->events[i];
        if (strcmp(e->ph, "X") || done[i]) continue;
        if (e->pid < 0 || e->pid >= ranks || !e->has_ts || !e->has_dur || e->dur < 0)
            TEST_FAIL_AT("span \"%s\": pid %d of %d ranks, ts %d dur %d (%g)", e->name, e->pid,
                         ranks, e->has_ts, e->has_dur, e->dur);
        if (!find_meta(r, "thread_name", e->pid, e->tid))
            TEST_FAIL_AT("span \"%s\": row %d of rank %d has no name", e->name, e->tid, e->pid);
        int n = 0;
        for (int j = i; j < r->n_events; j++) {
            const json_event *o = &r->events[j];
            if (!strcmp(o->ph, "X") && o->pid == e->pid && o->tid == e->tid) {
                row[n++] = o;
                done[j] = 1;
            }
        }
        qsort(row, (size_t)n, sizeof row[0], by_start_then_longest);
        const json_event *open[64];
        int depth = 0;
        for (int k = 0; k < n; k++) {
            while (depth && row[k]->ts >= open[depth - 1]->ts + open[depth - 1]->dur - SAME_US)
                depth--;
            if (depth &&
                row[k]->ts + row[k]->dur > open[depth - 1]->ts + open[depth - 1]->dur + SAME_US) {
                TEST_FAIL_AT("rank %d row %d: \"%s\" at %.3f+%.3f us overlaps \"%s\" at "
                             "%.3f+%.3f us without nesting in it",
                             e->pid, e->tid, row[k]->name, row[k]->ts, row[k]->dur,
                             open[depth - 1]->name, open[depth - 1]->ts, open[depth - 1]->dur);
                return;
            }
            if (depth < 64) open[depth++] = row[k];
        }
    }
}

/* The collective span on rank `pid`'s row `tid` that starts at `ts`, or with `name` (not NULL)
 * the one of that name that holds `ts`; or NULL. */
static const json_event *comm_span_at(const json_reader *r, int pid, int tid, double ts,
                                      const char *name) {
    for (int i = 0; i < r->n_events; i++) {
        const json_event *e = &r->events[i];
        if (strcmp(e->ph, "X") || strcmp(e->cat, "comm") || e->pid != pid || e->tid != tid)
            continue;
        if (name ? !strcmp(e->name, name) && e->ts - SAME_US <= ts && ts <= e->ts + e->dur + SAME_US
                 : e->ts == ts)
            return e;
    }
    return NULL;
}

/* Collectives linked across ranks: each arrow starts where the last rank's span of a call
 * starts and ends in another rank's span of the same call (the same name: group, sequence
 * number, arguments); and at least `calls` calls are joined so. */
static void check_links(const json_reader *r, int calls) {
    int arrows = 0;
    for (int i = 0; i < r->n_events; i++) {
        const json_event *s = &r->events[i];
        if (strcmp(s->ph, "s")) continue;
        const json_event *f = NULL;
        for (int j = 0; j < r->n_events; j++)
            if (!strcmp(r->events[j].ph, "f") && r->events[j].id == s->id) {
                CHECK(f == NULL); /* one end per arrow */
                f = &r->events[j];
            }
        if (!f) TEST_FAIL_AT("arrow %g from rank %d has no end", s->id, s->pid);
        if (!f) return;
        const json_event *from = comm_span_at(r, s->pid, s->tid, s->ts, NULL);
        const json_event *to = from ? comm_span_at(r, f->pid, f->tid, f->ts, from->name) : NULL;
        if (!from || !to || from->pid == to->pid || !to->arg_last[0])
            TEST_FAIL_AT("arrow %g from rank %d at %.3f us to rank %d at %.3f us: no span of "
                         "\"%s\" at its end",
                         s->id, s->pid, s->ts, f->pid, f->ts, from ? from->name : "(none)");
        arrows++;
    }
    CHECK_EQ(count_ph(r, "f"), arrows);
    if (arrows < calls)
        TEST_FAIL_AT("%d collectives joined across ranks, wanted %d", arrows, calls);
}

/* The k-th span (from 0) named `name` on rank `pid`'s compute row, or NULL. */
static const json_event *nth_span(const json_reader *r, int pid, const char *name, int k) {
    int tid = row_named(r, pid, "compute");
    for (int i = 0; i < r->n_events; i++) {
        const json_event *e = &r->events[i];
        if (!strcmp(e->ph, "X") && e->pid == pid && e->tid == tid && !strcmp(e->name, name) &&
            k-- == 0)
            return e;
    }
    return NULL;
}

/* On one host the ranks share a clock: the k-th span `a` of rank pa's compute row ends before
 * the l-th span `b` of rank pb's starts. */
static void check_before(const json_reader *r, int pa, const char *a, int k, int pb, const char *b,
                         int l) {
    const json_event *x = nth_span(r, pa, a, k), *y = nth_span(r, pb, b, l);
    if (!x || !y)
        TEST_FAIL_AT("no span \"%s\" #%d on rank %d's compute row", x ? b : a, x ? l : k,
                     x ? pb : pa);
    else if (x->ts + x->dur > y->ts + SAME_US)
        TEST_FAIL_AT("rank %d's \"%s\" #%d ends at %.3f us, after rank %d's \"%s\" #%d starts "
                     "at %.3f",
                     pa, a, k, x->ts + x->dur, pb, b, l, y->ts);
}

/* The process row of each of `ranks` named with the host, and on each the rows in `rows`. */
static void check_rows(const json_reader *r, int ranks, const char *const *rows, int nrows) {
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    for (int rank = 0; rank < ranks; rank++) {
        char want[300];
        snprintf(want, sizeof want, "rank %d (%s)", rank, host);
        const json_event *p = find_meta(r, "process_name", rank, 0);
        if (!p || strcmp(p->arg_name, want)) TEST_FAIL_AT("no process row \"%s\"", want);
        for (int k = 0; k < nrows; k++) {
            int n = 0;
            for (int i = 0; i < r->n_events; i++) {
                const json_event *e = &r->events[i];
                n += e->pid == rank && !strcmp(e->ph, "M") && !strcmp(e->name, "thread_name") &&
                     !strcmp(e->arg_name, rows[k]);
            }
            if (n != 1)
                TEST_FAIL_AT("rank %d has %d rows named \"%s\", wanted 1", rank, n, rows[k]);
        }
    }
}

/* tandemrun --trace DIR --trace-ops around the training example (DDP on 2 ranks): one file, a
 * row per rank named with its host, compute and communication rows, spans nested on each row,
 * each step's forward, backward and optimizer in order with the graph's ops inside, and the
 * collectives linked across the ranks. */
static void tandemrun_traces_the_example(void) {
    char trace_dir[128], path[160];
    snprintf(trace_dir, sizeof trace_dir, "%s/job", dir);
    CHECK_EQ(run("%s --trace %s --trace-ops --nproc-per-node 2 %s --model net --epochs 1 "
                 "--max-steps 3 --no-eval --data %s",
                 launcher, trace_dir, mnist, short_set),
             0);
    snprintf(path, sizeof path, "%s/trace.json", trace_dir);
    CHECK(strstr(output, path) != NULL); /* tandemrun says where it is */
    static json_reader r;
    CHECK(json_parse_file(path, &r));
    static const char *const rows[] = {"compute", "communication"};
    check_rows(&r, 2, rows, 2);
    check_rows_nest(&r, 2);
    check_links(&r, 3); /* at least each step's gradient bucket */
    for (int rank = 0; rank < 2; rank++)
        for (int step = 0; step < 3; step++) {
            check_before(&r, rank, "forward", step, rank, "backward", step);
            check_before(&r, rank, "backward", step, rank, "optimizer", step);
            if (step < 2) check_before(&r, rank, "optimizer", step, rank, "forward", step + 1);
            /* the Net's first op, inside the step's forward */
            const json_event *f = nth_span(&r, rank, "forward", step);
            const json_event *op = f ? nth_span(&r, rank, "conv2d:0", 2 * step) : NULL;
            CHECK(op && op->ts >= f->ts && op->ts + op->dur <= f->ts + f->dur + SAME_US);
        }
    snprintf(path, sizeof path, "%s/rank0.json", trace_dir);
    CHECK(access(path, F_OK) != 0);
    /* --trace-ops alone is refused */
    CHECK_EQ(run("%s --trace-ops %s --help", launcher, mnist), 2);
    CHECK(strstr(output, "--trace-ops needs --trace DIR") != NULL);
}

/* tandemrun --trace DIR around a 2-stage GPipe job: a row per rank with its compute and
 * transfer rows, spans nested, micro-batch m's forward on stage 1 after stage 0's, its backward
 * on stage 0 after stage 1's, and the group's collectives linked. */
static void tandemrun_traces_a_pipeline(void) {
    char trace_dir[128], path[160];
    snprintf(trace_dir, sizeof trace_dir, "%s/pipeline", dir);
    CHECK_EQ(run("%s --trace %s --trace-ops --nproc-per-node 2 %s --pipeline gpipe --model mlp "
                 "--stages 2 --micro-batches 2 --epochs 1 --max-steps 2 --no-eval --data %s",
                 launcher, trace_dir, mnist, short_set),
             0);
    snprintf(path, sizeof path, "%s/trace.json", trace_dir);
    static json_reader r;
    CHECK(json_parse_file(path, &r));
    static const char *const first[] = {"compute", "send activations", "recv gradients"};
    static const char *const last[] = {"compute", "recv activations", "send gradients"};
    check_rows(&r, 1, first, 3);
    for (int k = 0; k < 3; k++) CHECK(row_named(&r, 1, last[k]) >= 0);
    check_rows_nest(&r, 2);
    check_links(&r, 1);
    for (int step = 0; step < 2; step++)
        for (int m = 0; m < 2; m++) {
            char fwd[32], bwd[32];
            snprintf(fwd, sizeof fwd, "forward %d", m);
            snprintf(bwd, sizeof bwd, "backward %d", m);
            check_before(&r, 0, fwd, step, 1, fwd, step);
            check_before(&r, 1, bwd, step, 0, bwd, step);
        }
    CHECK(find_event(&r, "linear:0") != NULL); /* --trace-ops: the stages' ops */
}

/* A rank of the jobs below, this program started by tandemrun with "--rank SPANS DIE": it
 * records SPANS spans of its own, runs three all-reduces, and with DIE rank 1 kills itself
 * (SIGKILL: nothing runs after it) after the second. */
static int traced_rank(int spans, int die) {
    td_comm *comm = NULL;
    td_comm_params p = td_comm_default_params();
    if (td_comm_create(&comm, &p) != TD_OK) return 1;
    td_trace *trace = td_comm_trace(comm);
    for (int i = 0; trace && i < spans; i++)
        td_trace_span(trace, "a span whose name is long enough to fill a small disk soon", "step",
                      (uint64_t)i, (uint64_t)i + 1);
    float x[4] = {1, 2, 3, 4};
    for (int k = 0; k < 3; k++) {
        if (td_comm_allreduce(comm, x, x, 4, TD_F32, TD_OP_SUM) != TD_OK) return 1;
        if (die && k == 1 && td_comm_rank(comm) == 1) raise(SIGKILL);
    }
    td_comm_destroy(comm);
    return 0;
}

/* The spans named `name` of rank `pid` in a merged trace. */
static int spans_of(const json_reader *r, int pid, const char *name) {
    int n = 0;
    for (int i = 0; i < r->n_events; i++)
        n += r->events[i].pid == pid && !strcmp(r->events[i].ph, "X") &&
             !strcmp(r->events[i].name, name);
    return n;
}

/* Rank 1 is killed (SIGKILL) after two all-reduces: the job's trace still comes, with what
 * both ranks recorded up to then, rank 1's two calls among it, and tandemrun says where
 * (nothing at all was written before: the survivor is stopped before it gets to destroy). */
static void tandemrun_keeps_a_killed_ranks_trace(void) {
    char trace_dir[128], path[160];
    snprintf(trace_dir, sizeof trace_dir, "%s/killed", dir);
    CHECK_EQ(run("%s --trace %s --nproc-per-node 2 %s --rank 0 1", launcher, trace_dir, self),
             128 + SIGKILL);
    snprintf(path, sizeof path, "%s/trace.json", trace_dir);
    if (!strstr(output, "the job's trace is") || !strstr(output, path))
        TEST_FAIL_AT("tandemrun does not name the job's trace:\n%s", output);
    static json_reader r;
    CHECK(json_parse_file(path, &r));
    /* Rank 1 recorded both calls before it died; rank 0 the first at least (tandemrun may stop
     * it between the end of the second and its span). */
    CHECK_EQ(spans_of(&r, 1, "allreduce #0 (f32, 4 elements, sum)"), 1);
    CHECK_EQ(spans_of(&r, 1, "allreduce #1 (f32, 4 elements, sum)"), 1);
    CHECK_EQ(spans_of(&r, 1, "allreduce #2 (f32, 4 elements, sum)"), 0); /* it was dead */
    CHECK_EQ(spans_of(&r, 0, "allreduce #0 (f32, 4 elements, sum)"), 1);
    snprintf(path, sizeof path, "%s/rank1.trace", trace_dir);
    CHECK(access(path, F_OK) != 0);
}

/* A tmpfs of `size` at `at` (read-only with ro); 0 when it could not be mounted (not root). */
static int mount_tmpfs(const char *at, const char *size, int ro) {
    mkdir(at, 0755);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "mount -t tmpfs -o %ssize=%s tmpfs %s 2>/dev/null", ro ? "ro," : "",
             size, at);
    return system(cmd) == 0;
}

static void unmount(const char *at) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "umount %s", at);
    CHECK(system(cmd) == 0);
}

/* A trace directory that is a file, read-only or full is refused before any rank starts,
 * saying which (it gave only "no trace in DIR" after the job); on a disk that fills during
 * the job, tandemrun says why the trace could not be written, never that there is none. */
static void tandemrun_says_why_a_trace_dir_is_unusable(void) {
    char at[128], args[PATH_MAX + 64];
    snprintf(args, sizeof args, "--nproc-per-node 2 %s --rank 0 0", self);
    snprintf(at, sizeof at, "%s/a-file", dir);
    test_write_file(at, "x", 1);
    CHECK_EQ(run("%s --trace %s %s", launcher, at, args), 2);
    CHECK(strstr(output, "is a file, not a directory") != NULL);
    snprintf(at, sizeof at, "%s/ro", dir);
    if (!mount_tmpfs(at, "1m", 1)) {
        SKIP("cannot mount a tmpfs (needs root)");
        return;
    }
    CHECK_EQ(run("%s --trace %s %s", launcher, at, args), 2);
    CHECK(strstr(output, "cannot write in it: Read-only file system") != NULL);
    unmount(at);
    snprintf(at, sizeof at, "%s/full", dir);
    CHECK(mount_tmpfs(at, "64k", 0));
    char cmd[PATH_MAX];
    snprintf(cmd, sizeof cmd, "dd if=/dev/zero of=%s/filler bs=4k count=64 2>/dev/null", at);
    CHECK(system(cmd) != -1); /* fills it, then stops */
    CHECK_EQ(run("%s --trace %s %s", launcher, at, args), 2);
    CHECK(strstr(output, "cannot write in it: No space left on device") != NULL);
    unmount(at);
    /* 256 KiB, and each rank records about 300 KiB of spans */
    snprintf(at, sizeof at, "%s/small", dir);
    CHECK(mount_tmpfs(at, "256k", 0));
    snprintf(args, sizeof args, "--nproc-per-node 2 %s --rank 4000 0", self);
    CHECK_EQ(run("%s --trace %s %s", launcher, at, args), 0);
    CHECK(strstr(output, "no trace in") == NULL);
    static json_reader r;
    snprintf(cmd, sizeof cmd, "%s/trace.json", at);
    if (access(cmd, F_OK) == 0 && json_parse_file(cmd, &r))
        CHECK(strstr(output, "the job's trace is") != NULL);
    else if (!strstr(output, "No space left on device"))
        TEST_FAIL_AT("no trace, and tandemrun does not say why:\n%s", output);
    printf("    %s", strstr(output, "tandemrun:") ? strstr(output, "tandemrun:") : output);
    unmount(at);
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "--rank")) return traced_rank(atoi(argv[2]), atoi(argv[3]));
    if (!realpath(argv[0], self)) return 1;
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s", self);
    char *build = dirname(dirname(path)); /* BUILD/tests/x -> BUILD */
    snprintf(mnist, sizeof mnist, "%s/examples/mnist", build);
    snprintf(launcher, sizeof launcher, "%s/bin/tandemrun", build);
    snprintf(dir, sizeof dir, "/tmp/td_test_job_trace_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    snprintf(short_set, sizeof short_set, "%s/short", dir);
    if (fashion_mnist_subset(short_set, 640)) return 1;
    RUN(collectives_are_recorded_and_linked);
    RUN(trace_write_gathers_every_rank);
    RUN(job_trace_from_the_environment);
    RUN(job_trace_survives_a_dead_rank);
    RUN(graph_records_every_op);
    RUN(tandemrun_traces_the_example);
    RUN(tandemrun_traces_a_pipeline);
    RUN(tandemrun_keeps_a_killed_ranks_trace);
    RUN(tandemrun_says_why_a_trace_dir_is_unusable);
    test_remove_dir(dir);
    TEST_END();
}
