/* Element-wise ops on a GPU: ReLU, exact-erf GELU and tanh GELU (own output or in place, as the
 * fusion pass decided), add, scale, cast, reshape (a copy: layouts are plain here), and the
 * converting y = beta y + alpha x every gradient accumulation and dtype change uses. Each
 * element is computed in f32, as the CPU kernels do. */
#include "ops/cuda/cuda_ops.cuh"

template <typename Y, typename X>
__global__ void add_into_kernel(Y *y, const X *x, size_t n, float alpha, float beta) {
    TD__GRID_STRIDE(i, n) {
        float v = alpha * td_ld(x, i);
        td_st(y, i, beta != 0.f ? beta * td_ld(y, i) + v : v);
    }
}

td_status td__cuda_add_into(td__op_ctx *ctx, void *y, td_dtype yt, const void *x, td_dtype xt,
                            size_t n, float alpha, float beta, const char *what) {
    if (n == 0) return TD_OK;
    cudaStream_t s = td__gpu_of(ctx)->stream;
    TD__FLOAT_TYPES(yt, what, {
        typedef T YT;
        TD__FLOAT_TYPES(xt, what, {
            add_into_kernel<YT, T>
                <<<td__blocks(n), TD__THREADS, 0, s>>>((YT *)y, (const T *)x, n, alpha, beta);
        });
    });
    TD__LAUNCHED(what);
    return TD_OK;
}

/* ---- ReLU and GELU (exact erf form, and GPT-2's tanh form) ---- */

#define GELU_K 0.7978845608028654f /* sqrt(2 / pi) */

__device__ __forceinline__ float act(float x, int variant) {
    switch (variant) {
    case TD__ELT_GELU:
        return 0.5f * x * (1.f + erff(x * 0.70710678f));
    case TD__ELT_GELU_TANH:
        return 0.5f * x * (1.f + tanhf(GELU_K * (x + 0.044715f * x * x * x)));
    default:
        return fmaxf(x, 0.f);
    }
}

/* f'(x) dy */
__device__ __forceinline__ float act_grad(float x, float dy, int variant) {
    switch (variant) {
    case TD__ELT_GELU: {
        float cdf = 0.5f * (1.f + erff(x * 0.70710678f));
        return (cdf + x * 0.39894228f * expf(-0.5f * x * x)) * dy;
    }
    case TD__ELT_GELU_TANH: {
        float t = tanhf(GELU_K * (x + 0.044715f * x * x * x));
        float du = GELU_K * (1.f + 3.f * 0.044715f * x * x);
        return dy * (0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du);
    }
    default:
        return x > 0.f ? dy : 0.f;
    }
}

template <typename T> __global__ void act_forward(T *y, const T *x, size_t n, int variant) {
    TD__GRID_STRIDE(i, n) td_st(y, i, act(td_ld(x, i), variant));
}

/* dx = beta dx + f'(x) dy; in place (x gone), ReLU's f' is read off y over dy's storage. */
template <typename T>
__global__ void act_backward(T *dx, const T *dy, const T *x, size_t n, int variant, float beta) {
    TD__GRID_STRIDE(i, n) {
        float d = act_grad(td_ld(x, i), td_ld(dy, i), variant);
        td_st(dx, i, beta != 0.f ? beta * td_ld(dx, i) + d : d);
    }
}

static td_status elt_forward(td__op_ctx *ctx, td__node *n) {
    if (n->alias == TD__FOLDED) return TD_OK; /* its producer applied it */
    td_tensor *x = n->in[0], *y = n->out;
    size_t cnt = td__numel(x);
    cudaStream_t s = td__gpu_of(ctx)->stream;
    TD__FLOAT_TYPES(x->dtype, n->what, {
        act_forward<T><<<td__blocks(cnt), TD__THREADS, 0, s>>>((T *)y->data, (const T *)x->data,
                                                               cnt, n->variant);
    });
    TD__LAUNCHED(n->what);
    return TD_OK;
}

static td_status elt_backward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    if (n->alias == TD__FOLDED) { /* dy already sits in x's (shared) gradient */
        x->grad_zero = y->grad_zero;
        return TD_OK;
    }
    size_t cnt = td__numel(x);
    cudaStream_t s = td__gpu_of(ctx)->stream;
    int in_place = n->alias == TD__IN_PLACE; /* only ReLU runs in place */
    const void *from = in_place ? y->data : x->data;
    float beta = in_place ? 0.f : td__grad_beta(x);
    TD__FLOAT_TYPES(x->dtype, n->what, {
        act_backward<T><<<td__blocks(cnt), TD__THREADS, 0, s>>>(
            (T *)x->grad, (const T *)y->grad, (const T *)from, cnt,
            in_place ? TD__ELT_RELU : n->variant, beta);
    });
    TD__LAUNCHED(n->what);
    td__grad_written(x);
    return TD_OK;
}

const td__kernels td__cuda_eltwise = {.forward = elt_forward, .backward = elt_backward};

/* ---- add, scale, cast, reshape ---- */

template <typename T> __global__ void add_kernel(T *y, const T *a, const T *b, size_t n) {
    TD__GRID_STRIDE(i, n) td_st(y, i, td_ld(a, i) + td_ld(b, i));
}

static td_status add_forward(td__op_ctx *ctx, td__node *n) {
    td_tensor *a = n->in[0], *b = n->in[1], *y = n->out;
    size_t cnt = td__numel(y);
    cudaStream_t s = td__gpu_of(ctx)->stream;
    TD__FLOAT_TYPES(y->dtype, n->what, {
        add_kernel<T><<<td__blocks(cnt), TD__THREADS, 0, s>>>((T *)y->data, (const T *)a->data,
                                                              (const T *)b->data, cnt);
    });
    TD__LAUNCHED(n->what);
    return TD_OK;
}

/* Passes dy (times alpha) on to input i's gradient, converting to its dtype. */
static td_status pass_back(td__op_ctx *ctx, td__node *n, int i, float alpha) {
    td_tensor *x = n->in[i], *y = n->out;
    if (!x || !x->requires_grad || !x->grad) return TD_OK;
    TD__TRY(td__cuda_add_into(ctx, x->grad, x->dtype, y->grad, y->dtype, td__numel(x), alpha,
                              td__grad_beta(x), n->what));
    td__grad_written(x);
    return TD_OK;
}

static td_status add_backward(td__op_ctx *ctx, td__node *n) {
    TD__TRY(pass_back(ctx, n, 0, 1.f));
    return pass_back(ctx, n, 1, 1.f);
}

const td__kernels td__cuda_add = {.forward = add_forward, .backward = add_backward};

static td_status scale_forward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    return td__cuda_add_into(ctx, y->data, y->dtype, x->data, x->dtype, td__numel(x), n->attr.alpha,
                             0.f, n->what);
}

static td_status scale_backward(td__op_ctx *ctx, td__node *n) {
    return pass_back(ctx, n, 0, n->attr.alpha);
}

const td__kernels td__cuda_scale = {.forward = scale_forward, .backward = scale_backward};

/* Cast and reshape both copy values (converting the dtype for a cast). */
static td_status copy_forward(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    return td__cuda_add_into(ctx, y->data, y->dtype, x->data, x->dtype, td__numel(x), 1.f, 0.f,
                             n->what);
}

static td_status copy_backward(td__op_ctx *ctx, td__node *n) { return pass_back(ctx, n, 0, 1.f); }

const td__kernels td__cuda_cast = {.forward = copy_forward, .backward = copy_backward};
const td__kernels td__cuda_reshape = {.forward = copy_forward, .backward = copy_backward};
