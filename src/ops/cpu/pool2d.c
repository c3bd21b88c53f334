/* Max and average 2-d pooling nodes through oneDNN. The output keeps the input's layout
 * (blocked stays blocked); max pooling records its argmax in a oneDNN workspace so that
 * backward needs no search. */
#include <stdlib.h>

#include "ops/cpu/onednn.h"

typedef struct {
    dnnl_primitive_t fwd, bwd;
    void *ws; /* max pooling's workspace, from the arena */
    td__mem x, y, dy, dx, wsm;
} pool_state;

static void pool_geometry(const td__node *n, dnnl_dims_t k, dnnl_dims_t st, dnnl_dims_t pl,
                          dnnl_dims_t pr) {
    const td_pool2d_params *p = &n->attr.pool;
    for (int i = 0; i < 2; i++) {
        int64_t in = n->in[0]->shape.dim[2 + i], out = n->out->shape.dim[2 + i];
        k[i] = p->kernel[i];
        st[i] = p->stride[i];
        pl[i] = p->padding[i];
        pr[i] = (out - 1) * p->stride[i] + p->kernel[i] - in - p->padding[i];
    }
}

static td_status pool_compile(td__op_ctx *ctx, td__node *n) {
    pool_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "pool2d: out of memory");
    n->state = s;
    td_tensor *x = n->in[0], *y = n->out;
    dnnl_dims_t k, st, pl, pr, dil = {0, 0};
    pool_geometry(n, k, st, pl, pr);
    dnnl_memory_desc_t ymd = *td__md(y);
    if (x->blocked) {
        dnnl_dims_t yd = {y->shape.dim[0], y->shape.dim[1], y->shape.dim[2], y->shape.dim[3]};
        dnnl_memory_desc_init_by_tag(&ymd, 4, yd, td__dnnl_dtype(x->dtype), dnnl_format_tag_any);
    }
    dnnl_alg_kind_t alg =
        n->variant == TD__POOL_MAX ? dnnl_pooling_max : dnnl_pooling_avg_include_padding;
    dnnl_pooling_v2_desc_t d;
    dnnl_primitive_desc_t fpd = NULL, bpd = NULL;
    TD__DNNL(dnnl_pooling_v2_forward_desc_init(&d, dnnl_forward_training, alg, td__md(x), &ymd, st,
                                               k, dil, pl, pr),
             "pool2d forward");
    TD__TRY(td__pd_create(ctx, &fpd, &d, NULL, "pool2d forward"));
    *td__md(y) = td__pd_md(fpd, dnnl_query_dst_md);
    y->blocked = !td__md_is_plain(td__md(y), &y->shape);
    dnnl_memory_desc_t wsmd = td__pd_md(fpd, dnnl_query_workspace_md);
    td_status stt = td__prim_create(&s->fwd, fpd, "pool2d forward");
    if (stt == TD_OK && y->requires_grad) {
        if (dnnl_pooling_v2_backward_desc_init(&d, alg, td__md(x), td__md(y), st, k, dil, pl, pr) !=
            dnnl_success)
            stt = td__fail(TD_EBACKEND, "pool2d: backward descriptor");
        if (stt == TD_OK) stt = td__pd_create(ctx, &bpd, &d, fpd, "pool2d backward");
        if (stt == TD_OK) stt = td__prim_create(&s->bwd, bpd, "pool2d backward");
        if (bpd) dnnl_primitive_desc_destroy(bpd);
    }
    dnnl_primitive_desc_destroy(fpd);
    TD__TRY(stt);
    size_t wsb = dnnl_memory_desc_get_size(&wsmd);
    if (wsb) {
        if (!(s->ws = td__op_alloc(ctx, wsb))) return td__fail(TD_ENOMEM, "pool2d: out of memory");
        TD__TRY(td__mem_init(ctx, &s->wsm, &wsmd));
        td__mem_bind(&s->wsm, s->ws);
    }
    TD__TRY(td__mem_init(ctx, &s->x, td__md(x)));
    TD__TRY(td__mem_init(ctx, &s->y, td__md(y)));
    TD__TRY(td__mem_init(ctx, &s->dy, td__md(y)));
    return td__mem_init(ctx, &s->dx, td__md(x));
}

static td_status pool_forward(td__op_ctx *ctx, td__node *n) {
    pool_state *s = n->state;
    td__mem_bind(&s->x, n->in[0]->data);
    td__mem_bind(&s->y, n->out->data);
    dnnl_exec_arg_t a[3] = {
        {DNNL_ARG_SRC, s->x.mem}, {DNNL_ARG_DST, s->y.mem}, {DNNL_ARG_WORKSPACE, s->wsm.mem}};
    return td__exec(ctx, s->fwd, s->ws ? 3 : 2, a, "pool2d forward");
}

static td_status pool_backward(td__op_ctx *ctx, td__node *n) {
    pool_state *s = n->state;
    td_tensor *x = n->in[0];
    td__mem_bind(&s->dy, n->out->grad);
    td__mem_bind(&s->dx, td__grad_begin(ctx, x, 0));
    dnnl_exec_arg_t a[3] = {{DNNL_ARG_DIFF_DST, s->dy.mem},
                            {DNNL_ARG_DIFF_SRC, s->dx.mem},
                            {DNNL_ARG_WORKSPACE, s->wsm.mem}};
    TD__TRY(td__exec(ctx, s->bwd, s->ws ? 3 : 2, a, "pool2d backward"));
    td__grad_end(ctx, x);
    return TD_OK;
}

static void pool_destroy(td__node *n) {
    pool_state *s = n->state;
    if (!s) return;
    if (s->fwd) dnnl_primitive_destroy(s->fwd);
    if (s->bwd) dnnl_primitive_destroy(s->bwd);
    td__mem *m[] = {&s->x, &s->y, &s->dy, &s->dx, &s->wsm};
    for (size_t i = 0; i < sizeof m / sizeof *m; i++) td__mem_free(m[i]);
    free(s);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_pool2d = {
    .compile = pool_compile,
    .forward = pool_forward,
    .backward = pool_backward,
    .destroy = pool_destroy,
    .supports = td__onednn_supports,
};
