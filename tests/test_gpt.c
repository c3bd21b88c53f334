/* The GPT against PyTorch, as llm.c's test_gpt2: a small GPT-2 made by
 * tests/fixtures/models/make_gpt_ref.py (torch 1.13, nanoGPT's module layout) loads its
 * state_dict by name into td_gpt_sequential's model and must give PyTorch's log-probabilities,
 * loss and every parameter's gradient (the tied embedding's the sum of both uses) within 1e-4 of
 * each tensor's scale, and the losses of ten AdamW steps on the batch and the loss after them.
 * Then the model's shape: the layer list and parameter count, the default TD_MODEL_GPT at its
 * initial loss ln(256), a cut between blocks building the same parameters as the whole model,
 * and configurations that cannot be built. */
#include <string.h>

#include "tandem/checkpoint.h"
#include "tandem/nn.h"
#include "tandem/optim.h"

#include "test.h"

#define REF "tests/fixtures/models/gpt_ref.safetensors"
#define RTOL 1e-4

/* |got - want| <= rtol * max|want| + atol over n values. */
static void check_close(const char *what, const float *got, const float *want, size_t n,
                        double rtol, double atol) {
    double scale = 0, worst = 0;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(want[i]));
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        if (d > worst) worst = d;
        if (!(d <= rtol * scale + atol) && bad++ == 0) first = i;
    }
    if (bad)
        TEST_FAIL_AT("%s: %zu of %zu differ, first [%zu] %.9g vs PyTorch %.9g (worst %.3g, scale "
                     "%.3g)",
                     what, bad, n, first, (double)got[first], (double)want[first], worst, scale);
}

/* Tensor `name` of the fixture as `count` elements of `dtype` in a new buffer (NULL: failed). */
static void *ref_read(td_checkpoint *ck, const char *name, td_dtype dtype, size_t count) {
    for (size_t i = 0; i < td_checkpoint_count(ck); i++) {
        td_param info;
        if (td_checkpoint_tensor(ck, i, &info) || strcmp(info.name, name)) continue;
        if (info.dtype != dtype || (count && info.count != count)) {
            TEST_FAIL_AT("%s: %zu elements of %s, expected %zu of %s", name, info.count,
                         td_dtype_name(info.dtype), count, td_dtype_name(dtype));
            return NULL;
        }
        void *buf = malloc(info.count * td_dtype_size(dtype));
        info.data = buf;
        CHECK_OK(td_checkpoint_read(ck, &info, 1));
        return buf;
    }
    TEST_FAIL_AT("%s: not in %s", name, REF);
    return NULL;
}

/* The fixture's model built here with its weights loaded; 0 when that failed. */
typedef struct {
    td_gpt_params p;
    int64_t B;
    td_sequential *s;
    td_graph *g;
    td_model m;
    td_param *params;
    size_t n;
} ref_model;

static int ref_model_load(td_checkpoint *ck, ref_model *r) {
    memset(r, 0, sizeof *r);
    int64_t *cfg = ref_read(ck, "config", TD_I64, 6);
    if (!cfg) return 0;
    r->p = (td_gpt_params){.layers = (int)cfg[0],
                           .heads = (int)cfg[1],
                           .width = cfg[2],
                           .context = cfg[3],
                           .vocab = cfg[4]};
    r->B = cfg[5];
    free(cfg);
    CHECK_OK(td_gpt_sequential(&r->p, &r->s));
    CHECK_OK(td_graph_create(&r->g, NULL));
    CHECK_OK(td_model_build_sequential(r->g, r->s, r->B, 1, &r->m));
    CHECK_EQ(r->m.kind, TD_MODEL_GPT);
    CHECK_OK(td_graph_parameters(r->g, &r->params, &r->n));
    td_param *state = calloc(r->n, sizeof *state);
    char(*names)[96] = calloc(r->n, sizeof *names);
    for (size_t i = 0; i < r->n; i++) {
        state[i] = r->params[i];
        snprintf(names[i], sizeof names[i], "state.%s", state[i].name);
        state[i].name = names[i];
    }
    td_status st = td_checkpoint_read(ck, state, r->n); /* by name: nanoGPT's names */
    CHECK_OK(st);
    free(state);
    free(names);
    size_t BT = (size_t)(r->B * r->p.context);
    int64_t *x = ref_read(ck, "x", TD_I64, BT), *y = ref_read(ck, "y", TD_I64, BT);
    if (x && y) {
        float *xf = td_tensor_data(r->m.input);
        for (size_t i = 0; i < BT; i++) xf[i] = (float)x[i]; /* token ids as f32 */
        CHECK_OK(td_tensor_write(r->m.labels, y));
    }
    free(x);
    free(y);
    return st == TD_OK && x && y;
}

static void ref_model_free(ref_model *r) {
    td_graph_destroy(r->g);
    td_sequential_destroy(r->s);
}

static void gpt_matches_pytorch(void) {
    td_checkpoint *ck;
    CHECK_OK(td_checkpoint_open(&ck, test_source_path(REF)));
    ref_model r;
    if (!ref_model_load(ck, &r)) {
        td_checkpoint_close(ck);
        return;
    }
    size_t BT = (size_t)(r.B * r.p.context), V = (size_t)r.p.vocab;
    CHECK_OK(td_graph_forward(r.g));
    CHECK_OK(td_graph_zero_grad(r.g));
    CHECK_OK(td_graph_backward(r.g, r.m.loss));
    /* PyTorch's logits as log-probabilities, which is what the model hands on */
    float *logits = ref_read(ck, "logits", TD_F32, BT * V), *logp = malloc(BT * V * 4);
    if (logits) {
        for (size_t i = 0; i < BT; i++) {
            double m = -INFINITY, s = 0;
            for (size_t j = 0; j < V; j++) m = fmax(m, logits[i * V + j]);
            for (size_t j = 0; j < V; j++) s += exp(logits[i * V + j] - m);
            for (size_t j = 0; j < V; j++) logits[i * V + j] -= (float)(m + log(s));
        }
        CHECK_OK(td_tensor_read(r.m.output, logp));
        check_close("log-probabilities", logp, logits, BT * V, RTOL, 0);
    }
    float *loss = ref_read(ck, "loss", TD_F32, 1), got;
    CHECK_OK(td_tensor_read(r.m.loss, &got));
    if (loss) CHECK_NEAR(got, loss[0], RTOL * loss[0]);
    size_t checked = 0;
    for (size_t i = 0; i < r.n; i++) {
        char name[96];
        snprintf(name, sizeof name, "grad.%s", r.params[i].name);
        float *want = ref_read(ck, name, TD_F32, r.params[i].count);
        if (want) check_close(name, r.params[i].grad, want, r.params[i].count, RTOL, 0);
        checked += want != NULL;
        free(want);
    }
    CHECK_EQ(checked, 4 + 12 * r.p.layers); /* lm_head is transformer.wte.weight */
    printf("    %zu parameters' gradients, loss %.6f (PyTorch %.6f)\n", checked, (double)got,
           loss ? (double)loss[0] : 0.0);
    free(logits);
    free(logp);
    free(loss);
    ref_model_free(&r);
    td_checkpoint_close(ck);
}

static void ten_adamw_steps_match_pytorch(void) {
    td_checkpoint *ck;
    CHECK_OK(td_checkpoint_open(&ck, test_source_path(REF)));
    ref_model r;
    float *hp = ref_read(ck, "adamw", TD_F32, 5), *losses = ref_read(ck, "losses", TD_F32, 10);
    float *after = ref_read(ck, "loss_after", TD_F32, 1);
    if (!hp || !losses || !after || !ref_model_load(ck, &r)) {
        free(hp), free(losses), free(after);
        td_checkpoint_close(ck);
        return;
    }
    td_adamw_params ap = {
        .lr = hp[0], .beta1 = hp[1], .beta2 = hp[2], .eps = hp[3], .weight_decay = hp[4]};
    ap.lr = 1e-2, ap.beta1 = 0.9, ap.beta2 = 0.95, ap.eps = 1e-8, ap.weight_decay = 0.1;
    CHECK_NEAR(hp[0], ap.lr, 1e-9); /* the doubles PyTorch used, not their f32 copies */
    td_optim *opt;
    CHECK_OK(td_optim_create_adamw(&opt, r.params, r.n, &ap));
    float got[10], end;
    for (int step = 0; step < 10; step++) {
        CHECK_OK(td_graph_forward(r.g));
        CHECK_OK(td_tensor_read(r.m.loss, &got[step]));
        CHECK_OK(td_graph_zero_grad(r.g));
        CHECK_OK(td_graph_backward(r.g, r.m.loss));
        CHECK_OK(td_optim_step(opt));
    }
    CHECK_OK(td_graph_forward(r.g));
    CHECK_OK(td_tensor_read(r.m.loss, &end));
    check_close("losses of ten AdamW steps", got, losses, 10, RTOL, 0);
    CHECK_NEAR(end, after[0], RTOL * after[0]);
    printf("    losses %.4f .. %.4f, after ten steps %.6f (PyTorch %.6f)\n", (double)got[0],
           (double)got[9], (double)end, (double)after[0]);
    td_optim_destroy(opt);
    free(hp), free(losses), free(after);
    ref_model_free(&r);
    td_checkpoint_close(ck);
}

static void default_gpt_layers_and_initial_loss(void) {
    td_gpt_params p = td_gpt_default_params();
    td_sequential *s;
    CHECK_OK(td_model_sequential(TD_MODEL_GPT, &s));
    CHECK_EQ(td_sequential_count(s), (size_t)p.layers + 2);
    CHECK(strcmp(td_sequential_layer_name(s, 0), "embed") == 0);
    CHECK(strcmp(td_sequential_layer_name(s, 2), "h.1") == 0);
    CHECK(strcmp(td_sequential_layer_name(s, (size_t)p.layers + 1), "head") == 0);
    td_shape sh;
    CHECK_OK(td_sequential_shape_at(s, 2, 3, &sh));
    CHECK(sh.ndim == 3 && sh.dim[0] == 3 && sh.dim[1] == p.context && sh.dim[2] == p.width);
    td_sequential_destroy(s);
    td_graph *g;
    td_model m;
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_model_build(g, TD_MODEL_GPT, 2, 5, &m));
    td_param *ps;
    size_t n;
    int64_t count = 0;
    CHECK_OK(td_graph_parameters(g, &ps, &n));
    for (size_t i = 0; i < n; i++) count += (int64_t)ps[i].count;
    CHECK_EQ(count, td_gpt_parameter_count(&p));
    CHECK_EQ(td_tensor_numel(m.labels), 2 * p.context);
    float *x = td_tensor_data(m.input);
    int64_t *lab = td_tensor_data(m.labels);
    for (int64_t i = 0; i < 2 * p.context; i++) x[i] = (float)((i * 37) % 256), lab[i] = i % 256;
    CHECK_OK(td_graph_forward(g));
    float loss = *(float *)td_tensor_data(m.loss);
    CHECK_NEAR(loss, log(256.0), 0.05); /* GPT-2's small init: nearly uniform at first */
    td_graph_destroy(g);
}

/* A stage from "h.1" on holds the parameters the whole model has from there; its head holds
 * its own copy of the token embedding. */
static void cut_between_blocks_builds_the_same_parameters(void) {
    td_gpt_params p = {.layers = 3, .heads = 2, .width = 16, .context = 8, .vocab = 32};
    td_sequential *s;
    CHECK_OK(td_gpt_sequential(&p, &s));
    td_graph *whole, *part;
    td_model m;
    CHECK_OK(td_graph_create(&whole, NULL));
    CHECK_OK(td_model_build_sequential(whole, s, 2, 9, &m));
    size_t first;
    CHECK_OK(td_sequential_find(s, "h.1", &first));
    CHECK_OK(td_graph_create(&part, NULL));
    td_tensor *x, *y;
    CHECK_OK(
        td_graph_input(part, "stage_input", td_shape_3d(2, p.context, p.width), TD_F32, 1, &x));
    CHECK_OK(td_sequential_build(s, part, first, td_sequential_count(s), x, 9, &y));
    td_param *a, *b;
    size_t na, nb, matched = 0;
    CHECK_OK(td_graph_parameters(whole, &a, &na));
    CHECK_OK(td_graph_parameters(part, &b, &nb));
    CHECK_EQ(nb, na - 2 - 12 + 1); /* no wpe, no h.0; its own wte */
    for (size_t j = 0; j < nb; j++)
        for (size_t i = 0; i < na; i++) {
            if (strcmp(a[i].name, b[j].name) || !strcmp(a[i].name, "transformer.wte.weight"))
                continue;
            CHECK(memcmp(a[i].data, b[j].data, a[i].count * sizeof(float)) == 0);
            matched++;
        }
    CHECK_EQ(matched, nb - 1);
    td_graph_destroy(whole);
    td_graph_destroy(part);
    td_sequential_destroy(s);
}

static void bad_configurations_are_errors(void) {
    td_sequential *s;
    td_gpt_params p = td_gpt_default_params();
    p.heads = 3; /* 128 does not divide into 3 */
    CHECK_STATUS(td_gpt_sequential(&p, &s), TD_EINVAL);
    CHECK(strstr(td_last_error(), "does not divide into 3 heads") != NULL);
    p = td_gpt_default_params();
    p.context = 0;
    CHECK_STATUS(td_gpt_sequential(&p, &s), TD_EINVAL);
    /* a batch of other length than the context */
    p = td_gpt_default_params();
    CHECK_OK(td_gpt_sequential(&p, &s));
    td_graph *g;
    td_tensor *x, *y;
    CHECK_OK(td_graph_create(&g, NULL));
    CHECK_OK(td_graph_input(g, "input", td_shape_2d(2, 64), TD_F32, 0, &x));
    CHECK_STATUS(td_sequential_build(s, g, 0, 1, x, 0, &y), TD_ESHAPE);
    td_graph_destroy(g);
    td_sequential_destroy(s);
}

int main(void) {
    RUN(gpt_matches_pytorch);
    RUN(ten_adamw_steps_match_pytorch);
    RUN(default_gpt_layers_and_initial_loss);
    RUN(cut_between_blocks_builds_the_same_parameters);
    RUN(bad_configurations_are_errors);
    TEST_END();
}
