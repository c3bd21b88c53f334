/* The emulation of CUDA's execution model (src/device/cuda/emulate.cuh) holds to CUDA's rules:
 * barriers order a block's shared memory, warp primitives exchange values as a warp in lockstep
 * does, a seed reorders threads between barriers; and it stops, naming the kernel, block and
 * thread, at what a GPU refuses or leaves undefined: a read or write out of a buffer, a
 * __syncthreads() some thread does not reach, a warp primitive missing a lane, a block or grid
 * a GPU does not take, dynamic shared memory beyond what the kernel may have. */
#include "test_emulated.h"

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
    expect_stopped(read_past_end, "reads byte 400 of buffer 'src', which has 400: past its end",
                   "heap-buffer-overflow");
    expect_stopped(write_past_end, "writes byte 400 of buffer 'dst', which has 400: past its end",
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

int main(void) {
    td_rng_init(&rng, 1234);
    RUN_ISOLATED(emulation_barrier);
    RUN_ISOLATED(emulation_warps);
    RUN_ISOLATED(emulation_random_order);
    RUN_ISOLATED(emulation_stops);
    RUN_ISOLATED(emulation_opt_in);
    TEST_END();
}
