/* Element-wise ops on a GPU: ReLU, exact-erf GELU and tanh GELU (own output or in place, as the
 * fusion pass decided), add, scale, cast, reshape (a copy: layouts are plain here), and the
 * converting y = beta y + alpha x every gradient accumulation and dtype change uses; the kernels
 * are eltwise.cuh's. */
#include "ops/cuda/cuda_ops.cuh"
#include "ops/cuda/eltwise.cuh"

td_status td__cuda_add_into(td__op_ctx *ctx, void *y, td_dtype yt, const void *x, td_dtype xt,
                            size_t n, float alpha, float beta, const char *what) {
    if (n == 0) return TD_OK;
    cudaStream_t s = td__gpu_of(ctx)->stream;
    TD__FLOAT_TYPES(yt, what, {
        typedef T YT;
        TD__FLOAT_TYPES(xt, what,
                        { td__launch_add_into(s, (YT *)y, (const T *)x, n, alpha, beta); });
    });
    TD__LAUNCHED(what);
    return TD_OK;
}

static td_status elt_forward(td__op_ctx *ctx, td__node *n) {
    if (n->alias == TD__FOLDED) return TD_OK; /* its producer applied it */
    td_tensor *x = n->in[0], *y = n->out;
    size_t cnt = td__numel(x);
    cudaStream_t s = td__gpu_of(ctx)->stream;
    TD__FLOAT_TYPES(x->dtype, n->what, {
        td__launch_act_forward(s, (T *)y->data, (const T *)x->data, cnt, n->variant);
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
        td__launch_act_backward(s, (T *)x->grad, (const T *)y->grad, (const T *)from, cnt,
                                in_place ? TD__ELT_RELU : n->variant, beta);
    });
    TD__LAUNCHED(n->what);
    td__grad_written(x);
    return TD_OK;
}

const td__kernels td__cuda_eltwise = {.forward = elt_forward, .backward = elt_backward};

/* ---- add, scale, cast, reshape ---- */

static td_status add_forward(td__op_ctx *ctx, td__node *n) {
    td_tensor *a = n->in[0], *b = n->in[1], *y = n->out;
    size_t cnt = td__numel(y);
    cudaStream_t s = td__gpu_of(ctx)->stream;
    TD__FLOAT_TYPES(y->dtype, n->what, {
        td__launch_add(s, (T *)y->data, (const T *)a->data, (const T *)b->data, cnt);
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
