/* The negative log-likelihood loss on a GPU. The loss sums its samples in one block in a fixed
 * order, so results do not depend on timing. Labels outside [0, C) are skipped and counted in
 * mapped host memory; the next forward of the node fails naming the first such sample (the GPU
 * cannot stop mid-step to say so). */
#include <cstdlib>

#include "ops/cuda/cuda_ops.cuh"
#include "ops/cuda/nll_loss.cuh"

typedef struct {
    unsigned long long *bad;        /* mapped host memory: the first sample with a label outside
                                       [0, C), or ~0 */
    unsigned long long *bad_device; /* the same memory as the kernel addresses it */
} nll_state;

static td_status nll_compile(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    nll_state *s = (nll_state *)calloc(1, sizeof *s);
    if (!s) return td__host->fail(TD_ENOMEM, "nll_loss: out of memory");
    n->state = s;
    TD__CU(cudaHostAlloc((void **)&s->bad, sizeof *s->bad, cudaHostAllocMapped));
    *s->bad = ~0ull;
    TD__CU(cudaHostGetDevicePointer((void **)&s->bad_device, s->bad, 0));
    return TD_OK;
}

/* A label a finished forward found out of range fails the next forward (replayed or not). */
static td_status nll_check(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    nll_state *s = (nll_state *)n->state;
    if (*(volatile unsigned long long *)s->bad == ~0ull) return TD_OK;
    long long i = (long long)*s->bad;
    *s->bad = ~0ull;
    return td__host->fail(TD_EINVAL,
                          "nll_loss: the label of sample %lld (of a previous step on the GPU) is "
                          "outside [0, %lld)",
                          i, (long long)n->in[0]->shape.dim[1]);
}

static td_status nll_forward(td__op_ctx *ctx, td__node *n) {
    nll_state *s = (nll_state *)n->state;
    const td_tensor *lp = n->in[0];
    td__launch_nll_forward(td__gpu_of(ctx)->stream, (float *)n->out->data, (const float *)lp->data,
                           (const int64_t *)n->in[1]->data, lp->shape.dim[0], lp->shape.dim[1],
                           n->attr.reduction == TD_REDUCTION_MEAN, s->bad_device);
    TD__LAUNCHED("nll_loss");
    return TD_OK;
}

static td_status nll_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *lp = n->in[0];
    int64_t N = lp->shape.dim[0], C = lp->shape.dim[1];
    td__launch_nll_backward(td__gpu_of(ctx)->stream, (float *)lp->grad, (const float *)n->out->grad,
                            (const int64_t *)n->in[1]->data, N, C,
                            n->attr.reduction == TD_REDUCTION_MEAN, td__grad_beta(lp));
    TD__LAUNCHED("nll_loss backward");
    td__grad_written(lp);
    return TD_OK;
}

static void nll_destroy(td__node *n) {
    nll_state *s = (nll_state *)n->state;
    if (!s) return;
    if (s->bad) cudaFreeHost(s->bad);
    free(s);
}

const td__kernels td__cuda_nll = {.compile = nll_compile,
                                  .forward = nll_forward,
                                  .backward = nll_backward,
                                  .destroy = nll_destroy,
                                  .check = nll_check};
