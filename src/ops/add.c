/* The element-wise sum node (residual connections): y = a + b over tensors of one shape;
 * backward hands dy to both inputs. No broadcasting. The inputs may come in any layouts (a
 * residual block's two branches leave their convolutions blocked): the output takes the first
 * input's layout where its consumers accept it, and an input in another layout is reordered
 * into the output's on the way in (and its gradient back on the way out). */
#include <stdlib.h>
#include <string.h>

#include "ops/onednn.h"

typedef struct {
    td__adapt in[2];   /* input i -> output layout */
    td__adapt grad[2]; /* output layout -> input i's layout */
} add_state;

static td_status add_compile(td__op_ctx *ctx, td__node *n) {
    add_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "add: out of memory");
    n->state = s;
    td_tensor *y = n->out;
    if (n->in[0]->blocked && y->may_block) {
        y->md = n->in[0]->md;
        y->blocked = 1;
    }
    for (int i = 0; i < 2; i++) {
        TD__TRY(td__adapt_init(ctx, &s->in[i], &n->in[i]->md, &y->md));
        if (y->requires_grad && n->in[i]->requires_grad)
            TD__TRY(td__adapt_init(ctx, &s->grad[i], &y->md, &n->in[i]->md));
    }
    return TD_OK;
}

static td_status add_forward(td__op_ctx *ctx, td__node *n) {
    add_state *s = n->state;
    const float *a = td__adapt_in(ctx, &s->in[0], n->in[0]->data);
    const float *b = td__adapt_in(ctx, &s->in[1], n->in[1]->data);
    if (!a || !b) return td__fail(TD_EBACKEND, "add: reordering an input failed");
    float *y = n->out->data;
    size_t count = td__nfloats(n->out);
    for (size_t i = 0; i < count; i++) y[i] = a[i] + b[i];
    return TD_OK;
}

static td_status add_backward(td__op_ctx *ctx, td__node *n) {
    add_state *s = n->state;
    for (int i = 0; i < 2; i++) {
        td_tensor *x = n->in[i];
        if (!x->requires_grad) continue;
        const float *dy = td__adapt_in(ctx, &s->grad[i], n->out->grad);
        if (!dy) return td__fail(TD_EBACKEND, "add: reordering a gradient failed");
        memcpy(td__grad_begin(ctx, x, 0), dy, x->bytes);
        td__grad_end(ctx, x);
    }
    return TD_OK;
}

static void add_destroy(td__node *n) {
    add_state *s = n->state;
    if (!s) return;
    for (int i = 0; i < 2; i++) {
        td__adapt_free(&s->in[i]);
        td__adapt_free(&s->grad[i]);
    }
    free(s);
}

static td_status add_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *a = n->in[0], *b = n->in[1];
    if (!b) return td__fail(TD_EINVAL, "add: the second input is NULL");
    if (a->dtype != TD_F32 || b->dtype != TD_F32 || !td_shape_equal(&a->shape, &b->shape))
        return td__fail(TD_ESHAPE, "add: '%s' and '%s' must be f32 of one shape", a->name, b->name);
    *shape = a->shape;
    *dtype = TD_F32;
    return TD_OK;
}

const td__op td__op_add = {
    .name = "add",
    .accepts_blocked = 1,
    .infer = add_infer,
    .compile = add_compile,
    .forward = add_forward,
    .backward = add_backward,
    .destroy = add_destroy,
};
