/* Trains a GPT-2 on Jane Austen's novels, one byte per token, as nanoGPT's shakespeare_char does,
 * in one process or data-parallel, then writes a sample from a prompt.
 *
 *   build/examples/gpt --steps 2000
 *   build/bin/tandemrun --nproc-per-node 2 build/examples/gpt --steps 2000 --amp
 *
 * The text is Debian's r-cran-janeaustenr (--data FILE for another; docs/gpt.md): the first 90%
 * trains, the last 10% validates. Training draws non-overlapping windows of --context + 1 bytes
 * through the sampler (each global batch cut into one slice per rank), steps AdamW (betas 0.9,
 * 0.95, weight decay 0.1) with a linear warm-up and a cosine decay to a tenth, and clips the
 * gradient norm to 1. Every --eval-every steps it prints the validation loss over a fixed set of
 * windows split across ranks, beside the unigram baseline (the byte frequencies of the training
 * text). Under a launcher every rank builds the same model and DDP averages the gradients
 * (--ddp says so explicitly); --zero 1|2|3 shards the optimizer state, also the gradients, also
 * the parameters over the ranks instead (docs/zero.md; each rank writes its part of a
 * checkpoint); --amp computes the linears in bf16 (O1); --deterministic trains to the same bits
 * at any world size and thread count, each shard on one thread (docs/reproducibility.md);
 * --checkpoint / --resume continue a run at any world size, with or without --zero
 * (--stop-at-step N ends a run after step N as an interrupted one would; a run resumed at its
 * last step says there is nothing left to train); --device cuda trains on this rank's GPU
 * (cuda:LOCAL_RANK, or cuda:N); --pipeline cuts the model into stages instead (pipeline.c, on
 * the CPU); --recompute full|selective runs the blocks' forward again in backward instead of
 * keeping their activations (docs/recompute.md); --tp N (or tandemrun --tp N) splits every layer
 * over N ranks, Megatron-LM's tensor parallelism, the rest of the ranks data parallel over it
 * (--sequence-parallel splits the tokens between its regions too; docs/parallelism.md). A loss
 * that is not finite ends the run with status 1, naming the step. The last lines are a sample
 * and the SHA-256 of the parameters (of the whole model, gathered, under --tp). */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpt.h"

static const char usage[] =
    "usage: gpt [--data FILE] [--layers N] [--heads N] [--width C] [--context T]\n"
    "           [--batch GLOBAL] [--steps N] [--lr X] [--warmup N] [--seed N]\n"
    "           [--eval-every N] [--eval-batches N] [--ddp | --zero 1|2|3] [--amp]\n"
    "           [--recompute none|full|selective]\n"
    "           [--device cpu|cuda|cuda:N]\n"
    "           [--deterministic [--shards S]] [--checkpoint PATH [--checkpoint-every N]]\n"
    "           [--resume PATH|auto] [--stop-at-step STEP] [--sample N] [--prompt TEXT]\n"
    "           [--pipeline naive|gpipe|1f1b [--stages P] [--micro-batches M]\n"
    "            [--split LAYERS|balanced]] [--tp N [--sequence-parallel]] [--tp-shards S]\n"
    "  --eval-every N       validation every N steps (0: at the end only)\n"
    "  --checkpoint-every N also write the checkpoint every N steps (0: at the end only)\n"
    "  --stop-at-step STEP  stop after step STEP, as an interrupted run would\n";

static options parse(int argc, char **argv) {
    options o = {.model = td_gpt_default_params(),
                 .batch = 16,
                 .steps = 2000,
                 .warmup = 100,
                 .eval_every = 250,
                 .eval_batches = 8,
                 .sample = 300,
                 .lr = 3e-3,
                 .seed = 1,
                 .data = td_corpus_default_path(),
                 .prompt = "It is a truth universally acknowledged",
                 .shards = 4,
                 .device = "cpu",
                 .stages = 2,
                 .micro = 4,
                 .tp_shards = -1};
    int ddp = 0, stages_given = 0;
    const char *resume = NULL, *split = NULL;
    td_args a;
    td_args_init(&a, "gpt", argc, argv);
    while (td_args_next(&a)) {
        td_args_flag(&a, "--ddp", &ddp); /* what a launched run does anyway */
        td_args_flag(&a, "--amp", &o.amp);
        td_args_flag(&a, "--deterministic", &o.deterministic);
        td_args_string(&a, "--data", &o.data);
        td_args_int(&a, "--layers", 1, 1024, &o.model.layers);
        td_args_int(&a, "--heads", 1, 1024, &o.model.heads);
        long width = o.model.width, context = o.model.context;
        if (td_args_long(&a, "--width", 1, 1L << 20, &width)) o.model.width = width;
        if (td_args_long(&a, "--context", 1, 1L << 20, &context)) o.model.context = context;
        td_args_int(&a, "--batch", 1, INT_MAX, &o.batch);
        td_args_long(&a, "--steps", 1, LONG_MAX, &o.steps);
        td_args_real(&a, "--lr", 0, INFINITY, &o.lr);
        td_args_long(&a, "--warmup", 0, LONG_MAX, &o.warmup);
        td_args_u64(&a, "--seed", &o.seed);
        td_args_long(&a, "--eval-every", 0, LONG_MAX, &o.eval_every);
        td_args_long(&a, "--eval-batches", 1, LONG_MAX, &o.eval_batches);
        td_args_int(&a, "--zero", 1, 3, &o.zero);
        td_args_int(&a, "--shards", 1, INT_MAX, &o.shards);
        td_args_string(&a, "--checkpoint", &o.checkpoint);
        td_args_long(&a, "--checkpoint-every", 0, LONG_MAX, &o.checkpoint_every);
        td_args_string(&a, "--resume", &resume);
        td_args_long(&a, "--sample", 0, LONG_MAX, &o.sample);
        td_args_long(&a, "--stop-at-step", 1, LONG_MAX, &o.stop_at);
        td_args_string(&a, "--prompt", &o.prompt);
        stages_given |= td_args_int(&a, "--stages", 1, TD_PIPELINE_MAX_STAGES, &o.stages);
        td_args_int(&a, "--micro-batches", 1, INT_MAX, &o.micro);
        td_args_string(&a, "--split", &split);
        if (td_args_string(&a, "--device", &o.device)) {
            td_device d;
            if (td_device_parse(o.device, &d) != TD_OK)
                td_args_bad_value(&a, o.device, "cpu, cuda or cuda:N");
        }
        if (td_args_is(&a, "--pipeline")) {
            const char *v = td_args_value(&a);
            if (v && td_pipeline_schedule_parse(v, &o.schedule) != TD_OK)
                td_args_bad_value(&a, v, "naive, gpipe or 1f1b");
            o.pipeline = 1;
        }
        int recompute = -1; /* the names in td_recompute_mode's order */
        if (td_args_choice(&a, "--recompute", "none|full|selective", &recompute) && recompute >= 0)
            o.recompute = (td_recompute_mode)recompute;
        td_args_int(&a, "--tp", 1, 1024, &o.tp);
        td_args_flag(&a, "--sequence-parallel", &o.sp);
        td_args_int(&a, "--tp-shards", 0, 64, &o.tp_shards);
    }
    if (resume && !strcmp(resume, "auto"))
        o.resume_auto = 1;
    else
        o.resume = resume;
    o.split = split && strcmp(split, "balanced") ? split : NULL;
    /* tandemrun --pp N: N stages (1F1B unless --pipeline names another schedule) */
    int pp_env = getenv("TANDEM_PP") ? atoi(getenv("TANDEM_PP")) : 0;
    if (!stages_given && pp_env >= 1) o.stages = pp_env;
    if (!o.pipeline && !stages_given && pp_env > 1) o.pipeline = 1, o.schedule = TD_SCHEDULE_1F1B;
    if (o.pipeline && (o.zero || strcmp(o.device, "cpu")))
        td_args_error(&a, "--pipeline trains without --zero and --device");
    if (o.resume_auto && !o.checkpoint)
        td_args_error(&a, "--resume auto resumes from the --checkpoint file; give one");
    if (o.deterministic && o.batch % o.shards)
        td_args_error(&a, "--batch %d is not a multiple of --shards %d", o.batch, o.shards);
    if (!o.tp && getenv("TANDEM_TP")) o.tp = atoi(getenv("TANDEM_TP"));
    if (o.tp_shards < 0) { /* 4, or the most of 2 and 1 the heads and the vocabulary divide into */
        o.tp_shards = o.deterministic && !o.amp ? 4 : 0;
        while (o.tp_shards > 1 && (o.model.heads % o.tp_shards || o.model.vocab % o.tp_shards))
            o.tp_shards /= 2;
    }
    if (o.tp_shards && !o.deterministic)
        td_args_error(&a,
                      "--tp-shards %d: the fixed shards of every layer are deterministic "
                      "mode's; give --deterministic",
                      o.tp_shards);
    if (o.deterministic && o.tp > 1 && o.amp)
        td_args_error(&a,
                      "--deterministic --tp %d: deterministic tensor parallelism computes in "
                      "f32; leave out --amp",
                      o.tp);
    if (o.deterministic && o.tp > 1 && !o.tp_shards)
        td_args_error(&a,
                      "--deterministic --tp %d: each layer's fixed shards (--tp-shards) make "
                      "the sums the same at every tp; give them",
                      o.tp);
    if (o.tp > 1 && strcmp(o.device, "cpu"))
        td_args_error(&a, "--tp %d: tensor parallelism trains on the CPU", o.tp);
    if (o.tp_shards && o.amp)
        td_args_error(&a,
                      "--tp-shards %d: deterministic tensor parallelism computes in f32; "
                      "leave out --amp or give --tp-shards 0",
                      o.tp_shards);
    if (o.sp && o.tp < 2)
        td_args_error(&a, "--sequence-parallel splits the tokens among --tp ranks; give --tp");
    int rc = td_args_finish(&a, usage);
    if (rc >= 0) exit(rc);
    return o;
}

typedef struct {
    options opt;
    int rank, world;
    td_comm *comm;
    td_mesh *mesh;        /* --tp: pp 1 x dp x tp; else NULL */
    td_comm *dp;          /* the data-parallel group: the mesh's dp, or comm */
    int dp_rank, dp_size; /* this rank's replica and the replicas */
    td_param *stepped;    /* what the optimizer steps: the parameters, or ZeRO's shards */
    size_t n_stepped;
    td_device device; /* where the graphs compute */
    td_ddp *ddp;
    td_zero *zero; /* --zero: instead of ddp */
    td_graph *train, *eval;
    td_model model, eval_model;
    td_param *params;
    size_t n_params;
    td_optim *optim;
    td_corpus text;
    size_t n_train;      /* the first n_train bytes train, the rest validate */
    td_sampler *sampler; /* over the training windows, sharded by global batch */
    int64_t graph_batch; /* sequences the training graph holds: the rank's, or one shard's */
    float *x;            /* (global batch, T) this step's inputs */
    int64_t *y;          /* (global batch, T) their next bytes */
    long first_step;
} trainer;

/* ---- checkpoints ------------------------------------------------------------------------ */

/* What a DDP or single-process checkpoint holds: the parameters and the optimizer state (ZeRO
 * writes both in parts itself, under the same names). */
static td_param *checkpoint_tensors(trainer *t, size_t *n) {
    td_param *state;
    size_t n_state;
    td_optim_state(t->optim, &state, &n_state);
    *n = t->n_params + n_state;
    td_param *all = malloc(*n * sizeof *all);
    if (!all) CHECK(TD_ENOMEM);
    memcpy(all, t->params, t->n_params * sizeof *all);
    memcpy(all + t->n_params, state, n_state * sizeof *all);
    return all;
}

void gpt_run_meta(const options *o, char *out, size_t cap) {
    const td_gpt_params *m = &o->model;
    int at = snprintf(out, cap, "layers %d heads %d width %lld context %lld batch %d shards %d",
                      m->layers, m->heads, (long long)m->width, (long long)m->context, o->batch,
                      o->deterministic ? o->shards : 0);
    if (o->tp_shards && at > 0 && (size_t)at < cap)
        snprintf(out + at, cap - (size_t)at, " tp shards %d", o->tp_shards);
}

/* Rank 0 writes the whole run, or with --zero every rank its part; called on every rank. */
static void save(trainer *t, long step) {
    if (!t->opt.checkpoint || (!t->zero && !t->mesh && t->rank != 0)) return;
    char steps[32], shape[160];
    snprintf(steps, sizeof steps, "%ld", step);
    gpt_run_meta(&t->opt, shape, sizeof shape);
    td_checkpoint_meta meta[] = {{"model", "gpt"}, {"run", shape}, {"step", steps}};
    if (t->mesh && t->zero) { /* the whole model's checkpoint, gathered on rank 0 */
        CHECK(td_mesh_save_zero(t->mesh, t->zero, t->optim, t->opt.checkpoint, meta, 3));
    } else if (t->mesh) {
        CHECK(td_mesh_save(t->mesh, t->params, t->n_params, t->optim, t->opt.checkpoint, meta, 3));
    } else if (t->zero) {
        CHECK(td_zero_save(t->zero, t->optim, t->opt.checkpoint, NULL, 0, meta, 3));
    } else {
        size_t n;
        td_param *all = checkpoint_tensors(t, &n);
        CHECK(td_checkpoint_save(t->opt.checkpoint, all, n, meta, 3));
        free(all);
    }
    if (t->rank != 0) return;
    printf("checkpoint at step %ld: %s\n", step, t->opt.checkpoint);
    fflush(stdout);
}

long gpt_resume_step(const options *o, const char **path) {
    *path = o->resume ? o->resume : o->checkpoint;
    if (!o->resume && access(*path, F_OK) != 0) return -1; /* --resume auto, nothing yet */
    td_checkpoint *ck;
    CHECK(td_checkpoint_open(&ck, *path));
    char shape[160];
    gpt_run_meta(o, shape, sizeof shape);
    const char *run = td_checkpoint_get_meta(ck, "run");
    if (!run || strcmp(run, shape)) {
        fprintf(stderr, "gpt: %s was written by a run of %s; this run has %s\n", *path,
                run ? run : "(unknown shape)", shape);
        exit(1);
    }
    int64_t step;
    CHECK(td_checkpoint_get_meta_i64(ck, "step", 0, o->steps, &step));
    td_checkpoint_close(ck);
    return (long)step;
}

static void resume(trainer *t) {
    const char *path;
    long step = gpt_resume_step(&t->opt, &path);
    if (step < 0) return;
    if (t->mesh && t->zero) { /* every rank its slices of the whole tensors, sharded */
        CHECK(td_mesh_load_zero(t->mesh, t->zero, t->optim, path));
    } else if (t->mesh) { /* every rank its slices of the whole tensors */
        CHECK(td_mesh_load(t->mesh, t->params, t->n_params, t->optim, path));
    } else if (t->zero) { /* every rank its own parts, resharded to this world size */
        CHECK(td_zero_load(t->zero, t->optim, path, NULL, 0));
    } else {
        size_t n;
        td_param *all = checkpoint_tensors(t, &n);
        td_checkpoint *ck;
        CHECK(td_checkpoint_open(&ck, path));
        CHECK(td_checkpoint_read(ck, all, n));
        td_checkpoint_close(ck);
        free(all);
    }
    t->first_step = step;
    if (t->rank == 0) printf("resuming from %s at step %ld, world size %d\n", path, step, t->world);
}

/* ---- setup ------------------------------------------------------------------------------ */

void gpt_banner(const options *o, int world, const char *more) {
    char det[48] = "";
    if (o->deterministic)
        snprintf(det, sizeof det, ", deterministic (%d shards, tp shards %d)", o->shards,
                 o->tp_shards);
    printf("gpt: %d layers, %d heads, width %lld, context %lld: %lld parameters; world %d, global "
           "batch %d%s%s%s%s\n",
           o->model.layers, o->model.heads, (long long)o->model.width, (long long)o->model.context,
           (long long)td_gpt_parameter_count(&o->model), world, o->batch,
           o->amp ? ", amp bf16" : "", det,
           o->recompute == TD_RECOMPUTE_FULL        ? ", recompute full"
           : o->recompute == TD_RECOMPUTE_SELECTIVE ? ", recompute selective"
                                                    : "",
           more);
}

void gpt_build(const options *o, td_graph *g, int64_t batch, td_model *m) {
    td_sequential *s;
    CHECK(td_gpt_sequential(&o->model, &s));
    CHECK(td_model_build_sequential(g, s, batch, o->seed, m));
    td_sequential_destroy(s);
}

static void setup(trainer *t) {
    const options *o = &t->opt;
    t->world = 1;
    int launched = getenv("WORLD_SIZE") || getenv("OMPI_COMM_WORLD_SIZE") || getenv("SLURM_NTASKS");
    if (launched || o->deterministic || o->zero) {
        td_comm_params cp = td_comm_default_params();
        if (!launched) { /* alone: DDP's shard tree or ZeRO on one rank */
            cp.rank = cp.local_rank = 0;
            cp.world_size = cp.local_world_size = 1;
        }
        CHECK(td_comm_create(&t->comm, &cp));
        t->rank = td_comm_rank(t->comm);
        t->world = td_comm_size(t->comm);
    }
    t->dp = t->comm;
    t->dp_rank = t->rank;
    t->dp_size = t->world;
    if (o->tp > 1 || o->tp_shards) { /* tp shards: the tensor-parallel model at tp 1 too */
        t->mesh = gpt_mesh(o, t->comm);
        t->dp = td_mesh_group(t->mesh, "dp");
        t->dp_rank = td_mesh_coord(t->mesh, "dp");
        t->dp_size = td_mesh_size(t->mesh, "dp");
        t->opt.model.tensor_parallel = 1;
        t->opt.model.sequence_parallel = o->sp;
    }
    if (o->batch < t->dp_size) {
        fprintf(stderr, "gpt: --batch %d gives some of the %d replicas no sequence\n", o->batch,
                t->dp_size);
        exit(2);
    }
    size_t windows = gpt_load_text(o, &t->text, &t->n_train);
    td_sampler_params sp = td_sampler_default_params();
    sp.rank = t->dp_rank;
    sp.world_size = t->dp_size;
    sp.seed = o->seed;
    sp.drop_last = 1;
    sp.global_batch = (size_t)o->batch;
    CHECK(td_sampler_create(&t->sampler, windows, &sp));
    size_t first, count;
    td_split_even((size_t)o->batch, t->dp_size, t->dp_rank, &first, &count);
    t->graph_batch = o->deterministic ? o->batch / o->shards : (int64_t)count;
    size_t BT = (size_t)o->batch * (size_t)o->model.context;
    t->x = malloc(BT * sizeof *t->x);
    t->y = malloc(BT * sizeof *t->y);
    if (!t->x || !t->y) CHECK(TD_ENOMEM);

    td_graph_params gp = td_graph_default_params();
    gp.seed = o->seed;
    CHECK(td_device_choose(o->device, &t->device));
    gp.device = t->device;
    gp.comm = t->mesh ? td_mesh_group(t->mesh, "tp") : NULL;
    if (o->amp) gp.amp.level = TD_AMP_O1;
    gp.threads = o->deterministic ? 1 : 0; /* no sum of the kernels depends on OMP_NUM_THREADS */
    gp.tp_shards = o->tp_shards;           /* nor on the layout */
    gp.recompute = o->recompute;
    CHECK(td_graph_create(&t->train, &gp));
    const char *amp_note = td_graph_amp_fallback(t->train); /* no fast low-precision kernels */
    if (amp_note && t->rank == 0) fprintf(stderr, "gpt: %s\n", amp_note);
    gpt_build(o, t->train, t->graph_batch, &t->model);
    gp.grad_enabled = 0;
    gp.threads = 0;
    CHECK(td_graph_create(&t->eval, &gp));
    gpt_build(o, t->eval, 1, &t->eval_model);
    td_graph_set_training(t->eval, 0);
    CHECK(td_graph_parameters(t->train, &t->params, &t->n_params));
    td_ddp_params dp = td_ddp_default_params();
    dp.deterministic = o->deterministic;
    dp.shards = (size_t)o->shards;
    td_param *stepped = t->params; /* what the optimizer steps: all, or this rank's shards */
    size_t n_stepped = t->n_params;
    if (o->zero) {
        td_zero_params zp = td_zero_default_params();
        zp.stage = o->zero;
        zp.ddp = dp;
        CHECK(td_zero_create(&t->zero, t->dp, t->params, t->n_params, NULL, 0, &zp));
        CHECK(td_zero_parameters(t->zero, &stepped, &n_stepped));
        td_graph_set_grad_ready_hook(t->train, td_zero_grad_ready_hook, t->zero);
        td_graph_set_param_use_hook(t->train, td_zero_param_use_hook, t->zero);
    }
    /* After ZeRO moved the parameters: the evaluation graph reads where they are now. */
    CHECK(td_graph_share_params(t->eval, t->train));
    td_adamw_params ap = gpt_adamw(o);
    CHECK(td_optim_create_adamw(&t->optim, stepped, n_stepped, &ap));
    t->stepped = stepped;
    t->n_stepped = n_stepped;
    if (o->resume || o->resume_auto) resume(t);
    if (t->comm && !t->zero) {
        CHECK(td_ddp_create(&t->ddp, t->dp, t->params, t->n_params, NULL, 0, &dp));
        td_graph_set_grad_ready_hook(t->train, td_ddp_grad_ready_hook, t->ddp);
    }
}

/* The calls of a step to DDP or ZeRO, whichever synchronises the ranks (or none, alone). */
static void sync_prepare(trainer *t) {
    if (t->zero) CHECK(td_zero_prepare_forward(t->zero));
    if (t->ddp) CHECK(td_ddp_prepare_forward(t->ddp));
}

static void sync_finish(trainer *t, float loss) {
    if (t->zero) {
        td_zero_set_loss(t->zero, loss);
        CHECK(td_zero_finish_backward(t->zero));
    }
    if (t->ddp) {
        td_ddp_set_loss(t->ddp, loss);
        CHECK(td_ddp_finish_backward(t->ddp));
    }
}

/* The step's loss reduced over the ranks (this rank's `mine` alone). */
static float sync_loss(const trainer *t, float mine) {
    return t->zero ? td_zero_loss(t->zero) : t->ddp ? td_ddp_loss(t->ddp) : mine;
}

/* ---- training --------------------------------------------------------------------------- */

/* Fills x, y with this rank's slice of global batch `k` (rows [0, count)). */
static size_t fill_batch(trainer *t, size_t k) {
    size_t first, count;
    td_sampler_batch(t->sampler, k, &first, &count);
    const size_t *idx = td_sampler_indices(t->sampler);
    int64_t T = t->opt.model.context;
    for (size_t i = 0; i < count; i++)
        td_corpus_window(t->text.bytes, idx[first + i], T, t->x + i * T, t->y + i * T);
    return count;
}

/* The training graph's forward on the sequences at x, y (pointed to on the CPU, copied to a
 * GPU); returns the loss. */
static float run_graph(trainer *t, const float *x, const int64_t *y) {
    if (t->device.type == TD_DEVICE_CPU) {
        CHECK(td_tensor_set_data(t->model.input, (void *)x));
        CHECK(td_tensor_set_data(t->model.labels, (void *)y));
    } else {
        CHECK(td_tensor_write(t->model.input, x));
        CHECK(td_tensor_write(t->model.labels, y));
    }
    CHECK(td_graph_forward(t->train));
    float loss;
    CHECK(td_tensor_read(t->model.loss, &loss));
    return loss;
}

/* One step's gradients, the global batch's mean on every rank; returns the batch's loss. */
static float forward_backward(trainer *t, size_t rows, uint64_t step) {
    int64_t T = t->opt.model.context;
    if (t->opt.deterministic) {
        size_t first, count, b = (size_t)t->graph_batch;
        if (t->zero)
            td_zero_shards(t->zero, &first, &count);
        else
            td_ddp_shards(t->ddp, &first, &count);
        for (size_t j = 0; j < count; j++) {
            sync_prepare(t);
            CHECK(td_graph_set_rng_key(t->train, step, (first + j) * b));
            float loss = run_graph(t, t->x + j * b * T, t->y + j * b * T);
            CHECK(td_graph_zero_grad(t->train));
            CHECK(td_graph_backward(t->train, t->model.loss));
            sync_finish(t, loss);
        }
        return sync_loss(t, 0.0f);
    }
    /* a rank's mean weighs by its share of the global batch */
    float share = (float)((double)t->dp_size * (double)rows / (double)t->opt.batch);
    sync_prepare(t);
    float loss = run_graph(t, t->x, t->y);
    CHECK(td_graph_zero_grad(t->train));
    CHECK(td_graph_backward_from(t->train, t->model.loss, &share));
    sync_finish(t, loss * share);
    return sync_loss(t, loss);
}

/* Mean loss over the first eval_batches x batch windows of the validation text, split across
 * ranks; the same on every rank. */
static double validate(trainer *t) {
    const uint8_t *val = t->text.bytes + t->n_train;
    int64_t T = t->opt.model.context;
    size_t windows = td_corpus_windows(t->text.size - t->n_train, T);
    size_t want = (size_t)(t->opt.eval_batches * t->opt.batch);
    if (want > windows) want = windows;
    size_t first, count;
    td_split_even(want, t->dp_size, t->dp_rank, &first, &count);
    double sums[2] = {0, (double)count * (double)T};
    /* ranks may run different numbers of windows: ZeRO holds every parameter whole meanwhile */
    if (t->zero) CHECK(td_zero_full_params(t->zero, 1));
    for (size_t i = 0; i < count; i++) { /* through x, y: the eval graph may be on a GPU */
        td_corpus_window(val, first + i, T, t->x, t->y);
        CHECK(td_tensor_write(t->eval_model.input, t->x));
        CHECK(td_tensor_write(t->eval_model.labels, t->y));
        CHECK(td_graph_forward(t->eval));
        float loss;
        CHECK(td_tensor_read(t->eval_model.loss, &loss));
        sums[0] += loss * (double)T;
    }
    if (t->zero) CHECK(td_zero_full_params(t->zero, 0));
    if (t->dp) CHECK(td_comm_allreduce(t->dp, sums, sums, 2, TD_F64, TD_OP_SUM));
    return sums[0] / sums[1];
}

size_t gpt_load_text(const options *o, td_corpus *text, size_t *n_train) {
    CHECK(td_corpus_load(text, o->data));
    *n_train = text->size / 10 * 9;
    size_t windows = td_corpus_windows(*n_train, o->model.context);
    if (windows < (size_t)o->batch) {
        fprintf(stderr, "gpt: %s holds %zu training windows of %lld, fewer than --batch %d\n",
                o->data, windows, (long long)o->model.context, o->batch);
        exit(2);
    }
    return windows;
}

double gpt_unigram_baseline(const td_corpus *text, size_t n_train) {
    double count[256] = {0}, total = 256;
    for (size_t i = 0; i < n_train; i++) count[text->bytes[i]]++;
    for (int c = 0; c < 256; c++) total += count[c];
    double nll = 0;
    for (size_t i = n_train; i < text->size; i++) nll -= log((count[text->bytes[i]] + 1) / total);
    return nll / (double)(text->size - n_train);
}

td_adamw_params gpt_adamw(const options *o) {
    td_adamw_params ap = td_adamw_default_params();
    ap.lr = o->lr;
    ap.beta2 = 0.95;
    ap.weight_decay = 0.1;
    return ap;
}

double gpt_lr_at(const options *o, long step) {
    if (step < o->warmup) return o->lr * (double)(step + 1) / (double)o->warmup;
    double p =
        (double)(step - o->warmup) / (double)(o->steps > o->warmup ? o->steps - o->warmup : 1);
    return o->lr / 10 + (o->lr - o->lr / 10) * 0.5 * (1 + cos(M_PI * p));
}

/* Continues the prompt by `n` bytes, each drawn from the model's distribution at temperature
 * 0.8 given the last T bytes (the eval graph holds one sequence of T; positions past the text
 * are padding the causal mask keeps out of the ones read). */
void gpt_sample(const options *o, td_graph *eval, const td_model *m) {
    int64_t T = o->model.context, V = o->model.vocab;
    size_t plen = strlen(o->prompt), n = plen + (size_t)o->sample;
    unsigned char *text = malloc(n + 1);
    float *prob = malloc((size_t)V * sizeof *prob), *in = malloc((size_t)T * sizeof *in);
    float *logp = malloc((size_t)(T * V) * sizeof *logp);
    if (!text || !prob || !in || !logp) CHECK(TD_ENOMEM);
    memcpy(text, o->prompt, plen);
    td_rng rng;
    td_rng_init(&rng, o->seed);
    for (size_t len = plen; len < n; len++) {
        size_t from = len > (size_t)T ? len - (size_t)T : 0, used = len - from;
        for (int64_t i = 0; i < T; i++) in[i] = i < (int64_t)used ? text[from + i] : ' ';
        if (used == 0) used = 1, in[0] = '\n';
        CHECK(td_tensor_write(m->input, in));
        CHECK(td_graph_forward(eval));
        CHECK(td_tensor_read(m->output, logp));
        const float *row = logp + (used - 1) * V;
        double sum = 0;
        for (int64_t v = 0; v < V; v++) sum += prob[v] = expf(row[v] / 0.8f);
        double r = td_rng_uniform(&rng) * sum;
        int64_t pick = 0;
        while (pick + 1 < V && (r -= prob[pick]) > 0) pick++;
        text[len] = (unsigned char)pick;
    }
    text[n] = 0;
    printf("sample:\n%s\n", (char *)text);
    free(text);
    free(prob);
    free(in);
    free(logp);
}

td_mesh *gpt_mesh(const options *o, td_comm *comm) {
    td_mesh_params mp = td_mesh_default_params(); /* pp, dp, tp */
    mp.sizes[0] = o->pipeline ? o->stages : 1;
    mp.sizes[2] = o->tp > 1 ? o->tp : 1;
    td_mesh *mesh;
    td_status s = td_mesh_create(&mesh, comm, &mp);
    if (s != TD_OK) {
        fprintf(stderr, "gpt: %d ranks as %d stage(s) x --tp %d: %s\n", td_comm_size(comm),
                mp.sizes[0], mp.sizes[2], td_last_error());
        exit(2);
    }
    return mesh;
}

void gpt_whole_model(const options *o, td_mesh *mesh, const td_param *params, size_t n,
                     td_graph **g, td_model *m) {
    td_param *whole;
    size_t n_whole;
    *g = NULL;
    CHECK(td_mesh_gather_model(mesh, params, n, &whole, &n_whole));
    if (!whole) return;
    options plain = *o; /* one process's model, the whole of every layer */
    plain.model.tensor_parallel = plain.model.sequence_parallel = 0;
    td_graph_params gp = td_graph_default_params();
    gp.seed = o->seed;
    gp.grad_enabled = 0;
    if (o->amp) gp.amp.level = TD_AMP_O1;
    CHECK(td_graph_create(g, &gp));
    gpt_build(&plain, *g, 1, m);
    td_graph_set_training(*g, 0);
    td_param *all;
    size_t n_all;
    CHECK(td_graph_parameters(*g, &all, &n_all));
    for (size_t i = 0; i < n_all; i++) {
        size_t k = 0;
        while (k < n_whole && strcmp(whole[k].name, all[i].name)) k++;
        if (k == n_whole || whole[k].count != all[i].count || whole[k].dtype != all[i].dtype) {
            fprintf(stderr, "gpt: the ranks hold no %s of the model's shape\n", all[i].name);
            exit(1);
        }
        memcpy(all[i].data, whole[k].data, all[i].count * td_dtype_size(all[i].dtype));
    }
    td_mesh_model_free(whole, n_whole);
}

/* Frees what the run holds. */
static void release(trainer *t) {
    td_ddp_destroy(t->ddp);
    td_zero_destroy(t->zero);
    td_optim_destroy(t->optim);
    td_graph_destroy(t->eval);
    td_graph_destroy(t->train);
    td_sampler_destroy(t->sampler);
    td_corpus_free(&t->text);
    free(t->x);
    free(t->y);
    td_mesh_destroy(t->mesh);
    td_comm_destroy(t->comm);
}

int main(int argc, char **argv) {
    trainer t;
    memset(&t, 0, sizeof t);
    t.opt = parse(argc, argv);
    if (t.opt.pipeline) return gpt_pipeline_main(&t.opt);
    setup(&t);
    const options *o = &t.opt;
    if (t.rank == 0) {
        char on[48] = "";
        if (t.device.type != TD_DEVICE_CPU) {
            char dev[32];
            td_device_format(t.device, dev, sizeof dev);
            snprintf(on, sizeof on, ", on %s", dev);
        }
        gpt_banner(o, t.world, on);
        printf("data: %s, %zu bytes (%zu train, %zu validation); unigram baseline %.4f\n", o->data,
               t.text.size, t.n_train, t.text.size - t.n_train,
               gpt_unigram_baseline(&t.text, t.n_train));
        printf("graph memory: %.2f MiB of activations and gradients per rank\n",
               (double)td_graph_memory_bytes(t.train) / (1 << 20));
        fflush(stdout);
    }
    if (t.first_step >= o->steps) {
        if (t.rank == 0)
            printf(
                "nothing left to train: the checkpoint is at step %ld, the last of --steps %ld\n",
                t.first_step, o->steps);
        release(&t);
        return 0;
    }
    size_t per_epoch = td_sampler_batches(t.sampler);
    uint64_t t0 = td_time_ns();
    double tokens = 0;
    float loss = NAN;
    double val = NAN;
    for (long step = t.first_step; step < o->steps; step++) {
        uint64_t epoch = (uint64_t)step / per_epoch;
        td_sampler_set_epoch(t.sampler, epoch);
        size_t rows = fill_batch(&t, (size_t)step % per_epoch);
        td_optim_set_lr(t.optim, gpt_lr_at(o, step));
        loss = forward_backward(&t, rows, (uint64_t)step);
        CHECK(td_loss_check(loss, step + 1));
        if (t.mesh)
            CHECK(
                td_mesh_clip_grad_norm(t.mesh, t.stepped, t.n_stepped, t.zero != NULL, 1.0, NULL));
        else if (t.zero)
            CHECK(td_zero_clip_grad_norm(t.zero, 1.0, NULL));
        else
            CHECK(td_clip_grad_norm(t.params, t.n_params, 1.0, NULL));
        CHECK(td_optim_step(t.optim));
        tokens += (double)o->batch * (double)o->model.context;
        int last = step + 1 == o->steps || step + 1 == o->stop_at;
        if (t.rank == 0 && ((step + 1) % 50 == 0 || last)) {
            double s = (double)(td_time_ns() - t0) / 1e9;
            printf("step %ld/%ld: train loss %.4f, lr %.2e, %.0f tokens/s\n", step + 1, o->steps,
                   (double)loss, gpt_lr_at(o, step), tokens / s);
            fflush(stdout);
        }
        if ((o->eval_every > 0 && (step + 1) % o->eval_every == 0) || last) {
            val = validate(&t);
            if (t.rank == 0) printf("step %ld: val loss %.4f\n", step + 1, val);
        }
        if (o->checkpoint &&
            ((o->checkpoint_every > 0 && (step + 1) % o->checkpoint_every == 0) || last))
            save(&t, step + 1);
        if (step + 1 == o->stop_at) break; /* as a job stopped here would */
    }
    if (t.zero) CHECK(td_zero_full_params(t.zero, 1)); /* the whole model on every rank */
    td_graph *whole = NULL; /* under --tp, the whole model gathered on rank 0 */
    td_model wm = t.eval_model;
    if (t.mesh) gpt_whole_model(&t.opt, t.mesh, t.params, t.n_params, &whole, &wm);
    if (t.rank == 0) {
        if (o->sample > 0) gpt_sample(o, whole ? whole : t.eval, &wm);
        td_param *ps = t.params;
        size_t nps = t.n_params;
        if (whole) CHECK(td_graph_parameters(whole, &ps, &nps));
        char hex[65];
        td_params_sha256(ps, nps, hex);
        printf("final: train loss %.6f, val loss %.6f, params_sha256 %s\n", (double)loss, val, hex);
    }
    td_graph_destroy(whole);
    release(&t);
    return 0;
}
