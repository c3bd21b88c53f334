/* L2 normalisation of the rows of an f32 (N, D) tensor on a GPU (F.normalize(x, dim=1)), as the
 * CPU op computes it: the squared norm summed in double (here in a fixed tree, one block per
 * row), y = x / max(||x||, eps), and backward dx = dy / norm - x (x . dy) / norm^3 for rows
 * longer than eps, dy / eps for the others. The norms of the last forward stay on the device. */
#include <cstdlib>

#include "ops/cuda/cuda_ops.cuh"
#include "ops/cuda/normalize.cuh"

typedef struct {
    double *norm; /* (N) on the device: max(||x_i||, eps), negated where ||x_i|| < eps */
    td_device device;
} norm_state;

static td_status norm_compile(td__op_ctx *ctx, td__node *n) {
    norm_state *s = (norm_state *)calloc(1, sizeof *s);
    if (!s) return td__host->fail(TD_ENOMEM, "normalize: out of memory");
    n->state = s;
    s->device = ctx->device;
    return td__host->alloc(ctx->device, (size_t)n->in[0]->shape.dim[0] * sizeof(double),
                           (void **)&s->norm);
}

static td_status norm_forward(td__op_ctx *ctx, td__node *n) {
    norm_state *s = (norm_state *)n->state;
    const td_tensor *x = n->in[0];
    td__launch_norm_forward(td__gpu_of(ctx)->stream, (float *)n->out->data, s->norm,
                            (const float *)x->data, (unsigned)x->shape.dim[0], x->shape.dim[1],
                            n->attr.eps);
    TD__LAUNCHED("normalize");
    return TD_OK;
}

static td_status norm_backward(td__op_ctx *ctx, td__node *n) {
    norm_state *s = (norm_state *)n->state;
    td_tensor *x = n->in[0];
    td__launch_norm_backward(td__gpu_of(ctx)->stream, (float *)x->grad, (const float *)n->out->grad,
                             (const float *)x->data, s->norm, (unsigned)x->shape.dim[0],
                             x->shape.dim[1], td__grad_beta(x));
    TD__LAUNCHED("normalize backward");
    td__grad_written(x);
    return TD_OK;
}

static void norm_destroy(td__node *n) {
    norm_state *s = (norm_state *)n->state;
    if (!s) return;
    if (s->norm) td__host->free(s->device, s->norm);
    free(s);
}

const td__kernels td__cuda_normalize = {.compile = norm_compile,
                                        .forward = norm_forward,
                                        .backward = norm_backward,
                                        .destroy = norm_destroy};
