/* Embedding nodes, plain C: the token embedding (F.embedding: y = table[idx], a gather whose
 * backward scatter-adds dy into the table's gradient) and the learned position embedding of
 * GPT-2 (y = x + table[t] for every sequence of x (..., T, C), PyTorch's `tok + wpe(arange(T))`
 * without a (T, C) temporary). Gradients add into a table's gradient that already holds values,
 * so a table read by another node too (GPT-2's tied output projection) gets the sum; the scatter
 * runs in index order, so its sums do not depend on threads. Token ids may be i64, i32 or an
 * f32 holding whole numbers (a model whose input is an f32 tensor, as a pipeline stage's is); an
 * id outside [0, V) or not whole is an error naming its position. A vocabulary slice's table
 * holds rows [first, first + rows) of the whole: an id there is looked up, any other id of the
 * whole vocabulary gives a row of zeros and no gradient. */
#include <math.h>
#include <string.h>

#include "ops/op.h"

/* Token id i of idx, checked against V; TD_EINVAL names the position. */
static td_status token_id(const td__node *n, size_t i, int64_t V, int64_t *out) {
    const td_tensor *idx = n->in[0];
    int64_t id;
    if (idx->dtype == TD_I64) {
        id = ((const int64_t *)idx->data)[i];
    } else if (idx->dtype == TD_I32) {
        id = ((const int32_t *)idx->data)[i];
    } else {
        float f = td__load(idx->data, idx->dtype, i);
        if (!(f == floorf(f)) || fabsf(f) > 16777216.f)
            return td__fail(TD_EINVAL, "%s: token %zu of '%s' is %g, not a whole number", n->what,
                            i, idx->name, (double)f);
        id = (int64_t)f;
    }
    if (id < 0 || id >= V)
        return td__fail(TD_EINVAL, "%s: token %zu of '%s' is %lld, outside [0, %lld)", n->what, i,
                        idx->name, (long long)id, (long long)V);
    *out = id;
    return TD_OK;
}

/* Copies or adds `C` values of dtype dt (f32 fast path). */
static void row_copy(void *dst, size_t di, const void *src, size_t si, td_dtype dt, int64_t C) {
    if (dt == TD_F32) {
        memcpy((float *)dst + di, (const float *)src + si, (size_t)C * sizeof(float));
        return;
    }
    for (int64_t c = 0; c < C; c++) td__store(dst, dt, di + c, td__load(src, dt, si + c));
}

static void row_add(void *dst, size_t di, const void *src, size_t si, td_dtype dt, int64_t C) {
    if (dt == TD_F32) {
        float *d = (float *)dst + di;
        const float *s = (const float *)src + si;
        for (int64_t c = 0; c < C; c++) d[c] += s[c];
        return;
    }
    for (int64_t c = 0; c < C; c++)
        td__store(dst, dt, di + c, td__load(dst, dt, di + c) + td__load(src, dt, si + c));
}

/* Where a table's gradient accumulates: zeroed first when nothing has written it yet. */
static void *table_grad(td_tensor *table) {
    if (table->grad_zero) memset(table->grad, 0, table->bytes);
    table->grad_zero = 0;
    return table->grad;
}

/* Token i's row of the table (ids checked against the whole vocabulary), or -1 when the
 * table is a vocabulary slice that does not hold it. */
static td_status token_row(const td__node *n, size_t i, int64_t *row) {
    int64_t rows = n->in[1]->shape.dim[0];
    if (n->variant == TD__EMB_TOKEN) return token_id(n, i, rows, row);
    TD__TRY(token_id(n, i, n->attr.vocab.world_size * rows, row));
    *row -= n->attr.vocab.first;
    if (*row < 0 || *row >= rows) *row = -1;
    return TD_OK;
}

static td_status emb_forward(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    const td_tensor *table = n->in[1];
    int64_t C = table->shape.dim[1];
    td_dtype dt = n->out->dtype;
    if (n->variant != TD__EMB_POSITION) {
        size_t count = (size_t)td_shape_numel(&n->in[0]->shape);
        for (size_t i = 0; i < count; i++) {
            int64_t id;
            TD__TRY(token_row(n, i, &id));
            if (id >= 0)
                row_copy(n->out->data, i * (size_t)C, table->data, (size_t)id * (size_t)C, dt, C);
            else
                memset((char *)n->out->data + i * (size_t)C * td_dtype_size(dt), 0,
                       (size_t)C * td_dtype_size(dt));
        }
        return TD_OK;
    }
    const td_tensor *x = n->in[0];
    int64_t T = x->shape.dim[x->shape.ndim - 2];
    size_t rows = (size_t)td_shape_numel(&x->shape) / (size_t)C;
    for (size_t r = 0; r < rows; r++) {
        size_t at = r * (size_t)C, pos = (r % (size_t)T) * (size_t)C;
        row_copy(n->out->data, at, x->data, at, dt, C);
        row_add(n->out->data, at, table->data, pos, dt, C);
    }
    return TD_OK;
}

static td_status emb_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *in0 = n->in[0], *table = n->in[1];
    int64_t C = table->shape.dim[1];
    const void *dy = n->out->grad;
    td_dtype dt = n->out->dtype;
    if (n->variant != TD__EMB_POSITION) {
        if (!table->requires_grad) return TD_OK;
        void *dtab = table_grad(table);
        size_t count = (size_t)td_shape_numel(&in0->shape);
        for (size_t i = 0; i < count; i++) {
            int64_t id;
            TD__TRY(token_row(n, i, &id));
            if (id >= 0) row_add(dtab, (size_t)id * (size_t)C, dy, i * (size_t)C, dt, C);
        }
        return TD_OK;
    }
    int64_t T = in0->shape.dim[in0->shape.ndim - 2];
    size_t rows = (size_t)td_shape_numel(&in0->shape) / (size_t)C;
    if (table->requires_grad) {
        void *dtab = table_grad(table);
        for (size_t r = 0; r < rows; r++)
            row_add(dtab, (r % (size_t)T) * (size_t)C, dy, r * (size_t)C, dt, C);
    }
    if (in0->requires_grad) {
        memcpy(td__grad_begin(ctx, in0, 0), dy, in0->bytes);
        td__grad_end(ctx, in0);
    }
    return TD_OK;
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_embedding = {
    .forward = emb_forward,
    .backward = emb_backward,
};
