/* How messages name the members of a group: by their rank in the job's world first, with the
 * group and the rank in it beside ("world rank 3 (rank 2 of group {1,2,3})"), so that a
 * sub-group's rank 2 is never read as world rank 2. In the world group a rank is just "rank 3".
 * Backends format every peer and themselves through td__who; the generic layer (comm.c) keeps
 * each group's td__names and hands it to the backend. It decides nothing and moves nothing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm_impl.h"

void td__names_init(td__names *n, int size, int *world) {
    n->size = size;
    n->world = world;
    td__names_label(n, NULL);
}

void td__names_label(td__names *n, const char *name) {
    if (!n->world) {
        n->label[0] = 0;
        return;
    }
    /* "group {1,2,3}" or "group tp0 = {1,2,3}", the members in group-rank order; a long list
     * keeps its start and end. */
    char label[sizeof n->label];
    size_t cap = sizeof label,
           at = (size_t)(name ? snprintf(label, cap, "group %.32s = {", name)
                              : snprintf(label, cap, "group {"));
    for (int i = 0; i < n->size && at < cap; i++) {
        if (n->size > 12 && i == 8) {
            at += (size_t)snprintf(label + at, cap - at, ",...");
            i = n->size - 3;
        }
        at += (size_t)snprintf(label + at, cap - at, "%s%d", i ? "," : "", n->world[i]);
    }
    if (at < cap) snprintf(label + at, cap - at, "}");
    memcpy(n->label, label, sizeof label);
}

void td__names_free(td__names *n) {
    free(n->world);
    n->world = NULL;
}

int td__names_world(const td__names *n, int rank) {
    return n && n->world && rank >= 0 && rank < n->size ? n->world[rank] : rank;
}

td__who_text td__who_on(const td__names *n, int rank, const char *host) {
    td__who_text t;
    char on[64] = "";
    if (host && *host) snprintf(on, sizeof on, " on %s", host);
    if (!n || !n->world || rank < 0 || rank >= n->size)
        snprintf(t.s, sizeof t.s, "rank %d%s", rank, on);
    else
        snprintf(t.s, sizeof t.s, "world rank %d%s (rank %d of %.80s)", n->world[rank], on, rank,
                 n->label);
    return t;
}

td__who_text td__who(const td__names *n, int rank) { return td__who_on(n, rank, NULL); }
