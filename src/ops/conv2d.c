/* The 2-d convolution op (F.conv2d, groups = 1): its checks and PyTorch's output size.
 * Kernels: cpu/conv2d.c, cuda/conv2d.cu. */
#include "ops/op.h"

static td_status conv_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    const td_conv2d_params *q = &n->attr.conv;
    if (!w) return td__fail(TD_EINVAL, "conv2d: the weight is NULL");
    if (!td__is_float(x->dtype) || x->shape.ndim != 4)
        return td__fail(TD_ESHAPE, "conv2d: input '%s' must be (N, C, H, W) of a float dtype",
                        x->name);
    if (w->dtype != x->dtype || (b && b->dtype != x->dtype))
        return td__fail(TD_EDTYPE, "conv2d: '%s' is %s, its weight %s and bias %s: one dtype",
                        x->name, td_dtype_name(x->dtype), td_dtype_name(w->dtype),
                        b ? td_dtype_name(b->dtype) : "none");
    if (w->shape.ndim != 4 || w->shape.dim[1] != x->shape.dim[1])
        return td__fail(TD_ESHAPE, "conv2d: weight '%s' must be (OC, %lld, KH, KW)", w->name,
                        (long long)x->shape.dim[1]);
    if (b && (b->shape.ndim != 1 || b->shape.dim[0] != w->shape.dim[0]))
        return td__fail(TD_ESHAPE, "conv2d: bias '%s' must be (%lld)", b->name,
                        (long long)w->shape.dim[0]);
    for (int i = 0; i < 2; i++)
        if (q->stride[i] < 1 || q->dilation[i] < 1 || q->padding[i] < 0)
            return td__fail(TD_EINVAL,
                            "conv2d: stride %d, dilation %d, padding %d (need >= 1, >= 1, >= 0)",
                            q->stride[i], q->dilation[i], q->padding[i]);
    int64_t out[2];
    for (int i = 0; i < 2; i++) {
        int64_t span = (w->shape.dim[2 + i] - 1) * q->dilation[i] + 1;
        if (x->shape.dim[2 + i] + 2 * q->padding[i] < span)
            return td__fail(TD_ESHAPE, "conv2d: kernel span %lld larger than padded input %lld",
                            (long long)span, (long long)(x->shape.dim[2 + i] + 2 * q->padding[i]));
        out[i] = (x->shape.dim[2 + i] + 2 * q->padding[i] - span) / q->stride[i] + 1;
    }
    *shape = td_shape_4d(x->shape.dim[0], w->shape.dim[0], out[0], out[1]);
    *dtype = x->dtype;
    return TD_OK;
}

const td__op td__op_conv2d = {
    .name = "conv2d",
    .id = TD__OP_CONV2D,
    .accepts_blocked = 1,
    .infer = conv_infer,
    .precision = TD__PREC_LOW,
};
