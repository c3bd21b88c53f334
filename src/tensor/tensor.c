/* Shape descriptors and the public accessors of graph-owned tensors: metadata, plain
 * views, and copies in and out that undo a blocked layout. Creating tensors is the
 * graph's job (src/graph/graph.c); no math here. */
#include <string.h>

#include "graph/graph_impl.h"

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

const char *td_tensor_name(const td_tensor *t) { return t ? t->name : ""; }

td_shape td_tensor_shape(const td_tensor *t) {
    if (t) return t->shape;
    td_shape s;
    memset(&s, 0, sizeof s);
    return s;
}

td_dtype td_tensor_dtype(const td_tensor *t) { return t ? t->dtype : TD_DTYPE_COUNT; }

int64_t td_tensor_numel(const td_tensor *t) { return t ? td_shape_numel(&t->shape) : 0; }

void *td_tensor_data(const td_tensor *t) {
    if (t && (t->kind == TD__PARAM || t->kind == TD__BUFFER) && t->g->compiled)
        td__graph_sync_storage(t->g);
    return t && !t->blocked ? t->data : NULL;
}

float *td_tensor_grad(const td_tensor *t) {
    if (t && t->kind == TD__PARAM && t->g->compiled) td__graph_sync_storage(t->g);
    return t && !t->blocked ? t->grad : NULL;
}

/* Copies between a blocked buffer and plain memory through a one-off reorder. */
static td_status copy_blocked(const td_tensor *t, const void *src, void *dst, int to_plain) {
    dnnl_memory_desc_t plain;
    td__md_plain(&plain, &t->shape);
    td__reorder r;
    TD__TRY(to_plain ? td__reorder_init(t->g, &r, &t->md, &plain)
                     : td__reorder_init(t->g, &r, &plain, &t->md));
    td_status s = td__reorder_run(t->g, &r, src, dst);
    td__reorder_free(&r);
    return s;
}

td_status td_tensor_read(const td_tensor *t, void *dst) {
    if (!t || !dst) return td__fail(TD_EINVAL, "td_tensor_read: NULL argument");
    if (t->kind != TD__ACT && t->g->compiled) td__graph_sync_storage(t->g);
    if (!t->data)
        return td__fail(TD_ESTATE, "td_tensor_read: '%s' has no storage before td_graph_compile",
                        t->name);
    if (t->blocked) return copy_blocked(t, t->data, dst, 1);
    memcpy(dst, t->data, (size_t)td_shape_numel(&t->shape) * td_dtype_size(t->dtype));
    return TD_OK;
}

td_status td_tensor_read_grad(const td_tensor *t, float *dst) {
    if (!t || !dst) return td__fail(TD_EINVAL, "td_tensor_read_grad: NULL argument");
    if (t->kind == TD__PARAM && t->g->compiled) td__graph_sync_storage(t->g);
    if (!t->grad)
        return td__fail(
            TD_ESTATE, "td_tensor_read_grad: '%s' takes no gradient (or the graph is not compiled)",
            t->name);
    if (t->blocked) return copy_blocked(t, t->grad, dst, 1);
    memcpy(dst, t->grad, (size_t)td_shape_numel(&t->shape) * sizeof(float));
    return TD_OK;
}

td_status td_tensor_write(td_tensor *t, const void *src) {
    if (!t || !src) return td__fail(TD_EINVAL, "td_tensor_write: NULL argument");
    if (t->kind != TD__ACT && t->g->compiled) td__graph_sync_storage(t->g);
    if (!t->data)
        return td__fail(TD_ESTATE, "td_tensor_write: '%s' has no storage before td_graph_compile",
                        t->name);
    if (t->blocked) return copy_blocked(t, src, t->data, 0);
    memcpy(t->data, src, (size_t)td_shape_numel(&t->shape) * td_dtype_size(t->dtype));
    return TD_OK;
}

td_status td_tensor_set_data(td_tensor *t, void *data) {
    if (!t) return td__fail(TD_EINVAL, "td_tensor_set_data: tensor is NULL");
    if (t->kind != TD__INPUT)
        return td__fail(TD_EINVAL, "td_tensor_set_data: '%s' is not a graph input", t->name);
    t->data = data ? data : t->own;
    return TD_OK;
}
