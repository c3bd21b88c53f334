/* Every hand-written CUDA kernel of libtandem_cuda.so run on the CPU under the emulation of
 * CUDA's execution model (src/device/cuda/emulate.cuh), against the CPU's reference ops and the
 * CPU's own kernels, on the shapes where kernels break: one element, sizes that are not
 * multiples of the block, more blocks than a grid takes (grid-stride loops), zero rows. The
 * kernels are the library's own headers, compiled here by the C++ compiler; the CUDA libraries'
 * calls (cuBLASLt, cuDNN, NCCL) are not emulated and are tested on a GPU only
 * (test_cuda_graph, test_cuda_comm). First, cases that show the emulation itself holds to
 * CUDA's rules and stops at what a GPU would refuse. Each case runs in a child process, so a
 * kernel the emulation stops fails its case only. */
#include <sys/wait.h>
#include <vector>

extern "C" {
#include "tandem/optim.h"

#include "comm/comm_impl.h"
#include "core/core_impl.h"
#include "ops/ref.h"
}
#include "comm/cuda/ipc.cuh"
#include "device/cuda/channels.cuh"
#include "device/cuda/elements.cuh"
#include "optim/cuda/multi_tensor.cuh"
#include "test.h"

/* ---- running cases ---- */

/* Runs fn in a child; the child's exit says whether the case passed. */
static void run_isolated(const char *name, void (*fn)(void)) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        test_case_failed = test_case_skipped = 0;
        fn();
        fflush(stdout);
        _exit(test_case_failed ? 1 : test_case_skipped ? 2 : 0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 2) {
        test_skipped++;
        printf("skip %s\n", name);
        return;
    }
    int ok = pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && WIFEXITED(status) && WEXITSTATUS(status) == 3)
        fprintf(stderr, "%s: stopped by the emulation (above)\n", name);
    else if (!ok && WIFSIGNALED(status))
        fprintf(stderr, "%s: killed by signal %d\n", name, WTERMSIG(status));
    if (ok)
        test_passed++;
    else
        test_failed++;
    printf("%s %s\n", ok ? "ok  " : "FAIL", name);
    fflush(stdout);
}

#define RUN_ISOLATED(fn) run_isolated(#fn, fn)

/* Runs fn in a child that must be stopped by the emulation (or, in the sanitizers' build, by
 * AddressSanitizer where `asan` says so) with `expected` in what it prints. */
static void expect_stopped(void (*fn)(void), const char *expected, const char *asan) {
    int fds[2];
    CHECK(pipe(fds) == 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        fn();
        _exit(0);
    }
    close(fds[1]);
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, (size_t)n);
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    const char *want = TD__EMU_ASAN && asan ? asan : expected;
    int stopped = WIFEXITED(status) && WEXITSTATUS(status) != 0;
    if (!stopped || out.find(want) == std::string::npos)
        TEST_FAIL_AT("expected the emulation to stop with '%s'; exit status %d, it printed:\n%s",
                     want, status, out.c_str());
}

/* ---- data ---- */

static td_rng rng;

/* n floats uniform in [lo, hi) in a guarded buffer. */
static float *uniform(size_t n, const char *name, float lo = -1.f, float hi = 1.f) {
    float *p = td__emu::alloc<float>(n, name);
    td_rng_fill_uniform(&rng, p, n, lo, hi);
    return p;
}

/* The largest |a - b| / (1 + |b|) over n elements; NaN anywhere counts as infinite. */
[[maybe_unused]] static double max_rel(const float *a, const float *b, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]) / (1 + fabs((double)b[i]));
        if (!(d <= worst)) worst = std::isnan(d) ? INFINITY : d;
    }
    return worst;
}

#define CHECK_CLOSE(a, b, n, tol)                                                                 \
    do {                                                                                          \
        double test_d_ = max_rel(a, b, n);                                                        \
        if (!(test_d_ <= (tol)))                                                                  \
            TEST_FAIL_AT("%s vs %s over %zu elements: off by %.3g (tol %g)", #a, #b, (size_t)(n), \
                         test_d_, (double)(tol));                                                 \
    } while (0)

/* ---- the emulation's own rules ---- */

/* A barrier orders shared memory: each thread reads its neighbour's value. */
static __global__ void rotate_kernel(int *out) {
    __shared__ int s[1024];
    unsigned t = threadIdx.x + threadIdx.y * blockDim.x, n = blockDim.x * blockDim.y;
    s[t] = (int)(t * 7 + blockIdx.x);
    __syncthreads();
    out[blockIdx.x * n + t] = s[(t + 1) % n];
}

static void emulation_barrier(void) {
    for (dim3 block : {dim3(1), dim3(33), dim3(32, 32)}) {
        unsigned n = block.x * block.y;
        int *out = td__emu::alloc<int>(3 * n, "out");
        td__emu::launch("rotate_kernel", rotate_kernel, dim3(3), block, 0, out);
        for (unsigned b = 0; b < 3; b++)
            for (unsigned t = 0; t < n; t++) CHECK_EQ(out[b * n + t], ((t + 1) % n) * 7 + b);
        td__emu::release(out);
    }
}

/* Warp primitives: a sum by __shfl_down_sync, a butterfly by __shfl_xor_sync, an inclusive scan
 * by __shfl_up_sync in segments of 16, __shfl_sync from lane 3, and votes. */
static __global__ void warp_kernel(int *out) {
    int lane = (int)threadIdx.x % 32, v = (int)threadIdx.x + 1;
    int sum = v;
    for (int d = 16; d > 0; d /= 2) sum += __shfl_down_sync(0xffffffffu, sum, d);
    int all = v;
    for (int m = 1; m < 32; m *= 2) all += __shfl_xor_sync(0xffffffffu, all, m);
    int scan = v;
    for (int d = 1; d < 16; d *= 2) {
        int o = __shfl_up_sync(0xffffffffu, scan, d, 16);
        if (lane % 16 >= d) scan += o;
    }
    unsigned odd = __ballot_sync(0xffffffffu, v & 1);
    int any = __any_sync(0xffffffffu, v == 40), every = __all_sync(0xffffffffu, v > 0);
    double from3 = __shfl_sync(0xffffffffu, (double)v / 2, 3);
    __syncwarp();
    int *o = out + threadIdx.x * 7;
    o[0] = lane == 0 ? sum : 0;
    o[1] = all;
    o[2] = scan;
    o[3] = (int)odd;
    o[4] = any;
    o[5] = every;
    o[6] = (int)(from3 * 2);
}

static void emulation_warps(void) {
    int *out = td__emu::alloc<int>(64 * 7, "out");
    td__emu::launch("warp_kernel", warp_kernel, dim3(1), dim3(64), 0, out);
    for (int t = 0; t < 64; t++) {
        int w = t / 32 * 32, lane = t % 32, seg = t / 16 * 16;
        int total = 0, scan = 0;
        for (int l = 0; l < 32; l++) total += w + l + 1;
        for (int l = seg; l <= t; l++) scan += l + 1;
        const int *o = out + t * 7;
        if (lane == 0) CHECK_EQ(o[0], total);
        CHECK_EQ(o[1], total);
        CHECK_EQ(o[2], scan);
        CHECK_EQ((unsigned)o[3], 0x55555555u); /* v = t + 1 is odd on even lanes */
        CHECK_EQ(o[4], t / 32 == 1);
        CHECK_EQ(o[5], 1);
        CHECK_EQ(o[6], w + 4);
    }
    td__emu::release(out);
}

/* Threads of a block run in another order from a seed: a kernel that reads a neighbour's
 * shared value without a barrier (a race) then reads what index order never shows it. */
static __global__ void racy_kernel(int *out) {
    __shared__ int s[256];
    s[threadIdx.x] = 1;
    out[threadIdx.x] = s[(threadIdx.x + 1) % 256]; /* no __syncthreads(): a race */
    __syncthreads();
    s[threadIdx.x] = 0;
}

static void emulation_random_order(void) {
    int *out = td__emu::alloc<int>(256, "out");
    td__emu::state().shuffle = 0;
    td__emu::launch("racy_kernel", racy_kernel, dim3(2), dim3(256), 0, out);
    int ones = 0;
    for (int t = 0; t < 256; t++) ones += out[t];
    CHECK_EQ(ones, 1); /* in index order only the last thread sees its neighbour's write */
    td__emu::state().shuffle = 1;
    td__emu::state().rng.seed(7);
    td__emu::launch("racy_kernel", racy_kernel, dim3(2), dim3(256), 0, out);
    ones = 0;
    for (int t = 0; t < 256; t++) ones += out[t];
    CHECK(ones > 1 && ones < 256);
    td__emu::release(out);
}

static __global__ void copy_kernel(float *dst, const float *src, int n) {
    int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i <= n) dst[i] = src[i]; /* one too far */
}

static void read_past_end(void) {
    float *src = uniform(100, "src"), *dst = td__emu::alloc<float>(101, "dst");
    td__emu::launch("copy_kernel", copy_kernel, dim3(1), dim3(128), 0, dst, src, 100);
}

static void write_past_end(void) {
    float *src = uniform(101, "src"), *dst = td__emu::alloc<float>(100, "dst");
    td__emu::launch("copy_kernel", copy_kernel, dim3(1), dim3(128), 0, dst, src, 100);
}

static __global__ void before_kernel(float *dst) { dst[(int)threadIdx.x - 1] = 0.f; }

static void write_before_start(void) {
    float *dst = td__emu::alloc<float>(10, "dst");
    td__emu::launch("before_kernel", before_kernel, dim3(1), dim3(10), 0, dst);
}

static __global__ void early_exit_kernel(float *x) {
    __shared__ float s[64];
    if (threadIdx.x == 5) return;
    s[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    x[threadIdx.x] = s[63 - threadIdx.x];
}

static void barrier_not_reached(void) {
    float *x = uniform(64, "x");
    td__emu::launch("early_exit_kernel", early_exit_kernel, dim3(1), dim3(64), 0, x);
}

static __global__ void two_barriers_kernel(float *x) {
    if (threadIdx.x < 32)
        __syncthreads();
    else
        __syncthreads();
    x[threadIdx.x] = 0.f;
}

static void different_barriers(void) {
    float *x = uniform(64, "x");
    td__emu::launch("two_barriers_kernel", two_barriers_kernel, dim3(1), dim3(64), 0, x);
}

static __global__ void half_warp_kernel(int *x) {
    if (threadIdx.x < 16) x[threadIdx.x] = __shfl_sync(0xffffffffu, x[threadIdx.x], 0);
}

static void warp_lane_missing(void) {
    int *x = td__emu::alloc<int>(32, "x");
    td__emu::launch("half_warp_kernel", half_warp_kernel, dim3(1), dim3(32), 0, x);
}

static __global__ void nothing_kernel(float *x) {
    TD__DYNAMIC_SHARED(float, sm);
    sm[threadIdx.x] = 1.f;
    x[0] = sm[0];
}

static void too_many_threads(void) {
    float *x = td__emu::alloc<float>(1, "x");
    td__emu::launch("nothing_kernel", nothing_kernel, dim3(1), dim3(1025), 4100, x);
}

static void empty_grid(void) {
    float *x = td__emu::alloc<float>(1, "x");
    td__emu::launch("nothing_kernel", nothing_kernel, dim3(0), dim3(32), 128, x);
}

static void too_much_shared(void) {
    float *x = td__emu::alloc<float>(1, "x");
    td__emu::launch("nothing_kernel", nothing_kernel, dim3(1), dim3(32), (48 << 10) + 4, x);
}

/* What a GPU refuses or leaves undefined stops the emulation, naming it. */
static void emulation_stops(void) {
    expect_stopped(read_past_end, "reads byte 400 of buffer 'src', 0 past its end",
                   "heap-buffer-overflow");
    expect_stopped(write_past_end, "writes byte 400 of buffer 'dst', 0 past its end",
                   "heap-buffer-overflow");
    expect_stopped(write_before_start, "before_kernel wrote byte -4 of buffer 'dst'",
                   "heap-buffer-overflow");
    expect_stopped(barrier_not_reached, "thread (5, 0, 0): __syncthreads() at", nullptr);
    expect_stopped(different_barriers, "waits at __syncthreads() at", nullptr);
    expect_stopped(warp_lane_missing, "waits for lane 16 (mask 0xffffffff), which has exited",
                   nullptr);
    expect_stopped(too_many_threads, "a block of (1025, 1, 1) threads", nullptr);
    expect_stopped(empty_grid, "a grid of (0, 1, 1) blocks", nullptr);
    expect_stopped(too_much_shared, "49156 bytes of dynamic shared memory", nullptr);
}

/* A kernel opted in to more dynamic shared memory gets it, and each block finds it filled
 * with 0xff bytes. */
static __global__ void big_shared_kernel(unsigned *out, int words) {
    TD__DYNAMIC_SHARED(unsigned, sm);
    if (threadIdx.x == 0) out[blockIdx.x] = sm[words - 1];
    __syncthreads();
    for (int i = (int)threadIdx.x; i < words; i += (int)blockDim.x) sm[i] = 0;
}

static void emulation_opt_in(void) {
    int words = 50000;
    unsigned *out = td__emu::alloc<unsigned>(2, "out");
    cudaFuncSetAttribute(big_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, words * 4);
    td__emu::launch("big_shared_kernel", big_shared_kernel, dim3(2), dim3(256), (size_t)words * 4,
                    out, words);
    CHECK_EQ(out[0], 0xffffffffu);
    CHECK_EQ(out[1], 0xffffffffu);
}

/* ---- the device layer's kernels (src/device/cuda) ---- */

/* Conversions between every pair of dtypes, as the host converts (floats to nearest even
 * through f32, integers through int64), over a grid of more than 65535 blocks (the grid-stride
 * loop's second lap) and one element. */
static void device_convert(void) {
    const td_dtype all[] = {TD_F32, TD_F64, TD_BF16, TD_F16, TD_I32, TD_I64, TD_U8};
    for (size_t n : {(size_t)1, (size_t)1000, (size_t)65535 * 256 + 3}) {
        std::vector<double> v(n);
        for (size_t i = 0; i < n; i++) v[i] = (double)(i % 509) - 200.25 + (i % 3) * 1e-3;
        for (td_dtype st : all)
            for (td_dtype dt : all) {
                if (n > 1000 && !(st == TD_F32 && dt == TD_BF16)) continue; /* one long pass */
                size_t ss = td_dtype_size(st), ds = td_dtype_size(dt);
                char *src = td__emu::alloc<char>(n * ss, "src");
                char *dst = td__emu::alloc<char>(n * ds, "dst");
                for (size_t i = 0; i < n; i++) td_st_dt(src, st, i, v[i]);
                td__launch_convert(nullptr, dst, dt, src, st, n);
                size_t bad = 0;
                for (size_t i = 0; i < n; i++) {
                    double x = td_ld_dt(src, st, i), want;
                    if (dt == TD_F32 || dt == TD_BF16 || dt == TD_F16)
                        want = dt == TD_F32    ? (double)(float)x
                               : dt == TD_BF16 ? td__bf16_to_f32(td__f32_to_bf16((float)x))
                                               : td__f16_to_f32(td__f32_to_f16((float)x));
                    else if (dt == TD_F64)
                        want = x;
                    else
                        want = dt == TD_I32   ? (double)(int32_t)(int64_t)x
                               : dt == TD_I64 ? (double)(int64_t)x
                                              : (double)(uint8_t)(int64_t)x;
                    if (td_ld_dt(dst, dt, i) != want) bad++;
                }
                if (bad) TEST_FAIL_AT("convert %d -> %d, %zu elements: %zu wrong", st, dt, n, bad);
                td__emu::release(src);
                td__emu::release(dst);
            }
    }
}

static void device_fill(void) {
    for (int size : {2, 4})
        for (size_t n : {(size_t)1, (size_t)257, size == 2 ? (size_t)65535 * 256 + 1 : 1000}) {
            char *p = td__emu::alloc<char>(n * (size_t)size, "p");
            td__launch_fill(nullptr, p, 0xabcd1234u, size, n);
            size_t bad = 0;
            for (size_t i = 0; i < n; i++)
                bad += size == 2 ? ((uint16_t *)p)[i] != 0x1234 : ((uint32_t *)p)[i] != 0xabcd1234u;
            CHECK_EQ(bad, 0);
            td__emu::release(p);
        }
}

/* SyncBatchNorm's channel sums and affine map against sums in double in plain loops. */
static void device_channels(void) {
    struct {
        int64_t N, C, S;
    } shapes[] = {{1, 1, 1}, {3, 5, 7}, {2, 3, 300}, {0, 4, 9}, {4, 2, 0}, {1, 70000, 1}};
    for (auto sh : shapes) {
        int64_t N = sh.N, C = sh.C, S = sh.S, total = N * C * S;
        float *x = uniform((size_t)total, "x"), *dy = uniform((size_t)total, "dy");
        float *mean = uniform((size_t)C, "mean"), *coef = uniform((size_t)(4 * C), "coef");
        double *s = td__emu::alloc<double>((size_t)(2 * C), "sums");
        for (int with_dy = 0; with_dy < 2; with_dy++) {
            td__launch_channel_sums(nullptr, x, with_dy ? dy : nullptr, with_dy ? mean : nullptr, N,
                                    C, S, s);
            for (int64_t c = 0; c < C; c++) {
                double a = 0, b = 0;
                for (int64_t n = 0; n < N; n++)
                    for (int64_t j = 0; j < S; j++) {
                        double v = x[(n * C + c) * S + j], g = dy[(n * C + c) * S + j];
                        a += with_dy ? g : v;
                        b += with_dy ? g * (v - mean[c]) : v * v;
                    }
                CHECK_NEAR(s[c], a, 1e-12 * (1 + fabs(a)) * (double)(N * S + 1));
                CHECK_NEAR(s[C + c], b, 1e-12 * (1 + fabs(b)) * (double)(N * S + 1));
            }
        }
        float *out = td__emu::alloc<float>((size_t)total, "out");
        for (int extra = 0; extra < 2; extra++) {
            td__launch_channel_affine(nullptr, out, x, coef, extra ? dy : nullptr, N, C, S);
            size_t bad = 0;
            for (int64_t i = 0; i < total; i++) {
                int64_t c = (i / S) % C;
                float v = (x[i] - coef[c]) * coef[C + c] + coef[2 * C + c];
                if (extra) v = v + coef[3 * C + c] * dy[i];
                bad += out[i] != v;
            }
            CHECK_EQ(bad, 0);
        }
    }
}

/* ---- the optimizers' multi-tensor kernels (src/optim/cuda) ---- */

/* One parameter of a multi-tensor case: its values on the host for the CPU optimizer, and in
 * guarded buffers for the kernels. */
typedef struct {
    const char *name;
    size_t count;
    td_dtype dtype, master; /* master: TD_F32 (O2 master weights) or the dtype (O3) */
    int has_grad;
} mt_spec;

static const mt_spec mt_specs[] = {
    {"one", 1, TD_F32, TD_F32, 1},      {"chunks", 2 * TD__MT_CHUNK + 5, TD_F32, TD_F32, 1},
    {"o2", 700, TD_BF16, TD_F32, 1},    {"o3", 300, TD_F16, TD_F16, 1},
    {"no_grad", 50, TD_F32, TD_F32, 0}, {"empty", 0, TD_F32, TD_F32, 1},
    {"o2_half", 33, TD_F16, TD_F32, 1},
};
#define MT_N (sizeof mt_specs / sizeof *mt_specs)

/* The step's scalars, rounded from double as the CPU's optimizer rounds them. */
static td__mt_args mt_args(int adamw, const td_sgd_params *sgd, const td_adamw_params *aw) {
    td__mt_args a = {};
    a.op = adamw ? TD__MT_ADAMW : TD__MT_SGD;
    if (!adamw) {
        a.neg_lr = (float)(-sgd->lr);
        a.weight_decay = (float)sgd->weight_decay;
        a.momentum = (float)sgd->momentum;
        a.keep = (float)(1.0 - sgd->dampening);
        a.nesterov = sgd->nesterov;
    } else {
        a.decay = (float)(1.0 - aw->lr * aw->weight_decay);
        a.beta1 = (float)aw->beta1;
        a.beta2 = (float)aw->beta2;
        a.one_b1 = (float)(1.0 - aw->beta1);
        a.one_b2 = (float)(1.0 - aw->beta2);
        a.eps = (float)aw->eps;
    }
    return a;
}

/* Runs the multi-tensor launch over list[0..n) as the library does: planned, the list copied
 * into a guarded buffer, the scratch sized for the chunks. */
static double mt_run(const td__mt_args *a, td__mt_tensor *list, size_t n) {
    uint64_t chunks;
    size_t kept = td__mt_plan(a, list, n, &chunks);
    if (!kept) return 0;
    td__mt_tensor *dev = td__emu::alloc<td__mt_tensor>(kept, "list");
    memcpy((void *)dev, list, kept * sizeof *list);
    double *partials = td__emu::alloc<double>(chunks, "partials");
    int *flag = td__emu::alloc<int>(1, "flag");
    *flag = 0;
    td__launch_multi_tensor(nullptr, a, dev, kept, chunks, partials, flag);
    double r = a->op == TD__MT_SQUARES ? partials[0] : a->op == TD__MT_UNSCALE ? *flag : 0;
    td__emu::release(dev);
    td__emu::release(partials);
    td__emu::release(flag);
    return r;
}

/* Three steps of SGD (with momentum, dampening, weight decay, Nesterov or not) and of AdamW on
 * f32 parameters and on bf16 and f16 ones with f32 masters (O2) or in place (O3), against the
 * CPU's optimizer: the same bits in every parameter and every state buffer. */
static void optim_steps(int adamw, int nesterov) {
    td_param cpu[MT_N], dev[MT_N];
    void *grads[MT_N];
    for (size_t i = 0; i < MT_N; i++) {
        const mt_spec *m = &mt_specs[i];
        size_t es = td_dtype_size(m->dtype), c = m->count;
        td_param p = {};
        p.name = m->name;
        p.count = c;
        p.dtype = m->dtype;
        p.master_dtype = m->master;
        p.ndim = 1;
        p.shape[0] = (int64_t)c;
        cpu[i] = dev[i] = p;
        cpu[i].data = malloc(c * es + 1);
        cpu[i].grad = m->has_grad ? malloc(c * es + 1) : NULL;
        dev[i].data = td__emu::alloc<char>(c * es, m->name);
        grads[i] = m->has_grad ? td__emu::alloc<char>(c * es, "grad") : NULL;
        for (size_t j = 0; j < c; j++) td__store(cpu[i].data, m->dtype, j, td_rng_normal(&rng));
        memcpy(dev[i].data, cpu[i].data, c * es);
    }
    td_sgd_params sgd = td_sgd_default_params();
    sgd.lr = 0.05;
    sgd.momentum = 0.9;
    sgd.dampening = nesterov ? 0 : 0.1;
    sgd.weight_decay = 1e-2;
    sgd.nesterov = nesterov;
    td_adamw_params aw = td_adamw_default_params();
    aw.lr = 0.01;
    td_optim *o;
    CHECK_OK(adamw ? td_optim_create_adamw(&o, cpu, MT_N, &aw)
                   : td_optim_create_sgd(&o, cpu, MT_N, &sgd));
    /* The kernels' state: master weights from the parameters, zeroed buffers. */
    td__mt_tensor list[MT_N];
    for (size_t i = 0; i < MT_N; i++) {
        const mt_spec *m = &mt_specs[i];
        int low = m->dtype != TD_F32, o2 = low && m->master == TD_F32;
        td_dtype sd = low && !o2 ? m->dtype : TD_F32;
        size_t c = m->count, ss = td_dtype_size(sd);
        list[i] = td__mt_tensor{};
        list[i].param = dev[i].data;
        list[i].grad = grads[i];
        list[i].buf1 = td__emu::alloc<char>(c * ss, "buf1");
        list[i].buf2 = adamw ? td__emu::alloc<char>(c * ss, "buf2") : nullptr;
        memset(list[i].buf1, 0, c * ss);
        if (list[i].buf2) memset(list[i].buf2, 0, c * ss);
        list[i].master = o2 ? td__emu::alloc<float>(c, "master") : nullptr;
        list[i].count = c;
        list[i].dtype = m->dtype;
        list[i].state_dtype = sd;
        if (o2) {
            td__mt_args init = {};
            init.op = TD__MT_MASTER_INIT;
            td__mt_tensor t = list[i];
            mt_run(&init, &t, 1);
        }
    }
    for (int step = 1; step <= 3; step++) {
        for (size_t i = 0; i < MT_N; i++) {
            const mt_spec *m = &mt_specs[i];
            if (!m->has_grad) continue;
            for (size_t j = 0; j < m->count; j++)
                td__store(cpu[i].grad, m->dtype, j, td_rng_normal(&rng));
            memcpy(grads[i], cpu[i].grad, m->count * td_dtype_size(m->dtype));
        }
        CHECK_OK(td_optim_step(o));
        td__mt_args a = mt_args(adamw, &sgd, &aw);
        td__mt_tensor l[MT_N];
        for (size_t i = 0; i < MT_N; i++) {
            l[i] = list[i];
            l[i].first = step == 1;
            double bc1 = 1.0 - pow(aw.beta1, step), bc2 = 1.0 - pow(aw.beta2, step);
            l[i].neg_step = (float)(-(aw.lr / bc1));
            l[i].bc2_sqrt = (float)sqrt(bc2);
        }
        mt_run(&a, l, MT_N);
    }
    for (size_t i = 0; i < MT_N; i++) {
        size_t bytes = mt_specs[i].count * td_dtype_size(mt_specs[i].dtype);
        if (memcmp(cpu[i].data, dev[i].data, bytes))
            TEST_FAIL_AT("%s %s: parameter '%s' differs from the CPU's", adamw ? "AdamW" : "SGD",
                         nesterov ? "(Nesterov)" : "", mt_specs[i].name);
    }
    /* The CPU's state tensors, by name, against the kernels' buffers. */
    td_param *state;
    size_t ns;
    td_optim_state(o, &state, &ns);
    size_t compared = 0;
    for (size_t k = 0; k < ns; k++)
        for (size_t i = 0; i < MT_N; i++) {
            std::string base = std::string("optim.") + mt_specs[i].name + ".";
            const void *mine = nullptr;
            if (state[k].name == base + (adamw ? "exp_avg" : "momentum_buffer"))
                mine = list[i].buf1;
            if (state[k].name == base + "exp_avg_sq") mine = list[i].buf2;
            if (!mine || !mt_specs[i].has_grad || !state[k].count) continue;
            compared++;
            if (memcmp(state[k].data, mine, state[k].count * td_dtype_size(state[k].dtype)))
                TEST_FAIL_AT("state '%s' differs from the CPU's", state[k].name);
        }
    CHECK(compared >= (adamw ? 8u : 4u));
    td_optim_destroy(o);
}

static void optim_sgd(void) { optim_steps(0, 0); }
static void optim_sgd_nesterov(void) { optim_steps(0, 1); }
static void optim_adamw(void) { optim_steps(1, 0); }

/* The squared norm of every gradient (clipping), scaling, and unscaling with its overflow flag
 * (the loss scaler). */
static void optim_norm_scale(void) {
    td__mt_tensor list[MT_N];
    double want = 0;
    for (size_t i = 0; i < MT_N; i++) {
        const mt_spec *m = &mt_specs[i];
        list[i] = td__mt_tensor{};
        list[i].count = m->count;
        list[i].dtype = m->dtype;
        list[i].grad =
            m->has_grad ? td__emu::alloc<char>(m->count * td_dtype_size(m->dtype), "g") : nullptr;
        for (size_t j = 0; m->has_grad && j < m->count; j++) {
            td__store(list[i].grad, m->dtype, j, td_rng_normal(&rng));
            double v = td__load(list[i].grad, m->dtype, j);
            want += v * v;
        }
    }
    td__mt_args a = {};
    a.op = TD__MT_SQUARES;
    td__mt_tensor l[MT_N];
    memcpy(l, list, sizeof l);
    CHECK_NEAR(mt_run(&a, l, MT_N), want, 1e-12 * want);
    a.op = TD__MT_SCALE;
    a.factor = 0.375f;
    memcpy(l, list, sizeof l);
    std::vector<float> before(mt_specs[1].count);
    for (size_t j = 0; j < before.size(); j++) before[j] = td__load(list[1].grad, TD_F32, j);
    mt_run(&a, l, MT_N);
    for (size_t j = 0; j < before.size(); j++)
        CHECK_EQ(td__f32_bits(((float *)list[1].grad)[j]), td__f32_bits(before[j] * 0.375f));
    a.op = TD__MT_UNSCALE;
    a.factor = 0.5f;
    memcpy(l, list, sizeof l);
    CHECK_EQ(mt_run(&a, l, MT_N), 0);
    td__store(list[3].grad, TD_F16, 299, INFINITY); /* an overflow in the scaled backward */
    memcpy(l, list, sizeof l);
    CHECK_EQ(mt_run(&a, l, MT_N), 1);
}

/* ---- the IPC path's reductions (src/comm/cuda) ---- */

/* The reduction over 1 to 8 ranks' buffers at an offset, every dtype and op, against the
 * host's td__reduce (the same fold order, so the same bits), integers at their extremes (sums
 * and products wrap). */
static void ipc_reduce(void) {
    const td_dtype all[] = {TD_F32, TD_F64, TD_BF16, TD_F16, TD_I32, TD_I64, TD_U8};
    const td_reduce_op ops[] = {TD_OP_SUM, TD_OP_PROD, TD_OP_MIN, TD_OP_MAX, TD_OP_AVG};
    for (int ranks : {1, 2, 3, 8})
        for (size_t n : {(size_t)1, (size_t)1000})
            for (td_dtype dt : all)
                for (td_reduce_op op : ops) {
                    size_t es = td_dtype_size(dt), at = 5;
                    td__ipc_peers peers;
                    const void *src[TD__IPC_MAX_RANKS];
                    for (int r = 0; r < ranks; r++) {
                        char *b = td__emu::alloc<char>((at + n) * es, "staging");
                        for (size_t i = 0; i < at + n; i++) {
                            uint32_t u = td_rng_u32(&rng);
                            if (dt == TD_I64)
                                ((int64_t *)b)[i] = i % 7 == 0 ? INT64_MAX - (int64_t)(u % 3)
                                                               : (int64_t)u * 4099 - (1ll << 40);
                            else if (dt == TD_I32 || dt == TD_U8)
                                td_st_dt(b, dt, i,
                                         i % 7 == 0 ? 2147483647.0 - u % 3
                                                    : (double)(u % 1000) - 300);
                            else
                                td_st_dt(b, dt, i, td_rng_normal(&rng) * 3);
                        }
                        peers.p[r] = b;
                        src[r] = b + at * es;
                    }
                    char *got = td__emu::alloc<char>(n * es, "dst");
                    std::vector<char> want(n * es);
                    CHECK_EQ(td__launch_ipc_reduce(nullptr, got, peers, ranks, at, n, dt, op), 0);
                    td__reduce(want.data(), src, ranks, n, dt, op, ranks);
                    if (memcmp(got, want.data(), n * es))
                        TEST_FAIL_AT("%d ranks, %zu elements of dtype %d, op %d: not the host's",
                                     ranks, n, dt, op);
                    td__emu::release(got);
                    for (int r = 0; r < ranks; r++) td__emu::release((void *)peers.p[r]);
                }
}

int main(void) {
    td_rng_init(&rng, 1234);
    RUN_ISOLATED(emulation_barrier);
    RUN_ISOLATED(emulation_warps);
    RUN_ISOLATED(emulation_random_order);
    RUN_ISOLATED(emulation_stops);
    RUN_ISOLATED(emulation_opt_in);
    RUN_ISOLATED(device_convert);
    RUN_ISOLATED(device_fill);
    RUN_ISOLATED(device_channels);
    RUN_ISOLATED(optim_sgd);
    RUN_ISOLATED(optim_sgd_nesterov);
    RUN_ISOLATED(optim_adamw);
    RUN_ISOLATED(optim_norm_scale);
    RUN_ISOLATED(ipc_reduce);
    TEST_END();
}
