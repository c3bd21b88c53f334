/* The all-gather node (torch.distributed.nn.functional.all_gather, concatenated): every rank's
 * x (N, ...) stacked along dim 0 in rank order, (world * N, ...), on every rank. Its backward
 * is a reduce-scatter: the gradient of the gathered tensor is summed over ranks (each rank's
 * loss may depend on every rank's rows) and each rank keeps the rows of its own x. Any float
 * dtype, moved as it is; plain layouts only (ranks on different CPUs may block differently).
 * In a group of one it is a copy. Under deterministic tensor parallelism (attr.coll.tree) the
 * reduce-scatter adds in the fixed pairwise tree over the ranks. */
#include "ops/backend.h"
#include "ops/collective.h"

static td_status ag_compile(td__op_ctx *ctx, td__node *n) {
    const td_tensor *x = n->in[0];
    return td__coll_agree(ctx, n, &x->shape, x->dtype, n->out->requires_grad);
}

static td_status ag_forward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    if (td__coll_size(ctx) == 1) return ctx->backend->copy(ctx, y->data, x->data, x->bytes);
    td__coll_tag(ctx, n, "all-gather", "fwd");
    td_status st =
        td_comm_allgather(ctx->comm, x->data, y->data, (size_t)td_tensor_numel(x), x->dtype);
    return st == TD_OK ? TD_OK : td__coll_fail(n, "forward", st);
}

static td_status ag_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    if (!x->requires_grad) return TD_OK;
    void *dx = td__grad_begin(ctx, x, 0);
    td_status st = TD_OK;
    if (td__coll_size(ctx) == 1) {
        st = ctx->backend->copy(ctx, dx, y->grad, x->bytes);
    } else {
        td__coll_tag(ctx, n, "reduce-scatter", "bwd");
        if (n->attr.coll.tree) /* deterministic tensor parallelism's levels above the ranks */
            st = td_comm_reduce_scatter_tree(ctx->comm, y->grad, dx, (size_t)td_tensor_numel(x),
                                             x->dtype);
        else
            st = td_comm_reduce_scatter(ctx->comm, y->grad, dx, (size_t)td_tensor_numel(x),
                                        x->dtype, TD_OP_SUM);
    }
    if (st != TD_OK) return td__coll_fail(n, "backward", st);
    return td__grad_end(ctx, x);
}

static td_status ag_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    if (!td__is_float(x->dtype) || x->shape.ndim < 1)
        return td__fail(TD_ESHAPE, "all_gather: input '%s' must be (N, ...) of a float dtype",
                        x->name);
    *shape = x->shape;
    shape->dim[0] *= n->attr.coll.world_size;
    *dtype = x->dtype;
    return TD_OK;
}

/* Its kernels on every backend: the group moves host and device memory alike. */
static const td__kernels kernels = {
    .compile = ag_compile,
    .forward = ag_forward,
    .backward = ag_backward,
};

const td__op td__op_all_gather = {
    .name = "all_gather",
    .id = TD__OP_ALL_GATHER,
    .generic = &kernels,
    .collective = 1,
    .infer = ag_infer,
};
