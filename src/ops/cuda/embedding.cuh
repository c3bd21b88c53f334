/* The kernels of embedding.cu and their launches: the token lookup and the position embedding in
 * the tables' dtype, each sum rounded to it as the CPU rounds it, and their gradients summed with
 * no float atomics, every table element by one owning thread in token order (the token table
 * split into blocks of rows, tiling.h). Token ids are i64, i32 or f32 holding whole numbers; a
 * bad one gives a zero row and its first position goes to *bad. Compiles for a GPU and under the
 * CPU's emulation (device/cuda/kernel.cuh). Not installed. */
#ifndef TANDEM_CUDA_EMBEDDING_CUH
#define TANDEM_CUDA_EMBEDDING_CUH

#include "device/cuda/dtype.cuh"
#include "ops/cuda/tiling.h"

/* Token i of ids (dtype dt) as a row of a table of V rows, or -1 when it is not one. */
__device__ __forceinline__ int64_t td__token_row(const void *ids, int dt, size_t i, int64_t V) {
    int64_t id;
    if (dt == TD_I64) {
        id = ((const int64_t *)ids)[i];
    } else if (dt == TD_I32) {
        id = ((const int32_t *)ids)[i];
    } else {
        float f = ((const float *)ids)[i];
        if (!(f == floorf(f)) || fabsf(f) > 16777216.f) return -1;
        id = (int64_t)f;
    }
    return id >= 0 && id < V ? id : -1;
}

/* v rounded to T, as a store to T and a load back would give it. */
template <typename T> __device__ __forceinline__ float td__rounded(float v) {
    T t;
    td_st(&t, 0, v);
    return td_ld(&t, 0);
}

/* y (n, C) = table[ids]; a bad id's row is zeros and the smallest bad position goes to *bad. */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__token_forward_kernel(T *y, const T *table, const void *ids, int dt, size_t n, int64_t V,
                             int64_t C, unsigned long long *bad) {
    TD__GRID_STRIDE(e, n * (size_t)C) {
        size_t i = e / (size_t)C, c = e % (size_t)C;
        int64_t row = td__token_row(ids, dt, i, V);
        if (row < 0 && c == 0) atomicMin(bad, (unsigned long long)i);
        td_st(y, e, row < 0 ? 0.f : td_ld(table, (size_t)row * C + c));
    }
}

/* Exclusive prefix sum of one int per thread over a block of TD__THREADS (Hillis and Steele in
 * shared memory); *total gets the sum. Every thread must call it. */
__device__ __forceinline__ int td__block_exclusive_scan(int v, int *total) {
    __shared__ int buf[TD__THREADS];
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int step = 1; step < TD__THREADS; step *= 2) {
        int add = (int)threadIdx.x >= step ? buf[threadIdx.x - step] : 0;
        __syncthreads();
        buf[threadIdx.x] += add;
        __syncthreads();
    }
    int inclusive = buf[threadIdx.x];
    *total = buf[TD__THREADS - 1];
    __syncthreads();
    return inclusive - v;
}

/* dtable rows [v0, v0 + rows_per_block) of block v0 / rows_per_block: beta dtable, then dy's row
 * of every position whose id is in them, in position order (each element's thread is fixed by
 * its column, so its sum runs in that order, rounded to T at every step as on the CPU). */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__token_backward_kernel(T *dtable, const T *dy, const void *ids, int dt, size_t n, int64_t V,
                              int64_t C, int64_t rows_per_block, float beta) {
    __shared__ size_t hit_pos[TD__THREADS];
    __shared__ int64_t hit_row[TD__THREADS];
    int64_t v0 = (int64_t)blockIdx.x * rows_per_block;
    int64_t v1 = v0 + rows_per_block < V ? v0 + rows_per_block : V;
    for (int64_t v = v0; v < v1; v++)
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            size_t at = (size_t)(v * C + c);
            td_st(dtable, at, beta != 0.f ? beta * td_ld(dtable, at) : 0.f);
        }
    for (size_t base = 0; base < n; base += TD__THREADS) {
        size_t i = base + threadIdx.x;
        int64_t row = i < n ? td__token_row(ids, dt, i, V) : -1;
        int hit = row >= v0 && row < v1, hits;
        int at = td__block_exclusive_scan(hit, &hits); /* also orders the stores above */
        if (hit) {
            hit_pos[at] = i;
            hit_row[at] = row;
        }
        __syncthreads();
        for (int h = 0; h < hits; h++)
            for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
                size_t to = (size_t)(hit_row[h] * C + c);
                td_st(dtable, to, td_ld(dtable, to) + td_ld(dy, hit_pos[h] * (size_t)C + c));
            }
        __syncthreads();
    }
}

/* y = x + table[t] for the rows of x (rows, C), sequences of T positions one after another. */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__position_forward_kernel(T *y, const T *x, const T *table, size_t rows, int64_t T_,
                                int64_t C) {
    TD__GRID_STRIDE(e, rows * (size_t)C) {
        size_t r = e / (size_t)C, c = e % (size_t)C;
        size_t pos = (r % (size_t)T_) * (size_t)C + c;
        td_st(y, e, td_ld(x, e) + td_ld(table, pos));
    }
}

/* dtable[t, c] = beta dtable[t, c] + the sum over sequences s of dy[s, t, c], in order of s,
 * over every row of the table: the rows past T take no gradient (0 when written, as the CPU's). */
template <typename T>
__global__ void __launch_bounds__(TD__THREADS)
    td__position_backward_kernel(T *dtable, const T *dy, size_t sequences, int64_t T_, int64_t C,
                                 int64_t V, float beta) {
    TD__GRID_STRIDE(e, (size_t)(V * C)) {
        float sum = beta != 0.f ? beta * td_ld(dtable, e) : 0.f;
        if (e < (size_t)(T_ * C))
            for (size_t s = 0; s < sequences; s++)
                sum = td__rounded<T>(sum + td_ld(dy, s * (size_t)(T_ * C) + e));
        td_st(dtable, e, sum);
    }
}

/* y (n, C) = table[ids] over n ids of dtype dt into a table of V rows. */
template <typename T>
static inline void td__launch_token_forward(cudaStream_t s, T *y, const T *table, const void *ids,
                                            int dt, size_t n, int64_t V, int64_t C,
                                            unsigned long long *bad) {
    size_t cnt = n * (size_t)C;
    if (cnt)
        td__launch<td__token_forward_kernel<T>>(td__blocks(cnt), 0, s, y, table, ids, dt, n, V, C,
                                                bad);
}

/* dtable (V, C) = beta dtable + dy's rows summed at their ids, in token order. */
template <typename T>
static inline void td__launch_token_backward(cudaStream_t s, T *dtable, const T *dy,
                                             const void *ids, int dt, size_t n, int64_t V,
                                             int64_t C, float beta) {
    if (V > 0 && C > 0)
        td__launch<td__token_backward_kernel<T>>((unsigned)td__emb_blocks(V), 0, s, dtable, dy, ids,
                                                 dt, n, V, C, td__emb_rows_per_block(V), beta);
}

/* y = x + table[t] over `elements` of x (rows of C, sequences of T_ positions). */
template <typename T>
static inline void td__launch_position_forward(cudaStream_t s, T *y, const T *x, const T *table,
                                               size_t elements, int64_t T_, int64_t C) {
    if (elements)
        td__launch<td__position_forward_kernel<T>>(td__blocks(elements), 0, s, y, x, table,
                                                   elements / (size_t)C, T_, C);
}

/* dtable (V, C) = beta dtable + dy (`elements`, sequences of T_ rows of C) summed by position. */
template <typename T>
static inline void td__launch_position_backward(cudaStream_t s, T *dtable, const T *dy,
                                                size_t elements, int64_t T_, int64_t C, int64_t V,
                                                float beta) {
    if (V > 0 && C > 0)
        td__launch<td__position_backward_kernel<T>>(
            td__blocks((size_t)(V * C)), 0, s, dtable, dy,
            T_ > 0 && C > 0 ? elements / (size_t)(T_ * C) : 0, T_, C, V, beta);
}

#endif
