/* Activation recompute (torch.utils.checkpoint; torchtitan's full and selective modes): a
 * segment of the node list (td_graph_segment_begin .. td_graph_segment_end; td_sequential marks
 * each layer) keeps in forward only the activations it must, and backward runs its other nodes
 * forward again just before the first of its nodes runs backward. The activations it drops, and
 * their gradients, take a part of one region that every segment shares: forward is done with a
 * segment's dropped activations once the next segment starts, and backward finishes a segment
 * before it reaches the one before, so the region holds one segment at a time and the graph's
 * storage shrinks by all the others.
 *
 * Kept (never dropped): leaves, and the activations of nodes outside recomputing segments; an
 * activation read by a node outside its segment, or by none (an output); the output of a node
 * that reads a buffer (batch norm updates its running statistics in forward, which must not
 * happen twice); in selective mode the outputs of the op kinds recompute_keep names; and any
 * tensor that shares storage with a kept one (a ReLU run in place).
 *
 * Running a node forward again replays the last forward: its training mode, its dropout key
 * and, before each node, the RNG offsets that node started from, so dropout draws the masks it
 * drew. (On a GPU the dropout kernels read the forward's key from device memory and take their
 * offsets as launch arguments counted from the forward's start, so a recorded backward replays
 * the masks of each step's own forward.) A collective op runs its collective again; every rank
 * runs the same graph, so every rank does so at the same point of its backward, in node order.
 * Walks op tables and node words; names no op. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/graph_impl.h"

#define SEGMENT_NAME_MAX 48

/* The op kinds a selective segment keeps when recompute_keep is NULL (and collective ops). */
#define DEFAULT_KEEP "linear,conv2d,attention"

static td_status copy_spec(const char *from, char **to) {
    *to = NULL;
    if (!from) return TD_OK;
    *to = malloc(strlen(from) + 1);
    if (!*to) return td__fail(TD_ENOMEM, "td_graph_create: out of memory");
    strcpy(*to, from);
    return TD_OK;
}

td_status td__recompute_init(td_graph *g) {
    td__recompute *rc = &g->rc;
    rc->open = rc->done = -1;
    if ((unsigned)g->opt.recompute > TD_RECOMPUTE_SELECTIVE)
        return td__fail(TD_EINVAL,
                        "td_graph_create: recompute = %d (TD_RECOMPUTE_NONE, FULL or SELECTIVE)",
                        (int)g->opt.recompute);
    TD__TRY(copy_spec(g->opt.recompute_segments, &rc->segments_spec));
    TD__TRY(copy_spec(g->opt.recompute_keep, &rc->keep_spec));
    g->opt.recompute_segments = rc->segments_spec;
    g->opt.recompute_keep = rc->keep_spec;
    return TD_OK;
}

void td__recompute_free(td_graph *g) {
    td__recompute *rc = &g->rc;
    free(rc->segments);
    free(rc->segments_spec);
    free(rc->keep_spec);
    free(rc->segment_of);
    free(rc->rerun);
    free(rc->drop);
    free(rc->cursor);
    free(rc->rng_at);
    free(rc->sample_at);
}

td_status td_graph_segment_begin(td_graph *g, const char *name) {
    if (!g || !name) return td__fail(TD_EINVAL, "td_graph_segment_begin: NULL argument");
    td__recompute *rc = &g->rc;
    if (g->compiled)
        return td__fail(TD_ESTATE, "td_graph_segment_begin: segment '%s' after td_graph_compile",
                        name);
    if (!*name || strlen(name) >= SEGMENT_NAME_MAX || strchr(name, ','))
        return td__fail(TD_EINVAL,
                        "td_graph_segment_begin: segment name '%s' is empty, over %d characters "
                        "or holds a comma (recompute_segments separates names with commas)",
                        name, SEGMENT_NAME_MAX - 1);
    if (rc->open >= 0)
        return td__fail(TD_ESTATE,
                        "td_graph_segment_begin: segment '%s' begins inside segment '%s' "
                        "(segments do not nest: end it first)",
                        name, rc->segments[rc->open].name);
    if (rc->nsegments == rc->cap_segments) {
        int cap = rc->cap_segments ? 2 * rc->cap_segments : 16;
        td__segment *s = realloc(rc->segments, (size_t)cap * sizeof *s);
        if (!s) return td__fail(TD_ENOMEM, "td_graph_segment_begin: out of memory");
        rc->segments = s;
        rc->cap_segments = cap;
    }
    td__segment *s = &rc->segments[rc->nsegments];
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "%s", name);
    s->first = g->nnodes;
    s->last = g->nnodes - 1;
    rc->open = rc->nsegments++;
    return TD_OK;
}

td_status td_graph_segment_end(td_graph *g) {
    if (!g) return td__fail(TD_EINVAL, "td_graph_segment_end: graph is NULL");
    td__recompute *rc = &g->rc;
    if (rc->open < 0)
        return td__fail(TD_ESTATE, "td_graph_segment_end: no segment is open (td_graph_segment_begin)");
    rc->segments[rc->open].last = g->nnodes - 1;
    rc->open = -1;
    return TD_OK;
}

/* The next comma-separated word of *p (spaces around it left out) into word (cap bytes; a
 * longer word is cut); 0 at the end of the list. */
static int next_word(const char **p, char *word, size_t cap) {
    if (!**p) return 0;
    const char *end = strchr(*p, ',');
    size_t len = end ? (size_t)(end - *p) : strlen(*p);
    const char *w = *p;
    *p = end ? end + 1 : *p + len;
    while (len && *w == ' ') w++, len--;
    while (len && w[len - 1] == ' ') len--;
    if (len >= cap) len = cap - 1;
    memcpy(word, w, len);
    word[len] = 0;
    return 1;
}

/* A segment's name is `word`, or starts with "<word>." (the rule of td_sequential_find). */
static int names_segment(const char *word, const char *name) {
    size_t len = strlen(word);
    return strncmp(name, word, len) == 0 && (name[len] == 0 || name[len] == '.');
}

/* Whether `word` is among the comma-separated words of list. */
static int listed(const char *list, const char *word) {
    char w[64];
    while (next_word(&list, w, sizeof w))
        if (strcmp(w, word) == 0) return 1;
    return 0;
}

/* "a, b, c" of what `item(i)` gives for i in [0, n), each once, into buf. */
static const char *list_of(char *buf, size_t cap, int n, const char *(*item)(const td_graph *, int),
                          const td_graph *g) {
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < n && at + 1 < cap; i++) {
        const char *s = item(g, i);
        int seen = 0;
        for (int j = 0; j < i && !seen; j++) seen = strcmp(item(g, j), s) == 0;
        if (!seen) at += (size_t)snprintf(buf + at, cap - at, "%s%s", at ? ", " : "", s);
    }
    return buf;
}

static const char *segment_name(const td_graph *g, int i) { return g->rc.segments[i].name; }
static const char *node_word(const td_graph *g, int i) { return g->nodes[i]->what; }

/* Marks the segments recompute_segments selects; a name that selects none is an error. */
static td_status select_segments(td_graph *g) {
    td__recompute *rc = &g->rc;
    const char *spec = rc->segments_spec;
    char word[SEGMENT_NAME_MAX + 16], names[512];
    for (int i = 0; i < rc->nsegments; i++) rc->segments[i].selected = spec == NULL;
    if (!spec) return TD_OK;
    if (!*spec)
        return td__fail(TD_EINVAL, "td_graph_compile: recompute_segments is empty (NULL: all)");
    while (next_word(&spec, word, sizeof word)) {
        int found = 0;
        if (!*word)
            return td__fail(TD_EINVAL, "td_graph_compile: recompute_segments '%s' has an empty name",
                            rc->segments_spec);
        for (int i = 0; i < rc->nsegments; i++)
            if (names_segment(word, rc->segments[i].name)) rc->segments[i].selected = found = 1;
        if (!found)
            return td__fail(TD_ENOTFOUND,
                            "td_graph_compile: recompute_segments names '%s', which is no segment "
                            "(or '%s.*'); the segments are: %s",
                            word, word, list_of(names, sizeof names, rc->nsegments, segment_name, g));
    }
    return TD_OK;
}

/* Checks that every word of recompute_keep is some node's. */
static td_status check_keep(td_graph *g) {
    const char *spec = g->rc.keep_spec;
    char word[64], words[512];
    while (spec && next_word(&spec, word, sizeof word)) {
        int found = 0;
        for (int k = 0; k < g->nnodes && !found; k++) found = strcmp(g->nodes[k]->what, word) == 0;
        if (!found)
            return td__fail(TD_ENOTFOUND,
                            "td_graph_compile: recompute_keep names '%s', which no node of this "
                            "graph is; its ops are: %s",
                            word, list_of(words, sizeof words, g->nnodes, node_word, g));
    }
    return TD_OK;
}

/* Whether node n's output stays from forward to backward whatever its consumers. */
static int always_kept(const td_graph *g, const td__node *n) {
    for (int i = 0; i < n->nin; i++)
        if (n->in[i] && n->in[i]->kind == TD__BUFFER) return 1; /* it must not run twice */
    if (g->opt.recompute != TD_RECOMPUTE_SELECTIVE) return 0;
    if (!g->rc.keep_spec) return n->op->collective || listed(DEFAULT_KEEP, n->what);
    return listed(g->rc.keep_spec, n->what);
}

td_status td__recompute_plan(td_graph *g) {
    td__recompute *rc = &g->rc;
    if (rc->open >= 0)
        return td__fail(TD_ESTATE,
                        "td_graph_compile: segment '%s' was begun and never ended "
                        "(td_graph_segment_end)",
                        rc->segments[rc->open].name);
    if (g->opt.recompute == TD_RECOMPUTE_NONE || !g->opt.grad_enabled) return TD_OK;
    if (rc->nsegments == 0)
        return td__fail(TD_EINVAL,
                        "td_graph_compile: recompute is on but no segment is marked "
                        "(td_graph_segment_begin; a td_sequential marks each layer)");
    TD__TRY(select_segments(g));
    if (g->opt.recompute == TD_RECOMPUTE_SELECTIVE) TD__TRY(check_keep(g));
    size_t nn = (size_t)(g->nnodes ? g->nnodes : 1), nt = (size_t)(g->ntensors ? g->ntensors : 1);
    rc->segment_of = malloc(nn * sizeof *rc->segment_of);
    rc->rerun = calloc(nn, 1);
    rc->drop = calloc(nt, 1);
    rc->cursor = calloc((size_t)rc->nsegments, sizeof *rc->cursor);
    rc->rng_at = calloc(nn, sizeof *rc->rng_at);
    rc->sample_at = calloc(nn, sizeof *rc->sample_at);
    if (!rc->segment_of || !rc->rerun || !rc->drop || !rc->cursor || !rc->rng_at || !rc->sample_at)
        return td__fail(TD_ENOMEM, "td_graph_compile: out of memory planning recompute");
    for (int k = 0; k < g->nnodes; k++) rc->segment_of[k] = -1;
    for (int s = 0; s < rc->nsegments; s++) {
        const td__segment *seg = &rc->segments[s];
        for (int k = seg->first; seg->selected && k <= seg->last; k++) rc->segment_of[k] = s;
    }
    /* Dropped: an activation whose node is in a recomputing segment, read there and only there. */
    for (int k = 0; k < g->nnodes; k++) {
        const td__node *n = g->nodes[k];
        if (rc->segment_of[k] >= 0 && n->out->nconsumers > 0 && !always_kept(g, n))
            rc->drop[n->out->id] = 1;
    }
    for (int k = 0; k < g->nnodes; k++) {
        const td__node *n = g->nodes[k];
        for (int i = 0; i < n->nin; i++) {
            const td_tensor *t = n->in[i];
            if (t && t->producer >= 0 && rc->segment_of[t->producer] != rc->segment_of[k])
                rc->drop[t->id] = 0;
        }
    }
    /* Tensors that share storage are dropped together or kept together: a kept one keeps what
     * it aliases (down a chain, as tensors come after what they alias), then every alias
     * follows the tensor whose storage it takes. */
    for (int i = g->ntensors - 1; i >= 0; i--) {
        const td_tensor *t = g->tensors[i];
        if (t->alias_of && !rc->drop[t->id]) rc->drop[t->alias_of->id] = 0;
    }
    for (int i = 0; i < g->ntensors; i++) {
        const td_tensor *t = g->tensors[i];
        if (t->alias_of) rc->drop[t->id] = rc->drop[t->alias_of->id];
    }
    for (int k = 0; k < g->nnodes; k++) rc->rerun[k] = rc->drop[g->nodes[k]->out->id];
    return TD_OK;
}

int td__recompute_place(td_graph *g, td__storage_plan *p, const td_tensor *t) {
    td__recompute *rc = &g->rc;
    if (!rc->drop || !rc->drop[t->id] || t->alias_of) return 0;
    size_t *at = &rc->cursor[rc->segment_of[t->producer]];
    size_t bytes = (t->bytes + 63) & ~(size_t)63; /* as td__storage_place aligns */
    p->data[t->id] = *at;
    *at += bytes;
    if (t->requires_grad) {
        p->grad[t->id] = *at;
        *at += bytes;
    }
    if (*at > rc->region) rc->region = *at;
    return 1;
}

void td__recompute_rebase(td_graph *g, td__storage_plan *p) {
    td__recompute *rc = &g->rc;
    if (!rc->drop) return;
    size_t base = td__storage_place(p, rc->region);
    for (int i = 0; i < g->ntensors; i++) {
        if (!rc->drop[i]) continue;
        p->data[i] += base;
        if (p->grad[i] != SIZE_MAX) p->grad[i] += base;
    }
}

void td__recompute_forward_begin(td_graph *g) {
    td__recompute *rc = &g->rc;
    if (!rc->segment_of) return;
    rc->rng = *g->ctx.rng;
    rc->training = g->ctx.training;
    rc->by_sample = g->ctx.rng_by_sample;
    rc->step = g->ctx.rng_step;
    rc->first_sample = g->ctx.rng_first_sample;
}

void td__recompute_note(td_graph *g, int k) {
    td__recompute *rc = &g->rc;
    if (!rc->segment_of || !rc->rerun[k]) return;
    rc->rng_at[k] = g->ctx.rng->offset - rc->rng.offset;
    rc->sample_at[k] = g->ctx.rng_sample_offset;
}

td_status td__recompute_before_backward(td_graph *g, int k) {
    td__recompute *rc = &g->rc;
    if (!rc->segment_of || rc->segment_of[k] < 0 || rc->segment_of[k] == rc->done) return TD_OK;
    int s = rc->segment_of[k], first = rc->segments[s].first;
    rc->done = s;
    /* In the order backward would have announced them: the hook may wait on earlier units. */
    for (int j = k; g->use_hook && j >= first; j--)
        if (rc->rerun[j]) TD__TRY(td__graph_use_params_backward(g, g->nodes[j]));
    td__op_ctx *c = &g->ctx, was = g->ctx; /* what backward goes on with */
    td_rng rng = *c->rng;
    *c->rng = rc->rng;
    c->training = rc->training;
    c->rng_by_sample = rc->by_sample;
    c->rng_step = rc->step;
    c->rng_first_sample = rc->first_sample;
    c->keep_weights = 1; /* the parameters are the forward's */
    td_trace *trace = g->opt.trace;
    td_status st = TD_OK;
    for (int j = first; j <= k && st == TD_OK; j++) {
        if (!rc->rerun[j]) continue;
        td__node *n = g->nodes[j];
        c->rng->offset = rc->rng.offset + rc->rng_at[j];
        c->rng_sample_offset = rc->sample_at[j];
        uint64_t t0 = trace ? td_time_ns() : 0;
        st = td__kernels_of(c, n->op)->forward(c, n);
        if (trace && st == TD_OK)
            (void)td_trace_span(trace, n->out->name, "recompute", t0, td_time_ns());
    }
    *c->rng = rng;
    c->training = was.training;
    c->rng_by_sample = was.rng_by_sample;
    c->rng_step = was.rng_step;
    c->rng_first_sample = was.rng_first_sample;
    c->rng_sample_offset = was.rng_sample_offset;
    c->keep_weights = was.keep_weights;
    return st;
}
