/* What the files of the contrastive example share: the two augmented views of an image
 * (augment.c), the SimCLR network (network.c) and the linear probe (probe.c). main.c trains. */
#ifndef CONTRASTIVE_H
#define CONTRASTIVE_H

#include <stdio.h>
#include <stdlib.h>

#include "tandem/tandem.h"

#define CHECK(call)                                                                          \
    do {                                                                                     \
        td_status s_ = (call);                                                               \
        if (s_ != TD_OK) {                                                                   \
            fprintf(stderr, "contrastive: %s: %s\n", td_status_string(s_), td_last_error()); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

/* Fashion-MNIST's images: one channel of 28 x 28. */
#define IMAGE_SIDE 28
#define IMAGE_PIXELS (IMAGE_SIDE * IMAGE_SIDE)

/* View `view` (0 or 1) of dataset image `index` in `epoch`: a random crop of the image padded
 * by 4 pixels, a horizontal flip half of the time, and Gaussian noise. The random numbers are
 * a function of (seed, epoch, index, view) only, so a sample gets the same views on whichever
 * rank, at whatever world size, it lands. */
void augment_view(float *out, const float *image, uint64_t seed, uint64_t epoch, uint64_t index,
                  int view);

/* The SimCLR network for a batch of `images` inputs: encoder (three conv 3x3 + batch norm +
 * ReLU, max pools, global average pooling: 128 features) and projection head (linear 128 ->
 * 128, ReLU, linear -> 64), its output L2-normalised. */
typedef struct {
    td_tensor *input;    /* (images, 1, 28, 28) */
    td_tensor *features; /* (images, 128): the encoder's output, what the probe sees */
    td_tensor *z;        /* (images, 64): normalised projections */
} simclr_net;

/* Feature width of the encoder. */
#define FEATURES 128

/* Builds the network into g with parameters initialised from `seed` (the same everywhere);
 * with head 0 the encoder alone (z is NULL and features an output the probe can read). */
void simclr_build(td_graph *g, int64_t images, uint64_t seed, int head, simclr_net *net);

/* Linear-probe test accuracy of an encoder: features of the first n_train training images and
 * n_test test images (unaugmented, eval mode) from `net` (built in `g` for `batch` images),
 * computed in slices over the ranks of `comm` (may be NULL) and shared; then a linear
 * classifier trained on the standardised training features for `epochs` epochs, tested on the
 * test features. Every rank gets the same result. */
double probe_accuracy(td_graph *g, const simclr_net *net, int64_t batch, td_comm *comm,
                      td_dataset *train, size_t n_train, td_dataset *test, size_t n_test,
                      int epochs, uint64_t seed);

#endif
