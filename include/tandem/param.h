/* td_param: a named flat buffer as optimizers, checkpoints and DDP see it.
 *
 * The graph engine hands out its parameters and buffers as an array of these; a
 * hand-written trainer can build the array itself. Whoever owns the array owns the
 * memory the pointers refer to; consumers read `grad` afresh on every use, because DDP
 * moves gradients into its bucket memory after construction. */
#ifndef TANDEM_PARAM_H
#define TANDEM_PARAM_H

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How a tensor-parallel rank's entry relates to the whole tensor of its name (Megatron's
 * partition_dim and partition_stride; DTensor's Shard and Replicate): zeroed, it is the whole
 * tensor. A slice holds, of dimension `dim` of the whole, `parts` equal blocks (a fused q, k, v
 * projection: 3) each cut into `ranks` equal pieces, piece `rank` of each block, in block order;
 * so the whole tensor is every rank's slice put back in place (td_tp_gather). */
typedef struct {
    int ranks; /* 0: the whole tensor; n >= 1: one of the slices of n ranks */
    int rank;  /* which slice, 0 .. ranks-1 */
    int dim;   /* the dimension cut */
    int parts; /* blocks along dim, each cut n ways (0 or 1: one) */
} td_param_split;

/* Called by whoever writes a parameter's data (an optimizer step, block by block in increasing
 * order; a checkpoint load, td_tensor_write: once, the whole): elements [begin, end) of `data`
 * hold their new values, and so do those before begin since the call with begin 0. A graph
 * lays out its copies of the weight in its kernels' layouts there, while the values are in
 * cache. */
typedef void (*td_param_written_fn)(void *ctx, const void *data, size_t begin, size_t end);

/* One parameter (grad != NULL) or buffer / plain tensor (grad == NULL). */
typedef struct {
    const char *name; /* unique and stable: "conv1.weight" */
    void *data;       /* (count) elements of dtype */
    void *grad;       /* (count) elements of dtype, or NULL */
    size_t count;     /* product of shape */
    td_dtype dtype;   /* TD_F32, or TD_BF16 / TD_F16 under mixed precision */
    int ndim;         /* 0..TD_MAX_DIMS */
    int64_t shape[TD_MAX_DIMS];
    td_device device;      /* where data and grad live: the CPU (zeroed) unless a graph on a GPU
                              handed the entry out */
    td_dtype master_dtype; /* what an optimizer updates a bf16 / f16 parameter in: TD_F32 (the
                              zero value) through f32 master weights it keeps (apex's O2), or
                              the parameter's own dtype, in place with no copy and its
                              optimizer state in that dtype too (apex's O3). f32 parameters:
                              TD_F32 */
    td_param_split split;  /* a tensor-parallel model's slice of the whole tensor, or zeroed:
                              the whole (optimizer state takes its parameter's) */
    int shard_sum; /* 1: its producer sums a step's shards itself (td_graph_set_shard): grad is
                      written and reported ready once, at the step's last shard, as the sum
                      of every shard's gradient in deterministic mode's pairwise tree; 0: once
                      per backward */
    float shard_sum_scale;       /* what a shard_sum gradient's producer may multiply the sum
                                    by as it writes it (0: 1), set by the consumer that would
                                    scale it next (deterministic DDP, on one rank) ... */
    int shard_sum_scaled;        /* ... and 1 where the producer does (a graph's linear
                                    layers): then no pass of its own reads the sum again */
    td_param_written_fn written; /* NULL, or what a writer of data calls (a graph's, for the
                                    weights its blocked linear layers keep copies of) */
    void *written_ctx;           /* written's first argument */
} td_param;

/* The points of a sweep at which a parameter's values are about to be read, or were read for
 * the last time: a sharded strategy (ZeRO stage 3, tandem/zero.h) gathers a parameter's values
 * before its first read and frees them after the last. A sweep makes one AFTER call per
 * parameter, and a BEFORE call for each parameter it reads. */
typedef enum {
    TD_PARAM_BEFORE_FORWARD = 0,  /* before the first node that reads it runs forward */
    TD_PARAM_AFTER_FORWARD = 1,   /* after the last node that reads it ran forward (at the end of
                                     the forward for a parameter that no node reads) */
    TD_PARAM_BEFORE_BACKWARD = 2, /* before the first node that reads it runs backward */
    TD_PARAM_AFTER_BACKWARD = 3,  /* after the last node that reads it ran backward, its data
                                     gradient included (its gradient may have been final earlier:
                                     a layer reports its weight gradients before computing the
                                     gradient of its input from the weights) */
} td_param_use;

/* Called at those points with the parameter's index in its array; an error stops the sweep and
 * is what the sweep returns. */
typedef td_status (*td_param_use_fn)(size_t param_index, td_param_use use, void *ctx);

/* SHA-256 of the data bytes of params[0..n) in order, as 64 lower-case hex digits and a NUL:
 * two runs that trained to the same bits print the same digest, on any device (parameters on
 * a GPU are read through a host copy, which is what can fail). */
td_status td_params_sha256(const td_param *params, size_t n, char hex[65]);

#ifdef __cplusplus
}
#endif
#endif
