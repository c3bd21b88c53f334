/* The 2-d convolution node on a GPU through cuDNN's convolutions (NCHW, groups = 1), the
 * CPU's conv2d (oneDNN, checked against ref/conv2d.c) as the oracle. Each of the three
 * convolutions (forward, backward data, backward filter) gets its algorithm once, at compile,
 * from cuDNN's heuristics (cudnnGet*_v7, as PyTorch without benchmark mode): the first that
 * is deterministic, fits the graph's shared workspace and, unless the graph allows Winograd
 * (td_graph_params.conv_winograd, as on the CPU), sums directly (no FFT or Winograd
 * transforms). Deterministic always, since tandem's reproducible training (DDP's
 * deterministic mode) must give the same bits every run, and kernels are chosen before any
 * process group is known.
 *
 * f32 runs on FMA units only unless the graph allows TF32 (td_graph_params.allow_tf32, off by
 * default as PyTorch's for matmuls), so direct f32 results match the CPU's direct ones to
 * rounding; bf16 and f16 run on tensor cores,
 * accumulating in f32. The bias is added, and its gradient summed per channel in a fixed order, by
 * the kernels below. Gradients are written or added through cuDNN's beta (td__grad_beta). */
#include <cstdlib>

#include "ops/cuda/conv2d.cuh"
#include "ops/cuda/cuda_ops.cuh"

#define ALGO_MAX 16 /* more than cuDNN has of any kind */

typedef struct {
    cudnnTensorDescriptor_t x, y; /* (N, C, H, W), (N, OC, OH, OW) */
    cudnnFilterDescriptor_t w;    /* (OC, C, KH, KW) */
    /* One per convolution: each carries the math type its algorithm was chosen with. */
    cudnnConvolutionDescriptor_t fwd_desc, bd_desc, bf_desc;
    cudnnConvolutionFwdAlgo_t fwd;
    cudnnConvolutionBwdDataAlgo_t bd;
    cudnnConvolutionBwdFilterAlgo_t bf;
    int has_bd, has_bf;
} conv_state;

/* A convolution descriptor of n's geometry, accumulating in f32; f32 data is kept off tensor
 * cores (TF32) unless the graph allows TF32 (fma_only 0), the low dtypes may use them. */
static td_status conv_desc(const td__node *n, int fma_only, cudnnConvolutionDescriptor_t *d) {
    const td_conv2d_params *p = &n->attr.conv;
    TD__CUDNN(cudnnCreateConvolutionDescriptor(d));
    TD__CUDNN(cudnnSetConvolution2dDescriptor(*d, p->padding[0], p->padding[1], p->stride[0],
                                              p->stride[1], p->dilation[0], p->dilation[1],
                                              CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    TD__CUDNN(cudnnSetConvolutionMathType(*d, fma_only                    ? CUDNN_FMA_MATH
                                              : n->in[0]->dtype == TD_F32 ? CUDNN_DEFAULT_MATH
                                                                          : CUDNN_TENSOR_OP_MATH));
    return TD_OK;
}

/* Algorithms that transform their operands (FFT, Winograd): faster on some shapes, rounding
 * otherwise than a direct sum; used only where the graph allows Winograd (conv_winograd). */
static int transforms(cudnnConvolutionFwdAlgo_t a) {
    return a == CUDNN_CONVOLUTION_FWD_ALGO_FFT || a == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING ||
           a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD ||
           a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
}
static int transforms(cudnnConvolutionBwdDataAlgo_t a) {
    return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT ||
           a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING ||
           a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD ||
           a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
}
static int transforms(cudnnConvolutionBwdFilterAlgo_t a) {
    return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT ||
           a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING ||
           a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD ||
           a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
}

/* The first of cuDNN's ranked candidates that it can run, that is deterministic, fits in
 * `limit` bytes and transforms only where allowed; its index, or -1. */
template <typename Perf>
static int pick(const Perf *perf, int count, size_t limit, int transforms_ok) {
    for (int i = 0; i < count; i++)
        if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].determinism == CUDNN_DETERMINISTIC &&
            perf[i].memory <= limit && (transforms_ok || !transforms(perf[i].algo)))
            return i;
    return -1;
}

/* After the pick the descriptor takes the math type the algorithm was ranked with, except that
 * f32 without TF32 stays on FMA units whatever cuDNN reported (as PyTorch does). */
static td_status set_math(cudnnConvolutionDescriptor_t d, cudnnMathType_t m, int fma_only) {
    TD__CUDNN(cudnnSetConvolutionMathType(d, fma_only ? CUDNN_FMA_MATH : m));
    return TD_OK;
}

static td_status no_algo(const td__node *n, const char *which, size_t limit) {
    const td_tensor *x = n->in[0], *w = n->in[1];
    return td__host->fail(TD_EBACKEND,
                          "conv2d: cuDNN has no deterministic %s algorithm within the %zu-byte "
                          "workspace for input (%lld, %lld, %lld, %lld), weight (%lld, %lld, %lld, "
                          "%lld), %s",
                          which, limit, (long long)x->shape.dim[0], (long long)x->shape.dim[1],
                          (long long)x->shape.dim[2], (long long)x->shape.dim[3],
                          (long long)w->shape.dim[0], (long long)w->shape.dim[1],
                          (long long)w->shape.dim[2], (long long)w->shape.dim[3],
                          x->dtype == TD_F32    ? "f32"
                          : x->dtype == TD_BF16 ? "bf16"
                                                : "f16");
}

static td_status conv_compile(td__op_ctx *ctx, td__node *n) {
    conv_state *s = (conv_state *)calloc(1, sizeof *s);
    if (!s) return td__host->fail(TD_ENOMEM, "conv2d: out of memory");
    n->state = s;
    td__gpu *g = td__gpu_of(ctx);
    const td_tensor *x = n->in[0], *w = n->in[1], *y = n->out;
    const int64_t *wd = w->shape.dim, *yd = y->shape.dim;
    cudnnDataType_t t;
    TD__TRY(td__cudnn_dtype(x->dtype, &t, "conv2d"));
    int fma_only = x->dtype == TD_F32 && !ctx->allow_tf32;
    TD__TRY(td__cudnn_nchw(&s->x, x, "conv2d"));
    TD__TRY(td__cudnn_nchw(&s->y, y, "conv2d"));
    TD__CUDNN(cudnnCreateFilterDescriptor(&s->w));
    TD__CUDNN(cudnnSetFilter4dDescriptor(s->w, t, CUDNN_TENSOR_NCHW, (int)wd[0], (int)wd[1],
                                         (int)wd[2], (int)wd[3]));
    TD__TRY(conv_desc(n, fma_only, &s->fwd_desc));
    /* The op's shape inference and cuDNN must agree on the output, or the kernels would write
     * past it. */
    int on, oc, oh, ow;
    TD__CUDNN(cudnnGetConvolution2dForwardOutputDim(s->fwd_desc, s->x, s->w, &on, &oc, &oh, &ow));
    if (on != yd[0] || oc != yd[1] || oh != yd[2] || ow != yd[3])
        return td__host->fail(TD_EBACKEND,
                              "conv2d: cuDNN's output (%d, %d, %d, %d) is not the node's (%lld, "
                              "%lld, %lld, %lld)",
                              on, oc, oh, ow, (long long)yd[0], (long long)yd[1], (long long)yd[2],
                              (long long)yd[3]);
    size_t limit = g->workspace_bytes;
    int count = 0, i;

    cudnnConvolutionFwdAlgoPerf_t fp[ALGO_MAX];
    TD__CUDNN(cudnnGetConvolutionForwardAlgorithm_v7(g->dnn, s->x, s->w, s->fwd_desc, s->y,
                                                     ALGO_MAX, &count, fp));
    if ((i = pick(fp, count, limit, ctx->conv_winograd)) < 0) return no_algo(n, "forward", limit);
    s->fwd = fp[i].algo;
    TD__TRY(set_math(s->fwd_desc, fp[i].mathType, fma_only));

    if (x->requires_grad) {
        cudnnConvolutionBwdDataAlgoPerf_t dp[ALGO_MAX];
        TD__TRY(conv_desc(n, fma_only, &s->bd_desc));
        TD__CUDNN(cudnnGetConvolutionBackwardDataAlgorithm_v7(g->dnn, s->w, s->y, s->bd_desc, s->x,
                                                              ALGO_MAX, &count, dp));
        if ((i = pick(dp, count, limit, ctx->conv_winograd)) < 0)
            return no_algo(n, "backward-data", limit);
        s->bd = dp[i].algo;
        TD__TRY(set_math(s->bd_desc, dp[i].mathType, fma_only));
        s->has_bd = 1;
    }
    if (w->requires_grad) {
        cudnnConvolutionBwdFilterAlgoPerf_t wp[ALGO_MAX];
        TD__TRY(conv_desc(n, fma_only, &s->bf_desc));
        TD__CUDNN(cudnnGetConvolutionBackwardFilterAlgorithm_v7(g->dnn, s->x, s->y, s->bf_desc,
                                                                s->w, ALGO_MAX, &count, wp));
        if ((i = pick(wp, count, limit, ctx->conv_winograd)) < 0)
            return no_algo(n, "backward-filter", limit);
        s->bf = wp[i].algo;
        TD__TRY(set_math(s->bf_desc, wp[i].mathType, fma_only));
        s->has_bf = 1;
    }
    return TD_OK;
}

static td_status conv_forward(td__op_ctx *ctx, td__node *n) {
    conv_state *s = (conv_state *)n->state;
    td__gpu *g = td__gpu_of(ctx);
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2], *y = n->out;
    const float one = 1.f, zero = 0.f;
    TD__CUDNN(cudnnConvolutionForward(g->dnn, &one, s->x, x->data, s->w, w->data, s->fwd_desc,
                                      s->fwd, g->workspace, g->workspace_bytes, &zero, s->y,
                                      y->data));
    if (b) {
        int64_t N = y->shape.dim[0], C = y->shape.dim[1], HW = y->shape.dim[2] * y->shape.dim[3];
        TD__FLOAT_TYPES(y->dtype, "conv2d bias", {
            td__launch_conv_bias_add(g->stream, (T *)y->data, (const T *)b->data, N, C, HW);
        });
        TD__LAUNCHED("conv2d bias");
    }
    return TD_OK;
}

static td_status conv_backward(td__op_ctx *ctx, td__node *n) {
    conv_state *s = (conv_state *)n->state;
    td__gpu *g = td__gpu_of(ctx);
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2], *y = n->out;
    const float one = 1.f;
    if (s->has_bf && w->requires_grad) {
        float beta = td__grad_beta(w);
        TD__CUDNN(cudnnConvolutionBackwardFilter(g->dnn, &one, s->x, x->data, s->y, y->grad,
                                                 s->bf_desc, s->bf, g->workspace,
                                                 g->workspace_bytes, &beta, s->w, w->grad));
        td__grad_written(w);
    }
    if (b && b->requires_grad) {
        float beta = td__grad_beta(b);
        int64_t N = y->shape.dim[0], C = y->shape.dim[1], HW = y->shape.dim[2] * y->shape.dim[3];
        TD__FLOAT_TYPES(b->dtype, "conv2d backward bias", {
            td__launch_conv_bias_grad(g->stream, (T *)b->grad, (const T *)y->grad, N, C, HW, beta);
        });
        TD__LAUNCHED("conv2d backward bias");
        td__grad_written(b);
    }
    /* The weight gradient is final here; DDP can start on it while backward data runs. */
    ctx->params_ready(ctx, n, 1);
    if (s->has_bd && x->requires_grad) {
        float beta = td__grad_beta(x);
        TD__CUDNN(cudnnConvolutionBackwardData(g->dnn, &one, s->w, w->data, s->y, y->grad,
                                               s->bd_desc, s->bd, g->workspace, g->workspace_bytes,
                                               &beta, s->x, x->grad));
        td__grad_written(x);
    }
    return TD_OK;
}

static void conv_destroy(td__node *n) {
    conv_state *s = (conv_state *)n->state;
    if (!s) return;
    if (s->x) cudnnDestroyTensorDescriptor(s->x);
    if (s->y) cudnnDestroyTensorDescriptor(s->y);
    if (s->w) cudnnDestroyFilterDescriptor(s->w);
    cudnnConvolutionDescriptor_t d[3] = {s->fwd_desc, s->bd_desc, s->bf_desc};
    for (int i = 0; i < 3; i++)
        if (d[i]) cudnnDestroyConvolutionDescriptor(d[i]);
    free(s);
}

const td__kernels td__cuda_conv2d = {conv_compile, conv_forward, conv_backward, conv_destroy, NULL};
