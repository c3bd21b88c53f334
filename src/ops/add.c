/* The element-wise sum node (residual connections): y = a + b on plain tensors of one
 * shape; backward hands dy to both inputs. No broadcasting. */
#include <string.h>

#include "graph/graph_impl.h"

static td_status add_compile(td_graph *g, td__node *n) {
    (void)g;
    (void)n;
    return TD_OK;
}

static td_status add_forward(td_graph *g, td__node *n) {
    (void)g;
    const float *a = n->in[0]->data, *b = n->in[1]->data;
    float *y = n->out->data;
    size_t count = (size_t)td_shape_numel(&n->out->shape);
    for (size_t i = 0; i < count; i++) y[i] = a[i] + b[i];
    return TD_OK;
}

static td_status add_backward(td_graph *g, td__node *n) {
    size_t bytes = (size_t)td_shape_numel(&n->out->shape) * sizeof(float);
    for (int i = 0; i < 2; i++) {
        td_tensor *x = n->in[i];
        if (!x->requires_grad) continue;
        memcpy(td__grad_begin(g, x, 0), n->out->grad, bytes);
        td__grad_end(g, x);
    }
    return TD_OK;
}

const td__op td__op_add = {"add", 0, 0, add_compile, add_forward, add_backward, NULL};

td_status td_graph_add(td_graph *g, td_tensor *a, td_tensor *b, td_tensor **y) {
    TD__TRY(td__check_input(g, a, "add"));
    TD__TRY(td__check_input(g, b, "add"));
    if (!y) return td__fail(TD_EINVAL, "add: y is NULL");
    if (a->dtype != TD_F32 || b->dtype != TD_F32 || !td_shape_equal(&a->shape, &b->shape))
        return td__fail(TD_ESHAPE, "add: '%s' and '%s' must be f32 of one shape", a->name, b->name);
    td__node *n;
    td_tensor *ins[2] = {a, b};
    TD__TRY(td__graph_add_node(g, &td__op_add, ins, 2, a->shape, &n));
    *y = n->out;
    return TD_OK;
}
