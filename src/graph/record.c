/* Whole sweeps recorded once and replayed (CUDA graphs on a GPU): on a device whose backend
 * can record, the second forward (or backward) run with the same key is recorded as it runs
 * and every later one with that key is one replay, so a step costs a few launches instead of
 * one per kernel. The engine is define-then-run, so a sweep's kernels, shapes and storage are
 * the same every step; what else a sweep depends on is its key:
 *   forward:  the training mode and whether dropout is keyed by sample;
 *   backward: the tensor it starts from and every tensor's gradient flags (written since
 *             zeroing or not), which decide whether kernels write or add.
 * and for both, where every tensor's memory is (td_tensor_set_data or a repointed td_param
 * changes it: a recording reads the memory it was recorded with).
 * What a sweep changes on the host is redone after each replay: the dropout RNG's offsets
 * (forward) and the gradient flags (backward). Values that change from step to step reach the
 * kernels through device memory written before the sweep (the RNG key, the upstream
 * gradient), never as launch arguments. A grad-ready hook (DDP) runs host code in the middle
 * of backward, so backward is not recorded while one is set, and a traced graph (each op a
 * span timed on the host) records neither. A recording that fails turns
 * recording off for the graph, says why (td_graph_replays), and the sweep runs again op by op. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/graph_impl.h"

/* A tensor's gradient flags in one byte. */
static unsigned char flags_of(const td_tensor *t) {
    return (unsigned char)((t->grad_zero ? 1 : 0) | (t->grad_scratch << 1));
}

static void flags_save(const td_graph *g, unsigned char *to) {
    for (int i = 0; i < g->ntensors; i++) to[i] = flags_of(g->tensors[i]);
}

static void flags_restore(td_graph *g, const unsigned char *from) {
    for (int i = 0; i < g->ntensors; i++) {
        g->tensors[i]->grad_zero = from[i] & 1;
        g->tensors[i]->grad_scratch = from[i] >> 1;
    }
}

static int flags_equal(const td_graph *g, const unsigned char *to) {
    for (int i = 0; i < g->ntensors; i++)
        if (to[i] != flags_of(g->tensors[i])) return 0;
    return 1;
}

static void sweep_clear(td__recorded_sweep *s, const td__backend *be) {
    if (s->recording) be->release(s->recording);
    s->recording = NULL;
}

void td__graph_records_free(td_graph *g) {
    sweep_clear(&g->rec_forward, g->ctx.backend);
    sweep_clear(&g->rec_backward, g->ctx.backend);
    free(g->rec_backward.flags_before);
    free(g->rec_backward.flags_after);
}

/* Whether this graph records sweeps of kind `backward` now. A collective op waits for the
 * process group on the host, which no recording can hold: such a graph never records, and says
 * so. */
static int recordable(td_graph *g, int backward) {
    const td__backend *be = g->ctx.backend;
    if (!be->record_begin || !g->opt.cuda_graphs || g->record_why[0]) return 0;
    if (g->opt.trace) {
        snprintf(g->record_why, sizeof g->record_why,
                 "every op is a span of td_graph_params.trace, timed on the host");
        return 0;
    }
    for (int k = 0; k < g->nnodes && !g->record_checked; k++)
        if (g->nodes[k]->op->collective) {
            snprintf(g->record_why, sizeof g->record_why,
                     "node %d (%s) talks to the process group from the host", k, g->nodes[k]->what);
            return 0;
        }
    g->record_checked = 1;
    /* Hooks run host code in the middle of a sweep: DDP's in backward, ZeRO's in both. */
    return !g->use_hook && !(backward && g->hook);
}

/* The key of the sweep about to run, as it would be stored. A backward's kernels depend on the
 * training mode too (batch norm's training or evaluation backward, dropout's masks), so both
 * sweeps key on it. */
static int key_matches(const td_graph *g, const td__recorded_sweep *s, const td_tensor *from) {
    if (s->storage_gen != g->storage_gen || s->training != g->ctx.training ||
        s->by_sample != g->ctx.rng_by_sample)
        return 0;
    return !from || (s->from == from && flags_equal(g, s->flags_before));
}

static void key_store(td_graph *g, td__recorded_sweep *s, const td_tensor *from) {
    s->storage_gen = g->storage_gen;
    s->training = g->ctx.training;
    s->by_sample = g->ctx.rng_by_sample;
    s->from = from;
    if (from) flags_save(g, s->flags_before);
}

/* Records one sweep as it runs; on success it has run (replayed once) and *ok is 1. A failure
 * puts the host back as it was before the sweep and leaves *ok 0. */
static td_status record(td_graph *g, td__recorded_sweep *s, const td_tensor *from,
                        td_status (*run)(td_graph *, const void *), const void *arg, int *ok) {
    const td__backend *be = g->ctx.backend;
    uint64_t offset = g->ctx.rng->offset, sample = g->ctx.rng_sample_offset;
    *ok = 0;
    sweep_clear(s, be);
    key_store(g, s, from);
    td_status st = be->record_begin(&g->ctx);
    if (st == TD_OK) {
        st = run(g, arg);
        td_status end = be->record_end(&g->ctx, st == TD_OK, &s->recording);
        if (st == TD_OK) st = end;
    }
    if (st == TD_OK) st = be->replay(&g->ctx, s->recording);
    if (st != TD_OK) {
        snprintf(g->record_why, sizeof g->record_why, "%s", td_last_error());
        sweep_clear(s, be);
        g->ctx.rng->offset = offset;
        g->ctx.rng_sample_offset = sample;
        if (from) flags_restore(g, s->flags_before);
        return TD_OK;
    }
    s->rng_advance = g->ctx.rng->offset - offset;
    s->sample_advance = g->ctx.rng_sample_offset - sample;
    if (from) flags_save(g, s->flags_after);
    *ok = 1;
    return TD_OK;
}

td_status td__graph_sweep(td_graph *g, const td_tensor *from,
                          td_status (*run)(td_graph *, const void *), const void *arg) {
    int backward = from != NULL;
    td__recorded_sweep *s = backward ? &g->rec_backward : &g->rec_forward;
    if (!recordable(g, backward)) return run(g, arg);
    if (backward && !s->flags_before) {
        size_t n = (size_t)(g->ntensors ? g->ntensors : 1);
        s->flags_before = calloc(n, 1);
        s->flags_after = calloc(n, 1);
        if (!s->flags_before || !s->flags_after)
            return td__fail(TD_ENOMEM, "td_graph: out of memory for a recording's flags");
    }
    if (s->recording && key_matches(g, s, from)) {
        TD__TRY(g->ctx.backend->replay(&g->ctx, s->recording));
        g->ctx.rng->offset += s->rng_advance;
        g->ctx.rng_sample_offset += s->sample_advance;
        if (backward) flags_restore(g, s->flags_after);
        g->replays++;
        return TD_OK;
    }
    if (s->seen && key_matches(g, s, from)) { /* the same key twice in a row: record it */
        int ok;
        TD__TRY(record(g, s, from, run, arg, &ok));
        if (ok) {
            g->replays++;
            return TD_OK;
        }
        s->seen = 0;
        return run(g, arg); /* recording is off now (record_why): op by op */
    }
    /* A new key: run op by op and remember it, dropping a recording of another key. */
    sweep_clear(s, g->ctx.backend);
    key_store(g, s, from);
    s->seen = 1;
    return run(g, arg);
}

size_t td_graph_replays(const td_graph *g, const char **why_not) {
    if (why_not) *why_not = g && g->record_why[0] ? g->record_why : NULL;
    return g ? g->replays : 0;
}
