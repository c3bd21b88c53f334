/* Reading a job's dumps (DIR/rank<R>.json, as src/comm/dump.c writes them) and the launcher's
 * note on the ranks' processes (DIR/launcher.json, td_doctor_write_procs) into a dr_job, indexed
 * by world rank. A dump cut short or not a dump is an error naming the file; a rank without one
 * is simply absent. It judges nothing: diagnose.c does. */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/json_impl.h"
#include "core/core_impl.h"
#include "doctor/doctor_impl.h"

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        char *grown = realloc(buf, cap *= 2);
        if (!grown) {
            free(buf);
            buf = NULL;
        }
        buf = grown;
    }
    fclose(f);
    *len = n;
    return buf;
}

static double num(const td__json *o, const char *key, double fallback) {
    const td__json *v = td__json_get(o, key);
    return v && v->kind == TD__JSON_NUMBER ? v->number : fallback;
}

static void str(const td__json *o, const char *key, char *out, size_t cap) {
    const td__json *v = td__json_get(o, key);
    snprintf(out, cap, "%s", v && v->kind == TD__JSON_STRING ? v->string : "");
}

static int is_true(const td__json *o, const char *key) {
    const td__json *v = td__json_get(o, key);
    return v && v->kind == TD__JSON_BOOL && v->boolean;
}

static void load_call(const td__json *c, dr_call *k) {
    k->seq = (uint64_t)num(c, "seq", 0);
    str(c, "kind", k->kind, sizeof k->kind);
    k->p2p = strcmp(k->kind, "send") == 0 || strcmp(k->kind, "recv") == 0;
    k->coll = !k->p2p && strcmp(k->kind, "split") != 0 && strcmp(k->kind, "alloc") != 0;
    str(c, "desc", k->desc, sizeof k->desc);
    str(c, "tag", k->tag, sizeof k->tag);
    str(c, "dtype", k->dtype, sizeof k->dtype);
    k->count = (uint64_t)num(c, "count", 0);
    k->op = (int)num(c, "op", 0);
    k->peer = (int)num(c, "peer", -1);
    k->p2p_tag = (int)num(c, "p2p_tag", -1);
    str(c, "state", k->state, sizeof k->state);
    str(c, "status", k->status, sizeof k->status);
    k->step = (int64_t)num(c, "step", -1);
    k->waiting_for = (int)num(c, "waiting_for", -1);
    k->wait_s = num(c, "wait_s", 0);
    k->ended_s_ago = num(c, "ended_s_ago", -1);
}

static td_status load_group(const td__json *g, dr_group *out) {
    memset(out, 0, sizeof *out);
    str(g, "key", out->key, sizeof out->key);
    str(g, "label", out->label, sizeof out->label);
    str(g, "backend", out->backend, sizeof out->backend);
    str(g, "failed", out->failed, sizeof out->failed);
    out->rank = (int)num(g, "rank", -1);
    const td__json *m = td__json_get(g, "members"), *calls = td__json_get(g, "calls");
    if (!m || m->kind != TD__JSON_ARRAY || !calls || calls->kind != TD__JSON_ARRAY)
        return TD_EFORMAT;
    out->size = (int)m->n;
    out->members = malloc((m->n + 1) * sizeof *out->members);
    out->calls = calloc(calls->n + 1, sizeof *out->calls);
    if (!out->members || !out->calls) return TD_ENOMEM;
    for (size_t i = 0; i < m->n; i++) out->members[i] = (int)m->items[i].number;
    for (size_t i = 0; i < calls->n; i++) load_call(&calls->items[i], &out->calls[i]);
    out->ncalls = (int)calls->n;
    return TD_OK;
}

/* Grows job->ranks to hold rank r. */
static td_status make_room(dr_job *job, int r) {
    if (r < job->n) return TD_OK;
    int n = r + 1;
    dr_rank *grown = realloc(job->ranks, (size_t)n * sizeof *grown);
    if (!grown) return td__fail(TD_ENOMEM, "reading the dumps: out of memory");
    memset(grown + job->n, 0, (size_t)(n - job->n) * sizeof *grown);
    for (int i = job->n; i < n; i++) grown[i].rank = i;
    job->ranks = grown;
    job->n = n;
    return TD_OK;
}

static td_status load_dump(dr_job *job, const char *path) {
    size_t len = 0;
    char *text = read_all(path, &len), err[256] = "";
    if (!text) return td__fail(TD_EIO, "cannot read %s: %s", path, strerror(errno));
    td__json *root = td__json_parse(text, len, err, sizeof err);
    free(text);
    const td__json *d = td__json_get(root, "doctor");
    if (!d || d->kind != TD__JSON_OBJECT || (int)num(d, "rank", -1) < 0) {
        td__json_free(root);
        return td__fail(TD_EFORMAT, "%s is not a rank's dump%s%s", path,
                        err[0] ? ": " : "", err);
    }
    int r = (int)num(d, "rank", -1);
    td_status s = make_room(job, r);
    if (s) {
        td__json_free(root);
        return s;
    }
    dr_rank *k = &job->ranks[r];
    k->have_dump = 1;
    k->world_size = (int)num(d, "world_size", 0);
    k->pid = (int)num(d, "pid", 0);
    const td__json *t = td__json_get(d, "time_ns");
    k->time_ns = t && t->is_uint ? t->uint : (uint64_t)num(d, "time_ns", 0);
    str(d, "host", k->host, sizeof k->host);
    str(d, "why", k->why, sizeof k->why);
    str(d, "failure", k->failure, sizeof k->failure);
    const td__json *m = td__json_get(d, "marks"), *c = td__json_get(d, "creating");
    k->step = (int64_t)num(m, "step", -1);
    k->step_for_s = num(m, "step_for_s", -1);
    k->micro_batch = (int)num(m, "micro_batch", -1);
    str(m, "op", k->op, sizeof k->op);
    str(m, "phase", k->phase, sizeof k->phase);
    k->op_for_s = num(m, "op_for_s", -1);
    k->creating = c && c->kind == TD__JSON_OBJECT;
    k->creating_for_s = num(c, "for_s", 0);
    const td__json *groups = td__json_get(d, "groups"), *threads = td__json_get(d, "threads");
    if (groups && groups->kind == TD__JSON_ARRAY) {
        k->groups = calloc(groups->n + 1, sizeof *k->groups);
        for (size_t i = 0; k->groups && !s && i < groups->n; i++, k->ngroups++)
            s = load_group(&groups->items[i], &k->groups[i]);
        if (!k->groups) s = TD_ENOMEM;
    }
    for (size_t i = 0; !s && threads && threads->kind == TD__JSON_ARRAY && i < threads->n; i++) {
        const td__json *t = &threads->items[i], *stack = td__json_get(t, "stack");
        if (!is_true(t, "main") || !stack || stack->kind != TD__JSON_ARRAY) continue;
        for (size_t f = 0, at = 0; f < stack->n && at < 4; f++) {
            const char *frame =
                stack->items[f].kind == TD__JSON_STRING ? stack->items[f].string : "";
            /* The C library's frames (sleeps, waits) and the recorder's own handlers say
             * nothing of where the program is. */
            if (strstr(frame, "libc.so") || strstr(frame, "ld-linux") ||
                strstr(frame, "on_dump_signal") || strstr(frame, "on_probe"))
                continue;
            snprintf(k->main_stack[at++], sizeof k->main_stack[0], "%s", frame);
        }
    }
    td__json_free(root);
    if (s) return td__fail(s, "%s: a group's record is malformed", path);
    return TD_OK;
}

static td_status load_launcher(dr_job *job, const char *path) {
    size_t len = 0;
    char *text = read_all(path, &len), err[256] = "";
    if (!text) return TD_OK; /* no launcher wrote one */
    td__json *root = td__json_parse(text, len, err, sizeof err);
    free(text);
    const td__json *ranks = td__json_get(root, "ranks");
    if (!ranks || ranks->kind != TD__JSON_ARRAY) {
        td__json_free(root);
        return td__fail(TD_EFORMAT, "%s is not a launcher's note%s%s", path,
                        err[0] ? ": " : "", err);
    }
    td_status s = TD_OK;
    for (size_t i = 0; !s && i < ranks->n; i++) {
        const td__json *p = &ranks->items[i];
        int r = (int)num(p, "rank", -1);
        if (r < 0 || (s = make_room(job, r))) continue;
        dr_rank *k = &job->ranks[r];
        k->have_proc = 1;
        k->proc.rank = r;
        k->proc.pid = (int)num(p, "pid", 0);
        k->proc.ended = is_true(p, "ended");
        k->proc.code = (int)num(p, "code", 0);
        k->proc.signaled = is_true(p, "signaled");
        k->proc.recorder = is_true(p, "recorder");
        str(p, "host", k->proc.host, sizeof k->proc.host);
    }
    td__json_free(root);
    return s;
}

td_status td__doctor_load(const char *dir, dr_job *job) {
    memset(job, 0, sizeof *job);
    DIR *d = opendir(dir);
    if (!d) return td__fail(TD_EIO, "cannot read %s: %s", dir, strerror(errno));
    td_status s = TD_OK;
    struct dirent *e;
    char path[PATH_MAX];
    while (!s && (e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (strncmp(e->d_name, "rank", 4) != 0 || n < 6 || strcmp(e->d_name + n - 5, ".json") != 0)
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        s = load_dump(job, path);
    }
    closedir(d);
    snprintf(path, sizeof path, "%s/launcher.json", dir);
    if (!s) s = load_launcher(job, path);
    /* Ranks no dump and no launcher named, up to the world size the dumps give. */
    for (int r = 0; !s && r < job->n; r++)
        if (job->ranks[r].have_dump && job->ranks[r].world_size > job->n)
            s = make_room(job, job->ranks[r].world_size - 1);
    for (int r = 0; r < job->n; r++) {
        int seen = 0;
        for (int q = 0; q < r; q++)
            seen |= job->ranks[q].have_dump && job->ranks[r].have_dump &&
                    strcmp(job->ranks[q].host, job->ranks[r].host) == 0;
        job->hosts += job->ranks[r].have_dump && !seen;
    }
    if (!s && job->n == 0)
        s = td__fail(TD_EIO, "%s holds no dump (rank<R>.json) and no launcher.json",
                     dir);
    if (s) td__doctor_free(job);
    return s;
}

void td__doctor_free(dr_job *job) {
    for (int r = 0; r < job->n; r++) {
        for (int g = 0; g < job->ranks[r].ngroups; g++) {
            free(job->ranks[r].groups[g].members);
            free(job->ranks[r].groups[g].calls);
        }
        free(job->ranks[r].groups);
    }
    free(job->ranks);
    memset(job, 0, sizeof *job);
}

const dr_group *td__doctor_group_of(const dr_job *job, int r, const dr_group *g) {
    if (r < 0 || r >= job->n) return NULL;
    const dr_rank *k = &job->ranks[r];
    for (int i = 0; i < k->ngroups; i++) {
        const dr_group *h = &k->groups[i];
        if (strcmp(h->key, g->key) != 0 || h->size != g->size) continue;
        int same = 1;
        for (int m = 0; m < g->size && same; m++) same = h->members[m] == g->members[m];
        if (same) return h;
    }
    return NULL;
}

td_status td_doctor_write_procs(const char *dir, const td_doctor_proc *procs, int n) {
    if (!dir || (n > 0 && !procs))
        return td__fail(TD_EINVAL, "td_doctor_write_procs: NULL directory or processes");
    char path[PATH_MAX], tmp[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/launcher.json", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return td__fail(TD_EIO, "td_doctor_write_procs: %s: %s", tmp, strerror(errno));
    fputs("{\"ranks\": [", f);
    for (int i = 0; i < n; i++) {
        const td_doctor_proc *p = &procs[i];
        char host[160];
        td__json_escape(host, sizeof host, p->host, strnlen(p->host, sizeof p->host));
        fprintf(f,
                "%s\n  {\"rank\": %d, \"pid\": %d, \"ended\": %s, \"code\": %d, \"signaled\": %s, "
                "\"recorder\": %s, \"host\": \"%s\"}",
                i ? "," : "", p->rank, p->pid, p->ended ? "true" : "false", p->code,
                p->signaled ? "true" : "false", p->recorder ? "true" : "false", host);
    }
    fputs("]}\n", f);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad || rename(tmp, path) != 0) {
        unlink(tmp);
        return td__fail(TD_EIO, "td_doctor_write_procs: cannot write %s", path);
    }
    return TD_OK;
}
