/* Softmax and log-softmax over the last axis on a GPU. One block per row: the row's maximum and
 * sum are reduced in a fixed tree, so results do not depend on timing. */
#include <cfloat>

#include "ops/cuda/cuda_ops.cuh"

__global__ void softmax_forward(float *y, const float *x, int64_t C, int log) {
    const float *xr = x + (size_t)blockIdx.x * C;
    float *yr = y + (size_t)blockIdx.x * C;
    float m = -FLT_MAX;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) m = fmaxf(m, xr[c]);
    m = td__block_reduce(m, 1);
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += expf(xr[c] - m);
    s = td__block_reduce(s, 0);
    float ls = logf(s);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        yr[c] = log ? xr[c] - m - ls : expf(xr[c] - m) / s;
}

/* softmax: dx = y (dy - sum(dy y)); log-softmax: dx = dy - exp(y) sum(dy). */
__global__ void softmax_backward(float *dx, const float *dy, const float *y, int64_t C, int log,
                                 float beta) {
    size_t row = (size_t)blockIdx.x * C;
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        s += log ? dy[row + c] : dy[row + c] * y[row + c];
    s = td__block_reduce(s, 0);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        size_t i = row + c;
        float d = log ? dy[i] - expf(y[i]) * s : y[i] * (dy[i] - s);
        dx[i] = beta != 0.f ? beta * dx[i] + d : d;
    }
}

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
    softmax_forward<<<rows, TD__THREADS, 0, td__gpu_of(ctx)->stream>>>(
        (float *)n->out->data, (const float *)n->in[0]->data, C, n->variant == TD__LOG_SOFTMAX);
    TD__LAUNCHED(n->what);
    return TD_OK;
}

static td_status sm_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    unsigned rows;
    int64_t C;
    TD__TRY(rows_of(n, &rows, &C));
    softmax_backward<<<rows, TD__THREADS, 0, td__gpu_of(ctx)->stream>>>(
        (float *)x->grad, (const float *)y->grad, (const float *)y->data, C,
        n->variant == TD__LOG_SOFTMAX, td__grad_beta(x));
    TD__LAUNCHED(n->what);
    td__grad_written(x);
    return TD_OK;
}

const td__kernels td__cuda_softmax = {.forward = sm_forward, .backward = sm_backward};
