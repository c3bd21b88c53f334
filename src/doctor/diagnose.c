/* The diagnosis of a job from its ranks' dumps: who waits for whom, and why.
 *
 *  1. Each rank's wait: the oldest call of any group it has not finished (in flight, or the
 *     first that failed), and the members it waits on there: for a collective, those whose ring
 *     has not reached the call's sequence number; for a send or a receive, its peer; in
 *     td_comm_create, the ranks that have no group at all.
 *  2. The first divergence: the lowest sequence number of a group at which its members' calls
 *     differ (kind, dtype, count, op or root), or were made at different steps (then the rank a
 *     step ahead skipped a call). It is the root cause when there is one: the waits follow from
 *     it.
 *  3. Otherwise the chain of waits from a rank no one waits on, rank to rank across groups,
 *     down to the rank that holds it up: one not in any call (in compute: its step, op and for
 *     how long), one that died (how, from the launcher's note), one that never created a
 *     process group, or back to a rank already on it (a deadlock).
 *  4. Otherwise no rank is stuck, and straggler.c looks for the rank the others wait for.
 *
 * The text's first line is the root cause; then the chain, then a line per rank. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "doctor/doctor_impl.h"

#define MAX_ON 8

typedef struct {
    int waiting;
    int creating;        /* in td_comm_create */
    const dr_group *g;   /* the group of the call */
    const dr_call *call; /* the call */
    int on[MAX_ON];      /* the world ranks it waits on */
    int non;
} rank_wait;

/* A text that grows; a failed allocation leaves it as it was. */
typedef struct {
    char *s;
    size_t len, cap;
} text;

static void put(text *t, const char *fmt, ...) TD__PRINTF(2, 3);
static void put(text *t, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (t->len + (size_t)n + 1 > t->cap) {
        size_t cap = (t->len + (size_t)n + 1) * 2;
        char *grown = realloc(t->s, cap);
        if (!grown) return;
        t->s = grown;
        t->cap = cap;
    }
    va_start(ap, fmt);
    vsnprintf(t->s + t->len, t->cap - t->len, fmt, ap);
    va_end(ap);
    t->len += (size_t)n;
}

/* ---------------------------------------------------------------- words */

typedef struct {
    char s[512];
} words;

static words who(const dr_job *job, int r) {
    words w;
    const dr_rank *k = r >= 0 && r < job->n ? &job->ranks[r] : NULL;
    const char *host = k && k->have_dump ? k->host : k && k->have_proc ? k->proc.host : "";
    if (job->hosts > 1 && host[0])
        snprintf(w.s, sizeof w.s, "rank %d on %s", r, host);
    else
        snprintf(w.s, sizeof w.s, "rank %d", r);
    return w;
}

static words group_name(const dr_group *g) {
    words w;
    if (strcmp(g->label, "world") == 0)
        snprintf(w.s, sizeof w.s, "the world group");
    else
        snprintf(w.s, sizeof w.s, "%s", g->label);
    return w;
}

/* "allreduce #12 (f32, 4 elements, sum) ['ddp bucket 0']" */
static words call_words(const dr_call *c) {
    words w;
    char tag[64] = "";
    if (c->tag[0]) snprintf(tag, sizeof tag, " ['%s']", c->tag);
    snprintf(w.s, sizeof w.s, "%.255s%s", c->desc, tag);
    return w;
}

/* "allreduce #12 (f32, 4 elements, sum) ['ddp bucket 0'] of the world group" */
static words call_name(const dr_group *g, const dr_call *c) {
    words w;
    snprintf(w.s, sizeof w.s, "%.320s of %.150s", call_words(c).s, group_name(g).s);
    return w;
}

/* "ranks 0, 2" or "rank 1" */
static words rank_list(const dr_job *job, const int *r, int n) {
    words w;
    size_t at = 0;
    if (n == 1) return who(job, r[0]);
    at += (size_t)snprintf(w.s, sizeof w.s, "ranks ");
    for (int i = 0; i < n && at < sizeof w.s; i++)
        at += (size_t)snprintf(w.s + at, sizeof w.s - at, "%s%d", i ? ", " : "", r[i]);
    return w;
}

/* What a rank does when it is in no call: "in compute (step 57, op conv2 backward for 41.0 s)". */
static words compute_words(const dr_rank *k) {
    words w;
    char step[48] = "", op[128] = "";
    if (k->step >= 0) snprintf(step, sizeof step, "step %lld", (long long)k->step);
    if (k->op[0])
        snprintf(op, sizeof op, "%sop %s %s for %.1f s", step[0] ? ", " : "", k->op, k->phase,
                 k->op_for_s);
    else if (k->step >= 0 && k->step_for_s >= 0)
        snprintf(op, sizeof op, " for %.1f s, outside the graph's ops", k->step_for_s);
    if (step[0] || op[0])
        snprintf(w.s, sizeof w.s, "in compute (%s%s), not in any call", step, op);
    else
        snprintf(w.s, sizeof w.s, "in compute, not in any call (it marks no step or op)");
    return w;
}

/* How a rank's process ended: "exited with status 1", "was killed by signal 9 (SIGKILL)". */
static words end_words(const dr_rank *k) {
    words w;
    if (k->proc.signaled) {
        char name[16] = "";
        const char *abbrev = sigabbrev_np(k->proc.code);
        if (abbrev) snprintf(name, sizeof name, " (SIG%s)", abbrev);
        snprintf(w.s, sizeof w.s, "was killed by signal %d%s", k->proc.code, name);
    } else {
        snprintf(w.s, sizeof w.s, "exited with status %d", k->proc.code);
    }
    return w;
}

/* How a rank with no dump ended or why it has none. */
static words missing_words(const dr_job *job, int r) {
    words w;
    const dr_rank *k = r < job->n ? &job->ranks[r] : NULL;
    if (k && k->have_proc && k->proc.ended) {
        snprintf(w.s, sizeof w.s, "(pid %d) %.400s", k->proc.pid, end_words(k).s);
    } else if (k && k->have_proc && !k->proc.recorder) {
        snprintf(w.s, sizeof w.s,
                 "(pid %d) never created a process group: it runs, without a flight recorder",
                 k->proc.pid);
    } else if (k && k->have_proc) {
        snprintf(w.s, sizeof w.s, "(pid %d) runs but wrote no dump (stopped?)", k->proc.pid);
    } else {
        /* The survivors' errors may say how it went. */
        int died = 0;
        char needle[32];
        snprintf(needle, sizeof needle, "rank %d (pid", r);
        for (int q = 0; q < job->n && !died; q++)
            died = strstr(job->ranks[q].failure, needle) && strstr(job->ranks[q].failure, "died");
        snprintf(w.s, sizeof w.s, "%s",
                 died ? "died (its peers say)" : "left no dump: it died or never started");
    }
    return w;
}

/* ---------------------------------------------------------------- waits */

static int failed_waiting(const dr_call *c) {
    return strcmp(c->state, "failed") == 0 && strcmp(c->status, "invalid argument") != 0 &&
           strcmp(c->status, "unsupported dtype") != 0 && strcmp(c->status, "out of memory") != 0;
}

static int in_flight(const dr_call *c) {
    return strcmp(c->state, "running") == 0 || strcmp(c->state, "queued") == 0;
}

/* The highest collective sequence number in g's ring, or -1. */
static long long last_seq(const dr_group *g) {
    long long s = -1;
    for (int i = 0; i < g->ncalls; i++)
        if (g->calls[i].coll && (long long)g->calls[i].seq > s) s = (long long)g->calls[i].seq;
    return s;
}

static const dr_call *call_at(const dr_group *g, uint64_t seq) {
    for (int i = g->ncalls - 1; i >= 0; i--)
        if (g->calls[i].coll && g->calls[i].seq == seq) return &g->calls[i];
    return NULL;
}

static void add_on(rank_wait *w, int r) {
    for (int i = 0; i < w->non; i++)
        if (w->on[i] == r) return;
    if (w->non < MAX_ON) w->on[w->non++] = r;
}

/* Whom rank r waits on in call c of its group g. */
static void waits_on(const dr_job *job, int r, const dr_group *g, const dr_call *c, rank_wait *w) {
    w->waiting = 1;
    w->g = g;
    w->call = c;
    w->non = 0;
    if (c->p2p) {
        if (c->peer >= 0) add_on(w, c->peer);
        return;
    }
    if (!c->coll) { /* a split or an allocation: any member that did not come */
        if (c->waiting_for >= 0) add_on(w, c->waiting_for);
        return;
    }
    /* Every member's ring says whether it came; one with no dump (or without the group) did
     * not, as far as anyone can tell. */
    for (int m = 0; m < g->size; m++) {
        int q = g->members[m];
        if (q == r) continue;
        const dr_group *h = td__doctor_group_of(job, q, g);
        if (!h || last_seq(h) < (long long)c->seq) add_on(w, q);
    }
    /* The one the rank's own wait last named first (its backend knows whose message is due). */
    for (int i = 1; i < w->non; i++)
        if (w->on[i] == c->waiting_for) {
            w->on[i] = w->on[0];
            w->on[0] = c->waiting_for;
        }
}

/* How long a call in flight must have waited to hold its rank up: a second, and three times the
 * longest wait of a finished call of its group (a job that is merely slow waits that long at
 * every step). */
static double stuck_after(const dr_group *g) {
    double longest = 0;
    for (int i = 0; i < g->ncalls; i++)
        if (strcmp(g->calls[i].state, "done") == 0 && g->calls[i].wait_s > longest)
            longest = g->calls[i].wait_s;
    return 3 * longest > 1.0 ? 3 * longest : 1.0;
}

static void find_wait(const dr_job *job, int r, int failed, rank_wait *w) {
    memset(w, 0, sizeof *w);
    const dr_rank *k = &job->ranks[r];
    if (!k->have_dump) return;
    const dr_call *best = NULL;
    const dr_group *best_g = NULL;
    for (int i = 0; i < k->ngroups; i++) {
        const dr_group *g = &k->groups[i];
        const dr_call *first = NULL; /* its oldest call not finished */
        for (int j = 0; j < g->ncalls && !first; j++)
            if (in_flight(&g->calls[j]) || failed_waiting(&g->calls[j])) first = &g->calls[j];
        /* A call in flight holds the rank up once it waited long, or at once in a job where a
         * group failed (the dumps are of that moment) or when it waits on a rank that left no
         * dump (dead, or never there). */
        if (first && in_flight(first) && !failed && first->wait_s < stuck_after(g)) {
            rank_wait probe;
            waits_on(job, r, g, first, &probe);
            int gone = 0;
            for (int i = 0; i < probe.non; i++)
                gone |= probe.on[i] >= job->n || !job->ranks[probe.on[i]].have_dump;
            if (!gone) first = NULL;
        }
        /* Of several groups, the call waited on longest holds the rank up. */
        if (first && (!best || first->wait_s > best->wait_s)) best = first, best_g = g;
    }
    if (best) {
        waits_on(job, r, best_g, best, w);
        return;
    }
    if (k->creating || (k->ngroups == 0 && strstr(k->failure, "td_comm_create"))) {
        w->waiting = w->creating = 1;
        for (int q = 0; q < job->n; q++)
            if (q != r && (!job->ranks[q].have_dump ||
                           (job->ranks[q].ngroups == 0 && !job->ranks[q].creating)))
                add_on(w, q);
    }
}

/* ---------------------------------------------------------------- divergence */

typedef struct {
    int found;
    const dr_group *g;
    uint64_t seq;
    int by_step; /* the calls agree but were made at different steps */
    int bad[64]; /* the ranks that differ from the most common call (or are a step ahead) */
    int nbad;
    int good[64]; /* the others */
    int ngood;
    const dr_call *bad_call, *good_call;
} divergence;

static int same_call(const dr_call *a, const dr_call *b) {
    return strcmp(a->kind, b->kind) == 0 && strcmp(a->dtype, b->dtype) == 0 &&
           a->count == b->count && a->op == b->op && a->peer == b->peer;
}

/* Whether the members' calls at[0..n) of one seq differ, filling `d` when they do: calls unlike
 * the most common one, or equal calls made at different steps (every member marking steps),
 * where the ranks ahead of the lowest step skipped a call. */
static int differ(const dr_call *const *at, const int *members, int n, divergence *d) {
    int best = 0, best_votes = 0;
    for (int m = 0; m < n; m++) {
        int votes = 0;
        for (int q = 0; q < n; q++) votes += same_call(at[m], at[q]);
        if (votes > best_votes) best = m, best_votes = votes;
    }
    d->nbad = d->ngood = 0;
    d->by_step = best_votes == n;
    int64_t low = at[0]->step;
    for (int m = 0; m < n && d->by_step; m++) {
        if (at[m]->step < 0) return 0;
        if (at[m]->step < low) low = at[m]->step;
    }
    for (int m = 0; m < n; m++) {
        int ok = d->by_step ? at[m]->step == low : same_call(at[m], at[best]);
        if (ok) {
            d->good[d->ngood++] = members[m];
            d->good_call = at[m];
        } else {
            d->bad[d->nbad++] = members[m];
            d->bad_call = at[m];
        }
    }
    return d->nbad > 0;
}

/* The lowest seq of every group at which its members' calls differ; the first such group
 * (in rank order) wins. */
static void find_divergence(const dr_job *job, divergence *d) {
    memset(d, 0, sizeof *d);
    for (int r = 0; r < job->n && !d->found; r++) {
        const dr_rank *k = &job->ranks[r];
        for (int i = 0; i < k->ngroups && !d->found; i++) {
            const dr_group *g = &k->groups[i], *views[64];
            int n = g->size, ok = n <= 64;
            for (int m = 0; m < n && ok; m++)
                ok = (views[m] = td__doctor_group_of(job, g->members[m], g)) != NULL;
            if (!ok) continue; /* a member without the group: the chain names it */
            for (int c = 0; c < g->ncalls && !d->found; c++) {
                if (!g->calls[c].coll) continue;
                const dr_call *at[64];
                int all = 1;
                for (int m = 0; m < n && all; m++)
                    all = (at[m] = call_at(views[m], g->calls[c].seq)) != NULL;
                if (all && differ(at, g->members, n, d)) {
                    d->found = 1;
                    d->g = g;
                    d->seq = g->calls[c].seq;
                }
            }
        }
    }
}

/* ---------------------------------------------------------------- the chain */

/* The rank r waits on first: one that is itself stuck elsewhere, or gone, before one that is
 * merely late. */
static int next_of(const dr_job *job, const rank_wait *waits, int r) {
    const rank_wait *w = &waits[r];
    if (!w->waiting || w->non == 0) return -1;
    /* A rank that died first, then one with no dump or itself stuck, then the first. */
    for (int i = 0; i < w->non; i++) {
        int q = w->on[i];
        if (q < job->n && job->ranks[q].have_proc && job->ranks[q].proc.ended &&
            job->ranks[q].proc.signaled)
            return q;
    }
    for (int i = 0; i < w->non; i++) {
        int q = w->on[i];
        if (q >= 0 && q < job->n && (!job->ranks[q].have_dump || waits[q].waiting)) return q;
    }
    return w->on[0];
}

/* The chain from `start`: its ranks in order; returns its length, and *cycle = 1 when it comes
 * back to a rank already on it (the last entry). */
static int chain_from(const dr_job *job, const rank_wait *waits, int start, int *out, int cap,
                      int *cycle) {
    int n = 0;
    *cycle = 0;
    for (int r = start; r >= 0 && n < cap;) {
        for (int i = 0; i < n; i++)
            if (out[i] == r) {
                out[n++] = r;
                *cycle = 1;
                return n;
            }
        out[n++] = r;
        r = r < job->n ? next_of(job, waits, r) : -1;
    }
    return n;
}

/* "rank 0 waits for rank 1 in allreduce #12 ... (5.0 s)" */
static void put_wait(text *t, const dr_job *job, const rank_wait *waits, int r, int q) {
    const rank_wait *w = &waits[r];
    if (w->creating) {
        put(t, "%s waits for %s in td_comm_create", who(job, r).s, who(job, q).s);
        return;
    }
    put(t, "%s waits for %s in %s", who(job, r).s, who(job, q).s, call_name(w->g, w->call).s);
    if (w->call->wait_s >= 0.05) put(t, " (%.1f s)", w->call->wait_s);
}

/* ---------------------------------------------------------------- the text */

static void put_rank_line(text *t, const dr_job *job, const rank_wait *waits, int r) {
    const dr_rank *k = &job->ranks[r];
    const rank_wait *w = &waits[r];
    put(t, "  %s", who(job, r).s);
    if (!k->have_dump) {
        put(t, " %s\n", missing_words(job, r).s);
        return;
    }
    put(t, " (pid %d): ", k->pid);
    if (w->waiting && w->creating) {
        put(t, "in td_comm_create for %.1f s", k->creating_for_s);
    } else if (w->waiting) {
        put(t, "%s %s", strcmp(w->call->state, "failed") == 0 ? "failed in" : "in",
            call_name(w->g, w->call).s);
        if (w->call->wait_s >= 0.05) put(t, " after waiting %.1f s", w->call->wait_s);
        if (w->non) put(t, " for %s", rank_list(job, w->on, w->non).s);
        if (w->call->step >= 0) put(t, ", step %lld", (long long)w->call->step);
    } else {
        put(t, "%s", compute_words(k).s);
    }
    if (k->have_proc && k->proc.ended) put(t, "; then it %s", end_words(k).s);
    put(t, "\n");
    if (!w->waiting && k->main_stack[0][0]) {
        put(t, "      main thread:");
        for (int i = 0; i < 4 && k->main_stack[i][0]; i++)
            put(t, "%s %s", i ? " <-" : "", k->main_stack[i]);
        put(t, "\n");
    }
}

/* The root cause when the members of a group called different things. */
static void put_divergence(text *t, const dr_job *job, const divergence *d) {
    words g = group_name(d->g);
    if (d->by_step) {
        put(t,
            "root cause: %s skipped a call of %s: %s%s was made in step %lld, where %s made "
            "theirs in step %lld\n",
            rank_list(job, d->bad, d->nbad).s, g.s, d->nbad == 1 ? "its " : "their ",
            call_words(d->bad_call).s, (long long)d->bad_call->step,
            rank_list(job, d->good, d->ngood).s, (long long)d->good_call->step);
        return;
    }
    put(t, "root cause: the ranks' calls differ at #%llu of %s: %s called %s where %s called %s\n",
        (unsigned long long)d->seq, g.s, rank_list(job, d->bad, d->nbad).s,
        call_words(d->bad_call).s, rank_list(job, d->good, d->ngood).s,
        call_words(d->good_call).s);
}

/* The rank a chain ends at, in the root cause's words. */
static void put_culprit(text *t, const dr_job *job, const rank_wait *waits, int q) {
    const dr_rank *k = &job->ranks[q];
    if (!k->have_dump)
        put(t, "%s %s", who(job, q).s, missing_words(job, q).s);
    else if (waits[q].waiting && waits[q].creating)
        put(t, "%s is in td_comm_create (%.1f s)", who(job, q).s, k->creating_for_s);
    else if (waits[q].waiting) /* in a call whose members all came: moving data, or ended */
        put(t, "%s is in %s, which every member reached", who(job, q).s,
            call_name(waits[q].g, waits[q].call).s);
    else
        put(t, "%s is %s", who(job, q).s, compute_words(k).s);
}

td_status td_doctor_diagnose(const char *dir, char **out) {
    if (!dir || !out) return td__fail(TD_EINVAL, "td_doctor_diagnose: NULL directory or text");
    *out = NULL;
    dr_job job;
    TD__TRY(td__doctor_load(dir, &job));
    rank_wait *waits = calloc((size_t)job.n, sizeof *waits);
    int *best = malloc((size_t)(job.n + 1) * sizeof *best),
        *chain = malloc((size_t)(job.n + 1) * sizeof *chain);
    text t = {0};
    if (!waits || !best || !chain) {
        free(waits);
        free(best);
        free(chain);
        td__doctor_free(&job);
        return td__fail(TD_ENOMEM, "td_doctor_diagnose: out of memory");
    }
    /* A job where a group failed: its dumps are of that moment. */
    int failed = 0;
    for (int r = 0; r < job.n; r++) failed |= job.ranks[r].failure[0] != 0;
    for (int r = 0; r < job.n; r++) find_wait(&job, r, failed, &waits[r]);
    divergence d;
    find_divergence(&job, &d);
    /* The longest chain, from a waiting rank no one waits on (any waiting rank in a cycle). */
    int nbest = 0, best_cycle = 0;
    for (int pass = 0; pass < 2 && nbest == 0; pass++)
        for (int r = 0; r < job.n; r++) {
            if (!waits[r].waiting) continue;
            int waited_on = 0;
            for (int q = 0; q < job.n && !pass; q++) waited_on |= next_of(&job, waits, q) == r;
            if (waited_on) continue;
            int cycle, n = chain_from(&job, waits, r, chain, job.n + 1, &cycle);
            if (n > nbest) {
                nbest = n;
                best_cycle = cycle;
                memcpy(best, chain, (size_t)n * sizeof *chain);
            }
        }
    if (d.found) {
        put_divergence(&t, &job, &d);
    } else if (nbest >= 2 && best_cycle) {
        put(&t, "root cause: deadlock: ");
        for (int i = 0; i + 1 < nbest; i++) {
            put(&t, "%s", i ? ", and " : "");
            put_wait(&t, &job, waits, best[i], best[i + 1]);
        }
        put(&t, "\n");
    } else if (nbest >= 2) {
        put(&t, "root cause: ");
        put_culprit(&t, &job, waits, best[nbest - 1]);
        put(&t, ": ");
        put_wait(&t, &job, waits, best[nbest - 2], best[nbest - 1]);
        put(&t, "\n");
    } else {
        char slow[4096] = "";
        if (td__doctor_straggler(&job, slow, sizeof slow))
            put(&t, "%s", slow);
        else
            put(&t, "no rank is stuck, and none is slower than the others\n");
    }
    if (nbest > 2 && !d.found) {
        put(&t, "  waits: ");
        for (int i = 0; i + 1 < nbest; i++) {
            put(&t, "%s", i ? "; " : "");
            put_wait(&t, &job, waits, best[i], best[i + 1]);
        }
        put(&t, "\n");
    }
    for (int r = 0; r < job.n; r++) put_rank_line(&t, &job, waits, r);
    free(waits);
    free(best);
    free(chain);
    td__doctor_free(&job);
    if (!t.s) return td__fail(TD_ENOMEM, "td_doctor_diagnose: out of memory");
    *out = t.s;
    return TD_OK;
}
