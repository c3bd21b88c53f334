/* tandem base layer: status codes, error messages, logging, dtypes, arena, clock, RNG.
 *
 * Everything else in tandem depends on this header; it depends on nothing but libc.
 * Shapes live here too: process groups, tensors and checkpoints all speak of them.
 * It does not allocate behind the caller's back except where a function says so.
 *
 * How the options structs keep the ABI. Every td_*_params struct ends in `reserved`, zero bytes
 * that options added later take their room from, so its size never changes while the library's
 * soname (libtandem.so.0) stays: a program built against an older header passes and receives
 * structs of the size the library expects. Start from td_*_default_params(), which fills every
 * byte (options newer than the program's header get their defaults there); a struct filled by
 * hand must be zeroed first (`= {0}` or designated initializers). tests/test_abi.c pins each
 * size. */
#ifndef TANDEM_CORE_H
#define TANDEM_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes: 0 is success, every error is negative (libuv style). */
#define TD_STATUS_MAP(X)                                         \
    X(OK, 0, "success")                                          \
    X(EINVAL, -1, "invalid argument")                            \
    X(ENOMEM, -2, "out of memory")                               \
    X(EIO, -3, "input/output error")                             \
    X(EFORMAT, -4, "malformed or truncated data")                \
    X(ESHAPE, -5, "shape mismatch")                              \
    X(EDTYPE, -6, "unsupported dtype")                           \
    X(ETIMEOUT, -7, "timed out")                                 \
    X(EPEER, -8, "peer failed or disconnected")                  \
    X(EMISMATCH, -9, "ranks called different collectives")       \
    X(ESTATE, -10, "operation not allowed in the current state") \
    X(EBACKEND, -11, "backend library error")                    \
    X(EUNSUPPORTED, -12, "not supported")                        \
    X(ENOTFOUND, -13, "not found")                               \
    X(EAUTH, -14, "authentication failed")                       \
    X(EUNUSED, -15, "parameters received no gradient")

typedef enum {
#define TD_STATUS_ENUM(name, value, text) TD_##name = value,
    TD_STATUS_MAP(TD_STATUS_ENUM)
#undef TD_STATUS_ENUM
} td_status;

/* Short fixed description of a status code ("timed out"). */
const char *td_status_string(td_status status);

/* The detailed message of the last error returned on this thread (names the file, rank,
 * parameter, expected vs got). Valid until the next failing tandem call on the thread. */
const char *td_last_error(void);

/* Log levels, most severe first. */
typedef enum { TD_LOG_ERROR = 0, TD_LOG_WARN = 1, TD_LOG_INFO = 2, TD_LOG_DEBUG = 3 } td_log_level;

/* A log sink; the library is silent until one is installed. */
typedef void (*td_log_fn)(td_log_level level, const char *message, void *ctx);

/* Installs the process-wide log sink and the most verbose level passed to it. */
void td_log_set_callback(td_log_fn fn, void *ctx, td_log_level max_level);

/* A ready-made sink that writes "[tandem LEVEL] message" lines to stderr. */
void td_log_stderr(td_log_level level, const char *message, void *ctx);

/* Element types shared by tensors and collectives. */
typedef enum {
    TD_F32 = 0,
    TD_F64 = 1,
    TD_BF16 = 2,
    TD_F16 = 3,
    TD_I32 = 4,
    TD_I64 = 5,
    TD_U8 = 6,
    TD_DTYPE_COUNT
} td_dtype;

/* Bytes per element, or 0 for an invalid dtype. */
size_t td_dtype_size(td_dtype dtype);

/* Lower-case name ("f32"), or "invalid". */
const char *td_dtype_name(td_dtype dtype);

/* bf16 and f16 conversions (round to nearest even). */
uint16_t td_f32_to_bf16(float x);
float td_bf16_to_f32(uint16_t x);
uint16_t td_f32_to_f16(float x);
float td_f16_to_f32(uint16_t x);

/* Where memory lives and kernels run: the CPU, or a CUDA GPU numbered within
 * CUDA_VISIBLE_DEVICES. A value type like td_dtype; tandem/device.h has what acts on it. */
typedef enum { TD_DEVICE_CPU = 0, TD_DEVICE_CUDA = 1 } td_device_type;

typedef struct {
    td_device_type type;
    int index; /* 0 for the CPU */
} td_device;

/* Most dimensions a tensor or shape has. */
#define TD_MAX_DIMS 8

/* A shape descriptor: ndim sizes, outermost first (N, C, H, W). */
typedef struct {
    int ndim; /* 0..TD_MAX_DIMS; 0 is a scalar */
    int64_t dim[TD_MAX_DIMS];
} td_shape;

/* A shape from ndim sizes (ndim is clamped to 0..TD_MAX_DIMS). */
td_shape td_shape_make(int ndim, const int64_t *dims);

/* Convenience constructors for the common ranks. */
td_shape td_shape_1d(int64_t d0);
td_shape td_shape_2d(int64_t d0, int64_t d1);
td_shape td_shape_3d(int64_t d0, int64_t d1, int64_t d2);
td_shape td_shape_4d(int64_t d0, int64_t d1, int64_t d2, int64_t d3);

/* Number of elements (1 for a scalar). */
int64_t td_shape_numel(const td_shape *shape);

/* 1 when both shapes have the same rank and sizes. */
int td_shape_equal(const td_shape *a, const td_shape *b);

/* Monotonic clock in nanoseconds. */
uint64_t td_time_ns(void);

/* A bump allocator for per-graph activations: allocations live until reset or destroy. */
typedef struct td_arena td_arena;

/* Creates an arena whose blocks are at least block_bytes (0 picks 1 MiB). */
td_status td_arena_create(td_arena **out, size_t block_bytes);

/* Frees the arena and everything allocated from it. */
void td_arena_destroy(td_arena *arena);

/* 64-byte aligned memory from the arena, or NULL when out of memory. */
void *td_arena_alloc(td_arena *arena, size_t bytes);

/* Forgets every allocation but keeps the memory for reuse. */
void td_arena_reset(td_arena *arena);

/* Bytes currently handed out and the high-water mark since creation. */
size_t td_arena_used(const td_arena *arena);
size_t td_arena_peak(const td_arena *arena);

/* A counter-based RNG (Philox4x32-10): the stream is a pure function of (seed, offset),
 * so the same seed gives the same numbers on every rank and every machine, and saving
 * the two fields saves the state. */
typedef struct {
    uint64_t seed;
    uint64_t offset; /* number of 32-bit values drawn so far */
} td_rng;

/* Starts the stream of `seed` at offset 0. */
void td_rng_init(td_rng *rng, uint64_t seed);

/* Next 32 random bits. */
uint32_t td_rng_u32(td_rng *rng);

/* Uniform float in [0, 1). */
float td_rng_uniform(td_rng *rng);

/* Standard normal float (Box-Muller). */
float td_rng_normal(td_rng *rng);

/* Uniform integer in [0, n), n > 0, without modulo bias. */
uint32_t td_rng_below(td_rng *rng, uint32_t n);

/* Fills out[0..n) with uniform floats in [lo, hi). */
void td_rng_fill_uniform(td_rng *rng, float *out, size_t n, float lo, float hi);

/* The four 32-bit words of block `counter` of stream `seed`; the primitive the rest use. */
void td_philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]);

/* Block `counter` of sub-stream `stream` of `seed` (Philox's 128-bit counter is (counter,
 * stream)); stream 0 is td_philox4x32's. Deterministic training keys dropout by (step, sample)
 * this way, so a sample's masks do not depend on which rank or batch draws them. */
void td_philox4x32_stream(uint64_t seed, uint64_t stream, uint64_t counter, uint32_t out[4]);

/* SHA-256 (FIPS 180-4) of n bytes. */
void td_sha256(const void *data, size_t n, uint8_t digest[32]);

/* An incremental SHA-256 (caller-allocated): init, update with the pieces in order, final. */
typedef struct {
    uint32_t h[8];
    uint64_t bytes; /* hashed so far */
    uint8_t block[64];
} td_sha256_ctx;

/* Starts a digest. */
void td_sha256_init(td_sha256_ctx *ctx);

/* Hashes the next n bytes. */
void td_sha256_update(td_sha256_ctx *ctx, const void *data, size_t n);

/* Pads, writes the digest; ctx must be initialised again before reuse. */
void td_sha256_final(td_sha256_ctx *ctx, uint8_t digest[32]);

#ifdef __cplusplus
}
#endif
#endif
