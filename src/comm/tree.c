/* Sums across ranks in one fixed order: the aligned pairwise tree over the ranks in rank order
 * (((r0 + r1) + (r2 + r3)) + ...), whatever the backend. A backend's all-reduce adds in an
 * order of its own that depends on the group's size (shm folds the ranks left to right; rings
 * and trees elsewhere), so a sum that must be the same bits as one process adding fixed pieces
 * pairwise — the levels above the ranks of deterministic mode's trees — cannot use it beyond
 * two ranks (one addition, exact in either order). Here each rank receives every rank's
 * segment of one part of the buffer (an all-to-all), adds the w segments in pairs (stride 1,
 * 2, 4, ...) and, for an all-reduce, the parts are all-gathered back. Built on the group's own
 * collectives, so every backend and the group's checks serve it. f32 sums. */
#include <stdlib.h>
#include <string.h>

#include "comm/comm_impl.h"
#include "core/core_impl.h"

#define TREE_MAX_RANKS 1024 /* as many as tandemrun starts */

/* The w received segments of `seg` floats at stage, summed pairwise into the first. */
static void add_segments(float *stage, int w, size_t seg) {
    float *x[TREE_MAX_RANKS];
    for (int i = 0; i < w; i++) x[i] = stage + (size_t)i * seg;
    td__pairwise_sum(x, (size_t)w, seg);
}

static td_status check(td_comm *comm, td_dtype dtype, const char *what) {
    if (!comm) return td__fail(TD_EINVAL, "%s: comm is NULL", what);
    if (dtype != TD_F32)
        return td__fail(TD_EDTYPE, "%s: %s; the fixed tree sums f32", what, td_dtype_name(dtype));
    if (td_comm_size(comm) > TREE_MAX_RANKS)
        return td__fail(TD_EUNSUPPORTED, "%s: a group of %d ranks (at most %d)", what,
                        td_comm_size(comm), TREE_MAX_RANKS);
    return TD_OK;
}

td_status td_comm_allreduce_tree(td_comm *comm, const void *send, void *recv, size_t count,
                                 td_dtype dtype) {
    TD__TRY(check(comm, dtype, "td_comm_allreduce_tree"));
    int w = td_comm_size(comm);
    if (w == 1) {
        if (send != recv) memmove(recv, send, count * sizeof(float));
        return TD_OK;
    }
    if (w == 2) return td_comm_allreduce(comm, send, recv, count, TD_F32, TD_OP_SUM);
    size_t seg = (count + (size_t)w - 1) / (size_t)w, whole = seg * (size_t)w;
    int even = whole == count;
    /* the received segments; for an uneven count also the padded input and the gathered sum */
    float *stage = malloc((even ? whole : 2 * whole) * sizeof(float));
    if (!stage) return td__fail(TD_ENOMEM, "td_comm_allreduce_tree: out of memory");
    float *padded = stage + whole;
    const void *from = send;
    if (!even) {
        memcpy(padded, send, count * sizeof(float));
        memset(padded + count, 0, (whole - count) * sizeof(float));
        from = padded;
    }
    td_status s = td_comm_alltoall(comm, from, stage, seg, TD_F32);
    if (s == TD_OK) {
        add_segments(stage, w, seg);
        s = td_comm_allgather(comm, stage, even ? recv : (void *)padded, seg, TD_F32);
    }
    if (s == TD_OK && !even) memcpy(recv, padded, count * sizeof(float));
    free(stage);
    return s;
}

td_status td_comm_reduce_scatter_tree(td_comm *comm, const void *send, void *recv, size_t count,
                                      td_dtype dtype) {
    TD__TRY(check(comm, dtype, "td_comm_reduce_scatter_tree"));
    int w = td_comm_size(comm);
    if (w == 1) {
        if (send != recv) memmove(recv, send, count * sizeof(float));
        return TD_OK;
    }
    if (w == 2) return td_comm_reduce_scatter(comm, send, recv, count, TD_F32, TD_OP_SUM);
    float *stage = malloc(count * (size_t)w * sizeof(float));
    if (!stage) return td__fail(TD_ENOMEM, "td_comm_reduce_scatter_tree: out of memory");
    td_status s = td_comm_alltoall(comm, send, stage, count, TD_F32);
    if (s == TD_OK) {
        add_segments(stage, w, count);
        memcpy(recv, stage, count * sizeof(float));
    }
    free(stage);
    return s;
}
