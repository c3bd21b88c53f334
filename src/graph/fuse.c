/* The fusion pass, through the op tables only: an activation node whose input nothing else
 * reads is folded into its producer's primitive when the producer's table offers to take it
 * (batch norm + ReLU: one pass less over the activation, forward and backward), and otherwise
 * runs in place over its input when the producer's backward does not need its own output
 * (softmax's does). Either way the activation's output aliases its input. */
#include "graph/graph_impl.h"

void td__graph_fuse(td_graph *g) {
    for (int k = 0; k < g->nnodes; k++) {
        td__node *n = g->nodes[k];
        td__activation act = n->op->activation ? n->op->activation(n) : TD__NO_ACTIVATION;
        td_tensor *x = n->in[0];
        if (act == TD__NO_ACTIVATION || x->kind != TD__ACT || x->producer < 0 || x->nconsumers != 1)
            continue;
        td__node *p = g->nodes[x->producer];
        if (p->op->fold_activation && p->op->fold_activation(p, act))
            n->op->set_alias(n, TD__FOLDED);
        else if (!p->op->backward_reads_output)
            n->op->set_alias(n, TD__IN_PLACE);
    }
}
