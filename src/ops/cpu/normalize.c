/* The L2-normalisation node (F.normalize(x, p=2, dim=1)): each row of a plain (N, D) tensor
 * divided by max(||row||, eps), the usual last step before a cosine similarity (contrastive
 * losses compare unit vectors). Backward: dx = (dy - y (y . dy)) / ||x|| for rows longer than
 * eps and dy / eps for the others, from x and the norms saved by forward. In f32, plain C. */
#include <math.h>
#include <stdlib.h>

#include "ops/cpu/onednn.h"

typedef struct {
    double *norm;           /* (N) max(||x_i||, eps) of the last forward */
    unsigned char *clamped; /* (N) the row's norm was below eps */
} norm_state;

static td_status norm_compile(td__op_ctx *ctx, td__node *n) {
    norm_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "normalize: out of memory");
    n->state = s;
    size_t N = (size_t)n->in[0]->shape.dim[0];
    s->norm = td__op_alloc(ctx, N * sizeof *s->norm);
    s->clamped = td__op_alloc(ctx, N);
    if (!s->norm || !s->clamped) return td__fail(TD_ENOMEM, "normalize: out of memory");
    return TD_OK;
}

static td_status norm_forward(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    norm_state *s = n->state;
    const td_tensor *x = n->in[0];
    int64_t N = x->shape.dim[0], D = x->shape.dim[1];
    const float *xd = x->data;
    float *y = n->out->data;
    for (int64_t i = 0; i < N; i++) {
        const float *row = xd + i * D;
        double sq = 0;
        for (int64_t j = 0; j < D; j++) sq += (double)row[j] * row[j];
        double norm = sqrt(sq);
        s->clamped[i] = norm < n->attr.eps;
        if (s->clamped[i]) norm = n->attr.eps;
        s->norm[i] = norm;
        for (int64_t j = 0; j < D; j++) y[i * D + j] = (float)(row[j] / norm);
    }
    return TD_OK;
}

static td_status norm_backward(td__op_ctx *ctx, td__node *n) {
    norm_state *s = n->state;
    td_tensor *x = n->in[0];
    int64_t N = x->shape.dim[0], D = x->shape.dim[1];
    const float *xd = x->data, *dy = n->out->grad;
    float *dx = td__grad_begin(ctx, x, 0);
    for (int64_t i = 0; i < N; i++) {
        const float *row = xd + i * D, *g = dy + i * D;
        double norm = s->norm[i], dot = 0;
        if (!s->clamped[i])
            for (int64_t j = 0; j < D; j++) dot += (double)row[j] * g[j];
        double k = dot / (norm * norm * norm);
        for (int64_t j = 0; j < D; j++) dx[i * D + j] = (float)(g[j] / norm - row[j] * k);
    }
    td__grad_end(ctx, x);
    return TD_OK;
}

static void norm_destroy(td__node *n) { free(n->state); }

/* The CPU backend's kernels. */
const td__kernels td__cpu_normalize = {
    .compile = norm_compile,
    .forward = norm_forward,
    .backward = norm_backward,
    .destroy = norm_destroy,
};
