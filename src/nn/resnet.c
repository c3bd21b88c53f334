/* ResNet (He et al. 2015) as a td_sequential: a stem (for small images, or torchvision's
 * ImageNet stem), one layer per residual block (BasicBlock or Bottleneck, torchvision v1.5),
 * and a head of global average pooling and a linear classifier; torchvision's resnet18 ..
 * resnet152 by depth. Parameter names and initialisation follow torchvision, so a state_dict
 * of the same architecture loads by name (tests/fixtures/models checks it against PyTorch).
 * It does not train, and knows nothing of stages: any cut between layers is a valid one. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tandem/nn.h"

#include "core/core_impl.h"
#include "nn/nn_impl.h"

td_resnet_params td_resnet_default_params(void) {
    td_resnet_params p;
    memset(&p, 0, sizeof p);
    p.block = TD_RESNET_BASIC;
    p.stages = 4;
    for (int i = 0; i < p.stages; i++) p.blocks[i] = 1;
    p.base_width = 16;
    p.in_channels = 1;
    p.image_size = 28;
    p.classes = 10;
    return p;
}

td_status td_resnet_torchvision_params(int depth, td_resnet_params *out) {
    static const struct {
        int depth;
        td_resnet_block block;
        int blocks[4];
    } arch[] = {{18, TD_RESNET_BASIC, {2, 2, 2, 2}},
                {34, TD_RESNET_BASIC, {3, 4, 6, 3}},
                {50, TD_RESNET_BOTTLENECK, {3, 4, 6, 3}},
                {101, TD_RESNET_BOTTLENECK, {3, 4, 23, 3}},
                {152, TD_RESNET_BOTTLENECK, {3, 8, 36, 3}}};
    if (!out) return td__fail(TD_EINVAL, "td_resnet_torchvision_params: NULL argument");
    for (size_t i = 0; i < sizeof arch / sizeof *arch; i++) {
        if (arch[i].depth != depth) continue;
        td_resnet_params p = td_resnet_default_params();
        p.block = arch[i].block;
        for (int j = 0; j < 4; j++) p.blocks[j] = arch[i].blocks[j];
        p.base_width = 64;
        p.in_channels = 3;
        p.image_size = 224;
        p.classes = 1000;
        p.imagenet_stem = 1;
        *out = p;
        return TD_OK;
    }
    return td__fail(TD_EINVAL, "td_resnet_torchvision_params: depth %d (18, 34, 50, 101 or 152)",
                    depth);
}

/* conv (k x k, no bias) with torchvision's kaiming_normal_(mode="fan_out", relu). */
static td_status conv(td_graph *g, const char *prefix, const char *what, td_tensor *x, int64_t out,
                      int k, int stride, td_rng *rng, td_tensor **y) {
    char name[64];
    if (snprintf(name, sizeof name, "%s%s.weight", prefix, what) >= (int)sizeof name)
        return td__fail(TD_EINVAL, "resnet: parameter name '%s%s.weight' is too long", prefix,
                        what);
    int64_t c = td_tensor_shape(x).dim[1];
    td_tensor *w;
    TD__TRY(td_graph_param(g, name, td_shape_4d(out, c, k, k), &w));
    float *wd = td_tensor_data(w), std = sqrtf(2.0f / (float)(out * k * k));
    for (int64_t i = 0; i < td_tensor_numel(w); i++) wd[i] = std * td_rng_normal(rng);
    td_conv2d_params cp = td_conv2d_default_params();
    cp.stride[0] = cp.stride[1] = stride;
    cp.padding[0] = cp.padding[1] = k / 2;
    return td_graph_conv2d(g, x, w, NULL, &cp, y);
}

static td_status bn(td_graph *g, const char *prefix, const char *what, td_tensor *x,
                    td_tensor **y) {
    char name[64];
    if (snprintf(name, sizeof name, "%s%s", prefix, what) >= (int)sizeof name)
        return td__fail(TD_EINVAL, "resnet: layer name '%s%s' is too long", prefix, what);
    return td_nn_batch_norm2d(g, name, x, y);
}

/* The stem: conv1 to base_width channels, bn1, ReLU; 3x3 stride 1 for small images, or
 * torchvision's 7x7 stride 2 followed by its maxpool (3x3, stride 2, padding 1). */
static td_status stem(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                      td_tensor **y) {
    (void)name;
    const td_resnet_params *p = arg;
    td_tensor *t;
    TD__TRY(conv(g, "", "conv1", x, p->base_width, p->imagenet_stem ? 7 : 3,
                 p->imagenet_stem ? 2 : 1, rng, &t));
    TD__TRY(bn(g, "", "bn1", t, &t));
    if (!p->imagenet_stem) return td_graph_relu(g, t, y);
    TD__TRY(td_graph_relu(g, t, &t));
    td_pool2d_params pp = td_pool2d_default_params();
    pp.kernel[0] = pp.kernel[1] = 3;
    pp.stride[0] = pp.stride[1] = 2;
    pp.padding[0] = pp.padding[1] = 1;
    return td_graph_max_pool2d(g, t, &pp, y);
}

typedef struct {
    td_resnet_block block;
    int64_t planes;
    int stride;
} block_arg;

/* One residual block; `name` ("layer2.0") prefixes its parameters. The shortcut projects
 * (1x1 conv + batch norm, torchvision's downsample) when the stride or the width changes. */
static td_status block(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                       td_tensor **y) {
    const block_arg *a = arg;
    char prefix[64];
    snprintf(prefix, sizeof prefix, "%s.", name);
    int64_t in = td_tensor_shape(x).dim[1];
    int64_t out = a->block == TD_RESNET_BOTTLENECK ? a->planes * 4 : a->planes;
    td_tensor *t;
    if (a->block == TD_RESNET_BASIC) {
        TD__TRY(conv(g, prefix, "conv1", x, a->planes, 3, a->stride, rng, &t));
        TD__TRY(bn(g, prefix, "bn1", t, &t));
        TD__TRY(td_graph_relu(g, t, &t));
        TD__TRY(conv(g, prefix, "conv2", t, a->planes, 3, 1, rng, &t));
        TD__TRY(bn(g, prefix, "bn2", t, &t));
    } else {
        TD__TRY(conv(g, prefix, "conv1", x, a->planes, 1, 1, rng, &t));
        TD__TRY(bn(g, prefix, "bn1", t, &t));
        TD__TRY(td_graph_relu(g, t, &t));
        TD__TRY(conv(g, prefix, "conv2", t, a->planes, 3, a->stride, rng, &t));
        TD__TRY(bn(g, prefix, "bn2", t, &t));
        TD__TRY(td_graph_relu(g, t, &t));
        TD__TRY(conv(g, prefix, "conv3", t, out, 1, 1, rng, &t));
        TD__TRY(bn(g, prefix, "bn3", t, &t));
    }
    td_tensor *shortcut = x;
    if (a->stride != 1 || in != out) {
        TD__TRY(conv(g, prefix, "downsample.0", x, out, 1, a->stride, rng, &shortcut));
        TD__TRY(bn(g, prefix, "downsample.1", shortcut, &shortcut));
    }
    TD__TRY(td_graph_add(g, t, shortcut, &t));
    return td_graph_relu(g, t, y);
}

/* Global average pooling (a window of the whole feature map), flatten, fc. */
static td_status head(td_graph *g, const char *name, td_tensor *x, td_rng *rng, const void *arg,
                      td_tensor **y) {
    const td_resnet_params *p = arg;
    td_shape s = td_tensor_shape(x);
    td_pool2d_params pp = td_pool2d_default_params();
    pp.kernel[0] = pp.stride[0] = (int)s.dim[2];
    pp.kernel[1] = pp.stride[1] = (int)s.dim[3];
    td_tensor *t;
    TD__TRY(td_graph_avg_pool2d(g, x, &pp, &t));
    TD__TRY(td_graph_flatten(g, t, 1, &t));
    return td_nn_linear(g, name, t, p->classes, 1, rng, y);
}

static td_status check(const td_resnet_params *p) {
    if (p->block != TD_RESNET_BASIC && p->block != TD_RESNET_BOTTLENECK)
        return td__fail(TD_EINVAL, "resnet: unknown block kind %d", (int)p->block);
    if (p->stages < 1 || p->stages > TD_RESNET_MAX_STAGES)
        return td__fail(TD_EINVAL, "resnet: %d stages (1 to %d)", p->stages, TD_RESNET_MAX_STAGES);
    for (int i = 0; i < p->stages; i++)
        if (p->blocks[i] < 1 || p->blocks[i] > 64)
            return td__fail(TD_EINVAL, "resnet: stage %d has %d blocks (1 to 64)", i + 1,
                            p->blocks[i]);
    if (p->imagenet_stem != 0 && p->imagenet_stem != 1)
        return td__fail(TD_EINVAL, "resnet: imagenet_stem %d (0 or 1)", p->imagenet_stem);
    if (p->base_width < 1 || p->in_channels < 1 || p->image_size < 1 || p->classes < 1)
        return td__fail(TD_EINVAL,
                        "resnet: base_width %lld, in_channels %lld, image_size %lld and classes "
                        "%lld must all be >= 1",
                        (long long)p->base_width, (long long)p->in_channels,
                        (long long)p->image_size, (long long)p->classes);
    return TD_OK;
}

static td_status add_layers(td_sequential *s, const td_resnet_params *p) {
    TD__TRY(td_sequential_add(s, "stem", stem, p, sizeof *p));
    for (int i = 0; i < p->stages; i++)
        for (int j = 0; j < p->blocks[i]; j++) {
            block_arg a = {p->block, p->base_width << i, i > 0 && j == 0 ? 2 : 1};
            char name[32];
            snprintf(name, sizeof name, "layer%d.%d", i + 1, j);
            TD__TRY(td_sequential_add(s, name, block, &a, sizeof a));
        }
    return td_sequential_add(s, "fc", head, p, sizeof *p);
}

td_status td_resnet_sequential(const td_resnet_params *p, td_sequential **out) {
    if (!p || !out) return td__fail(TD_EINVAL, "td_resnet_sequential: NULL argument");
    *out = NULL;
    TD__TRY(check(p));
    td_sequential *s;
    int64_t sample[3] = {p->in_channels, p->image_size, p->image_size};
    TD__TRY(td_sequential_create(&s, td_shape_make(3, sample)));
    td_status st = add_layers(s, p);
    if (st != TD_OK) {
        td_sequential_destroy(s);
        return st;
    }
    td__sequential_set_kind(s, TD_MODEL_RESNET);
    *out = s;
    return TD_OK;
}
