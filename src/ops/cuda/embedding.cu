/* The embedding nodes on a GPU, as the CPU op (src/ops/cpu/embedding.c) computes them: the token
 * lookup y = table[idx] and the position embedding y = x + table[t], in the table's dtype (f32,
 * bf16 or f16: from apex O2 on the tables are stored low), each sum rounded to that dtype as the
 * CPU rounds it.
 *
 * The gradients sum into the tables deterministically, with no float atomics: every element of a
 * table's gradient has one owning thread, which adds its contributions in token order, so the
 * sums are the CPU's, in the CPU's order, and the same bits every run. The position table's
 * element (t, c) is one thread's loop over the sequences. The token table is split into blocks
 * of consecutive rows (tiling.h); a block reads every token id, a tile of ids at a time, lists
 * the positions whose ids fall in its rows in order (a prefix sum of the hits), and its threads,
 * one per column, add those positions' rows of dy: per-row ownership, no sort.
 *
 * Token ids are i64, i32 or f32 holding whole numbers, as on the CPU. An id outside [0, V) or not
 * whole gives a zero row and takes no gradient, and the first such position is kept in mapped
 * host memory: the next forward of the node fails naming it (the GPU cannot stop mid-step to say
 * so, as with nll_loss's labels). */
#include <cstdlib>

#include "ops/cuda/cuda_ops.cuh"
#include "ops/cuda/tiling.h"

/* Token i of ids (dtype dt) as a row of a table of V rows, or -1 when it is not one. */
__device__ __forceinline__ int64_t token_row(const void *ids, int dt, size_t i, int64_t V) {
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
template <typename T> __device__ __forceinline__ float rounded(float v) {
    T t;
    td_st(&t, 0, v);
    return td_ld(&t, 0);
}

/* y (n, C) = table[ids]; a bad id's row is zeros and the smallest bad position goes to *bad. */
template <typename T>
__global__ void token_forward(T *y, const T *table, const void *ids, int dt, size_t n, int64_t V,
                              int64_t C, unsigned long long *bad) {
    TD__GRID_STRIDE(e, n * (size_t)C) {
        size_t i = e / (size_t)C, c = e % (size_t)C;
        int64_t row = token_row(ids, dt, i, V);
        if (row < 0 && c == 0) atomicMin(bad, (unsigned long long)i);
        td_st(y, e, row < 0 ? 0.f : td_ld(table, (size_t)row * C + c));
    }
}

/* Exclusive prefix sum of one int per thread over a block of TD__THREADS (Hillis and Steele in
 * shared memory); *total gets the sum. Every thread must call it. */
__device__ __forceinline__ int block_exclusive_scan(int v, int *total) {
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
__global__ void token_backward(T *dtable, const T *dy, const void *ids, int dt, size_t n, int64_t V,
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
        int64_t row = i < n ? token_row(ids, dt, i, V) : -1;
        int hit = row >= v0 && row < v1, hits;
        int at = block_exclusive_scan(hit, &hits); /* also orders the stores above */
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
__global__ void position_forward(T *y, const T *x, const T *table, size_t rows, int64_t T_,
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
__global__ void position_backward(T *dtable, const T *dy, size_t sequences, int64_t T_, int64_t C,
                                  int64_t V, float beta) {
    TD__GRID_STRIDE(e, (size_t)(V * C)) {
        float sum = beta != 0.f ? beta * td_ld(dtable, e) : 0.f;
        if (e < (size_t)(T_ * C))
            for (size_t s = 0; s < sequences; s++)
                sum = rounded<T>(sum + td_ld(dy, s * (size_t)(T_ * C) + e));
        td_st(dtable, e, sum);
    }
}

typedef struct {
    unsigned long long *bad;        /* mapped host memory: the first bad token's position, or ~0 */
    unsigned long long *bad_device; /* the same memory as the kernels address it */
} emb_state;

static td_status emb_compile(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    if (n->variant != TD__EMB_TOKEN) return TD_OK;
    emb_state *s = (emb_state *)calloc(1, sizeof *s);
    if (!s) return td__host->fail(TD_ENOMEM, "%s: out of memory", n->what);
    n->state = s;
    TD__CU(cudaHostAlloc((void **)&s->bad, sizeof *s->bad, cudaHostAllocMapped));
    *s->bad = ~0ull;
    TD__CU(cudaHostGetDevicePointer((void **)&s->bad_device, s->bad, 0));
    return TD_OK;
}

/* A token a finished forward found bad fails the next forward (replayed or not). */
static td_status emb_check(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    emb_state *s = (emb_state *)n->state;
    if (!s || *(volatile unsigned long long *)s->bad == ~0ull) return TD_OK;
    unsigned long long i = *s->bad;
    *s->bad = ~0ull;
    return td__host->fail(TD_EINVAL,
                          "%s: token %llu of '%s' (of a previous step on the GPU) is outside [0, "
                          "%lld) or not a whole number",
                          n->what, i, n->in[0]->name, (long long)n->in[1]->shape.dim[0]);
}

static td_status emb_forward(td__op_ctx *ctx, td__node *n) {
    cudaStream_t st = td__gpu_of(ctx)->stream;
    const td_tensor *in0 = n->in[0], *table = n->in[1];
    int64_t C = table->shape.dim[1];
    td_tensor *y = n->out;
    size_t cnt = td__numel(y);
    if (n->variant == TD__EMB_TOKEN) {
        emb_state *s = (emb_state *)n->state;
        TD__FLOAT_TYPES(y->dtype, n->what, {
            token_forward<T><<<td__blocks(cnt), TD__THREADS, 0, st>>>(
                (T *)y->data, (const T *)table->data, in0->data, (int)in0->dtype, td__numel(in0),
                table->shape.dim[0], C, s->bad_device);
        });
    } else {
        int64_t T_ = in0->shape.dim[in0->shape.ndim - 2];
        TD__FLOAT_TYPES(y->dtype, n->what, {
            position_forward<T><<<td__blocks(cnt), TD__THREADS, 0, st>>>(
                (T *)y->data, (const T *)in0->data, (const T *)table->data, cnt / (size_t)C, T_, C);
        });
    }
    TD__LAUNCHED(n->what);
    return TD_OK;
}

static td_status emb_backward(td__op_ctx *ctx, td__node *n) {
    cudaStream_t st = td__gpu_of(ctx)->stream;
    td_tensor *in0 = n->in[0], *table = n->in[1], *y = n->out;
    int64_t V = table->shape.dim[0], C = table->shape.dim[1];
    float beta = td__grad_beta(table);
    if (n->variant == TD__EMB_TOKEN) {
        if (!table->requires_grad) return TD_OK;
        TD__FLOAT_TYPES(y->dtype, n->what, {
            token_backward<T><<<(unsigned)td__emb_blocks(V), TD__THREADS, 0, st>>>(
                (T *)table->grad, (const T *)y->grad, in0->data, (int)in0->dtype, td__numel(in0), V,
                C, td__emb_rows_per_block(V), beta);
        });
        TD__LAUNCHED(n->what);
        td__grad_written(table);
        return TD_OK;
    }
    int64_t T_ = in0->shape.dim[in0->shape.ndim - 2];
    size_t cnt = td__numel(y);
    if (table->requires_grad) {
        TD__FLOAT_TYPES(y->dtype, n->what, {
            int64_t rows = table->shape.dim[0];
            position_backward<T><<<td__blocks((size_t)(rows * C)), TD__THREADS, 0, st>>>(
                (T *)table->grad, (const T *)y->grad, cnt / (size_t)(T_ * C), T_, C, rows, beta);
        });
        TD__LAUNCHED(n->what);
        td__grad_written(table);
    }
    if (in0->requires_grad) {
        TD__TRY(td__cuda_add_into(ctx, in0->grad, in0->dtype, y->grad, y->dtype, cnt, 1.f,
                                  td__grad_beta(in0), n->what));
        td__grad_written(in0);
    }
    return TD_OK;
}

static void emb_destroy(td__node *n) {
    emb_state *s = (emb_state *)n->state;
    if (!s) return;
    if (s->bad) cudaFreeHost(s->bad);
    free(s);
}

const td__kernels td__cuda_embedding = {.compile = emb_compile,
                                        .forward = emb_forward,
                                        .backward = emb_backward,
                                        .destroy = emb_destroy,
                                        .check = emb_check};
