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
#include <cmath>
#include <cstdlib>

#include "ops/cuda/cuda_ops.cuh"
#include "ops/cuda/tiling.h"

/* Where one (sequence b, head h) lives: position t's q at qkv + t * 3C + q_at (k C later, v 2C
 * later), its output at y + t * C + y_at, its log-sum-exp at lse[bh * T + t]. */
struct head_at {
    size_t q_at, y_at, bh;
};

__device__ __forceinline__ head_at head_of(int64_t T_, int64_t C, int H, int64_t hs) {
    head_at a;
    int64_t bh = blockIdx.x, b = bh / H, h = bh % H;
    a.q_at = (size_t)(b * T_ * 3 * C + h * hs);
    a.y_at = (size_t)(b * T_ * C + h * hs);
    a.bh = (size_t)bh;
    return a;
}

/* rows x hs values from src (row r at src + (first + r) * ld) into dst (r, hs) as f32. */
template <typename T>
__device__ __forceinline__ void load_tile(float *dst, const T *src, int64_t first, int64_t rows,
                                          int64_t hs, size_t ld) {
    for (int64_t e = threadIdx.x; e < rows * hs; e += blockDim.x)
        dst[e] = td_ld(src, (size_t)(first + e / hs) * ld + (size_t)(e % hs));
}

/* rows x hs values of f32 src (r, hs) into dst (row r at dst + (first + r) * ld), as dst =
 * beta dst + src. */
template <typename T>
__device__ __forceinline__ void store_tile(T *dst, const float *src, int64_t first, int64_t rows,
                                           int64_t hs, size_t ld, float beta) {
    for (int64_t e = threadIdx.x; e < rows * hs; e += blockDim.x) {
        size_t at = (size_t)(first + e / hs) * ld + (size_t)(e % hs);
        td_st(dst, at, beta != 0.f ? beta * td_ld(dst, at) + src[e] : src[e]);
    }
}

__device__ __forceinline__ float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

template <typename T>
__global__ void att_forward(T *y, float *lse, const T *qkv, int64_t T_, int64_t C, int H,
                            int64_t hs, int64_t tile, float scale) {
    extern __shared__ float sm[];
    float *q = sm, *k = q + tile * hs, *v = k + tile * hs, *o = v + tile * hs;
    float *s = o + tile * hs, *m = s + tile * tile, *l = m + tile, *corr = l + tile;
    head_at a = head_of(T_, C, H, hs);
    size_t ld = (size_t)(3 * C);
    int64_t q0 = (int64_t)blockIdx.y * tile, nq = T_ - q0 < tile ? T_ - q0 : tile;
    load_tile(q, qkv + a.q_at, q0, nq, hs, ld);
    for (int64_t e = threadIdx.x; e < nq * hs; e += blockDim.x) o[e] = 0.f;
    for (int64_t i = threadIdx.x; i < nq; i += blockDim.x) {
        m[i] = -INFINITY;
        l[i] = 0.f;
    }
    /* Tiles are aligned, so the key tiles up to the query tile's own hold every key its rows
     * see, and each holds key k0, which every row sees: no row is ever wholly masked. */
    for (int64_t k0 = 0; k0 <= q0; k0 += tile) {
        int64_t nk = T_ - k0 < tile ? T_ - k0 : tile;
        __syncthreads();
        load_tile(k, qkv + a.q_at + C, k0, nk, hs, ld);
        load_tile(v, qkv + a.q_at + 2 * C, k0, nk, hs, ld);
        __syncthreads();
        for (int64_t e = threadIdx.x; e < nq * nk; e += blockDim.x) {
            int64_t i = e / nk, j = e % nk;
            s[i * tile + j] = k0 + j > q0 + i ? -INFINITY : dot(q + i * hs, k + j * hs, hs) * scale;
        }
        __syncthreads();
        for (int64_t i = threadIdx.x; i < nq; i += blockDim.x) {
            float *row = s + i * tile, mx = m[i], sum = 0.f;
            for (int64_t j = 0; j < nk; j++) mx = fmaxf(mx, row[j]);
            for (int64_t j = 0; j < nk; j++) sum += row[j] = expf(row[j] - mx);
            corr[i] = expf(m[i] - mx);
            l[i] = l[i] * corr[i] + sum;
            m[i] = mx;
        }
        __syncthreads();
        for (int64_t e = threadIdx.x; e < nq * hs; e += blockDim.x) {
            int64_t i = e / hs, d = e % hs;
            float acc = o[e] * corr[i];
            for (int64_t j = 0; j < nk; j++) acc += s[i * tile + j] * v[j * hs + d];
            o[e] = acc;
        }
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < nq * hs; e += blockDim.x) o[e] /= l[e / hs];
    store_tile(y + a.y_at, o, q0, nq, hs, (size_t)C, 0.f);
    for (int64_t i = threadIdx.x; i < nq; i += blockDim.x)
        lse[a.bh * (size_t)T_ + (size_t)(q0 + i)] = m[i] + logf(l[i]);
}

/* p and ds of query i (at q + i hs, do + i hs, with its lse and D) and key j. */
__device__ __forceinline__ void probability_grad(float *p, float *ds, const float *qi,
                                                 const float *doi, const float *kj, const float *vj,
                                                 float lse, float D, int64_t hs, float scale) {
    *p = expf(dot(qi, kj, hs) * scale - lse);
    *ds = *p * (dot(doi, vj, hs) - D) * scale;
}

template <typename T>
__global__ void att_dq(T *dqkv, float *Dg, const T *dy, const T *y, const T *qkv, const float *lse,
                       int64_t T_, int64_t C, int H, int64_t hs, int64_t tile, float scale,
                       float beta) {
    extern __shared__ float sm[];
    float *q = sm, *dout = q + tile * hs, *k = dout + tile * hs, *v = k + tile * hs;
    float *dq = v + tile * hs, *ds = dq + tile * hs, *lr = ds + tile * tile, *D = lr + tile;
    head_at a = head_of(T_, C, H, hs);
    size_t ld = (size_t)(3 * C);
    int64_t q0 = (int64_t)blockIdx.y * tile, nq = T_ - q0 < tile ? T_ - q0 : tile;
    load_tile(q, qkv + a.q_at, q0, nq, hs, ld);
    load_tile(dout, dy + a.y_at, q0, nq, hs, (size_t)C);
    for (int64_t e = threadIdx.x; e < nq * hs; e += blockDim.x) dq[e] = 0.f;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < nq; i += blockDim.x) {
        size_t row = a.y_at + (size_t)(q0 + i) * (size_t)C, at = a.bh * (size_t)T_ + q0 + i;
        float sum = 0.f;
        for (int64_t d = 0; d < hs; d++) sum += dout[i * hs + d] * td_ld(y, row + (size_t)d);
        D[i] = Dg[at] = sum;
        lr[i] = lse[at];
    }
    for (int64_t k0 = 0; k0 <= q0; k0 += tile) {
        int64_t nk = T_ - k0 < tile ? T_ - k0 : tile;
        __syncthreads();
        load_tile(k, qkv + a.q_at + C, k0, nk, hs, ld);
        load_tile(v, qkv + a.q_at + 2 * C, k0, nk, hs, ld);
        __syncthreads();
        for (int64_t e = threadIdx.x; e < nq * nk; e += blockDim.x) {
            int64_t i = e / nk, j = e % nk;
            float p = 0.f, g = 0.f;
            if (k0 + j <= q0 + i)
                probability_grad(&p, &g, q + i * hs, dout + i * hs, k + j * hs, v + j * hs, lr[i],
                                 D[i], hs, scale);
            ds[i * tile + j] = g;
        }
        __syncthreads();
        for (int64_t e = threadIdx.x; e < nq * hs; e += blockDim.x) {
            int64_t i = e / hs, d = e % hs;
            float acc = dq[e];
            for (int64_t j = 0; j < nk; j++) acc += ds[i * tile + j] * k[j * hs + d];
            dq[e] = acc;
        }
    }
    __syncthreads();
    store_tile(dqkv + a.q_at, dq, q0, nq, hs, ld, beta);
}

template <typename T>
__global__ void att_dkv(T *dqkv, const float *Dg, const T *dy, const T *qkv, const float *lse,
                        int64_t T_, int64_t C, int H, int64_t hs, int64_t tile, float scale,
                        float beta) {
    extern __shared__ float sm[];
    float *k = sm, *v = k + tile * hs, *dk = v + tile * hs, *dv = dk + tile * hs;
    float *q = dv + tile * hs, *dout = q + tile * hs, *p = dout + tile * hs, *ds = p + tile * tile;
    float *lr = ds + tile * tile, *D = lr + tile;
    head_at a = head_of(T_, C, H, hs);
    size_t ld = (size_t)(3 * C);
    int64_t k0 = (int64_t)blockIdx.y * tile, nk = T_ - k0 < tile ? T_ - k0 : tile;
    load_tile(k, qkv + a.q_at + C, k0, nk, hs, ld);
    load_tile(v, qkv + a.q_at + 2 * C, k0, nk, hs, ld);
    for (int64_t e = threadIdx.x; e < nk * hs; e += blockDim.x) dk[e] = dv[e] = 0.f;
    for (int64_t q0 = k0; q0 < T_; q0 += tile) { /* earlier queries see none of these keys */
        int64_t nq = T_ - q0 < tile ? T_ - q0 : tile;
        __syncthreads();
        load_tile(q, qkv + a.q_at, q0, nq, hs, ld);
        load_tile(dout, dy + a.y_at, q0, nq, hs, (size_t)C);
        for (int64_t i = threadIdx.x; i < nq; i += blockDim.x) {
            size_t at = a.bh * (size_t)T_ + (size_t)(q0 + i);
            lr[i] = lse[at];
            D[i] = Dg[at];
        }
        __syncthreads();
        for (int64_t e = threadIdx.x; e < nq * nk; e += blockDim.x) {
            int64_t i = e / nk, j = e % nk;
            float pr = 0.f, g = 0.f;
            if (k0 + j <= q0 + i)
                probability_grad(&pr, &g, q + i * hs, dout + i * hs, k + j * hs, v + j * hs, lr[i],
                                 D[i], hs, scale);
            p[i * tile + j] = pr;
            ds[i * tile + j] = g;
        }
        __syncthreads();
        for (int64_t e = threadIdx.x; e < nk * hs; e += blockDim.x) {
            int64_t j = e / hs, d = e % hs;
            float gv = dv[e], gk = dk[e];
            for (int64_t i = 0; i < nq; i++) {
                gv += p[i * tile + j] * dout[i * hs + d];
                gk += ds[i * tile + j] * q[i * hs + d];
            }
            dv[e] = gv;
            dk[e] = gk;
        }
    }
    __syncthreads();
    store_tile(dqkv + a.q_at + C, dk, k0, nk, hs, ld, beta);
    store_tile(dqkv + a.q_at + 2 * C, dv, k0, nk, hs, ld, beta);
}

typedef struct {
    td_device device;
    int64_t B, T, C, H, hs, tile;
    float *lse; /* (B, H, T) on the device: each row's log-sum-exp, from the last forward */
    float *D;   /* (B, H, T) on the device: do . y per row, in backward */
} att_state;

static td_status att_compile(td__op_ctx *ctx, td__node *n) {
    att_state *s = (att_state *)calloc(1, sizeof *s);
    if (!s) return td__host->fail(TD_ENOMEM, "attention: out of memory");
    n->state = s;
    const td_tensor *x = n->in[0];
    s->device = ctx->device;
    s->T = n->attr.attn.seq_len;
    s->C = x->shape.dim[x->shape.ndim - 1] / 3;
    s->B = (int64_t)(td__numel(x) / (size_t)(3 * s->C) / (size_t)s->T);
    s->H = n->attr.attn.heads;
    s->hs = s->C / s->H;
    s->tile = td__att_tile(s->hs);
    if (!s->tile)
        return td__host->fail(
            TD_EUNSUPPORTED,
            "attention: '%s' has heads of %lld on a GPU, whose kernels take heads "
            "of at most 253 (more heads, or the CPU)",
            x->name, (long long)s->hs);
    if (s->B * s->H > 0x7fffffff || (s->T + s->tile - 1) / s->tile > 65535)
        return td__host->fail(TD_EUNSUPPORTED,
                              "attention: '%s' has %lld sequences of %lld positions with %lld "
                              "heads, more than a GPU's grid takes",
                              x->name, (long long)s->B, (long long)s->T, (long long)s->H);
    size_t rows = (size_t)(s->B * s->H * s->T) * sizeof(float);
    TD__TRY(td__host->alloc(ctx->device, rows, (void **)&s->lse));
    return x->requires_grad ? td__host->alloc(ctx->device, rows, (void **)&s->D) : TD_OK;
}

static size_t shared_bytes(const att_state *s, int kernel) {
    return (size_t)td__att_shared_floats(kernel, s->tile, s->hs) * sizeof(float);
}

static td_status att_forward_run(td__op_ctx *ctx, td__node *n) {
    att_state *s = (att_state *)n->state;
    dim3 grid((unsigned)(s->B * s->H), (unsigned)((s->T + s->tile - 1) / s->tile));
    float scale = 1.0f / sqrtf((float)s->hs);
    TD__FLOAT_TYPES(n->out->dtype, "attention", {
        att_forward<T>
            <<<grid, TD__THREADS, shared_bytes(s, TD__ATT_FORWARD), td__gpu_of(ctx)->stream>>>(
                (T *)n->out->data, s->lse, (const T *)n->in[0]->data, s->T, s->C, (int)s->H, s->hs,
                s->tile, scale);
    });
    TD__LAUNCHED("attention");
    return TD_OK;
}

static td_status att_backward_run(td__op_ctx *ctx, td__node *n) {
    att_state *s = (att_state *)n->state;
    td_tensor *x = n->in[0], *y = n->out;
    if (!x->requires_grad) return TD_OK;
    cudaStream_t st = td__gpu_of(ctx)->stream;
    dim3 grid((unsigned)(s->B * s->H), (unsigned)((s->T + s->tile - 1) / s->tile));
    float scale = 1.0f / sqrtf((float)s->hs), beta = td__grad_beta(x);
    TD__FLOAT_TYPES(x->dtype, "attention backward", {
        att_dq<T><<<grid, TD__THREADS, shared_bytes(s, TD__ATT_DQ), st>>>(
            (T *)x->grad, s->D, (const T *)y->grad, (const T *)y->data, (const T *)x->data, s->lse,
            s->T, s->C, (int)s->H, s->hs, s->tile, scale, beta);
        att_dkv<T><<<grid, TD__THREADS, shared_bytes(s, TD__ATT_DKV), st>>>(
            (T *)x->grad, s->D, (const T *)y->grad, (const T *)x->data, s->lse, s->T, s->C,
            (int)s->H, s->hs, s->tile, scale, beta);
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
