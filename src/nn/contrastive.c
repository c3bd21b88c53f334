/* SimCLR's NT-Xent loss built from graph ops, so autodiff goes through it and through the
 * all-gather that brings other ranks' features in: cosine similarities of unit vectors as a
 * matmul (linear with the keys as its weight), a temperature (scale), each anchor's own
 * column masked out (an added constant), and cross entropy towards the other view. */
#include <stdio.h>

#include "tandem/nn.h"

#include "core/core_impl.h"

/* What masks an anchor's similarity with itself: exp() of it minus any logit is 0 in f32. */
#define SELF_MASK (-1e9f)

/* A graph input "<name>.<what>" of shape s. */
static td_status input_named(td_graph *g, const char *name, const char *what, td_shape s,
                             td_dtype dtype, td_tensor **out) {
    char full[64];
    if (snprintf(full, sizeof full, "%s.%s", name, what) >= (int)sizeof full)
        return td__fail(TD_EINVAL, "td_nn_nt_xent: name '%s' is too long", name);
    return td_graph_input(g, full, s, dtype, 0, out);
}

td_status td_nn_nt_xent(td_graph *g, const char *name, td_tensor *z, td_tensor *keys, int64_t first,
                        float temperature, td_tensor **loss) {
    if (!g || !name || !z || !keys || !loss)
        return td__fail(TD_EINVAL, "td_nn_nt_xent: NULL argument");
    td_shape zs = td_tensor_shape(z), ks = td_tensor_shape(keys);
    if (zs.ndim != 2 || zs.dim[0] % 2 != 0 || ks.ndim != 2 || ks.dim[1] != zs.dim[1])
        return td__fail(TD_ESHAPE,
                        "td_nn_nt_xent '%s': z must be (2n, D) and keys (K, D), got %d dims "
                        "(%lld rows) and %d dims",
                        name, zs.ndim, (long long)zs.dim[0], ks.ndim);
    int64_t rows = zs.dim[0], n = rows / 2, K = ks.dim[0];
    if (first < 0 || first + rows > K)
        return td__fail(TD_ESHAPE,
                        "td_nn_nt_xent '%s': z's %lld rows cannot lie at keys rows [%lld, %lld) "
                        "of %lld",
                        name, (long long)rows, (long long)first, (long long)(first + rows),
                        (long long)K);
    if (!(temperature > 0))
        return td__fail(TD_EINVAL, "td_nn_nt_xent '%s': temperature %g must be > 0", name,
                        (double)temperature);
    td_tensor *mask, *labels, *t;
    TD__TRY(input_named(g, name, "mask", td_shape_2d(rows, K), TD_F32, &mask));
    TD__TRY(input_named(g, name, "labels", td_shape_1d(rows), TD_I64, &labels));
    float *m = td_tensor_data(mask);
    int64_t *y = td_tensor_data(labels);
    for (int64_t i = 0; i < rows; i++) {
        m[i * K + first + i] = SELF_MASK;
        y[i] = first + (i < n ? i + n : i - n);
    }
    TD__TRY(td_graph_linear(g, z, keys, NULL, &t)); /* (2n, K) cosine similarities */
    TD__TRY(td_graph_scale(g, t, 1.0f / temperature, &t));
    TD__TRY(td_graph_add(g, t, mask, &t));
    return td_graph_cross_entropy(g, t, labels, TD_REDUCTION_MEAN, loss, NULL);
}
