/* Shape descriptors: construction, element counts, comparison, and their words in messages. No
 * storage here. */
#include <stdio.h>
#include <string.h>

#include "core/core_impl.h"

td_shape td_shape_make(int ndim, const int64_t *dims) {
    td_shape s;
    memset(&s, 0, sizeof s);
    if (ndim < 0) ndim = 0;
    if (ndim > TD_MAX_DIMS) ndim = TD_MAX_DIMS;
    s.ndim = ndim;
    for (int i = 0; i < ndim; i++) s.dim[i] = dims ? dims[i] : 1;
    return s;
}

td_shape td_shape_1d(int64_t d0) { return td_shape_make(1, (int64_t[]){d0}); }

td_shape td_shape_2d(int64_t d0, int64_t d1) { return td_shape_make(2, (int64_t[]){d0, d1}); }

td_shape td_shape_3d(int64_t d0, int64_t d1, int64_t d2) {
    return td_shape_make(3, (int64_t[]){d0, d1, d2});
}

td_shape td_shape_4d(int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
    return td_shape_make(4, (int64_t[]){d0, d1, d2, d3});
}

int64_t td_shape_numel(const td_shape *shape) {
    int64_t n = 1;
    for (int i = 0; i < shape->ndim; i++) n *= shape->dim[i];
    return n;
}

int td_shape_equal(const td_shape *a, const td_shape *b) {
    if (a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->dim[i] != b->dim[i]) return 0;
    return 1;
}

const char *td__dims_str(char *out, size_t cap, int64_t ndim, const int64_t *dims) {
    size_t at = (size_t)snprintf(out, cap, "(");
    for (int64_t i = 0; i < ndim && i < TD_MAX_DIMS && at < cap; i++)
        at += (size_t)snprintf(out + at, cap - at, i ? ", %lld" : "%lld", (long long)dims[i]);
    if (at < cap) snprintf(out + at, cap - at, ")");
    return out;
}
