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

static td_status concat_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x0 = n->in[0];
    td_shape s = x0->shape;
    if (s.ndim < 2 || !td__is_float(x0->dtype))
        return td__fail(TD_ESHAPE, "concat: '%s' must be a float tensor with >= 2 dims", x0->name);
    for (int i = 1; i < n->nin; i++) {
        const td_tensor *x = n->in[i];
        if (!x) return td__fail(TD_EINVAL, "concat: input %d is NULL", i);
        int ok = x->shape.ndim == s.ndim && x->dtype == x0->dtype;
        for (int d = 0; ok && d < s.ndim; d++)
            if (d != 1 && x->shape.dim[d] != s.dim[d]) ok = 0;
        if (!ok)
            return td__fail(TD_ESHAPE, "concat: '%s' does not match '%s' outside dim 1", x->name,
                            x0->name);
        s.dim[1] += x->shape.dim[1];
    }
    *shape = s;
    *dtype = x0->dtype;
    return TD_OK;
}

const td__op td__op_concat = {
    .name = "concat",
    .id = TD__OP_CONCAT,
    .infer = concat_infer,
};

/* The CPU backend's kernels. */
const td__kernels td__cpu_concat = {
    .forward = concat_forward,
    .backward = concat_backward,
};
