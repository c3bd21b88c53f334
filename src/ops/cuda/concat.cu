/* Channel concatenation on a GPU: (N, C_i, ...) inputs side by side along dim 1, and backward
 * slicing dy back out to each input's gradient (written or added, as the gradient rule says).
 * One strided copy kernel (concat.cuh) serves both directions. */
#include "ops/cuda/concat.cuh"
#include "ops/cuda/cuda_ops.cuh"

/* Elements per sample of t (C times the trailing dims). */
static size_t row_of(const td_tensor *t) { return td__numel(t) / (size_t)t->shape.dim[0]; }

static td_status concat_forward(td__op_ctx *ctx, td__node *n) {
    cudaStream_t st = td__gpu_of(ctx)->stream;
    size_t rows = (size_t)n->out->shape.dim[0], row = row_of(n->out), at = 0;
    for (int i = 0; i < n->nin; i++) {
        const td_tensor *x = n->in[i];
        size_t w = row_of(x);
        TD__FLOAT_TYPES(x->dtype, n->what, {
            td__launch_concat_rows(st, (T *)n->out->data, row, at, (const T *)x->data, w, 0, rows,
                                   w, 0.f);
        });
        TD__LAUNCHED(n->what);
        at += w;
    }
    return TD_OK;
}

static td_status concat_backward(td__op_ctx *ctx, td__node *n) {
    cudaStream_t st = td__gpu_of(ctx)->stream;
    size_t rows = (size_t)n->out->shape.dim[0], row = row_of(n->out), at = 0;
    for (int i = 0; i < n->nin; i++) {
        td_tensor *x = n->in[i];
        size_t w = row_of(x);
        if (x->requires_grad) {
            float beta = td__grad_beta(x);
            TD__FLOAT_TYPES(x->dtype, n->what, {
                td__launch_concat_rows(st, (T *)x->grad, w, 0, (const T *)n->out->grad, row, at,
                                       rows, w, beta);
            });
            TD__LAUNCHED(n->what);
            td__grad_written(x);
        }
        at += w;
    }
    return TD_OK;
}

const td__kernels td__cuda_concat = {.forward = concat_forward, .backward = concat_backward};
