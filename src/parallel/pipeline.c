/* td_pipeline: creating a stage (the groups, the cut, the micro-batch graphs that share one
 * set of parameters and gradients, the transfer channels, the replicas' DDP), the agreement
 * checks every rank runs at creation, the failure path that ends every group so no rank hangs,
 * and the accessors. The schedules themselves are in pipeline_schedule.c, the transfers in
 * pipeline_channel.c and the choice of cut in pipeline_split.c. */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* A process of this host that has exited (a zombie until reaped counts). */
static int pid_dead(int pid) {
    if (pid <= 0 || pid == getpid()) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

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
    size_t at =
        (size_t)snprintf(pp->failed_msg, sizeof pp->failed_msg, "pipeline %s of %d, step %llu: %s",
                         me, pp->P, (unsigned long long)pp->step, what);
    /* Which rank started it, when one has died: the comm's messages number the ranks of the
     * pipeline's own groups (in which rank s is stage s), so name them in the caller's terms. */
    for (int r = 0; pp->pids && r < pp->world && at < sizeof pp->failed_msg; r++) {
        if (r == pp->rank || pp->hosts[r] != pp->hosts[pp->rank] || !pid_dead(pp->pids[r]))
            continue;
        char who[64];
        td__pp_stage_name(pp, r, who, sizeof who);
        at += (size_t)snprintf(pp->failed_msg + at, sizeof pp->failed_msg - at,
                               "; %s, pid %d, has died", who, pp->pids[r]);
    }
    pp->failed = s;
    /* No rank may go on waiting for this one. */
    if (pp->pipe) (void)td_comm_abort(pp->pipe);
    if (pp->dp) (void)td_comm_abort(pp->dp);
    return td__fail(s, "%s", pp->failed_msg);
}

/* ---- agreement ---------------------------------------------------------------------- */

/* What every rank tells the others at creation, before anything collective can hang. */
typedef struct {
    int64_t status;
    int64_t stages, micro_batches, batch, schedule, layers, replicas;
    uint64_t model_hash, split_hash, seed;
    char message[320];
} pp_config;

/* What every rank tells the others once its stage is built. */
typedef struct {
    int64_t status, first, last, pid;
    uint64_t host;
    int64_t in_ndim, in_dims[TD_MAX_DIMS], out_ndim, out_dims[TD_MAX_DIMS];
    char message[320];
} pp_built;

static uint64_t fnv(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static uint64_t model_hash(const td_sequential *m) {
    uint64_t h = 14695981039346656037ull;
    td_shape s = td_sequential_sample_shape(m);
    h = fnv(h, &s, sizeof s);
    for (size_t i = 0; i < td_sequential_count(m); i++) {
        const char *n = td_sequential_layer_name(m, i);
        h = fnv(h, n, strlen(n) + 1);
    }
    return h;
}

static void shape_str(int64_t ndim, const int64_t *dims, char *out, size_t cap) {
    size_t at = (size_t)snprintf(out, cap, "(");
    for (int64_t i = 0; i < ndim && at < cap; i++)
        at += (size_t)snprintf(out + at, cap - at, i ? ", %lld" : "%lld", (long long)dims[i]);
    if (at < cap) snprintf(out + at, cap - at, ")");
}

/* Every rank's options against rank 0's; the same message on every rank. */
static td_status check_configs(const pp_config *all, int world, int rank) {
    for (int r = 0; r < world; r++)
        if (all[r].status != TD_OK) {
            if (r == rank) return td__fail((td_status)all[r].status, "%s", all[r].message);
            return td__fail((td_status)all[r].status,
                            "pipeline: rank %d rejected the pipeline's options: %s", r,
                            all[r].message);
        }
    const char *names[] = {"stages", "micro_batches", "batch", "schedule", "layers", "replicas"};
    for (int r = 1; r < world; r++) {
        const int64_t *a = &all[0].stages, *b = &all[r].stages;
        for (int i = 0; i < 6; i++)
            if (a[i] != b[i])
                return td__fail(TD_EMISMATCH,
                                "pipeline: rank %d has %s = %lld but rank 0 has %lld; every rank "
                                "must create the pipeline with the same options",
                                r, names[i], (long long)b[i], (long long)a[i]);
        if (all[r].model_hash != all[0].model_hash)
            return td__fail(TD_EMISMATCH,
                            "pipeline: rank %d describes another model than rank 0 (layer names "
                            "or sample shape differ)",
                            r);
        if (all[r].split_hash != all[0].split_hash || all[r].seed != all[0].seed)
            return td__fail(TD_EMISMATCH, "pipeline: rank %d has another split or seed than rank 0",
                            r);
    }
    return TD_OK;
}

/* Every stage built, and each reads what the stage before it produces. */
static td_status check_built(const td_pipeline *pp, const td_sequential *model,
                             const pp_built *all) {
    for (int r = 0; r < pp->world; r++)
        if (all[r].status != TD_OK) {
            char who[64];
            td__pp_stage_name(pp, r, who, sizeof who);
            if (r == pp->rank) return td__fail((td_status)all[r].status, "%s", all[r].message);
            return td__fail((td_status)all[r].status, "pipeline: %s could not build its stage: %s",
                            who, all[r].message);
        }
    for (int r = 0; r < pp->world; r++) {
        int s = r % pp->P;
        if (s + 1 == pp->P) continue;
        const pp_built *a = &all[r], *b = &all[r + 1];
        int same = a->out_ndim == b->in_ndim && a->last == b->first;
        for (int i = 0; same && i < a->out_ndim; i++) same = a->out_dims[i] == b->in_dims[i];
        if (same) continue;
        char wa[64], wb[64], sa[128], sb[128];
        td__pp_stage_name(pp, r, wa, sizeof wa);
        td__pp_stage_name(pp, r + 1, wb, sizeof wb);
        shape_str(a->out_ndim, a->out_dims, sa, sizeof sa);
        shape_str(b->in_ndim, b->in_dims, sb, sizeof sb);
        return td__fail(TD_ESHAPE,
                        "pipeline: %s sends activations of shape %s after '%s' but %s reads %s "
                        "from '%s': the stages were built from different models",
                        wa, sa, td_sequential_layer_name(model, (size_t)a->last - 1), wb, sb,
                        td_sequential_layer_name(model, (size_t)b->first));
    }
    return TD_OK;
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
        TD__TRY(td_graph_input(sl->g, "labels", td_shape_1d(pp->b), TD_I64, 0, &sl->labels));
        TD__TRY(td_graph_cross_entropy(sl->g, sl->output, sl->labels, TD_REDUCTION_MEAN, &sl->loss,
                                       &sl->logp));
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
    TD__TRY(td_sequential_shape_at(model, pp->first_layer, pp->b, &pp->in_shape));
    TD__TRY(td_sequential_shape_at(model, pp->last_layer, pp->b, &pp->out_shape));
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

static uint64_t host_hash(void) {
    char name[256] = "";
    gethostname(name, sizeof name - 1);
    return fnv(14695981039346656037ull, name, strlen(name));
}

/* Checks that need no other rank; the message goes to every rank. */
static td_status check_local(const td_pipeline_params *p, const td_sequential *model, int world) {
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
    pp_config mine;
    memset(&mine, 0, sizeof mine);
    td_status s = check_local(&pp->opt, model, pp->world);
    if (s) snprintf(mine.message, sizeof mine.message, "%s", td_last_error());
    mine.status = s;
    mine.stages = pp->opt.stages;
    mine.micro_batches = pp->M;
    mine.batch = pp->opt.batch;
    mine.schedule = pp->opt.schedule;
    mine.layers = (int64_t)td_sequential_count(model);
    mine.replicas = pp->opt.stages > 0 ? pp->world / pp->opt.stages : 0;
    mine.model_hash = model_hash(model);
    mine.split_hash = pp->opt.split ? fnv(1, pp->opt.split, strlen(pp->opt.split)) : 0;
    mine.seed = pp->opt.seed;
    pp_config *all = calloc((size_t)pp->world, sizeof *all);
    if (!all) return td__fail(TD_ENOMEM, "pipeline: out of memory");
    s = td_comm_allgather(comm, &mine, all, sizeof mine, TD_U8);
    if (s == TD_OK) s = check_configs(all, pp->world, pp->rank);
    free(all);
    return s;
}

static td_status agree_on_stages(td_pipeline *pp, td_comm *comm, const td_sequential *model,
                                 td_status built, const char *built_msg) {
    pp_built mine;
    memset(&mine, 0, sizeof mine);
    mine.status = built;
    snprintf(mine.message, sizeof mine.message, "%s", built_msg);
    mine.first = (int64_t)pp->first_layer;
    mine.last = (int64_t)pp->last_layer;
    mine.pid = getpid();
    mine.host = host_hash();
    mine.in_ndim = pp->in_shape.ndim;
    mine.out_ndim = pp->out_shape.ndim;
    for (int i = 0; i < TD_MAX_DIMS; i++) {
        mine.in_dims[i] = pp->in_shape.dim[i];
        mine.out_dims[i] = pp->out_shape.dim[i];
    }
    pp_built *all = calloc((size_t)pp->world, sizeof *all);
    pp->pids = calloc((size_t)pp->world, sizeof *pp->pids);
    pp->hosts = calloc((size_t)pp->world, sizeof *pp->hosts);
    if (!all || !pp->pids || !pp->hosts) {
        free(all);
        return td__fail(TD_ENOMEM, "pipeline: out of memory");
    }
    td_status s = td_comm_allgather(comm, &mine, all, sizeof mine, TD_U8);
    if (s == TD_OK) {
        for (int r = 0; r < pp->world; r++) {
            pp->pids[r] = (int)all[r].pid;
            pp->hosts[r] = all[r].host;
        }
        s = check_built(pp, model, all);
    }
    free(all);
    return s;
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

static td_status create(td_pipeline *pp, td_comm *comm, const td_sequential *model) {
    TD__TRY(agree_on_options(pp, comm, model));
    pp->P = pp->opt.stages;
    pp->D = pp->world / pp->P;
    pp->stage = pp->rank % pp->P;
    pp->replica = pp->rank / pp->P;
    pp->b = pp->opt.batch / pp->M;
    TD__TRY(td_comm_split(comm, pp->replica, pp->stage, &pp->pipe));
    if (pp->D > 1) TD__TRY(td_comm_split(comm, pp->stage, pp->replica, &pp->dp));
    TD__TRY(td__pp_choose_split(comm, model, pp->opt.split, pp->P, pp->b, pp->opt.balance_reps,
                                pp->stage_first));
    size_t L = td_sequential_count(model);
    pp->stage_first[pp->P] = L;
    pp->first_layer = pp->stage_first[pp->stage];
    pp->last_layer = pp->stage_first[pp->stage + 1];
    td_status built = build_stage(pp, model);
    char msg[320];
    snprintf(msg, sizeof msg, "%s", built ? td_last_error() : "");
    TD__TRY(agree_on_stages(pp, comm, model, built, msg));
    TD__TRY(start_channels(pp));
    if (pp->dp) {
        td_ddp_params dp = pp->opt.ddp;
        if (!dp.trace) dp.trace = pp->opt.trace;
        pp_slot *s0 = &pp->slots[0];
        TD__TRY(td_ddp_create(&pp->ddp, pp->dp, s0->params, s0->n_params, s0->buffers,
                              s0->n_buffers, &dp));
        for (int k = 0; k < pp->K; k++)
            td_graph_set_grad_ready_hook(pp->slots[k].g, td_ddp_grad_ready_hook, pp->ddp);
    }
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
    td_ddp_destroy(pp->ddp);
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
    free(pp->pids);
    free(pp->hosts);
    td_comm_destroy(pp->dp);
    td_comm_destroy(pp->pipe);
    free(pp);
}

/* ---- running and accessors ---------------------------------------------------------- */

td_status td_pipeline_step(td_pipeline *pp, const float *x, const int64_t *labels, float *loss) {
    if (!pp) return td__fail(TD_EINVAL, "td_pipeline_step: pipeline is NULL");
    if (pp->failed) return td__fail(pp->failed, "%s", pp->failed_msg);
    if (pp->stage == 0 && !x)
        return td__pp_fail(pp, TD_EINVAL, "td_pipeline_step: x is NULL on the first stage");
    if (pp->stage + 1 == pp->P && !labels)
        return td__pp_fail(pp, TD_EINVAL, "td_pipeline_step: labels are NULL on the last stage");
    return td__pp_run_step(pp, x, labels, loss);
}

td_status td_pipeline_evaluate(td_pipeline *pp, const float *x, const int64_t *labels, int64_t n,
                               double *loss_sum, int64_t *correct) {
    if (!pp) return td__fail(TD_EINVAL, "td_pipeline_evaluate: pipeline is NULL");
    if (pp->failed) return td__fail(pp->failed, "%s", pp->failed_msg);
    if (n < 1 || n > pp->opt.batch)
        return td__pp_fail(pp, TD_EINVAL, "td_pipeline_evaluate: n = %lld (1 to the batch, %lld)",
                           (long long)n, (long long)pp->opt.batch);
    if ((pp->stage == 0 && !x) || (pp->stage + 1 == pp->P && !labels))
        return td__pp_fail(pp, TD_EINVAL,
                           "td_pipeline_evaluate: x (first stage) or labels (last stage) is NULL");
    return td__pp_run_eval(pp, x, labels, n, loss_sum, correct);
}

td_status td_pipeline_parameters(td_pipeline *pp, td_param **params, size_t *n) {
    if (!pp || !params || !n) return td__fail(TD_EINVAL, "td_pipeline_parameters: NULL argument");
    *params = pp->slots[0].params;
    *n = pp->slots[0].n_params;
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
    info.transfer_nice = td__pp_channel_nice(pp->stage > 0 ? &pp->act_in : &pp->act_out);
    return info;
}

td_pipeline_stats td_pipeline_get_stats(const td_pipeline *pp) {
    td_pipeline_stats none;
    memset(&none, 0, sizeof none);
    return pp ? pp->stats : none;
}
