/* Adding a node under mixed precision (graph.h's td_amp_params), the way every builder adds
 * one: before the node goes in, its float inputs are cast to the dtype the node computes in (the
 * op table's `precision`), or it computes in f32 between casts when its table says it cannot
 * compute in the low dtype on this machine; from level O2 on, parameters are stored in the low
 * dtype the first time a node takes them (batch norm's stay f32 at O2), with f32 master weights
 * in the optimizer at O2 and none at O3. Casts are made once per (tensor, dtype), so a weight
 * used twice is cast once per forward, and go in through graph.c's raw insert. Walks op tables;
 * names no op but the cast it inserts. */
#include <stdlib.h>
#include <string.h>

#include "graph/graph_impl.h"

/* A tensor already cast to dtype, or NULL. */
static td_tensor *cast_made(const td_graph *g, const td_tensor *x, td_dtype dtype) {
    for (int i = 0; i < g->ncasts; i++)
        if (g->casts[i].from == x && g->casts[i].dtype == dtype) return g->casts[i].to;
    return NULL;
}

/* x cast to dtype, made once per (x, dtype); x itself when it already has that dtype. The cast
 * goes in as it is: a cast node's input is never cast again. */
static td_status cast_memo(td_graph *g, td_tensor *x, td_dtype dtype, td_tensor **out) {
    if (x->dtype == dtype) {
        *out = x;
        return TD_OK;
    }
    if ((*out = cast_made(g, x, dtype))) return TD_OK;
    if (g->ncasts == g->cap_casts) {
        int cap = g->cap_casts ? 2 * g->cap_casts : 16;
        td__graph_cast_entry *c = realloc(g->casts, (size_t)cap * sizeof *c);
        if (!c) return td__fail(TD_ENOMEM, "autocast: out of memory");
        g->casts = c;
        g->cap_casts = cap;
    }
    TD__TRY(td__graph_insert(g, &td__op_cast, "cast", &x, 1, NULL, (int)dtype, out));
    g->casts[g->ncasts++] = (td__graph_cast_entry){x, dtype, *out};
    return TD_OK;
}

/* The dtype a node that follows its inputs computes in: theirs when they agree, f32 when
 * they mix (as PyTorch promotes). Inputs whose dtype the op fixes (batch norm's f32 weight)
 * do not count. */
static td_dtype follow(const td__node *probe) {
    td_dtype d = TD_DTYPE_COUNT;
    for (int i = 0; i < probe->nin; i++) {
        const td_tensor *x = probe->in[i];
        if (!x || !td__is_float(x->dtype)) continue;
        if (probe->op->input_dtype && probe->op->input_dtype(probe, i, TD_BF16) != TD_BF16)
            continue;
        if (d == TD_DTYPE_COUNT)
            d = x->dtype;
        else if (d != x->dtype)
            return TD_F32;
    }
    return d == TD_DTYPE_COUNT ? TD_F32 : d;
}

/* Stores parameter t in dtype (values converted): its td_param entry follows. At O3 the
 * entry asks optimizers to step it in that dtype, with no f32 master weights (apex's O3). */
static td_status param_to(td_graph *g, td_tensor *t, td_dtype dtype) {
    size_t n = (size_t)td_shape_numel(&t->shape), bytes = n * td_dtype_size(dtype);
    void *own = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!own) return td__fail(TD_ENOMEM, "autocast: out of memory for '%s'", t->name);
    td__convert(own, dtype, t->data, t->dtype, n);
    free(t->own);
    t->own = t->data = own;
    t->dtype = dtype;
    t->bytes = bytes;
    TD__TRY(g->ctx.backend->describe(&g->ctx, t));
    g->params[t->index].data = own;
    g->params[t->index].dtype = dtype;
    if (g->opt.amp.level == TD_AMP_O3) g->params[t->index].master_dtype = dtype;
    return TD_OK;
}

/* Casts the inputs of a node of `op` about to be added and stores parameters low from level O2
 * on; *back is the dtype the node's output must be cast to after it (it computes in f32 for a
 * dtype its op cannot), or TD_DTYPE_COUNT for none. */
static td_status autocast(td_graph *g, const td__op *op, const char *what, td_tensor **ins, int nin,
                          const td__op_attr *attr, int variant, td_dtype *back) {
    const td_amp_params *amp = &g->opt.amp;
    td_dtype low = amp->dtype;
    td__node probe = {.op = op, .what = what, .nin = nin, .variant = variant};
    if (attr) probe.attr = *attr;
    memcpy(probe.in, ins, (size_t)nin * sizeof *ins);
    td_dtype compute = op->precision == TD__PREC_F32                              ? TD_F32
                       : op->precision == TD__PREC_LOW && amp->level >= TD_AMP_O1 ? low
                                                                                  : follow(&probe);
    *back = TD_DTYPE_COUNT; /* no cast after the node */
    const td__kernels *k = td__kernels_of(&g->ctx, op);
    if (compute != TD_F32 && k->supports &&
        (amp->emulate || !k->supports(&probe, compute, &g->ctx))) {
        *back = compute; /* computes in f32, hands on the low dtype */
        compute = TD_F32;
    }
    for (int i = 0; i < nin; i++) {
        td_tensor *x = ins[i];
        if (!x || !td__is_float(x->dtype)) continue;
        td_dtype want = op->input_dtype ? op->input_dtype(&probe, i, compute) : compute;
        if (x->kind == TD__PARAM && x->dtype == TD_F32 && x->nconsumers == 0 &&
            amp->level >= TD_AMP_O2) {
            /* O2 stores a weight low when the node would take it low natively; O3 always. */
            td_dtype native = op->input_dtype ? op->input_dtype(&probe, i, low) : low;
            if (amp->level == TD_AMP_O3 || native == low) TD__TRY(param_to(g, x, low));
        }
        if (x->dtype != want) TD__TRY(cast_memo(g, x, want, &ins[i]));
    }
    return TD_OK;
}

td_status td__graph_add(td_graph *g, const td__op *op, const char *what, td_tensor *const *ins,
                        int nin, const td__op_attr *attr, int variant, td_tensor **out) {
    TD__TRY(td__graph_check_add(g, op, what, ins, nin, out));
    td_tensor *cast_ins[TD__MAX_IN];
    memcpy(cast_ins, ins, (size_t)nin * sizeof *ins);
    td_dtype back;
    TD__TRY(autocast(g, op, what, cast_ins, nin, attr, variant, &back));
    TD__TRY(td__graph_insert(g, op, what, cast_ins, nin, attr, variant, out));
    return back == TD_DTYPE_COUNT ? TD_OK : cast_memo(g, *out, back, out);
}
