/* The softmax and log-softmax ops over the last dim of an f32 (N, C) tensor; backward reads
 * the output, as PyTorch's does. Kernels: cpu/softmax.c, cuda/softmax.cu. */
#include "ops/op.h"

static td_status sm_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    if (x->dtype != TD_F32 || x->shape.ndim != 2)
        return td__fail(TD_ESHAPE, "%s: input '%s' must be f32 (N, C), got %d dims", n->what,
                        x->name, x->shape.ndim);
    *shape = x->shape;
    *dtype = TD_F32;
    return TD_OK;
}

const td__op td__op_softmax = {
    .name = "softmax",
    .id = TD__OP_SOFTMAX,
    .infer = sm_infer,
    .backward_reads_output = 1,
    .precision = TD__PREC_F32,
};
