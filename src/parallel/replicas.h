/* One interface over the data-parallel strategies for a strategy that runs replicas of itself
 * (a pipeline's stages, each averaged over its replicas): td_ddp and td_zero answer the same
 * small table, chosen once at creation, so that the caller calls the table and never names
 * either. Not installed. */
#ifndef TANDEM_PARALLEL_REPLICAS_H
#define TANDEM_PARALLEL_REPLICAS_H

#include "tandem/ddp.h"
#include "tandem/graph.h"

typedef struct td__replicas_ops {
    /* Makes the group's data-parallel state over comm for the parameters and buffers of one
     * graph (zero_stage: ZeRO's stage, unused by DDP); collective over comm. */
    td_status (*create)(void **out, td_comm *comm, td_param *params, size_t n_params,
                        td_param *buffers, size_t n_buffers, const td_ddp_params *ddp,
                        int zero_stage);
    void (*destroy)(void *impl);
    /* Makes graph g call the group from its backward (and around each parameter's use, where the
     * group needs it); where the group moved the parameters, g reads them where `first` (the
     * graph they were registered from) does now. */
    td_status (*attach)(void *impl, td_graph *g, td_graph *first);
    /* The grad-ready hook attach installs (ctx: impl), for a caller that must see a gradient
     * before the group takes it. */
    td_grad_ready_fn grad_ready;
    /* no_sync off (1) or on (0) for the backwards that follow. */
    td_status (*set_sync)(void *impl, int sync);
    td_status (*prepare_forward)(void *impl);
    /* Ends a synchronised backward: the gradients are the replicas' average. */
    td_status (*finish_backward)(void *impl);
    /* What the optimizer steps: the graph's parameters, or this rank's shards of them. */
    td_status (*parameters)(void *impl, td_param **params, size_t *n);
    /* Readies the gradients for a norm taken over more ranks than the replicas' (the stages):
     * *shards NULL when every graph parameter's gradient is whole on every replica; else this
     * rank's shards of the averaged gradients, *n of them, whose squares the caller also sums
     * over the replicas' group. Collective where it gathers gradients. */
    td_status (*norm_grads)(void *impl, td_param **shards, size_t *n);
} td__replicas_ops;

extern const td__replicas_ops td__replicas_ddp;
extern const td__replicas_ops td__replicas_zero;

#endif
