/* The example's pipeline-parallel training: the GPT cut between layers into stages, one per
 * rank, trained with the naive split, GPipe or 1F1B, and replicated when there are more ranks
 * than stages (P stages x D replicas, each stage's replicas averaging gradients through DDP).
 *
 *   build/bin/tandemrun --nproc-per-node 2 build/examples/gpt --pipeline 1f1b --steps 2000
 *
 * The first stage holds the embeddings and the last the head, whose output projection is the
 * token embedding: each holds a copy of transformer.wte.weight, which the pipeline keeps equal
 * (the same start, the gradients summed every step; docs/pipeline.md). Each replica trains on its
 * slice of every global batch, as the data-parallel mode's ranks do; the gradient norm is
 * clipped over the whole model across the stages. With --tp N every stage is split over N ranks
 * too (the ranks a device mesh of stages x replicas x N, gpt_mesh). Validation runs through the
 * pipeline, each replica its share of the windows. At the end the whole model is gathered on
 * rank 0 for the sample and the digest (gpt_whole_model). Checkpoints are one process's file
 * (td_mesh_save), as the data-parallel mode writes them, and resume in either mode at any
 * layout. --deterministic makes each micro-batch one of the replica's --shards and every layer
 * --tp-shards fixed shards, so the run ends on the bits of every other layout's. */
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "gpt.h"

/* A group for this process: the launcher's world, or one rank of its own. */
static td_comm *make_comm(const options *o) {
    td_comm_params cp = td_comm_default_params();
    if (!getenv("WORLD_SIZE") && !getenv("OMPI_COMM_WORLD_SIZE") && !getenv("SLURM_NTASKS")) {
        if (o->stages > 1) {
            fprintf(stderr,
                    "gpt: --stages %d needs %d ranks: run it under tandemrun --nproc-per-node %d "
                    "(or a multiple, for replicas)\n",
                    o->stages, o->stages, o->stages);
            exit(2);
        }
        cp.rank = cp.local_rank = 0;
        cp.world_size = cp.local_world_size = 1;
        cp.master_port = 20000 + (int)(getpid() % 20000);
    }
    td_comm *comm;
    CHECK(td_comm_create(&comm, &cp));
    return comm;
}

typedef struct {
    const options *o;
    long first_step; /* the step a resumed run starts at */
    td_comm *comm;
    td_mesh *mesh;                     /* pp (stages) x dp (replicas) x tp */
    int rank, world, D, replica, last; /* last: this rank is its replica's last stage */
    int speaks;                        /* tp rank 0 of a last stage: its loss is counted */
    int64_t batch;                     /* sequences per replica and step */
    td_pipeline *pipe;
    td_pipeline_info info;
    td_param *params;
    size_t n_params;
    td_optim *optim;
    td_corpus text;
    size_t n_train;
    td_sampler *sampler; /* over the training windows, sharded by replica */
    float *x;            /* (batch, T) */
    int64_t *y;          /* (batch, T) */
} trainer;

/* The whole model's checkpoint, gathered by name on rank 0 (td_mesh_save): one process's file. */
static void save(trainer *t, long step) {
    char steps[32], shape[160];
    snprintf(steps, sizeof steps, "%ld", step);
    gpt_run_meta(t->o, shape, sizeof shape);
    td_checkpoint_meta meta[] = {{"model", "gpt"}, {"run", shape}, {"step", steps}};
    CHECK(td_mesh_save(t->mesh, t->params, t->n_params, t->optim, t->o->checkpoint, meta, 3));
    if (t->rank == 0) printf("checkpoint at step %ld: %s\n", step, t->o->checkpoint);
    fflush(stdout);
}

/* Every rank reads its stage's slices of the whole tensors (td_mesh_load). */
static void resume(trainer *t) {
    const char *path;
    long step = gpt_resume_step(t->o, &path);
    if (step < 0) return;
    CHECK(td_mesh_load(t->mesh, t->params, t->n_params, t->optim, path));
    t->first_step = step;
    if (t->rank == 0) printf("resuming from %s at step %ld, world size %d\n", path, step, t->world);
}

static void setup(trainer *t, options *o) {
    t->o = o;
    t->comm = make_comm(o);
    t->rank = td_comm_rank(t->comm);
    t->world = td_comm_size(t->comm);
    t->mesh = gpt_mesh(o, t->comm);
    t->D = td_mesh_size(t->mesh, "dp");
    t->replica = td_mesh_coord(t->mesh, "dp");
    o->model.tensor_parallel = td_mesh_size(t->mesh, "tp") > 1 || o->tp_shards;
    o->model.sequence_parallel = o->sp;
    if (o->deterministic) { /* each micro-batch one of the replica's shards */
        if (o->shards % t->D) {
            fprintf(stderr, "gpt: --shards %d do not split among %d replicas\n", o->shards, t->D);
            exit(2);
        }
        o->micro = o->shards / t->D;
        if (o->micro > 1 && o->schedule == TD_SCHEDULE_NAIVE) o->schedule = TD_SCHEDULE_1F1B;
    }
    int micro = o->schedule == TD_SCHEDULE_NAIVE ? 1 : o->micro;
    if (o->batch % t->D || (o->batch / t->D) % micro) {
        fprintf(stderr,
                "gpt: --batch %d must split into %d replica(s) of %d micro-batch(es) each\n",
                o->batch, t->D, micro);
        exit(2);
    }
    t->batch = o->batch / t->D;
    size_t windows = gpt_load_text(o, &t->text, &t->n_train);
    td_sampler_params sp = td_sampler_default_params();
    sp.rank = t->replica;
    sp.world_size = t->D;
    sp.seed = o->seed;
    sp.drop_last = 1;
    sp.global_batch = (size_t)o->batch;
    CHECK(td_sampler_create(&t->sampler, windows, &sp));
    size_t BT = (size_t)t->batch * (size_t)o->model.context;
    t->x = malloc(BT * sizeof *t->x);
    t->y = malloc(BT * sizeof *t->y);
    if (!t->x || !t->y) CHECK(TD_ENOMEM);

    td_sequential *model;
    CHECK(td_gpt_sequential(&o->model, &model));
    td_pipeline_params pp = td_pipeline_default_params();
    pp.schedule = o->schedule;
    pp.stages = o->stages;
    pp.micro_batches = o->micro;
    pp.batch = t->batch;
    pp.split = o->split;
    pp.seed = o->seed;
    pp.graph.seed = o->seed;
    pp.mesh = t->mesh;
    if (o->amp) pp.graph.amp.level = TD_AMP_O1;
    pp.graph.recompute = o->recompute;
    pp.graph.threads = o->deterministic ? 1 : 0;
    pp.graph.tp_shards = o->tp_shards;
    pp.ddp.deterministic = o->deterministic;
    pp.ddp.shards = (size_t)o->shards;
    CHECK(td_pipeline_create(&t->pipe, t->comm, model, &pp));
    t->info = td_pipeline_get_info(t->pipe);
    t->last = t->info.stage + 1 == t->info.stages;
    t->speaks = t->last && td_mesh_coord(t->mesh, "tp") == 0;
    CHECK(td_pipeline_parameters(t->pipe, &t->params, &t->n_params));
    td_adamw_params ap = gpt_adamw(o);
    CHECK(td_optim_create_adamw(&t->optim, t->params, t->n_params, &ap));
    if (o->resume || o->resume_auto) resume(t);
    if (t->rank == 0) {
        char more[256];
        int at = snprintf(more, sizeof more,
                          ", pipeline %s: %d stage(s) x %d replica(s) x tp %d, %d "
                          "micro-batch(es); stages start at",
                          td_pipeline_schedule_name(o->schedule), o->stages, t->D,
                          td_mesh_size(t->mesh, "tp"), t->info.micro_batches);
        for (int s = 0; s < t->info.stages && at < (int)sizeof more; s++)
            at += snprintf(more + at, sizeof more - (size_t)at, " %s",
                           td_sequential_layer_name(model, t->info.stage_first[s]));
        gpt_banner(o, t->world, more);
    }
    td_sequential_destroy(model);
}

/* Fills x, y with this replica's slice of global batch `k`. */
static void fill_batch(trainer *t, size_t k) {
    size_t first, count;
    td_sampler_batch(t->sampler, k, &first, &count);
    const size_t *idx = td_sampler_indices(t->sampler);
    int64_t T = t->o->model.context;
    for (size_t i = 0; i < count; i++)
        td_corpus_window(t->text.bytes, idx[first + i], T, t->x + i * T, t->y + i * T);
}

/* The sum over the world of each rank's value (the last stages' losses, each counted by its tp
 * rank 0), on every rank. */
static double world_sum(trainer *t, double mine) {
    CHECK(td_comm_allreduce(t->comm, &mine, &mine, 1, TD_F64, TD_OP_SUM));
    return mine;
}

/* Mean loss over the first eval_batches x batch windows of the validation text (the data-parallel
 * mode's windows), each replica evaluating its share through its pipeline; on every rank. */
static double validate(trainer *t) {
    const uint8_t *val = t->text.bytes + t->n_train;
    int64_t T = t->o->model.context;
    size_t windows = td_corpus_windows(t->text.size - t->n_train, T);
    size_t want = (size_t)(t->o->eval_batches * t->o->batch);
    if (want > windows) want = windows;
    size_t first, count;
    td_split_even(want, t->D, t->replica, &first, &count);
    double sum = 0;
    for (size_t done = 0; done < count;) {
        size_t n = count - done < (size_t)t->batch ? count - done : (size_t)t->batch;
        for (size_t i = 0; i < n; i++)
            td_corpus_window(val, first + done + i, T, t->x + i * T, t->y + i * T);
        double lsum;
        int64_t correct;
        CHECK(td_pipeline_evaluate(t->pipe, t->x, t->y, (int64_t)n, &lsum, &correct));
        if (t->speaks) sum += lsum;
        done += n;
    }
    return world_sum(t, sum) / ((double)want * (double)T);
}

int gpt_pipeline_main(const options *given) {
    options opt = *given, *o = &opt;
    trainer t;
    memset(&t, 0, sizeof t);
    setup(&t, o);
    if (t.rank == 0) {
        printf("data: %s, %zu bytes (%zu train, %zu validation); unigram baseline %.4f\n", o->data,
               t.text.size, t.n_train, t.text.size - t.n_train,
               gpt_unigram_baseline(&t.text, t.n_train));
        fflush(stdout);
    }
    if (t.first_step >= o->steps) {
        if (t.rank == 0)
            printf(
                "nothing left to train: the checkpoint is at step %ld, the last of --steps %ld\n",
                t.first_step, o->steps);
        o->sample = 0;
    }
    size_t per_epoch = td_sampler_batches(t.sampler);
    uint64_t t0 = td_time_ns();
    double tokens = 0, loss = NAN, val = NAN;
    for (long step = t.first_step; step < o->steps; step++) {
        td_sampler_set_epoch(t.sampler, (uint64_t)step / per_epoch);
        fill_batch(&t, (size_t)step % per_epoch);
        td_optim_set_lr(t.optim, gpt_lr_at(o, step));
        float mine;
        CHECK(td_pipeline_step(t.pipe, t.x, t.y, &mine));
        if (t.last) CHECK(td_loss_check(mine, step + 1)); /* the loss is the last stage's */
        CHECK(td_pipeline_clip_grad_norm(t.pipe, 1.0, NULL));
        CHECK(td_optim_step(t.optim));
        tokens += (double)o->batch * (double)o->model.context;
        int last = step + 1 == o->steps || step + 1 == o->stop_at;
        if ((step + 1) % 50 == 0 || last) {
            loss = world_sum(&t, t.speaks ? (double)mine : 0) / t.D;
            double s = (double)(td_time_ns() - t0) / 1e9;
            if (t.rank == 0) {
                printf("step %ld/%ld: train loss %.4f, lr %.2e, %.0f tokens/s\n", step + 1,
                       o->steps, loss, gpt_lr_at(o, step), tokens / s);
                fflush(stdout);
            }
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
    if (t.rank == 0)
        printf("stage 0 activation memory: %.2f MiB per micro-batch\n",
               (double)td_pipeline_get_stats(t.pipe).activation_bytes / (1 << 20));
    td_graph *whole = NULL;
    td_model m;
    gpt_whole_model(o, t.mesh, t.params, t.n_params, &whole, &m);
    if (t.rank == 0) {
        if (o->sample > 0) gpt_sample(o, whole, &m);
        td_param *all;
        size_t n_all;
        CHECK(td_graph_parameters(whole, &all, &n_all));
        char hex[65];
        td_params_sha256(all, n_all, hex);
        printf("final: train loss %.6f, val loss %.6f, params_sha256 %s\n", loss, val, hex);
    }
    td_graph_destroy(whole);
    td_optim_destroy(t.optim);
    td_pipeline_destroy(t.pipe);
    td_mesh_destroy(t.mesh);
    td_sampler_destroy(t.sampler);
    td_corpus_free(&t.text);
    free(t.x);
    free(t.y);
    td_comm_destroy(t.comm);
    return 0;
}
