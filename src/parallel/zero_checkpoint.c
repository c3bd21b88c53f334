/* td_zero's checkpoints: each rank writes the parts of the parameters and of the optimizer's
 * state in its chunks (rank 0 also the caller's extra tensors and the optimizer's step counts),
 * and rank 0 commits the set with the index (checkpoint.h's sharded checkpoints). Loading reads
 * through td_checkpoint_read_range, so a checkpoint of any world size, sharded or a single file,
 * loads at this one: every rank takes the elements of its own chunks.
 *
 * The tensors are the ones a whole-model run saves (td_ddp's: "<param>", "optim.<param>.<state>"
 * of the parameter's shape, "optim.step" with one count per parameter): the optimizer's state
 * entries for a part are named after the part's parameter and hold as many elements, so each is
 * that part of the whole state tensor. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "core/core_impl.h"
#include "parallel/zero_impl.h"

typedef td__zero_parts zero_view;

#define STEP_NAME "optim.step"

/* Which view an optimizer state entry belongs to ("optim.<view name>.<state>", the state
 * without dots), or n_views when none. */
static size_t state_view(const zero_view *zv, const td_param *state) {
    const char *name = state->name;
    if (strncmp(name, "optim.", 6) != 0) return zv->lay->n_views;
    name += 6;
    for (size_t v = 0; v < zv->lay->n_views; v++) {
        size_t len = strlen(zv->views[v].name);
        if (!strncmp(name, zv->views[v].name, len) && name[len] == '.' &&
            !strchr(name + len + 1, '.'))
            return v;
    }
    return zv->lay->n_views;
}

/* The whole tensor a view's state entry is a part of: the parameter's shape, the state's dtype. */
static td_param whole_of(const zero_view *zv, size_t v, const td_param *state) {
    td_param t = zv->params[zv->lay->views[v].param];
    t.name = state->name;
    t.dtype = state->dtype;
    t.data = t.grad = NULL;
    return t;
}

/* The whole step counts, as a whole-model run and td_zero_save write them. */
static td_param steps_whole(const zero_view *zv) {
    return (td_param){.name = STEP_NAME,
                      .count = zv->n_params,
                      .dtype = TD_I64,
                      .ndim = 1,
                      .shape = {(int64_t)zv->n_params}};
}

/* Every parameter's step count, the same on every rank: a part's count is its parameter's. */
static td_status gather_steps(const zero_view *zv, const td_param *state, size_t n_state,
                              int64_t *steps) {
    memset(steps, 0, zv->n_params * sizeof *steps);
    for (size_t k = 0; k < n_state; k++) {
        if (strcmp(state[k].name, STEP_NAME) != 0) continue;
        if (state[k].dtype != TD_I64 || state[k].count != zv->lay->n_views)
            return td__fail(TD_EINVAL,
                            "zero rank %d: the optimizer's " STEP_NAME
                            " holds %zu counts, expected one per part (%zu)",
                            zv->rank, state[k].count, zv->lay->n_views);
        const int64_t *mine = state[k].data;
        for (size_t v = 0; v < zv->lay->n_views; v++) steps[zv->lay->views[v].param] = mine[v];
    }
    return zv->n_params ? td_comm_allreduce(zv->comm, steps, steps, zv->n_params, TD_I64, TD_OP_MAX)
                        : TD_OK;
}

/* This rank's parts: its chunks of the parameters and of each state entry, and on rank 0 the
 * step counts and the extra tensors whole. */
static td_status list_parts(const zero_view *zv, const td_param *state, size_t n_state,
                            const int64_t *steps, const td_param *extra, size_t n_extra,
                            td_checkpoint_part **out, size_t *n_out) {
    size_t cap = zv->lay->n_views + n_state + n_extra + 1, n = 0;
    td_checkpoint_part *parts = calloc(cap, sizeof *parts);
    if (!parts) return td__fail(TD_ENOMEM, "zero rank %d: out of memory", zv->rank);
    for (size_t v = 0; v < zv->lay->n_views; v++) {
        const td__zero_view *w = &zv->lay->views[v];
        td_param t = zv->params[w->param];
        t.data = t.grad = NULL;
        parts[n++] = (td_checkpoint_part){t, w->param_offset, w->count, zv->views[v].data};
    }
    for (size_t k = 0; k < n_state; k++) {
        if (!strcmp(state[k].name, STEP_NAME)) continue;
        size_t v = state_view(zv, &state[k]);
        if (v == zv->lay->n_views || state[k].count != zv->lay->views[v].count) {
            free(parts);
            return td__fail(TD_EINVAL,
                            "zero rank %d: optimizer state '%s' (%zu elements) is no part's "
                            "\"optim.<parameter>.<state>\" of the part's size",
                            zv->rank, state[k].name, state[k].count);
        }
        parts[n++] =
            (td_checkpoint_part){whole_of(zv, v, &state[k]), zv->lay->views[v].param_offset,
                                 state[k].count, state[k].data};
    }
    if (zv->rank == 0) {
        if (n_state) parts[n++] = (td_checkpoint_part){steps_whole(zv), 0, zv->n_params, steps};
        for (size_t k = 0; k < n_extra; k++)
            parts[n++] = (td_checkpoint_part){extra[k], 0, extra[k].count, extra[k].data};
    }
    *out = parts;
    *n_out = n;
    return TD_OK;
}

/* The same verdict on every rank: rank r's `local` failure, or TD_OK. */
static td_status agree(const zero_view *zv, td_status local) {
    char what[32];
    snprintf(what, sizeof what, "zero rank %d", zv->rank);
    td_comm_agreement a = {.what = what, .local = local};
    return td_comm_agree(zv->comm, &a);
}

td_status td_zero_save(td_zero *z, const td_optim *optim, const char *path, const td_param *extra,
                       size_t n_extra, const td_checkpoint_meta *meta, size_t n_meta) {
    if (!z || !path || (!extra && n_extra) || (!meta && n_meta))
        return td__fail(TD_EINVAL, "td_zero_save: zero, path, extra or meta is NULL");
    zero_view zv;
    td__zero_parts_of(z, &zv);
    td_param *state = NULL;
    size_t n_state = 0;
    if (optim) td_optim_state((td_optim *)optim, &state, &n_state);
    int64_t *steps = calloc(zv.n_params ? zv.n_params : 1, sizeof *steps);
    if (!steps) return agree(&zv, td__fail(TD_ENOMEM, "zero rank %d: out of memory", zv.rank));
    td_status s = gather_steps(&zv, state, n_state, steps);
    /* One id names this save's files on every rank: rank 0's draw, random so that no other save
     * (of another run, seed or path) carries it. */
    uint64_t id = 0;
    if (zv.rank == 0 && getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id)
        id = td_time_ns() ^ ((uint64_t)getpid() << 32);
    if (s == TD_OK) s = td_comm_broadcast(zv.comm, &id, 1, TD_I64, 0);
    td_checkpoint_part *parts = NULL;
    size_t n = 0;
    if (s == TD_OK) s = list_parts(&zv, state, n_state, steps, extra, n_extra, &parts, &n);
    if (s == TD_OK) s = td_checkpoint_save_part(path, id, zv.rank, td_comm_size(zv.comm), parts, n);
    free(parts);
    free(steps);
    s = agree(&zv, s);
    /* Every part is on disk: rank 0 commits, and every rank learns how that went. */
    if (s == TD_OK)
        s = agree(&zv, zv.rank == 0
                           ? td_checkpoint_publish(path, id, td_comm_size(zv.comm), meta, n_meta)
                           : TD_OK);
    return s;
}

/* Reads this rank's parts of everything the group holds, and the extra tensors whole; each read
 * checks the whole tensor's dtype and shape. */
static td_status load_local(const zero_view *zv, td_checkpoint *ck, td_param *state, size_t n_state,
                            td_param *extra, size_t n_extra) {
    /* Stages 1 and 2 keep whole parameters, which every rank reads; stage 3 its chunks. */
    for (size_t i = 0; zv->stage < 3 && i < zv->n_params; i++) {
        const td_param *p = &zv->params[i];
        TD__TRY(td_checkpoint_read_range(ck, p, 0, p->count, p->data));
    }
    for (size_t v = 0; zv->stage == 3 && v < zv->lay->n_views; v++) {
        const td__zero_view *w = &zv->lay->views[v];
        TD__TRY(td_checkpoint_read_range(ck, &zv->params[w->param], w->param_offset, w->count,
                                         zv->views[v].data));
    }
    const td_param steps_all = steps_whole(zv);
    for (size_t k = 0; k < n_state; k++) {
        if (!strcmp(state[k].name, STEP_NAME)) {
            int64_t *steps = state[k].data;
            for (size_t v = 0; v < zv->lay->n_views && v < state[k].count; v++)
                TD__TRY(td_checkpoint_read_range(ck, &steps_all, zv->lay->views[v].param, 1,
                                                 &steps[v]));
            continue;
        }
        size_t v = state_view(zv, &state[k]);
        if (v == zv->lay->n_views || state[k].count != zv->lay->views[v].count)
            return td__fail(TD_EINVAL,
                            "zero rank %d: optimizer state '%s' is no part's "
                            "\"optim.<parameter>.<state>\"",
                            zv->rank, state[k].name);
        const td_param whole = whole_of(zv, v, &state[k]);
        TD__TRY(td_checkpoint_read_range(ck, &whole, zv->lay->views[v].param_offset, state[k].count,
                                         state[k].data));
    }
    return n_extra ? td_checkpoint_read(ck, extra, n_extra) : TD_OK;
}

td_status td_zero_load(td_zero *z, td_optim *optim, const char *path, td_param *extra,
                       size_t n_extra) {
    if (!z || !path || (!extra && n_extra))
        return td__fail(TD_EINVAL, "td_zero_load: zero, path or extra is NULL");
    zero_view zv;
    td__zero_parts_of(z, &zv);
    td_param *state = NULL;
    size_t n_state = 0;
    if (optim) td_optim_state(optim, &state, &n_state);
    td_checkpoint *ck = NULL;
    td_status s = td_checkpoint_open(&ck, path);
    if (s == TD_OK) s = load_local(&zv, ck, state, n_state, extra, n_extra);
    td_checkpoint_close(ck);
    s = agree(&zv, s);
    return s == TD_OK ? td__zero_loaded(z) : s;
}
