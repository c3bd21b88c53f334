/* The negative log-likelihood loss node (and cross entropy = log_softmax + nll): a scalar
 * from (N, C) log-probabilities and (N) int64 labels, mean or sum over the batch. Plain C;
 * labels out of range are an error naming the sample, not a crash. */
#include <string.h>

#include "graph/graph_impl.h"

static td_status nll_compile(td_graph *g, td__node *n) {
    (void)g;
    (void)n;
    return TD_OK;
}

static td_status nll_forward(td_graph *g, td__node *n) {
    (void)g;
    const td_tensor *lp = n->in[0];
    const float *logp = lp->data;
    const int64_t *lab = n->in[1]->data;
    int64_t N = lp->shape.dim[0], C = lp->shape.dim[1];
    double sum = 0;
    for (int64_t i = 0; i < N; i++) {
        if (lab[i] < 0 || lab[i] >= C)
            return td__fail(TD_EINVAL, "nll_loss: label %lld of sample %lld is outside [0, %lld)",
                            (long long)lab[i], (long long)i, (long long)C);
        sum -= logp[i * C + lab[i]];
    }
    if (n->attr.reduction == TD_REDUCTION_MEAN) sum /= (double)N;
    *(float *)n->out->data = (float)sum;
    return TD_OK;
}

static td_status nll_backward(td_graph *g, td__node *n) {
    td_tensor *lp = n->in[0];
    const int64_t *lab = n->in[1]->data;
    int64_t N = lp->shape.dim[0], C = lp->shape.dim[1];
    float gy = n->out->grad[0];
    float scale = n->attr.reduction == TD_REDUCTION_MEAN ? gy / (float)N : gy;
    int acc = !lp->grad_zero;
    float *d = lp->grad;
    if (!acc) memset(d, 0, (size_t)(N * C) * sizeof(float));
    for (int64_t i = 0; i < N; i++) d[i * C + lab[i]] -= scale;
    lp->grad_zero = 0;
    (void)g;
    return TD_OK;
}

const td__op td__op_nll = {"nll_loss", 0, 0, nll_compile, nll_forward, nll_backward, NULL};

td_status td_graph_nll_loss(td_graph *g, td_tensor *logp, td_tensor *labels, td_reduction reduction,
                            td_tensor **loss) {
    TD__TRY(td__check_input(g, logp, "nll_loss"));
    TD__TRY(td__check_input(g, labels, "nll_loss"));
    if (!loss) return td__fail(TD_EINVAL, "nll_loss: loss is NULL");
    if (logp->dtype != TD_F32 || logp->shape.ndim != 2)
        return td__fail(TD_ESHAPE, "nll_loss: '%s' must be f32 (N, C)", logp->name);
    if (labels->dtype != TD_I64 || labels->shape.ndim != 1 ||
        labels->shape.dim[0] != logp->shape.dim[0])
        return td__fail(TD_ESHAPE, "nll_loss: labels '%s' must be i64 (%lld)", labels->name,
                        (long long)logp->shape.dim[0]);
    if (reduction != TD_REDUCTION_MEAN && reduction != TD_REDUCTION_SUM)
        return td__fail(TD_EINVAL, "nll_loss: unknown reduction %d", (int)reduction);
    td__node *n;
    td_tensor *ins[2] = {logp, labels};
    TD__TRY(td__graph_add_node(g, &td__op_nll, ins, 2, td_shape_make(0, NULL), &n));
    n->attr.reduction = reduction;
    *loss = n->out;
    return TD_OK;
}

td_status td_graph_cross_entropy(td_graph *g, td_tensor *logits, td_tensor *labels,
                                 td_reduction reduction, td_tensor **loss, td_tensor **logp) {
    td_tensor *lp;
    TD__TRY(td_graph_log_softmax(g, logits, &lp));
    if (logp) *logp = lp;
    return td_graph_nll_loss(g, lp, labels, reduction, loss);
}
