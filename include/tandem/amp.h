/* Mixed precision's training side: a gradient scaler with torch.cuda.amp.GradScaler's rules.
 * The precision of the model itself is set on the graph (graph.h's td_amp_params, apex's
 * levels O0-O3); master weights live in the optimizer (optim.h). This header does loss
 * scaling: multiply the loss by a large scale so that small gradients survive f16 (and bf16
 * with f16-like ranges of values), divide the gradients by it before the step, and skip the
 * steps whose gradients overflowed.
 *
 * One step:
 *     td_graph_backward_from(g, loss, &(float){td_grad_scaler_scale(s)});
 *     td_ddp_finish_backward(ddp);                 // if data-parallel
 *     td_grad_scaler_unscale(s, optim);            // optional: before clipping
 *     td_clip_grad_norm(...);                      // optional
 *     td_grad_scaler_step(s, optim, &skipped);     // unscales if not done, steps unless inf/NaN
 *     td_grad_scaler_update(s);                    // halve after a skip, grow after clean steps
 * With a process group the ranks agree on every skip (one all-reduce of a flag per step), so
 * every rank skips the same steps and the replicas stay identical. */
#ifndef TANDEM_AMP_H
#define TANDEM_AMP_H

#include "tandem/comm.h"
#include "tandem/core.h"
#include "tandem/optim.h"
#include "tandem/param.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A loss scaler (opaque). */
typedef struct td_grad_scaler td_grad_scaler;

/* Options; fill with td_grad_scaler_default_params. */
typedef struct {
    double init_scale;       /* 65536 (2^16) */
    double growth_factor;    /* 2: times the scale after growth_interval clean steps */
    double backoff_factor;   /* 0.5: times the scale after a step with inf/NaN */
    int64_t growth_interval; /* 2000 */
    int dynamic;             /* 1; 0: a static scale that never changes (overflowing steps are
                                still skipped) */
    td_comm *comm;           /* NULL, or the group whose ranks agree on each skip (DDP's) */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_grad_scaler_params;

/* PyTorch's defaults: 2^16, x2 every 2000 clean steps, x0.5 on overflow, dynamic, no group. */
td_grad_scaler_params td_grad_scaler_default_params(void);

/* Creates a scaler; TD_EINVAL names a bad option. */
td_status td_grad_scaler_create(td_grad_scaler **out, const td_grad_scaler_params *params);

/* Frees the scaler; NULL-safe. */
void td_grad_scaler_destroy(td_grad_scaler *scaler);

/* The current scale: multiply the loss (the backward seed) by it. */
float td_grad_scaler_scale(const td_grad_scaler *scaler);

/* Divides the optimizer's gradients by the scale, once per step, and finds whether any is inf
 * or NaN (agreed by every rank of the group). Call it before clipping; step calls it itself
 * when it was not called. Collective over the group. */
td_status td_grad_scaler_unscale(td_grad_scaler *scaler, td_optim *optim);

/* Steps the optimizer unless this step's gradients had inf or NaN, in which case the
 * parameters are left untouched; *skipped (may be NULL) says which. */
td_status td_grad_scaler_step(td_grad_scaler *scaler, td_optim *optim, int *skipped);

/* Ends the step: after a skip the scale is multiplied by backoff_factor (and the clean count
 * restarts), after growth_interval clean steps in a row by growth_factor. */
void td_grad_scaler_update(td_grad_scaler *scaler);

/* Steps skipped since creation. */
int64_t td_grad_scaler_skipped(const td_grad_scaler *scaler);

/* The scaler's state as named tensors owned by it, for checkpoints: "amp.scale" (f64, the
 * scale) and "amp.growth_tracker" (i64, clean steps in a row). Loading saved values into them
 * resumes bit for bit. Valid until destroy. */
void td_grad_scaler_state(td_grad_scaler *scaler, td_param **state, size_t *n_state);

#ifdef __cplusplus
}
#endif
#endif
