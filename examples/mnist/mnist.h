/* What the example's two modes share: data-parallel training (main.c) and pipeline-parallel
 * training (pipeline.c, entered from main.c when the command line has --pipeline). */
#ifndef MNIST_MNIST_H
#define MNIST_MNIST_H

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

/* --model net|mlp|cnn|resnet, for both modes' parsers: 1 when the argument was it. */
static inline int mnist_model_option(td_args *a, td_model_kind *model) {
    int k = -1;
    if (!td_args_choice(a, "--model", "net|mlp|cnn|resnet", &k)) return 0;
    if (k >= 0) *model = (td_model_kind)k; /* the names in td_model_kind's order */
    return 1;
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

/* SGD's learning rate and momentum where the command line gave none (< 0): the seeds' SGD for
 * their Net; the others train faster with more momentum (and the ResNet, with batch norm after
 * every convolution, with a larger step). */
static inline void mnist_sgd_defaults(td_model_kind model, double *lr, double *momentum) {
    if (*lr < 0) *lr = model == TD_MODEL_MLP ? 0.05 : model == TD_MODEL_RESNET ? 0.1 : 0.01;
    if (*momentum < 0) *momentum = model == TD_MODEL_NET ? 0.5 : 0.9;
}

/* 1 when argv asks for pipeline parallelism (--pipeline). */
int mnist_pipeline_requested(int argc, char **argv);

/* Parses argv on its own terms and trains; returns the process's exit status. */
int mnist_pipeline_main(int argc, char **argv);

#endif
