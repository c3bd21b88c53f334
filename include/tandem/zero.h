/* td_zero: sharded data parallelism, DeepSpeed's ZeRO stages 1-3 (stage 3 is PyTorch FSDP's full
 * shard), for any trainer that can say "the gradient of parameter i is final", as td_ddp.
 *
 * Each rank keeps one shard of the training state instead of a whole copy:
 *  - stage 1: the optimizer state. Gradients are all-reduced as DDP does; each rank steps the
 *    optimizer over its shard only, and the parameters are all-gathered before the next forward.
 *  - stage 2: also the gradients: each unit's gradients are reduce-scattered into the rank's
 *    shard while backward goes on. The units' whole gradients are written into a ring of about
 *    two units (or ddp.bucket_bytes), each unit's slot reused once its reduce-scatter is done.
 *  - stage 3: also the parameters: a unit's parameters are all-gathered just before its forward
 *    and again before its backward and freed after each, the next unit's gather prefetched.
 * A unit is a run of consecutive parameters (a layer, or layers the caller groups); its
 * parameters of one dtype form a flat buffer, padded to a multiple of the world size (padding
 * the caller never sees), of which rank r holds the r-th chunk.
 *
 * Parameters keep their addresses: td_zero_create moves every parameter into memory of its own
 * and re-points params[i].data (and grad) there once, and a freed gathered copy gives its pages
 * up while its address stays reserved. So a graph, an evaluation graph sharing its parameters,
 * or a hand-written trainer reads params[i].data as always; at stage 3 only while the
 * parameter's unit is gathered (the hooks below see to it, or td_zero_full_params). At stages 2
 * and 3 a parameter's gradient lives in its unit's slot of the ring from the unit's
 * TD_PARAM_BEFORE_BACKWARD call to td_zero_finish_backward: read params[i].grad after that call.
 *
 * One training step (the same as td_ddp's, with the optimizer over the rank's shards):
 *     td_zero_parameters(zero, &shards, &n);      // once: td_optim_create_sgd(&opt, shards, n, ..)
 *     td_zero_prepare_forward(zero);              // stage 1, 2: all-gathers the last step's shards
 *     forward                                     // stage 3: td_zero_param_use_hook gathers units
 *     backward, calling td_zero_grad_ready(zero, i) the moment gradient i is final
 *         (and at stages 2 and 3 td_zero_param_use around each layer's reads, as in forward);
 *     td_zero_finish_backward(zero);              // the shards' gradients are the rank average
 *     td_optim_step(opt);                         // steps this rank's shards
 * A graph drives it with td_graph_set_grad_ready_hook(g, td_zero_grad_ready_hook, zero) and
 * td_graph_set_param_use_hook(g, td_zero_param_use_hook, zero) (stage 3 needs it; stage 2
 * without it writes each unit's whole gradient in memory of its own, whose pages go back after
 * each reduction and fault in again: correct, and slower).
 *
 * Everything DDP offers that a sharded step can keep is taken from DDP: the ranks' agreement on
 * registrations, rank 0's parameters and buffers broadcast at creation, buffers broadcast each
 * iteration, unused-parameter errors, no_sync, half-width communication (comm_dtype), mixed
 * precision (bf16 or f16 parameters: their f32 master weights are the optimizer's, so sharded;
 * gathers and reduce-scatters travel in the parameters' dtype), and the deterministic mode: its
 * gradients are DDP's shard tree's, so the parameters are the same bits as deterministic DDP's
 * and so at any world size. The grad scaler and clipping work on the shards (td_zero_clip_grad_norm
 * takes the norm across them).
 *
 * Not thread-safe; drive it from one thread. It does not own the comm, the arrays or the
 * optimizer; the arrays must outlive it. Parameters live in host memory (a graph on a GPU is
 * refused with TD_EUNSUPPORTED). */
#ifndef TANDEM_ZERO_H
#define TANDEM_ZERO_H

#include "tandem/checkpoint.h"
#include "tandem/comm.h"
#include "tandem/core.h"
#include "tandem/ddp.h"
#include "tandem/optim.h"
#include "tandem/param.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An opaque sharded data-parallel group over one process group. */
typedef struct td_zero td_zero;

/* Options; fill with td_zero_default_params and change what you need. Every rank must pass the
 * same values (checked). */
typedef struct {
    int stage;                /* 1, 2 or 3 */
    const char *const *units; /* NULL: one unit per top-level module, the parameter names' part
                                 before the first '.' ("conv1", "layer2"); else n_units names at
                                 which units begin: the first parameter called so, or whose name
                                 starts with "<name>.", begins a unit that runs to the next one
                                 (FSDP's wrap policy over consecutive layers). td_sequential's
                                 layer names work when parameters carry them. */
    size_t n_units;
    int prefetch;      /* 1: stage 3 gathers the next unit while the current one computes */
    td_ddp_params ddp; /* the gradient side, as td_ddp takes it: average, comm_dtype,
                          find_unused_parameters, broadcast_buffers, trace, deterministic and
                          shards, and (stage 1) bucket sizes; at stages 2 and 3 bucket_bytes is
                          the gradient ring's size when two units need less; join is not
                          supported */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_zero_params;

/* Stage 2, a unit per top-level module, prefetching, td_ddp_default_params(). */
td_zero_params td_zero_default_params(void);

/* Bytes one rank holds, by what for; each now and at its peak since creation. */
typedef struct {
    size_t params;   /* parameters kept between steps: all of them at stages 1 and 2, the
                        rank's shards at stage 3 */
    size_t grads;    /* gradients kept between steps: whole at stage 1 (DDP's buckets) and in
                        deterministic mode (DDP's shard tree, counted as one copy), the rank's
                        shards at stages 2 and 3 */
    size_t optim;    /* the optimizer's state (td_optim_state), when an optimizer is given */
    size_t gathered; /* stage 3: whole copies of units' parameters gathered for use */
    size_t reducing; /* stages 2 and 3: whole gradients of units being reduced, and their
                        half-width copies, outside the gradient ring */
    size_t cached;   /* stages 2 and 3: memory kept for reuse from step to step instead of
                        being faulted in again: the gradient ring where backward writes the
                        units' whole gradients, and at stage 3 the pages of freed gathered
                        copies waiting for the next gather */
    size_t total;    /* the sum */
} td_zero_bytes;

typedef struct {
    td_zero_bytes now, peak; /* peak.total is the largest sum, not the sum of the peaks */
} td_zero_memory;

/* Collective over `comm`: checks that every rank registered the same parameters and options (as
 * td_ddp_create does, TD_ESHAPE / TD_EINVAL naming the difference on every rank), broadcasts rank
 * 0's parameters and buffers, lays the units out and moves parameters and gradients into the
 * group's memory (params[i].data and .grad are re-pointed, values copied). At stage 3 the rank
 * then keeps only its shards. An unknown unit name is TD_ENOTFOUND naming it. */
td_status td_zero_create(td_zero **out, td_comm *comm, td_param *params, size_t n_params,
                         td_param *buffers, size_t n_buffers, const td_zero_params *p);

/* Points params[i].data and .grad back at the memory they had at creation and copies the
 * current values there where this rank holds them whole (stages 1 and 2 once gathered, stage 3
 * under td_zero_full_params), then frees the group's memory. Not collective. */
void td_zero_destroy(td_zero *zero);

/* The rank's shards as a parameter array for an optimizer: one entry per parameter that has
 * elements in this rank's chunk, named as the parameter, 1-D, with data and grad pointing at the
 * rank's part. Owned by the group; grads are refreshed by td_zero_finish_backward. */
td_status td_zero_parameters(td_zero *zero, td_param **shards, size_t *n);

/* Starts an iteration: at stages 1 and 2 all-gathers the shards stepped since the last gather;
 * broadcasts buffers as DDP does. Collective. */
td_status td_zero_prepare_forward(td_zero *zero);

/* Zeroes where the next backward's gradients go. A trainer that adds into params[i].grad calls it
 * before each backward, as with td_ddp (after a synchronised step the ring holds what the last
 * backward wrote); a graph after td_graph_zero_grad writes its gradients instead. */
void td_zero_zero_grad(td_zero *zero);

/* Parameter i's gradient is final in this backward (as td_ddp_grad_ready). */
td_status td_zero_grad_ready(td_zero *zero, size_t param_index);

/* td_zero_grad_ready in the shape of the graph's td_grad_ready_fn (ctx is the td_zero); an error
 * is kept and returned by td_zero_finish_backward. */
void td_zero_grad_ready_hook(size_t param_index, void *zero);

/* Parameter i's values are about to be read, or were read for the last time, in a forward or
 * backward (param.h's td_param_use). At stage 3, before a read the parameter's unit is gathered
 * (waiting for a prefetch in flight) and the next unit's gather starts; once every parameter of
 * a unit is past its last read of the sweep, the unit is freed. Collective in the order the
 * calls come: every rank makes the same calls in the same order (a graph does). At stages 2 and
 * 3, TD_PARAM_BEFORE_BACKWARD of a synchronised backward also points the unit's gradients at
 * its slot of the ring (waiting, if need be, for the reduce-scatter of the unit that used the
 * slot before). Nothing else at stages 1 and 2. */
td_status td_zero_param_use(td_zero *zero, size_t param_index, td_param_use use);

/* td_zero_param_use in the shape of td_param_use_fn (ctx is the td_zero). */
td_status td_zero_param_use_hook(size_t param_index, td_param_use use, void *zero);

/* Ends the backward as td_ddp_finish_backward does; the rank's shards (td_zero_parameters) then
 * hold the average (or sum) over ranks of their gradients. */
td_status td_zero_finish_backward(td_zero *zero);

/* sync = 0 is no_sync: backwards accumulate locally until a backward with sync = 1. At stages 2
 * and 3 the units' whole gradients stay in memory meanwhile (as FSDP's no_sync keeps them). */
td_status td_zero_set_sync(td_zero *zero, int sync);

/* This rank's loss of the step under way, times the weight its backward uses: set it after the
 * forward and before td_zero_finish_backward, before or after the backward (td_ddp_set_loss). */
void td_zero_set_loss(td_zero *zero, float loss);

/* After td_zero_finish_backward: the loss of the step just taken reduced over ranks (td_ddp_loss).
 */
float td_zero_loss(const td_zero *zero);

/* Deterministic mode: this rank's shards of every global batch (td_ddp_shards). */
void td_zero_shards(const td_zero *zero, size_t *first, size_t *count);

/* torch.nn.utils.clip_grad_norm_ over the whole model's gradients, taken from the rank's shards:
 * the L2 norm of every gradient together (squares summed in double per shard, then over ranks);
 * when it exceeds max_norm the shards' gradients are scaled by max_norm / (norm + 1e-6). In
 * deterministic mode the shards' gradients are first gathered and the norm is taken as
 * td_clip_grad_norm takes it, so it is the same bits at any world size. Collective. */
td_status td_zero_clip_grad_norm(td_zero *zero, double max_norm, double *total_norm);

/* hold = 1: every parameter whole on every rank until hold = 0 (FSDP's summon_full_params):
 * stages 1 and 2 gather what the last step changed, stage 3 gathers every unit and keeps it
 * (for an evaluation whose ranks run different numbers of batches, or reading the model).
 * hold = 0 frees stage 3's copies again. Collective. */
td_status td_zero_full_params(td_zero *zero, int hold);

/* This rank's bytes; optim (may be NULL) is the optimizer over td_zero_parameters. */
td_zero_memory td_zero_memory_stats(const td_zero *zero, const td_optim *optim);

/* The stage, the number of units and of flat buffers (for logs). */
void td_zero_layout(const td_zero *zero, int *stage, size_t *n_units, size_t *n_flats);

/* ---- checkpoints (docs/zero.md) --------------------------------------------------------- */

/* Writes a sharded checkpoint at path, collectively: every rank writes its part of every
 * parameter and of its optimizer's state ("optim.<name>.<state>", "optim.step"), rank 0 also the
 * `extra` tensors (buffers, the grad scaler's state: the same on every rank), each into a file
 * of its own beside path, and rank 0 then writes path itself, the index naming those files and
 * holding `meta`, atomically: until then path is the previous checkpoint, whole, whatever dies.
 * The files of the previous checkpoint are removed after. Its tensors are those a td_ddp run
 * saves with td_checkpoint_save (the same names, shapes and dtypes), so either resumes the
 * other, at any world size. */
td_status td_zero_save(td_zero *zero, const td_optim *optim, const char *path,
                       const td_param *extra, size_t n_extra, const td_checkpoint_meta *meta,
                       size_t n_meta);

/* Reads a checkpoint, sharded at any world size or a single file (td_checkpoint_save's, from
 * td_ddp or tandem-consolidate), into this group: every rank reads its own parts of the
 * parameters and of the optimizer's state, resharded to this world size, and the `extra`
 * tensors whole. Collective (a rank that fails makes every rank fail). */
td_status td_zero_load(td_zero *zero, td_optim *optim, const char *path, td_param *extra,
                       size_t n_extra);

#ifdef __cplusplus
}
#endif
#endif
