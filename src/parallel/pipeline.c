/* td_pipeline: creating a stage (the groups, the cut, the micro-batch graphs that share one
 * set of parameters and gradients, the transfer channels, the replicas' DDP), the agreement
 * checks every rank runs at creation and at the start of every call, the failure path that ends
 * every group so no rank hangs, and the accessors. The schedules themselves are in
 * pipeline_schedule.c, the transfers in pipeline_channel.c and the choice of cut in
 * pipeline_split.c. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/recorder.h"

#include "core/core_impl.h"
#include "parallel/pipeline_impl.h"

td_pipeline_params td_pipeline_default_params(void) {
    td_pipeline_params p;
    memset(&p, 0, sizeof p);
    p.schedule = TD_SCHEDULE_1F1B;
    p.stages = 2;
    p.micro_batches = 4;
    p.batch = 128;
    p.split = NULL;
    p.seed = 0;
    p.balance_reps = 5;
    p.transfer_nice = -10;
    p.graph = td_graph_default_params();
    p.ddp = td_ddp_default_params();
    p.zero_stage = 0;
    p.trace = NULL;
    return p;
}

static const char *const schedule_names[] = {"naive", "gpipe", "1f1b"};

const char *td_pipeline_schedule_name(td_pipeline_schedule s) {
    return (unsigned)s < 3 ? schedule_names[s] : "invalid";
}

td_status td_pipeline_schedule_parse(const char *name, td_pipeline_schedule *out) {
    if (!name || !out) return td__fail(TD_EINVAL, "td_pipeline_schedule_parse: NULL argument");
    for (int i = 0; i < 3; i++)
        if (strcmp(name, schedule_names[i]) == 0) {
            *out = (td_pipeline_schedule)i;
            return TD_OK;
        }
    return td__fail(TD_EINVAL, "unknown pipeline schedule '%s' (expected naive, gpipe or 1f1b)",
                    name);
}

/* ---- failure ------------------------------------------------------------------------ */

void td__pp_stage_name(const td_pipeline *pp, int rank, char *out, size_t cap) {
    int s = rank % pp->P, d = rank / pp->P;
    if (pp->D > 1)
        snprintf(out, cap, "stage %d (rank %d, replica %d)", s, rank, d);
    else
        snprintf(out, cap, "stage %d (rank %d)", s, rank);
}

td_status td__pp_fail(td_pipeline *pp, td_status s, const char *fmt, ...) {
    if (pp->failed) return td__fail(pp->failed, "%s", pp->failed_msg);
    char what[768], me[64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    td__pp_stage_name(pp, pp->rank, me, sizeof me);
    snprintf(pp->failed_msg, sizeof pp->failed_msg, "pipeline %s of %d, step %llu: %s", me, pp->P,
             (unsigned long long)pp->step, what);
    pp->failed = s;
    /* No rank may go on waiting for this one. */
    if (pp->pipe) (void)td_comm_abort(pp->pipe);
    if (pp->dp) (void)td_comm_abort(pp->dp);
    for (int k = 0; k < pp->n_tied_groups; k++)
        if (pp->tied_groups[k]) (void)td_comm_abort(pp->tied_groups[k]);
    return td__fail(s, "%s", pp->failed_msg);
}

/* ---- building ----------------------------------------------------------------------- */

static void *buffer(size_t payload) {
    size_t bytes = (PP_HDR + payload + 63) / 64 * 64;
    void *p = aligned_alloc(64, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

static td_status build_slot(td_pipeline *pp, const td_sequential *model, int k) {
    pp_slot *sl = &pp->slots[k];
    int first = pp->stage == 0, last = pp->stage + 1 == pp->P;
    td_graph_params gp = pp->opt.graph;
    gp.grad_enabled = 1;
    TD__TRY(td_graph_create(&sl->g, &gp));
    TD__TRY(td_graph_input(sl->g, first ? "input" : "stage_input", pp->in_shape, TD_F32, !first,
                           &sl->input));
    TD__TRY(td_sequential_build(model, sl->g, pp->first_layer, pp->last_layer, sl->input,
                                pp->opt.seed, &sl->output));
    /* Under mixed precision a stage may end in bf16 or f16; activations cross stages in f32,
     * as its input was declared. */
    if (!last && td_tensor_dtype(sl->output) != TD_F32)
        TD__TRY(td_graph_cast(sl->g, sl->output, TD_F32, &sl->output));
    if (last) {
        /* One label per row of the logits: a classifier's sample is one row, a GPT's sequence
         * of T tokens T rows. */
        td_shape os = td_tensor_shape(sl->output);
        if (os.ndim != 2 || os.dim[0] % pp->b) {
            char dims[128];
            return td__fail(TD_ESHAPE,
                            "pipeline: the last layer gives logits of shape %s for a micro-batch "
                            "of %lld samples; expected (rows, classes), the same rows per sample",
                            td__dims_str(dims, sizeof dims, os.ndim, os.dim), (long long)pp->b);
        }
        pp->label_rows = os.dim[0] / pp->b;
        TD__TRY(td_graph_input(sl->g, "labels", td_shape_1d(os.dim[0]), TD_I64, 0, &sl->labels));
        TD__TRY(td_sequential_loss(model, sl->g, sl->output, sl->labels, &sl->loss, &sl->logp));
    }
    TD__TRY(td_graph_compile(sl->g));
    if (k > 0) TD__TRY(td_graph_share_params(sl->g, pp->slots[0].g));
    TD__TRY(td_graph_parameters(sl->g, &sl->params, &sl->n_params));
    TD__TRY(td_graph_buffers(sl->g, &sl->buffers, &sl->n_buffers));
    if (!first && (!(sl->act_in = buffer(pp->in_bytes)) || !(sl->grad_out = buffer(pp->in_bytes))))
        return td__fail(TD_ENOMEM, "pipeline: out of memory for transfer buffers");
    if (!last && (!(sl->act_out = buffer(pp->out_bytes)) || !(sl->grad_in = buffer(pp->out_bytes))))
        return td__fail(TD_ENOMEM, "pipeline: out of memory for transfer buffers");
    sl->j_act_in.buf = sl->act_in;
    sl->j_grad_out.buf = sl->grad_out;
    sl->j_act_in.bytes = sl->j_grad_out.bytes = PP_HDR + pp->in_bytes;
    sl->j_act_out.buf = sl->act_out;
    sl->j_grad_in.buf = sl->grad_in;
    sl->j_act_out.bytes = sl->j_grad_in.bytes = PP_HDR + pp->out_bytes;
    return TD_OK;
}

/* This stage's layers and graphs; local. */
static td_status build_stage(td_pipeline *pp, const td_sequential *model) {
    TD__TRY(td_sequential_shape_on(model, pp->first_layer, pp->b, pp->tp, &pp->in_shape));
    TD__TRY(td_sequential_shape_on(model, pp->last_layer, pp->b, pp->tp, &pp->out_shape));
    pp->in_bytes = (size_t)td_shape_numel(&pp->in_shape) * sizeof(float);
    pp->out_bytes = (size_t)td_shape_numel(&pp->out_shape) * sizeof(float);
    if (pp->opt.schedule == TD_SCHEDULE_1F1B)
        pp->K = pp->M < pp->P - pp->stage ? pp->M : pp->P - pp->stage;
    else
        pp->K = pp->M;
    pp->slots = calloc((size_t)pp->K, sizeof *pp->slots);
    pp->ops = calloc(2 * (size_t)pp->M, sizeof *pp->ops);
    if (!pp->slots || !pp->ops) return td__fail(TD_ENOMEM, "pipeline: out of memory");
    for (int k = 0; k < pp->K; k++) TD__TRY(build_slot(pp, model, k));
    /* The parameter gradients' share of a graph's memory is not per micro-batch. */
    size_t grads = 0;
    for (size_t i = 0; i < pp->slots[0].n_params; i++)
        grads += (pp->slots[0].params[i].count * sizeof(float) + 63) / 64 * 64;
    size_t mem = td_graph_memory_bytes(pp->slots[0].g);
    pp->stats.activation_bytes = mem > grads ? mem - grads : 0;
    return TD_OK;
}

/* ---- agreement ---------------------------------------------------------------------- */

/* What every rank must have passed to td_pipeline_create, checked before anything collective
 * can hang. */
typedef struct {
    int64_t stages, micro_batches, batch, schedule, layers, replicas;
    uint64_t seed;
    char split[96];           /* as given, cut at 95 bytes ("" when balanced) */
    uint8_t split_digest[32]; /* SHA-256 of the whole split */
    uint8_t model_digest[32]; /* SHA-256 of the sample shape and the layer names */
} pp_options;

static const char *const option_names[] = {"stages",   "micro_batches", "batch",
                                           "schedule", "layers",        "replicas"};

static void describe_options(const void *sig, const void *other, char *out, size_t cap, void *ctx) {
    const pp_options *a = sig, *b = other;
    (void)ctx;
    const int64_t *x = &a->stages, *y = &b->stages;
    for (int i = 0; i < 6; i++)
        if (x[i] != y[i]) {
            snprintf(out, cap, "%s = %lld", option_names[i], (long long)x[i]);
            return;
        }
    if (a->seed != b->seed)
        snprintf(out, cap, "seed %llu", (unsigned long long)a->seed);
    else if (memcmp(a->split_digest, b->split_digest, 32) != 0)
        snprintf(out, cap, "split '%s'", a->split);
    else
        snprintf(out, cap, "a model of other layer names or sample shape (digest %02x%02x%02x%02x)",
                 a->model_digest[0], a->model_digest[1], a->model_digest[2], a->model_digest[3]);
}

static void model_digest(const td_sequential *m, uint8_t digest[32]) {
    td_sha256_ctx h;
    td_sha256_init(&h);
    td_shape s = td_sequential_sample_shape(m);
    int64_t ndim = s.ndim;
    td_sha256_update(&h, &ndim, sizeof ndim);
    td_sha256_update(&h, s.dim, (size_t)s.ndim * sizeof *s.dim);
    for (size_t i = 0; i < td_sequential_count(m); i++) {
        const char *n = td_sequential_layer_name(m, i);
        td_sha256_update(&h, n, strlen(n) + 1);
    }
    td_sha256_final(&h, digest);
}

/* The cuts as every rank sees them: where each stage starts, and the shape of the activations
 * that cross each cut as this rank's model computes them. Ranks built from different models
 * disagree here, before any activation is misread. */
typedef struct {
    int64_t first[TD_PIPELINE_MAX_STAGES + 1];
    int64_t ndim[TD_PIPELINE_MAX_STAGES], dims[TD_PIPELINE_MAX_STAGES][TD_MAX_DIMS];
} pp_cuts;

typedef struct {
    const td_sequential *model;
    int stages;
} pp_cut_words;

static void describe_cuts(const void *sig, const void *other, char *out, size_t cap, void *ctx) {
    const pp_cuts *a = sig, *b = other;
    const pp_cut_words *w = ctx;
    int c = 1;
    while (c < w->stages && a->first[c] == b->first[c] && a->ndim[c] == b->ndim[c] &&
           memcmp(a->dims[c], b->dims[c], sizeof a->dims[c]) == 0)
        c++;
    if (c == w->stages) { /* the cuts agree; what differs is not a cut's */
        snprintf(out, cap, "other cuts");
        return;
    }
    char dims[128];
    size_t layer = (size_t)a->first[c];
    snprintf(out, cap, "activations of shape %s between '%s' and '%s'",
             td__dims_str(dims, sizeof dims, a->ndim[c], a->dims[c]),
             td_sequential_layer_name(w->model, layer - 1),
             td_sequential_layer_name(w->model, layer));
}

/* Checks that need no other rank; the message goes to every rank. */
static td_status check_local(const td_pipeline_params *p, const td_sequential *model,
                             td_comm *comm) {
    int world = td_comm_size(comm);
    if (p->mesh && td_mesh_comm(p->mesh) != comm)
        return td__fail(TD_EINVAL, "pipeline: the mesh was made over another group than the one "
                                   "given to td_pipeline_create");
    if (p->mesh && (!td_mesh_group(p->mesh, "pp") || td_mesh_size(p->mesh, "pp") != p->stages))
        return td__fail(TD_EINVAL, "pipeline: %d stages, but the mesh's pp dimension has %d%s",
                        p->stages, td_mesh_size(p->mesh, "pp"),
                        td_mesh_group(p->mesh, "pp") ? "" : " (it has none)");
    if ((unsigned)p->schedule > TD_SCHEDULE_1F1B)
        return td__fail(TD_EINVAL, "pipeline: unknown schedule %d", (int)p->schedule);
    if (p->stages < 1 || p->stages > TD_PIPELINE_MAX_STAGES)
        return td__fail(TD_EINVAL, "pipeline: %d stages (1 to %d)", p->stages,
                        TD_PIPELINE_MAX_STAGES);
    if (world % p->stages)
        return td__fail(TD_EINVAL,
                        "pipeline: the group has %d ranks, not a multiple of %d stages (it must "
                        "hold stages x replicas ranks)",
                        world, p->stages);
    if (p->micro_batches < 1 || p->batch < 1 || p->batch % p->micro_batches)
        return td__fail(TD_EINVAL, "pipeline: batch %lld does not split into %d micro-batches",
                        (long long)p->batch, p->micro_batches);
    if ((size_t)p->stages > td_sequential_count(model))
        return td__fail(TD_EINVAL, "pipeline: %d stages for a model of %zu layers", p->stages,
                        td_sequential_count(model));
    if (p->balance_reps < 1)
        return td__fail(TD_EINVAL, "pipeline: balance_reps %d (>= 1)", p->balance_reps);
    return TD_OK;
}

static td_status agree_on_options(td_pipeline *pp, td_comm *comm, const td_sequential *model) {
    pp_options mine;
    memset(&mine, 0, sizeof mine);
    mine.stages = pp->opt.stages;
    mine.micro_batches = pp->M;
    mine.batch = pp->opt.batch;
    mine.schedule = pp->opt.schedule;
    mine.layers = (int64_t)td_sequential_count(model);
    mine.replicas = pp->opt.mesh         ? td_mesh_size(pp->opt.mesh, "dp")
                    : pp->opt.stages > 0 ? pp->world / pp->opt.stages
                                         : 0;
    mine.seed = pp->opt.seed;
    const char *split = pp->opt.split ? pp->opt.split : "";
    snprintf(mine.split, sizeof mine.split, "%s", split);
    td_sha256(split, strlen(split), mine.split_digest);
    model_digest(model, mine.model_digest);
    td_comm_agreement a = {
        .what = "pipeline",
        .local = check_local(&pp->opt, model, comm),
        .sig = &mine,
        .bytes = sizeof mine,
        .describe = describe_options,
        .hint = "; every rank must create the pipeline with the same options and model"};
    return td_comm_agree(comm, &a);
}

static td_status agree_on_cuts(td_pipeline *pp, td_comm *comm, const td_sequential *model,
                               td_status built) {
    pp_cuts mine;
    memset(&mine, 0, sizeof mine);
    td_status local = built;
    for (int c = 0; c <= pp->P; c++) mine.first[c] = (int64_t)pp->stage_first[c];
    for (int c = 1; c < pp->P && local == TD_OK; c++) {
        td_shape at;
        local = td_sequential_shape_on(model, pp->stage_first[c], pp->b, pp->tp, &at);
        mine.ndim[c] = at.ndim;
        for (int i = 0; i < at.ndim; i++) mine.dims[c][i] = at.dim[i];
    }
    pp_cut_words words = {model, pp->P};
    td_comm_agreement a = {.what = "pipeline",
                           .local = local,
                           .sig = &mine,
                           .bytes = sizeof mine,
                           .mismatch = TD_ESHAPE,
                           .describe = describe_cuts,
                           .describe_ctx = &words,
                           .hint = "; the stages were built from different models"};
    return td_comm_agree(comm, &a);
}

static td_status start_channels(td_pipeline *pp) {
    td_trace *tr = pp->opt.trace;
    if (pp->stage > 0) {
        TD__TRY(td__pp_channel_start(&pp->act_in, pp->pipe, pp->stage - 1, PP_TAG_ACT, 0,
                                     "recv activations", tr, pp->opt.transfer_nice));
        TD__TRY(td__pp_channel_start(&pp->grad_out, pp->pipe, pp->stage - 1, PP_TAG_GRAD, 1,
                                     "send gradients", tr, pp->opt.transfer_nice));
    }
    if (pp->stage + 1 < pp->P) {
        TD__TRY(td__pp_channel_start(&pp->act_out, pp->pipe, pp->stage + 1, PP_TAG_ACT, 1,
                                     "send activations", tr, pp->opt.transfer_nice));
        TD__TRY(td__pp_channel_start(&pp->grad_in, pp->pipe, pp->stage + 1, PP_TAG_GRAD, 0,
                                     "recv gradients", tr, pp->opt.transfer_nice));
    }
    return TD_OK;
}

/* Deterministic mode's conditions, the same on every rank: each micro-batch one of the
 * replica's shards of the shard tree, which averages no buffers across micro-batches run out of
 * order. */
static td_status check_deterministic(const td_pipeline *pp) {
    size_t S = pp->opt.ddp.shards, D = (size_t)pp->D;
    if (S % D || S / D != (size_t)pp->M)
        return td__fail(TD_EINVAL,
                        "pipeline: deterministic mode runs each of a replica's shards as one "
                        "micro-batch: %zu shards over %d replica(s) is %zu each, not %d "
                        "micro-batches",
                        S, pp->D, S / D, pp->M);
    if (pp->slots && pp->slots[0].n_buffers)
        return td__fail(TD_EUNSUPPORTED,
                        "pipeline: deterministic mode with buffers ('%s'): a stage runs the "
                        "forwards of later micro-batches before the backwards of earlier ones",
                        pp->slots[0].buffers[0].name);
    return TD_OK;
}

static td_status create(td_pipeline *pp, td_comm *comm, const td_sequential *model) {
    TD__TRY(agree_on_options(pp, comm, model));
    pp->P = pp->opt.stages;
    pp->b = pp->opt.batch / pp->M;
    pp->det = pp->opt.ddp.deterministic != 0;
    const td_mesh *mesh = pp->opt.mesh;
    /* deterministic mode's shard tree runs over the replicas however many there are */
    if (mesh) { /* the mesh's groups: stages along pp, replicas along dp, each stage split on tp */
        pp->D = td_mesh_size(mesh, "dp");
        pp->stage = td_mesh_coord(mesh, "pp");
        pp->replica = td_mesh_coord(mesh, "dp");
        pp->mesh_groups = 1;
        pp->pipe = td_mesh_group(mesh, "pp");
        pp->dp = pp->D > 1 || pp->det ? td_mesh_group(mesh, "dp") : NULL;
        pp->tp = td_mesh_group(mesh, "tp");
        pp->opt.graph.comm = pp->tp;
    } else {
        pp->D = pp->world / pp->P;
        pp->stage = pp->rank % pp->P;
        pp->replica = pp->rank / pp->P;
        TD__TRY(td_comm_split(comm, pp->replica, pp->stage, &pp->pipe));
        if (pp->D > 1 || pp->det) TD__TRY(td_comm_split(comm, pp->stage, pp->replica, &pp->dp));
    }
    TD__TRY(td__pp_choose_split(comm, model, pp->opt.split, pp->P, pp->b, pp->opt.balance_reps,
                                pp->stage_first));
    size_t L = td_sequential_count(model);
    pp->stage_first[pp->P] = L;
    pp->first_layer = pp->stage_first[pp->stage];
    pp->last_layer = pp->stage_first[pp->stage + 1];
    td_status built = build_stage(pp, model);
    if (built == TD_OK && pp->det) built = check_deterministic(pp);
    TD__TRY(agree_on_cuts(pp, comm, model, built));
    TD__TRY(td__pp_tie(pp));
    if (pp->dp && pp->opt.zero_stage >= 2 && !pp->opt.ddp.deterministic) {
        /* Sharded gradients are gone from params[i].grad before the stages could sum a tied
         * one: every stage hears of a tie anywhere, so all of them refuse together. */
        int tied = pp->n_tied;
        TD__TRY(td_comm_allreduce(pp->pipe, &tied, &tied, 1, TD_I32, TD_OP_MAX));
        if (tied)
            return td__fail(TD_EINVAL,
                            "td_pipeline_create: stages share a tied parameter%s%s%s, which ZeRO "
                            "stage %d cannot sum across stages (its gradients end sharded); use "
                            "zero_stage 1, DDP or the deterministic mode",
                            pp->n_tied ? " such as '" : "",
                            pp->n_tied ? pp->slots[0].params[pp->tied[0].param].name : "",
                            pp->n_tied ? "'" : "", pp->opt.zero_stage);
    }
    TD__TRY(start_channels(pp));
    if (pp->dp) {
        pp->replicas = pp->opt.zero_stage ? &td__replicas_zero : &td__replicas_ddp;
        td_ddp_params dp = pp->opt.ddp;
        if (!dp.trace) dp.trace = pp->opt.trace;
        pp_slot *s0 = &pp->slots[0];
        TD__TRY(pp->replicas->create(&pp->replicas_impl, pp->dp, s0->params, s0->n_params,
                                     s0->buffers, s0->n_buffers, &dp, pp->opt.zero_stage));
        for (int k = 0; k < pp->K; k++)
            TD__TRY(pp->replicas->attach(pp->replicas_impl, pp->slots[k].g, s0->g));
    }
    TD__TRY(td__pp_chains_start(pp));
    /* a tied gradient is handed down before the replicas' hook folds it into the tree */
    for (int k = 0; pp->chains && k < pp->K; k++)
        td_graph_set_grad_ready_hook(pp->slots[k].g, td__pp_chains_grad_ready, pp);
    return TD_OK;
}

td_status td_pipeline_create(td_pipeline **out, td_comm *comm, const td_sequential *model,
                             const td_pipeline_params *p) {
    if (!out || !comm || !model)
        return td__fail(TD_EINVAL, "td_pipeline_create: out, comm or model is NULL");
    *out = NULL;
    td_pipeline *pp = calloc(1, sizeof *pp);
    if (!pp) return td__fail(TD_ENOMEM, "td_pipeline_create: out of memory");
    pp->opt = p ? *p : td_pipeline_default_params();
    pp->group = comm;
    pp->rank = td_comm_rank(comm);
    pp->world = td_comm_size(comm);
    pp->M = pp->opt.schedule == TD_SCHEDULE_NAIVE ? 1 : pp->opt.micro_batches;
    pp->P = 1;
    td_status s = create(pp, comm, model);
    pp->opt.split = NULL;
    if (s != TD_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", td_last_error());
        td_pipeline_destroy(pp);
        return td__fail(s, "%s", msg);
    }
    *out = pp;
    return TD_OK;
}

void td_pipeline_destroy(td_pipeline *pp) {
    if (!pp) return;
    td__pp_channel_stop(&pp->act_in);
    td__pp_channel_stop(&pp->act_out);
    td__pp_channel_stop(&pp->grad_in);
    td__pp_channel_stop(&pp->grad_out);
    td__pp_chains_stop(pp);
    if (pp->replicas_impl) pp->replicas->destroy(pp->replicas_impl);
    for (int k = 0; pp->slots && k < pp->K; k++) {
        pp_slot *sl = &pp->slots[k];
        td_graph_destroy(sl->g);
        free(sl->act_in);
        free(sl->act_out);
        free(sl->grad_in);
        free(sl->grad_out);
    }
    free(pp->slots);
    free(pp->ops);
    for (int k = 0; k < pp->n_tied_groups; k++) td_comm_destroy(pp->tied_groups[k]);
    free(pp->tied_groups);
    free(pp->tied);
    free(pp->owner);
    free(pp->counted);
    if (!pp->mesh_groups) {
        td_comm_destroy(pp->dp);
        td_comm_destroy(pp->pipe);
    }
    free(pp);
}

/* ---- running and accessors ---------------------------------------------------------- */

/* What a rank is about to run; every rank of the group must start the same. */
typedef struct {
    int64_t evaluation; /* 0: a training step, 1: an evaluation */
    uint64_t index;     /* the step's or the evaluation's number */
    int64_t samples;
} pp_call;

static void describe_call(const void *sig, const void *other, char *out, size_t cap, void *ctx) {
    const pp_call *c = sig;
    (void)other, (void)ctx;
    if (c->evaluation)
        snprintf(out, cap, "evaluation %llu of %lld samples", (unsigned long long)c->index,
                 (long long)c->samples);
    else
        snprintf(out, cap, "training step %llu", (unsigned long long)c->index);
}

/* Every rank that takes part in a call starts the same one, checked by a collective on the
 * group of those ranks: a step on the group the pipeline was made on (the replicas step
 * together), an evaluation on its replica's stages (each replica evaluates its own batches),
 * which with one replica is the same group. A rank that issues a collective of its own there
 * instead, or another pipeline call, fails at once on every rank, named by the group's sequence
 * check or by this comparison, not by a transfer's timeout. `local` is this rank's argument
 * check. A pipeline that failed earlier still takes part, so that the others learn of it, and
 * returns its first error. */
static td_status start_call(td_pipeline *pp, int evaluation, int64_t samples, td_status local) {
    pp_call mine = {evaluation, evaluation ? pp->evals : pp->step, samples};
    if (pp->failed) local = td__fail(pp->failed, "%s", pp->failed_msg);
    td_comm_agreement a = {.what = "pipeline",
                           .local = local,
                           .sig = &mine,
                           .bytes = sizeof mine,
                           .describe = describe_call,
                           .hint = "; every rank must make the same pipeline calls in the same "
                                   "order, and no other collective on the pipeline's group "
                                   "between them"};
    td_status s = td_comm_agree(evaluation && pp->D > 1 ? pp->pipe : pp->group, &a);
    if (pp->failed) return td__fail(pp->failed, "%s", pp->failed_msg);
    if (s == TD_OK) return TD_OK;
    char msg[768];
    snprintf(msg, sizeof msg, "%s", td_last_error());
    return td__pp_fail(pp, s, "starting %s: %s", evaluation ? "an evaluation" : "the step", msg);
}

td_status td_pipeline_step(td_pipeline *pp, const float *x, const int64_t *labels, float *loss) {
    if (!pp) return td__fail(TD_EINVAL, "td_pipeline_step: pipeline is NULL");
    td_status local = TD_OK;
    if (pp->stage == 0 && !x)
        local = td__fail(TD_EINVAL, "td_pipeline_step: x is NULL on the first stage");
    else if (pp->stage + 1 == pp->P && !labels)
        local = td__fail(TD_EINVAL, "td_pipeline_step: labels are NULL on the last stage");
    TD__TRY(start_call(pp, 0, pp->opt.batch, local));
    td_recorder_step(TD_RECORDER_NEXT);
    return td__pp_run_step(pp, x, labels, loss);
}

td_status td_pipeline_evaluate(td_pipeline *pp, const float *x, const int64_t *labels, int64_t n,
                               double *loss_sum, int64_t *correct) {
    if (!pp) return td__fail(TD_EINVAL, "td_pipeline_evaluate: pipeline is NULL");
    td_status local = TD_OK;
    if (n < 1 || n > pp->opt.batch)
        local = td__fail(TD_EINVAL, "td_pipeline_evaluate: n = %lld (1 to the batch, %lld)",
                         (long long)n, (long long)pp->opt.batch);
    else if ((pp->stage == 0 && !x) || (pp->stage + 1 == pp->P && !labels))
        local = td__fail(TD_EINVAL,
                         "td_pipeline_evaluate: x (first stage) or labels (last stage) is NULL");
    TD__TRY(start_call(pp, 1, n, local));
    return td__pp_run_eval(pp, x, labels, n, loss_sum, correct);
}

td_status td_pipeline_parameters(td_pipeline *pp, td_param **params, size_t *n) {
    if (!pp || !params || !n) return td__fail(TD_EINVAL, "td_pipeline_parameters: NULL argument");
    *params = NULL;
    *n = 0;
    if (pp->replicas_impl) TD__TRY(pp->replicas->parameters(pp->replicas_impl, params, n));
    if (!*params) {
        *params = pp->slots[0].params;
        *n = pp->slots[0].n_params;
    }
    return TD_OK;
}

td_status td_pipeline_buffers(td_pipeline *pp, td_param **buffers, size_t *n) {
    if (!pp || !buffers || !n) return td__fail(TD_EINVAL, "td_pipeline_buffers: NULL argument");
    *buffers = pp->slots[0].buffers;
    *n = pp->slots[0].n_buffers;
    return TD_OK;
}

td_pipeline_info td_pipeline_get_info(const td_pipeline *pp) {
    td_pipeline_info info;
    memset(&info, 0, sizeof info);
    if (!pp) return info;
    info.stage = pp->stage;
    info.stages = pp->P;
    info.replica = pp->replica;
    info.replicas = pp->D;
    info.micro_batches = pp->M;
    info.micro_batch = pp->b;
    info.first_layer = pp->first_layer;
    info.last_layer = pp->last_layer;
    memcpy(info.stage_first, pp->stage_first, sizeof info.stage_first);
    info.graphs = pp->K;
    info.tied_params = pp->n_tied;
    info.transfer_nice = td__pp_channel_nice(pp->stage > 0 ? &pp->act_in : &pp->act_out);
    return info;
}

td_pipeline_stats td_pipeline_get_stats(const td_pipeline *pp) {
    td_pipeline_stats none;
    memset(&none, 0, sizeof none);
    return pp ? pp->stats : none;
}
