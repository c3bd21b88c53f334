/* Gradient bookkeeping for graphs that share parameter gradients through their td_param
 * arrays, as a pipeline stage's micro-batch graphs do: zeroing the input gradients alone, and
 * making the next backward add into parameter gradients that another graph's backward already
 * wrote (all of them, or one: a tied weight whose gradient a later stage began). Both only set the
 * deferred-zero flags td_graph_zero_grad sets (graph.c explains the deferral); nothing here touches
 * gradient memory or runs a sweep. */
#include "graph/graph_impl.h"

td_status td_graph_zero_input_grads(td_graph *g) {
    if (!g) return td__fail(TD_EINVAL, "td_graph_zero_input_grads: graph is NULL");
    if (!g->compiled) return TD_OK;
    for (int i = 0; i < g->ntensors; i++) {
        td_tensor *t = g->tensors[i];
        if (t->kind == TD__INPUT && t->grad) t->grad_zero = 1;
    }
    return TD_OK;
}

td_status td_graph_accumulate_param_grads(td_graph *g) {
    if (!g) return td__fail(TD_EINVAL, "td_graph_accumulate_param_grads: graph is NULL");
    if (!g->compiled)
        return td__fail(TD_ESTATE, "td_graph_accumulate_param_grads: call td_graph_compile first");
    td__graph_sync_storage(g);
    for (int i = 0; i < g->nparams; i++)
        if (g->param_t[i]->grad) g->param_t[i]->grad_zero = 0;
    return TD_OK;
}

td_status td_graph_accumulate_param_grad(td_graph *g, size_t i) {
    if (!g) return td__fail(TD_EINVAL, "td_graph_accumulate_param_grad: graph is NULL");
    if (!g->compiled)
        return td__fail(TD_ESTATE, "td_graph_accumulate_param_grad: call td_graph_compile first");
    if (i >= (size_t)g->nparams)
        return td__fail(TD_EINVAL, "td_graph_accumulate_param_grad: parameter %zu of %d", i,
                        g->nparams);
    td__graph_sync_storage(g);
    if (g->param_t[i]->grad) g->param_t[i]->grad_zero = 0;
    return TD_OK;
}
