/* The public accessors of graph-owned tensors that touch storage: plain views, and copies in
 * and out that undo a backend-chosen layout through the graph's backend. They
 * follow the graph's td_param entries first, so a caller always sees where a parameter's
 * values and gradient live now. */
#include <string.h>

#include "device/device_impl.h"
#include "graph/graph_impl.h"

/* Parameters and buffers may have been re-pointed through their td_param entries. */
static void follow(const td_tensor *t) {
    if (t && t->kind != TD__ACT && t->kind != TD__INPUT && t->g->compiled)
        td__graph_sync_storage(t->g);
}

void *td_tensor_data(const td_tensor *t) {
    follow(t);
    return t && !t->blocked ? t->data : NULL;
}

void *td_tensor_grad(const td_tensor *t) {
    follow(t);
    return t && !t->blocked ? t->grad : NULL;
}

/* Plain bytes between host memory and t's storage: a leaf is in host memory until compile,
 * later the backend's device holds it. */
static td_status move(const td_tensor *t, void *dst, const void *src, size_t bytes, int to_host) {
    td__op_ctx *ctx = &t->g->ctx;
    if (!t->g->compiled) {
        memcpy(dst, src, bytes);
        return TD_OK;
    }
    return to_host ? ctx->backend->download(ctx, dst, src, bytes)
                   : ctx->backend->upload(ctx, dst, src, bytes);
}

/* Copies between a backend-chosen layout and plain memory in the tensor's dtype. */
static td_status copy_blocked(const td_tensor *t, const void *src, void *dst, int to_plain) {
    td__op_ctx *ctx = &t->g->ctx;
    return ctx->backend->copy_plain(ctx, t, src, dst, t->dtype, to_plain);
}

td_status td_tensor_read(const td_tensor *t, void *dst) {
    if (!t || !dst) return td__fail(TD_EINVAL, "td_tensor_read: NULL argument");
    follow(t);
    if (!t->data)
        return td__fail(TD_ESTATE, "td_tensor_read: '%s' has no storage before td_graph_compile",
                        t->name);
    if (t->blocked) return copy_blocked(t, t->data, dst, 1);
    return move(t, dst, t->data, (size_t)td_shape_numel(&t->shape) * td_dtype_size(t->dtype), 1);
}

td_status td_tensor_read_grad(const td_tensor *t, void *dst) {
    if (!t || !dst) return td__fail(TD_EINVAL, "td_tensor_read_grad: NULL argument");
    follow(t);
    if (!t->grad)
        return td__fail(
            TD_ESTATE, "td_tensor_read_grad: '%s' takes no gradient (or the graph is not compiled)",
            t->name);
    if (t->blocked) return copy_blocked(t, t->grad, dst, 1);
    return move(t, dst, t->grad, (size_t)td_shape_numel(&t->shape) * td_dtype_size(t->dtype), 1);
}

td_status td_tensor_write(td_tensor *t, const void *src) {
    if (!t || !src) return td__fail(TD_EINVAL, "td_tensor_write: NULL argument");
    follow(t);
    if (!t->data)
        return td__fail(TD_ESTATE, "td_tensor_write: '%s' has no storage before td_graph_compile",
                        t->name);
    size_t count = (size_t)td_shape_numel(&t->shape);
    td_status st = t->blocked ? copy_blocked(t, src, t->data, 0)
                              : move(t, t->data, src, count * td_dtype_size(t->dtype), 0);
    const td_param *p = t->kind == TD__PARAM ? &t->g->params[t->index] : NULL;
    if (p && p->written) p->written(p->written_ctx, t->data, 0, st ? 0 : count); /* its copies */
    return st;
}

td_status td_tensor_copy_from(td_tensor *t, td_device from, const void *src) {
    if (!t || !src) return td__fail(TD_EINVAL, "td_tensor_copy_from: NULL argument");
    if (from.type == TD_DEVICE_CPU) return td_tensor_write(t, src);
    td_device on = t->g->opt.device;
    if (from.type != on.type || from.index != on.index) {
        char a[32], b[32];
        td_device_format(from, a, sizeof a);
        td_device_format(on, b, sizeof b);
        return td__fail(TD_EINVAL, "td_tensor_copy_from: '%s' is on %s, the source on %s", t->name,
                        b, a);
    }
    if (!t->g->compiled || t->kind == TD__ACT)
        return td__fail(TD_ESTATE, "td_tensor_copy_from: '%s' is not a leaf of a compiled graph",
                        t->name);
    td__op_ctx *ctx = &t->g->ctx;
    return ctx->backend->copy(ctx, t->data, src,
                              (size_t)td_shape_numel(&t->shape) * td_dtype_size(t->dtype));
}

td_status td_tensor_set_data(td_tensor *t, void *data) {
    if (!t) return td__fail(TD_EINVAL, "td_tensor_set_data: tensor is NULL");
    if (t->kind != TD__INPUT)
        return td__fail(TD_EINVAL, "td_tensor_set_data: '%s' is not a graph input", t->name);
    td_device on = t->g->opt.device, at = td__device_of_pointer(data);
    if (data && (at.type != on.type || at.index != on.index)) {
        char a[32], b[32];
        td_device_format(on, a, sizeof a);
        td_device_format(at, b, sizeof b);
        return td__fail(TD_EINVAL,
                        "td_tensor_set_data: '%s' is read on %s and the memory given is on %s "
                        "(td_tensor_write or td_tensor_copy_from copy it there)",
                        t->name, a, b);
    }
    void *to = data ? data : t->own;
    if (to != t->data) t->g->storage_gen++; /* recorded sweeps read the old memory */
    t->data = to;
    return TD_OK;
}
