/* Dropout and channel-wise dropout (dropout2d) on a GPU, drawing the same Philox words as the
 * CPU op (src/ops/cpu/dropout.c), so a mask is the same bits on either device: element i of a
 * forward draws word (offset + i) of stream 0, or, keyed by sample (td_graph_set_rng_key),
 * word (sample_offset + e) of sample n's stream (step << 32 | first_sample + n). The CPU
 * draws element masks over its storage, so the two agree where the CPU's layout is plain
 * (always for dropout after a linear, and for dropout2d, whose masks are per (n, c)).
 *
 * Offsets are read from the device copy of the forward's RNG key (backend.cu uploads it before
 * each forward) plus what earlier nodes of the forward drew, so a captured forward replays
 * with fresh masks. The mask is kept as one byte per element (or per channel) for backward. */
#include <cstdlib>

#include "ops/cuda/cuda_ops.cuh"
#include "ops/cuda/dropout.cuh"

typedef struct {
    unsigned char *keep; /* (numel) or (N, C) on the device: 1 keeps the element */
    size_t count;        /* entries of keep */
    td_device device;
    int trained; /* the last forward dropped (training and p > 0) */
} drop_state;

static td_status drop_compile(td__op_ctx *ctx, td__node *n) {
    drop_state *s = (drop_state *)calloc(1, sizeof *s);
    if (!s) return td__host->fail(TD_ENOMEM, "%s: out of memory", n->what);
    n->state = s;
    td_tensor *x = n->in[0];
    s->device = ctx->device;
    s->count =
        n->variant == TD__DROP_CHANNEL ? (size_t)(x->shape.dim[0] * x->shape.dim[1]) : td__numel(x);
    return td__host->alloc(ctx->device, s->count ? s->count : 1, (void **)&s->keep);
}

td_status td__cuda_rng_key_create(td__gpu *g) {
    return td__host->alloc(g->device, sizeof *g->rng_key, (void **)&g->rng_key);
}

td_status td__cuda_rng_key_write(td__op_ctx *ctx) {
    td__gpu *g = td__gpu_of(ctx);
    td__gpu_rng_key key = {ctx->rng->seed, ctx->rng->offset, ctx->rng_step, ctx->rng_first_sample};
    g->forward_offset = key.offset;
    TD__CU(cudaMemcpyAsync(g->rng_key, &key, sizeof key, cudaMemcpyHostToDevice, g->stream));
    return TD_OK;
}

static float keep_scale(float p) { return p >= 1.f ? 0.f : 1.f / (1.f - p); }

static td_status drop_forward(td__op_ctx *ctx, td__node *n) {
    drop_state *s = (drop_state *)n->state;
    td__gpu *g = td__gpu_of(ctx);
    td_tensor *x = n->in[0], *y = n->out;
    float p = n->attr.p;
    s->trained = ctx->training && p > 0.f;
    size_t cnt = td__numel(x);
    if (!s->trained)
        return td__cuda_add_into(ctx, y->data, y->dtype, x->data, x->dtype, cnt, 1.f, 0.f, n->what);
    int64_t N = x->shape.dim[0];
    uint64_t per_sample = td__dropout_per_sample(s->count, N);
    if (ctx->rng_by_sample && ctx->rng_first_sample + (uint64_t)N > ((uint64_t)1 << 32))
        return td__host->fail(TD_EINVAL, "%s: samples %llu..%llu of the RNG key pass 2^32", n->what,
                              (unsigned long long)ctx->rng_first_sample,
                              (unsigned long long)(ctx->rng_first_sample + (uint64_t)N));
    uint64_t delta = ctx->rng->offset - g->forward_offset, sample_delta = ctx->rng_sample_offset;
    td__launch_dropout_draw(g->stream, s->keep, s->count, N, g->rng_key, delta, sample_delta,
                            ctx->rng_by_sample, p);
    TD__LAUNCHED(n->what);
    TD__FLOAT_TYPES(x->dtype, n->what, {
        td__launch_dropout_apply(g->stream, (T *)y->data, (const T *)x->data, s->keep, cnt,
                                 s->count, keep_scale(p), 0.f);
    });
    TD__LAUNCHED(n->what);
    /* The host's account of the draws, as the CPU op keeps it. */
    if (ctx->rng_by_sample)
        ctx->rng_sample_offset += (per_sample + 3) & ~(uint64_t)3;
    else
        ctx->rng->offset += s->count;
    return TD_OK;
}

static td_status drop_backward(td__op_ctx *ctx, td__node *n) {
    drop_state *s = (drop_state *)n->state;
    td_tensor *x = n->in[0], *y = n->out;
    size_t cnt = td__numel(x);
    float beta = td__grad_beta(x);
    TD__FLOAT_TYPES(x->dtype, n->what, {
        td__launch_dropout_apply(td__gpu_of(ctx)->stream, (T *)x->grad, (const T *)y->grad,
                                 s->trained ? s->keep : NULL, cnt, s->count, keep_scale(n->attr.p),
                                 beta);
    });
    TD__LAUNCHED(n->what);
    td__grad_written(x);
    return TD_OK;
}

static void drop_destroy(td__node *n) {
    drop_state *s = (drop_state *)n->state;
    if (!s) return;
    if (s->keep) td__host->free(s->device, s->keep);
    free(s);
}

const td__kernels td__cuda_dropout = {.compile = drop_compile,
                                      .forward = drop_forward,
                                      .backward = drop_backward,
                                      .destroy = drop_destroy};
