/* The channel concatenation node: (N, C_i, ...) inputs side by side along dim 1, plain
 * layouts; backward slices dy back out to each input. */
#include <string.h>

#include "graph/graph_impl.h"

static td_status concat_compile(td_graph *g, td__node *n) {
    (void)g;
    (void)n;
    return TD_OK;
}

/* Elements per sample of input i (C_i times the trailing dims). */
static size_t chunk(const td_tensor *t) {
    return (size_t)(td_shape_numel(&t->shape) / t->shape.dim[0]);
}

static td_status concat_forward(td_graph *g, td__node *n) {
    (void)g;
    float *y = n->out->data;
    size_t row = chunk(n->out);
    for (int64_t s = 0; s < n->out->shape.dim[0]; s++) {
        size_t off = 0;
        for (int i = 0; i < n->nin; i++) {
            size_t c = chunk(n->in[i]);
            memcpy(y + s * row + off, (const float *)n->in[i]->data + s * c, c * sizeof(float));
            off += c;
        }
    }
    return TD_OK;
}

static td_status concat_backward(td_graph *g, td__node *n) {
    const float *dy = n->out->grad;
    size_t row = chunk(n->out), off = 0;
    for (int i = 0; i < n->nin; i++) {
        td_tensor *x = n->in[i];
        size_t c = chunk(x);
        if (x->requires_grad) {
            float *dx = td__grad_begin(g, x, 0);
            for (int64_t s = 0; s < n->out->shape.dim[0]; s++)
                memcpy(dx + s * c, dy + s * row + off, c * sizeof(float));
            td__grad_end(g, x);
        }
        off += c;
    }
    return TD_OK;
}

const td__op td__op_concat = {"concat",        0,   0, concat_compile, concat_forward,
                              concat_backward, NULL};

td_status td_graph_concat(td_graph *g, td_tensor *const *xs, int n, td_tensor **y) {
    if (!xs || n < 1 || n > TD__MAX_IN || !y)
        return td__fail(TD_EINVAL, "concat: need 1..%d inputs and an output pointer", TD__MAX_IN);
    TD__TRY(td__check_input(g, xs[0], "concat"));
    td_shape s = xs[0]->shape;
    if (s.ndim < 2 || xs[0]->dtype != TD_F32)
        return td__fail(TD_ESHAPE, "concat: '%s' must be f32 with >= 2 dims", xs[0]->name);
    for (int i = 1; i < n; i++) {
        TD__TRY(td__check_input(g, xs[i], "concat"));
        const td_shape *t = &xs[i]->shape;
        int ok = t->ndim == s.ndim && xs[i]->dtype == TD_F32;
        for (int d = 0; ok && d < s.ndim; d++)
            if (d != 1 && t->dim[d] != s.dim[d]) ok = 0;
        if (!ok)
            return td__fail(TD_ESHAPE, "concat: '%s' does not match '%s' outside dim 1",
                            xs[i]->name, xs[0]->name);
        s.dim[1] += t->dim[1];
    }
    td__node *node;
    TD__TRY(td__graph_add_node(g, &td__op_concat, xs, n, s, &node));
    *y = node->out;
    return TD_OK;
}
