/* Learning-rate schedules as pure functions of the step, with the closed forms of PyTorch's
 * StepLR, CosineAnnealingLR and LinearLR, and warm-up followed by a main schedule.
 *
 * Being pure functions, they need no state in a checkpoint beyond the step count. PyTorch's
 * chainable (recursive) forms agree with these up to float rounding. */
#include <math.h>

#include "tandem/optim.h"

td_lr_schedule_params td_lr_schedule_default_params(void) {
    td_lr_schedule_params s = {
        .kind = TD_LR_CONSTANT,
        .base_lr = 0.01,
        .step_size = 1,
        .gamma = 0.1,
        .t_max = 1,
        .eta_min = 0.0,
        .warmup_steps = 0,
        .warmup_start_factor = 1.0 / 3.0, /* torch LinearLR's default */
    };
    return s;
}

double td_lr_step(double base_lr, int64_t step_size, double gamma, int64_t t) {
    if (step_size <= 0 || t < 0) return base_lr;
    return base_lr * pow(gamma, (double)(t / step_size));
}

double td_lr_cosine(double base_lr, double eta_min, int64_t t_max, int64_t t) {
    if (t_max <= 0 || t < 0) return base_lr;
    const double pi = 3.14159265358979323846;
    return eta_min + (base_lr - eta_min) * (1.0 + cos(pi * (double)t / (double)t_max)) / 2.0;
}

double td_lr_linear_factor(double start_factor, double end_factor, int64_t total_steps, int64_t t) {
    if (total_steps <= 0 || t >= total_steps) return end_factor;
    if (t < 0) t = 0;
    return start_factor + (end_factor - start_factor) * (double)t / (double)total_steps;
}

double td_lr_schedule_at(const td_lr_schedule_params *s, int64_t t) {
    if (!s) return 0.0;
    if (s->warmup_steps > 0 && t < s->warmup_steps)
        return s->base_lr * td_lr_linear_factor(s->warmup_start_factor, 1.0, s->warmup_steps, t);
    int64_t u = t - (s->warmup_steps > 0 ? s->warmup_steps : 0);
    switch (s->kind) {
    case TD_LR_STEP:
        return td_lr_step(s->base_lr, s->step_size, s->gamma, u);
    case TD_LR_COSINE:
        return td_lr_cosine(s->base_lr, s->eta_min, s->t_max, u);
    default:
        return s->base_lr;
    }
}
