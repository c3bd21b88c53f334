/* The linear node on a GPU through cuBLASLt: y = x W^T + b with the bias as the matmul's
 * epilogue, and both gradients as matmuls whose beta adds into a gradient that already holds
 * values; the bias gradient is a column sum in two stages (linear.cuh), in a fixed order. Row-major
 * tensors are read as column-major transposes, so no data moves: forward      Y^T (OUT, N)  = W
 * (OUT, IN)      . X^T (IN, N) weights      dW^T (IN, OUT) = X^T (IN, N)     . dY (N, OUT) data
 * dX^T (IN, N)  = W^T (IN, OUT)    . dY^T (OUT, N) Accumulation is f32 for every dtype; f32 inputs
 * are rounded to TF32 only where the graph allows it (td_graph_params.allow_tf32, off by default as
 * in PyTorch). */
#include <cstdlib>

#include "ops/cuda/cuda_ops.cuh"
#include "ops/cuda/linear.cuh"

/* One matmul shape, made once at compile with its algorithm. */
typedef struct {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
} gemm;

typedef struct {
    gemm fwd, dw, dx;
    int has_dw, has_dx;
    td_device device;
    float *partial; /* the bias gradient's partial sums (linear.cuh), on the device */
} linear_state;

static cudaDataType_t cuda_type(td_dtype dt) {
    return dt == TD_BF16 ? CUDA_R_16BF : dt == TD_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* C (m, n) = op(A) . op(B), column-major, A stored (ta ? k x m : m x k) with ld rows. */
static td_status gemm_init(td__gpu *g, gemm *m, td_dtype dt, int tf32, int ta, int tb, int64_t rows,
                           int64_t cols, int64_t inner, int64_t lda, int64_t ldb, int64_t ldc,
                           cublasLtEpilogue_t epilogue, const char *what) {
    cudaDataType_t t = cuda_type(dt);
    cublasComputeType_t compute =
        dt == TD_F32 && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    TD__CUBLAS(cublasLtMatmulDescCreate(&m->desc, compute, CUDA_R_32F));
    cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    TD__CUBLAS(
        cublasLtMatmulDescSetAttribute(m->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
    TD__CUBLAS(
        cublasLtMatmulDescSetAttribute(m->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
    TD__CUBLAS(cublasLtMatmulDescSetAttribute(m->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                              sizeof epilogue));
    TD__CUBLAS(cublasLtMatrixLayoutCreate(&m->a, t, ta ? inner : rows, ta ? rows : inner, lda));
    TD__CUBLAS(cublasLtMatrixLayoutCreate(&m->b, t, tb ? cols : inner, tb ? inner : cols, ldb));
    TD__CUBLAS(cublasLtMatrixLayoutCreate(&m->c, t, rows, cols, ldc));
    cublasLtMatmulPreference_t pref;
    TD__CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &g->workspace_bytes, sizeof g->workspace_bytes);
    /* The heuristic otherwise assumes 256-byte alignment; a graph's storage plan and DDP's
     * buckets promise 64 (a pointer may change after this choice: td_tensor_set_data). */
    const uint32_t align = 64;
    const cublasLtMatmulPreferenceAttributes_t aligned[] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; i++)
        st = cublasLtMatmulPreferenceSetAttribute(pref, aligned[i], &align, sizeof align);
    cublasLtMatmulHeuristicResult_t h;
    int found = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulAlgoGetHeuristic(g->lt, m->desc, m->a, m->b, m->c, m->c, pref, 1, &h,
                                            &found);
    cublasLtMatmulPreferenceDestroy(pref);
    TD__CUBLAS(st);
    if (!found)
        return td__host->fail(TD_EBACKEND, "%s: cuBLASLt has no algorithm for %lldx%lldx%lld", what,
                              (long long)rows, (long long)cols, (long long)inner);
    m->algo = h.algo;
    return TD_OK;
}

static void gemm_free(gemm *m) {
    if (m->a) cublasLtMatrixLayoutDestroy(m->a);
    if (m->b) cublasLtMatrixLayoutDestroy(m->b);
    if (m->c) cublasLtMatrixLayoutDestroy(m->c);
    if (m->desc) cublasLtMatmulDescDestroy(m->desc);
}

static td_status gemm_run(td__gpu *g, gemm *m, const void *a, const void *b, void *c, float beta,
                          const void *bias) {
    if (bias)
        TD__CUBLAS(cublasLtMatmulDescSetAttribute(m->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                  sizeof bias));
    const float alpha = 1.f;
    TD__CUBLAS(cublasLtMatmul(g->lt, m->desc, &alpha, a, m->a, b, m->b, &beta, c, m->c, c, m->c,
                              &m->algo, g->workspace, g->workspace_bytes, g->stream));
    return TD_OK;
}

static td_status linear_compile(td__op_ctx *ctx, td__node *n) {
    linear_state *s = (linear_state *)calloc(1, sizeof *s);
    if (!s) return td__host->fail(TD_ENOMEM, "linear: out of memory");
    n->state = s;
    td__gpu *g = td__gpu_of(ctx);
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    int64_t N = x->shape.dim[0], IN = x->shape.dim[1], OUT = w->shape.dim[0];
    TD__TRY(gemm_init(g, &s->fwd, x->dtype, ctx->allow_tf32, 1, 0, OUT, N, IN, IN, IN, OUT,
                      b ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT, "linear forward"));
    if (w->requires_grad) {
        TD__TRY(gemm_init(g, &s->dw, x->dtype, ctx->allow_tf32, 0, 1, IN, OUT, N, IN, OUT, IN,
                          CUBLASLT_EPILOGUE_DEFAULT, "linear backward weights"));
        s->has_dw = 1;
    }
    if (x->requires_grad) {
        TD__TRY(gemm_init(g, &s->dx, x->dtype, ctx->allow_tf32, 0, 0, IN, N, OUT, IN, OUT, IN,
                          CUBLASLT_EPILOGUE_DEFAULT, "linear backward data"));
        s->has_dx = 1;
    }
    s->device = ctx->device;
    if (b && b->requires_grad)
        return td__host->alloc(ctx->device, (size_t)(td__partials(N) * OUT) * sizeof(float),
                               (void **)&s->partial);
    return TD_OK;
}

static td_status linear_forward(td__op_ctx *ctx, td__node *n) {
    linear_state *s = (linear_state *)n->state;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    return gemm_run(td__gpu_of(ctx), &s->fwd, w->data, x->data, n->out->data, 0.f,
                    b ? b->data : NULL);
}

static td_status linear_backward(td__op_ctx *ctx, td__node *n) {
    linear_state *s = (linear_state *)n->state;
    td__gpu *g = td__gpu_of(ctx);
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2], *y = n->out;
    if (s->has_dw) {
        TD__TRY(gemm_run(g, &s->dw, x->data, y->grad, w->grad, td__grad_beta(w), NULL));
        td__grad_written(w);
    }
    if (b && b->requires_grad) {
        int64_t rows = y->shape.dim[0], cols = y->shape.dim[1];
        float beta = td__grad_beta(b);
        TD__FLOAT_TYPES(b->dtype, "linear backward bias", {
            td__launch_column_sum(g->stream, (T *)b->grad, s->partial, (const T *)y->grad, rows,
                                  cols, beta);
        });
        TD__LAUNCHED("linear backward bias");
        td__grad_written(b);
    }
    /* Final weight gradients go to DDP before the data gradient is computed. */
    ctx->params_ready(ctx, n, 1);
    if (s->has_dx) {
        TD__TRY(gemm_run(g, &s->dx, w->data, y->grad, x->grad, td__grad_beta(x), NULL));
        td__grad_written(x);
    }
    return TD_OK;
}

static void linear_destroy(td__node *n) {
    linear_state *s = (linear_state *)n->state;
    if (!s) return;
    gemm_free(&s->fwd);
    gemm_free(&s->dw);
    gemm_free(&s->dx);
    if (s->partial) td__host->free(s->device, s->partial);
    free(s);
}

const td__kernels td__cuda_linear = {.compile = linear_compile,
                                     .forward = linear_forward,
                                     .backward = linear_backward,
                                     .destroy = linear_destroy};
