/* td_graph_compile as a sequence of named passes over the node list: fuse (fuse.c), plan
 * recompute (recompute.c), plan layouts, make primitives, allocate, and the bookkeeping for
 * the grad-ready hook. After it a training step neither mallocs nor creates primitives. Walks
 * op tables only. */
#include <stdint.h>
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

/* Offsets for every tensor's data and gradient and for the scratch slots. */
static td_status plan_storage(td_graph *g, td__storage_plan *p, size_t *scratch_at) {
    size_t scratch = 64;
    for (int i = 0; i < g->ntensors; i++) {
        td_tensor *t = g->tensors[i];
        if (t->kind == TD__ACT) t->bytes = g->ctx.backend->storage_bytes(t);
        if (!g->opt.grad_enabled && t->kind == TD__ACT) {
            t->requires_grad = 0;
            continue; /* td__plan_inference_memory below */
        }
        if (t->alias_of) { /* placed earlier: producers come before consumers */
            t->bytes = t->alias_of->bytes;
            p->data[t->id] = p->data[t->alias_of->id];
            p->grad[t->id] = p->grad[t->alias_of->id];
            continue;
        }
        if (td__is_float(t->dtype) && t->bytes > scratch) scratch = t->bytes;
        if (td__recompute_place(g, p, t)) continue; /* in the region segments share */
        /* Leaves live in host memory until compile, so that initialisers can write them; a
         * graph on a GPU moves them into its storage. */
        if (t->kind == TD__ACT || g->opt.device.type != TD_DEVICE_CPU)
            p->data[t->id] = td__storage_place(p, t->bytes);
        if (t->requires_grad && g->opt.grad_enabled)
            p->grad[t->id] = td__storage_place(p, t->bytes);
        else
            t->requires_grad = 0;
    }
    if (!g->opt.grad_enabled) return td__plan_inference_memory(g, p);
    td__recompute_rebase(g, p);
    g->ctx.scratch_bytes = scratch;
    for (int s = 0; s < TD__SCRATCH_SLOTS; s++) scratch_at[s] = td__storage_place(p, scratch);
    return TD_OK;
}

td_status td__graph_allocate(td_graph *g) {
    int n = g->ntensors ? g->ntensors : 1;
    td__storage_plan p = {malloc((size_t)n * sizeof *p.data), malloc((size_t)n * sizeof *p.grad),
                          0};
    size_t scratch_at[TD__SCRATCH_SLOTS] = {0};
    td_status st = TD_OK;
    if (!p.data || !p.grad) st = td__fail(TD_ENOMEM, "td_graph_compile: out of memory planning");
    for (int i = 0; st == TD_OK && i < g->ntensors; i++) p.data[i] = p.grad[i] = SIZE_MAX;
    if (st == TD_OK) st = plan_storage(g, &p, scratch_at);
    if (st == TD_OK) st = g->ctx.backend->alloc(&g->ctx, p.total, &g->storage);
    if (st == TD_OK) {
        char *base = g->storage;
        g->storage_bytes = p.total;
        for (int i = 0; i < g->ntensors; i++) {
            td_tensor *t = g->tensors[i];
            if (p.data[i] != SIZE_MAX) {
                void *at = base + p.data[i];
                if (t->kind != TD__ACT) { /* a leaf moves from host memory into storage */
                    st = g->ctx.backend->upload(&g->ctx, at, t->own, t->bytes);
                    if (st != TD_OK) break;
                    free(t->own);
                }
                t->data = at;
                if (!t->alias_of) t->own = at;
            }
            if (p.grad[i] != SIZE_MAX) {
                t->grad = base + p.grad[i];
                t->grad_zero = 1;
            }
        }
        if (g->opt.grad_enabled)
            for (int s = 0; s < TD__SCRATCH_SLOTS; s++)
                g->ctx.scratch[s] = (float *)(base + scratch_at[s]);
    }
    free(p.data);
    free(p.grad);
    return st;
}

/* For each parameter, the first node that reads it: the last one backward visits, after
 * which its gradient is final; and the last node that reads it, after which forward is done
 * with it (the parameter-use hook's points). */
static td_status plan_grad_ready(td_graph *g) {
    size_t n = (size_t)g->nparams + 1;
    g->param_last_node = malloc(n * sizeof *g->param_last_node);
    g->param_final_node = malloc(n * sizeof *g->param_final_node);
    g->fired = calloc(n, 1);
    g->used = calloc(n, 1);
    g->shard_summed = calloc(n, 1);
    if (!g->param_last_node || !g->param_final_node || !g->fired || !g->used || !g->shard_summed)
        return td__fail(TD_ENOMEM, "td_graph_compile: out of memory");
    for (int i = 0; i < g->nparams; i++) g->param_last_node[i] = g->param_final_node[i] = -1;
    for (int k = 0; k < g->nnodes; k++)
        for (int i = 0; i < g->nodes[k]->nin; i++) {
            td_tensor *t = g->nodes[k]->in[i];
            if (!t || t->kind != TD__PARAM) continue;
            if (g->param_last_node[t->index] < 0) g->param_last_node[t->index] = k;
            g->param_final_node[t->index] = k;
        }
    return TD_OK;
}

/* The nodes whose kernels sum a step's shards themselves (td_graph_set_shard) and whose
 * parameters no other node reads: their parameters' gradients come once per step. */
static void plan_shard_sums(td_graph *g) {
    for (int k = 0; k < g->nnodes; k++) {
        td__node *n = g->nodes[k];
        const td__kernels *kern = td__kernels_of(&g->ctx, n->op);
        int ok = kern->sums_shards && kern->sums_shards(&g->ctx, n) &&
                 (!n->in[0] || n->in[0]->kind != TD__PARAM);
        for (int i = 1; ok && i < n->nin; i++) {
            const td_tensor *t = n->in[i];
            ok = !t || t->kind != TD__PARAM ||
                 (g->param_last_node[t->index] == k && g->param_final_node[t->index] == k);
        }
        n->sums_shards = ok;
        for (int i = 1; ok && i < n->nin; i++)
            if (n->in[i] && n->in[i]->kind == TD__PARAM) g->shard_summed[n->in[i]->index] = 1;
    }
}

/* td_param.written of a parameter whose copy a node lays out itself. */
static void param_written(void *ctx, const void *data, size_t begin, size_t end) {
    td__param_writer *w = ctx;
    td__op_ctx *c = &w->g->ctx;
    td__kernels_of(c, w->node->op)->weights_written(c, w->node, data, begin, end);
}

/* The parameters some node keeps a copy of in a kernel's layout and lays out itself as they are
 * written: their writers tell that node (the first such, where several read one parameter). */
static td_status plan_weight_writes(td_graph *g) {
    g->writers = calloc((size_t)g->nparams + 1, sizeof *g->writers);
    if (!g->writers) return td__fail(TD_ENOMEM, "td_graph_compile: out of memory");
    for (int k = 0; k < g->nnodes; k++) {
        td__node *n = g->nodes[k];
        const td__kernels *kern = td__kernels_of(&g->ctx, n->op);
        int i = kern->lays_out_weights && kern->weights_written ? kern->lays_out_weights(&g->ctx, n)
                                                                : -1;
        td_tensor *t = i >= 0 && i < n->nin ? n->in[i] : NULL;
        if (!t || t->kind != TD__PARAM || g->writers[t->index].node) continue;
        g->writers[t->index] = (td__param_writer){g, n};
        g->params[t->index].written = param_written;
        g->params[t->index].written_ctx = &g->writers[t->index];
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
    TD__TRY(td__recompute_plan(g));
    td__graph_plan_layouts(g);
    /* Primitives are made for the thread count they will run on. */
    int was;
    TD__TRY(td__graph_threads_enter(g, "td_graph_compile", &was));
    td_status s = td__graph_make_primitives(g);
    td__graph_threads_leave(g, was);
    TD__TRY(s);
    TD__TRY(td__graph_allocate(g));
    TD__TRY(plan_grad_ready(g));
    plan_shard_sums(g);
    TD__TRY(plan_weight_writes(g));
    for (int i = 0; i < g->nparams; i++) {
        g->params[i].data = g->param_t[i]->data;
        g->params[i].grad = g->param_t[i]->grad;
    }
    g->compiled = 1;
    return TD_OK;
}
