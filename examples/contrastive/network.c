/* The SimCLR network of the example: a small CNN encoder whose pooled features the linear
 * probe reads, and the projection head the contrastive loss sees (SimCLR's g(h)). Batch norms
 * go through td_nn_batch_norm2d, so a graph created with sync_batch_norm = 1 gets
 * SyncBatchNorm everywhere without a change here. */
#include "contrastive.h"

/* conv 3x3 (no bias: batch norm follows) + batch norm + ReLU. */
static td_tensor *conv_bn_relu(td_graph *g, int i, td_tensor *x, int64_t channels, td_rng *rng) {
    char conv[16], bn[16];
    snprintf(conv, sizeof conv, "conv%d", i);
    snprintf(bn, sizeof bn, "bn%d", i);
    td_conv2d_params cp = td_conv2d_default_params();
    cp.padding[0] = cp.padding[1] = 1;
    td_tensor *t;
    CHECK(td_nn_conv2d(g, conv, x, channels, 3, &cp, 0, rng, &t));
    CHECK(td_nn_batch_norm2d(g, bn, t, &t));
    CHECK(td_graph_relu(g, t, &t));
    return t;
}

void simclr_build(td_graph *g, int64_t images, uint64_t seed, int head, simclr_net *net) {
    td_rng rng;
    td_rng_init(&rng, seed);
    td_pool2d_params half = td_pool2d_default_params(), whole = half;
    whole.kernel[0] = whole.kernel[1] = whole.stride[0] = whole.stride[1] = 7;
    CHECK(td_graph_input(g, "input", td_shape_4d(images, 1, IMAGE_SIDE, IMAGE_SIDE), TD_F32, 0,
                         &net->input));
    td_tensor *t = conv_bn_relu(g, 1, net->input, 32, &rng); /* 28 x 28 */
    CHECK(td_graph_max_pool2d(g, t, &half, &t));
    t = conv_bn_relu(g, 2, t, 64, &rng); /* 14 x 14 */
    CHECK(td_graph_max_pool2d(g, t, &half, &t));
    t = conv_bn_relu(g, 3, t, FEATURES, &rng); /* 7 x 7 */
    CHECK(td_graph_avg_pool2d(g, t, &whole, &t));
    CHECK(td_graph_flatten(g, t, 1, &net->features));
    net->z = NULL;
    if (!head) return;
    CHECK(td_nn_linear(g, "head1", net->features, FEATURES, 1, &rng, &t));
    CHECK(td_graph_relu(g, t, &t));
    CHECK(td_nn_linear(g, "head2", t, 64, 1, &rng, &t));
    CHECK(td_graph_normalize(g, t, 1e-12f, &net->z));
}
