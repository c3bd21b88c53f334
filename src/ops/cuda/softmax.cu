/* Softmax and log-softmax over the last axis on a GPU (softmax.cuh's kernels), f32 rows. */
#include "ops/cuda/cuda_ops.cuh"
#include "ops/cuda/softmax.cuh"

static td_status rows_of(const td__node *n, unsigned *rows, int64_t *C) {
    const td_tensor *x = n->in[0];
    *C = x->shape.dim[x->shape.ndim - 1];
    size_t r = td__numel(x) / (size_t)*C;
    if (x->dtype != TD_F32 || r > 0x7fffffffu)
        return td__host->fail(TD_EUNSUPPORTED, "%s: '%s' on a GPU must be f32 with < 2^31 rows",
                              n->what, x->name);
    *rows = (unsigned)r;
    return TD_OK;
}

static td_status sm_forward(td__op_ctx *ctx, td__node *n) {
    unsigned rows;
    int64_t C;
    TD__TRY(rows_of(n, &rows, &C));
    td__launch_softmax_forward(td__gpu_of(ctx)->stream, (float *)n->out->data,
                               (const float *)n->in[0]->data, rows, C,
                               n->variant == TD__LOG_SOFTMAX);
    TD__LAUNCHED(n->what);
    return TD_OK;
}

static td_status sm_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    unsigned rows;
    int64_t C;
    TD__TRY(rows_of(n, &rows, &C));
    td__launch_softmax_backward(td__gpu_of(ctx)->stream, (float *)x->grad, (const float *)y->grad,
                                (const float *)y->data, rows, C, n->variant == TD__LOG_SOFTMAX,
                                td__grad_beta(x));
    TD__LAUNCHED(n->what);
    td__grad_written(x);
    return TD_OK;
}

const td__kernels td__cuda_softmax = {.forward = sm_forward, .backward = sm_backward};
