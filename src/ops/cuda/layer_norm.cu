/* The layer norm node on a GPU (nn.LayerNorm over the last dim), in f32 as the CPU op
 * (src/ops/layer_norm.c) computes at every mixed precision level. Forward: one block per row,
 * the mean and then the biased variance of the row reduced in a fixed tree, y = (x - mean) rstd
 * w + b; the rows' mean and rstd = 1 / sqrt(var + eps) are kept for backward (2 floats a row, as
 * the CPU keeps mean and variance). Backward: dx one block per row, dx = rstd (gw - mean(gw) -
 * xhat mean(gw xhat)) with gw = dy w; the weight and bias gradients, sums over every row, in two
 * stages with no atomics: blocks of 32 columns by a chunk of rows (tiling.h) each write a partial
 * sum, then one thread per column adds the partial sums in chunk order. Every sum has a fixed
 * order, so the results are the same bits every run. */
#include <cstdlib>

#include "ops/cuda/cuda_ops.cuh"
#include "ops/cuda/tiling.h"

#define LN_COLS 32                       /* columns of one stage-one block */
#define LN_LANES (TD__THREADS / LN_COLS) /* rows a stage-one block reads at once */

typedef struct {
    td_device device;
    float *stats;   /* (2, rows) on the device: mean, then rstd, of the last forward */
    float *partial; /* (2, chunks, C) on the device: weight, then bias, partial gradients */
    int64_t rows, C, chunk_rows, chunks;
} ln_state;

__global__ void ln_forward_kernel(float *y, float *mean, float *rstd, const float *x,
                                  const float *w, const float *b, int64_t C, float eps) {
    size_t at = (size_t)blockIdx.x * (size_t)C;
    const float *xr = x + at;
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += xr[c];
    float m = td__block_reduce(s, 0) / (float)C;
    float q = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) q += (xr[c] - m) * (xr[c] - m);
    float rs = 1.f / sqrtf(td__block_reduce(q, 0) / (float)C + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float v = (xr[c] - m) * rs;
        y[at + c] = v * (w ? w[c] : 1.f) + (b ? b[c] : 0.f);
    }
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = m;
        rstd[blockIdx.x] = rs;
    }
}

/* dx = beta dx + rstd (gw - sum(gw) / C - xhat sum(gw xhat) / C), one block per row. */
__global__ void ln_dx_kernel(float *dx, const float *dy, const float *x, const float *w,
                             const float *mean, const float *rstd, int64_t C, float beta) {
    size_t at = (size_t)blockIdx.x * (size_t)C;
    float m = mean[blockIdx.x], rs = rstd[blockIdx.x], sg = 0.f, sgx = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float gw = dy[at + c] * (w ? w[c] : 1.f);
        sg += gw;
        sgx += gw * (x[at + c] - m) * rs;
    }
    sg = td__block_reduce(sg, 0) / (float)C;
    sgx = td__block_reduce(sgx, 0) / (float)C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float gw = dy[at + c] * (w ? w[c] : 1.f), xh = (x[at + c] - m) * rs;
        float d = rs * (gw - sg - xh * sgx);
        dx[at + c] = beta != 0.f ? beta * dx[at + c] + d : d;
    }
}

/* Stage one: block (column tile, chunk) sums dy xhat and dy over the chunk's rows for its 32
 * columns, LN_LANES rows at a time, then the lanes in order; into partial[0 or 1][chunk][c]. */
__global__ void ln_params_partial(float *partial, const float *dy, const float *x,
                                  const float *mean, const float *rstd, int64_t rows, int64_t C,
                                  int64_t chunk_rows) {
    __shared__ float sw[LN_LANES][LN_COLS], sb[LN_LANES][LN_COLS];
    int col = threadIdx.x % LN_COLS, lane = threadIdx.x / LN_COLS;
    int64_t c = (int64_t)blockIdx.x * LN_COLS + col, chunk = blockIdx.y;
    int64_t r0 = chunk * chunk_rows, r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    float aw = 0.f, ab = 0.f;
    if (c < C)
        for (int64_t r = r0 + lane; r < r1; r += LN_LANES) {
            size_t at = (size_t)(r * C + c);
            aw += dy[at] * (x[at] - mean[r]) * rstd[r];
            ab += dy[at];
        }
    sw[lane][col] = aw;
    sb[lane][col] = ab;
    __syncthreads();
    if (lane != 0 || c >= C) return;
    for (int l = 1; l < LN_LANES; l++) {
        aw += sw[l][col];
        ab += sb[l][col];
    }
    int64_t chunks = gridDim.y;
    partial[chunk * C + c] = aw;
    partial[(chunks + chunk) * C + c] = ab;
}

/* Stage two: dw[c] = beta_w dw[c] + the partial sums of column c in chunk order (db alike);
 * dw or db NULL when not wanted. */
__global__ void ln_params_sum(float *dw, float *db, const float *partial, int64_t chunks, int64_t C,
                              float beta_w, float beta_b) {
    TD__GRID_STRIDE(c, (size_t)C) {
        float w = 0.f, b = 0.f;
        for (int64_t k = 0; k < chunks; k++) {
            w += partial[k * C + (int64_t)c];
            b += partial[(chunks + k) * C + (int64_t)c];
        }
        if (dw) dw[c] = beta_w != 0.f ? beta_w * dw[c] + w : w;
        if (db) db[c] = beta_b != 0.f ? beta_b * db[c] + b : b;
    }
}

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
    s->chunk_rows = td__ln_chunk_rows(s->rows);
    s->chunks = td__ln_chunks(s->rows);
    TD__TRY(
        td__host->alloc(ctx->device, (size_t)(2 * s->rows) * sizeof(float), (void **)&s->stats));
    if (!(n->in[1] && n->in[1]->requires_grad) && !(n->in[2] && n->in[2]->requires_grad))
        return TD_OK;
    return td__host->alloc(ctx->device, (size_t)(2 * s->chunks * s->C) * sizeof(float),
                           (void **)&s->partial);
}

static td_status ln_forward(td__op_ctx *ctx, td__node *n) {
    ln_state *s = (ln_state *)n->state;
    const td_tensor *w = n->in[1], *b = n->in[2];
    ln_forward_kernel<<<(unsigned)s->rows, TD__THREADS, 0, td__gpu_of(ctx)->stream>>>(
        (float *)n->out->data, s->stats, s->stats + s->rows, (const float *)n->in[0]->data,
        w ? (const float *)w->data : NULL, b ? (const float *)b->data : NULL, s->C, n->attr.eps);
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
        dim3 grid((unsigned)((s->C + LN_COLS - 1) / LN_COLS), (unsigned)s->chunks);
        ln_params_partial<<<grid, TD__THREADS, 0, st>>>(s->partial, dy, (const float *)x->data,
                                                        mean, rstd, s->rows, s->C, s->chunk_rows);
        TD__LAUNCHED("layer_norm backward");
        ln_params_sum<<<td__blocks((size_t)s->C), TD__THREADS, 0, st>>>(
            want_w ? (float *)w->grad : NULL, want_b ? (float *)b->grad : NULL, s->partial,
            s->chunks, s->C, want_w ? td__grad_beta(w) : 0.f, want_b ? td__grad_beta(b) : 0.f);
        TD__LAUNCHED("layer_norm backward");
        if (want_w) td__grad_written(w);
        if (want_b) td__grad_written(b);
    }
    if (x->requires_grad) {
        ln_dx_kernel<<<(unsigned)s->rows, TD__THREADS, 0, st>>>(
            (float *)x->grad, dy, (const float *)x->data, w ? (const float *)w->data : NULL, mean,
            rstd, s->C, td__grad_beta(x));
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
