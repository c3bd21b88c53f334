/* The edges of a tensor-parallel region (Megatron-LM's conjugate pairs), on the graph's group,
 * which a tensor-parallel model makes its tp group. Every rank of the group holds the same
 * activations outside a region and its own slice of the computation inside, so each edge is a
 * communication in one direction and none in the other:
 *  - copy_to_tp_region (Megatron's f), where a region begins: forward the identity (every rank
 *    already holds x), backward the sum of the ranks' gradients of x, each rank's being the
 *    gradient through its slice only;
 *  - reduce_from_tp_region (Megatron's g), where a region ends: forward the sum of the ranks'
 *    partial results (a row-parallel linear's), backward the identity (every rank computes the
 *    same loss from the sum, so every rank's gradient of it is already the whole one);
 *  - reduce_scatter (sequence parallelism's g): forward the sum of the ranks' partial (N, ...)
 *    results of which rank r keeps rows [r N / n, (r + 1) N / n), backward an all-gather of the
 *    rows' gradients. Its partner where a region begins is the all-gather (all_gather.c), whose
 *    backward is this forward.
 * Any float dtype, moved as it is (bf16 and f16 are summed in f32 by the group); plain layouts
 * only. In a group of one each is a copy.
 *
 * The sums are the group's all-reduce or reduce-scatter, whose order of addition depends on the
 * group's size; under deterministic tensor parallelism (attr.coll.tree) each rank's partial is
 * its subtree of fixed shards (parallel_linear.c, layer_norm.c) and the sums are the levels of
 * the pairwise tree above the ranks (td_comm_allreduce_tree, td_comm_reduce_scatter_tree), so
 * the whole sum is the same bits at any group size. */
#include "ops/backend.h"
#include "ops/collective.h"

static td_status region_compile(td__op_ctx *ctx, td__node *n) {
    const td_tensor *x = n->in[0];
    return td__coll_agree(ctx, n, &x->shape, x->dtype, n->out->requires_grad);
}

/* The sum of the ranks' `from` (whole, count elements each) into `to`: all of it, or the rank's
 * rows when `scatter`; in the fixed pairwise tree over the ranks when the node asks for it. */
static td_status sum(td__op_ctx *ctx, const td__node *n, const void *from, void *to, size_t count,
                     td_dtype dtype, int scatter) {
    size_t mine = count / (size_t)td__coll_size(ctx);
    if (n->attr.coll.tree)
        return scatter ? td_comm_reduce_scatter_tree(ctx->comm, from, to, mine, dtype)
                       : td_comm_allreduce_tree(ctx->comm, from, to, count, dtype);
    if (scatter) return td_comm_reduce_scatter(ctx->comm, from, to, mine, dtype, TD_OP_SUM);
    return td_comm_allreduce(ctx->comm, from, to, count, dtype, TD_OP_SUM);
}

static td_status region_forward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    if (td__coll_size(ctx) == 1 || n->variant == TD__REGION_COPY)
        return ctx->backend->copy(ctx, y->data, x->data, y->bytes);
    int scatter = n->variant == TD__REGION_REDUCE_SCATTER;
    td__coll_tag(ctx, n, scatter ? "sp reduce-scatter" : "tp all-reduce", "fwd");
    td_status st = sum(ctx, n, x->data, y->data, (size_t)td_tensor_numel(x), x->dtype, scatter);
    return st == TD_OK ? TD_OK : td__coll_fail(n, "forward", st);
}

static td_status region_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    if (!x->requires_grad) return TD_OK;
    void *dx = td__grad_begin(ctx, x, 0);
    td_status st = TD_OK;
    if (td__coll_size(ctx) == 1 || n->variant == TD__REGION_REDUCE) {
        st = ctx->backend->copy(ctx, dx, y->grad, x->bytes);
    } else if (n->variant == TD__REGION_COPY) {
        td__coll_tag(ctx, n, "tp all-reduce", "bwd");
        st = sum(ctx, n, y->grad, dx, (size_t)td_tensor_numel(x), x->dtype, 0);
    } else {
        td__coll_tag(ctx, n, "sp all-gather", "bwd");
        st = td_comm_allgather(ctx->comm, y->grad, dx, (size_t)td_tensor_numel(y), x->dtype);
    }
    if (st != TD_OK) return td__coll_fail(n, "backward", st);
    return td__grad_end(ctx, x);
}

static td_status region_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    if (!td__is_float(x->dtype))
        return td__fail(TD_EDTYPE, "%s: input '%s' must be f32, bf16 or f16, not %s", n->what,
                        x->name, td_dtype_name(x->dtype));
    *shape = x->shape;
    *dtype = x->dtype;
    if (n->variant != TD__REGION_REDUCE_SCATTER) return TD_OK;
    int w = n->attr.coll.world_size;
    if (x->shape.ndim < 1 || x->shape.dim[0] % w)
        return td__fail(TD_ESHAPE,
                        "%s: input '%s' must be (N, ...) with N a multiple of the group's %d ranks",
                        n->what, x->name, w);
    shape->dim[0] /= w;
    return TD_OK;
}

/* An edge moves a tensor in the dtype it has: mixed precision neither casts its input nor, at
 * O2, stores a parameter it takes (a layer norm's weight under sequence parallelism) in the low
 * dtype on its account. */
static td_dtype region_input_dtype(const td__node *n, int i, td_dtype dtype) {
    (void)dtype;
    return n->in[i]->dtype;
}

/* Its kernels on every backend: the group moves host and device memory alike. */
static const td__kernels kernels = {
    .compile = region_compile,
    .forward = region_forward,
    .backward = region_backward,
};

const td__op td__op_tp_region = {
    .name = "tp_region",
    .id = TD__OP_TP_REGION,
    .generic = &kernels,
    .collective = 1,
    .infer = region_infer,
    .input_dtype = region_input_dtype,
};
