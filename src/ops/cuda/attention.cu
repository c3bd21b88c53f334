/* Causal multi-head self-attention on a GPU, the CPU op's (src/ops/attention.c) semantics: from
 * qkv (rows of [q | k | v], each C = heads x hs wide, sequences of T rows one after another) to
 * y = softmax(q k^T / sqrt(hs) + causal mask) v per head, heads side by side in (rows, C).
 *
 * Fused kernels in FlashAttention's manner (Dao et al. 2022; the backward split as in
 * FlashAttention-2, without its atomics), so the T x T scores never exist beyond one tile: a
 * block takes one (sequence, head) and one tile of positions (tiling.h sizes it from the head
 * size), keeps its tiles in shared memory as f32 and computes in f32 whatever the dtype (f32,
 * bf16 or f16: the op computes in the low dtype under mixed precision, and here it can).
 *   forward  one query tile walks the key tiles up to its own with the online softmax (a running
 *            maximum m and sum l per row, the output rescaled as the maximum grows) and writes
 *            y and lse = m + log(l) per (sequence, head, position): what backward keeps, as the
 *            CPU keeps one log-sum-exp a row.
 *   dq       one query tile: D = do . y per row (the softmax gradient's row term, kept for the
 *            next kernel), then over the key tiles p = exp(s - lse), ds = p (do v^T - D) / sqrt(hs)
 *            and dq = ds k.
 *   dk, dv   one key tile walks the query tiles from its own on, recomputing p and ds:
 *            dv = p^T do, dk = ds^T q.
 * Every value is one thread's sum in a fixed order and each gradient element has one writer, so
 * results are the same bits every run, with no atomics. Backward reads the forward's output y
 * (the op table says so). The two backward kernels write disjoint parts of dqkv under the
 * gradient rule (write when nothing was written since zeroing, add otherwise). */
#include <cstdlib>

#include "ops/cuda/attention.cuh"
#include "ops/cuda/cuda_ops.cuh"

typedef struct {
    td_device device;
    td__att_shape a;
    float *lse; /* (B, H, T) on the device: each row's log-sum-exp, from the last forward */
    float *D;   /* (B, H, T) on the device: do . y per row, in backward */
} att_state;

static td_status att_compile(td__op_ctx *ctx, td__node *n) {
    att_state *s = (att_state *)calloc(1, sizeof *s);
    if (!s) return td__host->fail(TD_ENOMEM, "attention: out of memory");
    n->state = s;
    const td_tensor *x = n->in[0];
    s->device = ctx->device;
    td__att_shape *a = &s->a;
    a->T = n->attr.attn.seq_len;
    a->C = x->shape.dim[x->shape.ndim - 1] / 3;
    a->B = (int64_t)(td__numel(x) / (size_t)(3 * a->C) / (size_t)a->T);
    a->H = n->attr.attn.heads;
    a->hs = a->C / a->H;
    a->tile = td__att_tile(a->hs);
    if (!a->tile)
        return td__host->fail(
            TD_EUNSUPPORTED,
            "attention: '%s' has heads of %lld on a GPU, whose kernels take heads "
            "of at most 253 (more heads, or the CPU)",
            x->name, (long long)a->hs);
    if (a->B * a->H > 0x7fffffff || (a->T + a->tile - 1) / a->tile > 65535)
        return td__host->fail(TD_EUNSUPPORTED,
                              "attention: '%s' has %lld sequences of %lld positions with %lld "
                              "heads, more than a GPU's grid takes",
                              x->name, (long long)a->B, (long long)a->T, (long long)a->H);
    size_t rows = (size_t)(a->B * a->H * a->T) * sizeof(float);
    TD__TRY(td__host->alloc(ctx->device, rows, (void **)&s->lse));
    return x->requires_grad ? td__host->alloc(ctx->device, rows, (void **)&s->D) : TD_OK;
}

static td_status att_forward_run(td__op_ctx *ctx, td__node *n) {
    att_state *s = (att_state *)n->state;
    TD__FLOAT_TYPES(n->out->dtype, "attention", {
        td__launch_att_forward(td__gpu_of(ctx)->stream, &s->a, (T *)n->out->data, s->lse,
                               (const T *)n->in[0]->data);
    });
    TD__LAUNCHED("attention");
    return TD_OK;
}

static td_status att_backward_run(td__op_ctx *ctx, td__node *n) {
    att_state *s = (att_state *)n->state;
    td_tensor *x = n->in[0], *y = n->out;
    if (!x->requires_grad) return TD_OK;
    TD__FLOAT_TYPES(x->dtype, "attention backward", {
        td__launch_att_backward(td__gpu_of(ctx)->stream, &s->a, (T *)x->grad, s->D,
                                (const T *)y->grad, (const T *)y->data, (const T *)x->data, s->lse,
                                td__grad_beta(x));
    });
    TD__LAUNCHED("attention backward");
    td__grad_written(x);
    return TD_OK;
}

static void att_destroy(td__node *n) {
    att_state *s = (att_state *)n->state;
    if (!s) return;
    if (s->lse) td__host->free(s->device, s->lse);
    if (s->D) td__host->free(s->device, s->D);
    free(s);
}

const td__kernels td__cuda_attention = {.compile = att_compile,
                                        .forward = att_forward_run,
                                        .backward = att_backward_run,
                                        .destroy = att_destroy};
