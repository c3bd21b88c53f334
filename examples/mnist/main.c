/* Trains PyTorch's MNIST example Net, an MLP, a CNN or a ResNet on Fashion-MNIST, in one process or
 * data-parallel (pipeline-parallel with --pipeline: pipeline.c).
 *
 *   build/examples/mnist --model net --epochs 2
 *   build/bin/tandemrun --nproc-per-node 2 build/examples/mnist --model cnn --epochs 3
 *   build/examples/mnist --spawn 2 --model cnn --epochs 3       (forks its own ranks)
 *
 * Under a launcher (tandemrun, mpirun, srun), or with --spawn N, every rank builds the same model,
 * DDP broadcasts rank 0's parameters and averages gradients bucket by bucket during backward, and
 * each rank trains on its slice of every global batch: the batch split as evenly as it goes (128
 * over 3 ranks: 43, 43, 42), each rank's gradient weighted by its share so that the average is the
 * global batch's mean. Only rank 0 prints and writes checkpoints. Test accuracy is computed each
 * epoch with the test set split across ranks. --max-steps N ends the run after N optimizer steps
 * in all (across epochs and a resume), writing the checkpoint where it stopped; it is also the
 * horizon of the cosine learning-rate schedule. --stop-at-step N stops at global step N instead,
 * writing the checkpoint, with the schedule left as it is: a run cut this way and resumed with the
 * same --epochs and --max-steps ends on the bits of one never cut. A checkpoint records its
 * schedule, and a resume with another one says so loudly.
 *
 * --device cuda trains on this rank's GPU (cuda:LOCAL_RANK; cuda:N names one, also for ranks
 * that share it): the graph, the optimizer and the loss scale on the GPU, batches uploaded
 * ahead on its copy stream from page-locked memory, one process's sweeps replayed as CUDA
 * graphs; DDP's buckets live on the GPU and go through NCCL (a GPU per rank) or CUDA IPC
 * (ranks sharing one). Deterministic mode stays on the CPU for now.
 *
 * --deterministic trains to the same bits at any world size (docs/reproducibility.md): the
 * global batch is --shards fixed shards, each rank runs its shards one by one (batch norm sees
 * one shard's statistics, dropout draws by sample and step), and DDP sums them in one fixed
 * tree. Its checkpoints (--checkpoint-every N steps) resume at any world size that divides the
 * shards, on the same trajectory; --resume auto picks up the --checkpoint file if there is one,
 * which is what a restarted job (tandemrun --max-restarts) needs. The last line gives the
 * SHA-256 of the parameters, to compare runs by.
 *
 * --zero 1|2|3 shards the training state over the ranks instead of replicating it (td_zero,
 * docs/zero.md): the optimizer state, also the gradients, also the parameters. Checkpoints are
 * then sharded (each rank writes its part beside --checkpoint, which names them) and resume at
 * any world size, as td_ddp's do; the run ends with each kind of memory rank 0 held. */
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/tandem.h"

#include "mnist.h"

typedef struct {
    td_model_kind model;
    int epochs;
    int batch; /* global */
    double lr, momentum;
    uint64_t seed;
    long max_steps; /* optimizer steps of the whole run, across epochs; 0 = --epochs decides */
    long stop_at;   /* stop at this global step, the schedule unchanged; 0 = at the run's end */
    int eval;       /* test accuracy after each epoch */
    int cosine;     /* anneal the learning rate to 0 over the run */
    long bucket_kb; /* DDP bucket cap (PyTorch's bucket_cap_mb), 0 = DDP's defaults */
    const char *data_dir, *checkpoint, *resume, *trace;
    td_amp_level amp;      /* apex's opt level */
    td_dtype amp_dtype;    /* bf16 or f16 */
    double loss_scale;     /* 0: dynamic; > 0: static; < 0: none */
    td_dtype comm_dtype;   /* what DDP's f32 gradients travel as */
    int spawn;             /* > 0: fork this many ranks (td_spawn, PyTorch's mp.spawn) */
    int deterministic;     /* the same bits at any world size */
    int shards;            /* S: fixed shards of the global batch (deterministic mode) */
    double dropout;        /* > 0: a dropout layer of this probability before the classifier */
    long checkpoint_every; /* also write the checkpoint every N steps (0: each epoch only) */
    int resume_auto;       /* --resume auto: from --checkpoint when that file exists */
    const char *device;    /* "cpu", "cuda" (this rank's GPU) or "cuda:N" */
    int zero;              /* 0: DDP; 1, 2, 3: the ZeRO stage */
    int trace_ops;         /* every op of the graph in the trace, not only forward/backward */
} options;

static const char usage[] =
    "usage: mnist [--model net|mlp|cnn|resnet] [--epochs N] [--batch GLOBAL] [--lr X]\n"
    "             [--momentum X] [--seed N] [--max-steps N] [--stop-at-step N] [--data DIR]\n"
    "             [--checkpoint PATH] [--resume PATH] [--trace PREFIX] [--trace-ops]\n"
    "             [--no-eval]\n"
    "             [--cosine | --constant-lr] [--bucket-kb N]\n"
    "             [--amp O0|O1|O2|O3] [--amp-dtype bf16|f16]\n"
    "             [--loss-scale dynamic|none|N] [--comm-dtype f32|bf16|f16]\n"
    "             [--spawn N]\n"
    "             [--deterministic [--shards S]] [--dropout P] [--checkpoint-every N]\n"
    "             [--resume auto] [--zero 1|2|3] [--device cpu|cuda|cuda:N]\n"
    "       mnist --pipeline naive|gpipe|1f1b ... (see examples/mnist/pipeline.c)\n"
    "  --max-steps N  stop after N optimizer steps in all, counted across epochs (and\n"
    "                 across a resume), or at the end of --epochs if that comes first;\n"
    "                 the cosine schedule anneals over the steps the run will take\n"
    "  --stop-at-step N  stop at step N (counted like --max-steps), writing the\n"
    "                 checkpoint, without changing the schedule: resuming it with the same\n"
    "                 --epochs and --max-steps continues the uncut run bit for bit\n"
    "  --trace PREFIX writes PREFIX.rank<R>.json per rank; under tandemrun --trace DIR\n"
    "                 the spans go to the job's one trace instead (docs/tracing.md);\n"
    "                 --trace-ops (or TANDEM_TRACE_OPS=1) adds every op of the graph\n";

static options parse(int argc, char **argv) {
    options o = {.model = TD_MODEL_NET,
                 .epochs = 2,
                 .batch = 128,
                 .lr = -1,
                 .momentum = -1,
                 .seed = 1,
                 .eval = 1,
                 .cosine = -1,
                 .amp = TD_AMP_O0,
                 .amp_dtype = TD_BF16,
                 .loss_scale = -2, /* unset: dynamic for f16, none for bf16 */
                 .comm_dtype = TD_F32,
                 .shards = 8,
                 .device = "cpu"};
    static const td_dtype comm_dtypes[] = {TD_F32, TD_BF16, TD_F16};
    int no_eval = 0, cosine = 0, constant = 0, amp = -1, amp_dtype = -1, comm_dtype = -1;
    const char *resume = NULL, *loss_scale = NULL;
    td_args a;
    mnist_shared shared = {&o.model,     &o.epochs,   &o.batch, &o.lr,    &o.momentum, &o.seed,
                           &o.max_steps, &o.data_dir, &o.trace, &no_eval, &cosine,     &constant};
    td_args_init(&a, "mnist", argc, argv);
    while (td_args_next(&a)) {
        mnist_shared_options(&a, &shared);
        td_args_flag(&a, "--deterministic", &o.deterministic);
        td_args_flag(&a, "--trace-ops", &o.trace_ops);
        td_args_long(&a, "--stop-at-step", 1, LONG_MAX, &o.stop_at);
        td_args_long(&a, "--bucket-kb", 1, LONG_MAX >> 10, &o.bucket_kb);
        td_args_string(&a, "--checkpoint", &o.checkpoint);
        td_args_string(&a, "--resume", &resume);
        td_args_int(&a, "--zero", 1, 3, &o.zero);
        td_args_int(&a, "--shards", 1, INT_MAX, &o.shards);
        td_args_real(&a, "--dropout", 0, 1, &o.dropout);
        td_args_long(&a, "--checkpoint-every", 0, LONG_MAX, &o.checkpoint_every);
        td_args_int(&a, "--spawn", 1, INT_MAX, &o.spawn);
        td_args_choice(&a, "--amp", "O0|O1|O2|O3", &amp);
        td_args_choice(&a, "--amp-dtype", "bf16|f16", &amp_dtype);
        td_args_choice(&a, "--comm-dtype", "f32|bf16|f16", &comm_dtype);
        if (td_args_string(&a, "--device", &o.device)) {
            td_device d;
            if (td_device_parse(o.device, &d) != TD_OK)
                td_args_bad_value(&a, o.device, "cpu, cuda or cuda:N");
        }
        if (td_args_string(&a, "--loss-scale", &loss_scale)) {
            char *end = NULL;
            o.loss_scale = !strcmp(loss_scale, "dynamic") ? 0
                           : !strcmp(loss_scale, "none")  ? -1
                                                          : strtod(loss_scale, &end);
            if (end && (end == loss_scale || *end || !(o.loss_scale > 0) || isinf(o.loss_scale)))
                td_args_bad_value(&a, loss_scale, "dynamic, none or a number > 0");
        }
    }
    if (no_eval) o.eval = 0;
    if (cosine || constant) o.cosine = cosine;
    if (amp >= 0) o.amp = (td_amp_level)amp;
    if (amp_dtype >= 0) o.amp_dtype = amp_dtype ? TD_F16 : TD_BF16;
    if (comm_dtype >= 0) o.comm_dtype = comm_dtypes[comm_dtype];
    if (resume && !strcmp(resume, "auto"))
        o.resume_auto = 1;
    else
        o.resume = resume;
    if (o.resume_auto && !o.checkpoint)
        td_args_error(&a, "--resume auto resumes from the --checkpoint file; give one");
    if (o.deterministic && o.batch % o.shards)
        td_args_error(&a,
                      "--batch %d is not a multiple of --shards %d: deterministic mode cuts every "
                      "global batch into equal shards",
                      o.batch, o.shards);
    if (o.deterministic && (o.amp > TD_AMP_O1 || o.comm_dtype != TD_F32))
        td_args_error(&a, "--deterministic sums f32 gradients: it takes --amp O0 or O1 (f32 "
                          "weights and gradients) and no --comm-dtype (docs/reproducibility.md)");
    int rc = td_args_finish(&a, usage);
    if (rc >= 0) exit(rc);
    mnist_sgd_defaults(o.model, &o.lr, &o.momentum);
    if (o.cosine < 0) o.cosine = o.model != TD_MODEL_NET;
    /* f16's range needs loss scaling (apex); bf16 has f32's range and does without. */
    if (o.loss_scale == -2) o.loss_scale = o.amp != TD_AMP_O0 && o.amp_dtype == TD_F16 ? 0 : -1;
    return o;
}

/* Everything one rank trains with. */
typedef struct {
    options opt;
    td_comm *comm; /* NULL in a single process */
    int rank, world;
    td_graph *train, *eval;
    td_model model, eval_model;
    td_param *params, *buffers;
    size_t n_params, n_buffers;
    td_optim *optim;
    td_grad_scaler *scaler; /* NULL without loss scaling */
    td_device device;       /* where the graphs train */
    td_ddp *ddp;
    td_zero *zero; /* --zero: instead of ddp */
    td_trace *trace;
    int first_epoch;
    size_t first_batch;   /* of first_epoch, when resuming in the middle of one */
    size_t epoch_batches; /* global batches (steps) per epoch */
    uint64_t run_steps;   /* steps of the whole run: --epochs of them, or --max-steps */
    uint64_t stop_steps;  /* where this process stops: run_steps, or --stop-at-step */
    /* The schedule of the run that wrote the checkpoint resumed from (resumed_schedule 0: none,
     * or a checkpoint from before checkpoints recorded it). */
    int resumed_schedule, resumed_cosine;
    double resumed_lr;
    int64_t resumed_lr_steps;
    int64_t local_batch; /* this rank's slice of the global batch */
    int64_t shard_batch; /* deterministic mode: samples per shard, what the graph is built for */
    float grad_scale;    /* world * local_batch / batch: weights the rank average by share */
} trainer;

/* What a checkpoint holds: the buffers and the loss scaler's state, then (whole) only when
 * `whole`, the parameters and the optimizer state (master weights included), which ZeRO writes
 * in parts itself. */
static td_param *checkpoint_tensors(trainer *t, int whole, size_t *n) {
    td_param *state = NULL, *amp = NULL;
    size_t n_state = 0, n_amp = 0;
    if (whole) td_optim_state(t->optim, &state, &n_state);
    if (t->scaler) td_grad_scaler_state(t->scaler, &amp, &n_amp);
    *n = (whole ? t->n_params : 0) + t->n_buffers + n_state + n_amp;
    td_param *all = malloc((*n ? *n : 1) * sizeof *all);
    if (!all) CHECK(TD_ENOMEM);
    td_param *at = all;
    for (size_t i = 0; i < t->n_buffers; i++) *at++ = t->buffers[i];
    for (size_t i = 0; i < n_amp; i++) *at++ = amp[i];
    for (size_t i = 0; whole && i < t->n_params; i++) *at++ = t->params[i];
    for (size_t i = 0; i < n_state; i++) *at++ = state[i];
    return all;
}

/* Writes the checkpoint after `epochs_done` whole epochs and `batches_done` batches of the next,
 * global step `step`: rank 0 alone, or with --zero every rank its part. It holds no world size:
 * the same checkpoint resumes at any. Called on every rank. */
static void save(trainer *t, int epochs_done, size_t batches_done, uint64_t step) {
    if (!t->zero && t->rank != 0) return;
    size_t n;
    td_param *all = checkpoint_tensors(t, !t->zero, &n);
    td_rng *rng = td_graph_rng(t->train);
    char epoch[32], batch[32], steps[32], global[32], shards[32], seed[32], offset[32], lr[32],
        lr_steps[32];
    snprintf(epoch, sizeof epoch, "%d", epochs_done);
    snprintf(batch, sizeof batch, "%zu", batches_done);
    snprintf(steps, sizeof steps, "%llu", (unsigned long long)step);
    snprintf(global, sizeof global, "%d", t->opt.batch);
    snprintf(shards, sizeof shards, "%d", t->opt.deterministic ? t->opt.shards : 0);
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)rng->seed);
    snprintf(offset, sizeof offset, "%llu", (unsigned long long)rng->offset);
    snprintf(lr, sizeof lr, "%.17g", t->opt.lr);
    snprintf(lr_steps, sizeof lr_steps, "%llu", (unsigned long long)t->run_steps);
    td_checkpoint_meta meta[] = {{"model", td_model_name(t->opt.model)},
                                 {"epoch", epoch},
                                 {"batch", batch},
                                 {"step", steps},
                                 {"global_batch", global},
                                 {"shards", shards},
                                 {"dropout_rng_seed", seed},
                                 {"dropout_rng_offset", offset},
                                 {"lr_schedule", t->opt.cosine ? "cosine" : "constant"},
                                 {"lr", lr},
                                 {"lr_steps", lr_steps}}; /* the cosine's horizon: last */
    size_t n_meta = sizeof meta / sizeof *meta - !t->opt.cosine;
    if (t->zero)
        CHECK(td_zero_save(t->zero, t->optim, t->opt.checkpoint, all, n, meta, n_meta));
    else
        CHECK(td_checkpoint_save(t->opt.checkpoint, all, n, meta, n_meta));
    free(all);
    if (t->rank == 0 && t->opt.checkpoint_every > 0) {
        printf("checkpoint at step %llu: %s\n", (unsigned long long)step, t->opt.checkpoint);
        fflush(stdout);
    }
}

/* An integer the checkpoint may lack (written before it existed): `absent` then. */
static int64_t meta_or(td_checkpoint *ck, const char *key, int64_t max, int64_t absent) {
    int64_t v = absent;
    td_status s = td_checkpoint_get_meta_i64(ck, key, 0, max, &v);
    if (s != TD_OK && s != TD_ENOTFOUND) CHECK(s);
    return v;
}

static void resume(trainer *t) {
    const char *path = t->opt.resume ? t->opt.resume : t->opt.checkpoint;
    if (!t->opt.resume && access(path, F_OK) != 0) return; /* --resume auto, nothing yet */
    td_checkpoint *ck;
    CHECK(td_checkpoint_open(&ck, path));
    const char *model = td_checkpoint_get_meta(ck, "model");
    if (!model || strcmp(model, td_model_name(t->opt.model))) {
        fprintf(stderr, "mnist: %s holds model %s, but --model is %s\n", path,
                model ? model : "(none)", td_model_name(t->opt.model));
        exit(1);
    }
    /* Checked before anything is loaded; the library's message names the key and the range.
     * "epoch" counts the epochs done, so 0 (nothing trained yet) up to --epochs (nothing left
     * to train) are the values this run can continue from. */
    int64_t epoch;
    uint64_t seed, offset;
    CHECK(td_checkpoint_get_meta_i64(ck, "epoch", 0, t->opt.epochs, &epoch));
    CHECK(td_checkpoint_get_meta_u64(ck, "dropout_rng_seed", 0, UINT64_MAX, &seed));
    CHECK(td_checkpoint_get_meta_u64(ck, "dropout_rng_offset", 0, UINT64_MAX, &offset));
    int64_t batch = meta_or(ck, "batch", INT32_MAX, 0), step = meta_or(ck, "step", INT64_MAX, 0);
    /* The trajectory is a function of the global batch and, deterministic, of the shards: a
     * checkpoint of other ones cannot continue it. */
    int64_t global = meta_or(ck, "global_batch", INT32_MAX, t->opt.batch);
    int64_t shards = meta_or(ck, "shards", INT32_MAX, 0);
    int want = t->opt.deterministic ? t->opt.shards : 0;
    if (global != t->opt.batch || shards != want) {
        char was[64], is[64];
        snprintf(was, sizeof was,
                 shards ? " --deterministic --shards %lld" : " (not deterministic)",
                 (long long)shards);
        snprintf(is, sizeof is, want ? " --deterministic --shards %d" : " (not deterministic)",
                 want);
        fprintf(stderr,
                "mnist: %s was written with --batch %lld%s, this run has --batch %d%s: resume "
                "with the same global batch and shards (at any world size that divides them)\n",
                path, (long long)global, was, t->opt.batch, is);
        exit(1);
    }
    size_t n;
    td_param *all = checkpoint_tensors(t, !t->zero, &n);
    if (t->zero) /* every rank its own parts, at this world size, sharded or not */
        CHECK(td_zero_load(t->zero, t->optim, path, all, n));
    else
        CHECK(td_checkpoint_read(ck, all, n));
    free(all);
    t->first_epoch = (int)epoch;
    t->first_batch = (size_t)batch;
    const char *schedule = td_checkpoint_get_meta(ck, "lr_schedule");
    const char *lr = td_checkpoint_get_meta(ck, "lr");
    if (schedule && lr) {
        t->resumed_schedule = 1;
        t->resumed_cosine = !strcmp(schedule, "cosine");
        t->resumed_lr = strtod(lr, NULL);
        t->resumed_lr_steps = meta_or(ck, "lr_steps", INT64_MAX, 0);
    }
    td_rng *rng = td_graph_rng(t->train);
    rng->seed = seed;
    rng->offset = offset;
    td_checkpoint_close(ck);
    if (t->rank == 0)
        printf("resuming from %s: epoch %lld, batch %lld, step %lld, world size %d\n", path,
               (long long)epoch + 1, (long long)batch, (long long)step, t->world);
}

/* The learning-rate schedule in words. */
static void schedule_words(char *out, size_t cap, int cosine, double lr, int64_t steps) {
    if (cosine)
        snprintf(out, cap, "cosine from %g over %lld steps", lr, (long long)steps);
    else
        snprintf(out, cap, "constant %g", lr);
}

/* A resume under another schedule than the checkpoint's run had (another --epochs or
 * --max-steps moves the cosine's horizon, another --lr its start) trains on, but no longer on
 * that run's trajectory, which is easy to miss: say so, loudly. Not refused: training on under
 * a new schedule (longer, or fine-tuning) is a legitimate use of a checkpoint. */
static void warn_if_schedule_differs(const trainer *t, const char *path) {
    if (!t->resumed_schedule || t->rank != 0) return;
    int64_t steps = (int64_t)t->run_steps;
    if (t->resumed_cosine == t->opt.cosine && t->resumed_lr == t->opt.lr &&
        (!t->opt.cosine || t->resumed_lr_steps == steps))
        return;
    char was[96], is[96];
    schedule_words(was, sizeof was, t->resumed_cosine, t->resumed_lr, t->resumed_lr_steps);
    schedule_words(is, sizeof is, t->opt.cosine, t->opt.lr, steps);
    fprintf(stderr,
            "mnist: WARNING: %s was written by a run whose learning rate was %s; this run's is "
            "%s, so it does not continue that run: its parameters will differ from those of the "
            "run never stopped. To cut a run and resume it bit for bit, give both parts the same "
            "--epochs, --max-steps and --lr, and stop the first with --stop-at-step.\n",
            path, was, is);
}

static td_status dropout_layer(td_graph *g, const char *name, td_tensor *x, td_rng *rng,
                               const void *arg, td_tensor **y) {
    (void)name;
    (void)rng;
    return td_graph_dropout(g, x, *(const float *)arg, y);
}

/* The model of --model, with --dropout's layer before its classifier, built for `batch`. */
static void build_model(const options *o, td_graph *g, int64_t batch, td_model *m) {
    td_sequential *s;
    CHECK(td_model_sequential(o->model, &s));
    if (o->dropout > 0) {
        float p = (float)o->dropout;
        CHECK(td_sequential_insert(s, td_sequential_count(s) - 1, "dropout", dropout_layer, &p,
                                   sizeof p));
    }
    CHECK(td_model_build_sequential(g, s, batch, o->seed, m));
    td_sequential_destroy(s);
}

/* Points (CPU) or copies (GPU, on its stream: the recorded sweeps keep reading the graph's own
 * memory) `n` samples of the batch, from sample `at` on, into the model's input and labels. */
static void feed(const trainer *t, const td_model *m, const td_batch *b, size_t at) {
    size_t sample = (size_t)td_tensor_numel(m->input) / (size_t)td_tensor_shape(m->input).dim[0];
    if (b->device.type == TD_DEVICE_CPU && t->device.type == TD_DEVICE_CPU) {
        CHECK(td_tensor_set_data(m->input, b->x + at * sample));
        CHECK(td_tensor_set_data(m->labels, b->y + at));
        return;
    }
    CHECK(td_tensor_copy_from(m->input, b->device, b->x + at * sample));
    CHECK(td_tensor_copy_from(m->labels, b->device, b->y + at));
}

/* The loss of the last forward, wherever the graph computes. */
static float loss_of(const td_model *m) {
    float loss;
    CHECK(td_tensor_read(m->loss, &loss));
    return loss;
}

static void setup(trainer *t) {
    t->rank = 0;
    t->world = 1;
    int launched = getenv("WORLD_SIZE") || getenv("OMPI_COMM_WORLD_SIZE") || getenv("SLURM_NTASKS");
    if (launched || t->opt.deterministic || t->opt.zero) {
        td_comm_params cp = td_comm_default_params();
        if (!launched) { /* alone: DDP's shard tree or ZeRO on one rank */
            cp.rank = cp.local_rank = 0;
            cp.world_size = cp.local_world_size = 1;
        }
        CHECK(td_comm_create(&t->comm, &cp));
        t->rank = td_comm_rank(t->comm);
        t->world = td_comm_size(t->comm);
    }
    if (t->opt.batch < t->world) {
        fprintf(stderr,
                "mnist: --batch %d gives some of the %d ranks no sample; pass at least %d\n",
                t->opt.batch, t->world, t->world);
        exit(2);
    }
    CHECK(td_device_choose(t->opt.device, &t->device));
    size_t first, count;
    td_split_even((size_t)t->opt.batch, t->world, t->rank, &first, &count);
    t->local_batch = (int64_t)count;
    t->grad_scale = (float)((double)t->world * (double)count / (double)t->opt.batch);
    t->shard_batch = t->opt.batch / t->opt.shards;
    /* --trace PREFIX: this rank's own file; else under tandemrun --trace DIR the job's trace,
     * which --trace-ops (or tandemrun --trace-ops) fills with every op of the graph too. */
    if (t->opt.trace) CHECK(td_trace_create(&t->trace, t->rank));
    if (!t->trace) t->trace = td_comm_trace(t->comm);
    const char *ops = getenv("TANDEM_TRACE_OPS");
    if (t->trace) CHECK(td_trace_name_thread(t->trace, "compute"));
    td_graph_params go = td_graph_default_params();
    go.device = t->device;
    go.seed = t->opt.seed;
    go.amp.level = t->opt.amp;
    go.amp.dtype = t->opt.amp_dtype;
    /* One thread per shard: no sum of oneDNN's depends on OMP_NUM_THREADS. Shards of 16 samples
     * or fewer take their linear layers' weights blocked, laid out once per step for all its
     * shards (the MLP's step at 8 shards of 16: 10% less time; at 32 or 64 samples a pass packs
     * the plain weights for less than the copy costs). Chosen by the shard's size, not by how
     * many shards a rank runs, so that every world size computes with the same kernels. */
    go.threads = t->opt.deterministic ? 1 : 0;
    go.blocked_linear = t->opt.deterministic && t->shard_batch <= 16;
    if (t->opt.trace_ops || (ops && !strcmp(ops, "1"))) go.trace = t->trace;
    CHECK(td_graph_create(&t->train, &go));
    const char *amp_note = td_graph_amp_fallback(t->train); /* no fast low-precision kernels */
    if (amp_note && t->rank == 0) fprintf(stderr, "mnist: %s\n", amp_note);
    build_model(&t->opt, t->train, t->opt.deterministic ? t->shard_batch : t->local_batch,
                &t->model);
    go.grad_enabled = 0;
    go.threads = 0;
    go.blocked_linear = 0;
    go.trace = NULL;
    CHECK(td_graph_create(&t->eval, &go));
    build_model(&t->opt, t->eval, t->local_batch, &t->eval_model);
    td_graph_set_training(t->eval, 0);

    CHECK(td_graph_parameters(t->train, &t->params, &t->n_params));
    CHECK(td_graph_buffers(t->train, &t->buffers, &t->n_buffers));
    td_ddp_params dp = td_ddp_default_params();
    dp.trace = t->trace;
    dp.comm_dtype = t->opt.comm_dtype;
    dp.deterministic = t->opt.deterministic;
    dp.shards = (size_t)t->opt.shards;
    if (t->opt.bucket_kb > 0) dp.bucket_bytes = (size_t)t->opt.bucket_kb << 10;
    td_param *stepped = t->params; /* what the optimizer steps: all, or this rank's shards */
    size_t n_stepped = t->n_params;
    if (t->opt.zero) {
        td_zero_params zp = td_zero_default_params();
        zp.stage = t->opt.zero;
        zp.ddp = dp;
        CHECK(td_zero_create(&t->zero, t->comm, t->params, t->n_params, t->buffers, t->n_buffers,
                             &zp));
        CHECK(td_zero_parameters(t->zero, &stepped, &n_stepped));
        td_graph_set_grad_ready_hook(t->train, td_zero_grad_ready_hook, t->zero);
        td_graph_set_param_use_hook(t->train, td_zero_param_use_hook, t->zero);
    }
    /* After ZeRO moved the parameters: the evaluation graph reads where they are now. */
    CHECK(td_graph_share_params(t->eval, t->train));
    td_sgd_params sp = td_sgd_default_params();
    sp.lr = t->opt.lr;
    sp.momentum = t->opt.momentum;
    CHECK(td_optim_create_sgd(&t->optim, stepped, n_stepped, &sp));
    if (t->opt.loss_scale >= 0) {
        td_grad_scaler_params gp = td_grad_scaler_default_params();
        gp.comm = t->comm; /* every rank skips the same steps */
        if (t->opt.loss_scale > 0) {
            gp.init_scale = t->opt.loss_scale;
            gp.dynamic = 0;
        }
        CHECK(td_grad_scaler_create(&t->scaler, &gp));
    }
    if (t->opt.resume || t->opt.resume_auto) resume(t);
    if (t->comm && !t->zero) {
        CHECK(
            td_ddp_create(&t->ddp, t->comm, t->params, t->n_params, t->buffers, t->n_buffers, &dp));
        td_graph_set_grad_ready_hook(t->train, td_ddp_grad_ready_hook, t->ddp);
    }
}

/* The calls of a step, to DDP or ZeRO, whichever synchronises the ranks (or none, alone). */
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

/* The step's loss reduced over ranks (this rank's `mine` alone). */
static float sync_loss(const trainer *t, float mine) {
    return t->zero ? td_zero_loss(t->zero) : t->ddp ? td_ddp_loss(t->ddp) : mine;
}

/* After step `step` of `epoch`, which runs to `end`: a bar redrawn in place on a terminal,
 * whole lines every 100 steps and at the end otherwise (a log keeps no \r). */
static void progress(const trainer *t, int epoch, size_t step, size_t end, double loss,
                     double samples_per_s) {
    if (t->rank != 0) return;
    size_t steps = t->epoch_batches;
    if (mnist_progress_redraws()) {
        int width = 30, filled = (int)(width * (step + 1) / steps);
        printf("\repoch %d [%.*s%*s] %zu/%zu loss %.4f %.0f samples/s", epoch + 1, filled,
               "==============================", width - filled, "", step + 1, steps, loss,
               samples_per_s);
        if (step + 1 == end) printf("\n");
        fflush(stdout);
    } else if ((step + 1) % 100 == 0 || step + 1 == end) {
        printf("epoch %d step %zu/%zu loss %.4f %.0f samples/s\n", epoch + 1, step + 1, steps, loss,
               samples_per_s);
        fflush(stdout);
    }
}

/* Forward and backward of the loader's batch, one rank's slice of a global batch; the gradients
 * are the global batch's mean after it. Returns the loss to show. */
static float forward_backward(trainer *t, const td_batch *batch) {
    uint64_t t0 = td_time_ns();
    sync_prepare(t);
    /* The batch stays valid until the next td_loader_next: train on it in place. */
    feed(t, &t->model, batch, 0);
    CHECK(td_graph_forward(t->train));
    uint64_t t1 = td_time_ns();
    float loss = loss_of(&t->model);
    /* The loss is this rank's mean; its share of the global mean has this weight, times the
     * loss scale under mixed precision. */
    float seed = t->grad_scale * (t->scaler ? td_grad_scaler_scale(t->scaler) : 1.0f);
    CHECK(td_graph_backward_from(t->train, t->model.loss, &seed));
    sync_finish(t, loss * t->grad_scale);
    if (t->trace) {
        CHECK(td_trace_span(t->trace, "forward", "compute", t0, t1));
        CHECK(td_trace_span(t->trace, "backward", "compute", t1, td_time_ns()));
    }
    return sync_loss(t, loss);
}

/* The same in deterministic mode: this rank's shards of the global batch one after another, each
 * with the graph built for one shard, its dropout keyed by (step, sample index in the global
 * batch); DDP folds their gradients, buffers and losses into its fixed tree. */
static float forward_backward_shards(trainer *t, const td_batch *batch, uint64_t step) {
    size_t first, count, b = (size_t)t->shard_batch;
    if (t->zero)
        td_zero_shards(t->zero, &first, &count);
    else
        td_ddp_shards(t->ddp, &first, &count);
    for (size_t j = 0; j < count; j++) {
        uint64_t t0 = td_time_ns();
        sync_prepare(t);
        if (j > 0) td_graph_keep_weights(t->train); /* no optimizer step since shard 0 */
        feed(t, &t->model, batch, j * b);
        CHECK(td_graph_set_rng_key(t->train, step, (first + j) * b));
        CHECK(td_graph_forward(t->train));
        float loss = loss_of(&t->model);
        CHECK(td_graph_zero_grad(t->train));
        CHECK(td_graph_set_shard(t->train, j, count)); /* linear layers sum the shards */
        /* every shard's loss is its mean; DDP averages over the shards (and f16 scales it) */
        float seed = t->scaler ? td_grad_scaler_scale(t->scaler) : 1.0f;
        CHECK(td_graph_backward_from(t->train, t->model.loss, &seed));
        sync_finish(t, loss);
        if (t->trace) CHECK(td_trace_span(t->trace, "shard", "compute", t0, td_time_ns()));
    }
    return sync_loss(t, 0.0f);
}

/* Steps [first, end) of one epoch; returns samples/s over them (all ranks). */
static double train_epoch(trainer *t, td_loader *loader, int epoch, size_t first, size_t end) {
    CHECK(td_loader_seek(loader, (uint64_t)epoch, first));
    uint64_t start = td_time_ns();
    for (size_t step = first; step < end; step++) {
        uint64_t global_step = (uint64_t)epoch * t->epoch_batches + step;
        if (t->opt.cosine)
            td_optim_set_lr(t->optim, td_lr_cosine(t->opt.lr, 0.0, (int64_t)t->run_steps,
                                                   (int64_t)global_step));
        td_batch batch;
        CHECK(td_loader_next(loader, &batch));
        float loss = t->opt.deterministic ? forward_backward_shards(t, &batch, global_step)
                                          : forward_backward(t, &batch);
        uint64_t t2 = td_time_ns();
        int skipped = 0; /* a step the loss scaler skipped is not a divergence (apex) */
        if (t->scaler) {
            CHECK(td_grad_scaler_step(t->scaler, t->optim, &skipped));
            td_grad_scaler_update(t->scaler);
        } else {
            CHECK(td_optim_step(t->optim));
        }
        if (!skipped) CHECK(td_loss_check(loss, (int64_t)global_step + 1));
        CHECK(td_graph_zero_grad(t->train));
        uint64_t t3 = td_time_ns();
        if (t->trace) CHECK(td_trace_span(t->trace, "optimizer", "compute", t2, t3));
        if (t->opt.checkpoint && t->opt.checkpoint_every > 0 &&
            (global_step + 1) % (uint64_t)t->opt.checkpoint_every == 0 && step + 1 < end)
            save(t, epoch, step + 1, global_step + 1);
        double secs = (double)(td_time_ns() - start) * 1e-9;
        progress(t, epoch, step, end, loss, (double)(step + 1 - first) * t->opt.batch / secs);
    }
    return (double)(end - first) * t->opt.batch / ((double)(td_time_ns() - start) * 1e-9);
}

/* Test accuracy and mean loss, the test set split across ranks batch by batch. */
static void evaluate(trainer *t, td_loader *test, double *accuracy, double *loss) {
    /* ranks evaluate different batches: ZeRO holds every parameter whole meanwhile */
    if (t->zero) CHECK(td_zero_full_params(t->zero, 1));
    CHECK(td_loader_set_epoch(test, 0));
    int64_t cap = td_tensor_shape(t->eval_model.input).dim[0];
    size_t sample = (size_t)td_tensor_numel(t->eval_model.input) / (size_t)cap;
    float *x = calloc((size_t)cap * sample, sizeof *x);
    int64_t *y = calloc((size_t)cap, sizeof *y);
    float *logp = malloc((size_t)td_tensor_numel(t->eval_model.output) * sizeof *logp);
    if (!x || !y || !logp) CHECK(TD_ENOMEM);
    double sums[3] = {0, 0, 0}; /* correct, loss sum, samples */
    td_batch b;
    for (size_t i = 0;; i++) {
        CHECK(td_loader_next(test, &b));
        if (b.size == 0) break;
        if ((int)(i % (size_t)t->world) != t->rank) continue;
        memcpy(x, b.x, b.size * sample * sizeof *x);
        memcpy(y, b.y, b.size * sizeof *y);
        CHECK(td_tensor_write(t->eval_model.input, x));
        CHECK(td_tensor_write(t->eval_model.labels, y));
        CHECK(td_graph_forward(t->eval));
        CHECK(td_tensor_read(t->eval_model.output, logp));
        for (size_t r = 0; r < b.size; r++) {
            const float *row = logp + r * 10;
            int best = 0;
            for (int c = 1; c < 10; c++)
                if (row[c] > row[best]) best = c;
            sums[0] += best == y[r];
            sums[1] -= row[y[r]];
        }
        sums[2] += (double)b.size;
    }
    if (t->comm) CHECK(td_comm_allreduce(t->comm, sums, sums, 3, TD_F64, TD_OP_SUM));
    *accuracy = sums[0] / sums[2];
    *loss = sums[1] / sums[2];
    if (t->zero) CHECK(td_zero_full_params(t->zero, 0));
    free(x);
    free(y);
    free(logp);
}

/* The OpenMP threads of this rank: OMP_NUM_THREADS, or OpenMP's default of one per core the
 * process may run on. */
static int openmp_threads(void) {
    const char *v = getenv("OMP_NUM_THREADS");
    if (v && atoi(v) > 0) return atoi(v);
    cpu_set_t cores;
    return sched_getaffinity(0, sizeof cores, &cores) == 0 ? CPU_COUNT(&cores) : 1;
}

static int train(int rank, int world_size, void *arg);

/* What ZeRO held on this rank, by kind, now and at its peak (td_zero_memory_stats). */
static void print_zero_memory(const trainer *t) {
    td_zero_memory m = td_zero_memory_stats(t->zero, t->optim);
    int stage;
    size_t units, flats;
    td_zero_layout(t->zero, &stage, &units, &flats);
    printf("zero stage %d, %zu units, rank 0 of %d held (KiB now / peak): parameters %zu / %zu, "
           "gradients %zu / %zu, optimizer %zu / %zu, gathered %zu / %zu, reducing %zu / %zu, "
           "cached %zu / %zu, total %zu / %zu\n",
           stage, units, t->world, m.now.params >> 10, m.peak.params >> 10, m.now.grads >> 10,
           m.peak.grads >> 10, m.now.optim >> 10, m.peak.optim >> 10, m.now.gathered >> 10,
           m.peak.gathered >> 10, m.now.reducing >> 10, m.peak.reducing >> 10, m.now.cached >> 10,
           m.peak.cached >> 10, m.now.total >> 10, m.peak.total >> 10);
}

int main(int argc, char **argv) {
    if (mnist_pipeline_requested(argc, argv)) return mnist_pipeline_main(argc, argv);
    options opt = parse(argc, argv);
    if (opt.spawn > 0 && !getenv("WORLD_SIZE")) {
        td_spawn_params sp = td_spawn_default_params();
        sp.nprocs = opt.spawn;
        CHECK(td_spawn(train, &opt, &sp)); /* names a rank that failed */
        return 0;
    }
    return train(0, 1, &opt);
}

/* One rank (or the only process). */
static int train(int rank, int world_size, void *arg) {
    (void)rank, (void)world_size; /* the environment says, as under a launcher */
    trainer t = {.opt = *(const options *)arg};
    setup(&t);

    td_dataset *train_set, *test_set;
    CHECK(td_dataset_load_fashion_mnist(&train_set, t.opt.data_dir, TD_SPLIT_TRAIN));
    CHECK(td_dataset_load_fashion_mnist(&test_set, t.opt.data_dir, TD_SPLIT_TEST));
    td_loader_params lp = td_loader_default_params();
    lp.sampler.global_batch = (size_t)t.opt.batch; /* each rank its slice of every batch */
    lp.sampler.seed = t.opt.seed;
    lp.sampler.drop_last = 1; /* the graph is built for one batch size */
    lp.sampler.rank = t.rank;
    lp.sampler.world_size = t.world;
    lp.device = t.device; /* the test set stays on the host: evaluation copies its batches */
    td_loader *loader = mnist_train_loader(train_set, &lp), *test_loader;
    t.epoch_batches = td_loader_batches_per_epoch(loader);
    t.run_steps = (uint64_t)t.opt.epochs * t.epoch_batches;
    if (t.opt.max_steps > 0 && (uint64_t)t.opt.max_steps < t.run_steps)
        t.run_steps = (uint64_t)t.opt.max_steps;
    t.stop_steps = t.run_steps;
    if (t.opt.stop_at > 0 && (uint64_t)t.opt.stop_at < t.stop_steps)
        t.stop_steps = (uint64_t)t.opt.stop_at;
    warn_if_schedule_differs(&t, t.opt.resume ? t.opt.resume : t.opt.checkpoint);
    td_loader_params tp = td_loader_default_params();
    tp.batch_size = (size_t)(t.opt.batch / t.world); /* the same batches on every rank */
    tp.sampler.shuffle = 0;
    CHECK(td_loader_create(&test_loader, test_set, &tp));

    if (t.rank == 0) {
        char steps[96] = "", precision[32] = "f32";
        int n = 0;
        if ((uint64_t)t.opt.epochs * t.epoch_batches > t.run_steps)
            n = snprintf(steps, sizeof steps, " (--max-steps %llu)",
                         (unsigned long long)t.run_steps);
        if (t.stop_steps < t.run_steps)
            snprintf(steps + n, sizeof steps - (size_t)n, ", stopping at step %llu",
                     (unsigned long long)t.stop_steps);
        if (t.opt.amp != TD_AMP_O0)
            snprintf(precision, sizeof precision, "amp O%d %s", (int)t.opt.amp,
                     td_dtype_name(t.opt.amp_dtype));
        char on[32];
        td_device_format(t.device, on, sizeof on);
        printf("training %s on Fashion-MNIST: %d rank(s), global batch %d, %d epoch(s) of %zu "
               "steps%s, %s on %s%s\n",
               td_model_name(t.opt.model), t.world, t.opt.batch, t.opt.epochs, t.epoch_batches,
               steps, precision, on, t.first_epoch || t.first_batch ? " (resumed)" : "");
        if (t.opt.deterministic) {
            int idle = openmp_threads() - 1;
            printf("deterministic: %d shards of %lld samples, %lld per rank, one thread each",
                   t.opt.shards, (long long)t.shard_batch, (long long)(t.opt.shards / t.world));
            if (idle > 0)
                printf(" (this rank's %d other OpenMP thread(s) idle: one rank per core is as "
                       "deterministic, and faster)",
                       idle);
            printf("\n");
        }
    }
    double accuracy = 0, test_loss = 0, rate = 0;
    uint64_t done = (uint64_t)t.first_epoch * t.epoch_batches + t.first_batch; /* steps */
    for (int epoch = t.first_epoch; epoch < t.opt.epochs && done < t.stop_steps; epoch++) {
        /* the epoch's steps [first, end): all of them, or up to --max-steps */
        uint64_t at = (uint64_t)epoch * t.epoch_batches;
        size_t first = (size_t)(done - at), end = t.epoch_batches;
        if (t.stop_steps - at < end) end = (size_t)(t.stop_steps - at);
        rate = train_epoch(&t, loader, epoch, first, end);
        done = at + end;
        if (t.opt.eval) evaluate(&t, test_loader, &accuracy, &test_loss);
        if (t.rank == 0 && t.opt.eval)
            printf("epoch %d: test accuracy %.4f, test loss %.4f, %.0f samples/s\n", epoch + 1,
                   accuracy, test_loss, rate);
        /* stopped by --max-steps inside the epoch: the checkpoint says where, to go on */
        int whole = end == t.epoch_batches;
        if (t.opt.checkpoint) save(&t, whole ? epoch + 1 : epoch, whole ? 0 : end, done);
    }
    char digest[65];
    if (t.rank == 0 && t.zero) print_zero_memory(&t);
    if (t.zero) CHECK(td_zero_full_params(t.zero, 1)); /* the whole model, for its digest */
    CHECK(td_params_sha256(t.params, t.n_params, digest));
    if (t.rank == 0 && t.scaler)
        printf("loss scale %g, %lld step(s) skipped for inf/NaN gradients\n",
               (double)td_grad_scaler_scale(t.scaler), (long long)td_grad_scaler_skipped(t.scaler));
    if (t.rank == 0 && t.opt.eval)
        printf("final: model %s ranks %d epochs %d steps %llu test_accuracy %.4f test_loss %.4f "
               "samples_per_s %.0f params_sha256 %s\n",
               td_model_name(t.opt.model), t.world, t.opt.epochs, (unsigned long long)done,
               accuracy, test_loss, rate, digest);
    else if (t.rank == 0)
        printf("final: model %s ranks %d epochs %d steps %llu samples_per_s %.0f params_sha256 "
               "%s\n",
               td_model_name(t.opt.model), t.world, t.opt.epochs, (unsigned long long)done, rate,
               digest);
    if (t.opt.trace) {
        char path[4096];
        snprintf(path, sizeof path, "%s.rank%d.json", t.opt.trace, t.rank);
        CHECK(td_trace_write(t.trace, path));
        td_trace_destroy(t.trace);
    }
    td_loader_destroy(loader);
    td_loader_destroy(test_loader);
    td_dataset_destroy(train_set);
    td_dataset_destroy(test_set);
    td_ddp_destroy(t.ddp);
    td_zero_destroy(t.zero);
    td_grad_scaler_destroy(t.scaler);
    td_optim_destroy(t.optim);
    td_graph_destroy(t.eval);
    td_graph_destroy(t.train);
    td_comm_destroy(t.comm);
    return 0;
}
