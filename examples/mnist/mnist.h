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

/* Where both modes keep the options they share (each its own struct's fields). */
typedef struct {
    td_model_kind *model;
    int *epochs, *batch;   /* batch: global */
    double *lr, *momentum; /* < 0 until given: the model's defaults */
    uint64_t *seed;
    long *max_steps; /* 0: --epochs decides */
    const char **data_dir, **trace;
    int *no_eval, *cosine, *constant_lr; /* flags; the schedule is the model's unless given */
} mnist_shared;

/* Offers the shared options to the current argument (td_args). */
static inline void mnist_shared_options(td_args *a, const mnist_shared *o) {
    int k = -1;
    if (td_args_choice(a, "--model", "net|mlp|cnn|resnet", &k) && k >= 0)
        *o->model = (td_model_kind)k; /* the names in td_model_kind's order */
    td_args_int(a, "--epochs", 1, INT_MAX, o->epochs);
    td_args_int(a, "--batch", 1, INT_MAX, o->batch);
    td_args_real(a, "--lr", 0, INFINITY, o->lr);
    td_args_real(a, "--momentum", 0, 1, o->momentum);
    td_args_u64(a, "--seed", o->seed);
    td_args_long(a, "--max-steps", 1, LONG_MAX, o->max_steps);
    td_args_string(a, "--data", o->data_dir);
    td_args_string(a, "--trace", o->trace);
    td_args_flag(a, "--no-eval", o->no_eval);
    td_args_flag(a, "--cosine", o->cosine);
    td_args_flag(a, "--constant-lr", o->constant_lr);
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
