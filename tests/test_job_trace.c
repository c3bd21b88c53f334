/* One trace of a job, over real ranks: process groups record each collective as a span named
 * as in error messages, linked by the same key on every rank and by different keys in
 * different groups (sub-groups included), the progress thread's row named; every rank's trace
 * gathered into one file where the late rank is the one the others waited for; the job trace
 * TANDEM_TRACE asks for, written at td_comm_destroy, or rank by rank when a rank died; a
 * graph's every op as a span; and tandemrun --trace around the training example. */
#include <libgen.h>
#include <limits.h>
#include <sys/syscall.h>

#include "tandem/tandem.h"

#include "test.h"
#include "test_comm_util.h"
#include "test_program.h"    /* run, output, fashion_mnist_subset */
#include "test_trace_json.h" /* json_parse_file, find_event, find_meta, count_ph */

static char dir[64], launcher[PATH_MAX + 16], mnist[PATH_MAX + 16], short_set[96];

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
    remove(path);
}

/* Rank 2 dies after the first call: the others' next call fails, and at destroy each of them
 * writes its own trace. */
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
    for (int rank = 0; rank < 2; rank++) {
        static json_reader r;
        snprintf(path, sizeof path, "%s/rank%d.json", dir, rank);
        CHECK(json_parse_file(path, &r));
        CHECK(find_event(&r, "allreduce #0 (f32, 16 elements, sum)") != NULL);
        remove(path);
    }
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

/* tandemrun --trace DIR --trace-ops around the training example: one file, a row per rank
 * named with its host, compute and communication rows, the graph's ops and the collectives
 * linked across the ranks. */
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
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    for (int rank = 0; rank < 2; rank++) {
        char want[300];
        snprintf(want, sizeof want, "rank %d (%s)", rank, host);
        const json_event *p = find_meta(&r, "process_name", rank, 0);
        CHECK(p && !strcmp(p->arg_name, want));
        int compute = 0, communication = 0;
        for (int i = 0; i < r.n_events; i++) {
            const json_event *e = &r.events[i];
            if (e->pid != rank || strcmp(e->ph, "M") || strcmp(e->name, "thread_name")) continue;
            compute += !strcmp(e->arg_name, "compute");
            communication += !strcmp(e->arg_name, "communication");
        }
        CHECK_EQ(compute, 1);
        CHECK_EQ(communication, 1);
    }
    CHECK(find_event(&r, "conv2d:0") != NULL); /* an op of the Net's graph */
    CHECK(find_event(&r, "forward") != NULL);  /* the example's own spans */
    CHECK(count_ph(&r, "s") > 0 && count_ph(&r, "s") == count_ph(&r, "f"));
    snprintf(path, sizeof path, "%s/rank0.json", trace_dir);
    CHECK(access(path, F_OK) != 0);
    /* --trace-ops alone is refused */
    CHECK_EQ(run("%s --trace-ops %s --help", launcher, mnist), 2);
    CHECK(strstr(output, "--trace-ops needs --trace DIR") != NULL);
}

int main(int argc, char **argv) {
    (void)argc;
    char self[PATH_MAX];
    if (!realpath(argv[0], self)) return 1;
    char *build = dirname(dirname(self)); /* BUILD/tests/x -> BUILD */
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
    test_remove_dir(dir);
    TEST_END();
}
