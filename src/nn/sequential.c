/* td_sequential: a model as consecutive named layers, and building any run of them into a
 * graph with the parameters the whole model would have. A pipeline builds each stage from its
 * run of layers; td_model_build builds them all.
 *
 * Initialisation draws from one stream per model seed, layer after layer, so that a model built
 * whole equals one built stage by stage: a run that starts at layer k first replays layers
 * [0, k) into a scratch graph that is never compiled (it allocates their parameters, no
 * activations) to reach layer k's place in the stream and its input shape. Each layer is a
 * recompute segment of the graph (td_graph_segment_begin), named as the layer. This file does
 * not define any layers (models.c and resnet.c do) or train. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "nn/nn_impl.h"

#define SEQ_NAME_MAX 48

typedef struct {
    char name[SEQ_NAME_MAX];
    td_layer_fn fn;
    void *arg; /* (arg_bytes) the layer's own copy, or NULL */
} seq_layer;

struct td_sequential {
    td_model_kind kind; /* the reference model it describes, TD_MODEL_COUNT for the caller's */
    int split_logits;   /* its logits are split by columns over the graph's group */
    td_shape sample;
    seq_layer *layers;
    size_t n, cap;
};

td_status td_sequential_create(td_sequential **out, td_shape sample) {
    if (!out) return td__fail(TD_EINVAL, "td_sequential_create: out is NULL");
    *out = NULL;
    if (sample.ndim < 1 || sample.ndim >= TD_MAX_DIMS)
        return td__fail(TD_ESHAPE, "td_sequential_create: a sample has %d dims (1 to %d)",
                        sample.ndim, TD_MAX_DIMS - 1);
    for (int i = 0; i < sample.ndim; i++)
        if (sample.dim[i] < 1)
            return td__fail(TD_ESHAPE, "td_sequential_create: sample dim %d is %lld", i,
                            (long long)sample.dim[i]);
    td_sequential *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "td_sequential_create: out of memory");
    s->kind = TD_MODEL_COUNT;
    s->sample = sample;
    *out = s;
    return TD_OK;
}

void td_sequential_destroy(td_sequential *s) {
    if (!s) return;
    for (size_t i = 0; i < s->n; i++) free(s->layers[i].arg);
    free(s->layers);
    free(s);
}

td_status td_sequential_insert(td_sequential *s, size_t index, const char *name, td_layer_fn fn,
                               const void *arg, size_t arg_bytes) {
    if (!s || !name || !fn || (arg_bytes && !arg))
        return td__fail(TD_EINVAL, "sequential: NULL model, name, function or arg");
    if (index > s->n)
        return td__fail(TD_EINVAL, "sequential: position %zu of a model of %zu layers", index,
                        s->n);
    if (!*name || strlen(name) >= SEQ_NAME_MAX)
        return td__fail(TD_EINVAL, "sequential: layer name '%s' is empty or over %d chars", name,
                        SEQ_NAME_MAX - 1);
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->layers[i].name, name) == 0)
            return td__fail(TD_EINVAL, "sequential: layer '%s' is already there", name);
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 16;
        seq_layer *l = realloc(s->layers, cap * sizeof *l);
        if (!l) return td__fail(TD_ENOMEM, "sequential: out of memory");
        s->layers = l;
        s->cap = cap;
    }
    seq_layer l;
    memset(&l, 0, sizeof l);
    snprintf(l.name, sizeof l.name, "%s", name);
    l.fn = fn;
    if (arg_bytes) {
        l.arg = malloc(arg_bytes);
        if (!l.arg) return td__fail(TD_ENOMEM, "sequential: out of memory");
        memcpy(l.arg, arg, arg_bytes);
    }
    memmove(&s->layers[index + 1], &s->layers[index], (s->n - index) * sizeof *s->layers);
    s->layers[index] = l;
    s->n++;
    s->kind = TD_MODEL_COUNT; /* no longer a reference model as it stands */
    return TD_OK;
}

td_status td_sequential_add(td_sequential *s, const char *name, td_layer_fn fn, const void *arg,
                            size_t arg_bytes) {
    return td_sequential_insert(s, s ? s->n : 0, name, fn, arg, arg_bytes);
}

size_t td_sequential_count(const td_sequential *s) { return s ? s->n : 0; }

const char *td_sequential_layer_name(const td_sequential *s, size_t i) {
    return s && i < s->n ? s->layers[i].name : NULL;
}

td_shape td_sequential_sample_shape(const td_sequential *s) {
    td_shape none = {0, {0}};
    return s ? s->sample : none;
}

td_status td_sequential_find(const td_sequential *s, const char *name, size_t *index) {
    if (!s || !name || !index) return td__fail(TD_EINVAL, "td_sequential_find: NULL argument");
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->layers[i].name, name) == 0) {
            *index = i;
            return TD_OK;
        }
    size_t len = strlen(name);
    for (size_t i = 0; i < s->n; i++)
        if (strncmp(s->layers[i].name, name, len) == 0 && s->layers[i].name[len] == '.') {
            *index = i;
            return TD_OK;
        }
    char names[512];
    size_t at = 0;
    names[0] = 0;
    for (size_t i = 0; i < s->n && at + 1 < sizeof names; i++)
        at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", i ? ", " : "",
                               s->layers[i].name);
    return td__fail(TD_ENOTFOUND, "no layer '%s' (or '%s.*'); the layers are: %s", name, name,
                    names);
}

/* Builds layers [first, last) reading x, drawing from rng; each layer is a recompute segment
 * of its own name. */
static td_status build_run(const td_sequential *s, td_graph *g, size_t first, size_t last,
                           td_tensor *x, td_rng *rng, td_tensor **y) {
    td_tensor *t = x;
    for (size_t i = first; i < last; i++) {
        const seq_layer *l = &s->layers[i];
        td_status st = td_graph_segment_begin(g, l->name);
        if (st == TD_OK) st = l->fn(g, l->name, t, rng, l->arg, &t);
        if (st == TD_OK) st = td_graph_segment_end(g);
        if (st != TD_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", td_last_error());
            return td__fail(st, "layer %zu '%s': %s", i, l->name, msg);
        }
    }
    *y = t;
    return TD_OK;
}

/* Replays layers [0, upto) in a scratch graph on group `comm` (whose size a tensor-parallel
 * layer's shapes follow; nothing is communicated): leaves rng where layer `upto` starts drawing
 * and gives the shape it reads. */
static td_status replay(const td_sequential *s, size_t upto, int64_t batch, uint64_t seed,
                        td_comm *comm, td_rng *rng, td_shape *shape) {
    td_rng_init(rng, seed);
    td_shape in = s->sample;
    memmove(in.dim + 1, in.dim, (size_t)in.ndim * sizeof in.dim[0]);
    in.dim[0] = batch;
    in.ndim++;
    if (upto == 0) {
        *shape = in;
        return TD_OK;
    }
    td_graph_params gp = td_graph_default_params();
    gp.grad_enabled = 0;
    gp.arena_block_bytes = 4096; /* never compiled: the arena stays empty */
    gp.comm = comm;
    td_graph *g;
    TD__TRY(td_graph_create(&g, &gp));
    td_tensor *x, *y;
    td_status st = td_graph_input(g, "input", in, TD_F32, 0, &x);
    if (st == TD_OK) st = build_run(s, g, 0, upto, x, rng, &y);
    if (st == TD_OK) *shape = td_tensor_shape(y);
    td_graph_destroy(g);
    return st;
}

td_status td_sequential_shape_at(const td_sequential *s, size_t index, int64_t batch,
                                 td_shape *out) {
    return td_sequential_shape_on(s, index, batch, NULL, out);
}

td_status td_sequential_shape_on(const td_sequential *s, size_t index, int64_t batch, td_comm *comm,
                                 td_shape *out) {
    if (!s || !out) return td__fail(TD_EINVAL, "td_sequential_shape_at: NULL argument");
    if (index > s->n)
        return td__fail(TD_EINVAL, "td_sequential_shape_at: layer %zu of %zu", index, s->n);
    if (batch < 1)
        return td__fail(TD_EINVAL, "td_sequential_shape_at: batch %lld", (long long)batch);
    td_rng rng;
    return replay(s, index, batch, 0, comm, &rng, out);
}

td_status td_sequential_build(const td_sequential *s, td_graph *g, size_t first, size_t last,
                              td_tensor *x, uint64_t seed, td_tensor **y) {
    if (!s || !g || !x || !y) return td__fail(TD_EINVAL, "td_sequential_build: NULL argument");
    if (first >= last || last > s->n)
        return td__fail(TD_EINVAL, "td_sequential_build: layers [%zu, %zu) of a model of %zu",
                        first, last, s->n);
    td_shape want, got = td_tensor_shape(x);
    td_rng rng;
    TD__TRY(replay(s, first, got.ndim > 0 ? got.dim[0] : 1, seed, td_graph_comm(g), &rng, &want));
    if (!td_shape_equal(&want, &got)) {
        char a[96], b[96];
        td__dims_str(a, sizeof a, want.ndim, want.dim);
        td__dims_str(b, sizeof b, got.ndim, got.dim);
        return td__fail(TD_ESHAPE, "td_sequential_build: layer %zu '%s' reads %s, x is %s", first,
                        s->layers[first].name, a, b);
    }
    return build_run(s, g, first, last, x, &rng, y);
}

td_status td_model_build_sequential(td_graph *g, const td_sequential *s, int64_t batch,
                                    uint64_t seed, td_model *out) {
    if (!g || !s || !out) return td__fail(TD_EINVAL, "td_model_build_sequential: NULL argument");
    if (batch < 1)
        return td__fail(TD_EINVAL, "td_model_build: batch %lld (must be >= 1)", (long long)batch);
    if (s->n == 0) return td__fail(TD_EINVAL, "td_model_build_sequential: the model has no layers");
    memset(out, 0, sizeof *out);
    out->kind = s->kind;
    out->batch = batch;
    td_shape in;
    td_rng rng;
    TD__TRY(replay(s, 0, batch, seed, NULL, &rng, &in));
    TD__TRY(td_graph_input(g, "input", in, TD_F32, 0, &out->input));
    td_tensor *logits;
    TD__TRY(build_run(s, g, 0, s->n, out->input, &rng, &logits));
    td_shape ls = td_tensor_shape(logits);
    if (ls.ndim != 2)
        return td__fail(TD_ESHAPE,
                        "td_model_build_sequential: the last layer gives %d dims, "
                        "expected (rows, classes) logits",
                        ls.ndim);
    TD__TRY(td_graph_input(g, "labels", td_shape_1d(ls.dim[0]), TD_I64, 0, &out->labels));
    TD__TRY(td_sequential_loss(s, g, logits, out->labels, &out->loss, &out->output));
    return td_graph_compile(g);
}

td_status td_sequential_loss(const td_sequential *s, td_graph *g, td_tensor *logits,
                             td_tensor *labels, td_tensor **loss, td_tensor **output) {
    if (!s || !g || !loss) return td__fail(TD_EINVAL, "td_sequential_loss: NULL argument");
    /* one rank holds every column: the plain loss, unless the graph's tp shards sum the
     * vocabulary's shards in their tree */
    if (!s->split_logits || (td_graph_world_size(g) == 1 && !td_graph_tp_shards(g)))
        return td_graph_cross_entropy(g, logits, labels, TD_REDUCTION_MEAN, loss, output);
    if (output) *output = logits;
    return td_graph_vocab_parallel_cross_entropy(g, logits, labels, TD_REDUCTION_MEAN, loss);
}

void td__sequential_set_kind(td_sequential *s, td_model_kind kind) {
    if (s) s->kind = kind;
}

void td__sequential_set_split_logits(td_sequential *s) {
    if (s) s->split_logits = 1;
}
