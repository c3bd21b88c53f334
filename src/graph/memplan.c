/* Where the graph's tensors lie in its one block of storage: offsets placed one after another
 * (td__storage_place, which compile.c's plan for training graphs uses), and the activation
 * memory of inference graphs (grad_enabled = 0): nothing is needed after the forward sweep
 * except what the last node reads and writes, so an activation may take over the storage of
 * one whose consumers have all run. Training graphs keep every activation (backward reads
 * them) and do not share. Only layouts without padding share memory: a padded blocked layout
 * relies on zeros that another tensor's values would spoil. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "graph/graph_impl.h"

typedef struct {
    size_t at; /* offset in the graph's storage */
    size_t bytes;
} free_block;

size_t td__storage_place(td__storage_plan *p, size_t bytes) {
    size_t at = p->total;
    p->total += (bytes + 63) & ~(size_t)63;
    return at;
}

static td_tensor *root_of(td_tensor *t) {
    while (t->alias_of) t = t->alias_of;
    return t;
}

/* No padding: the storage holds exactly the logical elements. */
static int shareable(const td_tensor *t) {
    return td__is_float(t->dtype) &&
           t->bytes == (size_t)td_shape_numel(&t->shape) * td_dtype_size(t->dtype);
}

td_status td__plan_inference_memory(td_graph *g, td__storage_plan *plan) {
    int n = g->ntensors;
    int *last = malloc((size_t)(n ? n : 1) * sizeof *last);
    unsigned char *released = calloc((size_t)(n ? n : 1), 1);
    free_block *pool = malloc((size_t)(n ? n : 1) * sizeof *pool);
    int npool = 0;
    td_status st = TD_OK;
    if (!last || !released || !pool) {
        st = td__fail(TD_ENOMEM, "td_graph_compile: out of memory planning activations");
        goto done;
    }
    /* The last node that reads or writes each storage; tensors nobody reads are outputs. */
    for (int i = 0; i < n; i++) last[i] = -1;
    for (int k = 0; k < g->nnodes; k++) {
        td__node *nd = g->nodes[k];
        for (int i = 0; i < nd->nin; i++)
            if (nd->in[i] && nd->in[i]->kind == TD__ACT) {
                td_tensor *r = root_of(nd->in[i]);
                if (last[r->id] < k) last[r->id] = k;
            }
        td_tensor *r = root_of(nd->out);
        if (last[r->id] < k) last[r->id] = k;
        if (nd->out->nconsumers == 0) last[r->id] = INT_MAX;
    }
    for (int k = 0; k < g->nnodes; k++) {
        td_tensor *t = g->nodes[k]->out;
        if (t->alias_of) {
            td_tensor *r = root_of(t);
            t->bytes = r->bytes;
            plan->data[t->id] = plan->data[r->id];
        } else {
            int best = -1;
            if (shareable(t))
                for (int b = 0; b < npool; b++)
                    if (pool[b].bytes >= t->bytes && (best < 0 || pool[b].bytes < pool[best].bytes))
                        best = b;
            if (best >= 0) {
                plan->data[t->id] = pool[best].at;
                pool[best] = pool[--npool];
            } else {
                plan->data[t->id] = td__storage_place(plan, t->bytes);
            }
        }
        /* Storage whose last reader is this node goes back to the pool. */
        td__node *nd = g->nodes[k];
        for (int i = 0; i < nd->nin; i++) {
            if (!nd->in[i] || nd->in[i]->kind != TD__ACT) continue;
            td_tensor *r = root_of(nd->in[i]);
            if (last[r->id] == k && !released[r->id] && shareable(r)) {
                released[r->id] = 1;
                pool[npool].at = plan->data[r->id];
                pool[npool].bytes = r->bytes;
                npool++;
            }
        }
    }
done:
    free(last);
    free(released);
    free(pool);
    return st;
}
