/* The kernels of multi_tensor.cu (src/device/multi_tensor.h) and their launch: each block takes
 * one chunk of TD__MT_CHUNK elements of one tensor of the list (a block finds its tensor by
 * binary search over the tensors' first chunks), so one launch covers every parameter. Updates
 * are written with explicitly rounded operations (__fmul_rn, __fadd_rn: no fused multiply-add),
 * in the CPU's order, so they give its bits. The squared norm is summed in double, per chunk in
 * a fixed tree and then over the chunks in a fixed order: the same result on every run.
 * Compiles for a GPU and under the CPU's emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_MULTI_TENSOR_CUH
#define TANDEM_CUDA_MULTI_TENSOR_CUH

#include "device/cuda/dtype.cuh"
#include "device/multi_tensor.h"

#define TD__MUL __fmul_rn
#define TD__ADD __fadd_rn

/* The tensor whose chunks include chunk c. */
__device__ __forceinline__ const td__mt_tensor *td__mt_tensor_of(const td__mt_tensor *list, int n,
                                                                 uint64_t c) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (list[mid].chunk0 <= c)
            lo = mid;
        else
            hi = mid - 1;
    }
    return &list[lo];
}

/* SGD on one element, as src/optim/optim.c's sgd_block: p, g and the momentum in f32 (the
 * momentum stored in the state's dtype, rounded once per step as the CPU's block is). */
__device__ __forceinline__ float td__mt_sgd(const td__mt_args &a, const td__mt_tensor &t, float p,
                                            float g, uint64_t j) {
    float d = a.weight_decay != 0.f ? TD__ADD(g, TD__MUL(a.weight_decay, p)) : g;
    if (!t.buf1) return TD__ADD(p, TD__MUL(a.neg_lr, d));
    float b = t.first ? d
                      : TD__ADD(TD__MUL((float)td_ld_dt(t.buf1, t.state_dtype, j), a.momentum),
                                TD__MUL(a.keep, d));
    td_st_dt(t.buf1, t.state_dtype, j, b); /* the update below uses it unrounded, as the CPU */
    return a.nesterov ? TD__ADD(p, TD__MUL(a.neg_lr, TD__ADD(d, TD__MUL(a.momentum, b))))
                      : TD__ADD(p, TD__MUL(a.neg_lr, b));
}

/* AdamW on one element, as optim.c's adamw_update. */
__device__ __forceinline__ float td__mt_adamw(const td__mt_args &a, const td__mt_tensor &t, float p,
                                              float g, uint64_t j) {
    float pj = TD__MUL(p, a.decay);
    float mj =
        TD__ADD(TD__MUL((float)td_ld_dt(t.buf1, t.state_dtype, j), a.beta1), TD__MUL(a.one_b1, g));
    float vj = TD__ADD(TD__MUL((float)td_ld_dt(t.buf2, t.state_dtype, j), a.beta2),
                       TD__MUL(TD__MUL(a.one_b2, g), g));
    float denom = TD__ADD(__fdiv_rn(__fsqrt_rn(vj), t.bc2_sqrt), a.eps);
    td_st_dt(t.buf1, t.state_dtype, j, mj);
    td_st_dt(t.buf2, t.state_dtype, j, vj);
    return TD__ADD(pj, TD__MUL(t.neg_step, __fdiv_rn(mj, denom)));
}

static __global__ void __launch_bounds__(TD__THREADS)
    td__mt_kernel(td__mt_args a, const td__mt_tensor *list, int n, double *partials, int *flag) {
    const td__mt_tensor &t = *td__mt_tensor_of(list, n, blockIdx.x);
    uint64_t begin = (blockIdx.x - t.chunk0) * (uint64_t)TD__MT_CHUNK;
    uint64_t end = begin + TD__MT_CHUNK < t.count ? begin + TD__MT_CHUNK : t.count;
    double sq = 0;
    int bad = 0;
    for (uint64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
        switch (a.op) {
        case TD__MT_SGD:
        case TD__MT_ADAMW: {
            float *m = t.master;
            float p = m ? m[j] : (float)td_ld_dt(t.param, t.dtype, j),
                  g = (float)td_ld_dt(t.grad, t.dtype, j);
            p = a.op == TD__MT_SGD ? td__mt_sgd(a, t, p, g, j) : td__mt_adamw(a, t, p, g, j);
            if (m) m[j] = p;
            td_st_dt(t.param, t.dtype, j, p);
            break;
        }
        case TD__MT_MASTER_INIT:
            t.master[j] = (float)td_ld_dt(t.param, t.dtype, j);
            break;
        case TD__MT_SQUARES: {
            double v = (float)td_ld_dt(t.grad, t.dtype, j);
            sq += v * v;
            break;
        }
        case TD__MT_SCALE:
        case TD__MT_UNSCALE: {
            float v = TD__MUL((float)td_ld_dt(t.grad, t.dtype, j), a.factor);
            td_st_dt(t.grad, t.dtype, j, v);
            bad |= !isfinite(v);
            break;
        }
        }
    }
    if (a.op == TD__MT_SQUARES) {
        sq = td__block_reduce(sq, 0);
        if (threadIdx.x == 0) partials[blockIdx.x] = sq;
    }
    if (a.op == TD__MT_UNSCALE && bad) atomicOr(flag, 1);
}

/* partials[0] = the sum of partials[0..count), in a fixed order. */
static __global__ void __launch_bounds__(TD__THREADS)
    td__mt_sum_partials(double *partials, uint64_t count) {
    double s = 0;
    for (uint64_t i = threadIdx.x; i < count; i += blockDim.x) s += partials[i];
    s = td__block_reduce(s, 0);
    if (threadIdx.x == 0) partials[0] = s;
}

/* Drops the tensors of list[0..n) that have nothing to do for args (no elements, or no gradient
 * where the operation reads one), fills each kept tensor's chunk0, and returns how many are
 * kept; *chunks gets the launch's blocks. */
static inline size_t td__mt_plan(const td__mt_args *args, td__mt_tensor *list, size_t n,
                                 uint64_t *chunks) {
    size_t kept = 0;
    *chunks = 0;
    for (size_t i = 0; i < n; i++) {
        if (list[i].count == 0 || (!list[i].grad && args->op != TD__MT_MASTER_INIT)) continue;
        list[kept] = list[i];
        list[kept].chunk0 = *chunks;
        *chunks += (list[i].count + TD__MT_CHUNK - 1) / TD__MT_CHUNK;
        kept++;
    }
    return kept;
}

/* One multi-tensor launch over the planned list (in device memory, kept tensors, chunks blocks,
 * 0 < chunks < 2^31); SQUARES leaves its sum in partials[0] (chunks doubles), UNSCALE sets
 * *flag (zeroed before) when a result is not finite. */
static inline void td__launch_multi_tensor(cudaStream_t s, const td__mt_args *args,
                                           const td__mt_tensor *list, size_t kept, uint64_t chunks,
                                           double *partials, int *flag) {
    td__launch<td__mt_kernel>((unsigned)chunks, 0, s, *args, list, (int)kept, partials, flag);
    if (args->op == TD__MT_SQUARES) td__launch<td__mt_sum_partials>(1, 0, s, partials, chunks);
}

#endif
