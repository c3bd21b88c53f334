/* A minimal JSON reader for the Chrome traces td_trace writes: validates the grammar and keeps,
 * for each object of the "traceEvents" array, the fields the trace tests check (name, cat, ph,
 * ts, dur, pid, tid, id, and args.name and args["last to arrive"]). Header-only; include it after
 * test.h. The reader is large: make it static. */
#ifndef TANDEM_TEST_TRACE_JSON_H
#define TANDEM_TEST_TRACE_JSON_H

#include <stdio.h>
#include <string.h>

typedef struct {
    char name[64], cat[16], ph[8];
    char arg_name[64], arg_last[32]; /* args.name (metadata), args["last to arrive"] */
    double ts, dur, id;
    int pid, tid, has_ts, has_dur;
} json_event;

typedef struct {
    const char *p;
    int ok;
    json_event events[4096];
    int n_events;
} json_reader;

static inline void json_ws(json_reader *r) {
    while (*r->p == ' ' || *r->p == '\n' || *r->p == '\t' || *r->p == '\r') r->p++;
}

static inline void json_string(json_reader *r, char *out, size_t cap) {
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

static inline double json_number(json_reader *r) {
    char *end;
    double v = strtod(r->p, &end);
    if (end == r->p) r->ok = 0;
    r->p = end;
    return v;
}

static inline void json_value(json_reader *r, int depth, int in_events);
static inline void json_object(json_reader *r, int depth, int is_event);

/* An event's "args": the two strings the checks read, the rest validated and skipped. */
static inline void json_args(json_reader *r, int depth, json_event *ev) {
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
        if (!strcmp(key, "name") && *r->p == '"')
            json_string(r, ev->arg_name, sizeof ev->arg_name);
        else if (!strcmp(key, "last to arrive") && *r->p == '"')
            json_string(r, ev->arg_last, sizeof ev->arg_last);
        else
            json_value(r, depth + 1, 0);
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

/* An object; when it is an element of traceEvents, its fields land in events[]. */
static inline void json_object(json_reader *r, int depth, int is_event) {
    json_event *ev = NULL;
    if (is_event) {
        if (r->n_events >= (int)(sizeof r->events / sizeof r->events[0])) {
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
        if (ev && !strcmp(key, "name") && *r->p == '"') {
            json_string(r, ev->name, sizeof ev->name);
        } else if (ev && !strcmp(key, "cat") && *r->p == '"') {
            json_string(r, ev->cat, sizeof ev->cat);
        } else if (ev && !strcmp(key, "ph") && *r->p == '"') {
            json_string(r, ev->ph, sizeof ev->ph);
        } else if (ev && !strcmp(key, "args") && *r->p == '{') {
            json_args(r, depth + 1, ev);
        } else if (ev && (!strcmp(key, "ts") || !strcmp(key, "dur") || !strcmp(key, "pid") ||
                          !strcmp(key, "tid") || !strcmp(key, "id"))) {
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
            if (!strcmp(key, "id")) ev->id = v;
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

static inline void json_value(json_reader *r, int depth, int in_events) {
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

static inline int json_parse_file(const char *path, json_reader *r) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    static char buf[1 << 22];
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

static inline const json_event *find_event(const json_reader *r, const char *name) {
    for (int i = 0; i < r->n_events; i++)
        if (!strcmp(r->events[i].name, name)) return &r->events[i];
    return NULL;
}

static inline int count_ph(const json_reader *r, const char *ph) {
    int n = 0;
    for (int i = 0; i < r->n_events; i++) n += !strcmp(r->events[i].ph, ph);
    return n;
}

/* The metadata event `name` ("process_name", "thread_name") of (pid, tid), or NULL. */
static inline const json_event *find_meta(const json_reader *r, const char *name, int pid,
                                          int tid) {
    for (int i = 0; i < r->n_events; i++) {
        const json_event *e = &r->events[i];
        if (!strcmp(e->ph, "M") && !strcmp(e->name, name) && e->pid == pid && e->tid == tid)
            return e;
    }
    return NULL;
}

#endif
