/* The max and average 2-d pooling ops (floor mode): their checks and output size. Kernels:
 * cpu/pool2d.c, cuda/pool2d.cu. */
#include "ops/op.h"

static td_status pool_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    const td_pool2d_params *p = &n->attr.pool;
    if (!td__is_float(x->dtype) || x->shape.ndim != 4)
        return td__fail(TD_ESHAPE, "%s: input '%s' must be (N, C, H, W) of a float dtype", n->what,
                        x->name);
    int64_t out[2];
    for (int i = 0; i < 2; i++) {
        if (p->kernel[i] < 1 || p->stride[i] < 1 || p->padding[i] < 0 ||
            2 * p->padding[i] > p->kernel[i])
            return td__fail(TD_EINVAL,
                            "%s: kernel %d stride %d padding %d (padding must be <= kernel/2)",
                            n->what, p->kernel[i], p->stride[i], p->padding[i]);
        out[i] = (x->shape.dim[2 + i] + 2 * p->padding[i] - p->kernel[i]) / p->stride[i] + 1;
        if (out[i] < 1)
            return td__fail(TD_ESHAPE, "%s: kernel %d larger than padded input %lld", n->what,
                            p->kernel[i], (long long)(x->shape.dim[2 + i] + 2 * p->padding[i]));
    }
    *shape = td_shape_4d(x->shape.dim[0], x->shape.dim[1], out[0], out[1]);
    *dtype = x->dtype;
    return TD_OK;
}

const td__op td__op_pool2d = {
    .name = "pool2d",
    .id = TD__OP_POOL2D,
    .propagates_layout = 1,
    .infer = pool_infer,
};
