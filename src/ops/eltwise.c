/* Element-wise activation nodes (ReLU, exact-erf GELU) through oneDNN's eltwise
 * primitive, in whatever layout the input has. */
#include <stdlib.h>

#include "graph/graph_impl.h"

enum { ELT_RELU = 0, ELT_GELU = 1 };

typedef struct {
    dnnl_primitive_t fwd, bwd;
    td__mem x, y, dy, dx;
} elt_state;

static td_status elt_compile(td_graph *g, td__node *n) {
    elt_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "eltwise: out of memory");
    n->state = s;
    td_tensor *x = n->in[0], *y = n->out;
    y->md = x->md;
    y->blocked = x->blocked;
    if (n->variant == TD__ELT_ALIAS) return TD_OK;
    dnnl_alg_kind_t alg = n->variant == ELT_RELU   ? dnnl_eltwise_relu
                          : n->variant == ELT_GELU ? dnnl_eltwise_gelu_erf
                                                   : dnnl_eltwise_relu_use_dst_for_bwd;
    dnnl_eltwise_desc_t d;
    dnnl_primitive_desc_t fpd = NULL, bpd = NULL;
    TD__DNNL(dnnl_eltwise_forward_desc_init(&d, dnnl_forward_training, alg, &x->md, 0.f, 0.f),
             "eltwise forward");
    TD__TRY(td__pd_create(g, &fpd, &d, NULL, "eltwise forward"));
    td_status st = td__prim_create(&s->fwd, fpd, "eltwise forward");
    if (st == TD_OK && y->requires_grad) {
        if (dnnl_eltwise_backward_desc_init(&d, alg, &x->md, &x->md, 0.f, 0.f) != dnnl_success)
            st = td__fail(TD_EBACKEND, "eltwise: backward descriptor");
        if (st == TD_OK) st = td__pd_create(g, &bpd, &d, fpd, "eltwise backward");
        if (st == TD_OK) st = td__prim_create(&s->bwd, bpd, "eltwise backward");
        if (bpd) dnnl_primitive_desc_destroy(bpd);
    }
    dnnl_primitive_desc_destroy(fpd);
    TD__TRY(st);
    TD__TRY(td__mem_init(g, &s->x, &x->md));
    TD__TRY(td__mem_init(g, &s->y, &x->md));
    TD__TRY(td__mem_init(g, &s->dy, &x->md));
    return td__mem_init(g, &s->dx, &x->md);
}

void td__relu_in_place(td__node *relu) {
    relu->variant = TD__ELT_INPLACE;
    relu->out->alias_of = relu->in[0];
}

int td__fuse_bn_relu(td__node *bn, td__node *relu) {
    bn->variant = TD__BN_FUSED_RELU;
    relu->variant = TD__ELT_ALIAS;
    relu->out->alias_of = relu->in[0];
    return 1;
}

static td_status elt_forward(td_graph *g, td__node *n) {
    elt_state *s = n->state;
    if (n->variant == TD__ELT_ALIAS) return TD_OK; /* the batch norm applied it */
    td__mem_bind(&s->x, n->in[0]->data);
    td__mem_bind(&s->y, n->out->data);
    dnnl_exec_arg_t a[2] = {{DNNL_ARG_SRC, s->x.mem}, {DNNL_ARG_DST, s->y.mem}};
    return td__exec(g, s->fwd, 2, a, "eltwise forward");
}

static td_status elt_backward(td_graph *g, td__node *n) {
    elt_state *s = n->state;
    td_tensor *x = n->in[0];
    if (n->variant == TD__ELT_ALIAS) { /* dy already sits in x's (shared) gradient */
        x->grad_zero = n->out->grad_zero;
        return TD_OK;
    }
    if (n->variant == TD__ELT_INPLACE) { /* dx = dy * (y > 0), over dy's storage */
        td__mem_bind(&s->y, n->out->data);
        td__mem_bind(&s->dy, n->out->grad);
        td__mem_bind(&s->dx, n->out->grad);
        dnnl_exec_arg_t a[3] = {{DNNL_ARG_DST, s->y.mem},
                                {DNNL_ARG_DIFF_DST, s->dy.mem},
                                {DNNL_ARG_DIFF_SRC, s->dx.mem}};
        TD__TRY(td__exec(g, s->bwd, 3, a, "relu backward"));
        x->grad_zero = 0;
        return TD_OK;
    }
    td__mem_bind(&s->x, x->data);
    td__mem_bind(&s->dy, n->out->grad);
    td__mem_bind(&s->dx, td__grad_begin(g, x, 0));
    dnnl_exec_arg_t a[3] = {
        {DNNL_ARG_SRC, s->x.mem}, {DNNL_ARG_DIFF_DST, s->dy.mem}, {DNNL_ARG_DIFF_SRC, s->dx.mem}};
    TD__TRY(td__exec(g, s->bwd, 3, a, "eltwise backward"));
    td__grad_end(g, x);
    return TD_OK;
}

static void elt_destroy(td__node *n) {
    elt_state *s = n->state;
    if (!s) return;
    if (s->fwd) dnnl_primitive_destroy(s->fwd);
    if (s->bwd) dnnl_primitive_destroy(s->bwd);
    td__mem *m[] = {&s->x, &s->y, &s->dy, &s->dx};
    for (size_t i = 0; i < sizeof m / sizeof *m; i++) td__mem_free(m[i]);
    free(s);
}

const td__op td__op_eltwise = {"eltwise",    1,          0, elt_compile, elt_forward,
                               elt_backward, elt_destroy};

static td_status elt_add(td_graph *g, td_tensor *x, int variant, td_tensor **y) {
    const char *name = variant == ELT_RELU ? "relu" : "gelu";
    TD__TRY(td__check_input(g, x, name));
    if (!y) return td__fail(TD_EINVAL, "%s: y is NULL", name);
    if (x->dtype != TD_F32) return td__fail(TD_EDTYPE, "%s: input '%s' must be f32", name, x->name);
    td__node *n;
    TD__TRY(td__graph_add_node(g, &td__op_eltwise, &x, 1, x->shape, &n));
    n->variant = variant;
    *y = n->out;
    return TD_OK;
}

td_status td_graph_relu(td_graph *g, td_tensor *x, td_tensor **y) {
    return elt_add(g, x, ELT_RELU, y);
}

td_status td_graph_gelu(td_graph *g, td_tensor *x, td_tensor **y) {
    return elt_add(g, x, ELT_GELU, y);
}
