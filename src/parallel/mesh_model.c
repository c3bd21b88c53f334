/* What a model split over a mesh needs beyond its strategies: the gradient norm of the whole
 * model (Megatron's clip_grad_norm over the model-parallel ranks) and the whole tensors by name
 * on one rank (a digest, a sample, mesh_checkpoint.c's files), both read from td_param.split.
 *
 * Every tensor-parallel rank holds the same sequence of slices (its model's split parameters,
 * in registration order); rank 0 of a tp group also holds every whole tensor of its stage, some
 * of which only it holds (a row-parallel layer's bias), so rank 0's list names the stage's
 * whole model. Nothing here runs inside a step. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/mesh.h"
#include "tandem/optim.h"

#include "core/core_impl.h"
#include "optim/optim_impl.h"
#include "parallel/grad_norm.h"

#define GATHER_TAG 0x6d657368 /* "mesh" */

/* ---- the norm --------------------------------------------------------------------------- */

td_status td_mesh_clip_grad_norm(const td_mesh *mesh, td_param *params, size_t n, int dp_shards,
                                 double max_norm, double *total_norm) {
    if (!mesh || (!params && n))
        return td__fail(TD_EINVAL, "td_mesh_clip_grad_norm: mesh or params is NULL");
    if (!(max_norm > 0))
        return td__fail(TD_EINVAL, "td_mesh_clip_grad_norm: max_norm %g, expected > 0", max_norm);
    int tp_rank = td_mesh_coord(mesh, "tp");
    td__sumsq acc;
    td__sumsq_init(&acc);
    for (size_t i = 0; i < n; i++) {
        const td_param *p = &params[i];
        if (!p->grad || (p->split.ranks == 0 && tp_rank != 0)) continue; /* counted on rank 0 */
        if (!td__is_float(p->dtype))
            return td__fail(TD_EDTYPE, "td_mesh_clip_grad_norm: gradient of %s is %s", p->name,
                            td_dtype_name(p->dtype));
        TD__TRY(td__grads_sumsq(p, 1, &acc, "td_mesh_clip_grad_norm"));
    }
    td_comm *groups[2] = {td_mesh_group(mesh, "tp"), dp_shards ? td_mesh_group(mesh, "dp") : NULL};
    TD__TRY(td__sumsq_allreduce(&acc, groups, 2));
    double sum = td__sumsq_value(&acc);
    double norm = sqrt(sum);
    if (total_norm) *total_norm = norm;
    double coef = max_norm / (norm + 1e-6);
    return coef < 1.0 ? td__grads_scale(params, n, (float)coef, "td_mesh_clip_grad_norm") : TD_OK;
}

/* ---- whole tensors ---------------------------------------------------------------------- */

/* A tensor as one stage tells stage 0 about it. */
typedef struct {
    char name[160];
    int32_t dtype, ndim;
    int64_t shape[TD_MAX_DIMS];
} wire_tensor;

void td_mesh_model_free(td_param *whole, size_t n) {
    for (size_t i = 0; whole && i < n; i++) {
        free((void *)whole[i].name);
        free(whole[i].data);
    }
    free(whole);
}

/* A whole tensor `name` of the given description with room for its data, as entry *e. */
static td_status whole_entry(td_param *e, const char *name, td_dtype dtype, int ndim,
                             const int64_t *shape) {
    memset(e, 0, sizeof *e);
    e->name = strdup(name);
    e->dtype = dtype;
    e->ndim = ndim;
    e->count = 1;
    for (int d = 0; d < ndim; d++) e->count *= (size_t)(e->shape[d] = shape[d]);
    e->data = malloc(e->count * td_dtype_size(dtype) + 1);
    if (!e->name || !e->data) return td__fail(TD_ENOMEM, "mesh: out of memory for '%s'", name);
    return TD_OK;
}

/* Puts the ranks' slices (gathered: rank r's at r * count) of p back in place in e. */
static void unslice(const td_param *p, const unsigned char *gathered, td_param *e) {
    const td_param_split *s = &p->split;
    size_t es = td_dtype_size(p->dtype), inner = es, outer = 1;
    for (int d = 0; d < p->ndim; d++) {
        if (d < s->dim) outer *= (size_t)p->shape[d];
        if (d > s->dim) inner *= (size_t)p->shape[d];
    }
    size_t parts = s->parts > 1 ? (size_t)s->parts : 1, mine = (size_t)p->shape[s->dim];
    size_t piece = mine / parts, whole = mine * (size_t)s->ranks;
    unsigned char *out = e->data;
    for (size_t r = 0; r < (size_t)s->ranks; r++)
        for (size_t o = 0; o < outer; o++)
            for (size_t b = 0; b < parts; b++)
                memcpy(out + (o * whole + b * (whole / parts) + r * piece) * inner,
                       gathered + r * p->count * es + (o * mine + b * piece) * inner,
                       piece * inner);
}

/* What every tp rank must agree on: the digest of its slices' names and shapes in order. */
static void describe_slices(const void *sig, const void *other, char *out, size_t cap, void *ctx) {
    (void)other, (void)ctx;
    const unsigned char *d = sig;
    snprintf(out, cap, "slices %02x%02x%02x%02x...", d[0], d[1], d[2], d[3]);
}

/* tp rank 0's whole tensors of this stage into *whole (n entries); elsewhere nothing. */
static td_status gather_tp(td_comm *tp, const td_param *params, size_t n, td_param **whole) {
    int rank = tp ? td_comm_rank(tp) : 0, ranks = tp ? td_comm_size(tp) : 1;
    *whole = NULL;
    td_sha256_ctx h;
    td_sha256_init(&h);
    for (size_t i = 0; i < n; i++) {
        if (params[i].split.ranks == 0) continue;
        if (params[i].split.ranks != ranks)
            return td__fail(TD_EINVAL, "mesh: '%s' is a slice of %d ranks, the tp group has %d",
                            params[i].name, params[i].split.ranks, ranks);
        td_sha256_update(&h, params[i].name, strlen(params[i].name) + 1);
        td_sha256_update(&h, params[i].shape, sizeof params[i].shape);
    }
    unsigned char digest[32];
    td_sha256_final(&h, digest);
    if (tp && ranks > 1) {
        td_comm_agreement a = {.what = "mesh: gathering the whole tensors",
                               .sig = digest,
                               .bytes = sizeof digest,
                               .describe = describe_slices,
                               .hint = "; every tp rank must hold the slices of the same tensors"};
        TD__TRY(td_comm_agree(tp, &a));
    }
    td_param *w = rank == 0 ? calloc(n ? n : 1, sizeof *w) : NULL;
    if (rank == 0 && !w) return td__fail(TD_ENOMEM, "mesh: out of memory");
    unsigned char *stage = NULL;
    td_status s = TD_OK;
    for (size_t i = 0; i < n && s == TD_OK; i++) {
        const td_param *p = &params[i];
        size_t bytes = p->count * td_dtype_size(p->dtype);
        if (p->split.ranks == 0) {
            if (rank == 0 &&
                (s = whole_entry(&w[i], p->name, p->dtype, p->ndim, p->shape)) == TD_OK)
                memcpy(w[i].data, p->data, bytes);
            continue;
        }
        unsigned char *grown = rank == 0 ? realloc(stage, bytes * (size_t)ranks + 1) : NULL;
        if (rank == 0 && !grown) {
            s = td__fail(TD_ENOMEM, "mesh: out of memory for '%s'", p->name);
            break;
        }
        stage = rank == 0 ? grown : stage;
        s = td_comm_gather(tp, p->data, stage, p->count, p->dtype, 0);
        if (s != TD_OK || rank != 0) continue;
        int64_t shape[TD_MAX_DIMS];
        memcpy(shape, p->shape, sizeof shape);
        shape[p->split.dim] *= ranks;
        if ((s = whole_entry(&w[i], p->name, p->dtype, p->ndim, shape)) == TD_OK)
            unslice(p, stage, &w[i]);
    }
    free(stage);
    if (s != TD_OK) {
        td_mesh_model_free(w, n);
        return s;
    }
    *whole = w;
    return TD_OK;
}

/* Stage `from`'s whole tensors received on stage 0 and added to *all (by name: a name stage 0
 * has already, a weight tied across stages, is taken from the lowest stage). */
static td_status receive_stage(td_comm *pp, int from, td_param **all, size_t *n_all) {
    int64_t n;
    TD__TRY(td_comm_recv(pp, &n, 1, TD_I64, from, GATHER_TAG));
    td_param *grown = realloc(*all, (*n_all + (size_t)n + 1) * sizeof *grown);
    if (!grown) return td__fail(TD_ENOMEM, "mesh: out of memory");
    *all = grown;
    for (int64_t i = 0; i < n; i++) {
        wire_tensor h;
        TD__TRY(td_comm_recv(pp, &h, sizeof h, TD_U8, from, GATHER_TAG));
        td_param e;
        TD__TRY(whole_entry(&e, h.name, (td_dtype)h.dtype, h.ndim, h.shape));
        td_status s = td_comm_recv(pp, e.data, e.count, e.dtype, from, GATHER_TAG);
        int known = 0;
        for (size_t j = 0; j < *n_all && !known; j++) known = !strcmp((*all)[j].name, e.name);
        if (s != TD_OK || known) {
            free((void *)e.name);
            free(e.data);
            TD__TRY(s);
            continue;
        }
        (*all)[(*n_all)++] = e;
    }
    return TD_OK;
}

static td_status send_stage(td_comm *pp, const td_param *w, size_t n) {
    int64_t count = (int64_t)n;
    TD__TRY(td_comm_send(pp, &count, 1, TD_I64, 0, GATHER_TAG));
    for (size_t i = 0; i < n; i++) {
        wire_tensor h;
        memset(&h, 0, sizeof h);
        if (strlen(w[i].name) >= sizeof h.name)
            return td__fail(TD_EINVAL, "mesh: tensor name '%s' is too long", w[i].name);
        snprintf(h.name, sizeof h.name, "%s", w[i].name);
        h.dtype = w[i].dtype;
        h.ndim = w[i].ndim;
        memcpy(h.shape, w[i].shape, sizeof h.shape);
        TD__TRY(td_comm_send(pp, &h, sizeof h, TD_U8, 0, GATHER_TAG));
        TD__TRY(td_comm_send(pp, w[i].data, w[i].count, w[i].dtype, 0, GATHER_TAG));
    }
    return TD_OK;
}

td_status td_mesh_gather_model(const td_mesh *mesh, const td_param *params, size_t n,
                               td_param **whole, size_t *n_whole) {
    if (!mesh || (!params && n) || !whole || !n_whole)
        return td__fail(TD_EINVAL, "td_mesh_gather_model: NULL argument");
    *whole = NULL;
    *n_whole = 0;
    if (td_mesh_coord(mesh, "dp") != 0) return TD_OK; /* replica 0 speaks for every replica */
    td_param *w;
    TD__TRY(gather_tp(td_mesh_group(mesh, "tp"), params, n, &w));
    if (td_mesh_coord(mesh, "tp") != 0) return TD_OK;
    td_comm *pp = td_mesh_group(mesh, "pp");
    int stage = pp ? td_comm_rank(pp) : 0, stages = pp ? td_comm_size(pp) : 1;
    td_status s = TD_OK;
    size_t count = n;
    if (stage > 0) {
        s = send_stage(pp, w, n);
        td_mesh_model_free(w, n);
        return s;
    }
    for (int from = 1; from < stages && s == TD_OK; from++) s = receive_stage(pp, from, &w, &count);
    if (s != TD_OK) {
        td_mesh_model_free(w, count);
        return s;
    }
    *whole = w;
    *n_whole = count;
    return TD_OK;
}
