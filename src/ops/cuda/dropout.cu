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

#include "core/philox.h"
#include "ops/cuda/cuda_ops.cuh"

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

/* keep[e] for the forward's mask entries: entry e draws word (offset + e) of stream 0, or, keyed
 * by sample, word (sample_delta + e % per_sample) of sample e / per_sample's stream. */
__global__ void draw_kernel(unsigned char *keep, size_t count, const td__gpu_rng_key *k,
                            uint64_t delta, uint64_t sample_delta, int by_sample,
                            uint64_t per_sample, float p) {
    TD__GRID_STRIDE(e, count) {
        uint32_t b[4];
        uint64_t w;
        if (by_sample) {
            w = sample_delta + e % per_sample;
            td__philox4x32_10(k->seed, k->step << 32 | (k->first_sample + e / per_sample), w >> 2,
                              b);
        } else {
            w = k->offset + delta + e;
            td__philox4x32_10(k->seed, 0, w >> 2, b);
        }
        keep[e] = td__philox_uniform(b[w & 3]) >= p;
    }
}

/* y = beta y + x * (scale or 0, as entry i / per_entry of the mask says), multiplied as the
 * CPU does; without a mask (a forward that did not drop) x passes unchanged. Forward (x, y)
 * and backward (dy, dx) alike. */
template <typename T>
__global__ void apply_kernel(T *y, const T *x, const unsigned char *keep, size_t n,
                             size_t per_entry, float scale, float beta) {
    TD__GRID_STRIDE(i, n) {
        float v = keep ? td_ld(x, i) * (keep[i / per_entry] ? scale : 0.f) : td_ld(x, i);
        td_st(y, i, beta != 0.f ? beta * td_ld(y, i) + v : v);
    }
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
    uint64_t per_sample = (uint64_t)(s->count / (size_t)N);
    size_t per_entry = cnt / s->count;
    if (ctx->rng_by_sample && ctx->rng_first_sample + (uint64_t)N > ((uint64_t)1 << 32))
        return td__host->fail(TD_EINVAL, "%s: samples %llu..%llu of the RNG key pass 2^32", n->what,
                              (unsigned long long)ctx->rng_first_sample,
                              (unsigned long long)(ctx->rng_first_sample + (uint64_t)N));
    uint64_t delta = ctx->rng->offset - g->forward_offset, sample_delta = ctx->rng_sample_offset;
    draw_kernel<<<td__blocks(s->count), TD__THREADS, 0, g->stream>>>(
        s->keep, s->count, g->rng_key, delta, sample_delta, ctx->rng_by_sample, per_sample, p);
    TD__LAUNCHED(n->what);
    TD__FLOAT_TYPES(x->dtype, n->what, {
        apply_kernel<T><<<td__blocks(cnt), TD__THREADS, 0, g->stream>>>(
            (T *)y->data, (const T *)x->data, s->keep, cnt, per_entry, keep_scale(p), 0.f);
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
        apply_kernel<T><<<td__blocks(cnt), TD__THREADS, 0, td__gpu_of(ctx)->stream>>>(
            (T *)x->grad, (const T *)y->grad, s->trained ? s->keep : NULL, cnt, cnt / s->count,
            keep_scale(n->attr.p), beta);
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
