/* The kernels of attention.cu and their launches: causal self-attention in FlashAttention's
 * manner, a block per (sequence, head) and tile of positions (tiling.h sizes the tile from the
 * head size and the 48 KiB of shared memory a block has without asking), f32 inside whatever
 * the dtype: the forward with the online softmax keeping each row's log-sum-exp, and backward in
 * two kernels (dq; dk and dv) so that no gradient needs an atomic. Compiles for a GPU and under
 * the CPU's emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_ATTENTION_CUH
#define TANDEM_CUDA_ATTENTION_CUH

#include <cmath>

#include "device/cuda/dtype.cuh"
#include "ops/cuda/tiling.h"

/* Where one (sequence b, head h) lives: position t's q at qkv + t * 3C + q_at (k C later, v 2C
 * later), its output at y + t * C + y_at, its log-sum-exp at lse[bh * T + t]. */
struct td__head_at {
    size_t q_at, y_at, bh;
};

__device__ __forceinline__ td__head_at td__head_of(int64_t T_, int64_t C, int H, int64_t hs) {
    td__head_at a;
    int64_t bh = blockIdx.x, b = bh / H, h = bh % H;
    a.q_at = (size_t)(b * T_ * 3 * C + h * hs);
    a.y_at = (size_t)(b * T_ * C + h * hs);
    a.bh = (size_t)bh;
    return a;
}

/* rows x hs values from src (row r at src + (first + r) * ld) into dst (r, hs) as f32. */
template <typename T>
__device__ __forceinline__ void td__load_tile(float *dst, const T *src, int64_t first, int64_t rows,
                                              int64_t hs, size_t ld) {
    for (int64_t e = threadIdx.x; e < rows * hs; e += blockDim.x)
        dst[e] = td_ld(src, (size_t)(first + e / hs) * ld + (size_t)(e % hs));
}

/* rows x hs values of f32 src (r, hs) into dst (row r at dst + (first + r) * ld), as dst =
 * beta dst + src. */
template <typename T>
__device__ __forceinline__ void td__store_tile(T *dst, const float *src, int64_t first,
                                               int64_t rows, int64_t hs, size_t ld, float beta) {
    for (int64_t e = threadIdx.x; e < rows * hs; e += blockDim.x) {
        size_t at = (size_t)(first + e / hs) * ld + (size_t)(e % hs);
        td_st(dst, at, beta != 0.f ? beta * td_ld(dst, at) + src[e] : src[e]);
    }
}

/* The key and value tile of keys [k0, k0 + nk) into k and v, once every thread is done with
 * the last ones; ready for every thread on return. */
template <typename T>
__device__ __forceinline__ void td__load_keys(float *k, float *v, const T *q, int64_t C, int64_t k0,
                                              int64_t nk, int64_t hs) {
    __syncthreads();
    td__load_tile(k, q + C, k0, nk, hs, (size_t)(3 * C));
    td__load_tile(v, q + 2 * C, k0, nk, hs, (size_t)(3 * C));
    __syncthreads();
}

__device__ __forceinline__ float td__dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__att_forward_kernel(T *y, float *lse, const T *qkv, int64_t T_, int64_t C, int H, int64_t hs,
                           int64_t tile, float scale) {
    TD__DYNAMIC_SHARED(float, sm);
    float *q = sm, *k = q + tile * hs, *v = k + tile * hs, *o = v + tile * hs;
    float *s = o + tile * hs, *m = s + tile * tile, *l = m + tile, *corr = l + tile;
    td__head_at a = td__head_of(T_, C, H, hs);
    size_t ld = (size_t)(3 * C);
    int64_t q0 = (int64_t)blockIdx.y * tile, nq = T_ - q0 < tile ? T_ - q0 : tile;
    td__load_tile(q, qkv + a.q_at, q0, nq, hs, ld);
    for (int64_t e = threadIdx.x; e < nq * hs; e += blockDim.x) o[e] = 0.f;
    for (int64_t i = threadIdx.x; i < nq; i += blockDim.x) {
        m[i] = -INFINITY;
        l[i] = 0.f;
    }
    /* Tiles are aligned, so the key tiles up to the query tile's own hold every key its rows
     * see, and each holds key k0, which every row sees: no row is ever wholly masked. */
    for (int64_t k0 = 0; k0 <= q0; k0 += tile) {
        int64_t nk = T_ - k0 < tile ? T_ - k0 : tile;
        td__load_keys(k, v, qkv + a.q_at, C, k0, nk, hs);
        for (int64_t e = threadIdx.x; e < nq * nk; e += blockDim.x) {
            int64_t i = e / nk, j = e % nk;
            s[i * tile + j] =
                k0 + j > q0 + i ? -INFINITY : td__dot(q + i * hs, k + j * hs, hs) * scale;
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
    td__store_tile(y + a.y_at, o, q0, nq, hs, (size_t)C, 0.f);
    for (int64_t i = threadIdx.x; i < nq; i += blockDim.x)
        lse[a.bh * (size_t)T_ + (size_t)(q0 + i)] = m[i] + logf(l[i]);
}

/* p and ds of query i (at q + i hs, do + i hs, with its lse and D) and key j. */
__device__ __forceinline__ void td__probability_grad(float *p, float *ds, const float *qi,
                                                     const float *doi, const float *kj,
                                                     const float *vj, float lse, float D,
                                                     int64_t hs, float scale) {
    *p = expf(td__dot(qi, kj, hs) * scale - lse);
    *ds = *p * (td__dot(doi, vj, hs) - D) * scale;
}

/* p (when wanted) and ds of the tile's queries [q0, q0 + nq) and keys [k0, k0 + nk), 0 where
 * the causal mask hides the key; rows of `tile` in p and ds. */
__device__ __forceinline__ void td__tile_grads(float *p, float *ds, const float *q,
                                               const float *dout, const float *k, const float *v,
                                               const float *lr, const float *D, int64_t q0,
                                               int64_t nq, int64_t k0, int64_t nk, int64_t tile,
                                               int64_t hs, float scale) {
    for (int64_t e = threadIdx.x; e < nq * nk; e += blockDim.x) {
        int64_t i = e / nk, j = e % nk;
        float pr = 0.f, g = 0.f;
        if (k0 + j <= q0 + i)
            td__probability_grad(&pr, &g, q + i * hs, dout + i * hs, k + j * hs, v + j * hs, lr[i],
                                 D[i], hs, scale);
        if (p) p[i * tile + j] = pr;
        ds[i * tile + j] = g;
    }
}

template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__att_dq_kernel(T *dqkv, float *Dg, const T *dy, const T *y, const T *qkv, const float *lse,
                      int64_t T_, int64_t C, int H, int64_t hs, int64_t tile, float scale,
                      float beta) {
    TD__DYNAMIC_SHARED(float, sm);
    float *q = sm, *dout = q + tile * hs, *k = dout + tile * hs, *v = k + tile * hs;
    float *dq = v + tile * hs, *ds = dq + tile * hs, *lr = ds + tile * tile, *D = lr + tile;
    td__head_at a = td__head_of(T_, C, H, hs);
    size_t ld = (size_t)(3 * C);
    int64_t q0 = (int64_t)blockIdx.y * tile, nq = T_ - q0 < tile ? T_ - q0 : tile;
    td__load_tile(q, qkv + a.q_at, q0, nq, hs, ld);
    td__load_tile(dout, dy + a.y_at, q0, nq, hs, (size_t)C);
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
        td__load_keys(k, v, qkv + a.q_at, C, k0, nk, hs);
        td__tile_grads(NULL, ds, q, dout, k, v, lr, D, q0, nq, k0, nk, tile, hs, scale);
        __syncthreads();
        for (int64_t e = threadIdx.x; e < nq * hs; e += blockDim.x) {
            int64_t i = e / hs, d = e % hs;
            float acc = dq[e];
            for (int64_t j = 0; j < nk; j++) acc += ds[i * tile + j] * k[j * hs + d];
            dq[e] = acc;
        }
    }
    __syncthreads();
    td__store_tile(dqkv + a.q_at, dq, q0, nq, hs, ld, beta);
}

template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__att_dkv_kernel(T *dqkv, const float *Dg, const T *dy, const T *qkv, const float *lse,
                       int64_t T_, int64_t C, int H, int64_t hs, int64_t tile, float scale,
                       float beta) {
    TD__DYNAMIC_SHARED(float, sm);
    float *k = sm, *v = k + tile * hs, *dk = v + tile * hs, *dv = dk + tile * hs;
    float *q = dv + tile * hs, *dout = q + tile * hs, *p = dout + tile * hs, *ds = p + tile * tile;
    float *lr = ds + tile * tile, *D = lr + tile;
    td__head_at a = td__head_of(T_, C, H, hs);
    size_t ld = (size_t)(3 * C);
    int64_t k0 = (int64_t)blockIdx.y * tile, nk = T_ - k0 < tile ? T_ - k0 : tile;
    td__load_tile(k, qkv + a.q_at + C, k0, nk, hs, ld);
    td__load_tile(v, qkv + a.q_at + 2 * C, k0, nk, hs, ld);
    for (int64_t e = threadIdx.x; e < nk * hs; e += blockDim.x) dk[e] = dv[e] = 0.f;
    for (int64_t q0 = k0; q0 < T_; q0 += tile) { /* earlier queries see none of these keys */
        int64_t nq = T_ - q0 < tile ? T_ - q0 : tile;
        __syncthreads();
        td__load_tile(q, qkv + a.q_at, q0, nq, hs, ld);
        td__load_tile(dout, dy + a.y_at, q0, nq, hs, (size_t)C);
        for (int64_t i = threadIdx.x; i < nq; i += blockDim.x) {
            size_t at = a.bh * (size_t)T_ + (size_t)(q0 + i);
            lr[i] = lse[at];
            D[i] = Dg[at];
        }
        __syncthreads();
        td__tile_grads(p, ds, q, dout, k, v, lr, D, q0, nq, k0, nk, tile, hs, scale);
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
    td__store_tile(dqkv + a.q_at + C, dk, k0, nk, hs, ld, beta);
    td__store_tile(dqkv + a.q_at + 2 * C, dv, k0, nk, hs, ld, beta);
}

/* The shape of one attention: B sequences of T_ positions, H heads of hs (C = H hs), tiles of
 * `tile` positions (td__att_tile). */
typedef struct {
    int64_t B, T, C, H, hs, tile;
} td__att_shape;

static inline dim3 td__att_grid(const td__att_shape *a) {
    return dim3((unsigned)(a->B * a->H), (unsigned)((a->T + a->tile - 1) / a->tile));
}

static inline size_t td__att_shared_bytes(const td__att_shape *a, int kernel) {
    return (size_t)td__att_shared_floats(kernel, a->tile, a->hs) * sizeof(float);
}

/* y (B T, C) and lse (B, H, T) from qkv (B T, 3C). */
template <typename T>
static inline void td__launch_att_forward(cudaStream_t s, const td__att_shape *a, T *y, float *lse,
                                          const T *qkv) {
    if (a->B * a->H * a->T == 0) return;
    td__launch<td__att_forward_kernel<T>>(td__att_grid(a), td__att_shared_bytes(a, TD__ATT_FORWARD),
                                          s, y, lse, qkv, a->T, a->C, (int)a->H, a->hs, a->tile,
                                          1.0f / sqrtf((float)a->hs));
}

/* dqkv = beta dqkv + the gradient from dy, through the forward's y and lse; D (B, H, T) is
 * scratch the two kernels pass between them. */
template <typename T>
static inline void td__launch_att_backward(cudaStream_t s, const td__att_shape *a, T *dqkv,
                                           float *D, const T *dy, const T *y, const T *qkv,
                                           const float *lse, float beta) {
    if (a->B * a->H * a->T == 0) return;
    float scale = 1.0f / sqrtf((float)a->hs);
    td__launch<td__att_dq_kernel<T>>(td__att_grid(a), td__att_shared_bytes(a, TD__ATT_DQ), s, dqkv,
                                     D, dy, y, qkv, lse, a->T, a->C, (int)a->H, a->hs, a->tile,
                                     scale, beta);
    td__launch<td__att_dkv_kernel<T>>(td__att_grid(a), td__att_shared_bytes(a, TD__ATT_DKV), s,
                                      dqkv, (const float *)D, dy, qkv, lse, a->T, a->C, (int)a->H,
                                      a->hs, a->tile, scale, beta);
}

#endif
