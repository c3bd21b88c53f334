/* The linear probe: how linearly separable the classes are in an encoder's features, the
 * standard measure of a self-supervised representation. The encoder is frozen (eval mode,
 * running statistics); its features are computed once, each rank a slice, and shared; a
 * linear classifier is then trained on them with SGD, the same on every rank. */
#include <math.h>
#include <string.h>

#include "contrastive.h"

#define PROBE_BATCH 256
#define PROBE_LR 0.1
#define CLASSES 10

/* Features (n, FEATURES) of the first n images of `set`, on every rank. */
static float *features_of(td_graph *g, const simclr_net *net, int64_t batch, td_comm *comm,
                          td_dataset *set, size_t n) {
    int world = comm ? td_comm_size(comm) : 1, rank = comm ? td_comm_rank(comm) : 0;
    size_t first, count, per = (n + (size_t)world - 1) / (size_t)world;
    td_split_even(n, world, rank, &first, &count);
    float *mine = calloc(per * FEATURES, sizeof *mine),
          *all = malloc((size_t)world * per * FEATURES * sizeof *all);
    float *x = calloc((size_t)batch * IMAGE_PIXELS, sizeof *x);
    float *h = malloc((size_t)batch * FEATURES * sizeof *h);
    if (!mine || !all || !x || !h) CHECK(TD_ENOMEM);
    const float *images = td_dataset_x(set);
    for (size_t at = 0; at < count; at += (size_t)batch) {
        size_t rows = count - at < (size_t)batch ? count - at : (size_t)batch;
        memcpy(x, images + (first + at) * IMAGE_PIXELS, rows * IMAGE_PIXELS * sizeof *x);
        CHECK(td_tensor_write(net->input, x));
        CHECK(td_graph_forward(g));
        CHECK(td_tensor_read(net->features, h));
        memcpy(mine + at * FEATURES, h, rows * FEATURES * sizeof *h);
    }
    if (comm)
        CHECK(td_comm_allgather(comm, mine, all, per * FEATURES, TD_F32));
    else
        memcpy(all, mine, per * FEATURES * sizeof *all);
    float *out = malloc(n * FEATURES * sizeof *out);
    if (!out) CHECK(TD_ENOMEM);
    for (int r = 0; r < world; r++) { /* rank r's rows, without its padding */
        td_split_even(n, world, r, &first, &count);
        memcpy(out + first * FEATURES, all + (size_t)r * per * FEATURES,
               count * FEATURES * sizeof *out);
    }
    free(mine), free(all), free(x), free(h);
    return out;
}

/* Standardises both sets with the training features' per-feature mean and deviation. */
static void standardise(float *train, size_t n_train, float *test, size_t n_test) {
    for (int f = 0; f < FEATURES; f++) {
        double sum = 0, sq = 0;
        for (size_t i = 0; i < n_train; i++) sum += train[i * FEATURES + f];
        double mean = sum / (double)n_train;
        for (size_t i = 0; i < n_train; i++) {
            double d = train[i * FEATURES + f] - mean;
            sq += d * d;
        }
        double inv = 1.0 / (sqrt(sq / (double)n_train) + 1e-6);
        for (size_t i = 0; i < n_train; i++)
            train[i * FEATURES + f] = (float)((train[i * FEATURES + f] - mean) * inv);
        for (size_t i = 0; i < n_test; i++)
            test[i * FEATURES + f] = (float)((test[i * FEATURES + f] - mean) * inv);
    }
}

double probe_accuracy(td_graph *g, const simclr_net *net, int64_t batch, td_comm *comm,
                      td_dataset *train, size_t n_train, td_dataset *test, size_t n_test,
                      int epochs, uint64_t seed) {
    float *ftrain = features_of(g, net, batch, comm, train, n_train);
    float *ftest = features_of(g, net, batch, comm, test, n_test);
    standardise(ftrain, n_train, ftest, n_test);

    td_graph *pg;
    td_tensor *x, *y, *logits, *loss;
    td_rng rng;
    td_rng_init(&rng, seed);
    CHECK(td_graph_create(&pg, NULL));
    CHECK(td_graph_input(pg, "features", td_shape_2d(PROBE_BATCH, FEATURES), TD_F32, 0, &x));
    CHECK(td_graph_input(pg, "labels", td_shape_1d(PROBE_BATCH), TD_I64, 0, &y));
    CHECK(td_nn_linear(pg, "probe", x, CLASSES, 1, &rng, &logits));
    CHECK(td_graph_cross_entropy(pg, logits, y, TD_REDUCTION_MEAN, &loss, NULL));
    CHECK(td_graph_compile(pg));
    td_param *params;
    size_t n_params;
    CHECK(td_graph_parameters(pg, &params, &n_params));
    td_sgd_params sp = td_sgd_default_params();
    sp.momentum = 0.9;
    td_optim *opt;
    CHECK(td_optim_create_sgd(&opt, params, n_params, &sp));

    float *xb = td_tensor_data(x), *lb = malloc(PROBE_BATCH * CLASSES * sizeof *lb);
    int64_t *yb = td_tensor_data(y);
    size_t *order = malloc(n_train * sizeof *order), steps = n_train / PROBE_BATCH;
    if (!lb || !order) CHECK(TD_ENOMEM);
    if (steps == 0) {
        fprintf(stderr, "contrastive: the probe needs at least %d training images\n", PROBE_BATCH);
        exit(2);
    }
    const int64_t *train_labels = td_dataset_y(train), *test_labels = td_dataset_y(test);
    for (size_t i = 0; i < n_train; i++) order[i] = i;
    for (int e = 0; e < epochs; e++) {
        for (size_t i = n_train - 1; i > 0; i--) { /* Fisher-Yates */
            size_t j = td_rng_below(&rng, (uint32_t)(i + 1)), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        for (size_t s = 0; s < steps; s++) {
            td_optim_set_lr(opt, td_lr_cosine(PROBE_LR, 0, (int64_t)(steps * (size_t)epochs),
                                              (int64_t)((size_t)e * steps + s)));
            for (size_t r = 0; r < PROBE_BATCH; r++) {
                size_t k = order[s * PROBE_BATCH + r];
                memcpy(xb + r * FEATURES, ftrain + k * FEATURES, FEATURES * sizeof *xb);
                yb[r] = train_labels[k];
            }
            CHECK(td_graph_forward(pg));
            CHECK(td_graph_backward(pg, loss));
            CHECK(td_optim_step(opt));
            CHECK(td_graph_zero_grad(pg));
        }
    }
    size_t correct = 0;
    for (size_t at = 0; at < n_test; at += PROBE_BATCH) {
        size_t rows = n_test - at < PROBE_BATCH ? n_test - at : PROBE_BATCH;
        memcpy(xb, ftest + at * FEATURES, rows * FEATURES * sizeof *xb);
        for (size_t r = 0; r < PROBE_BATCH; r++) yb[r] = 0;
        CHECK(td_graph_forward(pg));
        CHECK(td_tensor_read(logits, lb));
        for (size_t r = 0; r < rows; r++) {
            int best = 0;
            for (int c = 1; c < CLASSES; c++)
                if (lb[r * CLASSES + c] > lb[r * CLASSES + best]) best = c;
            correct += best == test_labels[at + r];
        }
    }
    td_optim_destroy(opt);
    td_graph_destroy(pg);
    free(ftrain), free(ftest), free(lb), free(order);
    return (double)correct / (double)n_test;
}
