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
#include "ops/cuda/embedding.cuh"

typedef struct {
    unsigned long long *bad;        /* mapped host memory: the first bad token's position, or ~0 */
    unsigned long long *bad_device; /* the same memory as the kernels address it */
} emb_state;

static td_status emb_compile(td__op_ctx *ctx, td__node *n) {
    (void)ctx;
    if (n->variant == TD__EMB_VOCAB_SLICE)
        return td__host->fail(TD_EUNSUPPORTED,
                              "%s: the vocabulary-parallel lookup has no GPU kernel (tensor "
                              "parallelism runs on the CPU)",
                              n->what);
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
            td__launch_token_forward(st, (T *)y->data, (const T *)table->data, in0->data,
                                     (int)in0->dtype, td__numel(in0), table->shape.dim[0], C,
                                     s->bad_device);
        });
    } else {
        int64_t T_ = in0->shape.dim[in0->shape.ndim - 2];
        TD__FLOAT_TYPES(y->dtype, n->what, {
            td__launch_position_forward(st, (T *)y->data, (const T *)in0->data,
                                        (const T *)table->data, cnt, T_, C);
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
            td__launch_token_backward(st, (T *)table->grad, (const T *)y->grad, in0->data,
                                      (int)in0->dtype, td__numel(in0), V, C, beta);
        });
        TD__LAUNCHED(n->what);
        td__grad_written(table);
        return TD_OK;
    }
    int64_t T_ = in0->shape.dim[in0->shape.ndim - 2];
    size_t cnt = td__numel(y);
    if (table->requires_grad) {
        TD__FLOAT_TYPES(y->dtype, n->what, {
            td__launch_position_backward(st, (T *)table->grad, (const T *)y->grad, cnt, T_, C, V,
                                         beta);
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
