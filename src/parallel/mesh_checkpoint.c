/* Checkpoints of a model split over a mesh, written as one process training the whole model
 * writes them (td_checkpoint_save: whole tensors by name, "optim.step" with one count per
 * parameter of the whole model) and read back into any layout: each rank's slices by
 * td_param.split, its step counts from the whole list.
 *
 * Under ZeRO a rank's tensor-parallel slice is itself sharded over dp, its optimizer's state in
 * flat chunks: ZeRO's own save and load (td_zero_save, td_zero_load, which reshard at any world
 * size) go through a file of the slice per tp rank beside the checkpoint, removed after. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/mesh.h"

#include "core/core_impl.h"
#include "parallel/zero_impl.h"

#define STEP_NAME "optim.step"

/* Every rank learns rank 0's status (and message) of a step only it took. */
static td_status share_outcome(td_comm *c, td_status s) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", s ? td_last_error() : "");
    int32_t st = (int32_t)s;
    TD__TRY(td_comm_broadcast(c, &st, 1, TD_I32, 0));
    TD__TRY(td_comm_broadcast(c, msg, sizeof msg, TD_U8, 0));
    return st ? td__fail((td_status)st, "%s", msg) : TD_OK;
}

/* ---- writing ------------------------------------------------------------------------------- */

/* The whole model's file on rank 0 from each rank's params[0..n), state[0..n_state) (the
 * optimizer's but its counts) and steps (one count per parameter, or NULL). Each count travels as
 * a tensor of its own ("optim.<name>.step"), gathered by name like the rest, so that the whole
 * model's counts follow its parameters' order. Collective over the mesh. */
static td_status save_whole(const td_mesh *mesh, const td_param *params, size_t n,
                            const td_param *state, size_t n_state, const int64_t *steps,
                            const char *path, const td_checkpoint_meta *meta, size_t n_meta) {
    td_status s = TD_OK;
    td_param *counts_t = calloc(n + 1, sizeof *counts_t);
    char(*names)[200] = calloc(n + 1, sizeof *names);
    if (!counts_t || !names) s = td__fail(TD_ENOMEM, "mesh: out of memory");
    for (size_t i = 0; s == TD_OK && steps && i < n; i++) {
        snprintf(names[i], sizeof names[i], "optim.%s.step", params[i].name);
        counts_t[i] = (td_param){.name = names[i],
                                 .data = (void *)&steps[i],
                                 .count = 1,
                                 .dtype = TD_I64}; /* whole on every rank that holds a slice */
    }
    td_param *wp = NULL, *ws = NULL, *wc = NULL;
    size_t nwp = 0, nws = 0, nwc = 0;
    if (s == TD_OK) s = td_mesh_gather_model(mesh, params, n, &wp, &nwp);
    if (s == TD_OK) s = td_mesh_gather_model(mesh, state, n_state, &ws, &nws);
    if (s == TD_OK && steps) s = td_mesh_gather_model(mesh, counts_t, n, &wc, &nwc);
    if (td_comm_rank(td_mesh_comm(mesh)) == 0 && s == TD_OK) {
        td_param *all = calloc(nwp + nws + 1, sizeof *all);
        int64_t *counts = calloc(nwp + 1, sizeof *counts);
        if (!all || !counts) s = td__fail(TD_ENOMEM, "mesh: out of memory");
        size_t k = 0;
        for (size_t i = 0; s == TD_OK && i < nwp; i++) all[k++] = wp[i];
        for (size_t i = 0; s == TD_OK && i < nws; i++) all[k++] = ws[i];
        for (size_t i = 0; s == TD_OK && steps && i < nwp; i++) {
            char want[200];
            snprintf(want, sizeof want, "optim.%s.step", wp[i].name);
            size_t j = 0;
            while (j < nwc && strcmp(wc[j].name, want)) j++;
            if (j == nwc)
                s = td__fail(TD_EINVAL, "mesh: no step count for %s", wp[i].name);
            else
                counts[i] = *(const int64_t *)wc[j].data;
        }
        if (s == TD_OK && steps)
            all[k++] = (td_param){.name = STEP_NAME,
                                  .data = counts,
                                  .count = nwp,
                                  .dtype = TD_I64,
                                  .ndim = 1,
                                  .shape = {(int64_t)nwp}};
        if (s == TD_OK) s = td_checkpoint_save(path, all, k, meta, n_meta);
        free(all);
        free(counts);
    }
    td_mesh_model_free(wp, nwp);
    td_mesh_model_free(ws, nws);
    td_mesh_model_free(wc, nwc);
    free(counts_t);
    free(names);
    return share_outcome(td_mesh_comm(mesh), s);
}

/* The optimizer's state but its step counts, and those counts (one per parameter, in the order
 * of the parameters it was made over: n of them, or TD_EINVAL). */
static td_status split_state(td_optim *optim, size_t n, td_param **state, size_t *n_state,
                             const int64_t **steps) {
    td_param *all;
    size_t n_all;
    td_optim_state(optim, &all, &n_all);
    *state = calloc(n_all + 1, sizeof **state);
    if (!*state) return td__fail(TD_ENOMEM, "mesh: out of memory");
    *n_state = 0;
    *steps = NULL;
    for (size_t i = 0; i < n_all; i++) {
        if (strcmp(all[i].name, STEP_NAME)) {
            (*state)[(*n_state)++] = all[i];
            continue;
        }
        if (all[i].count != n) {
            free(*state);
            return td__fail(TD_EINVAL,
                            "mesh: the optimizer steps %zu parameters, %zu were given (it must "
                            "be made over exactly these)",
                            all[i].count, n);
        }
        *steps = all[i].data;
    }
    return TD_OK;
}

td_status td_mesh_save(const td_mesh *mesh, const td_param *params, size_t n, td_optim *optim,
                       const char *path, const td_checkpoint_meta *meta, size_t n_meta) {
    if (!mesh || (!params && n) || !path)
        return td__fail(TD_EINVAL, "td_mesh_save: mesh, params or path is NULL");
    td_param *state = NULL;
    size_t n_state = 0;
    const int64_t *steps = NULL;
    td_status s = optim ? split_state(optim, n, &state, &n_state, &steps) : TD_OK;
    /* a rank that failed still takes part, so that none waits for it */
    if (s == TD_OK) s = save_whole(mesh, params, n, state, n_state, steps, path, meta, n_meta);
    free(state);
    return s;
}

/* ---- reading -------------------------------------------------------------------------------- */

/* The count every parameter took in the file (AdamW's and SGD's counts are the steps taken, the
 * same for all; a rank holding part of the model cannot place a whole model's list by name). */
static td_status file_steps(td_checkpoint *ck, const char *path, int64_t *out) {
    td_param info;
    size_t i = 0, count = td_checkpoint_count(ck);
    while (i < count && td_checkpoint_tensor(ck, i, &info) == TD_OK && strcmp(info.name, STEP_NAME))
        i++;
    if (i == count) return td__fail(TD_ENOTFOUND, "%s: no %s", path, STEP_NAME);
    if (info.dtype != TD_I64 || info.count == 0)
        return td__fail(TD_EDTYPE, "%s: %s is not i64 counts", path, STEP_NAME);
    int64_t *file = calloc(info.count, sizeof *file);
    if (!file) return td__fail(TD_ENOMEM, "%s: out of memory", path);
    td_status s = td_checkpoint_read_range(ck, &info, 0, info.count, file);
    for (size_t j = 1; s == TD_OK && j < info.count; j++)
        if (file[j] != file[0])
            s = td__fail(TD_EINVAL,
                         "%s: the parameters' step counts differ (%lld, %lld), which a rank "
                         "holding part of the model cannot place",
                         path, (long long)file[0], (long long)file[j]);
    *out = file[0];
    free(file);
    return s;
}

td_status td_mesh_load(const td_mesh *mesh, td_param *params, size_t n, td_optim *optim,
                       const char *path) {
    if (!mesh || (!params && n) || !path)
        return td__fail(TD_EINVAL, "td_mesh_load: mesh, params or path is NULL");
    td_param *state = NULL;
    size_t n_state = 0;
    const int64_t *steps = NULL;
    td_checkpoint *ck = NULL;
    int64_t count = 0;
    td_status s = optim ? split_state(optim, n, &state, &n_state, &steps) : TD_OK;
    if (s == TD_OK) s = td_checkpoint_open(&ck, path);
    if (s == TD_OK) s = td_checkpoint_read(ck, params, n);
    if (s == TD_OK) s = td_checkpoint_read(ck, state, n_state);
    if (s == TD_OK && steps) s = file_steps(ck, path, &count);
    for (size_t j = 0; s == TD_OK && steps && j < n; j++) ((int64_t *)steps)[j] = count;
    td_checkpoint_close(ck);
    free(state);
    return s;
}

/* ---- under ZeRO -------------------------------------------------------------------------- */

/* The file of this rank's tensor-parallel slice beside path (one per pipeline stage and tp rank,
 * shared by the dp group that shards it). */
static void slice_path(const td_mesh *mesh, const char *path, const char *what, char *out,
                       size_t cap) {
    snprintf(out, cap, "%s.%s-pp%d-tp%d", path, what, td_mesh_coord(mesh, "pp"),
             td_mesh_coord(mesh, "tp"));
}

/* The parameter whose state entry "optim.<name>.<suffix>" is, or NULL. */
static const td_param *owner_of(const char *state, const td_param *params, size_t n) {
    for (size_t i = 0; i < n; i++) {
        size_t len = strlen(params[i].name);
        if (!strncmp(state, "optim.", 6) && !strncmp(state + 6, params[i].name, len) &&
            state[6 + len] == '.' && !strchr(state + 7 + len, '.'))
            return &params[i];
    }
    return NULL;
}

/* Removes a sharded checkpoint's index and the parts its metadata "tandem.parts" lists (ZeRO's,
 * at path; checkpoint.h). */
static void remove_sharded(const char *path) {
    td_checkpoint *ck;
    if (td_checkpoint_open(&ck, path) == TD_OK) {
        const char *parts = td_checkpoint_get_meta(ck, "tandem.parts");
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash)
            slash[1] = 0;
        else
            dir[0] = 0;
        for (const char *at = parts; at && (at = strchr(at, '"'));) { /* ["a", "b"] */
            const char *end = strchr(++at, '"');
            if (!end) break;
            char file[2 * PATH_MAX + 1];
            snprintf(file, sizeof file, "%s%.*s", dir, (int)(end - at), at);
            unlink(file);
            at = end + 1;
        }
        td_checkpoint_close(ck);
    }
    unlink(path);
}

td_status td_mesh_save_zero(const td_mesh *mesh, td_zero *zero, td_optim *optim, const char *path,
                            const td_checkpoint_meta *meta, size_t n_meta) {
    if (!mesh || !zero || !optim || !path)
        return td__fail(TD_EINVAL, "td_mesh_save_zero: mesh, zero, optim or path is NULL");
    td__zero_parts zp;
    td__zero_parts_of(zero, &zp);
    char tmp[PATH_MAX];
    slice_path(mesh, path, "zero", tmp, sizeof tmp);
    /* the slice's whole tensors, by ZeRO (collective over dp), read back */
    td_status s = td_zero_save(zero, optim, tmp, NULL, 0, NULL, 0);
    td_checkpoint *ck = NULL;
    size_t n = 0, count = 0;
    td_param *all = NULL, *params = NULL, *state = NULL;
    size_t n_params = 0, n_state = 0;
    int64_t *steps = calloc(zp.n_params + 1, sizeof *steps);
    if (s == TD_OK && !steps) s = td__fail(TD_ENOMEM, "mesh: out of memory");
    if (s == TD_OK) s = td_checkpoint_open(&ck, tmp);
    if (s == TD_OK) count = td_checkpoint_count(ck);
    if (s == TD_OK && !(all = calloc(count + 1, sizeof *all)))
        s = td__fail(TD_ENOMEM, "mesh: out of memory");
    for (size_t i = 0; s == TD_OK && i < count; i++) {
        td_param info;
        s = td_checkpoint_tensor(ck, i, &info);
        if (s != TD_OK || !strcmp(info.name, STEP_NAME)) continue;
        all[n] = info;
        all[n].name = strdup(info.name);
        all[n].data = malloc(info.count * td_dtype_size(info.dtype) + 1);
        if (!all[n].name || !all[n].data) s = td__fail(TD_ENOMEM, "mesh: out of memory");
        n++;
        if (s == TD_OK) s = td_checkpoint_read(ck, &all[n - 1], 1);
    }
    td_param step_t = {.name = STEP_NAME,
                       .count = zp.n_params,
                       .dtype = TD_I64,
                       .ndim = 1,
                       .shape = {(int64_t)zp.n_params}};
    if (s == TD_OK) s = td_checkpoint_read_range(ck, &step_t, 0, zp.n_params, steps);
    /* the parameters in ZeRO's order (the model's), each with its slice; the state after */
    if (s == TD_OK && (!(params = calloc(zp.n_params + 1, sizeof *params)) ||
                       !(state = calloc(n + 1, sizeof *state))))
        s = td__fail(TD_ENOMEM, "mesh: out of memory");
    for (size_t i = 0; s == TD_OK && i < zp.n_params; i++) {
        size_t k = 0;
        while (k < n && strcmp(all[k].name, zp.params[i].name)) k++;
        if (k == n) s = td__fail(TD_EINVAL, "mesh: ZeRO's file lacks %s", zp.params[i].name);
        if (s == TD_OK) params[n_params] = all[k], params[n_params++].split = zp.params[i].split;
    }
    for (size_t k = 0; s == TD_OK && k < n; k++) {
        const td_param *of = owner_of(all[k].name, zp.params, zp.n_params);
        if (!of) continue;
        state[n_state] = all[k];
        state[n_state++].split = of->split;
    }
    td_checkpoint_close(ck);
    /* every rank takes part in the gathers, whatever failed here */
    td_status w = save_whole(mesh, params, n_params, state, n_state, steps, path, meta, n_meta);
    if (s == TD_OK) s = w;
    td_status b = td_comm_barrier(zp.comm); /* every rank of the dp group has read the file */
    if (s == TD_OK) s = b;
    if (zp.rank == 0) remove_sharded(tmp);
    for (size_t k = 0; all && k < n; k++) {
        free((void *)all[k].name);
        free(all[k].data);
    }
    free(all);
    free(params);
    free(state);
    free(steps);
    return s;
}

td_status td_mesh_load_zero(const td_mesh *mesh, td_zero *zero, td_optim *optim, const char *path) {
    if (!mesh || !zero || !optim || !path)
        return td__fail(TD_EINVAL, "td_mesh_load_zero: mesh, zero, optim or path is NULL");
    td__zero_parts zp;
    td__zero_parts_of(zero, &zp);
    char tmp[PATH_MAX];
    slice_path(mesh, path, "load", tmp, sizeof tmp);
    td_status s = TD_OK;
    if (zp.rank == 0) {
        /* the slice's whole tensors, read from the whole model's file, as a file of its own:
         * the parameters and every state tensor of theirs the file holds (a rank's optimizer
         * has entries only for the parameters its own chunks reach) */
        td_checkpoint *ck = NULL;
        s = td_checkpoint_open(&ck, path);
        size_t count = s == TD_OK ? td_checkpoint_count(ck) : 0, n = 0;
        td_param *t = calloc(zp.n_params + count + 1, sizeof *t);
        int64_t *steps = calloc(zp.n_params + 1, sizeof *steps), every = 0;
        if (s == TD_OK && (!t || !steps)) s = td__fail(TD_ENOMEM, "mesh: out of memory");
        for (size_t i = 0; s == TD_OK && i < zp.n_params; i++) t[n++] = zp.params[i];
        for (size_t i = 0; s == TD_OK && i < count; i++) {
            td_param info;
            s = td_checkpoint_tensor(ck, i, &info);
            const td_param *of = s == TD_OK ? owner_of(info.name, zp.params, zp.n_params) : NULL;
            if (!of) continue;
            t[n] = *of;
            t[n].name = info.name;
            t[n].dtype = info.dtype;
            t[n].grad = NULL;
            n++;
        }
        /* into memory of their own: ZeRO's load writes the parameters where they live */
        for (size_t k = 0; k < n; k++) t[k].data = NULL;
        for (size_t k = 0; s == TD_OK && k < n; k++)
            if (!(t[k].data = malloc(t[k].count * td_dtype_size(t[k].dtype) + 1)))
                s = td__fail(TD_ENOMEM, "mesh: out of memory");
        if (s == TD_OK) s = td_checkpoint_read(ck, t, n);
        if (s == TD_OK) s = file_steps(ck, path, &every);
        for (size_t i = 0; i < zp.n_params && steps; i++) steps[i] = every;
        if (s == TD_OK)
            t[n++] = (td_param){.name = STEP_NAME,
                                .data = steps,
                                .count = zp.n_params,
                                .dtype = TD_I64,
                                .ndim = 1,
                                .shape = {(int64_t)zp.n_params}};
        for (size_t k = 0; s == TD_OK && k < n; k++) memset(&t[k].split, 0, sizeof t[k].split);
        if (s == TD_OK) s = td_checkpoint_save(tmp, t, n, NULL, 0);
        for (size_t k = 0; t && k < n; k++)
            if (t[k].data != steps) free(t[k].data);
        td_checkpoint_close(ck); /* after the save: the state entries' names are the file's */
        free(t);
        free(steps);
    }
    s = share_outcome(zp.comm, s);
    if (s == TD_OK) s = td_zero_load(zero, optim, tmp, NULL, 0); /* collective over dp */
    td_status b = td_comm_barrier(zp.comm);
    if (s == TD_OK) s = b;
    if (zp.rank == 0) unlink(tmp);
    return s;
}
