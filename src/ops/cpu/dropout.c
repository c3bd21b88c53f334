/* Dropout and channel-wise dropout (dropout2d) nodes, PyTorch semantics: in training each
 * element (or each (n, c) channel) is kept with probability 1 - p and scaled by 1/(1-p);
 * in eval the node copies. Masks are drawn from the graph's td_rng, so saving that state
 * replays them exactly, or, once td_graph_set_rng_key was called, from each sample's own
 * Philox stream (seed, step, sample index), so that a sample's mask does not depend on the
 * batch it runs in. Plain C (no oneDNN primitive does this); blocked layouts are
 * handled through td__md_offset4. */
#include <stdlib.h>
#include <string.h>

#include "core/philox.h"
#include "ops/cpu/onednn.h"

typedef struct {
    float *mask;  /* (physical floats of x): 0 or 1/(1-p), element-wise dropout */
    float *cmask; /* (N, C): channel-wise dropout */
    int trained;  /* last forward ran in training mode */
} drop_state;

static td_status drop_compile(td__op_ctx *ctx, td__node *n) {
    drop_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "dropout: out of memory");
    n->state = s;
    td_tensor *x = n->in[0], *y = n->out;
    *td__md(y) = *td__md(x);
    y->blocked = x->blocked;
    /* One f32 mask value per element of x's storage, whatever x's dtype. */
    size_t bytes = dnnl_memory_desc_get_size(td__md(x)) / td_dtype_size(x->dtype) * sizeof(float);
    if (n->variant == TD__DROP_CHANNEL) {
        if (x->blocked && td__md_offset4(td__md(x), 0, 0, 0, 0) < 0)
            return td__fail(TD_EUNSUPPORTED, "dropout2d: unsupported input layout for '%s'",
                            x->name);
        bytes = (size_t)(x->shape.dim[0] * x->shape.dim[1]) * sizeof(float);
        s->cmask = td__op_alloc(ctx, bytes);
        if (!s->cmask) return td__fail(TD_ENOMEM, "dropout2d: out of memory");
    } else {
        s->mask = td__op_alloc(ctx, bytes);
        if (!s->mask) return td__fail(TD_ENOMEM, "dropout: out of memory");
    }
    return TD_OK;
}

/* mask[i] = 0 with probability p, else keep: the same numbers as n calls of
 * td_rng_uniform, drawn four per Philox block instead of one. */
static void draw_mask(td_rng *rng, float *mask, size_t n, float p, float keep) {
    size_t i = 0;
    uint32_t block[4];
    while (i < n) {
        td_philox4x32(rng->seed, rng->offset >> 2, block);
        for (unsigned k = (unsigned)(rng->offset & 3); k < 4 && i < n; k++, i++, rng->offset++) {
            float u = td__philox_uniform(block[k]);
            mask[i] = u < p ? 0.f : keep;
        }
    }
}

/* A sample's own stream (td_graph_set_rng_key): its 32-bit words from `word` on. */
typedef struct {
    uint64_t seed, stream, word;
    uint32_t block[4];
} sample_stream;

static void sample_stream_open(sample_stream *st, const td__op_ctx *ctx, int64_t n) {
    st->seed = ctx->rng->seed;
    st->stream = ctx->rng_step << 32 | (ctx->rng_first_sample + (uint64_t)n);
    st->word = ctx->rng_sample_offset;
    td_philox4x32_stream(st->seed, st->stream, st->word >> 2, st->block);
}

static float sample_stream_mask(sample_stream *st, float p, float keep) {
    if ((st->word & 3) == 0) td_philox4x32_stream(st->seed, st->stream, st->word >> 2, st->block);
    float u = td__philox_uniform(st->block[st->word++ & 3]);
    return u < p ? 0.f : keep;
}

/* Masks keyed by sample: sample n's `per_sample` values in logical order from its own stream;
 * mask is (N, per_sample) plain, or the physical layout md of a blocked 4-d tensor (its padding
 * keeps the zeros it was allocated with). Advances the forward's offset past these draws. */
static td_status draw_mask_by_sample(td__op_ctx *ctx, const td_tensor *x, float *mask,
                                     int64_t per_sample, const dnnl_memory_desc_t *md, float p,
                                     float keep) {
    int64_t N = x->shape.dim[0];
    if (ctx->rng_first_sample + (uint64_t)N > ((uint64_t)1 << 32))
        return td__fail(TD_EINVAL, "dropout: samples %llu..%llu of the RNG key pass 2^32",
                        (unsigned long long)ctx->rng_first_sample,
                        (unsigned long long)(ctx->rng_first_sample + (uint64_t)N));
    if (md && (x->shape.ndim != 4 || td__md_offset4(md, 0, 0, 0, 0) < 0))
        return td__fail(TD_EUNSUPPORTED, "dropout: unsupported layout of '%s' for per-sample masks",
                        x->name);
    sample_stream st;
    for (int64_t n = 0; n < N; n++) {
        sample_stream_open(&st, ctx, n);
        if (!md) {
            for (int64_t e = 0; e < per_sample; e++)
                mask[n * per_sample + e] = sample_stream_mask(&st, p, keep);
            continue;
        }
        for (int64_t c = 0; c < x->shape.dim[1]; c++)
            for (int64_t h = 0; h < x->shape.dim[2]; h++)
                for (int64_t w = 0; w < x->shape.dim[3]; w++)
                    mask[td__md_offset4(md, n, c, h, w)] = sample_stream_mask(&st, p, keep);
    }
    ctx->rng_sample_offset += ((uint64_t)per_sample + 3) & ~(uint64_t)3;
    return TD_OK;
}

/* Element access for the kernels below: f32 directly, 16-bit types through f32. */
#define F32_LD(p, i) (((const float *)(p))[i])
#define F32_ST(p, i, v) (((float *)(p))[i] = (v))
#define ANY_LD(p, i) td__load((p), dt, (i))
#define ANY_ST(p, i, v) td__store((p), dt, (i), (v))

/* out = in * cmask[n, c] (or out += ...) over a 4-d tensor in layout md. Dense plain and
 * channel-blocked layouts (what convolutions hand over) walk memory in order with the
 * block's masks in a small table; anything else goes element by element. */
#define APPLY_CHANNELS(name, LD, ST)                                                               \
    static void name(const dnnl_memory_desc_t *md, const td_shape *sh, const float *cm,            \
                     const void *in, void *out, int accumulate, td_dtype dt) {                     \
        (void)dt;                                                                                  \
        int64_t N = sh->dim[0], C = sh->dim[1], H = sh->dim[2], W = sh->dim[3], HW = H * W;        \
        const dnnl_blocking_desc_t *b = &md->format_desc.blocking;                                 \
        int64_t blk = b->inner_nblks == 1 && b->inner_idxs[0] == 1 ? b->inner_blks[0] : 1;         \
        int64_t cblocks = md->padded_dims[1] / blk;                                                \
        int dense = md->format_kind == dnnl_blocked && md->ndims == 4 && blk <= 64 &&              \
                    (b->inner_nblks == 0 || blk > 1) && b->strides[3] == blk &&                    \
                    b->strides[2] == W * blk && b->strides[1] == HW * blk &&                       \
                    b->strides[0] == cblocks * HW * blk;                                           \
        if (!dense) {                                                                              \
            for (int64_t nn = 0; nn < N; nn++)                                                     \
                for (int64_t c = 0; c < C; c++)                                                    \
                    for (int64_t h = 0; h < H; h++)                                                \
                        for (int64_t w = 0; w < W; w++) {                                          \
                            size_t o = (size_t)td__md_offset4(md, nn, c, h, w);                    \
                            float v = LD(in, o) * cm[nn * C + c];                                  \
                            ST(out, o, accumulate ? LD(out, o) + v : v);                           \
                        }                                                                          \
            return;                                                                                \
        }                                                                                          \
        float lane_mask[64];                                                                       \
        for (int64_t nn = 0; nn < N; nn++)                                                         \
            for (int64_t cb = 0; cb < cblocks; cb++) {                                             \
                for (int64_t l = 0; l < blk; l++) {                                                \
                    int64_t c = cb * blk + l;                                                      \
                    lane_mask[l] = c < C ? cm[nn * C + c] : 0.f; /* padding stays zero */          \
                }                                                                                  \
                size_t base = (size_t)((nn * cblocks + cb) * HW * blk);                            \
                for (int64_t i = 0; i < HW; i++, base += (size_t)blk)                              \
                    for (int64_t l = 0; l < blk; l++) {                                            \
                        float v = LD(in, base + (size_t)l) * lane_mask[l];                         \
                        ST(out, base + (size_t)l, accumulate ? LD(out, base + (size_t)l) + v : v); \
                    }                                                                              \
            }                                                                                      \
    }

APPLY_CHANNELS(apply_channels_f32, F32_LD, F32_ST)
APPLY_CHANNELS(apply_channels_any, ANY_LD, ANY_ST)

/* out = in * mask (or out += ...) element by element over n elements. */
#define APPLY_ELEMENTS(name, LD, ST)                                                         \
    static void name(const float *mask, const void *in, void *out, size_t n, int accumulate, \
                     td_dtype dt) {                                                          \
        (void)dt;                                                                            \
        for (size_t i = 0; i < n; i++) {                                                     \
            float v = mask ? LD(in, i) * mask[i] : LD(in, i);                                \
            ST(out, i, accumulate ? LD(out, i) + v : v);                                     \
        }                                                                                    \
    }

APPLY_ELEMENTS(apply_elements_f32, F32_LD, F32_ST)
APPLY_ELEMENTS(apply_elements_any, ANY_LD, ANY_ST)

static td_status drop_forward(td__op_ctx *ctx, td__node *n) {
    drop_state *s = n->state;
    td_tensor *x = n->in[0], *y = n->out;
    size_t total = td__nelems(x);
    float p = n->attr.p;
    s->trained = ctx->training && p > 0.f;
    if (!s->trained) {
        memcpy(y->data, x->data, x->bytes);
        return TD_OK;
    }
    float keep = p >= 1.f ? 0.f : 1.f / (1.f - p);
    int f32 = x->dtype == TD_F32;
    int64_t N = x->shape.dim[0];
    if (n->variant == TD__DROP_CHANNEL) {
        int64_t nc = N * x->shape.dim[1];
        if (ctx->rng_by_sample)
            TD__TRY(draw_mask_by_sample(ctx, x, s->cmask, x->shape.dim[1], NULL, p, keep));
        else
            draw_mask(ctx->rng, s->cmask, (size_t)nc, p, keep);
        (f32 ? apply_channels_f32 : apply_channels_any)(td__md(x), &x->shape, s->cmask, x->data,
                                                        y->data, 0, x->dtype);
    } else {
        if (ctx->rng_by_sample)
            TD__TRY(draw_mask_by_sample(ctx, x, s->mask, td_shape_numel(&x->shape) / N,
                                        x->blocked ? td__md(x) : NULL, p, keep));
        else
            draw_mask(ctx->rng, s->mask, total, p, keep);
        (f32 ? apply_elements_f32 : apply_elements_any)(s->mask, x->data, y->data, total, 0,
                                                        x->dtype);
    }
    return TD_OK;
}

static td_status drop_backward(td__op_ctx *ctx, td__node *n) {
    drop_state *s = n->state;
    td_tensor *x = n->in[0];
    int acc = !x->grad_zero, f32 = x->dtype == TD_F32;
    const void *dy = n->out->grad;
    if (n->variant == TD__DROP_CHANNEL && s->trained)
        (f32 ? apply_channels_f32 : apply_channels_any)(td__md(x), &x->shape, s->cmask, dy, x->grad,
                                                        acc, x->dtype);
    else
        (f32 ? apply_elements_f32 : apply_elements_any)(s->trained ? s->mask : NULL, dy, x->grad,
                                                        td__nelems(x), acc, x->dtype);
    x->grad_zero = 0;
    (void)ctx;
    return TD_OK;
}

static void drop_destroy(td__node *n) { free(n->state); }

/* The CPU backend's kernels. */
const td__kernels td__cpu_dropout = {
    .compile = drop_compile,
    .forward = drop_forward,
    .backward = drop_backward,
    .destroy = drop_destroy,
};
