/* What the GPU backend's kernel files share (CUDA C++, libtandem_cuda.so only): the backend's
 * handles, checked calls, element loads and stores in f32 for every float dtype, and the
 * gradient rule every kernel follows (write when nothing was written since zeroing, add
 * otherwise: td__grad_begin's contract, with beta instead of scratch); launches are
 * device/cuda/kernel.cuh's. Each kernel has the CPU op of the same name as its oracle
 * (tests/test_cuda_graph.c). Not installed. */
#ifndef TANDEM_CUDA_OPS_CUH
#define TANDEM_CUDA_OPS_CUH

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudnn.h>

#include "device/cuda/dtype.cuh"
#include "device/cuda/kernel.cuh"
#include "device/cuda/runtime.cuh"
#include "ops/backend.h"

/* The dropout RNG's position at the start of a forward, as the device reads it (dropout.cuh). */
typedef struct td__gpu_rng_key td__gpu_rng_key;

/* A GPU graph's handles (td__op_ctx.be). */
typedef struct {
    td_device device;
    cudaStream_t stream; /* the device's compute stream */
    cublasLtHandle_t lt;
    cudnnHandle_t dnn; /* on `stream` */
    void *workspace;   /* cuBLASLt's and cuDNN's, from the device's caching allocator */
    size_t workspace_bytes;
    td__gpu_rng_key *rng_key; /* on the device, written before each forward */
    uint64_t forward_offset;  /* the host's rng offset when the forward began */
} td__gpu;

static inline td__gpu *td__gpu_of(const td__op_ctx *ctx) { return (td__gpu *)ctx->be; }

/* Returns the host's td_status naming the call when a cuBLAS(Lt) call fails. */
#define TD__CUBLAS(call)                                               \
    do {                                                               \
        cublasStatus_t td_b_ = (call);                                 \
        if (td_b_ != CUBLAS_STATUS_SUCCESS)                            \
            return td__host->fail(TD_EBACKEND, "%s failed: %s", #call, \
                                  cublasLtGetStatusString(td_b_));     \
    } while (0)

/* Returns the host's td_status naming the call, cuDNN's status and its last message when a
 * cuDNN call fails. */
#define TD__CUDNN(call)                                                                    \
    do {                                                                                   \
        cudnnStatus_t td_d_ = (call);                                                      \
        if (td_d_ != CUDNN_STATUS_SUCCESS) {                                               \
            char td_m_[256] = "";                                                          \
            cudnnGetLastErrorString(td_m_, sizeof td_m_);                                  \
            return td__host->fail(TD_EBACKEND, "%s failed: %s%s%s%s", #call,               \
                                  cudnnGetErrorString(td_d_), td_m_[0] ? " (" : "", td_m_, \
                                  td_m_[0] ? ")" : "");                                    \
        }                                                                                  \
    } while (0)

/* cuDNN's name for a float dtype (f32, bf16, f16); other dtypes fail naming `what`. */
static inline td_status td__cudnn_dtype(td_dtype dt, cudnnDataType_t *out, const char *what) {
    if (dt != TD_F32 && dt != TD_BF16 && dt != TD_F16)
        return td__host->fail(TD_EDTYPE, "%s: dtype %d on a GPU (f32, bf16 or f16)", what, (int)dt);
    *out = dt == TD_BF16 ? CUDNN_DATA_BFLOAT16 : dt == TD_F16 ? CUDNN_DATA_HALF : CUDNN_DATA_FLOAT;
    return TD_OK;
}

/* Creates *d describing t, (N, C, H, W) in t's dtype, as plain NCHW. */
static inline td_status td__cudnn_nchw(cudnnTensorDescriptor_t *d, const td_tensor *t,
                                       const char *what) {
    cudnnDataType_t dt;
    td_status s = td__cudnn_dtype(t->dtype, &dt, what);
    if (s != TD_OK) return s;
    const int64_t *n = t->shape.dim;
    TD__CUDNN(cudnnCreateTensorDescriptor(d));
    TD__CUDNN(cudnnSetTensor4dDescriptor(*d, CUDNN_TENSOR_NCHW, dt, (int)n[0], (int)n[1], (int)n[2],
                                         (int)n[3]));
    return TD_OK;
}

/* After a launch: a bad configuration fails here, naming the op. */
#define TD__LAUNCHED(what)                                                             \
    do {                                                                               \
        cudaError_t td_l_ = cudaGetLastError();                                        \
        if (td_l_ != cudaSuccess)                                                      \
            return td__host->fail(TD_EBACKEND, "%s: kernel launch failed: %s", (what), \
                                  cudaGetErrorString(td_l_));                          \
    } while (0)

/* Runs the statements after `what` with T the C++ type of float dtype `dt`; other dtypes fail
 * naming `what`. */
#define TD__FLOAT_TYPES(dt, what, ...)                                                           \
    do {                                                                                         \
        switch (dt) {                                                                            \
        case TD_F32: {                                                                           \
            typedef float T;                                                                     \
            __VA_ARGS__;                                                                         \
            break;                                                                               \
        }                                                                                        \
        case TD_BF16: {                                                                          \
            typedef __nv_bfloat16 T;                                                             \
            __VA_ARGS__;                                                                         \
            break;                                                                               \
        }                                                                                        \
        case TD_F16: {                                                                           \
            typedef __half T;                                                                    \
            __VA_ARGS__;                                                                         \
            break;                                                                               \
        }                                                                                        \
        default:                                                                                 \
            return td__host->fail(TD_EDTYPE, "%s: dtype %d on a GPU (f32, bf16 or f16)", (what), \
                                  (int)(dt));                                                    \
        }                                                                                        \
    } while (0)

/* The gradient rule: 0 writes (nothing since zeroing), 1 adds. */
static inline float td__grad_beta(const td_tensor *t) { return t->grad_zero ? 0.f : 1.f; }

static inline void td__grad_written(td_tensor *t) {
    t->grad_zero = 0;
    t->grad_scratch = 0;
}

/* The library calls nothing of libtandem's but the host table, so it counts for itself. */
static inline size_t td__numel(const td_tensor *t) {
    size_t n = 1;
    for (int i = 0; i < t->shape.ndim; i++) n *= (size_t)t->shape.dim[i];
    return n;
}

static inline size_t td__elem_size(td_dtype dt) {
    return dt == TD_F64 || dt == TD_I64   ? 8
           : dt == TD_F32 || dt == TD_I32 ? 4
           : dt == TD_U8                  ? 1
                                          : 2;
}

/* The device copy of the RNG key dropout's kernels read, and its write before each forward
 * (dropout.cu). */
td_status td__cuda_rng_key_create(td__gpu *g);
td_status td__cuda_rng_key_write(td__op_ctx *ctx);

/* y[i] = beta * y[i] + x[i] (dtype conversions both ways), on ctx's stream. */
td_status td__cuda_add_into(td__op_ctx *ctx, void *y, td_dtype yt, const void *x, td_dtype xt,
                            size_t n, float alpha, float beta, const char *what);

/* The kernels of each op on a GPU (one file per op family). */
extern const td__kernels td__cuda_linear, td__cuda_eltwise, td__cuda_add, td__cuda_scale,
    td__cuda_cast, td__cuda_reshape, td__cuda_softmax, td__cuda_nll, td__cuda_dropout,
    td__cuda_concat, td__cuda_normalize;
extern const td__kernels td__cuda_conv2d, td__cuda_pool2d, td__cuda_batch_norm;
extern const td__kernels td__cuda_embedding, td__cuda_layer_norm, td__cuda_attention;

#endif
