/* td_trace: spans from several threads, the Chrome trace JSON they produce (checked with a
 * small JSON parser, not by string search) and the atomic write; named rows, the packed form
 * between processes, and several ranks' traces merged into one file: collectives joined by
 * their link from the last rank to arrive, another host's clock moved onto the first's. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/trace.h"

#include "test.h"
#include "test_trace_json.h" /* json_parse_file, find_event, find_meta, count_ph */

static void spans_round_trip_through_json(void) {
    td_trace *trace = NULL;
    CHECK_OK(td_trace_create(&trace, 3));
    if (!trace) return;
    CHECK_OK(td_trace_span(trace, "forward", "step", 1000000, 3500000));
    CHECK_OK(td_trace_span(trace, "odd \"name\"\\\n", NULL, 4000123, 4000999));
    uint64_t t0 = td_trace_begin(trace);
    usleep(2000);
    CHECK_OK(td_trace_end(trace, "sleep", "test", t0));
    CHECK_EQ(td_trace_count(trace), 3);
    td_trace_event ev;
    CHECK_OK(td_trace_event_get(trace, 2, &ev));
    CHECK(ev.dur_ns >= 2000000);
    CHECK(strcmp(ev.category, "test") == 0);
    CHECK_STATUS(td_trace_event_get(trace, 3, &ev), TD_EINVAL);

    char path[64];
    snprintf(path, sizeof path, "/tmp/td_trace_%d.json", (int)getpid());
    CHECK_OK(td_trace_write(trace, path));
    static json_reader r;
    CHECK(json_parse_file(path, &r));
    const json_event *fwd = find_event(&r, "forward");
    CHECK_EQ(count_ph(&r, "X"), 3);
    /* the process row is named after the rank, the thread after its first span's category */
    const json_event *process = find_meta(&r, "process_name", 3, 0);
    CHECK(process && !strcmp(process->arg_name, "rank 3"));
    const json_event *row = fwd ? find_meta(&r, "thread_name", 3, fwd->tid) : NULL;
    CHECK(row && !strncmp(row->arg_name, "step thread ", 12));
    CHECK(fwd != NULL);
    if (fwd) {
        CHECK(strcmp(fwd->ph, "X") == 0);
        CHECK(fwd->has_ts && fwd->has_dur);
        CHECK_NEAR(fwd->ts, 1000.0, 1e-6); /* microseconds */
        CHECK_NEAR(fwd->dur, 2500.0, 1e-6);
        CHECK_EQ(fwd->pid, 3);
        CHECK(fwd->tid > 0);
    }
    /* The escaped name parsed back (quotes, backslash and newline), with its sub-µs span. */
    int odd_found = 0;
    for (int i = 0; i < r.n_events; i++)
        if (!strcmp(r.events[i].name, "odd \"name\"\\?")) { /* \\u escapes read back as ? */
            odd_found = 1;
            CHECK_NEAR(r.events[i].dur, 0.876, 1e-9);
        }
    CHECK(odd_found);
    remove(path);
    /* The temporary file does not outlive the write. */
    char tmp[96];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    CHECK(access(tmp, F_OK) != 0);
    CHECK_STATUS(td_trace_write(trace, "/nonexistent-dir/x.json"), TD_EIO);
    td_trace_destroy(trace);
}

typedef struct {
    td_trace *trace;
    int tid_seen;
} thread_arg;

static void *record_many(void *p) {
    thread_arg *a = p;
    for (int i = 0; i < 200; i++) {
        uint64_t t = td_time_ns();
        if (td_trace_span(a->trace, "work", "thread", t, t + 10) != TD_OK) return NULL;
    }
    td_trace_event ev;
    if (td_trace_event_get(a->trace, 0, &ev) == TD_OK) a->tid_seen = 1;
    return NULL;
}

static void threads_record_concurrently(void) {
    td_trace *trace = NULL;
    CHECK_OK(td_trace_create(&trace, 0));
    if (!trace) return;
    pthread_t th[4];
    thread_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (thread_arg){trace, 0};
        CHECK(pthread_create(&th[i], NULL, record_many, &args[i]) == 0);
    }
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    CHECK_EQ(td_trace_count(trace), 800);
    /* Four threads, four distinct thread ids among the events. */
    int tids[4], n_tids = 0;
    for (size_t i = 0; i < td_trace_count(trace); i++) {
        td_trace_event ev;
        CHECK_OK(td_trace_event_get(trace, i, &ev));
        int known = 0;
        for (int k = 0; k < n_tids; k++) known |= tids[k] == ev.tid;
        if (!known && n_tids < 4) tids[n_tids++] = ev.tid;
    }
    CHECK_EQ(n_tids, 4);
    td_trace_destroy(trace);
}

/* Named rows: the calling thread and a track; renaming replaces; the names reach the file. */
static void rows_are_named(void) {
    td_trace *trace = NULL;
    CHECK_OK(td_trace_create(&trace, 1));
    if (!trace) return;
    CHECK_OK(td_trace_name_thread(trace, "compute"));
    CHECK_OK(td_trace_name_track(trace, 0x7f000002, "bucket 2"));
    CHECK_OK(td_trace_name_track(trace, 0x7f000002, "ddp bucket 2"));
    CHECK_OK(td_trace_span(trace, "forward", "compute", 1000, 2000));
    CHECK_OK(td_trace_span_on(trace, "allreduce", "ddp", 0x7f000002, 1500, 2500));
    CHECK_OK(td_trace_span_on(trace, "unnamed", "ddp", 0x7f000003, 1500, 2500));
    CHECK_OK(td_trace_set_host(trace, "node-a"));
    CHECK(td_trace_track_name(trace, 0x7f000002) &&
          !strcmp(td_trace_track_name(trace, 0x7f000002), "ddp bucket 2"));
    CHECK(td_trace_track_name(trace, 12345) == NULL);
    CHECK_STATUS(td_trace_name_thread(trace, NULL), TD_EINVAL);
    char path[64];
    snprintf(path, sizeof path, "/tmp/td_trace_rows_%d.json", (int)getpid());
    CHECK_OK(td_trace_write(trace, path));
    static json_reader r;
    CHECK(json_parse_file(path, &r));
    const json_event *fwd = find_event(&r, "forward");
    const json_event *compute = fwd ? find_meta(&r, "thread_name", 1, fwd->tid) : NULL;
    const json_event *bucket = find_meta(&r, "thread_name", 1, 0x7f000002);
    const json_event *unnamed = find_meta(&r, "thread_name", 1, 0x7f000003);
    const json_event *process = find_meta(&r, "process_name", 1, 0);
    CHECK(compute && !strcmp(compute->arg_name, "compute"));
    CHECK(bucket && !strcmp(bucket->arg_name, "ddp bucket 2"));
    CHECK(unnamed && !strcmp(unnamed->arg_name, "ddp track 3"));
    CHECK(process && !strcmp(process->arg_name, "rank 1 (node-a)"));
    remove(path);
    td_trace_destroy(trace);
}

/* A trace packed and unpacked is the same trace: rank, host, names and every span; bytes that
 * are not a whole packed trace are refused. */
static void packs_and_unpacks(void) {
    td_trace *trace = NULL, *back = NULL;
    CHECK_OK(td_trace_create(&trace, 5));
    if (!trace) return;
    CHECK_OK(td_trace_set_host(trace, "node-b"));
    CHECK_OK(td_trace_name_thread(trace, "communication"));
    CHECK_OK(td_trace_span(trace, "forward", "compute", 10, 20));
    CHECK_OK(td_trace_span_linked(trace, "allreduce #3", "comm", 0xabcdef, 30, 45));
    CHECK_OK(td_trace_span_on(trace, "odd \"one\"", NULL, 77, 50, 50));
    void *bytes = NULL;
    size_t len = 0;
    CHECK_OK(td_trace_pack(trace, &bytes, &len));
    CHECK_OK(td_trace_unpack(&back, bytes, len));
    if (back) {
        CHECK_EQ(td_trace_rank(back), 5);
        CHECK_EQ(td_trace_count(back), 3);
        for (size_t i = 0; i < 3; i++) {
            td_trace_event a, b;
            CHECK_OK(td_trace_event_get(trace, i, &a));
            CHECK_OK(td_trace_event_get(back, i, &b));
            CHECK(!strcmp(a.name, b.name) && !strcmp(a.category, b.category));
            CHECK(a.tid == b.tid && a.start_ns == b.start_ns && a.dur_ns == b.dur_ns &&
                  a.link == b.link);
        }
        td_trace_event ev;
        CHECK_OK(td_trace_event_get(back, 1, &ev));
        CHECK_EQ(ev.link, 0xabcdef);
        CHECK_OK(td_trace_event_get(back, 0, &ev));
        CHECK(td_trace_track_name(back, ev.tid) &&
              !strcmp(td_trace_track_name(back, ev.tid), "communication"));
    }
    td_trace_destroy(back);
    back = NULL;
    CHECK_STATUS(td_trace_unpack(&back, bytes, len - 1), TD_EFORMAT);
    CHECK_STATUS(td_trace_unpack(&back, bytes, 12), TD_EFORMAT);
    CHECK(strstr(td_last_error(), "not a packed trace") || strstr(td_last_error(), "cut short"));
    ((char *)bytes)[0] ^= 1;
    CHECK_STATUS(td_trace_unpack(&back, bytes, len), TD_EFORMAT);
    CHECK(strstr(td_last_error(), "not a packed trace") != NULL);
    CHECK(back == NULL);
    free(bytes);
    td_trace_destroy(trace);
}

/* Three ranks' traces of the same two collectives, merged: a process row per rank, every span
 * of a call says who arrived last (rank 2 in the first call, rank 0 in the second), flows run
 * from that rank to each other one, and rank 3's trace from another host whose clock is 5 s
 * ahead lands on the first host's time. */
static void merges_ranks_and_joins_collectives(void) {
    td_trace *t[4] = {NULL};
    for (int r = 0; r < 4; r++) {
        CHECK_OK(td_trace_create(&t[r], r));
        if (!t[r]) return;
        CHECK_OK(td_trace_set_host(t[r], r < 3 ? "node-a" : "node-b"));
    }
    const uint64_t ms = 1000000, ahead = 5000 * ms; /* rank 3's clock */
    /* call 1: ranks arrive at 1, 2, 5 (ms) and all leave at 6; rank 3 arrives at 3 */
    uint64_t arrive1[4] = {1 * ms, 2 * ms, 5 * ms, 3 * ms + ahead};
    /* call 2: rank 0 arrives last, at 9 */
    uint64_t arrive2[4] = {9 * ms, 7 * ms, 8 * ms, 7 * ms + ahead};
    for (int r = 0; r < 4; r++) {
        uint64_t skew = r == 3 ? ahead : 0;
        CHECK_OK(td_trace_span_linked(t[r], "allreduce #0", "comm", 11, arrive1[r], 6 * ms + skew));
        CHECK_OK(
            td_trace_span_linked(t[r], "allreduce #1", "comm", 12, arrive2[r], 10 * ms + skew));
        CHECK_OK(td_trace_span(t[r], "step", "compute", 0 + skew, 11 * ms + skew));
    }
    CHECK_OK(td_trace_span_linked(t[0], "alone", "comm", 13, 1, 2)); /* on one rank only */
    char path[64];
    snprintf(path, sizeof path, "/tmp/td_trace_merged_%d.json", (int)getpid());
    const td_trace *const all[4] = {t[2], t[0], t[1], t[3]}; /* any order; rank 2's clock first */
    CHECK_OK(td_trace_write_merged(all, 4, path));
    static json_reader r;
    CHECK(json_parse_file(path, &r));
    for (int rank = 0; rank < 4; rank++) {
        const json_event *p = find_meta(&r, "process_name", rank, 0);
        char want[32];
        snprintf(want, sizeof want, "rank %d (node-%c)", rank, rank < 3 ? 'a' : 'b');
        CHECK(p && !strcmp(p->arg_name, want));
    }
    int seen1 = 0, seen2 = 0;
    for (int i = 0; i < r.n_events; i++) {
        const json_event *e = &r.events[i];
        if (strcmp(e->ph, "X") != 0) continue;
        if (!strcmp(e->name, "allreduce #0")) {
            seen1++;
            CHECK(!strcmp(e->arg_last, "rank 2"));
            CHECK_NEAR(e->ts, arrive1[e->pid] / 1000.0 - (e->pid == 3 ? ahead / 1000.0 : 0), 1e-3);
        }
        if (!strcmp(e->name, "allreduce #1")) {
            seen2++;
            CHECK(!strcmp(e->arg_last, "rank 0"));
        }
        if (!strcmp(e->name, "alone")) CHECK(e->arg_last[0] == 0);
        if (!strcmp(e->name, "step") && e->pid == 3) CHECK_NEAR(e->ts, 0, 1e-3);
    }
    CHECK_EQ(seen1, 4);
    CHECK_EQ(seen2, 4);
    /* three arrows per call, each a start on the last rank's row and a finish on another's */
    CHECK_EQ(count_ph(&r, "s"), 6);
    CHECK_EQ(count_ph(&r, "f"), 6);
    for (int i = 0; i < r.n_events; i++) {
        const json_event *s = &r.events[i];
        if (strcmp(s->ph, "s") != 0) continue;
        int finishes = 0;
        for (int k = 0; k < r.n_events; k++) {
            const json_event *f = &r.events[k];
            if (!strcmp(f->ph, "f") && f->id == s->id) {
                finishes++;
                CHECK(f->pid != s->pid);
                CHECK(s->pid == (s->ts < 6000 ? 2 : 0));
            }
        }
        CHECK_EQ(finishes, 1);
    }
    remove(path);
    CHECK_STATUS(td_trace_write_merged(all, 0, path), TD_EINVAL);
    const td_trace *twice[2] = {t[0], t[0]};
    CHECK_STATUS(td_trace_write_merged(twice, 2, path), TD_EINVAL);
    for (int k = 0; k < 4; k++) td_trace_destroy(t[k]);
}

/* A kept trace is on disk as it records: read back while it is still being kept (as after a
 * kill) it has every span and name so far; a file torn inside its last record (a write cut
 * by SIGKILL or a full disk) reads up to it; ended, it reads whole. A span costs a write(2)
 * more when kept (printed, not asserted: timings belong to benchmarks). */
static void keeps_what_it_records_in_a_file(void) {
    char dir[64], path[128], torn[128];
    test_temp_dir(dir, sizeof dir, "trace_keep");
    snprintf(path, sizeof path, "%s/rank4.trace", dir);
    snprintf(torn, sizeof torn, "%s/torn.trace", dir);
    td_trace *trace = NULL, *back = NULL;
    CHECK_OK(td_trace_create(&trace, 4));
    if (!trace) return;
    CHECK_OK(td_trace_span(trace, "before", "step", 1, 2)); /* recorded before the keeping */
    CHECK_OK(td_trace_keep(trace, path));
    CHECK_OK(td_trace_set_host(trace, "node-c"));
    CHECK_OK(td_trace_name_thread(trace, "compute"));
    CHECK_OK(td_trace_span_linked(trace, "allreduce #0", "comm", 0x1234, 10, 20));
    CHECK_OK(td_trace_span(trace, "after", "step", 30, 45));
    CHECK(td_trace_keep_error(trace) == NULL);
    CHECK_OK(td_trace_read(&back, path));
    if (back) {
        CHECK_EQ(td_trace_rank(back), 4);
        CHECK_EQ(td_trace_count(back), 3);
        td_trace_event e;
        CHECK_OK(td_trace_event_get(back, 1, &e));
        CHECK(!strcmp(e.name, "allreduce #0") && e.link == 0x1234 && e.dur_ns == 10);
        CHECK(td_trace_track_name(back, e.tid) &&
              !strcmp(td_trace_track_name(back, e.tid), "compute"));
    }
    td_trace_destroy(back);
    back = NULL;
    size_t len = 0;
    unsigned char *bytes = test_read_file(path, &len);
    CHECK(bytes && len > 10);
    if (bytes) test_write_file(torn, bytes, len - 3);
    free(bytes);
    CHECK_OK(td_trace_read(&back, torn));
    CHECK_EQ(td_trace_count(back), 2); /* "after" was torn */
    td_trace_destroy(back);
    back = NULL;
    CHECK_OK(td_trace_keep(trace, NULL));
    CHECK_OK(td_trace_read(&back, path));
    CHECK_EQ(td_trace_count(back), 3);
    td_trace_destroy(back);
    test_write_file(torn, "not a trace", 11);
    CHECK_STATUS(td_trace_read(&back, torn), TD_EFORMAT);
    CHECK(strstr(td_last_error(), torn) != NULL);
    /* what a span costs, kept and not */
    CHECK_OK(td_trace_keep(trace, path));
    uint64_t t0 = td_time_ns();
    for (int i = 0; i < 20000; i++) td_trace_span(trace, "forward", "step", 1, 2);
    uint64_t t1 = td_time_ns();
    CHECK_OK(td_trace_keep(trace, NULL));
    for (int i = 0; i < 20000; i++) td_trace_span(trace, "forward", "step", 1, 2);
    uint64_t t2 = td_time_ns();
    printf("    a span: %.2f us kept, %.2f us in memory only\n", (double)(t1 - t0) / 20000e3,
           (double)(t2 - t1) / 20000e3);
    td_trace_destroy(trace);
    test_remove_dir(dir);
}

int main(void) {
    RUN(spans_round_trip_through_json);
    RUN(threads_record_concurrently);
    RUN(rows_are_named);
    RUN(packs_and_unpacks);
    RUN(merges_ranks_and_joins_collectives);
    RUN(keeps_what_it_records_in_a_file);
    TEST_END();
}
