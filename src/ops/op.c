/* The helpers of the op contract (op.h) that every kernel uses (arena memory, gradient
 * accumulation through scratch) and the defaults of the op descriptors in tandem/ops.h. */
#include "ops/op.h"

#include <string.h>

#include "ops/backend.h"

void *td__op_alloc(td__op_ctx *ctx, size_t bytes) {
    void *p = td_arena_alloc(ctx->arena, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

void *td__grad_begin(td__op_ctx *ctx, td_tensor *t, int slot) {
    if (t->grad_zero) {
        t->grad_scratch = 0;
        return t->grad;
    }
    t->grad_scratch = slot + 1;
    return ctx->scratch[slot];
}

td_status td__grad_end(td__op_ctx *ctx, td_tensor *t) {
    td_status s = TD_OK;
    if (t->grad_scratch)
        s = ctx->backend->accumulate(ctx, t->grad, ctx->scratch[t->grad_scratch - 1], t->dtype,
                                     td__nelems(t));
    t->grad_scratch = 0;
    t->grad_zero = 0;
    return s;
}

td_conv2d_params td_conv2d_default_params(void) {
    td_conv2d_params p = {.stride = {1, 1}, .padding = {0, 0}, .dilation = {1, 1}};
    return p;
}

td_pool2d_params td_pool2d_default_params(void) {
    td_pool2d_params p = {.kernel = {2, 2}, .stride = {2, 2}, .padding = {0, 0}};
    return p;
}

td_batch_norm_params td_batch_norm_default_params(void) {
    td_batch_norm_params p = {.eps = 1e-5f, .momentum = 0.1f};
    return p;
}
