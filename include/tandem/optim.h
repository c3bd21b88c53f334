/* Optimizers (SGD with momentum / nesterov / weight decay, AdamW), learning-rate schedules
 * and gradient-norm clipping over td_param arrays, with PyTorch's update rules.
 *
 * An optimizer keeps a pointer to the caller's td_param array and reads params[i].grad
 * afresh at every step (DDP moves gradients after construction); a parameter whose grad is
 * NULL at a step is skipped, as PyTorch skips p.grad is None. Parameters are f32, or bf16 /
 * f16 (mixed precision). A low-precision parameter whose master_dtype is f32 (O2) gets f32
 * master weights inside the optimizer, initialised from its values at creation, updated from
 * the gradient in f32 and copied back rounded after each step; they are part of
 * td_optim_state, so checkpoints keep them. One whose master_dtype is its own dtype (O3) is
 * updated in place, its optimizer state in that dtype too: each step computes in f32 and
 * rounds the parameter and the state once, so updates below half a unit in the last place of
 * the low dtype are lost, as in apex's O3. */
#ifndef TANDEM_OPTIM_H
#define TANDEM_OPTIM_H

#include <stdint.h>

#include "tandem/core.h"
#include "tandem/param.h"

#ifdef __cplusplus
extern "C" {
#endif

/* torch.optim.SGD's options (doubles, as PyTorch's Python floats are); fill with
 * td_sgd_default_params. */
typedef struct {
    double lr;
    double momentum; /* 0 disables the momentum buffer */
    double dampening;
    double weight_decay; /* L2 added to the gradient (coupled) */
    int nesterov;        /* needs momentum > 0 and dampening == 0 */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[68];
} td_sgd_params;

/* lr 0.01, no momentum, no dampening, no weight decay, no nesterov. */
td_sgd_params td_sgd_default_params(void);

/* torch.optim.AdamW's options; fill with td_adamw_default_params. */
typedef struct {
    double lr;
    double beta1, beta2;
    double eps;
    double weight_decay; /* decoupled: p *= 1 - lr * weight_decay */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_adamw_params;

/* PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2. */
td_adamw_params td_adamw_default_params(void);

/* An optimizer over a caller-owned td_param array. */
typedef struct td_optim td_optim;

/* SGD over params[0..n); the array must outlive the optimizer. */
td_status td_optim_create_sgd(td_optim **out, td_param *params, size_t n, const td_sgd_params *hp);

/* AdamW over params[0..n); the array must outlive the optimizer. */
td_status td_optim_create_adamw(td_optim **out, td_param *params, size_t n,
                                const td_adamw_params *hp);

/* Frees the optimizer and its state; NULL-safe. */
void td_optim_destroy(td_optim *optim);

/* One update of every parameter that has a gradient. */
td_status td_optim_step(td_optim *optim);

/* The parameter array the optimizer steps (the caller's, as given at creation). */
void td_optim_parameters(const td_optim *optim, td_param **params, size_t *n);

/* Sets every parameter's gradient to zero (parameters with grad == NULL are left alone). */
void td_optim_zero_grad(td_optim *optim);

/* The learning rate the next step uses (a schedule sets it before each step). */
void td_optim_set_lr(td_optim *optim, double lr);

/* The current learning rate. */
double td_optim_get_lr(const td_optim *optim);

/* The optimizer's state as named tensors owned by the optimizer, for checkpoints: "optim.step"
 * (i64, (n): steps each parameter has taken), per parameter "optim.<name>.momentum_buffer"
 * (SGD with momentum) or "optim.<name>.exp_avg" / "optim.<name>.exp_avg_sq" (AdamW), f32 or,
 * for a parameter without master weights, its own dtype, and "optim.<name>.master" for the
 * f32 master weights of a low-precision parameter that has them. Loading
 * saved values into these buffers resumes bit for bit. Valid until destroy. */
void td_optim_state(td_optim *optim, td_param **state, size_t *n_state);

/* ---- Learning-rate schedules -------------------------------------------------------- */

/* The main schedule after warm-up. */
typedef enum {
    TD_LR_CONSTANT = 0,
    TD_LR_STEP = 1, /* torch StepLR: base * gamma^(t / step_size) */
    TD_LR_COSINE =
        2, /* torch CosineAnnealingLR: eta_min + (base - eta_min)(1 + cos(pi t / T_max)) / 2 */
} td_lr_kind;

/* A schedule as a value: a linear warm-up (torch LinearLR from warmup_start_factor to 1 over
 * warmup_steps) followed by the main schedule, whose t counts from the end of warm-up (torch
 * SequentialLR with milestone warmup_steps). */
typedef struct {
    td_lr_kind kind;
    double base_lr;
    int64_t step_size;          /* TD_LR_STEP */
    double gamma;               /* TD_LR_STEP */
    int64_t t_max;              /* TD_LR_COSINE, > 0 */
    double eta_min;             /* TD_LR_COSINE */
    int64_t warmup_steps;       /* 0: no warm-up */
    double warmup_start_factor; /* in (0, 1] */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_lr_schedule_params;

/* A constant schedule at base_lr 0.01 (SGD's default) with no warm-up; set the other fields
 * as needed. */
td_lr_schedule_params td_lr_schedule_default_params(void);

/* The learning rate at step t (0-based: the value for the (t+1)-th scheduler position). */
double td_lr_schedule_at(const td_lr_schedule_params *schedule, int64_t t);

/* torch StepLR's value at epoch t. */
double td_lr_step(double base_lr, int64_t step_size, double gamma, int64_t t);

/* torch CosineAnnealingLR's closed form at epoch t (t may exceed T_max: it goes on as a cosine). */
double td_lr_cosine(double base_lr, double eta_min, int64_t t_max, int64_t t);

/* torch LinearLR's factor at step t, from start_factor to end_factor over total_steps. */
double td_lr_linear_factor(double start_factor, double end_factor, int64_t total_steps, int64_t t);

/* ---- Gradient clipping -------------------------------------------------------------- */

/* torch.nn.utils.clip_grad_norm_: the L2 norm of all gradients together; when it exceeds
 * max_norm every gradient is scaled by max_norm / (norm + 1e-6). Parameters with grad ==
 * NULL are skipped. total_norm may be NULL. */
td_status td_clip_grad_norm(td_param *params, size_t n, double max_norm, double *total_norm);

/* ---- Divergence ---------------------------------------------------------------------- */

/* The training loop's guard: TD_EINVAL naming `step` when its loss is NaN or infinite (the run
 * has diverged, and every step after would carry the NaN into the parameters), TD_OK
 * otherwise. A step a loss scaler skipped (td_grad_scaler_step) is not a divergence: check the
 * steps it took. */
td_status td_loss_check(double loss, int64_t step);

#ifdef __cplusplus
}
#endif
#endif
