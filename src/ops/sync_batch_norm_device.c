/* SyncBatchNorm's kernels on a GPU (any backend without kernels of its own for the op): the
 * per-channel sums and the per-channel affine map run on the device (device_impl.h's channel
 * kernels, plain NCHW f32: the op computes in f32), and between them the host does what the
 * CPU kernels do (sync_batch_norm.h): brings the sums down, all-reduces them over the group in
 * host memory, and computes the statistics, the running statistics and the coefficients,
 * which go back up. Each copy waits for the device (weight, bias and running statistics come
 * down every call, as other code may have changed them), a handful of short waits per call
 * beside the group's all-reduce, which waits anyway (a graph holding the op is never recorded).
 * The weight and bias gradients stay this rank's own, as on the CPU. */
#include "device/device_impl.h"
#include "ops/backend.h"
#include "ops/collective.h"
#include "ops/sync_batch_norm.h"

typedef struct {
    int64_t N, C, S;    /* x is (N, C, S = H * W) */
    td_device device;   /* where dev_sums and coef live */
    double *sums;       /* host (2C + 1): the group's sums, then the count */
    double *dev_sums;   /* device (2C) */
    double *mean, *inv; /* host (C) each */
    float *params;      /* host (4C): weight, bias, running mean and variance as downloaded */
    float *map;         /* host (4C): mean, then the map's a and c (or da and dc), then k */
    float *db;          /* host (C): a parameter's gradient on its way up */
    float *coef;        /* device (4C): the map as the affine kernel reads it */
    double count;       /* elements per channel over the group in the last training forward */
    int trained;        /* the last forward ran in training mode */
} dev_state;

static td_status dev_compile(td__op_ctx *ctx, td__node *n) {
    const td_tensor *x = n->in[0];
    dev_state *s = td__op_alloc(ctx, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "sync_batch_norm2d: out of memory");
    n->state = s;
    s->N = x->shape.dim[0];
    s->C = x->shape.dim[1];
    s->S = x->shape.dim[2] * x->shape.dim[3];
    s->device = ctx->device;
    size_t c = (size_t)s->C;
    s->sums = td__op_alloc(ctx, (2 * c + 1) * sizeof(double));
    s->mean = td__op_alloc(ctx, c * sizeof(double));
    s->inv = td__op_alloc(ctx, c * sizeof(double));
    s->params = td__op_alloc(ctx, 4 * c * sizeof(float));
    s->map = td__op_alloc(ctx, 4 * c * sizeof(float));
    s->db = td__op_alloc(ctx, c * sizeof(float));
    if (!s->sums || !s->mean || !s->inv || !s->params || !s->map || !s->db)
        return td__fail(TD_ENOMEM, "sync_batch_norm2d: out of memory");
    TD__TRY(td_device_alloc(s->device, 2 * c * sizeof(double), (void **)&s->dev_sums));
    TD__TRY(td_device_alloc(s->device, 4 * c * sizeof(float), (void **)&s->coef));
    td_shape channels = td_shape_1d(s->C);
    return td__coll_agree(ctx, n, &channels, x->dtype, x->requires_grad);
}

/* The statistics (st) over the map's first three rows: mean, a, c. */
static td__sbn_stats stats_of(dev_state *s) {
    size_t c = (size_t)s->C;
    return (td__sbn_stats){s->mean, s->inv, s->map, s->map + c, s->map + 2 * c};
}

/* Weight, bias and running statistics into s->params. */
static td_status download_params(td__op_ctx *ctx, td__node *n, dev_state *s) {
    size_t bytes = (size_t)s->C * sizeof(float);
    for (int i = 0; i < 4; i++)
        TD__TRY(ctx->backend->download(ctx, s->params + (size_t)i * (size_t)s->C,
                                       n->in[1 + i]->data, bytes));
    return TD_OK;
}

/* Sums over the channels (of x, or of dy against the mean on the device) into s->sums (2C). */
static td_status channel_sums(td__op_ctx *ctx, dev_state *s, const float *x, const float *dy) {
    TD__TRY(td__device_channel_sums(s->device, x, dy, dy ? s->coef : NULL, s->N, s->C, s->S,
                                    s->dev_sums, "sync_batch_norm2d"));
    return ctx->backend->download(ctx, s->sums, s->dev_sums, 2 * (size_t)s->C * sizeof(double));
}

/* out = the map (uploaded first) applied to in, plus k extra when extra is given. */
static td_status apply(td__op_ctx *ctx, dev_state *s, float *out, const float *in,
                       const float *extra) {
    TD__TRY(ctx->backend->upload(ctx, s->coef, s->map, 4 * (size_t)s->C * sizeof(float)));
    return td__device_channel_affine(s->device, out, in, s->coef, extra, s->N, s->C, s->S,
                                     "sync_batch_norm2d");
}

static td_status dev_forward(td__op_ctx *ctx, td__node *n) {
    dev_state *s = n->state;
    td_tensor *x = n->in[0];
    int64_t C = s->C;
    const float *w = s->params, *b = s->params + C;
    float *rm = s->params + 2 * C, *rv = s->params + 3 * C;
    td__sbn_stats st = stats_of(s);
    s->trained = ctx->training;
    TD__TRY(download_params(ctx, n, s));
    if (!ctx->training) {
        td__sbn_eval_stats(n, C, w, b, rm, rv, &st);
        return apply(ctx, s, n->out->data, x->data, NULL);
    }
    TD__TRY(channel_sums(ctx, s, x->data, NULL));
    s->sums[2 * C] = (double)(s->N * s->S);
    if (td__coll_size(ctx) > 1) {
        td_status e =
            td_comm_allreduce(ctx->comm, s->sums, s->sums, (size_t)(2 * C + 1), TD_F64, TD_OP_SUM);
        if (e != TD_OK) return td__coll_fail(n, "forward", e);
    }
    s->count = s->sums[2 * C];
    td__sbn_train_stats(n, C, C, s->sums, w, b, rm, rv, &st);
    size_t bytes = (size_t)C * sizeof(float);
    TD__TRY(ctx->backend->upload(ctx, n->in[3]->data, rm, bytes));
    TD__TRY(ctx->backend->upload(ctx, n->in[4]->data, rv, bytes));
    return apply(ctx, s, n->out->data, x->data, NULL);
}

/* A parameter's gradient from host values (g, C floats). */
static td_status param_grad(td__op_ctx *ctx, dev_state *s, td_tensor *t, int slot, const float *g) {
    TD__TRY(
        ctx->backend->upload(ctx, td__grad_begin(ctx, t, slot), g, (size_t)s->C * sizeof(float)));
    return td__grad_end(ctx, t);
}

static td_status dev_backward(td__op_ctx *ctx, td__node *n) {
    dev_state *s = n->state;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2], *y = n->out;
    int64_t C = s->C;
    td__sbn_stats st = stats_of(s);
    TD__TRY(download_params(ctx, n, s));
    if (!s->trained) /* the running stats as they are now */
        td__sbn_eval_stats(n, C, s->params, s->params + C, s->params + 2 * C, s->params + 3 * C,
                           &st);
    /* the mean the sums subtract is the map's first row */
    TD__TRY(ctx->backend->upload(ctx, s->coef, s->map, (size_t)C * sizeof(float)));
    TD__TRY(channel_sums(ctx, s, x->data, y->grad));
    const double *sdy = s->sums, *sdyx = s->sums + C;
    if (w->requires_grad) {
        for (int64_t ch = 0; ch < C; ch++) s->db[ch] = (float)(sdyx[ch] * s->inv[ch]);
        TD__TRY(param_grad(ctx, s, w, 1, s->db));
    }
    if (b->requires_grad) {
        for (int64_t ch = 0; ch < C; ch++) s->db[ch] = (float)sdy[ch];
        TD__TRY(param_grad(ctx, s, b, 2, s->db));
    }
    /* Final weight gradients go to DDP before the data gradient's all-reduce. */
    ctx->params_ready(ctx, n, 1);
    if (!x->requires_grad) return TD_OK;
    if (s->trained && td__coll_size(ctx) > 1) {
        td_status e =
            td_comm_allreduce(ctx->comm, s->sums, s->sums, (size_t)(2 * C), TD_F64, TD_OP_SUM);
        if (e != TD_OK) return td__coll_fail(n, "backward", e);
    }
    size_t c = (size_t)C;
    td__sbn_backward_coefficients(C, C, s->sums, s->params, s->count, s->trained, &st,
                                  s->map + 3 * c, s->map + c, s->map + 2 * c);
    TD__TRY(apply(ctx, s, td__grad_begin(ctx, x, 0), x->data, y->grad));
    return td__grad_end(ctx, x);
}

static void dev_destroy(td__node *n) {
    dev_state *s = n->state;
    if (!s) return;
    if (s->dev_sums) td_device_free(s->device, s->dev_sums);
    if (s->coef) td_device_free(s->device, s->coef);
}

const td__kernels td__sync_batch_norm_device = {
    .compile = dev_compile,
    .forward = dev_forward,
    .backward = dev_backward,
    .destroy = dev_destroy,
};
