/* What the collective ops (all_gather.c, all_reduce.c, cpu/sync_batch_norm.c) share: the size and
 * rank of the group the graph runs them on, the agreement check each runs when it compiles,
 * and errors that name the node as well as the group's own message. A collective op calls the
 * public comm API (tandem/comm.h) on ctx->comm from its forward and backward; every rank runs
 * the same graph, so every rank issues the same collectives in node order, and the group's
 * sequence check and timeouts turn a rank that does not into an error instead of a hang.
 * Not installed. */
#ifndef TANDEM_OPS_COLLECTIVE_H
#define TANDEM_OPS_COLLECTIVE_H

#include "ops/op.h"

/* Ranks of the graph's group (1 without one). */
int td__coll_size(const td__op_ctx *ctx);

/* This rank in the graph's group (0 without one). */
int td__coll_rank(const td__op_ctx *ctx);

/* Collective over the group (nothing to do in a group of one): every rank describes node n
 * by `shape`, `dtype` and whether a backward collective follows (`grad`), and all ranks must
 * agree, so that graphs that differ between ranks fail here, on every rank, with TD_ESHAPE
 * naming the node, both ranks and both descriptions, rather than mismatch later. */
td_status td__coll_agree(td__op_ctx *ctx, const td__node *n, const td_shape *shape, td_dtype dtype,
                         int grad);

/* Tags the group's next call from this thread for the flight recorder with what node n does
 * and when: "tp all-reduce node 57 fwd" (what = "tp all-reduce", phase = "fwd"). */
void td__coll_tag(const td__op_ctx *ctx, const td__node *n, const char *what, const char *phase);

/* Returns `status` (a failed comm call's) with a message that names node n and `step`
 * ("forward", "backward") before the group's own message. */
td_status td__coll_fail(const td__node *n, const char *step, td_status status);

#endif
