/* The backend contract: what a device's backend gives the graph, as src/comm/comm_impl.h is
 * what a comm backend gives a process group (ggml's backends are the model). A backend owns
 * its handles (created into td__op_ctx.be), the record of each tensor's layout (td_tensor
 * .extra), the kernels of every op it runs, its device's storage and the copies between its
 * layouts and the plain row-major one. The graph holds one backend per graph and calls only this
 * table. Not installed. */
#ifndef TANDEM_BACKEND_H
#define TANDEM_BACKEND_H

#include "ops/op.h"

struct td__backend {
    const char *name;
    /* By td__op_id; NULL: the op does not run on this backend. */
    const td__kernels *kernels[TD__OP_COUNT];
    /* Creates the backend's handles for ctx->device into ctx->be (errors name `what`);
     * destroy frees them. */
    td_status (*init)(td__op_ctx *ctx, const char *what);
    void (*destroy)(td__op_ctx *ctx);
    /* Records the plain row-major layout of t's shape and dtype in t->extra (from
     * ctx->records) and clears t->blocked; called again when the graph changes t's dtype. */
    td_status (*describe)(td__op_ctx *ctx, td_tensor *t);
    /* Bytes of storage t's recorded layout needs (padding of a blocked layout included). */
    size_t (*storage_bytes)(const td_tensor *t);
    /* Storage on the backend's device: zeroed, 64-byte aligned. */
    td_status (*alloc)(td__op_ctx *ctx, size_t bytes, void **out);
    void (*free)(td__op_ctx *ctx, void *ptr);
    td_status (*zero)(td__op_ctx *ctx, void *ptr, size_t bytes);
    /* Bytes between host memory and storage. */
    td_status (*upload)(td__op_ctx *ctx, void *dst, const void *host, size_t bytes);
    td_status (*download)(td__op_ctx *ctx, void *host, const void *src, size_t bytes);
    /* Bytes from storage to storage, queued in order with the kernels (no wait). */
    td_status (*copy)(td__op_ctx *ctx, void *dst, const void *src, size_t bytes);
    /* dst += src, n elements of dt in storage (td__grad_end's accumulation). */
    td_status (*accumulate)(td__op_ctx *ctx, void *dst, const void *src, td_dtype dt, size_t n);
    /* n elements of storage from one dtype to another (dst and src do not overlap). */
    td_status (*convert)(td__op_ctx *ctx, void *dst, td_dtype dst_dtype, const void *src,
                         td_dtype src_dtype, size_t n);
    /* Copies values between t's layout (in t's dtype) and the plain row-major layout in
     * plain_dtype: src in t's layout to dst plain when to_plain, else the other way. */
    td_status (*copy_plain)(td__op_ctx *ctx, const td_tensor *t, const void *src, void *dst,
                            td_dtype plain_dtype, int to_plain);
    /* Optional: runs first in every forward and backward, before anything either queues (a GPU
     * backend makes the graph's device the calling thread's current one: a thread may drive
     * graphs on several). */
    td_status (*begin)(td__op_ctx *ctx);
    /* Optional: runs before each forward's first node, outside any recorded region (a GPU
     * backend hands its kernels the forward's RNG key here). */
    td_status (*forward_begin)(td__op_ctx *ctx);
    /* Optional: bytes from pageable host memory (never pinned or registered) queued without
     * waiting; the source may be reused once the call returns. */
    td_status (*upload_async)(td__op_ctx *ctx, void *dst, const void *host, size_t bytes);
    /* Optional (all four or none): recording what the kernels queue between record_begin and
     * record_end (which hands back a replayable recording, or ends a failed recording and
     * frees what it had), replaying it, and freeing it. CUDA graphs on a GPU. */
    td_status (*record_begin)(td__op_ctx *ctx);
    td_status (*record_end)(td__op_ctx *ctx, int keep, void **recording);
    td_status (*replay)(td__op_ctx *ctx, void *recording);
    void (*release)(void *recording);
    /* Optional (NULL: the backend's kernels have no host thread count): makes the kernels that
     * the calling thread creates and runs from now on use n threads (n >= 1), and gives the
     * count before in *was, so that a graph runs on its own count (td_graph_params.threads) and
     * sets the caller's back after; an error names `what` when the backend cannot. */
    td_status (*set_threads)(td__op_ctx *ctx, int n, int *was, const char *what);
    /* Optional (NULL: every float dtype): 1 when the backend's matmuls and convolutions have
     * kernels of their own in `dtype`, at least as fast as its f32 ones, on this machine as
     * its libraries dispatch them; mixed precision computes in f32 where they have not. */
    int (*fast_dtype)(const td__op_ctx *ctx, td_dtype dtype);
    /* Optional: what computes here, for messages and benchmark headings (NUL-terminated). */
    void (*info)(char *buf, size_t cap);
};

/* The CPU backend: oneDNN primitives and plain-C kernels (cpu/backend.c). */
extern const td__backend td__backend_cpu;

/* Bumped whenever td__backend or the engine's structs change shape. */
#define TD__BACKEND_ABI 1

/* What a device library exports for the graph engine (its TD__DEVICE_BACKEND table): its backend
 * and what it was compiled against, so that a library built from other sources is refused, not
 * trusted. */
typedef struct {
    int abi;
    const td__backend *backend;
    size_t tensor_size, node_size, op_ctx_size;
} td__backend_library;

/* The backend of a device: the CPU's, or the one its library exports (backend.c); an error
 * names `what`, the device and why it cannot be used here. */
td_status td__backend_for(td_device device, const char *what, const td__backend **out);

/* The kernels of n's op on ctx's backend, or its backend-neutral ones (NULL when neither). */
static inline const td__kernels *td__kernels_of(const td__op_ctx *ctx, const td__op *op) {
    const td__kernels *k = ctx->backend->kernels[op->id];
    return k ? k : op->generic;
}

#endif
