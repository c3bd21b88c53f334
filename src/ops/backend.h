/* The backend contract: what a device's backend gives the graph, as src/comm/comm_impl.h is
 * what a comm backend gives a process group (ggml's backends are the model). A backend owns
 * its handles (created into td__op_ctx.be), the record of each tensor's layout (td_tensor
 * .extra), the kernels of every op it runs, and the copies between its layouts and the plain
 * row-major one. The graph holds one backend per graph and calls only this table. Not
 * installed. */
#ifndef TANDEM_BACKEND_H
#define TANDEM_BACKEND_H

#include "ops/op.h"

struct td__backend {
    const char *name;
    /* By td__op_id; NULL: the op does not run on this backend. */
    const td__kernels *kernels[TD__OP_COUNT];
    /* Creates the backend's handles into ctx->be (errors name `what`); destroy frees them. */
    td_status (*init)(td__op_ctx *ctx, const char *what);
    void (*destroy)(td__op_ctx *ctx);
    /* Records the plain row-major layout of t's shape and dtype in t->extra (from the graph's
     * arena) and clears t->blocked; called again when the graph changes t's dtype. */
    td_status (*describe)(td__op_ctx *ctx, td_tensor *t);
    /* Bytes of storage t's recorded layout needs (padding of a blocked layout included). */
    size_t (*storage_bytes)(const td_tensor *t);
    /* Copies values between t's layout (in t's dtype) and the plain row-major layout in
     * plain_dtype: src in t's layout to dst plain when to_plain, else the other way. */
    td_status (*copy_plain)(td__op_ctx *ctx, const td_tensor *t, const void *src, void *dst,
                            td_dtype plain_dtype, int to_plain);
};

/* The CPU backend: oneDNN primitives and plain-C kernels (cpu_backend.c). */
extern const td__backend td__backend_cpu;

/* The kernels of n's op on ctx's backend (NULL when it has none). */
static inline const td__kernels *td__kernels_of(const td__op_ctx *ctx, const td__op *op) {
    return ctx->backend->kernels[op->id];
}

#endif
