/* The embedding ops: the token embedding (F.embedding), its vocabulary-parallel slice
 * (Megatron's VocabParallelEmbedding: a table of rows [first, first + rows) of the whole, other
 * ids looked up as zeros) and GPT-2's learned position embedding (y = x + table[t]). Kernels:
 * cpu/embedding.c, cuda/embedding.cu (which has no vocabulary slice). */
#include "ops/op.h"

static td_status emb_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0], *table = n->in[1];
    if (!table) return td__fail(TD_EINVAL, "%s: the table is NULL", n->what);
    if (!td__is_float(table->dtype) || table->shape.ndim != 2)
        return td__fail(TD_ESHAPE, "%s: table '%s' must be (rows, C) of a float dtype", n->what,
                        table->name);
    int64_t C = table->shape.dim[1];
    if (n->variant != TD__EMB_POSITION) {
        if (x->dtype != TD_I64 && x->dtype != TD_I32 && x->dtype != TD_F32)
            return td__fail(TD_EDTYPE, "%s: token ids '%s' are %s (i64, i32 or f32)", n->what,
                            x->name, td_dtype_name(x->dtype));
        if (x->requires_grad)
            return td__fail(TD_EINVAL, "%s: token ids '%s' cannot take a gradient", n->what,
                            x->name);
        if (x->shape.ndim >= TD_MAX_DIMS)
            return td__fail(TD_ESHAPE, "%s: token ids '%s' have %d dims (at most %d)", n->what,
                            x->name, x->shape.ndim, TD_MAX_DIMS - 1);
        *shape = x->shape;
        shape->dim[shape->ndim++] = C;
        *dtype = table->dtype;
        return TD_OK;
    }
    if (x->shape.ndim < 2 || x->shape.dim[x->shape.ndim - 1] != C || x->dtype != table->dtype)
        return td__fail(TD_ESHAPE, "%s: '%s' must be (..., T, %lld) of the table's dtype %s",
                        n->what, x->name, (long long)C, td_dtype_name(table->dtype));
    int64_t T = x->shape.dim[x->shape.ndim - 2];
    if (T > table->shape.dim[0])
        return td__fail(TD_ESHAPE, "%s: '%s' has %lld positions, the table '%s' only %lld", n->what,
                        x->name, (long long)T, table->name, (long long)table->shape.dim[0]);
    *shape = x->shape;
    *dtype = x->dtype;
    return TD_OK;
}

/* Token ids keep their own dtype under mixed precision; everything else follows the table. */
static td_dtype emb_input_dtype(const td__node *n, int i, td_dtype dtype) {
    return i == 0 && n->variant != TD__EMB_POSITION ? n->in[0]->dtype : dtype;
}

const td__op td__op_embedding = {
    .name = "embedding",
    .id = TD__OP_EMBEDDING,
    .infer = emb_infer,
    .input_dtype = emb_input_dtype,
};
