/* What the example's two modes share: data-parallel training (main.c) and pipeline-parallel
 * training (pipeline.c, entered from main.c when the command line has --pipeline). */
#ifndef MNIST_MNIST_H
#define MNIST_MNIST_H

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "tandem/tandem.h"

/* A library call that must succeed: print its status and message and exit 1. */
#define CHECK(call)                                                                    \
    do {                                                                               \
        td_status s_ = (call);                                                         \
        if (s_ != TD_OK) {                                                             \
            fprintf(stderr, "mnist: %s: %s\n", td_status_string(s_), td_last_error()); \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

/* A bad value of a command-line option: names the option, the value and what it takes, and
 * exits 2 (a usage dump would leave the user to find which option was wrong). */
static inline void mnist_bad_value(const char *option, const char *value, const char *takes) {
    fprintf(stderr, "mnist: %s %s: expected %s\n", option, value, takes);
    exit(2);
}

/* The value of an integer option, which must lie in [min, max]. */
static inline long mnist_int(const char *option, const char *value, long min, long max) {
    char *end, takes[96];
    errno = 0;
    long v = strtol(value, &end, 10);
    if (errno || end == value || *end || v < min || v > max) {
        if (max == LONG_MAX || max == INT_MAX)
            snprintf(takes, sizeof takes, "an integer >= %ld", min);
        else
            snprintf(takes, sizeof takes, "an integer from %ld to %ld", min, max);
        mnist_bad_value(option, value, takes);
    }
    return v;
}

/* The value of a real-valued option, which must lie in [min, max). */
static inline double mnist_real(const char *option, const char *value, double min, double max) {
    char *end, takes[96];
    errno = 0;
    double v = strtod(value, &end);
    if (errno || end == value || *end || !(v >= min && v < max)) {
        if (isinf(max))
            snprintf(takes, sizeof takes, "a number >= %g", min);
        else
            snprintf(takes, sizeof takes, "a number in [%g, %g)", min, max);
        mnist_bad_value(option, value, takes);
    }
    return v;
}

/* The value of --seed: any 64-bit unsigned integer. */
static inline uint64_t mnist_seed(const char *value) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(value, &end, 10);
    if (errno || end == value || *end || value[0] == '-')
        mnist_bad_value("--seed", value, "an unsigned 64-bit integer");
    return (uint64_t)v;
}

/* The training set's loader. A set smaller than one global batch (each step trains on a whole
 * one, so the loader drops a short last batch) would train nothing: refused, saying so. */
static inline td_loader *mnist_train_loader(const td_dataset *train, const td_loader_params *lp) {
    td_loader *loader;
    if (td_loader_create(&loader, train, lp) == TD_OK) return loader;
    fprintf(stderr, "mnist: the training set (%zu samples) cannot train with --batch %zu: %s\n",
            td_dataset_size(train), lp->sampler.global_batch, td_last_error());
    exit(1);
}

/* Whether progress may redraw one line with \r: only on a terminal. Open MPI's mpirun hands its
 * ranks a pseudo-terminal for stdout even when its own output goes to a file, so under it the
 * answer is always no. */
static inline int mnist_progress_redraws(void) {
    return isatty(STDOUT_FILENO) && !getenv("OMPI_COMM_WORLD_SIZE");
}

/* SGD's learning rate and momentum where the command line gave none (< 0): the SGD of PyTorch's
 * MNIST example for its Net; the others train faster with more momentum (and the ResNet, with batch
 * norm after every convolution, with a larger step). */
static inline void mnist_sgd_defaults(td_model_kind model, double *lr, double *momentum) {
    if (*lr < 0) *lr = model == TD_MODEL_MLP ? 0.05 : model == TD_MODEL_RESNET ? 0.1 : 0.01;
    if (*momentum < 0) *momentum = model == TD_MODEL_NET ? 0.5 : 0.9;
}

/* 1 when argv asks for pipeline parallelism (--pipeline). */
int mnist_pipeline_requested(int argc, char **argv);

/* Parses argv on its own terms and trains; returns the process's exit status. */
int mnist_pipeline_main(int argc, char **argv);

#endif
