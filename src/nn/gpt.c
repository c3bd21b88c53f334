/* GPT-2 (Radford et al. 2019) as nanoGPT and llm.c write it, as a td_sequential: "embed"
 * (token and learned position embeddings), one layer per transformer block "h.<i>" (pre-norm:
 * x + attn(ln_1(x)), then x + mlp(ln_2(x)), the MLP 4x wide with the tanh GELU), and "head"
 * (ln_f and the output projection tied to the token embedding). Activations between layers are
 * (B, T, C), so that a pipeline's micro-batches are whole sequences; inside a layer (B * T, C),
 * one row per position, as the linears take them. Parameter names are nanoGPT's
 * state_dict names ("transformer.h.0.attn.c_attn.weight", weights (out, in) as nn.Linear), so a
 * PyTorch GPT's weights load by name; the tied lm_head is transformer.wte.weight itself.
 * Initialisation is GPT-2's: weights and embeddings N(0, 0.02), the residual projections
 * (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 layers)), biases 0, layer norms 1 and 0; no
 * dropout. With tensor_parallel it is Megatron-LM's GPT over the graph's group: each block's
 * heads and MLP features and the vocabulary cut among the ranks between the region edges of
 * src/ops/tp_region.c, every slice drawn from the whole model's values (docs/parallelism.md).
 * It does not train and knows nothing of data or stages. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/nn.h"

#include "core/core_impl.h"
#include "nn/nn_impl.h"

#define GPT_WTE "transformer.wte.weight"

td_gpt_params td_gpt_default_params(void) {
    td_gpt_params p = {.layers = 4, .heads = 4, .width = 128, .context = 128, .vocab = 256};
    return p;
}

/* How a graph splits the model: over n ranks of its group (1: whole), this rank, whether the
 * activations between the regions are split along the tokens too (sequence parallelism), and
 * under deterministic tensor parallelism the graph's S fixed shards of every split dimension (L
 * of them on this rank; 0: none). */
typedef struct {
    int n, rank, sp, S, L;
} tp_split;

/* What must divide among the ranks (or the shards): heads, the vocabulary and (sequence
 * parallel) the context. */
static td_status check_split(const tp_split *tp, const td_gpt_params *p) {
    if (tp->S && (!p->tensor_parallel || p->heads % tp->S || p->vocab % tp->S))
        return td__fail(TD_EINVAL,
                        "gpt: the graph's %d tp shards need a tensor-parallel GPT (tensor_parallel "
                        "%d) whose %d heads and vocabulary of %lld divide into them",
                        tp->S, p->tensor_parallel, p->heads, (long long)p->vocab);
    if (p->heads % tp->n || p->vocab % tp->n)
        return td__fail(TD_EINVAL,
                        "gpt: %d heads and a vocabulary of %lld do not both split among %d "
                        "tensor-parallel ranks",
                        p->heads, (long long)p->vocab, tp->n);
    if (tp->sp && p->context % tp->n)
        return td__fail(TD_EINVAL,
                        "gpt: a context of %lld tokens does not split among %d sequence-parallel "
                        "ranks",
                        (long long)p->context, tp->n);
    return TD_OK;
}

static tp_split split_of(const td_graph *g, const td_gpt_params *p) {
    tp_split t = {1, 0, 0, 0, 0};
    if (p->tensor_parallel && td_graph_world_size(g) > 1) {
        t.n = td_graph_world_size(g);
        t.rank = td_graph_rank(g);
        t.sp = p->sequence_parallel != 0;
    }
    t.S = td_graph_tp_shards(g);
    t.L = t.S / t.n;
    return t;
}

/* "<prefix><what>" into name, or TD_EINVAL when it does not fit. */
static td_status param_name(char name[64], const char *prefix, const char *what) {
    if (snprintf(name, 64, "%s%s", prefix, what) >= 64)
        return td__fail(TD_EINVAL, "gpt: parameter name '%s%s' is too long", prefix, what);
    return TD_OK;
}

/* GPT-2's initialisation of n values: N(0, std) drawn in order (std 0: zeros; std < 0: ones). */
static void init(float *d, int64_t n, float std, td_rng *rng) {
    for (int64_t i = 0; i < n; i++)
        d[i] = std > 0.f ? std * td_rng_normal(rng) : std < 0.f ? 1.f : 0.f;
}

/* A parameter "<prefix><what>" of shape s, initialised by init(). */
static td_status param(td_graph *g, const char *prefix, const char *what, td_shape s, float std,
                       td_rng *rng, td_tensor **out) {
    char name[64];
    TD__TRY(param_name(name, prefix, what));
    TD__TRY(td_graph_param(g, name, s, out));
    init(td_tensor_data(*out), td_tensor_numel(*out), std, rng);
    return TD_OK;
}

/* This rank's slice of a parameter whose whole tensor has shape s: dimension `dim` holds `parts`
 * blocks, each cut tp->n ways (td_param_split). The whole tensor is drawn as param() draws it and
 * the slice kept, so that every layout starts from the whole model's values. */
static td_status param_slice(td_graph *g, const tp_split *tp, const char *prefix, const char *what,
                             td_shape s, int dim, int parts, float std, td_rng *rng,
                             td_tensor **out) {
    if (tp->n == 1) return param(g, prefix, what, s, std, rng, out);
    int64_t whole = td_shape_numel(&s), inner = 1, outer = 1, D = s.dim[dim];
    for (int i = 0; i < s.ndim; i++) {
        if (i < dim) outer *= s.dim[i];
        if (i > dim) inner *= s.dim[i];
    }
    if (D % ((int64_t)parts * tp->n))
        return td__fail(TD_EINVAL,
                        "gpt: '%s%s' has %lld along dimension %d: not %d blocks cut %d ways",
                        prefix, what, (long long)D, dim, parts, tp->n);
    int64_t piece = D / parts / tp->n; /* of each block, this rank's rows */
    td_shape mine = s;
    mine.dim[dim] = D / tp->n;
    char name[64];
    TD__TRY(param_name(name, prefix, what));
    TD__TRY(td_graph_param(g, name, mine, out));
    td_param_split sp = {.ranks = tp->n, .rank = tp->rank, .dim = dim, .parts = parts};
    TD__TRY(td_graph_set_param_split(g, *out, &sp));
    float *all = malloc((size_t)whole * sizeof *all), *d = td_tensor_data(*out);
    if (!all) return td__fail(TD_ENOMEM, "gpt: out of memory drawing '%s'", name);
    init(all, whole, std, rng);
    for (int64_t o = 0; o < outer; o++)
        for (int b = 0; b < parts; b++) {
            const float *from = all + (o * D + b * (D / parts) + tp->rank * piece) * inner;
            memcpy(d + (o * (D / tp->n) + b * piece) * inner, from,
                   (size_t)(piece * inner) * sizeof *d);
        }
    free(all);
    return TD_OK;
}

/* A whole parameter that only rank 0 of the split holds (a row-parallel layer's bias, added once
 * before the ranks' partial results are summed): the other ranks draw what it draws and keep
 * nothing (*out NULL). */
static td_status param_on_first(td_graph *g, const tp_split *tp, const char *prefix,
                                const char *what, td_shape s, float std, td_rng *rng,
                                td_tensor **out) {
    *out = NULL;
    if (tp->rank == 0) return param(g, prefix, what, s, std, rng, out);
    int64_t n = td_shape_numel(&s);
    float *skip = malloc((size_t)n * sizeof *skip);
    if (!skip) return td__fail(TD_ENOMEM, "gpt: out of memory drawing '%s%s'", prefix, what);
    init(skip, n, std, rng);
    free(skip);
    return TD_OK;
}

/* Where a region begins: every rank's whole input (sequence parallel: the ranks' rows gathered). */
static td_status region_in(td_graph *g, const tp_split *tp, td_tensor *x, td_tensor **y) {
    if (tp->n == 1) {
        *y = x;
        return TD_OK;
    }
    return tp->sp ? td_graph_all_gather(g, x, y) : td_graph_copy_to_tp_region(g, x, y);
}

/* Where a region ends: the ranks' partial results summed (sequence parallel: each rank keeps its
 * rows of the sum). */
static td_status region_out(td_graph *g, const tp_split *tp, td_tensor *x, td_tensor **y) {
    if (tp->n == 1) {
        *y = x;
        return TD_OK;
    }
    return tp->sp ? td_graph_reduce_scatter(g, x, y) : td_graph_reduce_from_tp_region(g, x, y);
}

/* nn.Linear(x's width, out) with GPT-2's initialisation (weight N(0, std), bias 0), or its
 * column-parallel slice: this rank's `out / n` outputs (of each of `parts` blocks), under tp
 * shards shard by shard (what the attention, the GELU and a row-parallel linear take). */
static td_status column_linear(td_graph *g, const tp_split *tp, const char *prefix,
                               const char *what, td_tensor *x, int64_t out, int parts, float std,
                               td_rng *rng, td_tensor **y) {
    char name[64];
    snprintf(name, sizeof name, "%s.weight", what);
    td_tensor *w, *b;
    TD__TRY(param_slice(g, tp, prefix, name, td_shape_2d(out, td_tensor_shape(x).dim[1]), 0, parts,
                        std, rng, &w));
    snprintf(name, sizeof name, "%s.bias", what);
    TD__TRY(param_slice(g, tp, prefix, name, td_shape_1d(out), 0, parts, 0.f, rng, &b));
    return td_graph_column_parallel_linear(g, x, w, b, parts, 1, y);
}

/* nn.Linear(in, out) whose input x holds this rank's in / n features (row-parallel): its slice of
 * the weight's columns, the bias on rank 0 only, and the partial products summed at the region's
 * end. */
static td_status row_linear(td_graph *g, const tp_split *tp, const char *prefix, const char *what,
                            td_tensor *x, int64_t out, float std, td_rng *rng, td_tensor **y) {
    char name[64];
    snprintf(name, sizeof name, "%s.weight", what);
    td_tensor *w, *b, *t;
    int64_t in = td_tensor_shape(x).dim[1] * (tp->S ? tp->S : tp->n); /* x: a shard's inputs */
    TD__TRY(param_slice(g, tp, prefix, name, td_shape_2d(out, in), 1, 1, std, rng, &w));
    snprintf(name, sizeof name, "%s.bias", what);
    TD__TRY(param_on_first(g, tp, prefix, name, td_shape_1d(out), 0.f, rng, &b));
    TD__TRY(td_graph_row_parallel_linear(g, x, w, b, &t));
    return region_out(g, tp, t, y);
}

/* nn.LayerNorm(x's width). Under sequence parallelism each rank normalises its own rows, so the
 * weight and bias enter through copy_to_tp_region, whose backward sums the ranks' gradients.
 * Under tp shards the tokens are S shards too (L on a rank under sequence parallelism), whose
 * gradients of the weight and bias go up the pairwise tree. */
static td_status layer_norm(td_graph *g, const tp_split *tp, const char *prefix, const char *what,
                            td_tensor *x, td_rng *rng, td_tensor **y) {
    char name[64];
    int64_t C = td_tensor_shape(x).dim[1];
    td_tensor *w, *b;
    snprintf(name, sizeof name, "%s.weight", what);
    TD__TRY(param(g, prefix, name, td_shape_1d(C), -1.f, rng, &w));
    snprintf(name, sizeof name, "%s.bias", what);
    TD__TRY(param(g, prefix, name, td_shape_1d(C), 0.f, rng, &b));
    if (tp->sp) {
        TD__TRY(td_graph_copy_to_tp_region(g, w, &w));
        TD__TRY(td_graph_copy_to_tp_region(g, b, &b));
    }
    if (!tp->S) return td_graph_layer_norm(g, x, w, b, 1e-5f, y);
    int shards = tp->sp ? tp->L : tp->S;
    if (td_tensor_shape(x).dim[0] % shards)
        return td__fail(TD_EINVAL, "gpt: %lld tokens do not split into %d tp shards",
                        (long long)td_tensor_shape(x).dim[0] * (tp->sp ? tp->n : 1), tp->S);
    return td_graph_layer_norm_shards(g, x, w, b, 1e-5f, shards, y);
}

/* Token ids (B, T) -> wte[ids] + wpe[t], (B, T, C); split, each rank looks up its rows of the
 * vocabulary, rank 0 adds the positions, and the sum over ranks is the whole embedding (under
 * sequence parallelism each rank keeps its B T / n rows of it, (B, T / n, C)). */
static td_status embed(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                       td_tensor **y) {
    (void)name;
    const td_gpt_params *p = arg;
    tp_split tp = split_of(g, p);
    TD__TRY(check_split(&tp, p));
    td_shape xs = td_tensor_shape(x);
    if (xs.ndim != 2 || xs.dim[1] != p->context)
        return td__fail(TD_ESHAPE, "gpt: the tokens must be (B, %lld), got %d dims",
                        (long long)p->context, xs.ndim);
    td_tensor *wte, *wpe, *t;
    TD__TRY(
        param_slice(g, &tp, "", GPT_WTE, td_shape_2d(p->vocab, p->width), 0, 1, 0.02f, rng, &wte));
    td_shape ps = td_shape_2d(p->context, p->width);
    if (tp.n == 1) {
        TD__TRY(param(g, "", "transformer.wpe.weight", ps, 0.02f, rng, &wpe));
        TD__TRY(td_graph_embedding(g, x, wte, &t));
        return td_graph_position_embedding(g, t, wpe, y);
    }
    TD__TRY(param_on_first(g, &tp, "", "transformer.wpe.weight", ps, 0.02f, rng, &wpe));
    TD__TRY(td_graph_vocab_parallel_embedding(g, x, wte, &t));
    if (wpe) TD__TRY(td_graph_position_embedding(g, t, wpe, &t));
    TD__TRY(td_graph_reshape(g, t, td_shape_2d(xs.dim[0] * xs.dim[1], p->width), &t));
    TD__TRY(region_out(g, &tp, t, &t));
    /* Under sequence parallelism the rank's B T / n consecutive tokens, shaped (B, T / n, C) so
     * that dimension 0 stays the batch, as a td_sequential's layers (and a pipeline's
     * micro-batches) take it. */
    int64_t T = tp.sp ? xs.dim[1] / tp.n : xs.dim[1];
    return td_graph_reshape(g, t, td_shape_3d(xs.dim[0], T, p->width), y);
}

/* What a block layer is given: the model's shape and its own index. */
typedef struct {
    td_gpt_params p;
    int index;
} block_arg;

/* x + attn(ln_1(x)), then + mlp(ln_2(x)). Split: the attention's heads and the MLP's hidden
 * features are cut among the ranks (c_attn and c_fc column-parallel, the two c_proj
 * row-parallel), one sum over the ranks ending each. */
static td_status block(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                       td_tensor **y) {
    (void)name;
    const block_arg *a = arg;
    const td_gpt_params *p = &a->p;
    tp_split tp = split_of(g, p);
    TD__TRY(check_split(&tp, p));
    int64_t C = p->width;
    float std = 0.02f, proj_std = 0.02f / sqrtf(2.0f * (float)p->layers);
    char prefix[48];
    snprintf(prefix, sizeof prefix, "transformer.h.%d.", a->index);
    td_shape xs = td_tensor_shape(x);
    td_tensor *t, *r;
    TD__TRY(td_graph_reshape(g, x, td_shape_2d(td_shape_numel(&xs) / C, C), &x));
    TD__TRY(layer_norm(g, &tp, prefix, "ln_1", x, rng, &t));
    TD__TRY(region_in(g, &tp, t, &t));
    TD__TRY(column_linear(g, &tp, prefix, "attn.c_attn", t, 3 * C, 3, std, rng, &t));
    /* each shard's heads, the shards' rows one after another under tp shards */
    TD__TRY(td_graph_causal_attention(g, t, p->heads / (tp.S ? tp.S : tp.n), p->context, &t));
    TD__TRY(row_linear(g, &tp, prefix, "attn.c_proj", t, C, proj_std, rng, &t));
    TD__TRY(td_graph_add(g, x, t, &r));
    TD__TRY(layer_norm(g, &tp, prefix, "ln_2", r, rng, &t));
    TD__TRY(region_in(g, &tp, t, &t));
    TD__TRY(column_linear(g, &tp, prefix, "mlp.c_fc", t, 4 * C, 1, std, rng, &t));
    TD__TRY(td_graph_gelu_tanh(g, t, &t));
    TD__TRY(row_linear(g, &tp, prefix, "mlp.c_proj", t, C, proj_std, rng, &t));
    TD__TRY(td_graph_add(g, r, t, &t));
    return td_graph_reshape(g, t, xs, y);
}

/* The graph's parameter called `name`, or NULL. */
static td_tensor *find_param(td_graph *g, const char *name) {
    td_param *ps;
    size_t n;
    if (td_graph_parameters(g, &ps, &n) != TD_OK) return NULL;
    for (size_t i = 0; i < n; i++)
        if (strcmp(ps[i].name, name) == 0) return td_graph_param_tensor(g, i);
    return NULL;
}

/* ln_f, then logits = x wte^T. A graph without the embedding layer (a pipeline's last stage)
 * holds its own transformer.wte.weight, drawn as the embedding draws it; a pipeline finds the
 * two copies by their name and keeps them equal (td_pipeline's tied parameters). Split, each
 * rank's logits are its rows of the vocabulary, (B T, V / n), which the vocabulary-parallel
 * cross-entropy takes (td_sequential_loss): no rank holds them all. */
static td_status head(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                      td_tensor **y) {
    (void)name;
    const td_gpt_params *p = arg;
    tp_split tp = split_of(g, p);
    td_tensor *t, *wte = find_param(g, GPT_WTE);
    td_shape xs = td_tensor_shape(x);
    TD__TRY(td_graph_reshape(g, x, td_shape_2d(td_shape_numel(&xs) / p->width, p->width), &t));
    TD__TRY(layer_norm(g, &tp, "transformer.", "ln_f", t, rng, &t));
    if (!wte) {
        td_rng own;
        td_rng_init(&own, td_rng_u32(rng));
        TD__TRY(param_slice(g, &tp, "", GPT_WTE, td_shape_2d(p->vocab, p->width), 0, 1, 0.02f, &own,
                            &wte));
    }
    TD__TRY(region_in(g, &tp, t, &t));
    return td_graph_column_parallel_linear(g, t, wte, NULL, 1, 0, y);
}

static td_status check(const td_gpt_params *p) {
    if (p->layers < 1 || p->heads < 1 || p->width < 1 || p->context < 1 || p->vocab < 1)
        return td__fail(TD_EINVAL,
                        "gpt: layers %d, heads %d, width %lld, context %lld, vocab %lld (each "
                        "must be >= 1)",
                        p->layers, p->heads, (long long)p->width, (long long)p->context,
                        (long long)p->vocab);
    if (p->width % p->heads)
        return td__fail(TD_EINVAL, "gpt: width %lld does not divide into %d heads",
                        (long long)p->width, p->heads);
    if (p->layers > 1000) return td__fail(TD_EINVAL, "gpt: %d layers (at most 1000)", p->layers);
    if (p->sequence_parallel && !p->tensor_parallel)
        return td__fail(TD_EINVAL, "gpt: sequence parallelism splits the tensor-parallel regions' "
                                   "edges; set tensor_parallel too");
    return TD_OK;
}

td_status td_gpt_sequential(const td_gpt_params *p, td_sequential **out) {
    if (!p || !out) return td__fail(TD_EINVAL, "td_gpt_sequential: NULL argument");
    *out = NULL;
    TD__TRY(check(p));
    td_sequential *s;
    TD__TRY(td_sequential_create(&s, td_shape_1d(p->context)));
    td_status st = td_sequential_add(s, "embed", embed, p, sizeof *p);
    for (int i = 0; st == TD_OK && i < p->layers; i++) {
        block_arg a = {*p, i};
        char name[16];
        snprintf(name, sizeof name, "h.%d", i);
        st = td_sequential_add(s, name, block, &a, sizeof a);
    }
    if (st == TD_OK) st = td_sequential_add(s, "head", head, p, sizeof *p);
    if (st != TD_OK) {
        td_sequential_destroy(s);
        return st;
    }
    td__sequential_set_kind(s, TD_MODEL_GPT);
    if (p->tensor_parallel) td__sequential_set_split_logits(s);
    *out = s;
    return TD_OK;
}

int64_t td_gpt_parameter_count(const td_gpt_params *p) {
    int64_t C = p->width;
    int64_t block =
        2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C);
    return p->vocab * C + p->context * C + p->layers * block + 2 * C;
}
