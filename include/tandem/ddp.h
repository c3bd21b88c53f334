/* td_ddp: DistributedDataParallel's reducer, for any trainer that can say "the gradient of
 * parameter i is final".
 *
 * At creation DDP checks that every rank registered the same parameters (names, dtypes,
 * shapes), broadcasts rank 0's parameters and buffers, and moves every gradient into flat
 * buckets it owns: params[i].grad is re-pointed into bucket memory (existing values are
 * copied in). The params array is the one place that says where gradients live: the owner of
 * the array (a hand-written trainer or the graph engine) reads and writes gradients through
 * params[i].grad, re-reading the pointer after each synchronised step, because the buckets
 * are rebuilt once, after the first synchronised step, in the order gradients actually became
 * ready. A pointer cached across a move does not go unnoticed: the memory a gradient left
 * holds a signalling NaN until the next synchronised backward ends, which fails with TD_ESTATE
 * naming the parameter if anything wrote there (the first move leaves NaN in the trainer's own
 * gradient buffers until td_ddp_destroy copies the gradients back).
 *
 * One training step:
 *     td_ddp_prepare_forward(ddp);               // buffers from rank 0, new iteration
 *     forward; zero grads (td_ddp_zero_grad) when not accumulating;
 *     backward, accumulating (+=) into params[i].grad and calling td_ddp_grad_ready(ddp, i)
 *         the moment parameter i's gradient is final;
 *     td_ddp_finish_backward(ddp);               // grads now averaged over ranks
 *     optimizer step.
 * A bucket whose parameters are all ready is all-reduced on the comm's progress thread while
 * backward goes on. Buckets are launched in bucket order on every rank, whatever order the
 * gradients arrive in, so ranks always issue the same collectives.
 *
 * Not thread-safe: call every td_ddp function from one thread (the one running backward).
 * It does not own the comm, the params/buffers arrays or their data; the arrays must outlive
 * the td_ddp. Trainable parameters are f32, bf16 or f16 (mixed precision's O2; a bucket holds
 * one dtype and its rank average keeps it, summed in f32); buffers may be of any dtype. */
#ifndef TANDEM_DDP_H
#define TANDEM_DDP_H

#include "tandem/comm.h"
#include "tandem/core.h"
#include "tandem/param.h"
#include "tandem/trace.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An opaque reducer over one process group. */
typedef struct td_ddp td_ddp;

/* Options; fill with td_ddp_default_params and change what you need. */
typedef struct {
    size_t first_bucket_bytes;  /* 1 MiB: the first bucket is small so communication starts
                                   early (never larger than bucket_bytes) */
    size_t bucket_bytes;        /* 25 MiB: the cap of every later bucket */
    int average;                /* 1: gradients are averaged over ranks; 0: summed */
    int find_unused_parameters; /* 0: a parameter without grad_ready is TD_EUNUSED; 1: zero grad */
    int broadcast_buffers;      /* 1: td_ddp_prepare_forward broadcasts buffers from rank 0 */
    int rebuild_buckets;        /* 1: rebuild once from the observed ready order */
    td_trace *trace;            /* NULL, or where each bucket's all-reduce span is recorded */
    td_dtype comm_dtype;        /* TD_F32: f32 gradients travel as they are; TD_BF16 or TD_F16:
                                   they travel in half width and are added in f32 inside the
                                   reduction (PyTorch's bf16/fp16_compress_hook, Horovod's fp16
                                   compression): half the bytes, bf16/f16 rounding. bf16 and f16
                                   gradients always travel in their own dtype. */
    int deterministic;          /* 1: the same bits at any world size (docs/reproducibility.md):
                                   the global batch is `shards` fixed shards, this rank's
                                   td_ddp_shards of them run one by one (prepare_forward, forward,
                                   backward, finish_backward each), and their gradients, buffers
                                   and losses are summed in one fixed pairwise tree over all
                                   shards whichever rank holds them. f32 parameters, buffers and
                                   comm_dtype; no no_sync, no join, no rebuild */
    size_t shards;              /* 8: S, for deterministic mode; S / world_size must be a power
                                   of two (1, 2, 4, ...) unless the world size is 1 */
    int join;                   /* 1: uneven inputs (PyTorch's Join): ranks may run out of
                                   batches at different steps (td_ddp_join); each synchronised step
                                   averages over the ranks that contributed, weighted by their
                                   td_ddp_set_samples. Costs one small all-gather per step */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[68];
} td_ddp_params;

/* Counters for tests, logs and benchmarks. */
typedef struct {
    size_t n_buckets;       /* current number of buckets */
    size_t rebuilds;        /* 0 before the first synchronised step, then 1 */
    uint64_t sync_steps;    /* synchronised backwards finished */
    uint64_t buckets_early; /* buckets launched from td_ddp_grad_ready (overlapping backward) */
} td_ddp_stats;

/* The defaults above (deterministic 0 with 8 shards, join 0). */
td_ddp_params td_ddp_default_params(void);

/* Collective over `comm`: checks registrations agree on every rank (TD_ESHAPE naming the
 * first differing parameter, the ranks and both shapes, on every rank), broadcasts rank 0's
 * parameters and buffers, and moves gradients into buckets. `p` may be NULL (defaults). */
td_status td_ddp_create(td_ddp **out, td_comm *comm, td_param *params, size_t n_params,
                        td_param *buffers, size_t n_buffers, const td_ddp_params *p);

/* Waits for in-flight all-reduces, points params[i].grad back at the buffers it had at
 * creation (with the current values; NULL if it had none) and frees the reducer. */
void td_ddp_destroy(td_ddp *ddp);

/* Starts an iteration: broadcasts buffers from rank 0 (when broadcast_buffers and the
 * iteration is synchronised). Collective when it broadcasts. */
td_status td_ddp_prepare_forward(td_ddp *ddp);

/* Sets every gradient (all bucket memory) to zero; the usual zero_grad before a backward. */
void td_ddp_zero_grad(td_ddp *ddp);

/* Declares parameter `param_index` (registration order) final for this backward; launches
 * every bucket that became complete, in bucket order. */
td_status td_ddp_grad_ready(td_ddp *ddp, size_t param_index);

/* td_ddp_grad_ready in the shape of the graph's td_grad_ready_fn (ctx is the td_ddp): an
 * error is kept and returned by td_ddp_finish_backward. */
void td_ddp_grad_ready_hook(size_t param_index, void *ddp);

/* Ends the backward: launches the remaining buckets (unready parameters contribute zeros),
 * waits for them, and leaves the rank average (or sum) in params[i].grad. Returns TD_EUNUSED
 * naming the parameters that got no grad_ready unless find_unused_parameters; every rank
 * still runs the same collectives, so none hangs. Peer errors come back as TD_EPEER etc.
 * Called again without a backward in between (no td_ddp_prepare_forward or grad_ready since
 * the last call) it is TD_ESTATE and leaves the gradients alone. */
td_status td_ddp_finish_backward(td_ddp *ddp);

/* sync = 0 is PyTorch's no_sync: backwards only accumulate locally (no communication, no
 * unused check) until a backward with sync = 1 reduces the sum. Not allowed mid-backward. */
td_status td_ddp_set_sync(td_ddp *ddp, int sync);

/* This rank's loss of the step under way (of the shard, in deterministic mode), times the weight
 * its backward uses: set it after the forward that computed it and before td_ddp_finish_backward,
 * before or after the backward. td_ddp_finish_backward reduces it in f32 as the gradients are
 * reduced (their average over ranks, or over shards in the fixed tree). */
void td_ddp_set_loss(td_ddp *ddp, float loss);

/* After td_ddp_finish_backward: the loss of the step just taken reduced over ranks, for a
 * per-rank mean loss the global batch's mean (0 before the first step, or if none was set). */
float td_ddp_loss(const td_ddp *ddp);

/* Deterministic mode: this rank's shards of every global batch, shards [*first, *first + *count)
 * (each of global_batch / shards samples, in order). Default mode: 0 and 1. */
void td_ddp_shards(const td_ddp *ddp, size_t *first, size_t *count);

/* Join mode: the samples this rank's next synchronised backward averages over (default 1, which
 * counts every contributing rank alike, PyTorch's rule); the step's gradients are then the
 * samples-weighted average over ranks: the mean over every sample that took part. */
td_status td_ddp_set_samples(td_ddp *ddp, double samples);

/* Join mode, on a rank that has no batches left: shadows one synchronised step of the others
 * (contributing zeros with weight 0, running their collectives) and leaves their average in
 * params[i].grad, so stepping the optimizer on it keeps this replica equal to theirs. Call it in
 * a loop until *done: once every rank has joined, the last rank to have had data broadcasts its
 * parameters and buffers to all, and *done is 1 on every rank. Collective. */
td_status td_ddp_join(td_ddp *ddp, int *done);

/* Current counters. */
td_ddp_stats td_ddp_get_stats(const td_ddp *ddp);

/* Writes up to `max` parameter indices of bucket `bucket` in layout order into `indices`;
 * returns how many parameters the bucket holds (0 for a bucket index out of range). */
size_t td_ddp_bucket_params(const td_ddp *ddp, size_t bucket, size_t *indices, size_t max);

#ifdef __cplusplus
}
#endif
#endif
