/* What SyncBatchNorm buys, measured: the CNN (four conv + batch norm + ReLU layers) trained on
 * Fashion-MNIST at one global batch three ways,
 *   one process, batch norm over the global batch (32);
 *   W ranks of 32 / W with SyncBatchNorm: statistics over the global 32 again;
 *   W ranks of 32 / W with plain batch norm: statistics over each rank's 32 / W;
 * with the same seed, data order, learning-rate schedule and number of steps, and DDP
 * averaging the ranks' gradients. Prints the test accuracy (eval mode: running statistics,
 * rank 0's under DDP as its broadcast_buffers does) after E epochs for several seeds, run in
 * interleaved order, with the median per configuration, and training samples/s. Ranks are
 * forked by td_spawn with one oneDNN thread each, pinned to a core each only when there are
 * enough cores.
 *
 *   build/bench/syncbn [--epochs 1] [--seeds 3] [--world 4] [--batch 32] [--max-steps N]
 *                      [--json] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/tandem.h"

#include "bench.h"

#define EVAL_BATCH 500
#define MAX_SEEDS 16

typedef struct {
    int epochs, seeds, world, batch, json;
    long max_steps; /* per epoch, 0: all */
} options;

/* One configuration of one run. */
typedef struct {
    const options *o;
    int world;
    int sync;
    uint64_t seed;
} config;

typedef struct {
    double accuracy, samples_per_s, loss;
} result;

/* Test accuracy, the test set split across ranks batch by batch. */
static double evaluate(td_graph *eval, const td_model *m, td_comm *comm, td_loader *test) {
    int world = comm ? td_comm_size(comm) : 1, rank = comm ? td_comm_rank(comm) : 0;
    CHECK(td_loader_set_epoch(test, 0));
    static float x[EVAL_BATCH * 784];
    static int64_t y[EVAL_BATCH], pred[EVAL_BATCH];
    double counts[2] = {0, 0}; /* correct, samples */
    td_batch b;
    for (size_t i = 0;; i++) {
        CHECK(td_loader_next(test, &b));
        if (b.size == 0) break;
        if ((int)(i % (size_t)world) != rank) continue;
        memcpy(x, b.x, b.size * 784 * sizeof *x);
        memcpy(y, b.y, b.size * sizeof *y);
        CHECK(td_tensor_write(m->input, x));
        CHECK(td_tensor_write(m->labels, y));
        CHECK(td_graph_forward(eval));
        CHECK(td_model_predict(m, pred, NULL));
        for (size_t r = 0; r < b.size; r++) counts[0] += pred[r] == y[r];
        counts[1] += (double)b.size;
    }
    if (comm) CHECK(td_comm_allreduce(comm, counts, counts, 2, TD_F64, TD_OP_SUM));
    return counts[0] / counts[1];
}

static int rank_main(int rank, int world, void *out, void *arg) {
    const config *c = arg;
    const options *o = c->o;
    td_comm *comm = world > 1 ? bench_comm() : NULL;
    td_graph_params gp = td_graph_default_params();
    gp.seed = c->seed;
    gp.comm = comm;
    gp.sync_batch_norm = c->sync;
    td_graph *train, *eval;
    td_model m, em;
    CHECK(td_graph_create(&train, &gp));
    CHECK(td_model_build(train, TD_MODEL_CNN, o->batch / world, c->seed, &m));
    gp.grad_enabled = 0;
    gp.comm = NULL; /* eval mode normalises with running statistics: no group needed */
    CHECK(td_graph_create(&eval, &gp));
    CHECK(td_model_build(eval, TD_MODEL_CNN, EVAL_BATCH, c->seed, &em));
    CHECK(td_graph_share_params(eval, train));
    td_graph_set_training(eval, 0);
    td_param *params, *buffers;
    size_t np, nb;
    CHECK(td_graph_parameters(train, &params, &np));
    CHECK(td_graph_buffers(train, &buffers, &nb));
    td_sgd_params sp = td_sgd_default_params(); /* the mnist example's CNN settings */
    sp.lr = 0.01;
    sp.momentum = 0.9;
    td_optim *opt;
    CHECK(td_optim_create_sgd(&opt, params, np, &sp));
    td_ddp *ddp = NULL;
    if (comm) {
        CHECK(td_ddp_create(&ddp, comm, params, np, buffers, nb, NULL));
        td_graph_set_grad_ready_hook(train, td_ddp_grad_ready_hook, ddp);
    }
    td_dataset *train_set, *test_set;
    CHECK(td_dataset_load_fashion_mnist(&train_set, NULL, TD_SPLIT_TRAIN));
    CHECK(td_dataset_load_fashion_mnist(&test_set, NULL, TD_SPLIT_TEST));
    td_loader_params lp = td_loader_default_params();
    lp.sampler.global_batch = (size_t)o->batch;
    lp.sampler.seed = c->seed;
    lp.sampler.drop_last = 1;
    lp.sampler.rank = rank;
    lp.sampler.world_size = world;
    td_loader *loader, *test;
    CHECK(td_loader_create(&loader, train_set, &lp));
    td_loader_params tp = td_loader_default_params();
    tp.batch_size = EVAL_BATCH;
    tp.sampler.shuffle = 0;
    CHECK(td_loader_create(&test, test_set, &tp));

    size_t steps = td_loader_batches_per_epoch(loader);
    if (o->max_steps > 0 && (size_t)o->max_steps < steps) steps = (size_t)o->max_steps;
    int64_t total = (int64_t)(steps * (size_t)o->epochs);
    double loss = 0, seconds = 0;
    for (int e = 0; e < o->epochs; e++) {
        CHECK(td_loader_set_epoch(loader, (uint64_t)e));
        uint64_t start = td_time_ns();
        for (size_t s = 0; s < steps; s++) {
            td_optim_set_lr(opt, td_lr_cosine(sp.lr, 0, total, (int64_t)((size_t)e * steps + s)));
            td_batch b;
            CHECK(td_loader_next(loader, &b));
            if (ddp) CHECK(td_ddp_prepare_forward(ddp));
            CHECK(td_tensor_set_data(m.input, b.x));
            CHECK(td_tensor_set_data(m.labels, b.y));
            CHECK(td_graph_forward(train));
            CHECK(td_graph_backward(train, m.loss));
            if (ddp) CHECK(td_ddp_finish_backward(ddp));
            CHECK(td_optim_step(opt));
            CHECK(td_graph_zero_grad(train));
            loss = *(const float *)td_tensor_data(m.loss);
            CHECK(td_loss_check(loss, (int64_t)((size_t)e * steps + s) + 1));
        }
        seconds += (double)(td_time_ns() - start) * 1e-9;
    }
    /* Rank 0's running statistics, as DDP's next forward would broadcast them. */
    for (size_t i = 0; comm && i < nb; i++)
        CHECK(td_comm_broadcast(comm, buffers[i].data, buffers[i].count, buffers[i].dtype, 0));
    result *r = out;
    r->accuracy = evaluate(eval, &em, comm, test);
    r->samples_per_s = (double)(steps * (size_t)o->epochs * (size_t)o->batch) / seconds;
    r->loss = loss;
    td_loader_destroy(loader);
    td_loader_destroy(test);
    td_dataset_destroy(train_set);
    td_dataset_destroy(test_set);
    if (ddp) {
        td_graph_set_grad_ready_hook(train, NULL, NULL);
        td_ddp_destroy(ddp);
    }
    td_optim_destroy(opt);
    td_graph_destroy(eval);
    td_graph_destroy(train);
    td_comm_destroy(comm);
    return 0;
}

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, int n) {
    double s[MAX_SEEDS];
    memcpy(s, v, (size_t)n * sizeof *s);
    qsort(s, (size_t)n, sizeof *s, compare);
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

int main(int argc, char **argv) {
    bench_one_thread(argv);
    options o = {.epochs = 1, .seeds = 3, .world = 4, .batch = 32};
    td_args a;
    td_args_init(&a, "syncbn", argc, argv);
    while (td_args_next(&a)) {
        td_args_int(&a, "--epochs", 1, INT_MAX, &o.epochs);
        td_args_int(&a, "--seeds", 1, MAX_SEEDS, &o.seeds);
        td_args_int(&a, "--world", 2, 64, &o.world);
        td_args_int(&a, "--batch", 1, INT_MAX, &o.batch);
        td_args_long(&a, "--max-steps", 1, LONG_MAX, &o.max_steps);
        td_args_flag(&a, "--json", &o.json);
    }
    if (o.batch % o.world)
        td_args_error(&a, "--batch %d does not split over --world %d", o.batch, o.world);
    bench_args_finish(&a, "usage: syncbn [--epochs E (1)] [--seeds S (3)] [--world W (4)] "
                          "[--batch B (32)] [--max-steps N] [--json]\n");
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    /* The three configurations: (world, SyncBatchNorm). */
    const int worlds[3] = {1, o.world, o.world}, syncs[3] = {0, 1, 0};
    double acc[3][MAX_SEEDS], rate[3][MAX_SEEDS];
    result *res = malloc((size_t)o.world * sizeof *res);
    for (int s = 0; s < o.seeds; s++)
        for (int k = 0; k < 3; k++) { /* interleaved: noise falls on every configuration */
            config cfg = {&o, worlds[k], syncs[k], (uint64_t)(s + 1)};
            if (bench_ranks(worlds[k], worlds[k] <= cores, rank_main, &cfg, res, sizeof *res)) {
                fprintf(stderr, "syncbn: a run failed\n");
                return 1;
            }
            acc[k][s] = res[0].accuracy;
            rate[k][s] = res[0].samples_per_s;
            if (o.json)
                printf("{\"bench\":\"syncbn\",\"world\":%d,\"sync_batch_norm\":%d,\"seed\":%d,"
                       "\"epochs\":%d,\"batch\":%d,\"test_accuracy\":%.4f,\"samples_per_s\":%.0f,"
                       "\"loss\":%.4f}\n",
                       worlds[k], syncs[k], s + 1, o.epochs, o.batch, res[0].accuracy,
                       res[0].samples_per_s, res[0].loss);
            fflush(stdout);
        }
    free(res);
    if (o.json) return 0;
    char cpu[256];
    char steps[64] = "";
    if (o.max_steps > 0) snprintf(steps, sizeof steps, " of %ld steps", o.max_steps);
    printf("\n%s, %ld cores\nthe CNN on Fashion-MNIST, global batch %d, %d epoch(s)%s, SGD lr "
           "0.01 momentum 0.9 cosine, seeds 1..%d (medians)\n\n",
           bench_cpu_name(cpu, sizeof cpu), cores, o.batch, o.epochs, steps, o.seeds);
    printf("| configuration | batch norm statistics over | test accuracy | per seed | samples/s |\n"
           "|---|---|---|---|---|\n");
    for (int k = 0; k < 3; k++) {
        char name[64], over[32], seeds[256] = "";
        if (worlds[k] == 1)
            snprintf(name, sizeof name, "1 process x %d", o.batch);
        else
            snprintf(name, sizeof name, "%d ranks x %d, %s", o.world, o.batch / o.world,
                     syncs[k] ? "SyncBatchNorm" : "batch norm");
        snprintf(over, sizeof over, "%d samples",
                 worlds[k] == 1 || syncs[k] ? o.batch : o.batch / o.world);
        for (int s = 0; s < o.seeds; s++)
            snprintf(seeds + strlen(seeds), sizeof seeds - strlen(seeds), "%s%.4f", s ? " " : "",
                     acc[k][s]);
        printf("| %s | %s | %.4f | %s | %.0f |\n", name, over, median(acc[k], o.seeds), seeds,
               median(rate[k], o.seeds));
    }
    return 0;
}
