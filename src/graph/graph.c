/* The graph itself: creation, leaves and nodes, the forward and backward sweeps, gradient
 * zeroing, the grad-ready and parameter-use hooks, and parameter sharing between graphs. Compiling
 * is in compile.c and fuse.c, the public op builders in build.c, the ops' math in src/ops; this
 * file walks op tables and never names an op. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/recorder.h"

#include "device/device_impl.h"
#include "graph/graph_impl.h"

td_graph_params td_graph_default_params(void) {
    td_graph_params p = {.grad_enabled = 1,
                         .seed = 0,
                         .arena_block_bytes = 0,
                         .conv_winograd = 1,
                         .amp = {.level = TD_AMP_O0, .dtype = TD_BF16, .emulate = 0},
                         .comm = NULL,
                         .sync_batch_norm = 0,
                         .device = {TD_DEVICE_CPU, 0},
                         .cuda_graphs = 1,
                         .allow_tf32 = 0,
                         .threads = 0,
                         .blocked_linear = 0,
                         .trace = NULL,
                         .recompute = TD_RECOMPUTE_NONE,
                         .recompute_segments = NULL,
                         .recompute_keep = NULL,
                         .tp_shards = 0};
    return p;
}

td_status td__graph_threads_enter(td_graph *g, const char *what, int *was) {
    *was = 0;
    if (g->opt.threads == 0 || !g->ctx.backend->set_threads) return TD_OK;
    return g->ctx.backend->set_threads(&g->ctx, g->opt.threads, was, what);
}

void td__graph_threads_leave(td_graph *g, int was) {
    int set;
    if (was && was != g->opt.threads)
        (void)g->ctx.backend->set_threads(&g->ctx, was, &set, "graph"); /* as enter could */
}

static void params_ready(td__op_ctx *ctx, const td__node *n, int weights_only);

/* Mixed precision on a device whose matmuls and convolutions have no kernels of their own in
 * the low dtype (a CPU without bf16 instructions, f16 on CPUs): casts around f32 kernels would
 * make every step slower than f32 alone, so O1 and O2 compute in f32 as O0 does, and O3, whose
 * point is the memory of low weights, keeps them and computes between casts. Said once, at
 * creation, through the log and td_graph_amp_fallback. amp.emulate asks for the casts. */
static void amp_check(td_graph *g) {
    td_amp_params *amp = &g->opt.amp;
    const td__backend *be = g->ctx.backend;
    if (amp->level == TD_AMP_O0 || amp->emulate || !be->fast_dtype ||
        be->fast_dtype(&g->ctx, amp->dtype))
        return;
    char device[32], info[128] = "";
    td_device_format(g->ctx.device, device, sizeof device);
    if (be->info) be->info(info, sizeof info);
    int o3 = amp->level == TD_AMP_O3;
    snprintf(g->amp_fallback, sizeof g->amp_fallback,
             "amp O%d %s: %s%s%s%s has no %s matmul or convolution kernels of its own; %s",
             (int)amp->level, td_dtype_name(amp->dtype), device, *info ? " (" : "", info,
             *info ? ")" : "", td_dtype_name(amp->dtype),
             o3 ? "O3 keeps its weights low and computes in f32 between casts"
                : "computing in f32, as O0 does, which is faster here (amp.emulate = 1 computes "
                  "in f32 between casts instead)");
    td__log(TD_LOG_WARN, "%s", g->amp_fallback);
    if (!o3) amp->level = TD_AMP_O0;
}

td_status td_graph_create(td_graph **out, const td_graph_params *params) {
    if (!out) return td__fail(TD_EINVAL, "td_graph_create: out is NULL");
    *out = NULL;
    td_graph *g = calloc(1, sizeof *g);
    if (!g) return td__fail(TD_ENOMEM, "td_graph_create: out of memory");
    g->opt = params ? *params : td_graph_default_params();
    if (g->opt.threads < 0) {
        int n = g->opt.threads;
        free(g);
        return td__fail(TD_EINVAL, "td_graph_create: threads = %d (0: the caller's, or >= 1)", n);
    }
    if ((unsigned)g->opt.amp.level > TD_AMP_O3 ||
        (g->opt.amp.dtype != TD_BF16 && g->opt.amp.dtype != TD_F16)) {
        td_amp_params a = g->opt.amp;
        free(g);
        return td__fail(TD_EINVAL,
                        "td_graph_create: amp level %d and dtype %s (levels O0 to O3, "
                        "dtypes bf16 or f16)",
                        (int)a.level, td_dtype_name(a.dtype));
    }
    int world = g->opt.comm ? td_comm_size(g->opt.comm) : 1, S = g->opt.tp_shards;
    if (S < 0 || (S > 0 && (S % world || (S / world & (S / world - 1)) || S / world > 64))) {
        free(g);
        return td__fail(TD_EINVAL,
                        "td_graph_create: tp_shards %d over a group of %d: each rank must hold "
                        "the same power of two of the shards (1, 2, 4, ... up to 64)",
                        S, world);
    }
    if (S > 0 && g->opt.amp.level != TD_AMP_O0) {
        int level = (int)g->opt.amp.level;
        free(g);
        return td__fail(TD_EUNSUPPORTED,
                        "td_graph_create: tp_shards %d with mixed precision O%d: deterministic "
                        "tensor parallelism computes and sums its shards in f32",
                        S, level);
    }
    td_rng_init(&g->rng, g->opt.seed);
    g->ctx.training = 1;
    g->ctx.conv_winograd = g->opt.conv_winograd;
    g->ctx.blocked_linear = g->opt.blocked_linear;
    g->ctx.rng = &g->rng;
    g->ctx.comm = g->opt.comm;
    g->ctx.params_ready = params_ready;
    g->ctx.device = g->opt.device;
    g->ctx.allow_tf32 = g->opt.allow_tf32;
    td_status s = td__backend_for(g->opt.device, "td_graph_create", &g->ctx.backend);
    if (s == TD_OK) s = g->ctx.backend->init(&g->ctx, "td_graph_create");
    if (s == TD_OK)
        s = td_arena_create(&g->ctx.arena,
                            g->opt.arena_block_bytes ? g->opt.arena_block_bytes : (size_t)8 << 20);
    if (s == TD_OK) s = td_arena_create(&g->ctx.records, 0);
    if (s == TD_OK) amp_check(g);
    int was;
    if (s == TD_OK) s = td__graph_threads_enter(g, "td_graph_create", &was); /* it can */
    if (s == TD_OK) td__graph_threads_leave(g, was);
    if (s == TD_OK) s = td__recompute_init(g);
    if (s != TD_OK) {
        td_graph_destroy(g);
        return s;
    }
    *out = g;
    return TD_OK;
}

td_status td_graph_backend_info(td_device device, char *buf, size_t cap) {
    if (!buf || !cap) return td__fail(TD_EINVAL, "td_graph_backend_info: no buffer");
    buf[0] = 0;
    const td__backend *be;
    TD__TRY(td__backend_for(device, "td_graph_backend_info", &be));
    if (be->info)
        be->info(buf, cap);
    else
        snprintf(buf, cap, "%s", be->name);
    return TD_OK;
}

const char *td_graph_amp_fallback(const td_graph *g) {
    return g && g->amp_fallback[0] ? g->amp_fallback : NULL;
}

void td_graph_destroy(td_graph *g) {
    if (!g) return;
    for (int i = 0; i < g->nnodes; i++) {
        td__node *n = g->nodes[i];
        const td__kernels *k = td__kernels_of(&g->ctx, n->op);
        if (k->destroy) k->destroy(n);
        free(n);
    }
    char *storage = g->storage;
    for (int i = 0; i < g->ntensors; i++) {
        td_tensor *t = g->tensors[i];
        char *own = t->own;
        /* Leaves still in host memory (a graph on a GPU moves them into storage). */
        if (t->kind != TD__ACT && (own < storage || own >= storage + g->storage_bytes)) free(own);
        free(t);
    }
    td__graph_records_free(g);
    td__recompute_free(g);
    free(g->dy_host);
    if (g->storage) g->ctx.backend->free(&g->ctx, g->storage);
    free(g->nodes);
    free(g->tensors);
    free(g->params);
    free(g->param_t);
    free(g->buffers);
    free(g->buffer_t);
    free(g->param_last_node);
    free(g->param_final_node);
    free(g->casts);
    free(g->fired);
    free(g->shard_summed);
    free(g->writers);
    free(g->used);
    td_arena_destroy(g->ctx.arena);
    td_arena_destroy(g->ctx.records);
    if (g->ctx.backend) g->ctx.backend->destroy(&g->ctx);
    free(g);
}

/* Grows *arr (elements of `size` bytes) to hold at least n + 1. */
static int grow(void **arr, int *cap, int n, size_t size) {
    if (n < *cap) return 1;
    int nc = *cap ? *cap * 2 : 16;
    void *p = realloc(*arr, (size_t)nc * size);
    if (!p) return 0;
    *arr = p;
    *cap = nc;
    return 1;
}

static td_status tensor_new(td_graph *g, const char *name, td_shape shape, td_dtype dtype,
                            td__tensor_kind kind, td_tensor **out) {
    if (!g || !out)
        return td__fail(TD_EINVAL, "graph: NULL argument creating tensor '%s'", name ? name : "?");
    if (g->compiled)
        return td__fail(TD_ESTATE, "graph: cannot add '%s' after td_graph_compile",
                        name ? name : "?");
    if (shape.ndim < 0 || shape.ndim > TD_MAX_DIMS)
        return td__fail(TD_ESHAPE, "graph: tensor '%s' has %d dims (0..%d allowed)",
                        name ? name : "?", shape.ndim, TD_MAX_DIMS);
    for (int i = 0; i < shape.ndim; i++)
        if (shape.dim[i] <= 0)
            return td__fail(TD_ESHAPE, "graph: tensor '%s' dim %d is %lld (must be > 0)",
                            name ? name : "?", i, (long long)shape.dim[i]);
    if (td_dtype_size(dtype) == 0)
        return td__fail(TD_EDTYPE, "graph: tensor '%s' has invalid dtype %d", name ? name : "?",
                        (int)dtype);
    if ((kind == TD__PARAM || kind == TD__BUFFER) && dtype != TD_F32)
        return td__fail(TD_EDTYPE, "graph: tensor '%s' must be f32, got %s", name ? name : "?",
                        td_dtype_name(dtype));
    if (!grow((void **)&g->tensors, &g->cap_tensors, g->ntensors, sizeof *g->tensors))
        return td__fail(TD_ENOMEM, "graph: out of memory adding '%s'", name ? name : "?");
    td_tensor *t = calloc(1, sizeof *t);
    if (!t) return td__fail(TD_ENOMEM, "graph: out of memory adding '%s'", name ? name : "?");
    t->g = g;
    t->id = g->ntensors;
    snprintf(t->name, sizeof t->name, "%s", name ? name : "");
    t->shape = shape;
    t->dtype = dtype;
    t->kind = kind;
    t->producer = -1;
    t->grad_zero = 1;
    t->bytes = (size_t)td_shape_numel(&shape) * td_dtype_size(dtype);
    td_status ds = g->ctx.backend->describe(&g->ctx, t);
    if (ds != TD_OK) {
        free(t);
        return ds;
    }
    if (kind != TD__ACT) {
        size_t alloc = (t->bytes + 63) & ~(size_t)63;
        t->own = aligned_alloc(64, alloc);
        if (!t->own) {
            td_status s =
                td__fail(TD_ENOMEM, "graph: out of memory for '%s' (%zu bytes)", t->name, t->bytes);
            free(t);
            return s;
        }
        memset(t->own, 0, alloc);
        t->data = t->own;
    }
    g->tensors[g->ntensors++] = t;
    *out = t;
    return TD_OK;
}

static int name_taken(td_graph *g, const char *name) {
    for (int i = 0; i < g->ntensors; i++)
        if (g->tensors[i]->kind != TD__ACT && strcmp(g->tensors[i]->name, name) == 0) return 1;
    return 0;
}

static td_status leaf(td_graph *g, const char *name, td_shape shape, td_dtype dtype,
                      td__tensor_kind kind, td_tensor **out) {
    if (!name || !*name) return td__fail(TD_EINVAL, "graph: a leaf tensor needs a name");
    if (strlen(name) >= sizeof((td_tensor *)0)->name)
        return td__fail(TD_EINVAL, "graph: name '%s' is longer than 63 characters", name);
    if (g && name_taken(g, name))
        return td__fail(TD_EINVAL, "graph: the name '%s' is already used", name);
    return tensor_new(g, name, shape, dtype, kind, out);
}

static void fill_param(td_param *p, td_tensor *t) {
    memset(p, 0, sizeof *p);
    p->name = t->name;
    p->data = t->data;
    p->grad = t->grad;
    p->count = (size_t)td_shape_numel(&t->shape);
    p->dtype = t->dtype;
    p->ndim = t->shape.ndim;
    p->device = t->g->opt.device;
    p->master_dtype = TD_F32;
    for (int i = 0; i < TD_MAX_DIMS; i++) p->shape[i] = i < t->shape.ndim ? t->shape.dim[i] : 0;
}

td_status td_graph_input(td_graph *g, const char *name, td_shape shape, td_dtype dtype,
                         int requires_grad, td_tensor **out) {
    if (requires_grad && !td__is_float(dtype))
        return td__fail(TD_EDTYPE, "td_graph_input: '%s' asks for a gradient but is %s",
                        name ? name : "?", td_dtype_name(dtype));
    TD__TRY(leaf(g, name, shape, dtype, TD__INPUT, out));
    (*out)->requires_grad = requires_grad && g->opt.grad_enabled;
    return TD_OK;
}

td_status td_graph_param(td_graph *g, const char *name, td_shape shape, td_tensor **out) {
    if (g) {
        int cap = g->cap_params;
        if (!grow((void **)&g->params, &g->cap_params, g->nparams, sizeof *g->params))
            return td__fail(TD_ENOMEM, "td_graph_param: out of memory for '%s'", name);
        if (cap != g->cap_params || !g->param_t) {
            td_tensor **pt = realloc(g->param_t, (size_t)g->cap_params * sizeof *pt);
            if (!pt) return td__fail(TD_ENOMEM, "td_graph_param: out of memory for '%s'", name);
            g->param_t = pt;
        }
    }
    TD__TRY(leaf(g, name, shape, TD_F32, TD__PARAM, out));
    td_tensor *t = *out;
    t->requires_grad = g->opt.grad_enabled;
    t->index = g->nparams;
    g->param_t[g->nparams] = t;
    fill_param(&g->params[g->nparams], t);
    g->nparams++;
    return TD_OK;
}

td_status td_graph_set_param_split(td_graph *g, td_tensor *param, const td_param_split *split) {
    if (!g || !param || !split)
        return td__fail(TD_EINVAL, "td_graph_set_param_split: NULL argument");
    int i = param->index;
    if (param->g != g || i < 0 || i >= g->nparams || g->param_t[i] != param)
        return td__fail(TD_EINVAL, "td_graph_set_param_split: '%s' is not a parameter of the graph",
                        param->name);
    const td_param_split *s = split;
    int parts = s->parts > 1 ? s->parts : 1;
    if (s->ranks < 0 ||
        (s->ranks > 0 && (s->rank < 0 || s->rank >= s->ranks || s->dim < 0 ||
                          s->dim >= param->shape.ndim || param->shape.dim[s->dim] % parts)))
        return td__fail(TD_EINVAL,
                        "td_graph_set_param_split: '%s' %d dims: slice %d of %d along dim %d in "
                        "%d blocks does not fit",
                        param->name, param->shape.ndim, s->rank, s->ranks, s->dim, parts);
    g->params[i].split = *s;
    return TD_OK;
}

td_status td_graph_buffer(td_graph *g, const char *name, td_shape shape, td_tensor **out) {
    if (g) {
        int cap = g->cap_buffers;
        if (!grow((void **)&g->buffers, &g->cap_buffers, g->nbuffers, sizeof *g->buffers))
            return td__fail(TD_ENOMEM, "td_graph_buffer: out of memory for '%s'", name);
        if (cap != g->cap_buffers || !g->buffer_t) {
            td_tensor **bt = realloc(g->buffer_t, (size_t)g->cap_buffers * sizeof *bt);
            if (!bt) return td__fail(TD_ENOMEM, "td_graph_buffer: out of memory for '%s'", name);
            g->buffer_t = bt;
        }
    }
    TD__TRY(leaf(g, name, shape, TD_F32, TD__BUFFER, out));
    td_tensor *t = *out;
    t->index = g->nbuffers;
    g->buffer_t[g->nbuffers] = t;
    fill_param(&g->buffers[g->nbuffers], t);
    g->nbuffers++;
    return TD_OK;
}

/* Checks that t belongs to g and may be an input of a new node. */
static td_status check_input(td_graph *g, const td_tensor *t, const char *what) {
    if (!t) return td__fail(TD_EINVAL, "%s: an input tensor is NULL", what);
    if (t->g != g)
        return td__fail(TD_EINVAL, "%s: tensor '%s' belongs to another graph", what, t->name);
    return TD_OK;
}

td_status td__graph_check_add(td_graph *g, const td__op *op, const char *what,
                              td_tensor *const *ins, int nin, td_tensor **out) {
    if (!g) return td__fail(TD_EINVAL, "%s: graph is NULL", what);
    if (!out) return td__fail(TD_EINVAL, "%s: the output pointer is NULL", what);
    if (g->compiled) return td__fail(TD_ESTATE, "%s: the graph is already compiled", what);
    if (nin < 1 || nin > TD__MAX_IN)
        return td__fail(TD_EINVAL, "%s: %d inputs (1 to %d)", what, nin, TD__MAX_IN);
    if (!td__kernels_of(&g->ctx, op)) {
        char dev[32];
        td_device_format(g->opt.device, dev, sizeof dev);
        return td__fail(TD_EUNSUPPORTED, "%s: no kernels for it on %s (the %s backend) yet", what,
                        dev, g->ctx.backend->name);
    }
    TD__TRY(check_input(g, ins[0], what));
    for (int i = 1; i < nin; i++)
        if (ins[i]) TD__TRY(check_input(g, ins[i], what));
    return TD_OK;
}

td_status td__graph_insert(td_graph *g, const td__op *op, const char *what, td_tensor *const *ins,
                           int nin, const td__op_attr *attr, int variant, td_tensor **out) {
    td__node probe = {.op = op, .what = what, .nin = nin, .variant = variant};
    if (attr) probe.attr = *attr;
    for (int i = 0; i < nin; i++) probe.in[i] = ins[i];
    td_shape shape;
    td_dtype dtype;
    TD__TRY(op->infer(&probe, &shape, &dtype));
    if (!grow((void **)&g->nodes, &g->cap_nodes, g->nnodes, sizeof *g->nodes))
        return td__fail(TD_ENOMEM, "%s: out of memory", what);
    char name[64];
    snprintf(name, sizeof name, "%s:%d", op->name, g->nnodes);
    td_tensor *y;
    TD__TRY(tensor_new(g, name, shape, dtype, TD__ACT, &y));
    td__node *n = malloc(sizeof *n);
    if (!n) return td__fail(TD_ENOMEM, "%s: out of memory", what);
    *n = probe;
    n->index = g->nnodes;
    for (int i = 0; i < nin; i++) {
        if (!ins[i]) continue;
        ins[i]->nconsumers++;
        if (ins[i]->requires_grad) y->requires_grad = 1;
    }
    y->producer = n->index;
    n->out = y;
    g->nodes[g->nnodes++] = n;
    *out = y;
    return TD_OK;
}

void td__graph_sync_storage(td_graph *g) {
    int moved = 0;
    for (int i = 0; i < g->nparams; i++) {
        td_tensor *t = g->param_t[i];
        if (g->params[i].data && g->params[i].data != t->data)
            t->data = g->params[i].data, moved = 1;
        if (g->params[i].grad && g->params[i].grad != t->grad)
            t->grad = g->params[i].grad, moved = 1;
    }
    for (int i = 0; i < g->nbuffers; i++) {
        td_tensor *t = g->buffer_t[i];
        if (g->buffers[i].data && g->buffers[i].data != t->data)
            t->data = g->buffers[i].data, moved = 1;
    }
    g->storage_gen += moved;
}

/* Tells the parameter-use hook that parameter i reaches `use`, then takes its storage from its
 * td_param entry again: the hook may have moved it. */
static td_status use_param(td_graph *g, int i, td_param_use use) {
    TD__TRY(g->use_hook((size_t)i, use, g->use_ctx));
    td_tensor *t = g->param_t[i];
    if (g->params[i].data) t->data = g->params[i].data;
    if (g->params[i].grad) t->grad = g->params[i].grad;
    return TD_OK;
}

/* Whether input i of n is a parameter that no earlier input of n is. */
static int first_param_input(const td__node *n, int i) {
    if (!n->in[i] || n->in[i]->kind != TD__PARAM) return 0;
    for (int j = 0; j < i; j++)
        if (n->in[j] == n->in[i]) return 0;
    return 1;
}

/* The hook for each parameter that node n reads and whose first or last reader n is. */
static td_status use_params_at(td_graph *g, const td__node *n, const int *reader,
                               td_param_use use) {
    for (int i = 0; i < n->nin; i++)
        if (first_param_input(n, i) && reader[n->in[i]->index] == n->index)
            TD__TRY(use_param(g, n->in[i]->index, use));
    return TD_OK;
}

static td_status forward_nodes(td_graph *g, const void *arg);

td_status td_graph_forward(td_graph *g) {
    if (!g) return td__fail(TD_EINVAL, "td_graph_forward: graph is NULL");
    if (!g->compiled) return td__fail(TD_ESTATE, "td_graph_forward: call td_graph_compile first");
    td__graph_sync_storage(g);
    for (int k = 0; k < g->nnodes; k++) {
        const td__kernels *kern = td__kernels_of(&g->ctx, g->nodes[k]->op);
        if (kern->check) TD__TRY(kern->check(&g->ctx, g->nodes[k]));
    }
    g->ctx.rng_sample_offset = 0;
    td__recompute_forward_begin(g);
    g->ctx.keep_weights = g->keep_weights;
    g->keep_weights = 0;
    if (g->opt.trace) (void)td_trace_name_thread(g->opt.trace, "compute");
    if (g->ctx.backend->begin) TD__TRY(g->ctx.backend->begin(&g->ctx));
    if (g->ctx.backend->forward_begin) TD__TRY(g->ctx.backend->forward_begin(&g->ctx));
    int was;
    TD__TRY(td__graph_threads_enter(g, "td_graph_forward", &was));
    td_status s = td__graph_sweep(g, NULL, forward_nodes, NULL);
    td__graph_threads_leave(g, was);
    return s;
}

/* A forward's nodes, with the parameter-use hook at each parameter's first and last reader. */
static td_status forward_nodes(td_graph *g, const void *arg) {
    (void)arg;
    td_param_use_fn hook = g->use_hook;
    td_trace *trace = g->opt.trace;
    for (int k = 0; k < g->nnodes; k++) {
        td__node *n = g->nodes[k];
        if (hook) TD__TRY(use_params_at(g, n, g->param_last_node, TD_PARAM_BEFORE_FORWARD));
        td__recompute_note(g, k);
        uint64_t t0 = trace ? td_time_ns() : 0;
        td_recorder_op(n->out->name, "forward");
        TD__TRY(td__kernels_of(&g->ctx, n->op)->forward(&g->ctx, n));
        if (trace) (void)td_trace_span(trace, n->out->name, "forward", t0, td_time_ns());
        if (hook) TD__TRY(use_params_at(g, n, g->param_final_node, TD_PARAM_AFTER_FORWARD));
    }
    td_recorder_op(NULL, NULL);
    for (int i = 0; hook && i < g->nparams; i++)
        if (g->param_final_node[i] < 0) TD__TRY(use_param(g, i, TD_PARAM_AFTER_FORWARD));
    return TD_OK;
}

/* Backward's point: before the first node that reads a parameter and runs backward (or runs
 * forward again first, recomputed). */
td_status td__graph_use_params_backward(td_graph *g, const td__node *n) {
    for (int i = 0; i < n->nin; i++)
        if (first_param_input(n, i) && !g->used[n->in[i]->index]) {
            g->used[n->in[i]->index] = 1;
            TD__TRY(use_param(g, n->in[i]->index, TD_PARAM_BEFORE_BACKWARD));
        }
    return TD_OK;
}

static void fire(td_graph *g, int i) {
    td_tensor *t = g->param_t[i];
    /* Zeroing is deferred to here for gradients that backward never wrote (see zero_grad). */
    if (t->grad_zero && t->grad && g->ctx.backend->zero(&g->ctx, t->grad, t->bytes) != TD_OK)
        g->zero_failed = 1;
    g->fired[i] = 1;
    if (g->hook) g->hook((size_t)i, g->hook_ctx);
}

/* Parameter i's gradient comes at a later shard of the step (td_graph_set_shard). */
static int held_back(const td_graph *g, int i) {
    return g->shard_summed[i] && g->ctx.shard_index + 1 < g->ctx.shard_count;
}

/* The ctx callback through which an op reports its weight gradients final (op.h). */
static void params_ready(td__op_ctx *ctx, const td__node *n, int weights_only) {
    td_graph *g = (td_graph *)ctx;
    for (int i = 0; i < n->nin; i++) {
        td_tensor *t = n->in[i];
        if (weights_only && t == n->in[0]) continue; /* its data gradient is still to come */
        if (t && t->kind == TD__PARAM && g->param_last_node[t->index] == n->index &&
            !g->fired[t->index] && !held_back(g, t->index))
            fire(g, t->index);
    }
}

void td_graph_keep_weights(td_graph *g) {
    if (g) g->keep_weights = 1;
}

td_status td_graph_set_shard(td_graph *g, size_t index, size_t count) {
    if (!g) return td__fail(TD_EINVAL, "td_graph_set_shard: graph is NULL");
    if (!g->compiled) return td__fail(TD_ESTATE, "td_graph_set_shard: call td_graph_compile first");
    if (count && index >= count)
        return td__fail(TD_EINVAL, "td_graph_set_shard: shard %zu of %zu; expected below %zu",
                        index, count, count);
    g->ctx.shard_index = index;
    g->ctx.shard_count = count;
    for (int i = 0; i < g->nparams; i++) {
        g->params[i].shard_sum = g->params[i].shard_sum_scaled = count && g->shard_summed[i];
        g->param_t[i]->sum_scale = g->params[i].shard_sum_scale;
    }
    return TD_OK;
}

/* What a backward sweep starts from: y and its upstream gradient, f32, where the device reads
 * it. */
typedef struct {
    td_tensor *y;
    const float *dy;
} backward_args;

static td_status backward_nodes(td_graph *g, const void *arg);

td_status td_graph_backward_from(td_graph *g, td_tensor *y, const float *dy) {
    if (!g || !y || !dy) return td__fail(TD_EINVAL, "td_graph_backward: NULL argument");
    if (!g->compiled) return td__fail(TD_ESTATE, "td_graph_backward: call td_graph_compile first");
    if (!g->opt.grad_enabled)
        return td__fail(TD_ESTATE,
                        "td_graph_backward: the graph was created with grad_enabled = 0");
    if (y->g != g)
        return td__fail(TD_EINVAL, "td_graph_backward: '%s' belongs to another graph", y->name);
    if (!y->requires_grad)
        return td__fail(
            TD_ESTATE,
            "td_graph_backward: '%s' depends on no parameter or input that takes a gradient",
            y->name);
    for (int k = 0; k < g->nnodes; k++)
        if (g->nodes[k]->out->alias_of == y)
            return td__fail(TD_EUNSUPPORTED,
                            "td_graph_backward: '%s' shares storage with the ReLU after it (fused "
                            "or in place); start from the ReLU's output",
                            y->name);
    td__graph_sync_storage(g);
    size_t numel = (size_t)td_shape_numel(&y->shape);
    if (g->ctx.backend->begin) TD__TRY(g->ctx.backend->begin(&g->ctx));
    if (g->opt.device.type != TD_DEVICE_CPU) {
        /* dy goes to the device ahead of the sweep (which may be a replay that reads it there),
         * from a pageable copy so that the caller may reuse its buffer at once; a dy already on
         * the graph's GPU is copied there. */
        if (numel * sizeof(float) > g->ctx.scratch_bytes)
            return td__fail(TD_EUNSUPPORTED,
                            "td_graph_backward: '%s' (%zu elements) is larger than the graph's "
                            "scratch for an f32 gradient",
                            y->name, numel);
        td_device at = td__device_of_pointer(dy);
        if (at.type == g->opt.device.type && at.index == g->opt.device.index) {
            TD__TRY(g->ctx.backend->copy(&g->ctx, g->ctx.scratch[1], dy, numel * sizeof *dy));
        } else {
            if (g->dy_host_count < numel) {
                float *h = realloc(g->dy_host, numel * sizeof *h);
                if (!h) return td__fail(TD_ENOMEM, "td_graph_backward: out of memory");
                g->dy_host = h;
                g->dy_host_count = numel;
            }
            memcpy(g->dy_host, dy, numel * sizeof *dy);
            TD__TRY(g->ctx.backend->upload_async(&g->ctx, g->ctx.scratch[1], g->dy_host,
                                                 numel * sizeof *dy));
        }
        dy = g->ctx.scratch[1];
    }
    backward_args a = {y, dy};
    int was;
    TD__TRY(td__graph_threads_enter(g, "td_graph_backward", &was));
    td_status s = td__graph_sweep(g, y, backward_nodes, &a);
    td__graph_threads_leave(g, was);
    return s;
}

static td_status backward_nodes(td_graph *g, const void *arg) {
    const backward_args *a = arg;
    td_tensor *y = a->y;
    const float *dy = a->dy;
    for (int i = 0; i < g->ntensors; i++)
        if (g->tensors[i]->kind == TD__ACT) g->tensors[i]->grad_zero = 1;
    void *d = td__grad_begin(&g->ctx, y, 0);
    size_t numel = (size_t)td_shape_numel(&y->shape);
    const td__backend *be = g->ctx.backend;
    if (y->blocked) /* f32 plain -> y's dtype and layout in one copy */
        TD__TRY(be->copy_plain(&g->ctx, y, dy, d, TD_F32, 0));
    else
        TD__TRY(be->convert(&g->ctx, d, y->dtype, dy, TD_F32, numel));
    td__grad_end(&g->ctx, y);
    g->zero_failed = 0;
    memset(g->fired, 0, (size_t)g->nparams);
    memset(g->used, 0, (size_t)g->nparams);
    g->rc.done = -1;
    td_trace *trace = g->opt.trace;
    for (int k = g->nnodes - 1; k >= 0; k--) {
        td__node *n = g->nodes[k];
        if (n->out->requires_grad && !n->out->grad_zero) {
            TD__TRY(td__recompute_before_backward(g, k));
            if (g->use_hook) TD__TRY(td__graph_use_params_backward(g, n));
            uint64_t t0 = trace ? td_time_ns() : 0;
            td_recorder_op(n->out->name, "backward");
            TD__TRY(td__kernels_of(&g->ctx, n->op)->backward(&g->ctx, n));
            if (trace) (void)td_trace_span(trace, n->out->name, "backward", t0, td_time_ns());
        }
        params_ready(&g->ctx, n, 0);
        if (g->use_hook) TD__TRY(use_params_at(g, n, g->param_last_node, TD_PARAM_AFTER_BACKWARD));
    }
    td_recorder_op(NULL, NULL);
    for (int i = 0; i < g->nparams; i++)
        if (!g->fired[i] && !held_back(g, i)) fire(g, i);
    for (int i = 0; g->use_hook && i < g->nparams; i++)
        if (g->param_last_node[i] < 0) TD__TRY(use_param(g, i, TD_PARAM_AFTER_BACKWARD));
    if (g->zero_failed)
        return td__fail(TD_EBACKEND, "td_graph_backward: zeroing a parameter gradient failed");
    for (int i = 0; i < g->ntensors; i++) {
        td_tensor *t = g->tensors[i];
        if (t->kind == TD__INPUT && t->grad && t->grad_zero)
            TD__TRY(be->zero(&g->ctx, t->grad, t->bytes));
    }
    return TD_OK;
}

td_status td_graph_backward(td_graph *g, td_tensor *loss) {
    if (!g || !loss) return td__fail(TD_EINVAL, "td_graph_backward: NULL argument");
    if (td_shape_numel(&loss->shape) != 1)
        return td__fail(TD_ESHAPE,
                        "td_graph_backward: '%s' has %lld elements, expected a scalar loss",
                        loss->name, (long long)td_shape_numel(&loss->shape));
    const float one = 1.0f;
    return td_graph_backward_from(g, loss, &one);
}

td_status td_graph_zero_grad(td_graph *g) {
    if (!g) return td__fail(TD_EINVAL, "td_graph_zero_grad: graph is NULL");
    if (!g->compiled) return TD_OK;
    td__graph_sync_storage(g);
    /* No memset: the next backward writes each gradient instead of adding to it, and zeroes
     * (as it hands them on) those it never reaches; one pass over the gradients saved. */
    for (int i = 0; i < g->ntensors; i++) {
        td_tensor *t = g->tensors[i];
        if (t->grad && t->kind != TD__ACT) t->grad_zero = 1;
    }
    return TD_OK;
}

void td_graph_set_training(td_graph *g, int training) {
    if (g) g->ctx.training = training != 0;
}

int td_graph_training(const td_graph *g) { return g ? g->ctx.training : 0; }

td_comm *td_graph_comm(const td_graph *g) { return g ? g->opt.comm : NULL; }

int td_graph_rank(const td_graph *g) { return g && g->opt.comm ? td_comm_rank(g->opt.comm) : 0; }

int td_graph_world_size(const td_graph *g) {
    return g && g->opt.comm ? td_comm_size(g->opt.comm) : 1;
}

int td_graph_tp_shards(const td_graph *g) { return g ? g->opt.tp_shards : 0; }

td_rng *td_graph_rng(td_graph *g) { return g ? &g->rng : NULL; }

td_status td_graph_set_rng_key(td_graph *g, uint64_t step, uint64_t first_sample) {
    if (!g) return td__fail(TD_EINVAL, "td_graph_set_rng_key: graph is NULL");
    /* The sub-stream holds the step in its upper and the sample in its lower 32 bits (dropout
     * checks first_sample + n). */
    if (step >> 32 || first_sample >> 32)
        return td__fail(
            TD_EINVAL,
            "td_graph_set_rng_key: step %llu, first sample %llu; both must be below 2^32",
            (unsigned long long)step, (unsigned long long)first_sample);
    g->ctx.rng_by_sample = 1;
    g->ctx.rng_step = step;
    g->ctx.rng_first_sample = first_sample;
    return TD_OK;
}

td_status td_graph_parameters(td_graph *g, td_param **params, size_t *n) {
    if (!g || !params || !n) return td__fail(TD_EINVAL, "td_graph_parameters: NULL argument");
    *params = g->params;
    *n = (size_t)g->nparams;
    return TD_OK;
}

td_status td_graph_buffers(td_graph *g, td_param **buffers, size_t *n) {
    if (!g || !buffers || !n) return td__fail(TD_EINVAL, "td_graph_buffers: NULL argument");
    *buffers = g->buffers;
    *n = (size_t)g->nbuffers;
    return TD_OK;
}

td_tensor *td_graph_param_tensor(td_graph *g, size_t index) {
    if (!g || index >= (size_t)g->nparams) return NULL;
    return g->param_t[index];
}

void td_graph_set_grad_ready_hook(td_graph *g, td_grad_ready_fn fn, void *ctx) {
    if (!g) return;
    g->hook = fn;
    g->hook_ctx = ctx;
}

void td_graph_set_param_use_hook(td_graph *g, td_param_use_fn fn, void *ctx) {
    if (!g) return;
    g->use_hook = fn;
    g->use_ctx = ctx;
}

static td_status share(td_tensor **dst, td_param *dp, td_tensor **src, int n, int nsrc,
                       const char *what) {
    if (n != nsrc)
        return td__fail(TD_EMISMATCH, "td_graph_share_params: %d %s in dst, %d in src", n, what,
                        nsrc);
    for (int i = 0; i < n; i++) {
        if (strcmp(dst[i]->name, src[i]->name) != 0 ||
            !td_shape_equal(&dst[i]->shape, &src[i]->shape) || dst[i]->dtype != src[i]->dtype)
            return td__fail(TD_EMISMATCH,
                            "td_graph_share_params: %s %d is '%s' %s in dst but '%s' %s in src (or "
                            "shapes differ)",
                            what, i, dst[i]->name, td_dtype_name(dst[i]->dtype), src[i]->name,
                            td_dtype_name(src[i]->dtype));
    }
    for (int i = 0; i < n; i++) {
        dst[i]->data = src[i]->data;
        dp[i].data = src[i]->data;
    }
    return TD_OK;
}

td_status td_graph_share_params(td_graph *dst, td_graph *src) {
    if (!dst || !src) return td__fail(TD_EINVAL, "td_graph_share_params: NULL graph");
    td__graph_sync_storage(src); /* where src's td_param entries say, if moved since its sweep */
    TD__TRY(
        share(dst->param_t, dst->params, src->param_t, dst->nparams, src->nparams, "parameters"));
    return share(dst->buffer_t, dst->buffers, src->buffer_t, dst->nbuffers, src->nbuffers,
                 "buffers");
}

size_t td_graph_memory_bytes(const td_graph *g) {
    return g ? g->storage_bytes + td_arena_peak(g->ctx.arena) : 0;
}
