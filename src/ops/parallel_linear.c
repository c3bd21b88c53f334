/* Megatron's column- and row-parallel linear layers computed in fixed shards (deterministic
 * tensor parallelism, td_graph_params.tp_shards): the split dimension of the whole layer is cut
 * into S shards, a rank of a tp group of n ranks holds L = S / n of them, and each shard is a
 * product of one shape whatever n is, so no kernel's order of addition depends on the layout.
 *  - column (TD__PLIN_COLUMN): y = x w^T + b with w (parts L Ob, K) the rank's rows of each of
 *    `parts` blocks of the whole weight (c_attn's q, k, v), shard l of it rows [l Ob, (l+1) Ob)
 *    of every block. Shard l's output is x (N, K) times its (parts Ob, K) rows; y is shard by
 *    shard, (L N, parts Ob), or (N, parts L Ob) as a linear lays it out. The input gradient is
 *    the sum over the shards of dy_l w_l: the pairwise tree over the rank's shards, whose levels
 *    above the rank the region's edge adds (tp_region.c);
 *  - row (TD__PLIN_ROW): x shard by shard (L N, Kb), w (O, L Kb) the rank's columns of the
 *    whole weight: y (N, O) = the pairwise tree over the shards of x_l w_l^T, the bias (which
 *    only tp rank 0 holds) in shard 0's product; the levels above the rank are the region's.
 * f32 (mixed precision leaves these layers in f32); kernels: cpu/parallel_linear.c. */
#include "ops/op.h"

static td_status plin_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    int64_t L = n->attr.plin.shards, parts = n->attr.plin.parts;
    if (!w) return td__fail(TD_EINVAL, "%s: the weight is NULL", n->what);
    if (x->dtype != TD_F32 || w->dtype != TD_F32 || (b && b->dtype != TD_F32))
        return td__fail(TD_EDTYPE, "%s: '%s', its weight and bias must be f32", n->what, x->name);
    if (x->shape.ndim != 2 || w->shape.ndim != 2 || L < 1 || L > 64 || parts < 1)
        return td__fail(TD_ESHAPE,
                        "%s: input '%s' and weight '%s' must be 2-d, %lld shards (1 to 64)",
                        n->what, x->name, w->name, (long long)L);
    int64_t N = x->shape.dim[0], K = x->shape.dim[1], O = w->shape.dim[0];
    if (n->variant == TD__PLIN_COLUMN) {
        if (w->shape.dim[1] != K || O % (parts * L))
            return td__fail(TD_ESHAPE,
                            "%s: weight '%s' must be (%lld blocks of %lld shards of rows, %lld)",
                            n->what, w->name, (long long)parts, (long long)L, (long long)K);
        if (b && (b->shape.ndim != 1 || b->shape.dim[0] != O))
            return td__fail(TD_ESHAPE, "%s: bias '%s' must be (%lld)", n->what, b->name,
                            (long long)O);
        *shape = n->attr.plin.by_shard ? td_shape_2d(L * N, O / L) : td_shape_2d(N, O);
    } else {
        if (N % L || w->shape.dim[1] != L * K)
            return td__fail(TD_ESHAPE,
                            "%s: input '%s' must be %lld shards of rows and weight '%s' (OUT, "
                            "%lld)",
                            n->what, x->name, (long long)L, w->name, (long long)(L * K));
        if (b && (b->shape.ndim != 1 || b->shape.dim[0] != O))
            return td__fail(TD_ESHAPE, "%s: bias '%s' must be (%lld)", n->what, b->name,
                            (long long)O);
        *shape = td_shape_2d(N / L, O);
    }
    *dtype = TD_F32;
    return TD_OK;
}

const td__op td__op_parallel_linear = {
    .name = "parallel_linear",
    .id = TD__OP_PARALLEL_LINEAR,
    .infer = plin_infer,
    .precision = TD__PREC_F32,
};
