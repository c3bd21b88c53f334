/* The layer norm node on a GPU (nn.LayerNorm over the last dim), in f32 as the CPU op
 * (src/ops/layer_norm.c) computes at every mixed precision level. Forward: one block per row,
 * the mean and then the biased variance of the row reduced in a fixed tree, y = (x - mean) rstd
 * w + b; the rows' mean and rstd = 1 / sqrt(var + eps) are kept for backward (2 floats a row, as
 * the CPU keeps mean and variance). Backward: dx one block per row, dx = rstd (gw - mean(gw) -
 * xhat mean(gw xhat)) with gw = dy w; the weight and bias gradients, sums over every row, in two
 * stages with no atomics (layer_norm.cuh's kernels). Every sum has a fixed order, so the results
 * are the same bits every run. */
#include <cstdlib>

#include "ops/cuda/cuda_ops.cuh"
#include "ops/cuda/layer_norm.cuh"

typedef struct {
    td_device device;
    float *stats;   /* (2, rows) on the device: mean, then rstd, of the last forward */
    float *partial; /* (2, chunks, C) on the device: weight, then bias, partial gradients */
    int64_t rows, C;
} ln_state;

static td_status ln_compile(td__op_ctx *ctx, td__node *n) {
    ln_state *s = (ln_state *)calloc(1, sizeof *s);
    if (!s) return td__host->fail(TD_ENOMEM, "layer_norm: out of memory");
    n->state = s;
    const td_tensor *x = n->in[0];
    s->device = ctx->device;
    s->C = x->shape.dim[x->shape.ndim - 1];
    s->rows = (int64_t)(td__numel(x) / (size_t)s->C);
    if (s->rows > 0x7fffffff)
        return td__host->fail(TD_EUNSUPPORTED,
                              "layer_norm: '%s' has %lld rows (a GPU's grid "
                              "takes < 2^31)",
                              x->name, (long long)s->rows);
    TD__TRY(
        td__host->alloc(ctx->device, (size_t)(2 * s->rows) * sizeof(float), (void **)&s->stats));
    if (!(n->in[1] && n->in[1]->requires_grad) && !(n->in[2] && n->in[2]->requires_grad))
        return TD_OK;
    return td__host->alloc(ctx->device, (size_t)(2 * td__partials(s->rows) * s->C) * sizeof(float),
                           (void **)&s->partial);
}

static td_status ln_forward(td__op_ctx *ctx, td__node *n) {
    ln_state *s = (ln_state *)n->state;
    const td_tensor *w = n->in[1], *b = n->in[2];
    td__launch_ln_forward(td__gpu_of(ctx)->stream, (float *)n->out->data, s->stats,
                          s->stats + s->rows, (const float *)n->in[0]->data,
                          w ? (const float *)w->data : NULL, b ? (const float *)b->data : NULL,
                          s->rows, s->C, n->attr.ln.eps);
    TD__LAUNCHED("layer_norm");
    return TD_OK;
}

static td_status ln_backward(td__op_ctx *ctx, td__node *n) {
    ln_state *s = (ln_state *)n->state;
    cudaStream_t st = td__gpu_of(ctx)->stream;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    const float *dy = (const float *)n->out->grad, *mean = s->stats, *rstd = s->stats + s->rows;
    int want_w = w && w->requires_grad, want_b = b && b->requires_grad;
    if (want_w || want_b) {
        td__launch_ln_params(st, want_w ? (float *)w->grad : NULL, want_b ? (float *)b->grad : NULL,
                             s->partial, dy, (const float *)x->data, mean, rstd, s->rows, s->C,
                             want_w ? td__grad_beta(w) : 0.f, want_b ? td__grad_beta(b) : 0.f);
        TD__LAUNCHED("layer_norm backward");
        if (want_w) td__grad_written(w);
        if (want_b) td__grad_written(b);
    }
    if (x->requires_grad) {
        td__launch_ln_dx(st, (float *)x->grad, dy, (const float *)x->data,
                         w ? (const float *)w->data : NULL, mean, rstd, s->rows, s->C,
                         td__grad_beta(x));
        TD__LAUNCHED("layer_norm backward");
        td__grad_written(x);
    }
    return TD_OK;
}

static void ln_destroy(td__node *n) {
    ln_state *s = (ln_state *)n->state;
    if (!s) return;
    if (s->stats) td__host->free(s->device, s->stats);
    if (s->partial) td__host->free(s->device, s->partial);
    free(s);
}

const td__kernels td__cuda_layer_norm = {
    .compile = ln_compile, .forward = ln_forward, .backward = ln_backward, .destroy = ln_destroy};
