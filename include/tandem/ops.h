/* What the ops take besides tensors: the geometry of convolution and pooling, batch norm's
 * options and the reduction of a loss, each with PyTorch's defaults. The graph's op builders
 * (graph.h) take these; they describe, they compute nothing. */
#ifndef TANDEM_OPS_H
#define TANDEM_OPS_H

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Convolution geometry; groups are always 1. */
typedef struct {
    int stride[2];   /* (h, w) */
    int padding[2];  /* zeros on both sides */
    int dilation[2]; /* 1 = dense kernel, as PyTorch */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_conv2d_params;

/* stride 1, padding 0, dilation 1. */
td_conv2d_params td_conv2d_default_params(void);

/* Pooling geometry. */
typedef struct {
    int kernel[2];
    int stride[2]; /* PyTorch's default is the kernel size */
    int padding[2];
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_pool2d_params;

/* kernel 2 x 2, stride 2, padding 0 (nn.MaxPool2d(2)). */
td_pool2d_params td_pool2d_default_params(void);

/* Batch norm options. */
typedef struct {
    float eps;      /* 1e-5 */
    float momentum; /* 0.1: running = (1 - m) * running + m * batch (unbiased var) */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_batch_norm_params;

/* eps 1e-5, momentum 0.1 (PyTorch's defaults). */
td_batch_norm_params td_batch_norm_default_params(void);

/* Loss reduction over the batch. */
typedef enum { TD_REDUCTION_MEAN = 0, TD_REDUCTION_SUM = 1 } td_reduction;

#ifdef __cplusplus
}
#endif
#endif
