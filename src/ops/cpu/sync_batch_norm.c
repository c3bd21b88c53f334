/* The SyncBatchNorm node (torch.nn.SyncBatchNorm's numerics): batch norm over (N, C, H, W)
 * whose training statistics are those of the whole group's batch. Forward all-reduces each
 * channel's sum and sum of squares and the element count (f64), normalises with the global
 * mean and biased variance, and moves the running stats with the unbiased variance over the
 * global count; backward all-reduces each channel's sum of dy and of dy * (x - mean) and
 * forms dx from the global sums, while the weight and bias gradients stay this rank's own
 * (DDP averages them, as PyTorch's). Ranks may hold different batch sizes. Eval mode
 * normalises with the running stats and communicates nothing. Computes in f32 whatever the
 * activations' dtype (apex's rule), in plain C over the input's own layout (plain or
 * channel-blocked), which the output keeps. The graph adds plain batch norm instead when the
 * group has one rank, as PyTorch does. The per-channel arithmetic on the host is shared with the
 * kernels for other devices (../sync_batch_norm_device.c). */
#include "ops/sync_batch_norm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops/collective.h"
#include "ops/cpu/onednn.h"

/* How a 4-d activation lies in memory: sample n, channel block cb, position s of an H * W
 * plane, then blk consecutive channels (blk 1: one channel per block, plain NCHW or NHWC). */
typedef struct {
    int64_t N, C, CB, S, blk;
    int64_t sn, scb, ss; /* strides in elements */
} walk;

/* The walk of md, or 0 for a layout it cannot describe. */
static int walk_of(const dnnl_memory_desc_t *md, walk *w) {
    if (md->ndims != 4 || md->format_kind != dnnl_blocked || md->offset0 != 0) return 0;
    const dnnl_blocking_desc_t *b = &md->format_desc.blocking;
    w->blk = 1;
    if (b->inner_nblks == 1 && b->inner_idxs[0] == 1)
        w->blk = b->inner_blks[0];
    else if (b->inner_nblks != 0)
        return 0;
    if (b->strides[2] != md->dims[3] * b->strides[3]) return 0; /* H and W are one plane */
    if (w->blk > 1 && b->strides[3] != w->blk) return 0;
    w->N = md->dims[0];
    w->C = md->dims[1];
    w->CB = md->padded_dims[1] / w->blk;
    w->S = md->dims[2] * md->dims[3];
    w->sn = b->strides[0];
    w->scb = b->strides[1];
    w->ss = b->strides[3];
    return 1;
}

typedef struct {
    walk w;
    int64_t Cp;         /* channels with padding (CB * blk) */
    double *sums;       /* (2 Cp + 1): per-channel sums, then the element count */
    double *mean, *inv; /* (Cp) statistics of the last training forward (inv = 1/sqrt(var+eps)) */
    double count;       /* elements per channel over the group in the last training forward */
    float *mean_f;      /* (Cp) the mean the passes subtract */
    float *a, *c;       /* (Cp) forward: y = (x - mean) a + c */
    float *k, *da, *dc; /* (Cp) backward: dx = k dy + (x - mean) da + dc */
    int trained;        /* the last forward ran in training mode */
} sbn_state;

/* Per-channel sums of x (into s0) and of x * x, or of y * (x - mean), (into s1), in double. */
static void channel_sums(const walk *w, const float *x, const float *y, const float *mean,
                         double *s0, double *s1) {
    memset(s0, 0, (size_t)(w->CB * w->blk) * sizeof *s0);
    memset(s1, 0, (size_t)(w->CB * w->blk) * sizeof *s1);
    for (int64_t n = 0; n < w->N; n++)
        for (int64_t cb = 0; cb < w->CB; cb++) {
            int64_t base = n * w->sn + cb * w->scb;
            const float *px = x + base, *py = y ? y + base : NULL;
            if (w->blk == 1) {
                double a = 0, b = 0, m = mean ? mean[cb] : 0;
                for (int64_t s = 0; s < w->S; s++) {
                    double v = px[s * w->ss];
                    if (py) {
                        a += py[s * w->ss];
                        b += py[s * w->ss] * (v - m);
                    } else {
                        a += v;
                        b += v * v;
                    }
                }
                s0[cb] += a;
                s1[cb] += b;
                continue;
            }
            double *a = s0 + cb * w->blk, *b = s1 + cb * w->blk;
            const float *m = mean ? mean + cb * w->blk : NULL;
            for (int64_t s = 0; s < w->S; s++) {
                const float *vx = px + s * w->ss, *vy = py ? py + s * w->ss : NULL;
                for (int64_t i = 0; i < w->blk; i++) {
                    if (vy) {
                        a[i] += vy[i];
                        b[i] += (double)vy[i] * ((double)vx[i] - m[i]);
                    } else {
                        a[i] += vx[i];
                        b[i] += (double)vx[i] * vx[i];
                    }
                }
            }
        }
}

/* out = (in - mean) * a + c per channel, plus k * extra when extra is given (dx's dy term). */
static void channel_affine(const walk *w, float *out, const float *in, const float *mean,
                           const float *a, const float *c, const float *extra, const float *k) {
    for (int64_t n = 0; n < w->N; n++)
        for (int64_t cb = 0; cb < w->CB; cb++) {
            int64_t base = n * w->sn + cb * w->scb;
            for (int64_t s = 0; s < w->S; s++) {
                int64_t at = base + s * w->ss;
                for (int64_t i = 0; i < w->blk; i++) {
                    int64_t ch = cb * w->blk + i;
                    float v = (in[at + i] - mean[ch]) * a[ch] + c[ch];
                    out[at + i] = extra ? v + k[ch] * extra[at + i] : v;
                }
            }
        }
}

static td_status sbn_compile(td__op_ctx *ctx, td__node *n) {
    td_tensor *x = n->in[0], *y = n->out;
    sbn_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "sync_batch_norm2d: out of memory");
    n->state = s;
    *td__md(y) = *td__md(x);
    y->blocked = x->blocked;
    if (!walk_of(td__md(x), &s->w))
        return td__fail(TD_EUNSUPPORTED,
                        "sync_batch_norm2d: input '%s' has a layout it cannot walk", x->name);
    s->Cp = s->w.CB * s->w.blk;
    size_t cp = (size_t)s->Cp;
    s->sums = td__op_alloc(ctx, (2 * cp + 1) * sizeof(double));
    s->mean = td__op_alloc(ctx, cp * sizeof(double));
    s->inv = td__op_alloc(ctx, cp * sizeof(double));
    s->mean_f = td__op_alloc(ctx, cp * sizeof(float));
    s->a = td__op_alloc(ctx, cp * sizeof(float));
    s->c = td__op_alloc(ctx, cp * sizeof(float));
    s->k = td__op_alloc(ctx, cp * sizeof(float));
    s->da = td__op_alloc(ctx, cp * sizeof(float));
    s->dc = td__op_alloc(ctx, cp * sizeof(float));
    if (!s->sums || !s->mean || !s->inv || !s->mean_f || !s->a || !s->c || !s->k || !s->da ||
        !s->dc)
        return td__fail(TD_ENOMEM, "sync_batch_norm2d: out of memory");
    td_shape channels = td_shape_1d(x->shape.dim[1]);
    return td__coll_agree(ctx, n, &channels, x->dtype, x->requires_grad);
}

void td__sbn_eval_stats(const td__node *n, int64_t C, const float *w, const float *b,
                        const float *rm, const float *rv, td__sbn_stats *st) {
    for (int64_t ch = 0; ch < C; ch++) {
        double inv = 1.0 / sqrt((double)rv[ch] + n->attr.bn.eps);
        st->mean[ch] = rm[ch];
        st->inv[ch] = inv;
        st->mean_f[ch] = rm[ch];
        st->a[ch] = (float)(w[ch] * inv);
        st->c[ch] = b[ch];
    }
}

void td__sbn_train_stats(const td__node *n, int64_t C, int64_t Cp, const double *sums,
                         const float *w, const float *b, float *rm, float *rv, td__sbn_stats *st) {
    const double *sum = sums, *sq = sums + Cp;
    double count = sq[Cp];
    double m = n->attr.bn.momentum, unbias = count > 1 ? count / (count - 1) : 1;
    for (int64_t ch = 0; ch < C; ch++) {
        double mean = sum[ch] / count, var = sq[ch] / count - mean * mean;
        if (var < 0) var = 0;
        double inv = 1.0 / sqrt(var + n->attr.bn.eps);
        st->mean[ch] = mean;
        st->inv[ch] = inv;
        st->mean_f[ch] = (float)mean;
        st->a[ch] = (float)(w[ch] * inv);
        st->c[ch] = b[ch];
        rm[ch] = (float)((1 - m) * rm[ch] + m * mean);
        rv[ch] = (float)((1 - m) * rv[ch] + m * var * unbias);
    }
}

void td__sbn_backward_coefficients(int64_t C, int64_t Cp, const double *sums, const float *w,
                                   double count, int trained, const td__sbn_stats *st, float *k,
                                   float *da, float *dc) {
    const double *sdy = sums, *sdyx = sums + Cp;
    for (int64_t ch = 0; ch < C; ch++) {
        double inv = st->inv[ch], g = w[ch] * inv;
        k[ch] = (float)g;
        da[ch] = trained ? (float)(-g * inv * inv * sdyx[ch] / count) : 0.f;
        dc[ch] = trained ? (float)(-g * sdy[ch] / count) : 0.f;
    }
}

/* Eval: the running statistics, no communication. */
static void eval_coefficients(sbn_state *s, const td__node *n) {
    td__sbn_stats st = {s->mean, s->inv, s->mean_f, s->a, s->c};
    td__sbn_eval_stats(n, s->w.C, n->in[1]->data, n->in[2]->data, n->in[3]->data, n->in[4]->data,
                       &st);
}

static td_status sbn_forward(td__op_ctx *ctx, td__node *n) {
    sbn_state *s = n->state;
    td_tensor *x = n->in[0];
    s->trained = ctx->training;
    if (!ctx->training) {
        eval_coefficients(s, n);
        channel_affine(&s->w, n->out->data, x->data, s->mean_f, s->a, s->c, NULL, NULL);
        return TD_OK;
    }
    int64_t C = s->w.C, Cp = s->Cp;
    double *sum = s->sums, *sq = s->sums + Cp;
    channel_sums(&s->w, x->data, NULL, NULL, sum, sq);
    sq[Cp] = (double)(s->w.N * s->w.S);
    if (td__coll_size(ctx) > 1) {
        td_status st =
            td_comm_allreduce(ctx->comm, s->sums, s->sums, (size_t)(2 * Cp + 1), TD_F64, TD_OP_SUM);
        if (st != TD_OK) return td__coll_fail(n, "forward", st);
    }
    s->count = sq[Cp];
    td__sbn_stats st = {s->mean, s->inv, s->mean_f, s->a, s->c};
    td__sbn_train_stats(n, C, Cp, s->sums, n->in[1]->data, n->in[2]->data, n->in[3]->data,
                        n->in[4]->data, &st);
    channel_affine(&s->w, n->out->data, x->data, s->mean_f, s->a, s->c, NULL, NULL);
    return TD_OK;
}

static td_status sbn_backward(td__op_ctx *ctx, td__node *n) {
    sbn_state *s = n->state;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2], *y = n->out;
    int64_t C = s->w.C, Cp = s->Cp;
    double *sdy = s->sums, *sdyx = s->sums + Cp;
    if (!s->trained) eval_coefficients(s, n); /* the running stats as they are now */
    channel_sums(&s->w, x->data, y->grad, s->mean_f, sdy, sdyx);
    if (w->requires_grad) {
        float *dw = td__grad_begin(ctx, w, 1);
        for (int64_t ch = 0; ch < C; ch++) dw[ch] = (float)(sdyx[ch] * s->inv[ch]);
        td__grad_end(ctx, w);
    }
    if (b->requires_grad) {
        float *db = td__grad_begin(ctx, b, 2);
        for (int64_t ch = 0; ch < C; ch++) db[ch] = (float)sdy[ch];
        td__grad_end(ctx, b);
    }
    /* Final weight gradients go to DDP before the data gradient's all-reduce. */
    ctx->params_ready(ctx, n, 1);
    if (!x->requires_grad) return TD_OK;
    const float *wd = w->data;
    int world = td__coll_size(ctx);
    if (s->trained && world > 1) {
        td_status st =
            td_comm_allreduce(ctx->comm, s->sums, s->sums, (size_t)(2 * Cp), TD_F64, TD_OP_SUM);
        if (st != TD_OK) return td__coll_fail(n, "backward", st);
    }
    td__sbn_stats st = {s->mean, s->inv, s->mean_f, s->a, s->c};
    td__sbn_backward_coefficients(C, Cp, s->sums, wd, s->count, s->trained, &st, s->k, s->da,
                                  s->dc);
    channel_affine(&s->w, td__grad_begin(ctx, x, 0), x->data, s->mean_f, s->da, s->dc, y->grad,
                   s->k);
    td__grad_end(ctx, x);
    return TD_OK;
}

static void sbn_destroy(td__node *n) { free(n->state); }

/* The CPU backend's kernels. */
const td__kernels td__cpu_sync_batch_norm = {
    .compile = sbn_compile,
    .forward = sbn_forward,
    .backward = sbn_backward,
    .destroy = sbn_destroy,
};
