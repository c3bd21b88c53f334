/* Multi-tensor kernels: one launch that walks a list of parameters (an optimizer's step, the
 * squared norm of all gradients, scaling them, unscaling them with an overflow check), as
 * apex's multi_tensor_apply and PyTorch's fused optimizers do, instead of a launch per
 * parameter. The list lives in host memory; the library copies it to the device with each call
 * into a scratch buffer the caller keeps. The arithmetic is the CPU's (src/optim), operation
 * for operation and rounded the same way, so a step on a GPU gives the CPU's bits from the
 * same gradients. C, shared with the CUDA side. Not installed. */
#ifndef TANDEM_MULTI_TENSOR_H
#define TANDEM_MULTI_TENSOR_H

#include <stdint.h>

typedef enum {
    TD__MT_SGD,         /* torch.optim.SGD's update (momentum, dampening, nesterov, weight decay) */
    TD__MT_ADAMW,       /* torch.optim.AdamW's update */
    TD__MT_MASTER_INIT, /* master = param, converted to f32 */
    TD__MT_SQUARES,     /* result = sum of grad^2 over every tensor, in double */
    TD__MT_SCALE,       /* grad *= factor */
    TD__MT_UNSCALE,     /* grad *= factor; result = 1 when any result is inf or NaN, else 0 */
} td__mt_op;

/* One tensor of the list; pointers are device memory, NULL where absent. */
typedef struct {
    void *param;         /* (count) in dtype, updated in place (through master when it has one) */
    void *grad;          /* (count) in dtype */
    void *buf1;          /* momentum_buffer or exp_avg (count) of state_dtype */
    void *buf2;          /* exp_avg_sq (count) of state_dtype */
    float *master;       /* f32 master weights of a bf16 or f16 parameter */
    uint64_t count;      /* elements */
    int32_t dtype;       /* td_dtype of param and grad */
    int32_t state_dtype; /* of buf1 and buf2: f32, or the parameter's own without a master (O3) */
    int32_t first;       /* SGD: the parameter's first step (the momentum buffer starts as d) */
    float neg_step;      /* AdamW: -(lr / (1 - beta1^step)), rounded from double as the CPU does */
    float bc2_sqrt;      /* AdamW: sqrt(1 - beta2^step) */
    uint64_t chunk0;     /* the tensor's first chunk of the launch (the library fills it) */
} td__mt_tensor;

/* The step's scalars, each already rounded to float from double as the CPU does. */
typedef struct {
    int32_t op; /* td__mt_op */
    int32_t nesterov;
    float neg_lr, weight_decay, momentum, keep;     /* SGD: -lr, wd, momentum, 1 - dampening */
    float decay, beta1, beta2, one_b1, one_b2, eps; /* AdamW: 1 - lr wd, betas, 1 - betas, eps */
    float factor;                                   /* SCALE and UNSCALE */
} td__mt_args;

/* Elements one block of a multi-tensor launch handles. */
#define TD__MT_CHUNK 4096

#endif
