/* Flatten and reshape nodes. The output is always plain row-major, so this is where a
 * blocked activation (conv -> ... -> flatten -> linear) goes back to PyTorch's layout;
 * for a plain input it is a copy. */
#include <stdlib.h>
#include <string.h>

#include "graph/graph_impl.h"

typedef struct {
    td__reorder to_plain, from_plain; /* only for a blocked input */
} reshape_state;

static td_status reshape_compile(td_graph *g, td__node *n) {
    reshape_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "reshape: out of memory");
    n->state = s;
    td_tensor *x = n->in[0];
    if (!x->blocked) return TD_OK;
    dnnl_memory_desc_t plain;
    td__md_plain(&plain, &x->shape);
    TD__TRY(td__reorder_init(g, &s->to_plain, &x->md, &plain));
    if (x->requires_grad) TD__TRY(td__reorder_init(g, &s->from_plain, &plain, &x->md));
    return TD_OK;
}

static td_status reshape_forward(td_graph *g, td__node *n) {
    reshape_state *s = n->state;
    td_tensor *x = n->in[0];
    if (x->blocked) return td__reorder_run(g, &s->to_plain, x->data, n->out->data);
    memcpy(n->out->data, x->data, x->bytes);
    return TD_OK;
}

static td_status reshape_backward(td_graph *g, td__node *n) {
    reshape_state *s = n->state;
    td_tensor *x = n->in[0];
    float *dx = td__grad_begin(g, x, 0);
    if (x->blocked)
        TD__TRY(td__reorder_run(g, &s->from_plain, n->out->grad, dx));
    else
        memcpy(dx, n->out->grad, x->bytes);
    td__grad_end(g, x);
    return TD_OK;
}

static void reshape_destroy(td__node *n) {
    reshape_state *s = n->state;
    if (!s) return;
    td__reorder_free(&s->to_plain);
    td__reorder_free(&s->from_plain);
    free(s);
}

const td__op td__op_reshape = {
    "reshape", 0, 1, reshape_compile, reshape_forward, reshape_backward, reshape_destroy};

td_status td_graph_reshape(td_graph *g, td_tensor *x, td_shape shape, td_tensor **y) {
    TD__TRY(td__check_input(g, x, "reshape"));
    if (!y) return td__fail(TD_EINVAL, "reshape: y is NULL");
    if (x->dtype != TD_F32) return td__fail(TD_EDTYPE, "reshape: input '%s' must be f32", x->name);
    if (shape.ndim < 0 || shape.ndim > TD_MAX_DIMS ||
        td_shape_numel(&shape) != td_shape_numel(&x->shape))
        return td__fail(TD_ESHAPE, "reshape: '%s' has %lld elements, the new shape %lld", x->name,
                        (long long)td_shape_numel(&x->shape), (long long)td_shape_numel(&shape));
    td__node *n;
    TD__TRY(td__graph_add_node(g, &td__op_reshape, &x, 1, shape, &n));
    *y = n->out;
    return TD_OK;
}

td_status td_graph_flatten(td_graph *g, td_tensor *x, int start_dim, td_tensor **y) {
    TD__TRY(td__check_input(g, x, "flatten"));
    if (start_dim < 0 || start_dim >= (x->shape.ndim > 0 ? x->shape.ndim : 1))
        return td__fail(TD_EINVAL, "flatten: start_dim %d out of range for %d dims", start_dim,
                        x->shape.ndim);
    td_shape s = x->shape;
    int64_t rest = 1;
    for (int i = start_dim; i < x->shape.ndim; i++) rest *= x->shape.dim[i];
    s.ndim = start_dim + 1;
    s.dim[start_dim] = rest;
    return td_graph_reshape(g, x, s, y);
}
