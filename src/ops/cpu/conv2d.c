/* The 2-d convolution node through oneDNN (groups = 1). oneDNN picks the activation and
 * weight layouts ("any"); activations stay blocked when every consumer copes (see
 * td_graph_compile), and weights stay in PyTorch's plain (OC, C, KH, KW) layout for the
 * td_param view, reordered at each forward when the kernel wants another layout (once per
 * step when the graph keeps its weights: td_graph_keep_weights). */
#include <stdlib.h>
#include <string.h>

#include "ops/cpu/onednn.h"

/* Input channels below which Winograd loses to a direct convolution (measured, see above). */
#define TD__WINOGRAD_MIN_CHANNELS 16

typedef struct {
    dnnl_primitive_t fwd, bwd_data, bwd_w;
    /* Each adapter reorders only where the kernel's preferred layout differs. */
    td__adapt x_fwd;              /* x -> forward src layout */
    td__adapt w_fwd;              /* plain weights -> forward weights layout */
    td__adapt dy_bd;              /* dy -> backward-data diff_dst layout */
    td__adapt w_bd;               /* plain weights -> backward-data weights layout */
    td__adapt dx_bd;              /* backward-data diff_src layout -> x's layout */
    td__adapt x_bw;               /* x -> backward-weights src layout */
    td__adapt dy_bw;              /* dy -> backward-weights diff_dst layout */
    td__adapt dw_bw;              /* backward-weights diff_weights layout -> plain */
    td__adapt db_bw;              /* backward-weights diff_bias -> the bias's dtype */
    int w_bd_reuse;               /* backward data takes the forward's weights layout */
    int x_bw_reuse;               /* backward weights takes the forward's src layout */
    int dy_bw_reuse;              /* both backward kernels take one diff_dst layout (dy_bd's) */
    void *x_now, *w_now, *dy_now; /* operands of the current step in kernel layouts */
    td__mem src, w, b, dst, bd_dy, bd_w, bd_dx, bw_x, bw_dy, bw_dw, bw_db;
} conv_state;

static void conv_geometry(const td__node *n, dnnl_dims_t strides, dnnl_dims_t dil, dnnl_dims_t pl,
                          dnnl_dims_t pr, int64_t *oh, int64_t *ow) {
    const td_conv2d_params *p = &n->attr.conv;
    const td_tensor *x = n->in[0], *w = n->in[1];
    int64_t in[2] = {x->shape.dim[2], x->shape.dim[3]}, k[2] = {w->shape.dim[2], w->shape.dim[3]};
    int64_t out[2];
    for (int i = 0; i < 2; i++) {
        int64_t span = (k[i] - 1) * p->dilation[i] + 1;
        out[i] = (in[i] + 2 * p->padding[i] - span) / p->stride[i] + 1;
        strides[i] = p->stride[i];
        dil[i] = p->dilation[i] - 1;
        pl[i] = p->padding[i];
        pr[i] = (out[i] - 1) * p->stride[i] + span - in[i] - p->padding[i];
    }
    *oh = out[0];
    *ow = out[1];
}

static td_status conv_compile(td__op_ctx *ctx, td__node *n) {
    conv_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "conv2d: out of memory");
    n->state = s;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2], *y = n->out;
    dnnl_dims_t strides, dil, pl, pr;
    int64_t oh, ow;
    conv_geometry(n, strides, dil, pl, pr, &oh, &ow);
    dnnl_memory_desc_t any_x, any_w, any_y, bmd, wplain = *td__md(w);
    dnnl_dims_t xd = {x->shape.dim[0], x->shape.dim[1], x->shape.dim[2], x->shape.dim[3]};
    dnnl_dims_t wd = {w->shape.dim[0], w->shape.dim[1], w->shape.dim[2], w->shape.dim[3]};
    dnnl_dims_t yd = {y->shape.dim[0], y->shape.dim[1], y->shape.dim[2], y->shape.dim[3]};
    dnnl_data_type_t dt = td__dnnl_dtype(x->dtype);
    dnnl_memory_desc_init_by_tag(&any_x, 4, xd, dt, dnnl_format_tag_any);
    dnnl_memory_desc_init_by_tag(&any_w, 4, wd, dt, dnnl_format_tag_any);
    dnnl_memory_desc_init_by_tag(&any_y, 4, yd, dt, dnnl_format_tag_any);
    dnnl_memory_desc_t fy = y->may_block ? any_y : *td__md(y);
    td_shape bs = td_shape_1d(w->shape.dim[0]);
    td__md_plain(&bmd, &bs, b ? b->dtype : x->dtype);
    /* "auto" lets oneDNN take Winograd for 3x3 kernels, about 1.45x faster on the CNN's layers
     * of 32 and 64 channels; with few input channels its transforms dominate (1 -> 32: 6.7 ms
     * a forward at batch 128 against 0.7 ms direct), so those layers stay direct. */
    dnnl_alg_kind_t alg = ctx->conv_winograd && x->shape.dim[1] >= TD__WINOGRAD_MIN_CHANNELS
                              ? dnnl_convolution_auto
                              : dnnl_convolution_direct;
    dnnl_convolution_desc_t d;
    dnnl_primitive_desc_t fpd = NULL, pd = NULL;
    TD__DNNL(dnnl_dilated_convolution_forward_desc_init(&d, dnnl_forward_training, alg, &any_x,
                                                        &any_w, b ? &bmd : NULL, &fy, strides, dil,
                                                        pl, pr),
             "conv2d forward");
    TD__TRY(td__pd_create(ctx, &fpd, &d, NULL, "conv2d forward"));
    dnnl_memory_desc_t smd = td__pd_md(fpd, dnnl_query_src_md);
    dnnl_memory_desc_t fwmd = td__pd_md(fpd, dnnl_query_weights_md);
    *td__md(y) = td__pd_md(fpd, dnnl_query_dst_md);
    y->blocked = !td__md_is_plain(td__md(y), &y->shape);
    td_status st = td__prim_create(&s->fwd, fpd, "conv2d forward");
    if (st == TD_OK) st = td__adapt_init(ctx, &s->x_fwd, td__md(x), &smd);
    if (st == TD_OK) st = td__adapt_init(ctx, &s->w_fwd, &wplain, &fwmd);
    if (st == TD_OK) st = td__mem_init(ctx, &s->src, &smd);
    if (st == TD_OK) st = td__mem_init(ctx, &s->w, &fwmd);
    if (st == TD_OK) st = td__mem_init(ctx, &s->b, &bmd);
    if (st == TD_OK) st = td__mem_init(ctx, &s->dst, td__md(y));
    dnnl_memory_desc_t bd_dy;
    memset(&bd_dy, 0, sizeof bd_dy);
    if (st == TD_OK && x->requires_grad) {
        for (int attempt = 0; attempt < 2 && st == TD_OK && !pd; attempt++) {
            const dnnl_memory_desc_t *bx = attempt ? &any_x : td__md(x),
                                     *by = attempt ? &any_y : td__md(y);
            if (dnnl_dilated_convolution_backward_data_desc_init(&d, alg, bx, &any_w, by, strides,
                                                                 dil, pl, pr) != dnnl_success)
                st = td__fail(TD_EBACKEND, "conv2d: backward-data descriptor");
            else if (dnnl_primitive_desc_create(&pd, &d, NULL, td__cpu_of(ctx)->engine, fpd) !=
                         dnnl_success ||
                     (attempt == 0 && td__pd_is_slow(pd))) {
                if (pd) dnnl_primitive_desc_destroy(pd);
                pd = NULL;
            }
        }
        if (st == TD_OK && !pd) st = td__fail(TD_EBACKEND, "conv2d: no backward-data kernel");
        if (st == TD_OK) st = td__prim_create(&s->bwd_data, pd, "conv2d backward data");
        if (st == TD_OK) {
            dnnl_memory_desc_t dx = td__pd_md(pd, dnnl_query_diff_src_md);
            dnnl_memory_desc_t wm = td__pd_md(pd, dnnl_query_weights_md);
            bd_dy = td__pd_md(pd, dnnl_query_diff_dst_md);
            s->w_bd_reuse = dnnl_memory_desc_equal(&wm, &fwmd);
            st = td__adapt_init(ctx, &s->dy_bd, td__md(y), &bd_dy);
            if (st == TD_OK && !s->w_bd_reuse) st = td__adapt_init(ctx, &s->w_bd, &wplain, &wm);
            if (st == TD_OK) st = td__adapt_init(ctx, &s->dx_bd, &dx, td__md(x));
            if (st == TD_OK) st = td__mem_init(ctx, &s->bd_dy, &bd_dy);
            if (st == TD_OK) st = td__mem_init(ctx, &s->bd_w, &wm);
            if (st == TD_OK) st = td__mem_init(ctx, &s->bd_dx, &dx);
        }
        if (pd) dnnl_primitive_desc_destroy(pd);
        pd = NULL;
    }
    if (st == TD_OK && w->requires_grad) {
        /* The forward's activation layouts avoid two reorders per step, unless only a slow
         * kernel takes them (reference, or im2col + gemm); then oneDNN chooses. When even its
         * choice is slow in a low dtype (bf16 with the Net's 5x5 kernels and 1 or 10 input
         * channels: only gemm, 2.7x slower than f32), the weight gradient is computed in f32
         * from converted operands, the reorders converting dtype and layout at once. */
        dnnl_memory_desc_t fx = any_x, fw = any_w, fy = any_y, fb = bmd;
        fx.data_type = fw.data_type = fy.data_type = fb.data_type = dnnl_f32;
        dnnl_primitive_desc_t hint32 = NULL;
        int last = dt == dnnl_f32 ? 2 : 3;
        for (int attempt = 0; attempt <= last && st == TD_OK && !pd; attempt++) {
            const dnnl_memory_desc_t *cand_x[4] = {td__md(x), &smd, &any_x, &fx};
            const dnnl_memory_desc_t *bx = cand_x[attempt], *by = attempt < 2 ? td__md(y) : &any_y;
            const dnnl_memory_desc_t *bw = &any_w, *bb = b ? &bmd : NULL;
            const_dnnl_primitive_desc_t hint = fpd;
            if (attempt == 3) { /* f32, with an f32 forward as the hint */
                by = &fy, bw = &fw, bb = b ? &fb : NULL;
                if (dnnl_dilated_convolution_forward_desc_init(&d, dnnl_forward_training, alg, &fx,
                                                               &fw, bb, &fy, strides, dil, pl,
                                                               pr) != dnnl_success ||
                    dnnl_primitive_desc_create(&hint32, &d, NULL, td__cpu_of(ctx)->engine, NULL) !=
                        dnnl_success)
                    break;
                hint = hint32;
            }
            if (dnnl_dilated_convolution_backward_weights_desc_init(
                    &d, alg, bx, bw, bb, by, strides, dil, pl, pr) != dnnl_success)
                st = td__fail(TD_EBACKEND, "conv2d: backward-weights descriptor");
            else if (dnnl_primitive_desc_create(&pd, &d, NULL, td__cpu_of(ctx)->engine, hint) !=
                         dnnl_success ||
                     (attempt < last && td__pd_is_slow(pd))) {
                if (pd) dnnl_primitive_desc_destroy(pd);
                pd = NULL;
            }
        }
        if (hint32) dnnl_primitive_desc_destroy(hint32);
        if (st == TD_OK && !pd && last == 3) { /* no f32 kernel either: the slow one, then */
            if (dnnl_dilated_convolution_backward_weights_desc_init(
                    &d, alg, &any_x, &any_w, b ? &bmd : NULL, &any_y, strides, dil, pl, pr) ==
                dnnl_success)
                dnnl_primitive_desc_create(&pd, &d, NULL, td__cpu_of(ctx)->engine, fpd);
        }
        if (st == TD_OK && !pd) st = td__fail(TD_EBACKEND, "conv2d: no backward-weights kernel");
        if (st == TD_OK) st = td__prim_create(&s->bwd_w, pd, "conv2d backward weights");
        if (st == TD_OK) {
            dnnl_memory_desc_t xm = td__pd_md(pd, dnnl_query_src_md);
            dnnl_memory_desc_t dym = td__pd_md(pd, dnnl_query_diff_dst_md);
            dnnl_memory_desc_t dwm = td__pd_md(pd, dnnl_query_diff_weights_md);
            s->x_bw_reuse = dnnl_memory_desc_equal(&xm, &smd);
            s->dy_bw_reuse = s->bwd_data && dnnl_memory_desc_equal(&dym, &bd_dy);
            if (!s->x_bw_reuse) st = td__adapt_init(ctx, &s->x_bw, td__md(x), &xm);
            if (st == TD_OK && !s->dy_bw_reuse)
                st = td__adapt_init(ctx, &s->dy_bw, td__md(y), &dym);
            dnnl_memory_desc_t dbm = bmd; /* index 1 of diff_weights is the bias */
            if (b) {
                dbm = *dnnl_primitive_desc_query_md(pd, dnnl_query_diff_weights_md, 1);
                st = td__adapt_init(ctx, &s->db_bw, &dbm, &bmd);
            }
            if (st == TD_OK) st = td__adapt_init(ctx, &s->dw_bw, &dwm, &wplain);
            if (st == TD_OK) st = td__mem_init(ctx, &s->bw_x, &xm);
            if (st == TD_OK) st = td__mem_init(ctx, &s->bw_dy, &dym);
            if (st == TD_OK) st = td__mem_init(ctx, &s->bw_dw, &dwm);
            if (st == TD_OK) st = td__mem_init(ctx, &s->bw_db, &dbm);
        }
        if (pd) dnnl_primitive_desc_destroy(pd);
    }
    dnnl_primitive_desc_destroy(fpd);
    return st;
}

static td_status conv_forward(td__op_ctx *ctx, td__node *n) {
    conv_state *s = n->state;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    s->x_now = td__adapt_in(ctx, &s->x_fwd, x->data);
    s->w_now = td__adapt_weights(ctx, &s->w_fwd, w->data);
    if (!s->x_now || !s->w_now) return td__fail(TD_EBACKEND, "conv2d: input reorder failed");
    td__mem_bind(&s->src, s->x_now);
    td__mem_bind(&s->w, s->w_now);
    td__mem_bind(&s->dst, n->out->data);
    if (b) td__mem_bind(&s->b, b->data);
    dnnl_exec_arg_t a[4] = {{DNNL_ARG_SRC, s->src.mem},
                            {DNNL_ARG_WEIGHTS, s->w.mem},
                            {DNNL_ARG_DST, s->dst.mem},
                            {DNNL_ARG_BIAS, s->b.mem}};
    return td__exec(ctx, s->fwd, b ? 4 : 3, a, "conv2d forward");
}

static td_status conv_backward(td__op_ctx *ctx, td__node *n) {
    conv_state *s = n->state;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    void *dy_bw = NULL;
    if (s->bwd_w) {
        void *xs = s->x_bw_reuse ? s->x_now : td__adapt_in(ctx, &s->x_bw, x->data);
        void *dy = td__adapt_in(ctx, s->dy_bw_reuse ? &s->dy_bd : &s->dy_bw, n->out->grad);
        dy_bw = dy;
        if (!xs || !dy) return td__fail(TD_EBACKEND, "conv2d: backward reorder failed");
        float *dw = td__grad_begin(ctx, w, 1);
        td__mem_bind(&s->bw_x, xs);
        td__mem_bind(&s->bw_dy, dy);
        td__mem_bind(&s->bw_dw, td__adapt_out_ptr(&s->dw_bw, dw));
        void *db = b ? td__grad_begin(ctx, b, 2) : NULL;
        if (b) td__mem_bind(&s->bw_db, td__adapt_out_ptr(&s->db_bw, db));
        dnnl_exec_arg_t a[4] = {{DNNL_ARG_SRC, s->bw_x.mem},
                                {DNNL_ARG_DIFF_DST, s->bw_dy.mem},
                                {DNNL_ARG_DIFF_WEIGHTS, s->bw_dw.mem},
                                {DNNL_ARG_DIFF_BIAS, s->bw_db.mem}};
        TD__TRY(td__exec(ctx, s->bwd_w, b ? 4 : 3, a, "conv2d backward weights"));
        TD__TRY(td__adapt_out(ctx, &s->dw_bw, dw));
        if (b) TD__TRY(td__adapt_out(ctx, &s->db_bw, db));
        td__grad_end(ctx, w);
        if (b) td__grad_end(ctx, b);
    }
    /* The weight gradient is final here; DDP can start on it while backward data runs. */
    ctx->params_ready(ctx, n, 1);
    if (s->bwd_data) {
        /* Forward already produced the weights in its layout; reuse them when they match. */
        void *wt = s->w_bd_reuse ? s->w_now : td__adapt_weights(ctx, &s->w_bd, w->data);
        void *dy_bd = s->dy_bw_reuse && dy_bw ? dy_bw : td__adapt_in(ctx, &s->dy_bd, n->out->grad);
        if (!wt || !dy_bd) return td__fail(TD_EBACKEND, "conv2d: backward reorder failed");
        float *dx = td__grad_begin(ctx, x, 0);
        td__mem_bind(&s->bd_w, wt);
        td__mem_bind(&s->bd_dy, dy_bd);
        td__mem_bind(&s->bd_dx, td__adapt_out_ptr(&s->dx_bd, dx));
        dnnl_exec_arg_t a[3] = {{DNNL_ARG_DIFF_DST, s->bd_dy.mem},
                                {DNNL_ARG_WEIGHTS, s->bd_w.mem},
                                {DNNL_ARG_DIFF_SRC, s->bd_dx.mem}};
        TD__TRY(td__exec(ctx, s->bwd_data, 3, a, "conv2d backward data"));
        TD__TRY(td__adapt_out(ctx, &s->dx_bd, dx));
        td__grad_end(ctx, x);
    }
    return TD_OK;
}

static void conv_destroy(td__node *n) {
    conv_state *s = n->state;
    if (!s) return;
    dnnl_primitive_t p[] = {s->fwd, s->bwd_data, s->bwd_w};
    for (int i = 0; i < 3; i++)
        if (p[i]) dnnl_primitive_destroy(p[i]);
    td__adapt *r[] = {&s->x_fwd, &s->w_fwd, &s->dy_bd, &s->w_bd, &s->dx_bd,
                      &s->x_bw,  &s->dy_bw, &s->dw_bw, &s->db_bw};
    for (size_t i = 0; i < sizeof r / sizeof *r; i++) td__adapt_free(r[i]);
    td__mem *m[] = {&s->src,   &s->w,    &s->b,     &s->dst,   &s->bd_dy, &s->bd_w,
                    &s->bd_dx, &s->bw_x, &s->bw_dy, &s->bw_dw, &s->bw_db};
    for (size_t i = 0; i < sizeof m / sizeof *m; i++) td__mem_free(m[i]);
    free(s);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_conv2d = {
    .compile = conv_compile,
    .forward = conv_forward,
    .backward = conv_backward,
    .destroy = conv_destroy,
    .supports = td__onednn_supports,
};
