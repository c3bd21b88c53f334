/* The rank a job that is not stuck keeps waiting for. In each group, for the recent calls every
 * member's ring holds, the member that waited least arrived last: the others waited for it
 * (every rank stamps a call that waits past its spin with how long). A rank last at most of them
 * is the straggler; the report says how long the others waited for it per call, at which
 * calls, and how each rank's time since the window began splits between compute and waiting.
 * It compares durations only, so ranks on different hosts (other clocks) compare too. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "doctor/doctor_impl.h"

#define WINDOW 200        /* recent calls looked at, per group */
#define MIN_WAIT_S 0.0005 /* a call at which nobody waited this long names no one */

static const dr_call *call_at(const dr_group *g, uint64_t seq) {
    for (int i = g->ncalls - 1; i >= 0; i--)
        if (g->calls[i].coll && g->calls[i].seq == seq) return &g->calls[i];
    return NULL;
}

/* A call's words without its sequence number: "allreduce (f32, 4 elements, sum) ['tag']". */
static void signature(const dr_call *c, char *out, size_t cap) {
    const char *hash = strchr(c->desc, '#'), *space = hash ? strchr(hash, ' ') : NULL;
    if (hash && space)
        snprintf(out, cap, "%.*s%s", (int)(hash - c->desc), c->desc, space + 1);
    else
        snprintf(out, cap, "%s", c->desc);
    if (c->tag[0]) {
        size_t n = strlen(out);
        snprintf(out + n, cap - n, " ['%s']", c->tag);
    }
}

typedef struct {
    char sig[320];
    double waited; /* the others' waits, summed over the calls */
    int calls;
} per_call;

int td__doctor_straggler(const dr_job *job, char *out, size_t cap) {
    int found = 0;
    for (int r = 0; r < job->n && !found; r++) {
        const dr_rank *k = &job->ranks[r];
        for (int gi = 0; gi < k->ngroups && !found; gi++) {
            const dr_group *g = &k->groups[gi], *views[64];
            int n = g->size, ok = n >= 2 && n <= 64;
            for (int m = 0; m < n && ok; m++)
                ok = (views[m] = td__doctor_group_of(job, g->members[m], g)) != NULL;
            if (!ok || g->rank != 0) continue; /* each group once, from its rank 0 */
            int last[64] = {0}, counted = 0;
            double waits[64] = {0}, oldest = 0, for_last[64] = {0};
            per_call kinds[16];
            int nkinds = 0;
            int from = g->ncalls > WINDOW ? g->ncalls - WINDOW : 0;
            for (int c = from; c < g->ncalls; c++) {
                if (!g->calls[c].coll) continue;
                const dr_call *at[64];
                int all = 1;
                for (int m = 0; m < n && all; m++)
                    all = (at[m] = call_at(views[m], g->calls[c].seq)) != NULL &&
                          strcmp(at[m]->state, "done") == 0;
                if (!all) continue;
                int least = 0;
                double most = 0;
                for (int m = 0; m < n; m++) {
                    if (at[m]->wait_s < at[least]->wait_s) least = m;
                    if (at[m]->wait_s > most) most = at[m]->wait_s;
                    waits[m] += at[m]->wait_s;
                    if (at[m]->wait_s > 0 && at[m]->ended_s_ago + at[m]->wait_s > oldest)
                        oldest = at[m]->ended_s_ago + at[m]->wait_s;
                }
                if (most < MIN_WAIT_S) continue;
                counted++;
                last[least]++;
                double others = 0;
                for (int m = 0; m < n; m++) others += m == least ? 0 : at[m]->wait_s;
                others /= n - 1;
                for_last[least] += others;
                char sig[320];
                signature(at[least], sig, sizeof sig);
                int kk = 0;
                while (kk < nkinds && strcmp(kinds[kk].sig, sig) != 0) kk++;
                if (kk == nkinds && nkinds < 16) {
                    snprintf(kinds[nkinds].sig, sizeof kinds[0].sig, "%s", sig);
                    kinds[nkinds].waited = 0;
                    kinds[nkinds++].calls = 0;
                }
                if (kk < nkinds) {
                    kinds[kk].waited += others;
                    kinds[kk].calls++;
                }
            }
            int s = 0;
            for (int m = 1; m < n; m++)
                if (last[m] > last[s]) s = m;
            if (counted < 3 || last[s] * 10 < counted * 6) continue;
            found = 1;
            int slow = g->members[s];
            size_t at = 0;
            at += (size_t)snprintf(
                out + at, cap - at,
                "root cause: no rank is stuck; rank %d is the slowest: the last to arrive at %d of "
                "the %d recent calls of %s at which a rank waited, the others waiting %.1f ms a "
                "call for it\n",
                slow, last[s], counted,
                strcmp(g->label, "world") == 0 ? "the world group" : g->label,
                1e3 * for_last[s] / last[s]);
            if (at < cap && oldest > 0) {
                at += (size_t)snprintf(out + at, cap - at,
                                       "  where the time went, the last %.1f s:", oldest);
                for (int m = 0; m < n && at < cap; m++) {
                    double w = waits[m] / oldest;
                    at += (size_t)snprintf(out + at, cap - at,
                                           "%s rank %d %.0f%% compute, %.0f%% waiting",
                                           m ? ";" : "", g->members[m], 100 * (1 - w), 100 * w);
                }
                if (at < cap) at += (size_t)snprintf(out + at, cap - at, "\n");
            }
            for (int kk = 0; kk < nkinds && at < cap; kk++)
                at += (size_t)snprintf(
                    out + at, cap - at, "  at %s: the others waited %.1f ms a call (%d calls)\n",
                    kinds[kk].sig, 1e3 * kinds[kk].waited / kinds[kk].calls, kinds[kk].calls);
        }
    }
    return found;
}
