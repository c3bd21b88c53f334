/* What the example's two modes share: data-parallel training (main.c) and pipeline-parallel
 * training (pipeline.c, entered from main.c when the command line has --pipeline). */
#ifndef MNIST_MNIST_H
#define MNIST_MNIST_H

#include <stdio.h>
#include <stdlib.h>

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
