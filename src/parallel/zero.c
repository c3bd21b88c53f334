/* td_zero: creation (the layout, the ranks' agreement, DDP's front over the chosen gradient
 * reducer, parameters moved into the group's region), the calls of an iteration, stage 3's
 * gathering and freeing of units around their use, whole parameters on demand, clipping across
 * shards and the memory count; how the stages work is docs/zero.md's. Checkpoints are in
 * zero_checkpoint.c, the layout in zero_layout.c, the sharded gradient reducer in zero_reduce.c,
 * the pages parked between gathers in zero_region.c. It knows nothing of graphs. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "optim/optim_impl.h"
#include "parallel/grad_norm.h"
#include "parallel/zero_impl.h"

struct td_zero {
    td_comm *comm;
    td_comm *gather_comm; /* stage 3: the units' gathers, apart from the gradients' reductions */
    int rank, world;
    td_zero_params opt;
    td_param *params; /* (n_params) the caller's */
    size_t n_params;
    void **orig_data;  /* (n_params) data pointers at creation, restored by destroy */
    td_ddp *ddp;       /* the gradient side */
    int sharded_grads; /* the reduce-scatter reducer: the views' gradients are its shards */
    td__zero_layout lay;
    td__zero_region mem; /* every flat's parameters, at the flat's `at` */
    td__zero_pool pool;  /* stage 3: pages of freed gathered copies, parked for the next */
    td_param *views;     /* (lay.n_views) what the optimizer steps */
    int dirty;           /* stages 1, 2: chunks stepped since the last gather */
    int hold;            /* td_zero_full_params(1) is in force */
    size_t uses;         /* stage 3: BEFORE calls since td_zero_prepare_forward */
    uint64_t sync_steps; /* DDP's count when the views were last refreshed */
    td_status err;       /* an error of the grad-ready hook, for finish_backward */
    char err_msg[512];
};

td_zero_params td_zero_default_params(void) {
    td_zero_params p = {.stage = 2, .units = NULL, .n_units = 0, .prefetch = 1};
    p.ddp = td_ddp_default_params();
    return p;
}

/* Where flat f lies in the parameter region (this rank's chunk at td__zero_chunk_at). */
static unsigned char *flat_data(const td_zero *z, const td__zero_flat *f) {
    return z->mem.base + f->at;
}

/* ---- gathering ----------------------------------------------------------------------- */

/* Starts the in-place all-gather of flat f's chunks (at stage 3, onto the pages it frees). */
static td_status flat_launch(td_zero *z, td_comm *comm, td__zero_flat *f) {
    unsigned char *d = flat_data(z, f);
    size_t es = td_dtype_size(f->dtype);
    if (z->opt.stage == 3)
        td__zero_account_add(&z->lay.acct, ZERO_GATHERED,
                             (long long)(f->chunk * (size_t)(z->world - 1) * es));
    td_comm_tag(comm, "zero gather flat %d", (int)(f - z->lay.flats));
    td_status s =
        td_comm_iallgather(comm, d + td__zero_chunk_at(f, z->rank), d, f->chunk, f->dtype, &f->req);
    if (s != TD_OK) f->req = NULL;
    return s;
}

/* Waits for flat f's gather, if one is in flight. */
static td_status flat_wait(td__zero_flat *f) {
    td_request *r = f->req;
    f->req = NULL;
    return r ? td_request_wait(r) : TD_OK;
}

/* Stages 1 and 2: every flat whole again after the optimizer stepped the chunks. */
static td_status gather_all(td_zero *z) {
    td_status s = TD_OK;
    for (size_t f = 0; f < z->lay.n_flats && s == TD_OK; f++)
        s = flat_launch(z, z->comm, &z->lay.flats[f]);
    for (size_t f = 0; f < z->lay.n_flats; f++) {
        td_status w = flat_wait(&z->lay.flats[f]);
        if (s == TD_OK) s = w;
    }
    if (s == TD_OK) z->dirty = 0;
    return s;
}

/* Stage 3: the pages outside this rank's chunk of flat f, parked or given back, or (take) taken
 * from the pool where it has some; what the pool holds is counted as cached. */
static void flat_pages(td_zero *z, const td__zero_flat *f, int take) {
    size_t lo = td__zero_chunk_at(f, z->rank), hi = lo + f->chunk * td_dtype_size(f->dtype);
    size_t moved = take ? td__zero_pool_take(&z->pool, f->at, lo) +
                              td__zero_pool_take(&z->pool, f->at + hi, f->span - hi)
                        : td__zero_pool_park(&z->pool, f->at, lo) +
                              td__zero_pool_park(&z->pool, f->at + hi, f->span - hi);
    td__zero_account_add(&z->lay.acct, ZERO_CACHED, take ? -(long long)moved : (long long)moved);
}

/* Stage 3: starts gathering unit u unless it is whole or on its way; with wait, also waits. */
static td_status unit_gather(td_zero *z, size_t u, int wait) {
    td__zero_unit *un = &z->lay.units[u];
    td_status s = TD_OK;
    if (!un->whole) {
        un->whole = 1;
        for (size_t k = 0; k < un->n_flats && s == TD_OK; k++) {
            flat_pages(z, &z->lay.flats[un->first_flat + k], 1);
            s = flat_launch(z, z->gather_comm, &z->lay.flats[un->first_flat + k]);
        }
    }
    for (size_t k = 0; wait && k < un->n_flats; k++) {
        td_status w = flat_wait(&z->lay.flats[un->first_flat + k]);
        if (s == TD_OK) s = w;
    }
    return s;
}

/* Stage 3: unit u's pages outside this rank's chunks go back; they read as zeros after. */
static void unit_release(td_zero *z, size_t u) {
    td__zero_unit *un = &z->lay.units[u];
    if (!un->whole || z->hold) return;
    un->whole = 0;
    for (size_t k = 0; k < un->n_flats; k++) {
        td__zero_flat *f = &z->lay.flats[un->first_flat + k];
        (void)flat_wait(f); /* nothing may still be writing there */
        size_t es = td_dtype_size(f->dtype);
        flat_pages(z, f, 0);
        td__zero_account_add(&z->lay.acct, ZERO_GATHERED,
                             -(long long)(f->chunk * (size_t)(z->world - 1) * es));
    }
}

static void release_all(td_zero *z) {
    for (size_t u = 0; u < z->lay.n_units; u++) {
        unit_release(z, u);
        z->lay.units[u].forward_done = z->lay.units[u].backward_done = 0;
    }
}

/* ---- creation ------------------------------------------------------------------------ */

/* What every rank must agree on before DDP's front is made. */
typedef struct {
    int64_t stage, prefetch, units_given, det;
} zero_options;

typedef struct {
    int64_t n_units, n_flats;
    uint64_t starts; /* a hash of where the units begin */
} zero_units;

static void describe_options(const void *sig, const void *other, char *out, size_t cap, void *ctx) {
    const zero_options *o = sig;
    (void)other, (void)ctx;
    snprintf(out, cap, "stage %lld (prefetch %lld, %s units, deterministic %lld)",
             (long long)o->stage, (long long)o->prefetch, o->units_given ? "named" : "default",
             (long long)o->det);
}

static void describe_units(const void *sig, const void *other, char *out, size_t cap, void *ctx) {
    const zero_units *u = sig;
    (void)other, (void)ctx;
    snprintf(out, cap, "%lld units (%lld flat buffers) beginning at parameters hashed %016llx",
             (long long)u->n_units, (long long)u->n_flats, (unsigned long long)u->starts);
}

static td_status agree_units(td_zero *z) {
    zero_units u = {(int64_t)z->lay.n_units, (int64_t)z->lay.n_flats, 1469598103934665603ull};
    for (size_t k = 0; k < z->lay.n_units; k++)
        u.starts = (u.starts ^ z->lay.units[k].first_param) * 1099511628211ull;
    char what[32];
    snprintf(what, sizeof what, "zero rank %d", z->rank);
    td_comm_agreement a = {.what = what,
                           .sig = &u,
                           .bytes = sizeof u,
                           .mismatch = TD_EINVAL,
                           .describe = describe_units,
                           .hint = "; every rank must name the same units"};
    return td_comm_agree(z->comm, &a);
}

/* The optimizer's entries: each a part of a parameter, in this rank's chunk of the region. */
static td_status make_views(td_zero *z) {
    z->views = calloc(z->lay.n_views ? z->lay.n_views : 1, sizeof *z->views);
    if (!z->views) return td__fail(TD_ENOMEM, "zero rank %d: out of memory", z->rank);
    for (size_t v = 0; v < z->lay.n_views; v++) {
        const td__zero_view *w = &z->lay.views[v];
        const td__zero_flat *f = &z->lay.flats[w->flat];
        const td_param *p = &z->params[w->param];
        size_t es = td_dtype_size(p->dtype);
        z->views[v] = (td_param){.name = p->name,
                                 .data = flat_data(z, f) + w->flat_offset * es,
                                 .count = w->count,
                                 .dtype = p->dtype,
                                 .ndim = 1,
                                 .shape = {(int64_t)w->count},
                                 .split = p->split};
    }
    return TD_OK;
}

/* Points the views' gradients at where this step's reduced values are. */
static void refresh_views(td_zero *z) {
    for (size_t v = 0; v < z->lay.n_views; v++) {
        const td__zero_view *w = &z->lay.views[v];
        const td__zero_flat *f = &z->lay.flats[w->flat];
        size_t es = td_dtype_size(f->dtype);
        z->views[v].grad = z->sharded_grads
                               ? (unsigned char *)f->grad_shard +
                                     (w->flat_offset - (size_t)z->rank * f->chunk) * es
                               : (unsigned char *)z->params[w->param].grad + w->param_offset * es;
    }
    z->sync_steps = td_ddp_get_stats(z->ddp).sync_steps;
}

/* Parameters move into the region, flat by flat; at stage 3 only this rank's chunks stay. */
static td_status move_params(td_zero *z) {
    /* Stage 3 gathers on its own group: the region is that group's, so its gathers read the
     * other ranks' chunks in place. Nobody reads the rest of a rank's flats but the rank: its
     * own memory, whose pages move between gathered copies. */
    TD__TRY(td__zero_region_alloc(&z->mem, z->gather_comm ? z->gather_comm : z->comm,
                                  z->lay.region_bytes, z->rank, "parameters"));
    size_t largest = 0;
    for (size_t f = 0; z->opt.stage == 3 && z->world > 1 && f < z->lay.n_flats; f++) {
        const td__zero_flat *fl = &z->lay.flats[f];
        size_t lo = td__zero_chunk_at(fl, z->rank), hi = lo + fl->chunk * td_dtype_size(fl->dtype);
        TD__TRY(td__zero_region_private(&z->mem, fl->at, lo));
        TD__TRY(td__zero_region_private(&z->mem, fl->at + hi, fl->span - hi));
    }
    /* Parked: what the gathered copies of two of the largest units leave, the unit in use and
     * the one prefetched (each step's forward and backward then take what the last freed). On
     * one host only: pages that move under an address would go unseen by a transport library
     * that registered the memory (UCX, MPI over RDMA). */
    for (size_t u = 0; z->opt.stage == 3 && z->world > 1 && u < z->lay.n_units; u++) {
        size_t bytes = 0;
        for (size_t k = 0; k < z->lay.units[u].n_flats; k++) {
            const td__zero_flat *fl = &z->lay.flats[z->lay.units[u].first_flat + k];
            bytes += fl->span - fl->chunk * td_dtype_size(fl->dtype);
        }
        largest = bytes > largest ? bytes : largest;
    }
    int one_host = z->gather_comm && !strcmp(td_comm_backend_name(z->gather_comm), "shm");
    TD__TRY(td__zero_pool_init(&z->pool, z->mem.base, z->mem.bytes, one_host ? 2 * largest : 0,
                               z->rank));
    for (size_t f = 0; f < z->lay.n_flats; f++) {
        const td__zero_flat *fl = &z->lay.flats[f];
        size_t es = td_dtype_size(fl->dtype);
        for (size_t m = 0; m < fl->n_members; m++) {
            td_param *p = &z->params[fl->members[m]];
            void *to = flat_data(z, fl) + fl->offset[m] * es;
            if (p->count) memcpy(to, p->data, p->count * es);
            p->data = to;
        }
        td__zero_account_add(
            &z->lay.acct, ZERO_PARAMS,
            (long long)((z->opt.stage == 3 ? 1 : (size_t)z->world) * fl->chunk * es));
    }
    if (z->opt.stage == 3) {
        for (size_t u = 0; u < z->lay.n_units; u++) {
            z->lay.units[u].whole = 1;
            for (size_t k = 0; k < z->lay.units[u].n_flats; k++) {
                const td__zero_flat *f = &z->lay.flats[z->lay.units[u].first_flat + k];
                td__zero_account_add(
                    &z->lay.acct, ZERO_GATHERED,
                    (long long)(f->chunk * (size_t)(z->world - 1) * td_dtype_size(f->dtype)));
            }
            unit_release(z, u);
        }
    }
    return TD_OK;
}

static td_status check_options(const td_zero *z, const td_param *params, size_t n) {
    if (z->opt.stage < 1 || z->opt.stage > 3)
        return td__fail(TD_EINVAL, "zero rank %d: stage %d, expected 1, 2 or 3", z->rank,
                        z->opt.stage);
    if (z->opt.ddp.join)
        return td__fail(TD_EINVAL, "zero rank %d: join (uneven inputs) is not supported", z->rank);
    if (z->opt.units && !z->opt.n_units)
        return td__fail(TD_EINVAL, "zero rank %d: units given with n_units 0", z->rank);
    for (size_t i = 0; i < n; i++)
        if (params[i].device.type != TD_DEVICE_CPU)
            return td__fail(TD_EUNSUPPORTED,
                            "zero rank %d: parameter '%s' lives on a device; ZeRO shards host "
                            "memory only",
                            z->rank, params[i].name ? params[i].name : "?");
    return TD_OK;
}

td_status td_zero_create(td_zero **out, td_comm *comm, td_param *params, size_t n_params,
                         td_param *buffers, size_t n_buffers, const td_zero_params *p) {
    if (!out || !comm || (n_params && !params) || (n_buffers && !buffers))
        return td__fail(TD_EINVAL, "td_zero_create: out, comm, params or buffers is NULL");
    *out = NULL;
    td_zero *z = calloc(1, sizeof *z);
    if (!z) return td__fail(TD_ENOMEM, "td_zero_create: out of memory");
    z->comm = comm;
    z->rank = td_comm_rank(comm);
    z->world = td_comm_size(comm);
    z->opt = p ? *p : td_zero_default_params();
    z->params = params;
    z->n_params = n_params;
    z->orig_data = calloc(n_params ? n_params : 1, sizeof *z->orig_data);
    for (size_t i = 0; z->orig_data && i < n_params; i++) z->orig_data[i] = params[i].data;
    td_status local = z->orig_data ? check_options(z, params, n_params)
                                   : td__fail(TD_ENOMEM, "td_zero_create: out of memory");
    if (local == TD_OK)
        local = td__zero_plan(&z->lay, params, n_params, z->opt.units, z->opt.n_units, z->rank,
                              z->world, z->opt.stage == 3 ? td__zero_pages(1) : 64);
    char what[32];
    snprintf(what, sizeof what, "zero rank %d", z->rank);
    zero_options o = {z->opt.stage, z->opt.prefetch != 0, z->opt.units != NULL,
                      z->opt.ddp.deterministic != 0};
    td_comm_agreement a = {.what = what,
                           .local = local,
                           .sig = &o,
                           .bytes = sizeof o,
                           .mismatch = TD_EINVAL,
                           .describe = describe_options,
                           .hint = "; every rank must create ZeRO with the same options"};
    td_status s = td_comm_agree(comm, &a);
    /* Gradients: DDP's all-reduce at stage 1, the shard tree in deterministic mode, else the
     * reduce-scatter into shards, over ZeRO's layout. */
    z->sharded_grads = z->opt.stage >= 2 && !z->opt.ddp.deterministic;
    if (s == TD_OK)
        s = z->sharded_grads
                ? td__ddp_create_with(&z->ddp, comm, params, n_params, buffers, n_buffers,
                                      &z->opt.ddp, &td__ddp_reduce_scatter, &z->lay)
                : td_ddp_create(&z->ddp, comm, params, n_params, buffers, n_buffers, &z->opt.ddp);
    if (s == TD_OK) s = agree_units(z);
    if (s == TD_OK && z->opt.stage == 3) s = td_comm_split(comm, 0, z->rank, &z->gather_comm);
    if (s == TD_OK) s = move_params(z);
    if (s == TD_OK) s = make_views(z);
    if (s != TD_OK) {
        char msg[768];
        snprintf(msg, sizeof msg, "%s", td_last_error());
        td_zero_destroy(z);
        return td__fail(s, "%s", msg);
    }
    refresh_views(z);
    if (!z->sharded_grads) /* DDP's buckets or tree: one whole copy, counted */
        for (size_t k = 0; k < z->ddp->n_buckets; k++)
            td__zero_account_add(
                &z->lay.acct, ZERO_GRADS,
                (long long)(z->ddp->buckets[k].count * td_dtype_size(z->ddp->buckets[k].dtype)));
    for (int k = 0; k < ZERO_KINDS; k++) z->lay.acct.peak[k] = z->lay.acct.now[k];
    z->lay.acct.peak_total = z->lay.acct.total; /* peaks count from here */
    td__log(TD_LOG_INFO,
            "zero rank %d/%d: stage %d, %zu parameters in %zu units (%zu flats), "
            "%zu of them in this rank's chunks",
            z->rank, z->world, z->opt.stage, n_params, z->lay.n_units, z->lay.n_flats,
            z->lay.n_views);
    *out = z;
    return TD_OK;
}

void td_zero_destroy(td_zero *z) {
    if (!z) return;
    for (size_t f = 0; f < z->lay.n_flats; f++) (void)flat_wait(&z->lay.flats[f]);
    td_ddp_destroy(z->ddp); /* gradients back where the trainer had them */
    int whole = z->opt.stage == 3 ? z->hold : !z->dirty;
    for (size_t i = 0; z->orig_data && i < z->n_params; i++) {
        td_param *p = &z->params[i];
        void *orig = z->orig_data[i];
        if (whole && orig && p->data != orig && p->count)
            memcpy(orig, p->data, p->count * td_dtype_size(p->dtype));
        p->data = orig;
    }
    td__zero_pool_free(&z->pool);
    td__zero_region_free(&z->mem);
    if (z->gather_comm) td_comm_destroy(z->gather_comm);
    td__zero_layout_free(&z->lay);
    free(z->views);
    free(z->orig_data);
    free(z);
}

/* ---- one iteration ------------------------------------------------------------------- */

td_status td_zero_parameters(td_zero *z, td_param **shards, size_t *n) {
    if (!z || !shards || !n) return td__fail(TD_EINVAL, "td_zero_parameters: NULL argument");
    *shards = z->views;
    *n = z->lay.n_views;
    return TD_OK;
}

td_status td_zero_prepare_forward(td_zero *z) {
    if (!z) return td__fail(TD_EINVAL, "td_zero_prepare_forward: zero is NULL");
    if (z->opt.stage < 3 && z->dirty) TD__TRY(gather_all(z));
    /* Units a forward without a backward kept whole (the last ones, below) may be stale now. */
    if (z->opt.stage == 3) release_all(z);
    z->uses = 0;
    return td_ddp_prepare_forward(z->ddp);
}

void td_zero_zero_grad(td_zero *z) {
    if (z) td_ddp_zero_grad(z->ddp);
}

td_status td_zero_grad_ready(td_zero *z, size_t i) {
    if (!z) return td__fail(TD_EINVAL, "td_zero_grad_ready: zero is NULL");
    return td_ddp_grad_ready(z->ddp, i);
}

void td_zero_grad_ready_hook(size_t i, void *zero) {
    td_zero *z = zero;
    if (!z) return;
    td_status s = td_zero_grad_ready(z, i);
    if (s != TD_OK && z->err == TD_OK) {
        z->err = s;
        snprintf(z->err_msg, sizeof z->err_msg, "%s", td_last_error());
    }
}

td_status td_zero_param_use(td_zero *z, size_t i, td_param_use use) {
    if (!z) return td__fail(TD_EINVAL, "td_zero_param_use: zero is NULL");
    if (i >= z->n_params)
        return td__fail(TD_EINVAL, "zero rank %d: parameter index %zu, but %zu are registered",
                        z->rank, i, z->n_params);
    /* Stages 2 and 3: the unit's whole gradients go to its slot of the ring (zero_reduce.c). */
    if (use == TD_PARAM_BEFORE_BACKWARD) td__ddp_before_backward(z->ddp, i);
    if (z->opt.stage < 3) return TD_OK;
    size_t u = z->lay.unit_of[i];
    td__zero_unit *un = &z->lay.units[u];
    if (use == TD_PARAM_AFTER_FORWARD || use == TD_PARAM_AFTER_BACKWARD) {
        size_t *done = use == TD_PARAM_AFTER_FORWARD ? &un->forward_done : &un->backward_done;
        /* The last units of a forward are the first of the backward: those it would gather
         * again at once (the unit it starts with, and the one it prefetches) stay whole, which
         * holds no more than the forward's own unit in use and prefetched one did. */
        size_t reused = z->opt.prefetch ? 2 : 1;
        if (++*done == un->n_params) {
            *done = 0;
            if (use == TD_PARAM_AFTER_BACKWARD || u + reused < z->lay.n_units) unit_release(z, u);
        }
        return TD_OK;
    }
    int backward = use == TD_PARAM_BEFORE_BACKWARD;
    z->uses++;
    TD__TRY(unit_gather(z, u, 1));
    /* The neighbour the sweep reaches next: units run in registration order forward. */
    size_t next = backward ? u - 1 : u + 1;
    if (z->opt.prefetch && (backward ? u > 0 : u + 1 < z->lay.n_units) && !z->lay.units[next].whole)
        TD__TRY(unit_gather(z, next, 0));
    return TD_OK;
}

td_status td_zero_param_use_hook(size_t i, td_param_use use, void *zero) {
    return td_zero_param_use(zero, i, use);
}

td_status td_zero_finish_backward(td_zero *z) {
    if (!z) return td__fail(TD_EINVAL, "td_zero_finish_backward: zero is NULL");
    td_status s = td_ddp_finish_backward(z->ddp);
    if (z->opt.stage == 3) release_all(z);
    /* Parameters nobody gathered read as zeros: a forward without the hooks computed nothing. */
    if (s == TD_OK && z->opt.stage == 3 && z->n_params && !z->uses && z->hold == 0)
        s = td__fail(TD_ESTATE,
                     "zero rank %d: stage 3 gathers parameters before they are read, but this "
                     "iteration made no td_zero_param_use call: install "
                     "td_graph_set_param_use_hook(g, td_zero_param_use_hook, zero) (or call "
                     "td_zero_param_use around each layer)",
                     z->rank);
    if (td_ddp_get_stats(z->ddp).sync_steps != z->sync_steps) {
        refresh_views(z);
        z->dirty = z->opt.stage < 3;
    }
    if (z->err != TD_OK) {
        td_status e = z->err;
        z->err = TD_OK;
        return td__fail(e, "%s", z->err_msg);
    }
    return s;
}

td_status td_zero_set_sync(td_zero *z, int sync) {
    if (!z) return td__fail(TD_EINVAL, "td_zero_set_sync: zero is NULL");
    return td_ddp_set_sync(z->ddp, sync);
}

void td_zero_set_loss(td_zero *z, float loss) {
    if (z) td_ddp_set_loss(z->ddp, loss);
}

float td_zero_loss(const td_zero *z) { return z ? td_ddp_loss(z->ddp) : 0.0f; }

void td_zero_shards(const td_zero *z, size_t *first, size_t *count) {
    td_ddp_shards(z ? z->ddp : NULL, first, count);
}

/* ---- whole parameters, clipping, memory ----------------------------------------------- */

td_status td_zero_full_params(td_zero *z, int hold) {
    if (!z) return td__fail(TD_EINVAL, "td_zero_full_params: zero is NULL");
    if (z->opt.stage < 3) return z->dirty ? gather_all(z) : TD_OK;
    if (!hold) {
        z->hold = 0;
        release_all(z);
        return TD_OK;
    }
    td_status s = TD_OK;
    for (size_t u = 0; u < z->lay.n_units && s == TD_OK; u++)
        if (!z->lay.units[u].whole) s = unit_gather(z, u, 0);
    for (size_t u = 0; u < z->lay.n_units; u++) {
        td_status w = unit_gather(z, u, 1);
        if (s == TD_OK) s = w;
    }
    if (s == TD_OK) z->hold = 1;
    return s;
}

/* Deterministic mode: every rank's stepped-to-be gradients (the views, perhaps unscaled) whole
 * in params[i].grad again, flat by flat through a staging copy in the flat's layout. */
static td_status gather_grads(td_zero *z) {
    size_t most = 0;
    for (size_t f = 0; f < z->lay.n_flats; f++)
        if (z->lay.flats[f].span > most) most = z->lay.flats[f].span;
    unsigned char *stage = aligned_alloc(64, most ? most : 64);
    if (!stage) return td__fail(TD_ENOMEM, "zero rank %d: out of memory", z->rank);
    memset(stage, 0, most);
    td_status s = TD_OK;
    for (size_t f = 0; f < z->lay.n_flats && s == TD_OK; f++) {
        const td__zero_flat *fl = &z->lay.flats[f];
        size_t es = td_dtype_size(fl->dtype);
        for (size_t v = 0; v < z->lay.n_views; v++)
            if (z->lay.views[v].flat == f)
                memcpy(stage + z->lay.views[v].flat_offset * es, z->views[v].grad,
                       z->views[v].count * es);
        s = td_comm_allgather(z->comm, stage + td__zero_chunk_at(fl, z->rank), stage, fl->chunk,
                              fl->dtype);
        for (size_t m = 0; m < fl->n_members && s == TD_OK; m++) {
            const td_param *p = &z->params[fl->members[m]];
            memcpy(p->grad, stage + fl->offset[m] * es, p->count * es);
        }
    }
    free(stage);
    return s;
}

int td__zero_grads_sharded(const td_zero *z) { return z->sharded_grads; }

td_status td__zero_whole_grads(td_zero *z) {
    return z->opt.ddp.deterministic ? gather_grads(z) : TD_OK;
}

td_status td_zero_clip_grad_norm(td_zero *z, double max_norm, double *total_norm) {
    if (!z) return td__fail(TD_EINVAL, "td_zero_clip_grad_norm: zero is NULL");
    if (!(max_norm > 0))
        return td__fail(TD_EINVAL, "td_zero_clip_grad_norm: max_norm %g, expected > 0", max_norm);
    if (z->opt.ddp.deterministic) {
        TD__TRY(gather_grads(z));
        return td_clip_grad_norm(z->params, z->n_params, max_norm, total_norm);
    }
    td__sumsq acc;
    td__sumsq_init(&acc);
    TD__TRY(td__grads_sumsq(z->views, z->lay.n_views, &acc, "td_zero_clip_grad_norm"));
    TD__TRY(td__sumsq_allreduce(&acc, &z->comm, 1));
    return td__grads_clip(z->views, z->lay.n_views, max_norm, td__sumsq_value(&acc), total_norm,
                          "td_zero_clip_grad_norm");
}

void td__zero_parts_of(td_zero *z, td__zero_parts *out) {
    *out =
        (td__zero_parts){z->comm, z->rank, z->opt.stage, z->params, z->n_params, &z->lay, z->views};
}

td_status td__zero_loaded(td_zero *z) {
    z->dirty = 0;
    if (z->opt.stage == 3 && !z->hold) release_all(z); /* whole copies of the old values */
    if (z->opt.stage < 3 || !z->hold) return TD_OK;
    z->hold = 0;
    release_all(z);
    return td_zero_full_params(z, 1);
}

static size_t optim_bytes(const td_optim *optim) {
    td_param *state;
    size_t n, bytes = 0;
    td_optim_state((td_optim *)optim, &state, &n);
    for (size_t i = 0; i < n; i++) bytes += state[i].count * td_dtype_size(state[i].dtype);
    return bytes;
}

td_zero_memory td_zero_memory_stats(const td_zero *z, const td_optim *optim) {
    td_zero_memory m;
    memset(&m, 0, sizeof m);
    if (!z) return m;
    const td__zero_account *a = &z->lay.acct;
    size_t ob = optim ? optim_bytes(optim) : 0;
    m.now = (td_zero_bytes){a->now[ZERO_PARAMS],   a->now[ZERO_GRADS],    ob,
                            a->now[ZERO_GATHERED], a->now[ZERO_REDUCING], a->now[ZERO_CACHED],
                            a->total + ob};
    m.peak = (td_zero_bytes){a->peak[ZERO_PARAMS],   a->peak[ZERO_GRADS],    ob,
                             a->peak[ZERO_GATHERED], a->peak[ZERO_REDUCING], a->peak[ZERO_CACHED],
                             a->peak_total + ob};
    return m;
}

void td_zero_layout(const td_zero *z, int *stage, size_t *n_units, size_t *n_flats) {
    if (stage) *stage = z ? z->opt.stage : 0;
    if (n_units) *n_units = z ? z->lay.n_units : 0;
    if (n_flats) *n_flats = z ? z->lay.n_flats : 0;
}
