/* The example's pipeline-parallel training: the model cut into stages, one per rank, trained
 * with the naive split, GPipe or 1F1B, and replicated when there are more ranks than stages
 * (P stages x D replicas; each stage's replicas average gradients through DDP).
 *
 *   build/bin/tandemrun --nproc-per-node 2 build/examples/mnist --model resnet --pipeline 1f1b \
 *       --stages 2 --micro-batches 4 --epochs 3
 *
 * Each replica trains on its slice of every global batch (the loader shards it as in the data
 * parallel mode); stage 0 reads the images and the last stage the labels. The last stage of
 * replica 0 prints progress and the test accuracy, which every replica helps evaluate, through
 * the pipeline, batch by batch. With --trace PREFIX every rank writes PREFIX.rank<r>.json, a
 * Chrome trace of its forwards, backwards, transfers and optimizer steps (under tandemrun
 * --trace DIR they go to the job's one trace instead). Checkpoints are not
 * written in this mode. The last line gives the SHA-256 of the whole model's parameters (every
 * stage's, in layer order), to compare runs by. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/tandem.h"

#include "mnist.h"

typedef struct {
    td_model_kind model;
    td_pipeline_schedule schedule;
    int stages, micro, epochs, batch, eval, cosine;
    double lr, momentum;
    uint64_t seed;
    long max_steps; /* optimizer steps of the whole run, across epochs; 0 = --epochs decides */
    const char *split, *data_dir, *trace;
} pp_options;

int mnist_pipeline_requested(int argc, char **argv) {
    for (int i = 1; i < argc && strcmp(argv[i], "--"); i++)
        if (!strcmp(argv[i], "--pipeline") || !strncmp(argv[i], "--pipeline=", 11)) return 1;
    return 0;
}

static const char usage[] =
    "usage: mnist --pipeline naive|gpipe|1f1b [--stages P] [--micro-batches M]\n"
    "             [--split NAMES|balanced] [--model resnet|net|mlp|cnn] [--epochs N]\n"
    "             [--batch GLOBAL] [--lr X] [--momentum X] [--seed N] [--max-steps N]\n"
    "             [--data DIR] [--trace PREFIX] [--no-eval] [--cosine | --constant-lr]\n"
    "       run under tandemrun with P x replicas ranks\n"
    "  --max-steps N  stop after N optimizer steps in all, counted across epochs, or at\n"
    "                 the end of --epochs if that comes first\n";

static pp_options parse(int argc, char **argv) {
    pp_options o = {
        TD_MODEL_RESNET, TD_SCHEDULE_1F1B, 2, 4, 2, 128, 1, 1, -1, -1, 1, 0, NULL, NULL, NULL};
    int no_eval = 0, cosine = 0, constant = 0;
    td_args a;
    mnist_shared shared = {&o.model,     &o.epochs,   &o.batch, &o.lr,    &o.momentum, &o.seed,
                           &o.max_steps, &o.data_dir, &o.trace, &no_eval, &cosine,     &constant};
    td_args_init(&a, "mnist", argc, argv);
    while (td_args_next(&a)) {
        mnist_shared_options(&a, &shared);
        if (td_args_is(&a, "--pipeline")) {
            const char *v = td_args_value(&a);
            if (v && td_pipeline_schedule_parse(v, &o.schedule) != TD_OK)
                td_args_bad_value(&a, v, "naive, gpipe or 1f1b");
        }
        td_args_int(&a, "--stages", 1, TD_PIPELINE_MAX_STAGES, &o.stages);
        td_args_int(&a, "--micro-batches", 1, INT_MAX, &o.micro);
        td_args_string(&a, "--split", &o.split);
    }
    int rc = td_args_finish(&a, usage);
    if (rc >= 0) exit(rc);
    if (no_eval) o.eval = 0;
    if (cosine || constant) o.cosine = cosine;
    if (o.split && !strcmp(o.split, "balanced")) o.split = NULL;
    mnist_sgd_defaults(o.model, &o.lr, &o.momentum); /* both modes train the same way */
    return o;
}

/* A group for this process: the launcher's world, or one rank of its own. */
static td_comm *make_comm(const pp_options *o) {
    td_comm_params cp = td_comm_default_params();
    if (!getenv("WORLD_SIZE")) {
        if (o->stages > 1) {
            fprintf(stderr,
                    "mnist: --stages %d needs %d ranks: run it under tandemrun "
                    "--nproc-per-node %d (or a multiple, for replicas)\n",
                    o->stages, o->stages, o->stages);
            exit(2);
        }
        cp.rank = 0;
        cp.world_size = 1;
        cp.local_rank = 0;
        cp.local_world_size = 1;
        cp.master_port = 20000 + (int)(getpid() % 20000);
    }
    td_comm *comm;
    CHECK(td_comm_create(&comm, &cp));
    return comm;
}

/* Test accuracy and mean loss; each replica evaluates every D-th batch. */
static void evaluate(td_pipeline *pp, td_comm *comm, td_loader *test, double *accuracy,
                     double *loss) {
    td_pipeline_info info = td_pipeline_get_info(pp);
    CHECK(td_loader_set_epoch(test, 0));
    double sums[3] = {0, 0, 0}; /* correct, loss sum, samples (counted on last stages) */
    td_batch b;
    for (size_t i = 0;; i++) {
        CHECK(td_loader_next(test, &b));
        if (b.size == 0) break;
        if ((int)(i % (size_t)info.replicas) != info.replica) continue;
        double lsum;
        int64_t correct;
        CHECK(td_pipeline_evaluate(pp, b.x, b.y, (int64_t)b.size, &lsum, &correct));
        if (info.stage + 1 == info.stages) {
            sums[0] += (double)correct;
            sums[1] += lsum;
            sums[2] += (double)b.size;
        }
    }
    CHECK(td_comm_allreduce(comm, sums, sums, 3, TD_F64, TD_OP_SUM));
    *accuracy = sums[0] / sums[2];
    *loss = sums[1] / sums[2];
}

/* SHA-256 of the whole model's parameters in layer order, what td_params_sha256 gives for one
 * list of them all: replica 0's stages (ranks 0..P-1) hash theirs in turn, each handing the
 * running digest to the next; the last stage's `hex` gets it. */
static void model_digest(td_comm *comm, const td_pipeline_info *info, const td_param *params,
                         size_t n, char hex[65]) {
    hex[0] = 0;
    if (info->replica != 0) return;
    td_sha256_ctx ctx;
    int rank = info->stage, tag = 0x5a5;
    if (rank == 0)
        td_sha256_init(&ctx);
    else
        CHECK(td_comm_recv(comm, &ctx, sizeof ctx, TD_U8, rank - 1, tag));
    for (size_t i = 0; i < n; i++)
        if (params[i].data)
            td_sha256_update(&ctx, params[i].data,
                             params[i].count * td_dtype_size(params[i].dtype));
    if (rank + 1 < info->stages) {
        CHECK(td_comm_send(comm, &ctx, sizeof ctx, TD_U8, rank + 1, tag));
        return;
    }
    uint8_t d[32];
    td_sha256_final(&ctx, d);
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
}

int mnist_pipeline_main(int argc, char **argv) {
    pp_options o = parse(argc, argv);
    td_comm *comm = make_comm(&o);
    int rank = td_comm_rank(comm), world = td_comm_size(comm);
    if (world % o.stages) {
        fprintf(stderr, "mnist: %d ranks do not make replicas of %d stages\n", world, o.stages);
        return 2;
    }
    int replicas = world / o.stages, replica = rank / o.stages;
    int micro = o.schedule == TD_SCHEDULE_NAIVE ? 1 : o.micro;
    if (o.batch % replicas || (o.batch / replicas) % micro) {
        fprintf(stderr,
                "mnist: --batch %d must split into %d replica(s) of %d micro-batch(es) each\n",
                o.batch, replicas, micro);
        return 2;
    }
    td_sequential *model;
    CHECK(td_model_sequential(o.model, &model));
    /* --trace PREFIX: this rank's own file; else under tandemrun --trace DIR the job's trace,
     * which tandemrun --trace-ops (TANDEM_TRACE_OPS=1) fills with every op of the graphs too. */
    td_trace *trace = NULL;
    if (o.trace) CHECK(td_trace_create(&trace, rank));
    if (!trace) trace = td_comm_trace(comm);
    if (trace) CHECK(td_trace_name_thread(trace, "compute"));
    const char *ops = getenv("TANDEM_TRACE_OPS");
    td_pipeline_params pp = td_pipeline_default_params();
    pp.schedule = o.schedule;
    pp.stages = o.stages;
    pp.micro_batches = o.micro;
    pp.batch = o.batch / replicas;
    pp.split = o.split;
    pp.seed = o.seed;
    pp.trace = trace;
    pp.graph.seed = o.seed;
    if (ops && !strcmp(ops, "1")) pp.graph.trace = trace;
    td_pipeline *pipe;
    CHECK(td_pipeline_create(&pipe, comm, model, &pp));
    td_pipeline_info info = td_pipeline_get_info(pipe);
    int reporter = info.stage + 1 == info.stages && info.replica == 0;

    td_param *params;
    size_t n_params;
    CHECK(td_pipeline_parameters(pipe, &params, &n_params));
    td_sgd_params sp = td_sgd_default_params();
    sp.lr = o.lr;
    sp.momentum = o.momentum;
    td_optim *optim;
    CHECK(td_optim_create_sgd(&optim, params, n_params, &sp));

    td_dataset *train_set, *test_set;
    CHECK(td_dataset_load_fashion_mnist(&train_set, o.data_dir, TD_SPLIT_TRAIN));
    CHECK(td_dataset_load_fashion_mnist(&test_set, o.data_dir, TD_SPLIT_TEST));
    td_loader_params lp = td_loader_default_params();
    lp.sampler.global_batch = (size_t)o.batch;
    lp.sampler.seed = o.seed;
    lp.sampler.drop_last = 1;
    lp.sampler.rank = replica;
    lp.sampler.world_size = replicas;
    td_loader *loader = mnist_train_loader(train_set, &lp), *test_loader;
    size_t epoch_batches = td_loader_batches_per_epoch(loader);
    uint64_t run_steps = (uint64_t)o.epochs * epoch_batches, done = 0;
    if (o.max_steps > 0 && (uint64_t)o.max_steps < run_steps) run_steps = (uint64_t)o.max_steps;
    td_loader_params tp = td_loader_default_params();
    tp.batch_size = (size_t)pp.batch;
    tp.sampler.shuffle = 0;
    CHECK(td_loader_create(&test_loader, test_set, &tp));

    if (reporter) {
        printf("training %s on Fashion-MNIST: %s pipeline, %d stage(s) x %d replica(s), %d "
               "micro-batch(es), global batch %d, %d epoch(s)\n",
               td_model_name(o.model), td_pipeline_schedule_name(o.schedule), o.stages, replicas,
               info.micro_batches, o.batch, o.epochs);
        printf("stages start at layers:");
        for (int s = 0; s < info.stages; s++)
            printf(" %s", td_sequential_layer_name(model, info.stage_first[s]));
        printf("\n");
        fflush(stdout);
    }
    double accuracy = 0, test_loss = 0, rate = 0;
    for (int epoch = 0; epoch < o.epochs && done < run_steps; epoch++) {
        CHECK(td_loader_set_epoch(loader, (uint64_t)epoch));
        /* all of the epoch's batches, or up to --max-steps */
        size_t steps =
            run_steps - done < epoch_batches ? (size_t)(run_steps - done) : epoch_batches;
        uint64_t start = td_time_ns();
        for (size_t step = 0; step < steps; step++) {
            if (o.cosine)
                td_optim_set_lr(
                    optim, td_lr_cosine(o.lr, 0.0, (int64_t)run_steps, (int64_t)(done + step)));
            td_batch batch;
            CHECK(td_loader_next(loader, &batch));
            float loss;
            CHECK(td_pipeline_step(pipe, batch.x, batch.y, &loss));
            if (info.stage + 1 == info.stages) /* the loss is the last stage's */
                CHECK(td_loss_check(loss, (int64_t)(done + step) + 1));
            uint64_t t0 = td_time_ns();
            CHECK(td_optim_step(optim));
            if (trace) CHECK(td_trace_span(trace, "optimizer", "compute", t0, td_time_ns()));
            if (reporter && ((step + 1) % 100 == 0 || step + 1 == steps)) {
                double secs = (double)(td_time_ns() - start) * 1e-9;
                printf("epoch %d step %zu/%zu loss %.4f %.0f samples/s\n", epoch + 1, step + 1,
                       epoch_batches, loss, (double)(step + 1) * o.batch / secs);
                fflush(stdout);
            }
        }
        rate = (double)steps * o.batch / ((double)(td_time_ns() - start) * 1e-9);
        done += steps;
        if (o.eval) evaluate(pipe, comm, test_loader, &accuracy, &test_loss);
        if (reporter && o.eval) {
            printf("epoch %d: test accuracy %.4f, test loss %.4f, %.0f samples/s\n", epoch + 1,
                   accuracy, test_loss, rate);
            fflush(stdout);
        }
    }
    char digest[65];
    model_digest(comm, &info, params, n_params, digest);
    if (reporter)
        printf("final: model %s ranks %d pipeline %s stages %d micro_batches %d epochs %d steps "
               "%llu test_accuracy %.4f test_loss %.4f samples_per_s %.0f params_sha256 %s\n",
               td_model_name(o.model), world, td_pipeline_schedule_name(o.schedule), o.stages,
               info.micro_batches, o.epochs, (unsigned long long)done, accuracy, test_loss, rate,
               digest);
    if (o.trace) {
        char path[4096];
        snprintf(path, sizeof path, "%s.rank%d.json", o.trace, rank);
        CHECK(td_trace_write(trace, path));
    }
    td_loader_destroy(loader);
    td_loader_destroy(test_loader);
    td_dataset_destroy(train_set);
    td_dataset_destroy(test_set);
    td_optim_destroy(optim);
    td_pipeline_destroy(pipe);
    if (o.trace) td_trace_destroy(trace);
    td_sequential_destroy(model);
    td_comm_destroy(comm);
    return 0;
}
