/* The 2-d batch norm node on a GPU, PyTorch's semantics as the CPU's batch_norm2d (oneDNN,
 * checked against ref/batch_norm.c), its oracle: training normalises with the batch's mean and
 * biased variance through cuDNN's spatial batch norm, which also moves the running stats by
 * momentum with the unbiased variance (as PyTorch's cuDNN path does) and keeps the batch's
 * mean and inverse standard deviation for backward; eval normalises with the running stats
 * (cuDNN's inference batch norm). Activations are f32, bf16 or f16 (NCHW); weight, bias and
 * statistics are always f32, which is what cuDNN takes with every activation dtype.
 *
 * Not cuDNN's: a folded ReLU (the fusion pass's batch norm + ReLU), applied in place after
 * the normalisation and, backward, as a mask on dy (y > 0) written to scratch, since dy is
 * also the ReLU's output gradient; and backward in eval mode, where the statistics are
 * constants (cuDNN's backward always differentiates through the batch statistics), whose
 * per-channel sums run one block per channel in a fixed order. */
#include <cstdlib>

#include "ops/cuda/batch_norm.cuh"
#include "ops/cuda/cuda_ops.cuh"

typedef struct {
    td_device device;
    cudnnTensorDescriptor_t x;  /* (N, C, H, W): x, y and their gradients */
    cudnnTensorDescriptor_t bn; /* (1, C, 1, 1) f32: weight, bias and statistics */
    /* (4, C) f32 in device memory: the last training forward's batch mean and inverse
     * standard deviation, then weight and bias gradients on their way to a gradient that
     * cannot take them directly. */
    float *stats;
    int trained; /* the last forward ran in training mode */
} bn_state;

static td_status bn_compile(td__op_ctx *ctx, td__node *n) {
    bn_state *s = (bn_state *)calloc(1, sizeof *s);
    if (!s) return td__host->fail(TD_ENOMEM, "%s: out of memory", n->what);
    n->state = s;
    td__gpu *g = td__gpu_of(ctx);
    s->device = g->device;
    int64_t C = n->in[0]->shape.dim[1];
    TD__TRY(td__cudnn_nchw(&s->x, n->in[0], n->what));
    TD__CUDNN(cudnnCreateTensorDescriptor(&s->bn));
    TD__CUDNN(cudnnDeriveBNTensorDescriptor(s->bn, s->x, CUDNN_BATCHNORM_SPATIAL));
    return td__host->alloc(g->device, (size_t)(4 * C) * sizeof(float), (void **)&s->stats);
}

static td_status bn_forward(td__op_ctx *ctx, td__node *n) {
    bn_state *s = (bn_state *)n->state;
    td__gpu *g = td__gpu_of(ctx);
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2], *rm = n->in[3], *rv = n->in[4];
    td_tensor *y = n->out;
    const float one = 1.f, zero = 0.f;
    double eps = n->attr.bn.eps;
    int64_t C = x->shape.dim[1];
    s->trained = ctx->training;
    if (ctx->training)
        TD__CUDNN(cudnnBatchNormalizationForwardTraining(
            g->dnn, CUDNN_BATCHNORM_SPATIAL, &one, &zero, s->x, x->data, s->x, y->data, s->bn,
            w->data, b->data, (double)n->attr.bn.momentum, rm->data, rv->data, eps, s->stats,
            s->stats + C));
    else
        TD__CUDNN(cudnnBatchNormalizationForwardInference(
            g->dnn, CUDNN_BATCHNORM_SPATIAL, &one, &zero, s->x, x->data, s->x, y->data, s->bn,
            w->data, b->data, rm->data, rv->data, eps));
    if (n->variant == TD__BN_RELU) {
        size_t cnt = td__numel(y);
        TD__FLOAT_TYPES(y->dtype, n->what, { td__launch_bn_relu(g->stream, (T *)y->data, cnt); });
        TD__LAUNCHED(n->what);
    }
    return TD_OK;
}

/* Training backward through cuDNN. Its one beta for both parameter gradients serves when
 * both are wanted and both write or both add; otherwise they go to s->stats first. */
static td_status backward_train(td__op_ctx *ctx, td__node *n, const void *dy) {
    bn_state *s = (bn_state *)n->state;
    td__gpu *g = td__gpu_of(ctx);
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    int64_t C = x->shape.dim[1];
    const float one = 1.f;
    float beta_x = x->requires_grad ? td__grad_beta(x) : 0.f;
    void *dx = x->requires_grad ? x->grad : (void *)ctx->scratch[1];
    int direct = w->requires_grad && b->requires_grad && td__grad_beta(w) == td__grad_beta(b);
    float beta_p = direct ? td__grad_beta(w) : 0.f;
    void *dw = direct ? w->grad : (void *)(s->stats + 2 * C);
    void *db = direct ? b->grad : (void *)(s->stats + 3 * C);
    TD__CUDNN(cudnnBatchNormalizationBackward(
        g->dnn, CUDNN_BATCHNORM_SPATIAL, &one, &beta_x, &one, &beta_p, s->x, x->data, s->x, dy,
        s->x, dx, s->bn, w->data, dw, db, (double)n->attr.bn.eps, s->stats, s->stats + C));
    if (!direct && w->requires_grad)
        TD__TRY(td__cuda_add_into(ctx, w->grad, TD_F32, dw, TD_F32, (size_t)C, 1.f,
                                  td__grad_beta(w), n->what));
    if (!direct && b->requires_grad)
        TD__TRY(td__cuda_add_into(ctx, b->grad, TD_F32, db, TD_F32, (size_t)C, 1.f,
                                  td__grad_beta(b), n->what));
    return TD_OK;
}

/* Eval backward: the running stats are constants, so dx is dy scaled per channel. */
static td_status backward_eval(td__op_ctx *ctx, td__node *n, const void *dy) {
    td__gpu *g = td__gpu_of(ctx);
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2], *rm = n->in[3], *rv = n->in[4];
    int64_t N = x->shape.dim[0], C = x->shape.dim[1], HW = x->shape.dim[2] * x->shape.dim[3];
    float eps = n->attr.bn.eps;
    if (w->requires_grad || b->requires_grad) {
        float *dw = w->requires_grad ? (float *)w->grad : NULL;
        float *db = b->requires_grad ? (float *)b->grad : NULL;
        float beta_w = w->requires_grad ? td__grad_beta(w) : 0.f;
        float beta_b = b->requires_grad ? td__grad_beta(b) : 0.f;
        TD__FLOAT_TYPES(x->dtype, n->what, {
            td__launch_bn_eval_params(g->stream, dw, db, beta_w, beta_b, (const T *)dy,
                                      (const T *)x->data, (const float *)rm->data,
                                      (const float *)rv->data, eps, N, C, HW);
        });
        TD__LAUNCHED(n->what);
    }
    if (x->requires_grad) {
        float beta = td__grad_beta(x);
        TD__FLOAT_TYPES(x->dtype, n->what, {
            td__launch_bn_eval_dx(g->stream, (T *)x->grad, (const T *)dy, (const float *)w->data,
                                  (const float *)rv->data, eps, N, C, HW, beta);
        });
        TD__LAUNCHED(n->what);
    }
    return TD_OK;
}

static td_status bn_backward(td__op_ctx *ctx, td__node *n) {
    bn_state *s = (bn_state *)n->state;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2], *y = n->out;
    const void *dy = y->grad;
    if (n->variant == TD__BN_RELU) {
        size_t cnt = td__numel(y);
        cudaStream_t st = td__gpu_of(ctx)->stream;
        TD__FLOAT_TYPES(y->dtype, n->what, {
            td__launch_bn_relu_mask(st, (T *)ctx->scratch[0], (const T *)y->grad,
                                    (const T *)y->data, cnt);
        });
        TD__LAUNCHED(n->what);
        dy = ctx->scratch[0];
    }
    TD__TRY(s->trained ? backward_train(ctx, n, dy) : backward_eval(ctx, n, dy));
    if (x->requires_grad) td__grad_written(x);
    if (w->requires_grad) td__grad_written(w);
    if (b->requires_grad) td__grad_written(b);
    return TD_OK;
}

static void bn_destroy(td__node *n) {
    bn_state *s = (bn_state *)n->state;
    if (!s) return;
    if (s->x) cudnnDestroyTensorDescriptor(s->x);
    if (s->bn) cudnnDestroyTensorDescriptor(s->bn);
    if (s->stats) td__host->free(s->device, s->stats);
    free(s);
}

const td__kernels td__cuda_batch_norm = {bn_compile, bn_forward, bn_backward, bn_destroy, NULL};
