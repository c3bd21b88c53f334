/* td_trace: spans from several threads, the Chrome trace JSON they produce (checked with a
 * small JSON parser, not by string search) and the atomic write. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/trace.h"

#include "test.h"

/* A minimal JSON reader: validates the grammar and collects, for each object inside the
 * "traceEvents" array, the fields the checks need. */
typedef struct {
    char name[64], ph[8];
    double ts, dur;
    int pid, tid, has_ts, has_dur;
} json_event;

typedef struct {
    const char *p;
    int ok;
    json_event events[64];
    int n_events;
} json_reader;

static void json_ws(json_reader *r) {
    while (*r->p == ' ' || *r->p == '\n' || *r->p == '\t' || *r->p == '\r') r->p++;
}

static void json_string(json_reader *r, char *out, size_t cap) {
    size_t n = 0;
    if (*r->p != '"') {
        r->ok = 0;
        return;
    }
    r->p++;
    while (*r->p && *r->p != '"') {
        char c = *r->p++;
        if ((unsigned char)c < 0x20) {
            r->ok = 0;
            return;
        }
        if (c == '\\') {
            c = *r->p++;
            if (c == 'u') {
                for (int i = 0; i < 4; i++) {
                    if (!strchr("0123456789abcdefABCDEF", *r->p) || !*r->p) {
                        r->ok = 0;
                        return;
                    }
                    r->p++;
                }
                c = '?';
            } else if (!strchr("\"\\/bfnrt", c) || !c) {
                r->ok = 0;
                return;
            }
        }
        if (out && n + 1 < cap) out[n++] = c;
    }
    if (*r->p != '"') {
        r->ok = 0;
        return;
    }
    r->p++;
    if (out) out[n] = 0;
}

static double json_number(json_reader *r) {
    char *end;
    double v = strtod(r->p, &end);
    if (end == r->p) r->ok = 0;
    r->p = end;
    return v;
}

static void json_value(json_reader *r, int depth, int in_events);

/* An object; when it is an element of traceEvents, its fields land in events[]. */
static void json_object(json_reader *r, int depth, int is_event) {
    json_event *ev = NULL;
    if (is_event) {
        if (r->n_events >= 64) {
            r->ok = 0;
            return;
        }
        ev = &r->events[r->n_events++];
        memset(ev, 0, sizeof *ev);
    }
    r->p++; /* { */
    json_ws(r);
    if (*r->p == '}') {
        r->p++;
        return;
    }
    while (r->ok) {
        char key[64] = "";
        json_ws(r);
        json_string(r, key, sizeof key);
        json_ws(r);
        if (*r->p != ':') {
            r->ok = 0;
            return;
        }
        r->p++;
        json_ws(r);
        if (ev && (!strcmp(key, "name") || !strcmp(key, "ph")) && *r->p == '"') {
            json_string(r, !strcmp(key, "name") ? ev->name : ev->ph, !strcmp(key, "name") ? 64 : 8);
        } else if (ev && (!strcmp(key, "ts") || !strcmp(key, "dur") || !strcmp(key, "pid") ||
                          !strcmp(key, "tid"))) {
            double v = json_number(r);
            if (!strcmp(key, "ts")) {
                ev->ts = v;
                ev->has_ts = 1;
            }
            if (!strcmp(key, "dur")) {
                ev->dur = v;
                ev->has_dur = 1;
            }
            if (!strcmp(key, "pid")) ev->pid = (int)v;
            if (!strcmp(key, "tid")) ev->tid = (int)v;
        } else {
            json_value(r, depth + 1, depth == 0 && !strcmp(key, "traceEvents"));
        }
        json_ws(r);
        if (*r->p == ',') {
            r->p++;
            continue;
        }
        if (*r->p == '}') {
            r->p++;
            return;
        }
        r->ok = 0;
    }
}

static void json_value(json_reader *r, int depth, int in_events) {
    json_ws(r);
    if (depth > 16) {
        r->ok = 0;
        return;
    }
    if (*r->p == '{') {
        json_object(r, depth, 0);
    } else if (*r->p == '[') {
        r->p++;
        json_ws(r);
        if (*r->p == ']') {
            r->p++;
            return;
        }
        while (r->ok) {
            json_ws(r);
            if (in_events && *r->p == '{')
                json_object(r, depth, 1);
            else
                json_value(r, depth + 1, 0);
            json_ws(r);
            if (*r->p == ',') {
                r->p++;
                continue;
            }
            if (*r->p == ']') {
                r->p++;
                return;
            }
            r->ok = 0;
        }
    } else if (*r->p == '"') {
        json_string(r, NULL, 0);
    } else if (!strncmp(r->p, "true", 4) || !strncmp(r->p, "null", 4)) {
        r->p += 4;
    } else if (!strncmp(r->p, "false", 5)) {
        r->p += 5;
    } else {
        json_number(r);
    }
}

static int json_parse_file(const char *path, json_reader *r) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    memset(r, 0, sizeof *r);
    r->p = buf;
    r->ok = 1;
    if (*r->p != '{') return 0;
    json_object(r, 0, 0);
    json_ws(r);
    return r->ok && *r->p == 0;
}

static const json_event *find_event(const json_reader *r, const char *name) {
    for (int i = 0; i < r->n_events; i++)
        if (!strcmp(r->events[i].name, name)) return &r->events[i];
    return NULL;
}

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
    json_reader r;
    CHECK(json_parse_file(path, &r));
    CHECK_EQ(r.n_events, 4); /* process name + 3 spans */
    const json_event *fwd = find_event(&r, "forward");
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

int main(void) {
    RUN(spans_round_trip_through_json);
    RUN(threads_record_concurrently);
    TEST_END();
}
