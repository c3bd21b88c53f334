/* td_graph_compile as a sequence of named passes over the node list: fuse (fuse.c), plan
 * layouts, make primitives, allocate, and the bookkeeping for the grad-ready hook. After it
 * a training step neither mallocs nor creates primitives. Walks op tables only. */
#include <stdlib.h>
#include <string.h>

#include "graph/graph_impl.h"

/* A tensor may stay in a backend-chosen layout only when every consumer copes. */
void td__graph_plan_layouts(td_graph *g) {
    for (int i = 0; i < g->ntensors; i++) {
        td_tensor *t = g->tensors[i];
        t->may_block = t->kind == TD__ACT && t->nconsumers > 0;
    }
    for (int k = g->nnodes - 1; k >= 0; k--) {
        td__node *n = g->nodes[k];
        int ok = n->op->accepts_blocked || (n->op->propagates_layout && n->out->may_block);
        for (int i = 0; i < n->nin; i++)
            if (n->in[i] && !ok) n->in[i]->may_block = 0;
    }
}

td_status td__graph_make_primitives(td_graph *g) {
    for (int k = 0; k < g->nnodes; k++) {
        td__node *n = g->nodes[k];
        const td__kernels *k = td__kernels_of(&g->ctx, n->op);
        if (k->compile) TD__TRY(k->compile(&g->ctx, n));
    }
    return TD_OK;
}

/* Storage of the size the tensor's layout needs, zeroed (blocked layouts rely on zero padding). */
static void *zeroed(td_graph *g, size_t bytes) {
    void *p = td_arena_alloc(g->ctx.arena, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

td_status td__graph_allocate(td_graph *g) {
    size_t scratch = 64;
    for (int i = 0; i < g->ntensors; i++) {
        td_tensor *t = g->tensors[i];
        if (t->kind == TD__ACT) t->bytes = g->ctx.backend->storage_bytes(t);
        if (!g->opt.grad_enabled && t->kind == TD__ACT) {
            t->requires_grad = 0;
            continue; /* td__plan_inference_memory below */
        }
        if (t->alias_of) { /* allocated earlier: producers come before consumers */
            t->bytes = t->alias_of->bytes;
            t->own = NULL;
            t->data = t->alias_of->data;
            t->grad = t->alias_of->grad;
            t->grad_zero = 1;
            continue;
        }
        if (t->kind == TD__ACT) {
            t->own = zeroed(g, t->bytes);
            if (!t->own)
                return td__fail(TD_ENOMEM, "td_graph_compile: out of memory for %s", t->name);
            t->data = t->own;
        }
        if (td__is_float(t->dtype) && t->bytes > scratch) scratch = t->bytes;
        if (t->requires_grad && g->opt.grad_enabled) {
            t->grad = zeroed(g, t->bytes);
            if (!t->grad)
                return td__fail(TD_ENOMEM, "td_graph_compile: out of memory for the gradient of %s",
                                t->name);
            t->grad_zero = 1;
        } else {
            t->requires_grad = 0;
        }
    }
    if (!g->opt.grad_enabled) return td__plan_inference_memory(g);
    g->ctx.scratch_bytes = scratch;
    for (int s = 0; s < TD__SCRATCH_SLOTS; s++) {
        g->ctx.scratch[s] = zeroed(g, scratch);
        if (!g->ctx.scratch[s])
            return td__fail(TD_ENOMEM, "td_graph_compile: out of memory for scratch");
    }
    return TD_OK;
}

/* For each parameter, the first node that reads it: the last one backward visits, after
 * which its gradient is final. */
static td_status plan_grad_ready(td_graph *g) {
    g->param_last_node = malloc(((size_t)g->nparams + 1) * sizeof *g->param_last_node);
    g->fired = calloc((size_t)g->nparams + 1, 1);
    if (!g->param_last_node || !g->fired)
        return td__fail(TD_ENOMEM, "td_graph_compile: out of memory");
    for (int i = 0; i < g->nparams; i++) g->param_last_node[i] = -1;
    for (int k = 0; k < g->nnodes; k++)
        for (int i = 0; i < g->nodes[k]->nin; i++) {
            td_tensor *t = g->nodes[k]->in[i];
            if (t && t->kind == TD__PARAM && g->param_last_node[t->index] < 0)
                g->param_last_node[t->index] = k;
        }
    return TD_OK;
}

td_status td_graph_compile(td_graph *g) {
    if (!g) return td__fail(TD_EINVAL, "td_graph_compile: graph is NULL");
    if (g->compiled) return TD_OK; /* td_model_build compiles; a second call is harmless */
    for (int k = 0; k < g->nnodes; k++)
        if (g->nodes[k]->state)
            return td__fail(TD_ESTATE,
                            "td_graph_compile: an earlier compile failed; build a new graph");
    td__graph_fuse(g);
    td__graph_plan_layouts(g);
    TD__TRY(td__graph_make_primitives(g));
    TD__TRY(td__graph_allocate(g));
    TD__TRY(plan_grad_ready(g));
    for (int i = 0; i < g->nparams; i++) {
        g->params[i].data = g->param_t[i]->data;
        g->params[i].grad = g->param_t[i]->grad;
    }
    g->compiled = 1;
    return TD_OK;
}
