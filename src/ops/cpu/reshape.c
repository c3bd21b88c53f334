/* Flatten and reshape nodes. The output is always plain row-major, so this is where a
 * blocked activation (conv -> ... -> flatten -> linear) goes back to PyTorch's layout;
 * for a plain input it is a copy. */
#include <stdlib.h>
#include <string.h>

#include "ops/cpu/onednn.h"

typedef struct {
    td__reorder to_plain, from_plain; /* only for a blocked input */
} reshape_state;

static td_status reshape_compile(td__op_ctx *ctx, td__node *n) {
    reshape_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "reshape: out of memory");
    n->state = s;
    td_tensor *x = n->in[0];
    if (!x->blocked) return TD_OK;
    dnnl_memory_desc_t plain;
    td__md_plain(&plain, &x->shape, x->dtype);
    TD__TRY(td__reorder_init(ctx, &s->to_plain, td__md(x), &plain));
    if (x->requires_grad) TD__TRY(td__reorder_init(ctx, &s->from_plain, &plain, td__md(x)));
    return TD_OK;
}

static td_status reshape_forward(td__op_ctx *ctx, td__node *n) {
    reshape_state *s = n->state;
    td_tensor *x = n->in[0];
    if (x->blocked) return td__reorder_run(ctx, &s->to_plain, x->data, n->out->data);
    memcpy(n->out->data, x->data, x->bytes);
    return TD_OK;
}

static td_status reshape_backward(td__op_ctx *ctx, td__node *n) {
    reshape_state *s = n->state;
    td_tensor *x = n->in[0];
    float *dx = td__grad_begin(ctx, x, 0);
    if (x->blocked)
        TD__TRY(td__reorder_run(ctx, &s->from_plain, n->out->grad, dx));
    else
        memcpy(dx, n->out->grad, x->bytes);
    td__grad_end(ctx, x);
    return TD_OK;
}

static void reshape_destroy(td__node *n) {
    reshape_state *s = n->state;
    if (!s) return;
    td__reorder_free(&s->to_plain);
    td__reorder_free(&s->from_plain);
    free(s);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_reshape = {
    .compile = reshape_compile,
    .forward = reshape_forward,
    .backward = reshape_backward,
    .destroy = reshape_destroy,
    .supports = td__onednn_supports,
};
