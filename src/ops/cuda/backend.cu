/* The GPU backend (backend.h): the device's compute stream and caching allocator (lent by the
 * host), cuBLASLt and cuDNN handles on that stream sharing one workspace, plain row-major
 * layouts only (no layout records), storage in device memory, and the kernels of the ops that
 * have them on a GPU. An op whose kernels are missing here is refused when it is added to a
 * graph, naming the op and the device. */
#include <cstdlib>

#include "ops/cuda/cuda_ops.cuh"

static td_status gpu_init(td__op_ctx *ctx, const char *what) {
    td__gpu *g = (td__gpu *)calloc(1, sizeof *g);
    if (!g) return td__host->fail(TD_ENOMEM, "%s: out of memory", what);
    ctx->be = g;
    g->device = ctx->device;
    TD__CU(cudaSetDevice(g->device.index));
    void *stream;
    td_status s = td__host->stream(g->device, &stream);
    if (s != TD_OK) return s;
    g->stream = (cudaStream_t)stream;
    TD__CUBLAS(cublasLtCreate(&g->lt));
    TD__CUDNN(cudnnCreate(&g->dnn));
    TD__CUDNN(cudnnSetStream(g->dnn, g->stream));
    g->workspace_bytes = (size_t)32 << 20;
    s = td__host->alloc(g->device, g->workspace_bytes, &g->workspace);
    if (s != TD_OK) return s;
    return td__cuda_rng_key_create(g);
}

static void gpu_destroy(td__op_ctx *ctx) {
    td__gpu *g = td__gpu_of(ctx);
    if (!g) return;
    if (g->workspace) td__host->free(g->device, g->workspace);
    if (g->rng_key) td__host->free(g->device, g->rng_key);
    if (g->lt) cublasLtDestroy(g->lt);
    if (g->dnn) cudnnDestroy(g->dnn);
    free(g);
    ctx->be = NULL;
}

/* Every forward and backward makes its GPU current first, whatever it runs (replayed, recorded
 * or op by op), and so do the calls from outside a sweep below: a thread may drive graphs on
 * several GPUs. */
static td_status gpu_begin(td__op_ctx *ctx) {
    TD__CU(cudaSetDevice(td__gpu_of(ctx)->device.index));
    return TD_OK;
}

static td_status gpu_describe(td__op_ctx *ctx, td_tensor *t) {
    (void)ctx;
    t->extra = NULL;
    t->blocked = 0;
    return TD_OK;
}

static size_t gpu_storage_bytes(const td_tensor *t) {
    return td__numel(t) * td__elem_size(t->dtype);
}

static td_status gpu_alloc(td__op_ctx *ctx, size_t bytes, void **out) {
    td__gpu *g = td__gpu_of(ctx);
    TD__TRY(gpu_begin(ctx));
    td_status s = td__host->alloc(g->device, bytes ? bytes : 64, out);
    if (s != TD_OK) return s;
    TD__CU(cudaMemsetAsync(*out, 0, bytes, g->stream));
    return TD_OK;
}

static void gpu_free(td__op_ctx *ctx, void *ptr) { td__host->free(td__gpu_of(ctx)->device, ptr); }

static td_status gpu_zero(td__op_ctx *ctx, void *ptr, size_t bytes) {
    TD__TRY(gpu_begin(ctx));
    TD__CU(cudaMemsetAsync(ptr, 0, bytes, td__gpu_of(ctx)->stream));
    return TD_OK;
}

/* Host memory may be pageable: the copy completes before the call returns. */
static td_status gpu_copy(td__op_ctx *ctx, void *dst, const void *src, size_t bytes) {
    TD__TRY(gpu_begin(ctx));
    cudaStream_t s = td__gpu_of(ctx)->stream;
    TD__CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    TD__CU(cudaStreamSynchronize(s));
    return TD_OK;
}

static td_status gpu_copy_async(td__op_ctx *ctx, void *dst, const void *src, size_t bytes) {
    TD__TRY(gpu_begin(ctx));
    if (bytes)
        TD__CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, td__gpu_of(ctx)->stream));
    return TD_OK;
}

static td_status gpu_accumulate(td__op_ctx *ctx, void *dst, const void *src, td_dtype dt,
                                size_t n) {
    return td__cuda_add_into(ctx, dst, dt, src, dt, n, 1.f, 1.f, "accumulate");
}

static td_status gpu_convert(td__op_ctx *ctx, void *dst, td_dtype dst_dtype, const void *src,
                             td_dtype src_dtype, size_t n) {
    return td__cuda_add_into(ctx, dst, dst_dtype, src, src_dtype, n, 1.f, 0.f, "convert");
}

/* Layouts on a GPU are always plain: only the dtype changes. */
static td_status gpu_copy_plain(td__op_ctx *ctx, const td_tensor *t, const void *src, void *dst,
                                td_dtype plain_dtype, int to_plain) {
    return to_plain ? gpu_convert(ctx, dst, plain_dtype, src, t->dtype, td__numel(t))
                    : gpu_convert(ctx, dst, t->dtype, src, plain_dtype, td__numel(t));
}

/* The RNG key the forward's dropout kernels read. */
static td_status gpu_forward_begin(td__op_ctx *ctx) { return td__cuda_rng_key_write(ctx); }

/* Pageable sources are staged by the driver before the call returns. */
static td_status gpu_upload_async(td__op_ctx *ctx, void *dst, const void *host, size_t bytes) {
    TD__CU(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, td__gpu_of(ctx)->stream));
    return TD_OK;
}

/* Recordings are CUDA graphs of the compute stream, captured in this thread's mode, so that
 * another thread's unrelated CUDA calls do not break them. */
static td_status gpu_record_begin(td__op_ctx *ctx) {
    TD__CU(cudaStreamBeginCapture(td__gpu_of(ctx)->stream, cudaStreamCaptureModeThreadLocal));
    return TD_OK;
}

static td_status gpu_record_end(td__op_ctx *ctx, int keep, void **recording) {
    *recording = NULL;
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(td__gpu_of(ctx)->stream, &graph);
    if (e != cudaSuccess || !keep) {
        if (graph) cudaGraphDestroy(graph);
        cudaGetLastError(); /* a broken capture leaves its error behind */
        if (!keep) return TD_OK;
        return td__host->fail(TD_EBACKEND, "recording the sweep as a CUDA graph failed: %s",
                              cudaGetErrorString(e));
    }
    cudaGraphExec_t exec;
    e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess)
        return td__host->fail(TD_EBACKEND, "cudaGraphInstantiate failed: %s",
                              cudaGetErrorString(e));
    *recording = exec;
    return TD_OK;
}

static td_status gpu_replay(td__op_ctx *ctx, void *recording) {
    TD__CU(cudaGraphLaunch((cudaGraphExec_t)recording, td__gpu_of(ctx)->stream));
    return TD_OK;
}

static void gpu_release(void *recording) { cudaGraphExecDestroy((cudaGraphExec_t)recording); }

static td__backend make_backend() {
    td__backend b = {};
    b.name = "cuda";
    b.kernels[TD__OP_LINEAR] = &td__cuda_linear;
    b.kernels[TD__OP_CONV2D] = &td__cuda_conv2d;
    b.kernels[TD__OP_POOL2D] = &td__cuda_pool2d;
    b.kernels[TD__OP_BATCH_NORM] = &td__cuda_batch_norm;
    b.kernels[TD__OP_ELTWISE] = &td__cuda_eltwise;
    b.kernels[TD__OP_ADD] = &td__cuda_add;
    b.kernels[TD__OP_SCALE] = &td__cuda_scale;
    b.kernels[TD__OP_CAST] = &td__cuda_cast;
    b.kernels[TD__OP_RESHAPE] = &td__cuda_reshape;
    b.kernels[TD__OP_SOFTMAX] = &td__cuda_softmax;
    b.kernels[TD__OP_NLL] = &td__cuda_nll;
    b.kernels[TD__OP_DROPOUT] = &td__cuda_dropout;
    b.kernels[TD__OP_CONCAT] = &td__cuda_concat;
    b.kernels[TD__OP_NORMALIZE] = &td__cuda_normalize;
    b.kernels[TD__OP_EMBEDDING] = &td__cuda_embedding;
    b.kernels[TD__OP_LAYER_NORM] = &td__cuda_layer_norm;
    b.kernels[TD__OP_ATTENTION] = &td__cuda_attention;
    b.init = gpu_init;
    b.destroy = gpu_destroy;
    b.describe = gpu_describe;
    b.storage_bytes = gpu_storage_bytes;
    b.alloc = gpu_alloc;
    b.free = gpu_free;
    b.zero = gpu_zero;
    b.upload = gpu_copy;
    b.download = gpu_copy;
    b.copy = gpu_copy_async;
    b.accumulate = gpu_accumulate;
    b.convert = gpu_convert;
    b.copy_plain = gpu_copy_plain;
    b.begin = gpu_begin;
    b.forward_begin = gpu_forward_begin;
    b.upload_async = gpu_upload_async;
    b.record_begin = gpu_record_begin;
    b.record_end = gpu_record_end;
    b.replay = gpu_replay;
    b.release = gpu_release;
    return b;
}

/* C++ has no designated array initializers: the table is filled once, at load. */
static const td__backend backend = make_backend();

static const td__backend_library library = {TD__BACKEND_ABI, &backend, sizeof(td_tensor),
                                            sizeof(td__node), sizeof(td__op_ctx)};

/* The graph engine's table of libtandem_cuda.so (device/library.c names it). */
extern "C" __attribute__((visibility("default"))) const td__backend_library *
td_cuda_backend_entry(void) {
    return &library;
}
