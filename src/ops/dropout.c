/* Dropout and channel-wise dropout (dropout2d) nodes, PyTorch semantics: in training each
 * element (or each (n, c) channel) is kept with probability 1 - p and scaled by 1/(1-p);
 * in eval the node copies. Masks are drawn from the graph's td_rng, so saving that state
 * replays them exactly. Plain C (no oneDNN primitive does this); blocked layouts are
 * handled through td__md_offset4. */
#include <stdlib.h>
#include <string.h>

#include "ops/onednn.h"

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
    y->md = x->md;
    y->blocked = x->blocked;
    size_t bytes = dnnl_memory_desc_get_size(&x->md);
    if (n->variant == TD__DROP_CHANNEL) {
        if (x->blocked && td__md_offset4(&x->md, 0, 0, 0, 0) < 0)
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
            float u = (float)(block[k] >> 8) * (1.0f / 16777216.0f);
            mask[i] = u < p ? 0.f : keep;
        }
    }
}

/* out = in * cmask[n, c] (or out += ...) over a 4-d tensor in layout md. Dense plain and
 * channel-blocked layouts (what convolutions hand over) walk memory in order with the
 * block's masks in a small table; anything else goes element by element. */
static void apply_channels(const dnnl_memory_desc_t *md, const td_shape *sh, const float *cm,
                           const float *in, float *out, int accumulate) {
    int64_t N = sh->dim[0], C = sh->dim[1], H = sh->dim[2], W = sh->dim[3], HW = H * W;
    const dnnl_blocking_desc_t *b = &md->format_desc.blocking;
    int64_t blk = b->inner_nblks == 1 && b->inner_idxs[0] == 1 ? b->inner_blks[0] : 1;
    int64_t cblocks = md->padded_dims[1] / blk;
    int dense = md->format_kind == dnnl_blocked && md->ndims == 4 && blk <= 64 &&
                (b->inner_nblks == 0 || blk > 1) && b->strides[3] == blk &&
                b->strides[2] == W * blk && b->strides[1] == HW * blk &&
                b->strides[0] == cblocks * HW * blk;
    if (!dense) {
        for (int64_t nn = 0; nn < N; nn++)
            for (int64_t c = 0; c < C; c++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t w = 0; w < W; w++) {
                        int64_t o = td__md_offset4(md, nn, c, h, w);
                        float v = in[o] * cm[nn * C + c];
                        out[o] = accumulate ? out[o] + v : v;
                    }
        return;
    }
    float lane_mask[64];
    for (int64_t nn = 0; nn < N; nn++)
        for (int64_t cb = 0; cb < cblocks; cb++) {
            for (int64_t l = 0; l < blk; l++) {
                int64_t c = cb * blk + l;
                lane_mask[l] = c < C ? cm[nn * C + c] : 0.f; /* padded channels stay zero */
            }
            size_t base = (size_t)((nn * cblocks + cb) * HW * blk);
            const float *src = in + base;
            float *dst = out + base;
            for (int64_t i = 0; i < HW; i++, src += blk, dst += blk)
                for (int64_t l = 0; l < blk; l++) {
                    float v = src[l] * lane_mask[l];
                    dst[l] = accumulate ? dst[l] + v : v;
                }
        }
}

static td_status drop_forward(td__op_ctx *ctx, td__node *n) {
    drop_state *s = n->state;
    td_tensor *x = n->in[0], *y = n->out;
    const float *in = x->data;
    float *out = y->data;
    size_t total = td__nfloats(x);
    float p = n->attr.p;
    s->trained = ctx->training && p > 0.f;
    if (!s->trained) {
        memcpy(out, in, x->bytes);
        return TD_OK;
    }
    float keep = p >= 1.f ? 0.f : 1.f / (1.f - p);
    if (n->variant == TD__DROP_CHANNEL) {
        int64_t nc = x->shape.dim[0] * x->shape.dim[1];
        draw_mask(ctx->rng, s->cmask, (size_t)nc, p, keep);
        apply_channels(&x->md, &x->shape, s->cmask, in, out, 0);
    } else {
        draw_mask(ctx->rng, s->mask, total, p, keep);
        for (size_t i = 0; i < total; i++) out[i] = in[i] * s->mask[i];
    }
    return TD_OK;
}

static td_status drop_backward(td__op_ctx *ctx, td__node *n) {
    drop_state *s = n->state;
    td_tensor *x = n->in[0];
    const float *dy = n->out->grad;
    size_t total = td__nfloats(x);
    int acc = !x->grad_zero;
    float *dx = x->grad;
    if (!s->trained) {
        for (size_t i = 0; i < total; i++) dx[i] = acc ? dx[i] + dy[i] : dy[i];
    } else if (n->variant == TD__DROP_CHANNEL) {
        apply_channels(&x->md, &x->shape, s->cmask, dy, dx, acc);
    } else {
        for (size_t i = 0; i < total; i++) dx[i] = (acc ? dx[i] : 0.f) + dy[i] * s->mask[i];
    }
    x->grad_zero = 0;
    (void)ctx;
    return TD_OK;
}

static void drop_destroy(td__node *n) { free(n->state); }

static td_status drop_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    float p = n->attr.p;
    if (!(p >= 0.f && p <= 1.f))
        return td__fail(TD_EINVAL, "%s: p = %g, must be in [0, 1]", n->what, (double)p);
    if (x->dtype != TD_F32)
        return td__fail(TD_EDTYPE, "%s: input '%s' must be f32", n->what, x->name);
    if (n->variant == TD__DROP_CHANNEL && x->shape.ndim != 4)
        return td__fail(TD_ESHAPE, "dropout2d: input '%s' must be (N, C, H, W), got %d dims",
                        x->name, x->shape.ndim);
    *shape = x->shape;
    *dtype = TD_F32;
    return TD_OK;
}

const td__op td__op_dropout = {
    .name = "dropout",
    .propagates_layout = 1,
    .infer = drop_infer,
    .compile = drop_compile,
    .forward = drop_forward,
    .backward = drop_backward,
    .destroy = drop_destroy,
};
