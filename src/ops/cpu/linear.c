/* The linear (fully connected) node through oneDNN's inner product: y = x W^T + b with
 * PyTorch's (OUT, IN) weight layout kept as is, so parameters need no reorder. Inputs are
 * plain (N, IN); flatten has already undone any blocked layout.
 *
 * With blocked_linear, forward and backward data read a copy of the weights in the blocked
 * layout oneDNN's kernels pick (AB16b64a on AVX-512): with the plain layout the GEMM packs the
 * weights again at every call, which at 16 samples costs more than the product itself (and a
 * row of 1024 floats, 4 KiB, maps every row to the same cache sets). The copy is made at each
 * forward, or once per step when the graph keeps its weights; the weight gradient stays plain,
 * where a blocked kernel is no faster and the td_param view needs it. (Backward data as a
 * forward kernel over a blocked W^T, which spares oneDNN's backward-data kernel the
 * transposition it makes of its copy at every call, measured no faster for the MLP: a second
 * copy per step costs what it saves.) */
#include <stdlib.h>

#include "ops/cpu/onednn.h"

typedef struct {
    dnnl_primitive_t fwd, bwd_data, bwd_w;
    td__adapt w_fwd; /* plain weights -> the kernels' layout, where it differs */
    void *w_now;     /* the weights of the current pass in the kernels' layout */
    td__mem x, w, b, y, dy, dx, dw, db;
} linear_state;

static td_status linear_compile(td__op_ctx *ctx, td__node *n) {
    linear_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "linear: out of memory");
    n->state = s;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    dnnl_memory_desc_t xmd = *td__md(x), wmd = *td__md(w), ymd = *td__md(n->out), bmd;
    dnnl_memory_desc_t kwmd = wmd; /* the weights as forward and backward data take them */
    if (ctx->blocked_linear)
        dnnl_memory_desc_init_by_tag(&kwmd, 2, wmd.dims, wmd.data_type, dnnl_format_tag_any);
    td_shape bs = td_shape_1d(w->shape.dim[0]);
    td__md_plain(&bmd, &bs, b ? b->dtype : x->dtype);
    dnnl_inner_product_desc_t d;
    dnnl_primitive_desc_t fpd = NULL, pd = NULL;
    TD__DNNL(dnnl_inner_product_forward_desc_init(&d, dnnl_forward_training, &xmd, &kwmd,
                                                  b ? &bmd : NULL, &ymd),
             "linear forward");
    TD__TRY(td__pd_create(ctx, &fpd, &d, NULL, "linear forward"));
    kwmd = td__pd_md(fpd, dnnl_query_weights_md);
    td_status st = td__prim_create(&s->fwd, fpd, "linear forward");
    if (st == TD_OK) st = td__adapt_init(ctx, &s->w_fwd, &wmd, &kwmd);
    if (st == TD_OK && x->requires_grad) {
        if (dnnl_inner_product_backward_data_desc_init(&d, &xmd, &kwmd, &ymd) != dnnl_success)
            st = td__fail(TD_EBACKEND, "linear: backward-data descriptor");
        if (st == TD_OK) st = td__pd_create(ctx, &pd, &d, fpd, "linear backward data");
        if (st == TD_OK) st = td__prim_create(&s->bwd_data, pd, "linear backward data");
        if (pd) dnnl_primitive_desc_destroy(pd);
        pd = NULL;
    }
    if (st == TD_OK && w->requires_grad) {
        if (dnnl_inner_product_backward_weights_desc_init(&d, &xmd, &wmd, b ? &bmd : NULL, &ymd) !=
            dnnl_success)
            st = td__fail(TD_EBACKEND, "linear: backward-weights descriptor");
        if (st == TD_OK) st = td__pd_create(ctx, &pd, &d, fpd, "linear backward weights");
        if (st == TD_OK) st = td__prim_create(&s->bwd_w, pd, "linear backward weights");
        if (pd) dnnl_primitive_desc_destroy(pd);
    }
    dnnl_primitive_desc_destroy(fpd);
    TD__TRY(st);
    TD__TRY(td__mem_init(ctx, &s->x, &xmd));
    TD__TRY(td__mem_init(ctx, &s->w, &kwmd));
    TD__TRY(td__mem_init(ctx, &s->b, &bmd));
    TD__TRY(td__mem_init(ctx, &s->y, &ymd));
    TD__TRY(td__mem_init(ctx, &s->dy, &ymd));
    TD__TRY(td__mem_init(ctx, &s->dx, &xmd));
    TD__TRY(td__mem_init(ctx, &s->dw, &wmd));
    return td__mem_init(ctx, &s->db, &bmd);
}

static td_status linear_forward(td__op_ctx *ctx, td__node *n) {
    linear_state *s = n->state;
    s->w_now = td__adapt_weights(ctx, &s->w_fwd, n->in[1]->data);
    if (!s->w_now) return td__fail(TD_EBACKEND, "linear: weight reorder failed");
    td__mem_bind(&s->x, n->in[0]->data);
    td__mem_bind(&s->w, s->w_now);
    td__mem_bind(&s->y, n->out->data);
    dnnl_exec_arg_t a[4] = {{DNNL_ARG_SRC, s->x.mem},
                            {DNNL_ARG_WEIGHTS, s->w.mem},
                            {DNNL_ARG_DST, s->y.mem},
                            {DNNL_ARG_BIAS, s->b.mem}};
    if (n->in[2]) td__mem_bind(&s->b, n->in[2]->data);
    return td__exec(ctx, s->fwd, n->in[2] ? 4 : 3, a, "linear forward");
}

static td_status linear_backward(td__op_ctx *ctx, td__node *n) {
    linear_state *s = n->state;
    td_tensor *x = n->in[0], *w = n->in[1], *b = n->in[2];
    td__mem_bind(&s->dy, n->out->grad);
    if (s->bwd_w) {
        td__mem_bind(&s->x, x->data);
        td__mem_bind(&s->dw, td__grad_begin(ctx, w, 1));
        if (b) td__mem_bind(&s->db, td__grad_begin(ctx, b, 2));
        dnnl_exec_arg_t a[4] = {{DNNL_ARG_SRC, s->x.mem},
                                {DNNL_ARG_DIFF_DST, s->dy.mem},
                                {DNNL_ARG_DIFF_WEIGHTS, s->dw.mem},
                                {DNNL_ARG_DIFF_BIAS, s->db.mem}};
        TD__TRY(td__exec(ctx, s->bwd_w, b ? 4 : 3, a, "linear backward weights"));
        td__grad_end(ctx, w);
        if (b) td__grad_end(ctx, b);
    }
    /* Final weight gradients go to DDP before the data gradient is computed. */
    ctx->params_ready(ctx, n, 1);
    if (s->bwd_data) {
        /* forward's copy in the kernels' layout; the plain weights where they are now (a
         * parameter-use hook may have moved them since forward) */
        td__mem_bind(&s->w, s->w_fwd.need ? s->w_now : w->data);
        td__mem_bind(&s->dx, td__grad_begin(ctx, x, 0));
        dnnl_exec_arg_t a[3] = {{DNNL_ARG_DIFF_DST, s->dy.mem},
                                {DNNL_ARG_WEIGHTS, s->w.mem},
                                {DNNL_ARG_DIFF_SRC, s->dx.mem}};
        TD__TRY(td__exec(ctx, s->bwd_data, 3, a, "linear backward data"));
        td__grad_end(ctx, x);
    }
    return TD_OK;
}

static void linear_destroy(td__node *n) {
    linear_state *s = n->state;
    if (!s) return;
    if (s->fwd) dnnl_primitive_destroy(s->fwd);
    if (s->bwd_data) dnnl_primitive_destroy(s->bwd_data);
    if (s->bwd_w) dnnl_primitive_destroy(s->bwd_w);
    td__adapt_free(&s->w_fwd);
    td__mem *m[] = {&s->x, &s->w, &s->b, &s->y, &s->dy, &s->dx, &s->dw, &s->db};
    for (size_t i = 0; i < sizeof m / sizeof *m; i++) td__mem_free(m[i]);
    free(s);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_linear = {
    .compile = linear_compile,
    .forward = linear_forward,
    .backward = linear_backward,
    .destroy = linear_destroy,
    .supports = td__onednn_supports,
};
