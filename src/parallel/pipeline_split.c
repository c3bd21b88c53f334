/* Where a pipeline's stages start: at named layers (PyTorch's model-parallel tutorial's split,
 * "layer3"), or balanced from measured time. Balancing times each layer alone (forward + backward
 * at the micro-batch size, in a graph of its own), averages the times over every rank so that all
 * ranks cut the same way, and cuts the layer sequence into consecutive runs whose largest total is
 * smallest: the slowest stage sets a pipeline's pace. Communication time is not modelled. It builds
 * no stage and moves no activations. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "parallel/pipeline_impl.h"

/* The fastest of reps timed forward + backward runs of layer i alone: on a shared machine
 * other work only ever adds time, so the minimum is the layer's own cost. */
static td_status profile_one(const td_sequential *model, size_t i, int64_t b, int reps,
                             double *seconds) {
    size_t L = td_sequential_count(model);
    td_shape in;
    TD__TRY(td_sequential_shape_at(model, i, b, &in));
    td_graph *g;
    TD__TRY(td_graph_create(&g, NULL));
    td_tensor *x, *y, *labels = NULL, *loss = NULL;
    float *dy = NULL;
    td_status s = td_graph_input(g, "input", in, TD_F32, i > 0, &x);
    if (s == TD_OK) s = td_sequential_build(model, g, i, i + 1, x, 0, &y);
    /* Inside a stage a layer's output feeds the next layer, which may take it in a blocked
     * layout; a flatten behind it lets it stay blocked here too, as a graph output could not. */
    if (s == TD_OK && i + 1 < L && td_tensor_shape(y).ndim > 2) s = td_graph_flatten(g, y, 1, &y);
    /* The last layer runs with the loss, as the last stage does: a label (class 0) per row. */
    if (s == TD_OK && i + 1 == L)
        s = td_graph_input(g, "labels", td_shape_1d(td_tensor_shape(y).dim[0]), TD_I64, 0, &labels);
    if (s == TD_OK && i + 1 == L)
        s = td_graph_cross_entropy(g, y, labels, TD_REDUCTION_MEAN, &loss, NULL);
    if (s == TD_OK) s = td_graph_compile(g);
    if (s == TD_OK) {
        td_rng rng;
        td_rng_init(&rng, 1);
        /* The model's own input may be token ids: zeros are a valid one for every model. */
        if (i > 0)
            td_rng_fill_uniform(&rng, td_tensor_data(x), (size_t)td_tensor_numel(x), -1, 1);
        else
            memset(td_tensor_data(x), 0, (size_t)td_tensor_numel(x) * sizeof(float));
        if (labels)
            memset(td_tensor_data(labels), 0, (size_t)td_tensor_numel(labels) * sizeof(int64_t));
        dy = malloc((size_t)td_tensor_numel(y) * sizeof *dy);
        if (!dy) s = td__fail(TD_ENOMEM, "pipeline: out of memory profiling layer %zu", i);
        if (dy) td_rng_fill_uniform(&rng, dy, (size_t)td_tensor_numel(y), -1e-3f, 1e-3f);
    }
    double best = 1e300;
    for (int r = -1; s == TD_OK && r < reps; r++) {
        uint64_t t0 = td_time_ns();
        s = td_graph_forward(g);
        if (s == TD_OK) s = loss ? td_graph_backward(g, loss) : td_graph_backward_from(g, y, dy);
        if (s == TD_OK) s = td_graph_zero_grad(g);
        double t = (double)(td_time_ns() - t0) * 1e-9;
        if (r >= 0 && t < best) best = t;
    }
    if (s == TD_OK) *seconds = best;
    free(dy);
    td_graph_destroy(g);
    return s;
}

td_status td_pipeline_profile_layers(const td_sequential *model, int64_t micro_batch, int reps,
                                     double *seconds) {
    if (!model || !seconds) return td__fail(TD_EINVAL, "td_pipeline_profile_layers: NULL argument");
    if (micro_batch < 1 || reps < 1)
        return td__fail(TD_EINVAL, "td_pipeline_profile_layers: micro_batch %lld, reps %d",
                        (long long)micro_batch, reps);
    for (size_t i = 0; i < td_sequential_count(model); i++) {
        td_status s = profile_one(model, i, micro_batch, reps, &seconds[i]);
        if (s != TD_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", td_last_error());
            return td__fail(s, "td_pipeline_profile_layers: layer %zu '%s': %s", i,
                            td_sequential_layer_name(model, i), msg);
        }
    }
    return TD_OK;
}

td_status td_pipeline_balance(const double *cost, size_t n, int stages, size_t *first) {
    if (!cost || !first) return td__fail(TD_EINVAL, "td_pipeline_balance: NULL argument");
    if (stages < 1 || (size_t)stages > n)
        return td__fail(TD_EINVAL, "td_pipeline_balance: %d stages for %zu layers", stages, n);
    for (size_t i = 0; i < n; i++)
        if (!(cost[i] >= 0))
            return td__fail(TD_EINVAL, "td_pipeline_balance: layer %zu costs %g", i, cost[i]);
    /* best[k][j]: the smallest largest-run total of layers [0, j) in k runs; cut[k][j] where
     * the last of those runs starts. */
    size_t P = (size_t)stages, W = n + 1;
    double *prefix = calloc(W, sizeof *prefix), *best = malloc((P + 1) * W * sizeof *best);
    size_t *cut = calloc((P + 1) * W, sizeof *cut);
    if (!prefix || !best || !cut) {
        free(prefix), free(best), free(cut);
        return td__fail(TD_ENOMEM, "td_pipeline_balance: out of memory");
    }
    for (size_t i = 0; i < n; i++) prefix[i + 1] = prefix[i] + cost[i];
    for (size_t i = 0; i < (P + 1) * W; i++) best[i] = 1e300;
    best[0] = 0;
    for (size_t k = 1; k <= P; k++)
        for (size_t j = k; j <= n; j++)
            for (size_t c = k - 1; c < j; c++) {
                double prev = best[(k - 1) * W + c], run = prefix[j] - prefix[c];
                double v = prev > run ? prev : run;
                if (v < best[k * W + j]) { /* strict: the earliest cut wins ties */
                    best[k * W + j] = v;
                    cut[k * W + j] = c;
                }
            }
    size_t j = n;
    for (size_t k = P; k >= 1; k--) {
        first[k - 1] = cut[k * W + j];
        j = first[k - 1];
    }
    free(prefix), free(best), free(cut);
    return TD_OK;
}

/* The split names: P - 1 comma-separated layer names, strictly increasing. */
static td_status parse_split(const td_sequential *model, const char *split, int stages,
                             size_t *first) {
    char buf[512];
    if (strlen(split) >= sizeof buf)
        return td__fail(TD_EINVAL, "pipeline: split '%s' is too long", split);
    snprintf(buf, sizeof buf, "%s", split);
    first[0] = 0;
    int k = 1;
    for (char *save = NULL, *name = strtok_r(buf, ",", &save); name;
         name = strtok_r(NULL, ",", &save), k++) {
        if (k >= stages)
            return td__fail(TD_EINVAL,
                            "pipeline: split '%s' names %d or more cuts, %d stages need %d", split,
                            k, stages, stages - 1);
        TD__TRY(td_sequential_find(model, name, &first[k]));
        if (first[k] <= first[k - 1])
            return td__fail(TD_EINVAL,
                            "pipeline: split '%s': stage %d would start at layer %zu '%s', not "
                            "after stage %d's start (layer %zu)",
                            split, k, first[k], name, k - 1, first[k - 1]);
    }
    if (k != stages)
        return td__fail(TD_EINVAL, "pipeline: split '%s' names %d cut(s), %d stages need %d", split,
                        k - 1, stages, stages - 1);
    return TD_OK;
}

td_status td__pp_choose_split(td_comm *comm, const td_sequential *model, const char *split,
                              int stages, int64_t micro_batch, int reps, size_t *first) {
    size_t L = td_sequential_count(model);
    if ((size_t)stages > L)
        return td__fail(TD_EINVAL, "pipeline: %d stages but the model has %zu layers", stages, L);
    if (split) return parse_split(model, split, stages, first);
    if (stages == 1) {
        first[0] = 0;
        return TD_OK;
    }
    /* Every rank measures and the times are averaged, so each computes the same cut. A rank
     * whose measurement failed sends -1s, and every rank then fails alike. */
    double *t = calloc(L + 1, sizeof *t);
    if (!t) return td__fail(TD_ENOMEM, "pipeline: out of memory");
    td_status s = td_pipeline_profile_layers(model, micro_batch, reps, t);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", s ? td_last_error() : "");
    t[L] = s != TD_OK ? 1 : 0;
    td_status c = td_comm_allreduce(comm, t, t, L + 1, TD_F64, TD_OP_SUM);
    for (size_t i = 0; i < L; i++) t[i] /= td_comm_size(comm);
    if (c != TD_OK)
        s = c;
    else if (s != TD_OK)
        s = td__fail(s, "%s", msg);
    else if (t[L] > 0)
        s = td__fail(TD_EPEER, "pipeline: another rank could not time the layers (its error says "
                               "why)");
    if (s == TD_OK) s = td_pipeline_balance(t, L, stages, first);
    free(t);
    return s;
}
