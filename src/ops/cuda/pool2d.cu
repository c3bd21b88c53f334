/* Max and average 2-d pooling nodes on a GPU through cuDNN's pooling (NCHW, floor mode), the
 * CPU's pool2d (oneDNN, checked against ref/pool2d.c) as the oracle: max pooling lets NaN win
 * and runs cuDNN's deterministic variant, average pooling divides by the whole window, padding
 * included (count_include_pad; the op's padding <= kernel / 2 keeps every window inside the
 * padded input, so that divisor is always KH * KW, as the CPU's). Where a window holds the
 * same maximum twice, which of them takes the gradient is cuDNN's choice, not necessarily the
 * CPU's first.
 *
 * Max pooling's backward finds the maximum again from x and y, so it needs no workspace; y
 * may since have been overwritten by a ReLU run in place, which changes only outputs <= 0,
 * and those get no gradient through the ReLU. */
#include <cstdlib>

#include "ops/cuda/cuda_ops.cuh"

typedef struct {
    cudnnPoolingDescriptor_t pool;
    cudnnTensorDescriptor_t x, y; /* (N, C, H, W), (N, C, OH, OW) */
} pool_state;

static td_status pool_compile(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    pool_state *s = (pool_state *)calloc(1, sizeof *s);
    if (!s) return td__host->fail(TD_ENOMEM, "%s: out of memory", n->what);
    n->state = s;
    const td_pool2d_params *p = &n->attr.pool;
    const td_tensor *x = n->in[0], *y = n->out;
    TD__TRY(td__cudnn_nchw(&s->x, x, n->what));
    TD__TRY(td__cudnn_nchw(&s->y, y, n->what));
    cudnnPoolingMode_t mode = n->variant == TD__POOL_MAX
                                  ? CUDNN_POOLING_MAX_DETERMINISTIC
                                  : CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING;
    TD__CUDNN(cudnnCreatePoolingDescriptor(&s->pool));
    TD__CUDNN(cudnnSetPooling2dDescriptor(s->pool, mode, CUDNN_PROPAGATE_NAN, p->kernel[0],
                                          p->kernel[1], p->padding[0], p->padding[1], p->stride[0],
                                          p->stride[1]));
    /* The op's shape inference and cuDNN must agree on the output (floor mode both). */
    int on, oc, oh, ow;
    TD__CUDNN(cudnnGetPooling2dForwardOutputDim(s->pool, s->x, &on, &oc, &oh, &ow));
    const int64_t *yd = y->shape.dim;
    if (on != yd[0] || oc != yd[1] || oh != yd[2] || ow != yd[3])
        return td__host->fail(TD_EBACKEND,
                              "%s: cuDNN's output (%d, %d, %d, %d) is not the node's (%lld, %lld, "
                              "%lld, %lld)",
                              n->what, on, oc, oh, ow, (long long)yd[0], (long long)yd[1],
                              (long long)yd[2], (long long)yd[3]);
    return TD_OK;
}

static td_status pool_forward(td__op_ctx *ctx, td__node *n) {
    pool_state *s = (pool_state *)n->state;
    const float one = 1.f, zero = 0.f;
    TD__CUDNN(cudnnPoolingForward(td__gpu_of(ctx)->dnn, s->pool, &one, s->x, n->in[0]->data, &zero,
                                  s->y, n->out->data));
    return TD_OK;
}

static td_status pool_backward(td__op_ctx *ctx, td__node *n) {
    pool_state *s = (pool_state *)n->state;
    td_tensor *x = n->in[0], *y = n->out;
    const float one = 1.f, beta = td__grad_beta(x);
    TD__CUDNN(cudnnPoolingBackward(td__gpu_of(ctx)->dnn, s->pool, &one, s->y, y->data, s->y,
                                   y->grad, s->x, x->data, &beta, s->x, x->grad));
    td__grad_written(x);
    return TD_OK;
}

static void pool_destroy(td__node *n) {
    pool_state *s = (pool_state *)n->state;
    if (!s) return;
    if (s->pool) cudnnDestroyPoolingDescriptor(s->pool);
    if (s->x) cudnnDestroyTensorDescriptor(s->x);
    if (s->y) cudnnDestroyTensorDescriptor(s->y);
    free(s);
}

const td__kernels td__cuda_pool2d = {pool_compile, pool_forward, pool_backward, pool_destroy, NULL};
