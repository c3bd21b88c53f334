/* The contract between td_ddp's front (ddp.c: creation, the ranks' agreement, the public API,
 * no_sync, uneven inputs) and a reducer: what turns the gradients of one synchronised backward
 * into their rank average. A reducer is a table of functions filled with designated
 * initializers; the front picks one at creation and from then on calls the table, never a
 * particular reducer. A reducer keeps its own state behind td_ddp.state and may use the front's
 * shared pieces in ddp_impl.h: the bucket layout, moving gradients into its memory, the buffer
 * broadcast, the error of the backward.
 *
 * The reducers: td__ddp_allreduce (ddp_allreduce.c), buckets all-reduced in bucket order on the
 * progress thread while backward runs; td__ddp_shard_tree (ddp_shard_tree.c), deterministic
 * mode's fixed pairwise tree over shards; and td__ddp_reduce_scatter (zero_reduce.c), ZeRO's
 * reduce-scatter of each unit's gradients into the rank's shard, which td_zero creates through
 * td__ddp_create_with. The hooks are the points of an iteration where any gradient reduction
 * acts, so that a device reducer (buckets in device memory, all-reduced on a communication
 * stream that the step waits for) is another table. Not installed. */
#ifndef TANDEM_PARALLEL_REDUCER_H
#define TANDEM_PARALLEL_REDUCER_H

#include "tandem/ddp.h"

typedef struct td__ddp_reducer {
    const char *name;
    /* Optional: checks of the options and parameters this reducer needs that involve no other
     * rank (TD_EINVAL, TD_EDTYPE naming the problem); run before the ranks agree, so that every
     * rank returns the error. */
    td_status (*check)(const td_ddp *d);
    /* Lays the gradients out in d->order (td__ddp_plan_buckets), moves params[i].grad into the
     * reducer's memory (td__ddp_move_gradient) and sets d->state; on failure leaves what it
     * made in d->state for destroy. Collective when it allocates group memory. */
    td_status (*create)(td_ddp *d);
    /* A synchronised iteration (in deterministic mode, a shard) begins: the buffers are made
     * the same on every rank, or put back to the step's start. Collective when it broadcasts. */
    td_status (*prepare)(td_ddp *d);
    /* Parameter i's gradient is final for this synchronised backward (the front has marked it
     * ready); may launch communication. Errors are kept with td__ddp_note_error. */
    void (*grad_ready)(td_ddp *d, size_t i);
    /* Ends a synchronised backward: what is left is launched and waited for, and the result
     * is in params[i].grad, or an error (unused parameters, a failed peer) once every rank has
     * run the same collectives. */
    td_status (*finish)(td_ddp *d);
    /* Zeroes where the next backward's gradients go. */
    void (*zero_grad)(td_ddp *d);
    /* Optional: NULL allows no_sync; otherwise TD_EUNSUPPORTED saying why not. */
    td_status (*refuse_no_sync)(const td_ddp *d);
    /* Waits for the communication still in flight, ignoring its errors (before destroy copies
     * the gradients back). */
    void (*wait)(td_ddp *d);
    /* Frees d->state and the gradient memory it holds. */
    void (*destroy)(td_ddp *d);
} td__ddp_reducer;

extern const td__ddp_reducer td__ddp_allreduce;
extern const td__ddp_reducer td__ddp_shard_tree;
extern const td__ddp_reducer td__ddp_reduce_scatter; /* ZeRO stages 2 and 3 (zero_reduce.c) */

#endif
