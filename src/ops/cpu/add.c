/* The element-wise sum node (residual connections): y = a + b over inputs of one shape and
 * dtype; backward hands dy to both inputs. It works over storage, so it keeps the first
 * input's layout (blocked stays blocked, as a residual block's convolutions hand over) and
 * reorders the second only when its layout differs. No broadcasting. */
#include <stdlib.h>
#include <string.h>

#include "ops/cpu/onednn.h"

typedef struct {
    td__adapt b_in;   /* b -> a's layout */
    td__adapt db_out; /* a's layout -> b's, for b's gradient */
} add_state;

static td_status add_compile(td__op_ctx *ctx, td__node *n) {
    add_state *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "add: out of memory");
    n->state = s;
    td_tensor *a = n->in[0], *b = n->in[1], *y = n->out;
    *td__md(y) = *td__md(a);
    y->blocked = a->blocked;
    TD__TRY(td__adapt_init(ctx, &s->b_in, td__md(b), td__md(a)));
    if (b->requires_grad) TD__TRY(td__adapt_init(ctx, &s->db_out, td__md(a), td__md(b)));
    return TD_OK;
}

static td_status add_forward(td__op_ctx *ctx, td__node *n) {
    add_state *s = n->state;
    td_tensor *a = n->in[0], *y = n->out;
    const void *b = td__adapt_in(ctx, &s->b_in, n->in[1]->data);
    if (!b) return td__fail(TD_EBACKEND, "add: reorder of '%s' failed", n->in[1]->name);
    size_t count = td__nelems(a);
    if (a->dtype == TD_F32) {
        const float *pa = a->data, *pb = b;
        float *py = y->data;
        for (size_t i = 0; i < count; i++) py[i] = pa[i] + pb[i];
    } else {
        for (size_t i = 0; i < count; i++)
            td__store(y->data, a->dtype, i,
                      td__load(a->data, a->dtype, i) + td__load(b, a->dtype, i));
    }
    return TD_OK;
}

static td_status add_backward(td__op_ctx *ctx, td__node *n) {
    add_state *s = n->state;
    td_tensor *a = n->in[0], *b = n->in[1];
    if (a->requires_grad) {
        memcpy(td__grad_begin(ctx, a, 0), n->out->grad, a->bytes);
        td__grad_end(ctx, a);
    }
    if (b->requires_grad) {
        void *db = td__grad_begin(ctx, b, 0);
        if (s->db_out.need)
            TD__TRY(td__reorder_run(ctx, &s->db_out.r, n->out->grad, db));
        else
            memcpy(db, n->out->grad, b->bytes);
        td__grad_end(ctx, b);
    }
    return TD_OK;
}

static void add_destroy(td__node *n) {
    add_state *s = n->state;
    if (!s) return;
    td__adapt_free(&s->b_in);
    td__adapt_free(&s->db_out);
    free(s);
}

/* The CPU backend's kernels. */
const td__kernels td__cpu_add = {
    .compile = add_compile,
    .forward = add_forward,
    .backward = add_backward,
    .destroy = add_destroy,
};
