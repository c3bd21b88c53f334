/* The all-reduce node (torch.distributed.nn.functional.all_reduce): the sum or the average
 * over ranks of x, on every rank, any shape. Its backward all-reduces the gradient with the
 * same op: y = sum_r x_r gives every x_r the sum of the ranks' gradients of y, and the
 * average divides that by the world size too. Only SUM and AVG have that gradient. Any float
 * dtype (bf16 and f16 are added in f32 by the group); plain layouts only. In a group of one
 * it is a copy. */
#include "ops/backend.h"
#include "ops/collective.h"

static td_status ar_compile(td__op_ctx *ctx, td__node *n) {
    const td_tensor *x = n->in[0];
    return td__coll_agree(ctx, n, &x->shape, x->dtype, n->out->requires_grad);
}

static td_status ar_forward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    if (td__coll_size(ctx) == 1) return ctx->backend->copy(ctx, y->data, x->data, x->bytes);
    td_status st = td_comm_allreduce(ctx->comm, x->data, y->data, (size_t)td_tensor_numel(x),
                                     x->dtype, n->attr.coll.op);
    return st == TD_OK ? TD_OK : td__coll_fail(n, "forward", st);
}

static td_status ar_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    if (!x->requires_grad) return TD_OK;
    void *dx = td__grad_begin(ctx, x, 0);
    td_status st = TD_OK;
    if (td__coll_size(ctx) == 1)
        st = ctx->backend->copy(ctx, dx, y->grad, x->bytes);
    else
        st = td_comm_allreduce(ctx->comm, y->grad, dx, (size_t)td_tensor_numel(x), x->dtype,
                               n->attr.coll.op);
    if (st != TD_OK) return td__coll_fail(n, "backward", st);
    return td__grad_end(ctx, x);
}

static td_status ar_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    if (!td__is_float(x->dtype))
        return td__fail(TD_EDTYPE, "all_reduce: input '%s' must be f32, bf16 or f16, not %s",
                        x->name, td_dtype_name(x->dtype));
    if (n->attr.coll.op != TD_OP_SUM && n->attr.coll.op != TD_OP_AVG)
        return td__fail(TD_EINVAL,
                        "all_reduce: op %s has no gradient here (sum and avg have; reduce "
                        "outside the graph for the others)",
                        td_reduce_op_name(n->attr.coll.op));
    *shape = x->shape;
    *dtype = x->dtype;
    return TD_OK;
}

/* Its kernels on every backend: the group moves host and device memory alike. */
static const td__kernels kernels = {
    .compile = ar_compile,
    .forward = ar_forward,
    .backward = ar_backward,
};

const td__op td__op_all_reduce = {
    .name = "all_reduce",
    .id = TD__OP_ALL_REDUCE,
    .generic = &kernels,
    .collective = 1,
    .infer = ar_infer,
};
