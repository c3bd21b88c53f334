/* The pipeline's schedules as one executor: a schedule is this stage's list of forwards and
 * backwards of micro-batches (GPipe: all forwards, then all backwards; 1F1B: warm-up forwards,
 * then one forward and one backward in turn, then the rest; naive: one micro-batch), and the
 * executor runs the list. A forward waits for its activations (stage 0 reads the caller's
 * batch), runs the micro-batch's graph and hands the output to the send channel; a backward
 * waits for its output gradient (the last stage starts from its loss, scaled by 1/M), runs
 * backward into the stage's shared parameter gradients and hands the input gradient upstream.
 * Receives are queued as soon as a graph's buffers are free, so transfers overlap compute.
 * Also the forward-only evaluation sweep. Building stages and the failure path are in
 * pipeline.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "parallel/pipeline_impl.h"

/* This stage's order of work for one step; returns the number of entries (2M). */
static int schedule_ops(const td_pipeline *pp, pp_op *ops) {
    int n = 0, M = pp->M;
    if (pp->opt.schedule == TD_SCHEDULE_1F1B) {
        int warm = pp->P - pp->stage - 1 < M ? pp->P - pp->stage - 1 : M;
        for (int m = 0; m < warm; m++) ops[n++] = (pp_op){1, m};
        for (int i = 0; i + warm < M; i++) {
            ops[n++] = (pp_op){1, warm + i};
            ops[n++] = (pp_op){0, i};
        }
        for (int m = M - warm; m < M; m++) ops[n++] = (pp_op){0, m};
    } else {
        for (int m = 0; m < M; m++) ops[n++] = (pp_op){1, m};
        for (int m = 0; m < M; m++) ops[n++] = (pp_op){0, m};
    }
    return n;
}

/* splitmix64's finaliser: decorrelates the fields mixed into a dropout seed. */
static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static const char *kind_name(uint32_t kind) {
    return kind == PP_ACT    ? "activations"
           : kind == PP_GRAD ? "gradients"
           : kind == PP_TIED ? "tied gradients"
                             : "eval activations";
}

void td__pp_put_header(const td_pipeline *pp, unsigned char *buf, pp_kind kind, int m,
                       const td_shape *shape) {
    pp_header h;
    memset(&h, 0, sizeof h);
    h.magic = PP_MAGIC;
    h.kind = kind;
    h.step = (int64_t)(kind == PP_EVAL ? pp->evals : pp->step);
    h.micro_batch = m;
    h.from_stage = pp->stage;
    h.ndim = shape->ndim;
    for (int i = 0; i < shape->ndim; i++) h.dims[i] = shape->dim[i];
    h.bytes = (int64_t)td_shape_numel(shape) * (int64_t)sizeof(float);
    memcpy(buf, &h, sizeof h);
}

td_status td__pp_check_header(td_pipeline *pp, const unsigned char *buf, pp_kind kind, int m,
                              int from, const td_shape *shape) {
    pp_header h;
    memcpy(&h, buf, sizeof h);
    uint64_t step = kind == PP_EVAL ? pp->evals : pp->step;
    if (h.magic != PP_MAGIC)
        return td__pp_fail(pp, TD_EFORMAT, "the message from stage %d is not a pipeline message",
                           from);
    if (h.kind != kind || h.step != (int64_t)step || h.micro_batch != m || h.from_stage != from)
        return td__pp_fail(pp, TD_EMISMATCH,
                           "expected %s of micro-batch %d, step %llu from stage %d, but stage %d "
                           "sent %s of micro-batch %lld, step %lld (the stages run different "
                           "schedules or calls)",
                           kind_name(kind), m, (unsigned long long)step, from, h.from_stage,
                           kind_name(h.kind), (long long)h.micro_batch, (long long)h.step);
    int same = h.ndim == shape->ndim;
    for (int i = 0; same && i < shape->ndim; i++) same = h.dims[i] == shape->dim[i];
    if (!same) {
        char a[128], b[128];
        td__dims_str(a, sizeof a, h.ndim, h.dims);
        td__dims_str(b, sizeof b, shape->ndim, shape->dim);
        return td__pp_fail(pp, TD_ESHAPE,
                           "stage %d sent %s of shape %s for micro-batch %d, this stage expects %s",
                           from, kind_name(kind), a, m, b);
    }
    return TD_OK;
}

/* Waits for a transfer job with stage `peer`; its failure ends the pipeline, saying what this
 * stage was doing. */
static td_status wait_job(td_pipeline *pp, pp_channel *c, pp_job *j, const char *doing, int m,
                          int peer) {
    uint64_t t0 = td_time_ns();
    td_status s = td__pp_job_wait(c, j);
    uint64_t t1 = td_time_ns();
    pp->stats.wait_ns += t1 - t0;
    if (pp->opt.trace && t1 - t0 > 20000) {
        char name[64];
        snprintf(name, sizeof name, "wait: %s %d", doing, m);
        (void)td_trace_span(pp->opt.trace, name, "idle", t0, t1);
    }
    if (s == TD_OK) return TD_OK;
    char msg[768], who[64];
    snprintf(msg, sizeof msg, "%s", td_last_error());
    td__pp_stage_name(pp, pp->replica * pp->P + peer, who, sizeof who);
    return td__pp_fail(pp, s, "%s of micro-batch %d %s %s: %s", doing, m,
                       c->is_send ? "to" : "from", who, msg);
}

/* Runs fn's status through the failure path with context. */
static td_status compute_failed(td_pipeline *pp, td_status s, const char *what, int m) {
    char msg[768];
    snprintf(msg, sizeof msg, "%s", td_last_error());
    return td__pp_fail(pp, s, "%s of micro-batch %d: %s", what, m, msg);
}

static void span(td_pipeline *pp, const char *what, int m, const char *cat, uint64_t t0,
                 uint64_t t1) {
    if (!pp->opt.trace) return;
    char name[48];
    snprintf(name, sizeof name, "%s %d", what, m);
    (void)td_trace_span(pp->opt.trace, name, cat, t0, t1);
}

/* Queues the receives micro-batch m needs on its slot (activations from upstream, and for
 * training the gradient from downstream). */
static void post_receives(td_pipeline *pp, int m, int training) {
    pp_slot *sl = &pp->slots[m % pp->K];
    if (pp->stage > 0) {
        sl->j_act_in.micro_batch = m;
        td__pp_channel_submit(&pp->act_in, &sl->j_act_in);
    }
    if (training && pp->stage + 1 < pp->P) {
        sl->j_grad_in.micro_batch = m;
        td__pp_channel_submit(&pp->grad_in, &sl->j_grad_in);
    }
}

/* The forward of micro-batch m: its input (xm, its samples on stage 0; ym, its labels on the
 * last stage), the graph, and the output on its way downstream. */

/* A micro-batch's host memory as a graph input: the graph reads it where it is on the CPU and
 * takes a copy on a GPU. */
static td_status feed(td_pipeline *pp, td_tensor *t, const void *host) {
    if (pp->opt.graph.device.type == TD_DEVICE_CPU) return td_tensor_set_data(t, (void *)host);
    return td_tensor_write(t, host);
}

static td_status forward_one(td_pipeline *pp, int m, const float *xm, const int64_t *ym,
                             pp_kind kind, double *loss_sum) {
    pp_slot *sl = &pp->slots[m % pp->K];
    int last = pp->stage + 1 == pp->P;
    td_status s;
    if (pp->stage == 0) {
        s = feed(pp, sl->input, xm);
        if (s) return compute_failed(pp, s, "the input", m);
    } else {
        TD__TRY(
            wait_job(pp, &pp->act_in, &sl->j_act_in, "receiving activations", m, pp->stage - 1));
        TD__TRY(td__pp_check_header(pp, sl->act_in, kind, m, pp->stage - 1, &pp->in_shape));
        s = feed(pp, sl->input, sl->act_in + PP_HDR);
        if (s) return compute_failed(pp, s, "the input", m);
    }
    if (last) {
        s = feed(pp, sl->labels, ym);
        if (s) return compute_failed(pp, s, "the labels", m);
    }
    /* Each micro-batch's dropout masks depend on where it is, not on when it runs. */
    td_rng *rng = td_graph_rng(sl->g);
    uint64_t step = kind == PP_EVAL ? pp->evals : pp->step;
    td_rng_init(rng, mix(mix(mix(mix(pp->opt.seed) + (uint64_t)pp->stage) + step) + (uint64_t)m));
    uint64_t t0 = td_time_ns();
    s = td_graph_forward(sl->g);
    uint64_t t1 = td_time_ns();
    if (s) return compute_failed(pp, s, "the forward", m);
    if (last && loss_sum) {
        float l;
        s = td_tensor_read(sl->loss, &l);
        if (s) return compute_failed(pp, s, "reading the loss", m);
        *loss_sum += l;
    }
    pp->stats.busy_ns += t1 - t0;
    span(pp, "forward", m, "forward", t0, t1);
    if (!last) {
        TD__TRY(wait_job(pp, &pp->act_out, &sl->j_act_out, "sending activations", m - pp->K,
                         pp->stage + 1));
        uint64_t t2 = td_time_ns();
        td__pp_put_header(pp, sl->act_out, kind, m, &pp->out_shape);
        s = td_tensor_read(sl->output, sl->act_out + PP_HDR);
        if (s) return compute_failed(pp, s, "reading the output", m);
        sl->j_act_out.micro_batch = m;
        td__pp_channel_submit(&pp->act_out, &sl->j_act_out);
        pp->stats.busy_ns += td_time_ns() - t2;
    }
    return TD_OK;
}

/* Deterministic mode's start of micro-batch m's backward: the replicas' shard tree takes it
 * as its next shard (the leaf its gradients go to, which every slot's graph writes), the graph
 * writes them, and a tied weight's gradient starts from what the higher stages handed down. */
static td_status begin_shard(td_pipeline *pp, pp_slot *sl, int m) {
    pp_slot *s0 = &pp->slots[0];
    TD__TRY(pp->replicas->prepare_forward(pp->replicas_impl));
    for (size_t i = 0; i < s0->n_params; i++) sl->params[i].grad = s0->params[i].grad;
    TD__TRY(td_graph_zero_grad(sl->g));
    return td__pp_chains_seed(pp, m);
}

/* The backward of micro-batch m into the stage's shared gradients; the input gradient goes
 * upstream. `first`: the first backward of the step, which writes the gradients. In
 * deterministic mode every micro-batch is a shard of the replicas' tree: it writes its own
 * leaf, which the tree folds in. */
static td_status backward_one(td_pipeline *pp, int m, int first) {
    pp_slot *sl = &pp->slots[m % pp->K];
    int last = pp->stage + 1 == pp->P;
    if (!last) {
        TD__TRY(
            wait_job(pp, &pp->grad_in, &sl->j_grad_in, "receiving gradients", m, pp->stage + 1));
        TD__TRY(td__pp_check_header(pp, sl->grad_in, PP_GRAD, m, pp->stage + 1, &pp->out_shape));
    }
    td_status s;
    if (pp->det) {
        s = begin_shard(pp, sl, m);
    } else if (first) {
        s = td_graph_zero_grad(sl->g);
    } else {
        s = td_graph_accumulate_param_grads(sl->g);
        if (!s) s = td_graph_zero_input_grads(sl->g);
    }
    /* The replicas reduce once, as the step's last backward makes each gradient final. */
    if (!s && !pp->det && m == pp->M - 1 && pp->M > 1 && pp->replicas_impl)
        s = pp->replicas->set_sync(pp->replicas_impl, 1);
    if (s) return compute_failed(pp, s, "preparing the backward", m);
    uint64_t t0 = td_time_ns();
    if (last) { /* deterministic mode: each shard's mean, which the tree averages */
        float scale = pp->det ? 1.0f : 1.0f / (float)pp->M;
        s = td_graph_backward_from(sl->g, sl->loss, &scale);
    } else {
        s = td_graph_backward_from(sl->g, sl->output, (const float *)(sl->grad_in + PP_HDR));
    }
    if (!s && pp->det) s = pp->replicas->finish_backward(pp->replicas_impl);
    uint64_t t1 = td_time_ns();
    if (s) return compute_failed(pp, s, "the backward", m);
    pp->stats.busy_ns += t1 - t0;
    span(pp, "backward", m, "backward", t0, t1);
    if (pp->stage > 0) {
        TD__TRY(wait_job(pp, &pp->grad_out, &sl->j_grad_out, "sending gradients", m - pp->K,
                         pp->stage - 1));
        uint64_t t2 = td_time_ns();
        td__pp_put_header(pp, sl->grad_out, PP_GRAD, m, &pp->in_shape);
        s = td_tensor_read_grad(sl->input, (float *)(sl->grad_out + PP_HDR));
        if (s) return compute_failed(pp, s, "reading the input gradient", m);
        sl->j_grad_out.micro_batch = m;
        td__pp_channel_submit(&pp->grad_out, &sl->j_grad_out);
        pp->stats.busy_ns += td_time_ns() - t2;
    }
    /* This slot's buffers are free: its next micro-batch may arrive. */
    if (m + pp->K < pp->M) post_receives(pp, m + pp->K, 1);
    return TD_OK;
}

/* Waits for this stage's sends still in flight. */
static td_status drain_sends(td_pipeline *pp) {
    for (int k = 0; k < pp->K; k++) {
        pp_slot *sl = &pp->slots[k];
        if (pp->stage + 1 < pp->P)
            TD__TRY(wait_job(pp, &pp->act_out, &sl->j_act_out, "sending activations",
                             sl->j_act_out.micro_batch, pp->stage + 1));
        if (pp->stage > 0)
            TD__TRY(wait_job(pp, &pp->grad_out, &sl->j_grad_out, "sending gradients",
                             sl->j_grad_out.micro_batch, pp->stage - 1));
    }
    return TD_OK;
}

td_status td__pp_run_step(td_pipeline *pp, const float *x, const int64_t *labels, float *loss) {
    td_pipeline_stats *st = &pp->stats;
    st->start_ns = td_time_ns();
    st->busy_ns = st->wait_ns = st->sync_ns = 0;
    if (loss) *loss = NAN;
    /* Every graph's gradients are slot 0's, wherever DDP keeps them now. */
    pp_slot *s0 = &pp->slots[0];
    for (int k = 1; k < pp->K; k++)
        for (size_t i = 0; i < s0->n_params; i++) pp->slots[k].params[i].grad = s0->params[i].grad;
    td_status s = TD_OK;
    void *rep = pp->det ? NULL : pp->replicas_impl; /* deterministic: per micro-batch */
    if (rep) {
        s = pp->replicas->set_sync(rep, 1);
        if (!s) s = pp->replicas->prepare_forward(rep);
        if (!s && pp->M > 1) s = pp->replicas->set_sync(rep, 0);
        if (s) return compute_failed(pp, s, "starting the replicas' group before the forward", 0);
    }
    pp_op *ops = pp->ops;
    int n = schedule_ops(pp, ops);
    for (int m = 0; m < pp->K && m < pp->M; m++) {
        post_receives(pp, m, 1);
        td__pp_chains_post(pp, m);
    }
    size_t sample = (size_t)td_shape_numel(&pp->in_shape) / (size_t)pp->b;
    double loss_sum = 0;
    int in_flight = 0, peak = 0, backwards = 0;
    for (int i = 0; i < n; i++) {
        int m = ops[i].m;
        if (ops[i].forward) {
            const float *xm = x ? x + (size_t)m * (size_t)pp->b * sample : NULL;
            const int64_t *ym =
                labels ? labels + (size_t)m * (size_t)(pp->b * pp->label_rows) : NULL;
            TD__TRY(forward_one(pp, m, xm, ym, PP_ACT, &loss_sum));
            if (++in_flight > peak) peak = in_flight;
        } else {
            TD__TRY(backward_one(pp, m, backwards++ == 0));
            in_flight--;
        }
    }
    TD__TRY(drain_sends(pp));
    TD__TRY(td__pp_chains_drain(pp));
    if (rep) {
        uint64_t t0 = td_time_ns();
        s = pp->replicas->finish_backward(rep);
        st->sync_ns = td_time_ns() - t0;
        if (s)
            return compute_failed(pp, s, "the replicas' all-reduce after the backward", pp->M - 1);
    }
    TD__TRY(td__pp_reduce_tied(pp));
    if (loss && pp->stage + 1 == pp->P) *loss = (float)(loss_sum / pp->M);
    pp->step++;
    st->steps = pp->step;
    st->end_ns = td_time_ns();
    st->peak_in_flight = peak;
    st->peak_activation_bytes = (size_t)peak * st->activation_bytes;
    return TD_OK;
}

/* A micro-batch's loss and hits from this tensor-parallel rank's columns of the logits (z, its
 * `classes` of each of `rows` rows): the loss is the graph's, the same on every rank, whose mean
 * over the micro-batch counts only whole micro-batches (the padded rows of a short one have no
 * loss of their own to leave out); a row is a hit where the rank holding its label's column
 * finds the row's largest logit over every rank (max, rows floats) there. */
static td_status split_rows(td_pipeline *pp, const pp_slot *sl, const float *z, const int64_t *y,
                            int64_t real, int64_t rows, int64_t classes, float *max, double *lsum,
                            int64_t *hits) {
    if (real < rows)
        return td__fail(TD_EINVAL,
                        "evaluate: %lld of a micro-batch's %lld rows; a "
                        "tensor-parallel model evaluates whole micro-batches",
                        (long long)real, (long long)rows);
    for (int64_t r = 0; r < rows; r++) {
        max[r] = z[r * classes];
        for (int64_t c = 1; c < classes; c++) max[r] = fmaxf(max[r], z[r * classes + c]);
    }
    if (pp->tp) TD__TRY(td_comm_allreduce(pp->tp, max, max, (size_t)rows, TD_F32, TD_OP_MAX));
    int64_t mine = 0, first = pp->tp ? td_comm_rank(pp->tp) * classes : 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t c = y[r] - first;
        mine += c >= 0 && c < classes && z[r * classes + c] == max[r];
    }
    if (pp->tp) TD__TRY(td_comm_allreduce(pp->tp, &mine, &mine, 1, TD_I64, TD_OP_SUM));
    *hits += mine;
    *lsum += (double)*(const float *)td_tensor_data(sl->loss) * (double)rows;
    return TD_OK;
}

td_status td__pp_run_eval(td_pipeline *pp, const float *x, const int64_t *labels, int64_t n,
                          double *loss_sum, int64_t *correct) {
    if (loss_sum) *loss_sum = 0;
    if (correct) *correct = 0;
    int last = pp->stage + 1 == pp->P;
    int nm = (int)((n + pp->b - 1) / pp->b);
    size_t sample = (size_t)td_shape_numel(&pp->in_shape) / (size_t)pp->b;
    int64_t classes = last ? td_tensor_shape(pp->slots[0].logp).dim[1] : 0;
    int64_t R = pp->label_rows, mb_rows = pp->b * R; /* label rows per sample, per micro-batch */
    float *pad_x = NULL, *logp = NULL;
    int64_t *pad_y = NULL;
    td_status s = TD_OK;
    /* A short last micro-batch runs full size: its missing samples are zeros, left uncounted. */
    if (n % pp->b) {
        if (pp->stage == 0) pad_x = calloc((size_t)pp->b * sample, sizeof *pad_x);
        if (last) pad_y = calloc((size_t)mb_rows, sizeof *pad_y);
        if ((pp->stage == 0 && !pad_x) || (last && !pad_y))
            s = td__pp_fail(pp, TD_ENOMEM, "evaluate: out of memory");
    }
    /* A tensor-parallel last stage's logits are this rank's columns (td_sequential_loss); so
     * are one rank's under tp shards, all of them: the loss is the vocabulary-parallel one. */
    int split = last && pp->slots[0].logp == pp->slots[0].output &&
                ((pp->tp && td_comm_size(pp->tp) > 1) || pp->opt.graph.tp_shards);
    float *max = NULL;
    if (!s && last && !(logp = malloc((size_t)(mb_rows * classes) * sizeof *logp)))
        s = td__pp_fail(pp, TD_ENOMEM, "evaluate: out of memory");
    if (!s && split && !(max = malloc((size_t)mb_rows * sizeof *max)))
        s = td__pp_fail(pp, TD_ENOMEM, "evaluate: out of memory");
    for (int k = 0; k < pp->K; k++) td_graph_set_training(pp->slots[k].g, 0);
    for (int m = 0; !s && m < pp->K && m < nm; m++) post_receives(pp, m, 0);
    double lsum = 0;
    int64_t hits = 0;
    for (int m = 0; !s && m < nm; m++) {
        int64_t samples = n - (int64_t)m * pp->b < pp->b ? n - (int64_t)m * pp->b : pp->b;
        const float *xm = x ? x + (size_t)m * (size_t)pp->b * sample : NULL;
        const int64_t *ym = labels ? labels + (size_t)m * (size_t)mb_rows : NULL;
        if (samples < pp->b) {
            if (pad_x) {
                memcpy(pad_x, xm, (size_t)samples * sample * sizeof *pad_x);
                xm = pad_x;
            }
            if (pad_y) {
                memcpy(pad_y, ym, (size_t)(samples * R) * sizeof *pad_y);
                ym = pad_y;
            }
        }
        s = forward_one(pp, m, xm, ym, PP_EVAL, NULL);
        if (!s && last) {
            pp_slot *sl = &pp->slots[m % pp->K];
            s = td_tensor_read(sl->logp, logp);
            const int64_t *y = labels + (size_t)m * (size_t)mb_rows;
            if (!s && split)
                s = split_rows(pp, sl, logp, y, samples * R, mb_rows, classes, max, &lsum, &hits);
            for (int64_t r = 0; !s && !split && r < samples * R; r++) {
                const float *row = logp + r * classes;
                int64_t best = 0;
                for (int64_t c = 1; c < classes; c++)
                    if (row[c] > row[best]) best = c;
                hits += best == y[r];
                lsum -= row[y[r]];
            }
            if (s) s = compute_failed(pp, s, "reading the log-probabilities", m);
        }
        if (!s && pp->stage > 0 && m + pp->K < nm) post_receives(pp, m + pp->K, 0);
    }
    if (!s) s = drain_sends(pp);
    for (int k = 0; k < pp->K; k++) td_graph_set_training(pp->slots[k].g, 1);
    free(pad_x);
    free(pad_y);
    free(logp);
    free(max);
    if (s) return s;
    pp->evals++;
    if (loss_sum && last) *loss_sum = lsum;
    if (correct && last) *correct = hits;
    return TD_OK;
}
