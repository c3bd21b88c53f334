/* Causal multi-head self-attention (GPT-2's attention between its two linears): from the
 * fused projection qkv (rows of [q | k | v], each C = heads x hs wide, T rows per sequence) to
 * y = softmax(q k^T / sqrt(hs) + causal mask) v per head, the heads side by side in (rows, C),
 * as F.scaled_dot_product_attention(is_causal=True) after nanoGPT's split and transposes.
 *
 * Memory: the T x T scores never exist for more than one block of rows of one (sequence, head)
 * at a time (ATT_BLOCK x T floats, twice in backward); what forward keeps for backward is one
 * log-sum-exp per (sequence, head, position), and backward recomputes the probabilities from
 * it (FlashAttention's trade: one more q k^T product for memory that grows as T, not T^2).
 * Only the causal part of each block is multiplied: a block of rows r0.. r1 needs keys 0.. r1.
 * The products are oneDNN's sgemm on strided views of qkv, which threads them itself;
 * softmax and its gradient run in f32. Computes in f32 (bf16 and f16 inputs are cast around
 * it by mixed precision). */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops/cpu/onednn.h"

#define ATT_BLOCK 64

/* ---- the rows' softmax arithmetic ----------------------------------------------------- */

/* The exponentials of the scores are a fifth of the op's time done one expf call at a time; on
 * AVX-512 (chosen at run time: core/cpu.c) they run 16 at a time: exp(x) = 2^n exp(r),
 * n = round(x / ln 2), r = x - n ln 2 in two parts, exp(r) by Cephes' expf polynomial (within
 * 2 ulp of expf on the range softmax sees). */
__attribute__((target("avx512f"))) static __m512 exp16_avx512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-103.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* row[0, n) = exp(row[j] - shift); returns their sum. */
__attribute__((target("avx512f"))) static float exp_row_avx512(float *row, int64_t n, float shift) {
    __m512 sum = _mm512_setzero_ps(), sh = _mm512_set1_ps(shift);
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp16_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), sh));
        _mm512_mask_storeu_ps(row + j, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

static float exp_row(float *row, int64_t n, float shift) {
    if (td__cpu_isa() >= TD__ISA_AVX512) return exp_row_avx512(row, n, shift);
    float sum = 0.f;
    for (int64_t j = 0; j < n; j++) sum += row[j] = expf(row[j] - shift);
    return sum;
}

typedef struct {
    int64_t B, T, C, H, hs, blk;
    float *lse; /* (B, H, T) log-sum-exp of each row's scores, from the last forward */
    float *p;   /* (blk, T) probabilities of one block of rows */
    float *dp;  /* (blk, T) their gradient, in backward */
} att_state;

static td_status att_compile(td__op_ctx *ctx, td__node *n) {
    att_state *s = td__op_alloc(ctx, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "attention: out of memory");
    const td_tensor *x = n->in[0];
    s->T = n->attr.attn.seq_len;
    s->C = x->shape.dim[x->shape.ndim - 1] / 3;
    s->B = td_shape_numel(&x->shape) / (3 * s->C) / s->T;
    s->H = n->attr.attn.heads;
    s->hs = s->C / s->H;
    s->blk = s->T < ATT_BLOCK ? s->T : ATT_BLOCK;
    s->lse = td__op_alloc(ctx, (size_t)(s->B * s->H * s->T) * sizeof(float));
    s->p = td__op_alloc(ctx, (size_t)(s->blk * s->T) * sizeof(float));
    s->dp =
        n->out->requires_grad ? td__op_alloc(ctx, (size_t)(s->blk * s->T) * sizeof(float)) : s->p;
    if (!s->lse || !s->p || !s->dp) return td__fail(TD_ENOMEM, "attention: out of memory");
    n->state = s;
    return TD_OK;
}

/* Row-major C = alpha op(A) op(B) + beta C through oneDNN. */
static td_status gemm(char ta, char tb, int64_t M, int64_t N, int64_t K, float alpha,
                      const float *A, int64_t lda, const float *Bm, int64_t ldb, float beta,
                      float *Cm, int64_t ldc) {
    if (dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, Bm, ldb, beta, Cm, ldc) != dnnl_success)
        return td__fail(TD_EBACKEND, "attention: oneDNN sgemm (%lld x %lld x %lld) failed",
                        (long long)M, (long long)N, (long long)K);
    return TD_OK;
}

/* p (rb, r1) = q[r0, r1) k[0, r1)^T / sqrt(hs) for one (sequence, head). */
static td_status scores(const att_state *s, const float *q, int64_t r0, int64_t rb) {
    int64_t ld = 3 * s->C, r1 = r0 + rb;
    float scale = 1.0f / sqrtf((float)s->hs);
    return gemm('N', 'T', rb, r1, s->hs, scale, q + r0 * ld, ld, q + s->C, ld, 0.f, s->p, r1);
}

static td_status att_forward(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    att_state *s = n->state;
    const float *x = n->in[0]->data;
    float *y = n->out->data;
    int64_t T = s->T, C = s->C, ld = 3 * C;
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t h = 0; h < s->H; h++) {
            const float *q = x + b * T * ld + h * s->hs, *v = q + 2 * C;
            float *o = y + b * T * C + h * s->hs, *lse = s->lse + (b * s->H + h) * T;
            for (int64_t r0 = 0; r0 < T; r0 += s->blk) {
                int64_t rb = T - r0 < s->blk ? T - r0 : s->blk, r1 = r0 + rb;
                TD__TRY(scores(s, q, r0, rb));
                for (int64_t i = 0; i < rb; i++) { /* row t = r0 + i sees keys 0..t */
                    float *row = s->p + i * r1;
                    int64_t t = r0 + i;
                    float m = row[0];
                    for (int64_t j = 1; j <= t; j++) m = row[j] > m ? row[j] : m;
                    float sum = exp_row(row, t + 1, m);
                    float inv = 1.0f / sum;
                    for (int64_t j = 0; j <= t; j++) row[j] *= inv;
                    for (int64_t j = t + 1; j < r1; j++) row[j] = 0.f;
                    lse[t] = m + logf(sum);
                }
                TD__TRY(gemm('N', 'N', rb, s->hs, r1, 1.f, s->p, r1, v, ld, 0.f, o + r0 * C, C));
            }
        }
    return TD_OK;
}

static td_status att_backward(td__op_ctx *ctx, td__node *n) {
    att_state *s = n->state;
    td_tensor *xt = n->in[0];
    if (!xt->requires_grad) return TD_OK;
    const float *x = xt->data, *dy = n->out->grad;
    float *dx = td__grad_begin(ctx, xt, 0);
    memset(dx, 0, xt->bytes); /* every head's dk and dv gather from several blocks */
    int64_t T = s->T, C = s->C, ld = 3 * C;
    float scale = 1.0f / sqrtf((float)s->hs);
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t h = 0; h < s->H; h++) {
            const float *q = x + b * T * ld + h * s->hs, *k = q + C, *v = q + 2 * C;
            const float *d_o = dy + b * T * C + h * s->hs, *lse = s->lse + (b * s->H + h) * T;
            float *dq = dx + b * T * ld + h * s->hs, *dk = dq + C, *dv = dq + 2 * C;
            for (int64_t r0 = 0; r0 < T; r0 += s->blk) {
                int64_t rb = T - r0 < s->blk ? T - r0 : s->blk, r1 = r0 + rb;
                TD__TRY(scores(s, q, r0, rb));
                for (int64_t i = 0; i < rb; i++) {
                    float *row = s->p + i * r1;
                    int64_t t = r0 + i;
                    exp_row(row, t + 1, lse[t]);
                    for (int64_t j = t + 1; j < r1; j++) row[j] = 0.f;
                }
                /* dv[0, r1) += p^T do;  dp = do v[0, r1)^T */
                TD__TRY(gemm('T', 'N', r1, s->hs, rb, 1.f, s->p, r1, d_o + r0 * C, C, 1.f, dv, ld));
                TD__TRY(gemm('N', 'T', rb, r1, s->hs, 1.f, d_o + r0 * C, C, v, ld, 0.f, s->dp, r1));
                /* ds = p (dp - sum_j p dp) / sqrt(hs), into dp */
                for (int64_t i = 0; i < rb; i++) {
                    const float *p = s->p + i * r1;
                    float *g = s->dp + i * r1;
                    float dot = 0.f;
                    for (int64_t j = 0; j <= r0 + i; j++) dot += p[j] * g[j];
                    for (int64_t j = 0; j < r1; j++) g[j] = p[j] * (g[j] - dot) * scale;
                }
                /* dq[r0, r1) += ds k[0, r1);  dk[0, r1) += ds^T q[r0, r1) */
                TD__TRY(
                    gemm('N', 'N', rb, s->hs, r1, 1.f, s->dp, r1, k, ld, 1.f, dq + r0 * ld, ld));
                TD__TRY(
                    gemm('T', 'N', r1, s->hs, rb, 1.f, s->dp, r1, q + r0 * ld, ld, 1.f, dk, ld));
            }
        }
    td__grad_end(ctx, xt);
    return TD_OK;
}

/* sgemm: f32 only; mixed precision casts around it. */
static int att_supports(const td__node *n, td_dtype dtype, const td__op_ctx *ctx) {
    (void)n, (void)ctx;
    return dtype == TD_F32;
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_attention = {
    .compile = att_compile,
    .forward = att_forward,
    .backward = att_backward,
    .supports = att_supports,
};
