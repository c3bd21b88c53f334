/* td_comm_agree: the check every strategy runs before it acts on something that all ranks must
 * share (DDP's registered parameters, a pipeline's options and cut, a collective graph node, the
 * start of a pipeline step). One all-gather of each rank's status and signature; the verdict is
 * computed from the same gathered bytes on every rank, so every rank returns the same error and
 * none waits for a rank that gave up. It moves bytes through the public collectives only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/comm.h"

#include "core/core_impl.h"

#define AGREE_MESSAGE 640 /* bytes of a failed rank's message that reach the others */

td_status td_comm_agree(td_comm *comm, const td_comm_agreement *a) {
    if (!comm || !a || !a->what || (a->bytes && (!a->sig || !a->describe)))
        return td__fail(TD_EINVAL, "td_comm_agree: comm, agreement, what, sig or describe is NULL");
    char message[AGREE_MESSAGE];
    snprintf(message, sizeof message, "%s", a->local ? td_last_error() : "");
    int size = td_comm_size(comm), rank = td_comm_rank(comm);
    size_t stride = 8 + (a->bytes + 7) / 8 * 8; /* the status, then the signature */
    unsigned char *mine = calloc(1, stride), *all = calloc((size_t)size, stride);
    if (!mine || !all) {
        free(mine);
        free(all);
        return td__fail(TD_ENOMEM, "%s: out of memory for %d signatures of %zu bytes", a->what,
                        size, a->bytes);
    }
    int64_t status = a->local;
    memcpy(mine, &status, 8);
    if (a->bytes) memcpy(mine + 8, a->sig, a->bytes);
    td_status s = td_comm_allgather(comm, mine, all, stride, TD_U8);
    int failed = -1, differs = -1;
    for (int r = 0; s == TD_OK && r < size && failed < 0; r++) {
        memcpy(&status, all + (size_t)r * stride, 8);
        if (status != TD_OK) failed = r;
    }
    for (int r = 1; s == TD_OK && failed < 0 && r < size && differs < 0; r++)
        if (memcmp(all + 8, all + (size_t)r * stride + 8, a->bytes) != 0) differs = r;
    if (failed >= 0) {
        /* The rank that failed tells the others why: its message less the "<what>: " it began
         * with, which the others' own "<what>: rank R: " replaces, so that a layer's words come
         * once. */
        memcpy(&status, all + (size_t)failed * stride, 8);
        char relay[AGREE_MESSAGE];
        size_t own = strlen(a->what);
        int prefixed = !strncmp(message, a->what, own) && !strncmp(message + own, ": ", 2);
        snprintf(relay, sizeof relay, "%s", message + (prefixed ? own + 2 : 0));
        s = td_comm_broadcast(comm, relay, sizeof relay, TD_U8, failed);
        relay[sizeof relay - 1] = '\0';
        if (s == TD_OK && rank == failed)
            s = td__fail((td_status)status, "%s", message);
        else if (s == TD_OK)
            s = td__fail((td_status)status, "%s: rank %d: %s", a->what, failed, relay);
    } else if (differs >= 0) {
        char at0[320], atr[320];
        const unsigned char *first = all + 8, *other = all + (size_t)differs * stride + 8;
        a->describe(first, other, at0, sizeof at0, a->describe_ctx);
        a->describe(other, first, atr, sizeof atr, a->describe_ctx);
        s = td__fail(a->mismatch ? a->mismatch : TD_EMISMATCH,
                     "%s: rank 0 has %s but rank %d has %s%s", a->what, at0, differs, atr,
                     a->hint ? a->hint : "");
    }
    free(mine);
    free(all);
    return s;
}
