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
 * dropout. It does not train and knows nothing of data or stages. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tandem/nn.h"

#include "core/core_impl.h"
#include "nn/nn_impl.h"

#define GPT_WTE "transformer.wte.weight"

td_gpt_params td_gpt_default_params(void) {
    td_gpt_params p = {.layers = 4, .heads = 4, .width = 128, .context = 128, .vocab = 256};
    return p;
}

/* A parameter "<prefix><what>" of shape s drawn N(0, std) (std 0: zeros; std < 0: ones). */
static td_status param(td_graph *g, const char *prefix, const char *what, td_shape s, float std,
                       td_rng *rng, td_tensor **out) {
    char name[64];
    if (snprintf(name, sizeof name, "%s%s", prefix, what) >= (int)sizeof name)
        return td__fail(TD_EINVAL, "gpt: parameter name '%s%s' is too long", prefix, what);
    TD__TRY(td_graph_param(g, name, s, out));
    float *d = td_tensor_data(*out);
    for (int64_t i = 0; i < td_tensor_numel(*out); i++)
        d[i] = std > 0.f ? std * td_rng_normal(rng) : std < 0.f ? 1.f : 0.f;
    return TD_OK;
}

/* nn.Linear(x's width, out) with GPT-2's initialisation (weight N(0, std), bias 0). */
static td_status linear(td_graph *g, const char *prefix, const char *what, td_tensor *x,
                        int64_t out, float std, td_rng *rng, td_tensor **y) {
    char name[64];
    snprintf(name, sizeof name, "%s.weight", what);
    td_tensor *w, *b;
    TD__TRY(param(g, prefix, name, td_shape_2d(out, td_tensor_shape(x).dim[1]), std, rng, &w));
    snprintf(name, sizeof name, "%s.bias", what);
    TD__TRY(param(g, prefix, name, td_shape_1d(out), 0.f, rng, &b));
    return td_graph_linear(g, x, w, b, y);
}

static td_status layer_norm(td_graph *g, const char *prefix, const char *what, td_tensor *x,
                            td_rng *rng, td_tensor **y) {
    char name[64];
    int64_t C = td_tensor_shape(x).dim[1];
    td_tensor *w, *b;
    snprintf(name, sizeof name, "%s.weight", what);
    TD__TRY(param(g, prefix, name, td_shape_1d(C), -1.f, rng, &w));
    snprintf(name, sizeof name, "%s.bias", what);
    TD__TRY(param(g, prefix, name, td_shape_1d(C), 0.f, rng, &b));
    return td_graph_layer_norm(g, x, w, b, 1e-5f, y);
}

/* Token ids (B, T) -> wte[ids] + wpe[t], (B, T, C). */
static td_status embed(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                       td_tensor **y) {
    (void)name;
    const td_gpt_params *p = arg;
    td_shape xs = td_tensor_shape(x);
    if (xs.ndim != 2 || xs.dim[1] != p->context)
        return td__fail(TD_ESHAPE, "gpt: the tokens must be (B, %lld), got %d dims",
                        (long long)p->context, xs.ndim);
    td_tensor *wte, *wpe, *t;
    TD__TRY(param(g, "", GPT_WTE, td_shape_2d(p->vocab, p->width), 0.02f, rng, &wte));
    TD__TRY(param(g, "", "transformer.wpe.weight", td_shape_2d(p->context, p->width), 0.02f, rng,
                  &wpe));
    TD__TRY(td_graph_embedding(g, x, wte, &t));
    return td_graph_position_embedding(g, t, wpe, y);
}

/* What a block layer is given: the model's shape and its own index. */
typedef struct {
    td_gpt_params p;
    int index;
} block_arg;

static td_status block(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                       td_tensor **y) {
    (void)name;
    const block_arg *a = arg;
    const td_gpt_params *p = &a->p;
    int64_t C = p->width;
    float std = 0.02f, proj_std = 0.02f / sqrtf(2.0f * (float)p->layers);
    char prefix[48];
    snprintf(prefix, sizeof prefix, "transformer.h.%d.", a->index);
    td_shape xs = td_tensor_shape(x);
    td_tensor *t, *r;
    TD__TRY(td_graph_reshape(g, x, td_shape_2d(xs.dim[0] * xs.dim[1], C), &x));
    TD__TRY(layer_norm(g, prefix, "ln_1", x, rng, &t));
    TD__TRY(linear(g, prefix, "attn.c_attn", t, 3 * C, std, rng, &t));
    TD__TRY(td_graph_causal_attention(g, t, p->heads, p->context, &t));
    TD__TRY(linear(g, prefix, "attn.c_proj", t, C, proj_std, rng, &t));
    TD__TRY(td_graph_add(g, x, t, &r));
    TD__TRY(layer_norm(g, prefix, "ln_2", r, rng, &t));
    TD__TRY(linear(g, prefix, "mlp.c_fc", t, 4 * C, std, rng, &t));
    TD__TRY(td_graph_gelu_tanh(g, t, &t));
    TD__TRY(linear(g, prefix, "mlp.c_proj", t, C, proj_std, rng, &t));
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
 * holds its own transformer.wte.weight, drawn as the embedding draws it; keeping the two equal
 * is the caller's (docs/gpt.md). */
static td_status head(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                      td_tensor **y) {
    (void)name;
    const td_gpt_params *p = arg;
    td_tensor *t, *wte = find_param(g, GPT_WTE);
    td_shape xs = td_tensor_shape(x);
    TD__TRY(td_graph_reshape(g, x, td_shape_2d(xs.dim[0] * xs.dim[1], p->width), &t));
    TD__TRY(layer_norm(g, "transformer.", "ln_f", t, rng, &t));
    if (!wte) {
        td_rng own;
        td_rng_init(&own, td_rng_u32(rng));
        TD__TRY(param(g, "", GPT_WTE, td_shape_2d(p->vocab, p->width), 0.02f, &own, &wte));
    }
    return td_graph_linear(g, t, wte, NULL, y);
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
    *out = s;
    return TD_OK;
}

int64_t td_gpt_parameter_count(const td_gpt_params *p) {
    int64_t C = p->width;
    int64_t block =
        2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C);
    return p->vocab * C + p->context * C + p->layers * block + 2 * C;
}
