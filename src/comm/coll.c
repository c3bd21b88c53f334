/* The words of the collectives: their names, their descriptions in error messages ("allreduce
 * #3 (f32, 1024 elements, sum)"), and which of them reduce or have a root. Shared by the
 * generic layer and every backend; no communication here. */
#include <stdio.h>

#include "comm/comm_impl.h"

static const char *const coll_names[TD__COLL_COUNT] = {
    "allreduce", "reduce",         "broadcast", "allgather", "gather",
    "scatter",   "reduce_scatter", "alltoall",  "barrier",
};

const char *td__coll_name(td__coll_kind kind) {
    return (unsigned)kind < TD__COLL_COUNT ? coll_names[kind] : "unknown collective";
}

const char *td_reduce_op_name(td_reduce_op op) {
    static const char *const names[TD_OP_COUNT] = {"sum", "prod", "min", "max", "avg"};
    return (unsigned)op < TD_OP_COUNT ? names[op] : "invalid";
}

void td__coll_describe(char *out, size_t cap, td__coll_kind kind, uint64_t seq, td_dtype dtype,
                       size_t count, td_reduce_op op, int root) {
    const char *name = td__coll_name(kind);
    unsigned long long s = (unsigned long long)seq;
    switch (kind) {
    case TD__COLL_BARRIER:
        snprintf(out, cap, "%s #%llu", name, s);
        break;
    case TD__COLL_ALLREDUCE:
    case TD__COLL_REDUCE_SCATTER:
        snprintf(out, cap, "%s #%llu (%s, %zu elements, %s)", name, s, td_dtype_name(dtype), count,
                 td_reduce_op_name(op));
        break;
    case TD__COLL_REDUCE:
        snprintf(out, cap, "%s #%llu (%s, %zu elements, %s, root %d)", name, s,
                 td_dtype_name(dtype), count, td_reduce_op_name(op), root);
        break;
    case TD__COLL_BROADCAST:
    case TD__COLL_GATHER:
    case TD__COLL_SCATTER:
        snprintf(out, cap, "%s #%llu (%s, %zu elements, root %d)", name, s, td_dtype_name(dtype),
                 count, root);
        break;
    default:
        snprintf(out, cap, "%s #%llu (%s, %zu elements)", name, s, td_dtype_name(dtype), count);
    }
}

int td__coll_is_reduction(td__coll_kind kind) {
    return kind == TD__COLL_ALLREDUCE || kind == TD__COLL_REDUCE || kind == TD__COLL_REDUCE_SCATTER;
}

int td__coll_is_rooted(td__coll_kind kind) {
    return kind == TD__COLL_REDUCE || kind == TD__COLL_BROADCAST || kind == TD__COLL_GATHER ||
           kind == TD__COLL_SCATTER;
}

void td__coll_describe_call(char *out, size_t cap, const td__coll *c) {
    const td__coll *s = td__coll_sig(c);
    td__coll_describe(out, cap, s->kind, s->seq, s->dtype, s->count, s->op, s->root);
}

td_status td__coll_step(const td__backend_ops *ops, void *ctx, const td__coll *c,
                        td__coll_kind kind, const void *send, void *recv, size_t count,
                        td_dtype dtype, td_reduce_op op, int root, double timeout_s) {
    td__coll sub = {.kind = kind,
                    .seq = c->seq,
                    .send = send,
                    .recv = recv,
                    .count = count,
                    .dtype = dtype,
                    .op = op,
                    .root = root,
                    .error = c->error,
                    .error_msg = c->error_msg,
                    .error_rank = c->error_rank,
                    .sig = td__coll_sig(c),
                    .device = {TD_DEVICE_CPU, 0}};
    return ops->collective(ctx, &sub, timeout_s);
}
