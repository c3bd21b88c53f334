/* The multi-tensor kernels of src/device/multi_tensor.h: each block takes one chunk of
 * TD__MT_CHUNK elements of one tensor of the list (a block finds its tensor by binary search
 * over the tensors' first chunks), so one launch covers every parameter. Updates are written
 * with explicitly rounded operations (__fmul_rn, __fadd_rn: no fused multiply-add), in the
 * CPU's order, so they give its bits. The squared norm is summed in double, per chunk in a
 * fixed tree and then over the chunks in a fixed order: the same result on every run. */
#include "device/cuda/dtype.cuh"
#include "device/cuda/runtime.cuh"
#include "device/multi_tensor.h"

#define MT_THREADS 256

#define MUL __fmul_rn
#define ADD __fadd_rn

/* The tensor whose chunks include chunk c. */
__device__ __forceinline__ const td__mt_tensor *tensor_of(const td__mt_tensor *list, int n,
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
__device__ __forceinline__ float sgd(const td__mt_args &a, const td__mt_tensor &t, float p, float g,
                                     uint64_t j) {
    float d = a.weight_decay != 0.f ? ADD(g, MUL(a.weight_decay, p)) : g;
    if (!t.buf1) return ADD(p, MUL(a.neg_lr, d));
    float b = t.first
                  ? d
                  : ADD(MUL((float)td_ld_dt(t.buf1, t.state_dtype, j), a.momentum), MUL(a.keep, d));
    td_st_dt(t.buf1, t.state_dtype, j, b); /* the update below uses it unrounded, as the CPU */
    return a.nesterov ? ADD(p, MUL(a.neg_lr, ADD(d, MUL(a.momentum, b))))
                      : ADD(p, MUL(a.neg_lr, b));
}

/* AdamW on one element, as optim.c's adamw_update. */
__device__ __forceinline__ float adamw(const td__mt_args &a, const td__mt_tensor &t, float p,
                                       float g, uint64_t j) {
    float pj = MUL(p, a.decay);
    float mj = ADD(MUL((float)td_ld_dt(t.buf1, t.state_dtype, j), a.beta1), MUL(a.one_b1, g));
    float vj =
        ADD(MUL((float)td_ld_dt(t.buf2, t.state_dtype, j), a.beta2), MUL(MUL(a.one_b2, g), g));
    float denom = ADD(__fdiv_rn(__fsqrt_rn(vj), t.bc2_sqrt), a.eps);
    td_st_dt(t.buf1, t.state_dtype, j, mj);
    td_st_dt(t.buf2, t.state_dtype, j, vj);
    return ADD(pj, MUL(t.neg_step, __fdiv_rn(mj, denom)));
}

__global__ void mt_kernel(td__mt_args a, const td__mt_tensor *list, int n, double *partials,
                          int *flag) {
    const td__mt_tensor &t = *tensor_of(list, n, blockIdx.x);
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
            p = a.op == TD__MT_SGD ? sgd(a, t, p, g, j) : adamw(a, t, p, g, j);
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
            float v = MUL((float)td_ld_dt(t.grad, t.dtype, j), a.factor);
            td_st_dt(t.grad, t.dtype, j, v);
            bad |= !isfinite(v);
            break;
        }
        }
    }
    if (a.op == TD__MT_SQUARES) {
        __shared__ double buf[MT_THREADS];
        buf[threadIdx.x] = sq;
        __syncthreads();
        for (int half = MT_THREADS / 2; half > 0; half /= 2) {
            if ((int)threadIdx.x < half) buf[threadIdx.x] += buf[threadIdx.x + half];
            __syncthreads();
        }
        if (threadIdx.x == 0) partials[blockIdx.x] = buf[0];
    }
    if (a.op == TD__MT_UNSCALE && bad) atomicOr(flag, 1);
}

/* partials[0] = the sum of partials[0..count), in a fixed order. */
__global__ void sum_partials(double *partials, uint64_t count) {
    __shared__ double buf[MT_THREADS];
    double s = 0;
    for (uint64_t i = threadIdx.x; i < count; i += blockDim.x) s += partials[i];
    buf[threadIdx.x] = s;
    __syncthreads();
    for (int half = MT_THREADS / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) buf[threadIdx.x] += buf[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[0] = buf[0];
}

/* Scratch layout: the list, then the flag (8 bytes), then one double per chunk. */
td_status td__cu_multi_tensor(int device, void *stream, const td__mt_args *args,
                              td__mt_tensor *list, size_t n, void **scratch, size_t *scratch_bytes,
                              double *result) {
    uint64_t chunks = 0;
    size_t kept = 0;
    for (size_t i = 0; i < n; i++) { /* tensors with nothing to do leave the list */
        if (list[i].count == 0 || (!list[i].grad && args->op != TD__MT_MASTER_INIT)) continue;
        list[kept] = list[i];
        list[kept].chunk0 = chunks;
        chunks += (list[i].count + TD__MT_CHUNK - 1) / TD__MT_CHUNK;
        kept++;
    }
    if (result) *result = 0;
    if (kept == 0) return TD_OK;
    if (chunks > 0x7fffffffu)
        return td__host->fail(TD_EINVAL,
                              "multi-tensor kernel: %llu chunks are too many for one "
                              "launch",
                              (unsigned long long)chunks);
    size_t list_bytes = (kept * sizeof *list + 7) & ~(size_t)7;
    size_t need = list_bytes + 8 + chunks * sizeof(double);
    cudaStream_t s = (cudaStream_t)stream;
    td_device d = {TD_DEVICE_CUDA, device};
    if (*scratch_bytes < need) {
        if (*scratch) td__host->free(d, *scratch);
        *scratch = NULL;
        *scratch_bytes = 0;
        td_status st = td__host->alloc(d, need, scratch);
        if (st != TD_OK) return st;
        *scratch_bytes = need;
    }
    char *base = (char *)*scratch;
    int *flag = (int *)(base + list_bytes);
    double *partials = (double *)(base + list_bytes + 8);
    TD__CU(cudaSetDevice(device));
    TD__CU(cudaMemcpyAsync(base, list, kept * sizeof *list, cudaMemcpyHostToDevice, s));
    if (args->op == TD__MT_UNSCALE) TD__CU(cudaMemsetAsync(flag, 0, sizeof(int), s));
    mt_kernel<<<(unsigned)chunks, MT_THREADS, 0, s>>>(*args, (const td__mt_tensor *)base, (int)kept,
                                                      partials, flag);
    TD__CU(cudaGetLastError());
    if (args->op == TD__MT_SQUARES) {
        sum_partials<<<1, MT_THREADS, 0, s>>>(partials, chunks);
        TD__CU(cudaGetLastError());
        TD__CU(cudaMemcpyAsync(result, partials, sizeof(double), cudaMemcpyDeviceToHost, s));
        TD__CU(cudaStreamSynchronize(s));
    } else if (args->op == TD__MT_UNSCALE) {
        int f = 0;
        TD__CU(cudaMemcpyAsync(&f, flag, sizeof f, cudaMemcpyDeviceToHost, s));
        TD__CU(cudaStreamSynchronize(s));
        *result = f;
    }
    return TD_OK;
}
