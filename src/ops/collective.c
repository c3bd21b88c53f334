/* The helpers of collective ops (collective.h): group size and rank, the compile-time
 * agreement check, and errors that name the node. */
#include "ops/collective.h"

#include <stdio.h>
#include <string.h>

int td__coll_size(const td__op_ctx *ctx) { return ctx->comm ? td_comm_size(ctx->comm) : 1; }

int td__coll_rank(const td__op_ctx *ctx) { return ctx->comm ? td_comm_rank(ctx->comm) : 0; }

/* What one rank says about a collective node; compared byte for byte. */
typedef struct {
    char what[32]; /* the builder's word: "all_gather" */
    int64_t grad, dtype, ndim, dim[TD_MAX_DIMS];
} coll_sig;

static void describe(const void *sig, const void *other, char *buf, size_t cap, void *ctx) {
    (void)other, (void)ctx;
    const coll_sig *s = sig;
    char dims[160];
    snprintf(buf, cap, "%s of %s %s%s", s->what, td_dtype_name((td_dtype)s->dtype),
             td__dims_str(dims, sizeof dims, s->ndim, s->dim), s->grad ? " with a backward" : "");
}

td_status td__coll_agree(td__op_ctx *ctx, const td__node *n, const td_shape *shape, td_dtype dtype,
                         int grad) {
    if (td__coll_size(ctx) == 1) return TD_OK;
    coll_sig mine;
    memset(&mine, 0, sizeof mine);
    snprintf(mine.what, sizeof mine.what, "%s", n->what);
    mine.grad = grad != 0;
    mine.dtype = dtype;
    mine.ndim = shape->ndim;
    for (int i = 0; i < shape->ndim; i++) mine.dim[i] = shape->dim[i];
    char what[160];
    snprintf(what, sizeof what, "%s (node %d, input '%s'): ranks build different graphs", n->what,
             n->index, n->in[0]->name);
    td_comm_agreement a = {.what = what,
                           .sig = &mine,
                           .bytes = sizeof mine,
                           .mismatch = TD_ESHAPE,
                           .describe = describe};
    td_status st = td_comm_agree(ctx->comm, &a);
    return st == TD_OK || st == TD_ESHAPE ? st : td__coll_fail(n, "compile", st);
}

void td__coll_tag(const td__op_ctx *ctx, const td__node *n, const char *what, const char *phase) {
    if (ctx->comm) td_comm_tag(ctx->comm, "%s node %d %s", what, n->index, phase);
}

td_status td__coll_fail(const td__node *n, const char *step, td_status status) {
    char group[768];
    snprintf(group, sizeof group, "%s", td_last_error());
    return td__fail(status, "%s %s (node %d, input '%s'): %s", n->what, step, n->index,
                    n->in[0]->name, group);
}
