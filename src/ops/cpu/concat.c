/* The channel concatenation node: (N, C_i, ...) inputs of one dtype side by side along dim 1,
 * plain layouts; backward slices dy back out to each input. */
#include <string.h>

#include "ops/cpu/onednn.h"

/* Bytes per sample of input i (C_i times the trailing dims). */
static size_t chunk(const td_tensor *t) {
    return (size_t)(td_shape_numel(&t->shape) / t->shape.dim[0]) * td_dtype_size(t->dtype);
}

static td_status concat_forward(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    unsigned char *y = n->out->data;
    size_t row = chunk(n->out);
    for (int64_t s = 0; s < n->out->shape.dim[0]; s++) {
        size_t off = 0;
        for (int i = 0; i < n->nin; i++) {
            size_t c = chunk(n->in[i]);
            memcpy(y + s * row + off, (const unsigned char *)n->in[i]->data + s * c, c);
            off += c;
        }
    }
    return TD_OK;
}

static td_status concat_backward(td__op_ctx *ctx, td__node *n) {
    const unsigned char *dy = n->out->grad;
    size_t row = chunk(n->out), off = 0;
    for (int i = 0; i < n->nin; i++) {
        td_tensor *x = n->in[i];
        size_t c = chunk(x);
        if (x->requires_grad) {
            unsigned char *dx = td__grad_begin(ctx, x, 0);
            for (int64_t s = 0; s < n->out->shape.dim[0]; s++)
                memcpy(dx + s * c, dy + s * row + off, c);
            td__grad_end(ctx, x);
        }
        off += c;
    }
    return TD_OK;
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_concat = {
    .forward = concat_forward,
    .backward = concat_backward,
};
