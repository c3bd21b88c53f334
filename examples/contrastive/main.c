/* SimCLR on Fashion-MNIST: contrastive learning of an image encoder without labels, alone or
 * data-parallel, with negatives from this rank's batch or from every rank's.
 *
 *   build/examples/contrastive --epochs 5
 *   build/bin/tandemrun --nproc-per-node 2 build/examples/contrastive --negatives global
 *
 * Each image of a global batch gets two augmented views (augment.c); the encoder and
 * projection head (network.c) map both to unit vectors z, and the NT-Xent loss pulls each
 * view towards its partner and away from every other view it is compared with: with
 * --negatives local those of this rank's batch, with --negatives global those of the whole
 * global batch, gathered from every rank by td_graph_all_gather, whose backward sends each
 * rank the gradient the others' losses put on its features. Batch norm is SyncBatchNorm
 * (statistics of the global batch, as SimCLR's global BN; --no-sync-bn for per-rank ones), so
 * with global negatives N ranks train the same weights as one process on the global batch.
 * DDP averages the gradients. After training a linear probe (probe.c) measures the frozen
 * encoder's features, beside the same probe on the encoder as it was initialised. Only rank 0
 * prints and writes the checkpoint. --device cuda trains (and probes) on this rank's GPU
 * (cuda:LOCAL_RANK; cuda:N names one), the views augmented on the host and copied in. */
#include <limits.h>
#include <math.h>
#include <string.h>

#include "contrastive.h"

typedef struct {
    int global_negatives; /* 1: keys are the all-gathered global batch */
    int sync_bn;
    int epochs, batch;       /* batch: images per global batch (two views each) */
    int adamw;               /* 0: SGD with momentum 0.9 */
    double lr, weight_decay; /* the peak learning rate, annealed to 0 by a cosine */
    float temperature;
    uint64_t seed;
    long max_steps; /* optimizer steps of the whole run, across epochs; 0 = --epochs decides */
    const char *data_dir, *checkpoint;
    long probe_train, probe_test; /* images the probe trains and tests on; 0 train: no probe */
    int probe_epochs;
    const char *device; /* "cpu", "cuda" (this rank's GPU) or "cuda:N" */
} options;

static const char usage[] =
    "usage: contrastive [--negatives local|global] [--epochs N] [--batch GLOBAL]\n"
    "                   [--optimizer sgd|adamw] [--lr X] [--weight-decay X]\n"
    "                   [--temperature T] [--seed N]\n"
    "                   [--max-steps N] [--no-sync-bn] [--data DIR] [--checkpoint PATH]\n"
    "                   [--probe-train N] [--probe-test N] [--probe-epochs N]\n"
    "                   [--device cpu|cuda|cuda:N]\n"
    "  --max-steps N  stop after N optimizer steps in all, counted across epochs, or at\n"
    "                 the end of --epochs if that comes first\n";

static options parse(int argc, char **argv) {
    options o = {.global_negatives = 1,
                 .sync_bn = 1,
                 .epochs = 5,
                 .batch = 64,
                 .lr = -1,
                 .weight_decay = -1,
                 .temperature = 0.2f,
                 .seed = 1,
                 .probe_train = 60000,
                 .probe_test = 10000,
                 .probe_epochs = 10,
                 .device = "cpu"};
    int no_sync_bn = 0;
    double temperature = o.temperature;
    td_args a;
    td_args_init(&a, "contrastive", argc, argv);
    while (td_args_next(&a)) {
        td_args_flag(&a, "--no-sync-bn", &no_sync_bn);
        td_args_choice(&a, "--negatives", "local|global", &o.global_negatives);
        td_args_choice(&a, "--optimizer", "sgd|adamw", &o.adamw);
        td_args_int(&a, "--epochs", 1, INT_MAX, &o.epochs);
        td_args_int(&a, "--batch", 1, INT_MAX, &o.batch);
        td_args_real(&a, "--lr", 0, INFINITY, &o.lr);
        td_args_real(&a, "--weight-decay", 0, INFINITY, &o.weight_decay);
        td_args_positive(&a, "--temperature", INFINITY, &temperature);
        td_args_u64(&a, "--seed", &o.seed);
        td_args_long(&a, "--max-steps", 1, LONG_MAX, &o.max_steps);
        td_args_string(&a, "--data", &o.data_dir);
        td_args_string(&a, "--checkpoint", &o.checkpoint);
        td_args_long(&a, "--probe-train", 0, LONG_MAX, &o.probe_train);
        td_args_long(&a, "--probe-test", 1, LONG_MAX, &o.probe_test);
        td_args_int(&a, "--probe-epochs", 1, INT_MAX, &o.probe_epochs);
        if (td_args_string(&a, "--device", &o.device)) {
            td_device d;
            if (td_device_parse(o.device, &d) != TD_OK)
                td_args_bad_value(&a, o.device, "cpu, cuda or cuda:N");
        }
    }
    int rc = td_args_finish(&a, usage);
    if (rc >= 0) exit(rc);
    o.sync_bn = !no_sync_bn;
    o.temperature = (float)temperature;
    if (o.lr < 0) o.lr = o.adamw ? 1e-3 : 0.1;
    if (o.weight_decay < 0) o.weight_decay = o.adamw ? 1e-4 : 5e-4;
    return o;
}

/* Everything one rank trains with. */
typedef struct {
    options opt;
    td_comm *comm; /* NULL in a single process */
    int rank, world;
    int64_t images; /* this rank's images per step */
    td_device device;
    float *views; /* (2 images, 1, 28, 28) a step's augmented views, on the host */
    td_graph *train;
    simclr_net net;
    td_tensor *loss;
    td_param *params, *buffers;
    size_t n_params, n_buffers;
    td_optim *optim;
    td_ddp *ddp;
    uint64_t run_steps; /* steps of the whole run: --epochs of the sampler's batches, or fewer */
    uint64_t done;      /* steps trained so far */
} trainer;

static void setup(trainer *t) {
    t->rank = 0;
    t->world = 1;
    if (getenv("WORLD_SIZE")) {
        td_comm_params cp = td_comm_default_params();
        CHECK(td_comm_create(&t->comm, &cp));
        t->rank = td_comm_rank(t->comm);
        t->world = td_comm_size(t->comm);
    }
    if (t->opt.batch % t->world) {
        fprintf(stderr, "contrastive: --batch %d does not split evenly over %d ranks\n",
                t->opt.batch, t->world);
        exit(2);
    }
    t->images = t->opt.batch / t->world;
    CHECK(td_device_choose(t->opt.device, &t->device));
    t->views = malloc((size_t)(2 * t->images) * IMAGE_PIXELS * sizeof *t->views);
    if (!t->views) CHECK(TD_ENOMEM);
    td_graph_params gp = td_graph_default_params();
    gp.device = t->device;
    gp.comm = t->comm;
    gp.sync_batch_norm = t->opt.sync_bn;
    CHECK(td_graph_create(&t->train, &gp));
    /* Rows [0, n) hold the images' first views, [n, 2n) their second views. */
    simclr_build(t->train, 2 * t->images, t->opt.seed, 1, &t->net);
    td_tensor *keys = t->net.z;
    int64_t first = 0;
    if (t->opt.global_negatives) {
        CHECK(td_graph_all_gather(t->train, t->net.z, &keys));
        first = 2 * t->images * t->rank;
    }
    CHECK(td_nn_nt_xent(t->train, "ntxent", t->net.z, keys, first, t->opt.temperature, &t->loss));
    CHECK(td_graph_compile(t->train));
    CHECK(td_graph_parameters(t->train, &t->params, &t->n_params));
    CHECK(td_graph_buffers(t->train, &t->buffers, &t->n_buffers));
    if (t->opt.adamw) {
        td_adamw_params ap = td_adamw_default_params();
        ap.lr = t->opt.lr;
        ap.weight_decay = t->opt.weight_decay;
        CHECK(td_optim_create_adamw(&t->optim, t->params, t->n_params, &ap));
    } else {
        td_sgd_params sp = td_sgd_default_params();
        sp.lr = t->opt.lr;
        sp.momentum = 0.9;
        sp.weight_decay = t->opt.weight_decay;
        CHECK(td_optim_create_sgd(&t->optim, t->params, t->n_params, &sp));
    }
    if (t->comm) {
        CHECK(td_ddp_create(&t->ddp, t->comm, t->params, t->n_params, t->buffers, t->n_buffers,
                            NULL));
        td_graph_set_grad_ready_hook(t->train, td_ddp_grad_ready_hook, t->ddp);
    }
}

/* One epoch, or what --max-steps leaves of it; returns the mean loss over its steps and ranks,
 * and the images per second. */
static double train_epoch(trainer *t, td_sampler *sampler, td_dataset *data, int epoch,
                          double *images_per_s) {
    td_sampler_set_epoch(sampler, (uint64_t)epoch);
    size_t steps = td_sampler_batches(sampler);
    if (t->run_steps - t->done < steps) steps = (size_t)(t->run_steps - t->done);
    const size_t *indices = td_sampler_indices(sampler);
    const float *images = td_dataset_x(data);
    float *x = t->views;
    double loss_sum = 0;
    uint64_t start = td_time_ns();
    for (size_t step = 0; step < steps; step++) {
        td_optim_set_lr(t->optim, td_lr_cosine(t->opt.lr, 0.0, (int64_t)t->run_steps,
                                               (int64_t)(t->done + step)));
        size_t first, count;
        td_sampler_batch(sampler, step, &first, &count);
        for (size_t i = 0; i < count; i++) {
            size_t index = indices[first + i];
            for (int view = 0; view < 2; view++)
                augment_view(x + ((size_t)view * count + i) * IMAGE_PIXELS,
                             images + index * IMAGE_PIXELS, t->opt.seed, (uint64_t)epoch, index,
                             view);
        }
        CHECK(td_tensor_write(t->net.input, x));
        if (t->ddp) CHECK(td_ddp_prepare_forward(t->ddp));
        CHECK(td_graph_forward(t->train));
        CHECK(td_graph_backward(t->train, t->loss));
        if (t->ddp) CHECK(td_ddp_finish_backward(t->ddp));
        CHECK(td_optim_step(t->optim));
        CHECK(td_graph_zero_grad(t->train));
        float loss;
        CHECK(td_tensor_read(t->loss, &loss));
        CHECK(td_loss_check(loss, (int64_t)(t->done + step) + 1));
        loss_sum += loss;
    }
    t->done += steps;
    *images_per_s =
        (double)(steps * (size_t)t->opt.batch) / ((double)(td_time_ns() - start) * 1e-9);
    if (t->comm) CHECK(td_comm_allreduce(t->comm, &loss_sum, &loss_sum, 1, TD_F64, TD_OP_AVG));
    return steps ? loss_sum / (double)steps : 0;
}

static void save(trainer *t) {
    size_t n = t->n_params + t->n_buffers;
    td_param *all = malloc(n * sizeof *all);
    if (!all) CHECK(TD_ENOMEM);
    memcpy(all, t->params, t->n_params * sizeof *all);
    memcpy(all + t->n_params, t->buffers, t->n_buffers * sizeof *all);
    td_checkpoint_meta meta[] = {{"negatives", t->opt.global_negatives ? "global" : "local"}};
    CHECK(td_checkpoint_save(t->opt.checkpoint, all, n, meta, 1));
    free(all);
}

/* An encoder-only graph in eval mode for the probe; with `from` it reads from's weights (the
 * encoder's parameters and buffers come first there, in the same order), else it keeps the
 * ones it was initialised with. */
static td_graph *probe_encoder(trainer *t, int64_t batch, td_graph *from, simclr_net *net) {
    td_graph_params gp = td_graph_default_params();
    gp.grad_enabled = 0;
    gp.device = t->device; /* where `from`'s weights are */
    td_graph *g;
    CHECK(td_graph_create(&g, &gp));
    simclr_build(g, batch, t->opt.seed, 0, net);
    CHECK(td_graph_compile(g));
    td_graph_set_training(g, 0);
    if (!from) return g;
    td_param *p, *b;
    size_t np, nb;
    CHECK(td_graph_parameters(g, &p, &np));
    CHECK(td_graph_buffers(g, &b, &nb));
    for (size_t i = 0; i < np; i++) {
        if (strcmp(p[i].name, t->params[i].name)) CHECK(TD_EMISMATCH);
        p[i].data = t->params[i].data; /* the graph follows params[i].data (graph.h) */
    }
    for (size_t i = 0; i < nb; i++) b[i].data = t->buffers[i].data;
    return g;
}

int main(int argc, char **argv) {
    trainer t = {.opt = parse(argc, argv)};
    setup(&t);
    td_dataset *train_set, *test_set;
    CHECK(td_dataset_load_fashion_mnist(&train_set, t.opt.data_dir, TD_SPLIT_TRAIN));
    CHECK(td_dataset_load_fashion_mnist(&test_set, t.opt.data_dir, TD_SPLIT_TEST));
    td_sampler_params sp = td_sampler_default_params();
    sp.rank = t.rank;
    sp.world_size = t.world;
    sp.seed = t.opt.seed;
    sp.drop_last = 1;
    sp.global_batch = (size_t)t.opt.batch; /* each rank its slice of every global batch */
    td_sampler *sampler;
    CHECK(td_sampler_create(&sampler, td_dataset_size(train_set), &sp));
    t.run_steps = (uint64_t)t.opt.epochs * td_sampler_batches(sampler);
    if (t.opt.max_steps > 0 && (uint64_t)t.opt.max_steps < t.run_steps)
        t.run_steps = (uint64_t)t.opt.max_steps;
    char on[32];
    td_device_format(t.device, on, sizeof on);
    if (t.rank == 0)
        printf("SimCLR on Fashion-MNIST: %d rank(s) on %s, global batch %d (%lld per rank), %s "
               "negatives (%lld per anchor), %s, temperature %g, %d epoch(s)\n",
               t.world, on, t.opt.batch, (long long)t.images,
               t.opt.global_negatives ? "global" : "local",
               (long long)(2 * (t.opt.global_negatives ? t.opt.batch : t.images) - 2),
               t.opt.sync_bn ? "SyncBatchNorm" : "per-rank batch norm", (double)t.opt.temperature,
               t.opt.epochs);
    double loss = 0, rate = 0;
    for (int epoch = 0; epoch < t.opt.epochs && t.done < t.run_steps; epoch++) {
        loss = train_epoch(&t, sampler, train_set, epoch, &rate);
        if (t.rank == 0) {
            printf("epoch %d: loss %.4f, %.0f images/s\n", epoch + 1, loss, rate);
            fflush(stdout);
        }
    }
    if (t.opt.checkpoint && t.rank == 0) save(&t);
    double trained = -1, random = -1;
    if (t.opt.probe_train > 0) {
        size_t n_train = (size_t)t.opt.probe_train, n_test = (size_t)t.opt.probe_test;
        if (n_train > td_dataset_size(train_set)) n_train = td_dataset_size(train_set);
        if (n_test > td_dataset_size(test_set)) n_test = td_dataset_size(test_set);
        simclr_net net;
        td_graph *g = probe_encoder(&t, 500, t.train, &net);
        trained = probe_accuracy(g, &net, 500, t.comm, train_set, n_train, test_set, n_test,
                                 t.opt.probe_epochs, t.opt.seed);
        td_graph_destroy(g);
        g = probe_encoder(&t, 500, NULL, &net);
        random = probe_accuracy(g, &net, 500, t.comm, train_set, n_train, test_set, n_test,
                                t.opt.probe_epochs, t.opt.seed);
        td_graph_destroy(g);
        if (t.rank == 0)
            printf("linear probe (%zu training, %zu test images): trained encoder %.4f, random "
                   "encoder %.4f\n",
                   n_train, n_test, trained, random);
    }
    if (t.rank == 0)
        printf("final: negatives %s ranks %d epochs %d steps %llu batch %d loss %.4f "
               "images_per_s %.0f probe_trained %.4f probe_random %.4f\n",
               t.opt.global_negatives ? "global" : "local", t.world, t.opt.epochs,
               (unsigned long long)t.done, t.opt.batch, loss, rate, trained, random);
    td_sampler_destroy(sampler);
    td_dataset_destroy(train_set);
    td_dataset_destroy(test_set);
    if (t.ddp) {
        td_graph_set_grad_ready_hook(t.train, NULL, NULL);
        td_ddp_destroy(t.ddp);
    }
    td_optim_destroy(t.optim);
    td_graph_destroy(t.train);
    td_comm_destroy(t.comm);
    free(t.views);
    return 0;
}
