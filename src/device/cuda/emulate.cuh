/* CUDA's execution model emulated on the CPU, so that the kernels of libtandem_cuda.so run in
 * the test suite of every machine (tests/test_kernels_emulated.cc), against the CPU's reference
 * ops. Host C++17, one header, no dependency: the kernel headers (the .cuh files of src/LAYER/cuda)
 * compile unchanged under it with g++ -DTD_CUDA_EMULATE, through device/cuda/kernel.cuh.
 *
 * A launch runs its grid one block at a time. A block's threads are fibers on the calling
 * thread: each runs until it reaches __syncthreads(), a warp primitive or its end, then the next
 * runs, so a barrier releases once every thread of the block waits at it, and a warp primitive
 * (__shfl_*_sync, __ballot_sync, __any_sync, __all_sync, __syncwarp) completes once every lane
 * its mask names has joined it, exchanging the lanes' values as a warp in lockstep does. Blocks
 * never overlap, so static __shared__ arrays are static storage, each block's in turn; dynamic
 * shared memory (TD__DYNAMIC_SHARED) is a guarded buffer, filled with 0xff bytes (NaN as f32)
 * before each block. Atomics are plain operations: fibers switch only at the points above.
 * TD_EMU_SEED=N runs a block's threads between barriers in an order drawn from seed N (index
 * order by default), to shake out races a fixed order hides.
 *
 * What a GPU would refuse, or what is undefined there, ends the program with a message naming
 * the kernel, block and thread (tests run each case in a child process, so the case fails):
 *   - a block of more than 1024 threads or beyond (1024, 1024, 64); a grid dimension of 0 or
 *     beyond (2^31 - 1, 65535, 65535);
 *   - dynamic shared memory beyond 48 KiB unless cudaFuncSetAttribute opted the kernel in, and
 *     never beyond a Hopper's 227 KiB (static shared memory is checked per kernel by the
 *     resource gate of the GPU build, scripts/cuda_resources.sh: the emulation cannot see it);
 *   - a __syncthreads() that some thread of the block does not reach (it exited, or waits at
 *     another __syncthreads()); a warp primitive whose mask leaves out the calling lane or names
 *     a lane that does not exist, exited, or waits elsewhere;
 *   - a read or write outside a buffer from td__emu::alloc. Each buffer ends at an inaccessible
 *     page, so any access past its end faults at once and is reported (buffer, offset, read or
 *     write, kernel, block, thread); the bytes before its start on its first page are a canary,
 *     checked after every launch, so a write before the start is reported naming the buffer and
 *     the kernel; a read before the start within that page goes unseen. Under AddressSanitizer
 *     (the SAN build) buffers are malloc's instead, and its redzones catch reads and writes on
 *     both sides, static shared arrays included.
 * Not installed; never part of libtandem_cuda.so. */
#ifndef TANDEM_CUDA_EMULATE_CUH
#define TANDEM_CUDA_EMULATE_CUH

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <sys/mman.h>
#include <tuple>
#include <type_traits>
#include <ucontext.h>
#include <unistd.h>
#include <utility>
#include <vector>

extern "C" {
#include "core/core_impl.h"
}

#if defined(__SANITIZE_ADDRESS__)
#define TD__EMU_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#else
#define TD__EMU_ASAN 0
#endif

/* Fibers switch with a few lines of x86-64 code (no system call: a launch switches twice a
 * thread at least), elsewhere (or with -DTD_EMU_UCONTEXT) with ucontext's swapcontext. */
#if defined(__x86_64__) && !defined(TD_EMU_UCONTEXT)
#define TD__EMU_ASM_SWITCH 1
#else
#define TD__EMU_ASM_SWITCH 0
#endif

/* ---- CUDA C++'s words ---- */

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)
#define warpSize 32

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

typedef struct td__emu_stream *cudaStream_t;

/* The 16-bit floats, as cuda_fp16.h and cuda_bf16.h define them for host code: conversions to
 * and from float (round to nearest even), no arithmetic. */
struct __half {
    unsigned short __x;
    __half() = default;
    __half(float f) : __x(td__f32_to_f16(f)) {}
    operator float() const { return td__f16_to_f32(__x); }
};

struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(td__f32_to_bf16(f)) {}
    operator float() const { return td__bf16_to_f32(__x); }
};

inline float __half2float(__half h) { return td__f16_to_f32(h.__x); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return td__bf16_to_f32(h.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }

/* The correctly rounded intrinsics: the host's IEEE operations (tests build with
 * -ffp-contract=off, so none fuses). */
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
using std::isfinite;

namespace td__emu {

/* ---- fibers ---- */

enum { READY, AT_BARRIER, AT_WARP, DONE };
enum { WARP_SYNC, SHFL, SHFL_UP, SHFL_DOWN, SHFL_XOR, BALLOT, ANY, ALL };

/* Where a switched-out stack resumes. */
struct context {
#if TD__EMU_ASM_SWITCH
    void *sp;
#else
    ucontext_t uc;
#endif
};

/* A warp primitive as one lane calls it. */
struct warp_call {
    int op;
    unsigned mask;
    uint64_t value;
    int arg, width;
};

struct fiber {
    context ctx; /* while switched out */
    char *stack;
    size_t stack_bytes;
    uint3 tid;
    unsigned linear; /* x + y Dx + z Dx Dy */
    int state;
    const char *file; /* where it waits: __syncthreads() or a warp primitive */
    int line;
    warp_call call;   /* the warp primitive it waits at */
    uint64_t result;  /* what the primitive gave it */
    void *fake_stack; /* AddressSanitizer's, while switched out */
};

/* One launch: its kernel's name, and the call that runs one thread. */
struct launch_state {
    const char *kernel;
    void (*body)(void *);
    void *args;
};

struct buffer {
    char *map; /* the mapping: [guard][pages][guard] (or malloc's block under ASan) */
    size_t map_bytes;
    char *data;
    size_t bytes;
    std::string name;
};

struct state_t {
    std::vector<fiber *> fibers;
    std::vector<unsigned> order;
    fiber *current;
    context scheduler;
    void *scheduler_fake;
    const void *scheduler_bottom;
    size_t scheduler_size;
    launch_state *launch;
    uint3 block_idx;
    dim3 block_dim, grid_dim;
    std::vector<buffer> buffers;
    char *dynamic_shared;
    size_t dynamic_shared_bytes;
    std::vector<std::pair<const void *, int>> opt_in; /* kernel, dynamic shared bytes */
    std::mt19937_64 rng;
    int shuffle;
    int configured; /* TD_EMU_SEED read */
    int handler_installed;
};

inline state_t &state() {
    static state_t s;
    return s;
}

#if TD__EMU_ASM_SWITCH
extern "C" void td__emu_swap(void **save_sp, void *load_sp);

/* Saves the callee-saved registers and the SSE and x87 control words on the current stack,
 * stores the stack pointer in *save_sp, and resumes the stack load_sp as saved. */
__asm__(".pushsection .text\n"
        ".weak td__emu_swap\n"
        ".hidden td__emu_swap\n"
        ".type td__emu_swap, @function\n"
        "td__emu_swap:\n"
        "    pushq %rbp\n"
        "    pushq %rbx\n"
        "    pushq %r12\n"
        "    pushq %r13\n"
        "    pushq %r14\n"
        "    pushq %r15\n"
        "    subq $8, %rsp\n"
        "    stmxcsr (%rsp)\n"
        "    fnstcw 4(%rsp)\n"
        "    movq %rsp, (%rdi)\n"
        "    movq %rsi, %rsp\n"
        "    ldmxcsr (%rsp)\n"
        "    fldcw 4(%rsp)\n"
        "    addq $8, %rsp\n"
        "    popq %r15\n"
        "    popq %r14\n"
        "    popq %r13\n"
        "    popq %r12\n"
        "    popq %rbx\n"
        "    popq %rbp\n"
        "    ret\n"
        ".size td__emu_swap, .-td__emu_swap\n"
        ".popsection\n");

inline void switch_to(context *from, context *to) { td__emu_swap(&from->sp, to->sp); }

/* A context whose first switch "returns" into entry, as if called (rsp = 8 mod 16). */
inline void make_context(context *c, char *stack, size_t bytes, void (*entry)()) {
    uint64_t *top = (uint64_t *)(stack + bytes);
    top[-1] = 0;
    top[-2] = (uint64_t)(uintptr_t)entry;
    for (int r = 3; r <= 8; r++) top[-r] = 0; /* rbp rbx r12 r13 r14 r15 */
    uint32_t control[2] = {0x1f80, 0x037f};   /* MXCSR and the x87 control word at reset */
    memcpy(&top[-9], control, 8);
    c->sp = &top[-9];
}
#else
inline void switch_to(context *from, context *to) { swapcontext(&from->uc, &to->uc); }

inline void make_context(context *c, char *stack, size_t bytes, void (*entry)()) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = bytes;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
}
#endif

/* Ends the program with the launch's kernel, block and thread before the message. */
[[noreturn]] inline void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

inline void where(char *out, size_t n) {
    state_t &s = state();
    if (!s.launch) {
        snprintf(out, n, "emulated CUDA");
        return;
    }
    int at = snprintf(out, n, "emulated CUDA: kernel %s, block (%u, %u, %u)", s.launch->kernel,
                      s.block_idx.x, s.block_idx.y, s.block_idx.z);
    if (s.current && at > 0 && (size_t)at < n)
        snprintf(out + at, n - (size_t)at, ", thread (%u, %u, %u)", s.current->tid.x,
                 s.current->tid.y, s.current->tid.z);
}

inline void fail(const char *fmt, ...) {
    char head[512], msg[1024];
    where(head, sizeof head);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s: %s\n", head, msg);
    fflush(stderr);
    _exit(3);
}

inline void start_switch(void **fake, const void *bottom, size_t size) {
#if TD__EMU_ASAN
    __sanitizer_start_switch_fiber(fake, bottom, size);
#else
    (void)fake, (void)bottom, (void)size;
#endif
}

inline void finish_switch(void *fake, const void **bottom, size_t *size) {
#if TD__EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, bottom, size);
#else
    (void)fake, (void)bottom, (void)size;
#endif
}

/* Back to the scheduler from the running fiber (which has set its state). */
inline void yield() {
    state_t &s = state();
    fiber *f = s.current;
    start_switch(&f->fake_stack, s.scheduler_bottom, s.scheduler_size);
    switch_to(&f->ctx, &s.scheduler);
    finish_switch(f->fake_stack, nullptr, nullptr);
}

/* Every fiber's life: run a thread of the current launch, say so, wait for the next. */
inline void fiber_main() {
    state_t &s = state();
    finish_switch(nullptr, &s.scheduler_bottom, &s.scheduler_size);
    for (;;) {
        s.launch->body(s.launch->args);
        s.current->state = DONE;
        yield();
    }
}

inline fiber *make_fiber() {
    fiber *f = new fiber();
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    f->stack_bytes = (size_t)(TD__EMU_ASAN ? 1024 : 256) << 10;
    void *m = mmap(nullptr, f->stack_bytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) fail("no memory for a fiber's stack");
    mprotect(m, page, PROT_NONE); /* a stack overflow faults */
    f->stack = (char *)m + page;
    make_context(&f->ctx, f->stack, f->stack_bytes, fiber_main);
    return f;
}

/* Runs fiber f until it waits or ends. */
inline void resume(fiber *f) {
    state_t &s = state();
    s.current = f;
    start_switch(&s.scheduler_fake, f->stack, f->stack_bytes);
    switch_to(&s.scheduler, &f->ctx);
    finish_switch(s.scheduler_fake, nullptr, nullptr);
    s.current = nullptr;
}

/* ---- warps ---- */

inline const char *waits_at(const fiber *f, char *out, size_t n) {
    if (f->state == DONE)
        snprintf(out, n, "has exited");
    else if (f->state == AT_BARRIER)
        snprintf(out, n, "waits at __syncthreads() at %s:%d", f->file, f->line);
    else
        snprintf(out, n, "waits at a warp primitive at %s:%d", f->file, f->line);
    return out;
}

/* Whether fiber o waits at the same place as f. */
inline bool same_site(const fiber *o, const fiber *f) {
    return o->line == f->line && (o->file == f->file || strcmp(o->file, f->file) == 0);
}

/* Completes the warp primitive of f's warp when every lane of its mask has joined it. */
inline void try_complete(fiber *f) {
    state_t &s = state();
    unsigned base = f->linear & ~31u;
    for (int l = 0; l < 32; l++) {
        if (!(f->call.mask >> l & 1)) continue;
        fiber *o = s.fibers[base + (unsigned)l];
        if (o->state != AT_WARP || !same_site(o, f)) return;
        if (o->call.mask != f->call.mask || o->call.op != f->call.op)
            fail("lanes %u and %d of a warp call the primitive at %s:%d with different masks "
                 "(0x%08x, 0x%08x) or kinds",
                 f->linear & 31u, l, f->file, f->line, f->call.mask, o->call.mask);
    }
    uint64_t ballot = 0;
    int any = 0, all = 1;
    for (int l = 0; l < 32; l++)
        if (f->call.mask >> l & 1) {
            int p = s.fibers[base + (unsigned)l]->call.value != 0;
            ballot |= (uint64_t)p << l;
            any |= p;
            all &= p;
        }
    for (int l = 0; l < 32; l++) {
        if (!(f->call.mask >> l & 1)) continue;
        fiber *o = s.fibers[base + (unsigned)l];
        int w = o->call.width, seg = l & ~(w - 1), src = l;
        switch (o->call.op) {
        case SHFL:
            src = seg + (o->call.arg & (w - 1));
            break;
        case SHFL_UP:
            src = (l - seg) >= o->call.arg ? l - o->call.arg : l;
            break;
        case SHFL_DOWN:
            src = (l - seg) + o->call.arg < w ? l + o->call.arg : l;
            break;
        case SHFL_XOR:
            src = ((l ^ o->call.arg) & ~(w - 1)) == seg ? l ^ o->call.arg : l;
            break;
        }
        if (o->call.op >= SHFL && o->call.op <= SHFL_XOR && !(f->call.mask >> src & 1))
            fail("lane %d reads lane %d through a shuffle at %s:%d, which its mask 0x%08x leaves "
                 "out",
                 l, src, o->file, o->line, o->call.mask);
        o->result = o->call.op == BALLOT ? ballot
                    : o->call.op == ANY  ? (uint64_t)any
                    : o->call.op == ALL  ? (uint64_t)all
                                         : s.fibers[base + (unsigned)src]->call.value;
    }
    for (int l = 0; l < 32; l++)
        if (f->call.mask >> l & 1) s.fibers[base + (unsigned)l]->state = READY;
}

inline uint64_t warp_op(int op, unsigned mask, uint64_t value, int arg, int width, const char *file,
                        int line) {
    state_t &s = state();
    fiber *f = s.current;
    if (!f) fail("a warp primitive outside a kernel (%s:%d)", file, line);
    unsigned lane = f->linear & 31u, base = f->linear & ~31u;
    if (!(mask >> lane & 1))
        fail("the warp primitive at %s:%d: mask 0x%08x leaves out the calling lane %u", file, line,
             mask, lane);
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail("the warp primitive at %s:%d: width %d is not a power of 2 up to 32", file, line,
             width);
    for (int l = 0; l < 32; l++)
        if ((mask >> l & 1) && base + (unsigned)l >= s.fibers.size())
            fail("the warp primitive at %s:%d: mask 0x%08x names lane %d, which the block does not "
                 "have",
                 file, line, mask, l);
    f->state = AT_WARP;
    f->file = file;
    f->line = line;
    f->call = warp_call{op, mask, value, arg, width};
    try_complete(f);
    yield();
    return f->result;
}

/* ---- blocks and grids ---- */

inline unsigned block_threads() {
    const dim3 &b = state().block_dim;
    return b.x * b.y * b.z;
}

/* Every thread of the block, in turn, until all have ended; barriers release when every
 * thread waits at the same one. */
inline void run_block() {
    state_t &s = state();
    unsigned n = block_threads();
    const dim3 &b = s.block_dim;
    for (unsigned i = 0; i < n; i++) {
        fiber *f = s.fibers[i];
        f->tid = uint3{i % b.x, (i / b.x) % b.y, i / (b.x * b.y)};
        f->linear = i;
        f->state = READY;
    }
    s.order.resize(n);
    for (unsigned i = 0; i < n; i++) s.order[i] = i;
    for (;;) {
        if (s.shuffle) std::shuffle(s.order.begin(), s.order.end(), s.rng);
        for (int ran = 1; ran;) {
            ran = 0;
            for (unsigned i : s.order)
                if (s.fibers[i]->state == READY) {
                    resume(s.fibers[i]);
                    ran = 1;
                }
        }
        /* Nothing can run: the block has ended, waits at a barrier, or is stuck. */
        fiber *at = nullptr, *warp = nullptr;
        for (unsigned i = 0; i < n; i++) {
            fiber *f = s.fibers[i];
            if (f->state == AT_BARRIER && !at) at = f;
            if (f->state == AT_WARP && !warp) warp = f;
        }
        if (!at && !warp) return;
        char why[256];
        if (warp) {
            for (int l = 0; l < 32; l++) {
                if (!(warp->call.mask >> l & 1)) continue;
                fiber *o = s.fibers[(warp->linear & ~31u) + (unsigned)l];
                if (o->state != AT_WARP || !same_site(o, warp)) {
                    s.current = warp;
                    fail("the warp primitive at %s:%d waits for lane %d (mask 0x%08x), which %s",
                         warp->file, warp->line, l, warp->call.mask, waits_at(o, why, sizeof why));
                }
            }
        }
        for (unsigned i = 0; i < n; i++) {
            fiber *f = s.fibers[i];
            if (f->state != AT_BARRIER || !same_site(f, at)) {
                s.current = f;
                fail("__syncthreads() at %s:%d is not reached by this thread, which %s", at->file,
                     at->line, waits_at(f, why, sizeof why));
            }
        }
        for (unsigned i = 0; i < n; i++) s.fibers[i]->state = READY;
    }
}

inline void check_canaries(const char *kernel);

inline int dynamic_limit(const void *kernel) {
    for (auto &o : state().opt_in)
        if (o.first == kernel) return o.second;
    return 48 << 10;
}

inline char *alloc_bytes(size_t bytes, size_t align, const char *name);
inline void release(void *p);

inline void run_grid(const char *kernel, const void *fn, dim3 grid, dim3 block, size_t shared,
                     void (*body)(void *), void *args) {
    state_t &s = state();
    launch_state l = {kernel, body, args};
    s.launch = &l;
    s.block_idx = uint3{0, 0, 0};
    s.current = nullptr;
    unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (!block.x || !block.y || !block.z || threads > 1024 || block.x > 1024 || block.y > 1024 ||
        block.z > 64)
        fail("launched with a block of (%u, %u, %u) threads: a GPU takes 1 to 1024, at most "
             "(1024, 1024, 64)",
             block.x, block.y, block.z);
    if (!grid.x || !grid.y || !grid.z || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
        fail("launched with a grid of (%u, %u, %u) blocks: a GPU takes 1 to (2^31 - 1, 65535, "
             "65535)",
             grid.x, grid.y, grid.z);
    if (shared > (size_t)dynamic_limit(fn))
        fail("launched with %zu bytes of dynamic shared memory, more than the %d its kernel may "
             "have (cudaFuncSetAttribute raises it, up to 232448)",
             shared, dynamic_limit(fn));
    if (!s.configured) {
        s.configured = 1;
        const char *seed = getenv("TD_EMU_SEED");
        if (seed && *seed) {
            s.shuffle = 1;
            s.rng.seed(strtoull(seed, nullptr, 10));
        }
    }
    s.block_dim = block;
    s.grid_dim = grid;
    while (s.fibers.size() < threads) s.fibers.push_back(make_fiber());
    if (shared) {
        s.dynamic_shared = alloc_bytes(shared, 16, "dynamic shared memory");
        s.dynamic_shared_bytes = shared;
    }
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                s.block_idx = uint3{x, y, z};
                if (shared) memset(s.dynamic_shared, 0xff, shared);
                run_block();
            }
    if (shared) release(s.dynamic_shared);
    s.dynamic_shared = nullptr;
    s.dynamic_shared_bytes = 0;
    check_canaries(kernel);
    s.launch = nullptr;
}

/* The thread body of one launch: the kernel called with (a copy of) its arguments. */
template <typename... P> struct call {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...> args;
    static void run(void *c) {
        call *self = (call *)c;
        std::apply(self->kernel, self->args);
    }
};

/* Launches kernel over grid x block threads with `shared` bytes of dynamic shared memory. */
template <typename... P, typename... A>
inline void launch(const char *name, void (*kernel)(P...), dim3 grid, dim3 block, size_t shared,
                   A &&...args) {
    static_assert(sizeof...(P) == sizeof...(A), "a kernel's arguments, one for each parameter");
    call<P...> c{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
    run_grid(name, (const void *)kernel, grid, block, shared, &call<P...>::run, &c);
}

/* What follows "K = " in the compiler's spelling of a function instantiated for kernel K. */
inline std::string kernel_name(const char *pretty) {
    std::string p = pretty;
    size_t at = p.find("K = ");
    if (at == std::string::npos) return p;
    size_t end = p.find_first_of(";]", at);
    return p.substr(at + 4, end - at - 4);
}

/* The name of kernel K, as the compiler spells it. */
template <auto K> inline const char *name_of() {
    static const std::string name = kernel_name(__PRETTY_FUNCTION__);
    return name.c_str();
}

/* ---- guarded buffers ---- */

inline size_t page_size() { return (size_t)sysconf(_SC_PAGESIZE); }

inline void on_fault(int sig, siginfo_t *info, void *context) {
    state_t &s = state();
    char *a = (char *)info->si_addr;
    int write = (((ucontext_t *)context)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
    for (const buffer &b : s.buffers) {
        if (a < b.map || a >= b.map + b.map_bytes) continue;
        long long off = (long long)(a - b.data);
        fail("%s byte %lld of buffer '%s', which has %zu: %s", write ? "writes" : "reads", off,
             b.name.c_str(), b.bytes, off >= 0 ? "past its end" : "before its start");
    }
    if (s.launch) {
        char head[512];
        where(head, sizeof head);
        fprintf(stderr, "%s: segmentation fault at %p, outside every emulated buffer\n", head,
                (void *)a);
    }
    signal(sig, SIG_DFL); /* the access faults again, as it would have */
}

#if TD__EMU_ASAN
inline void on_asan_death() {
    char head[512];
    where(head, sizeof head);
    fprintf(stderr, "(the report above is from %s)\n", head);
}
#endif

inline void install_handler() {
    state_t &s = state();
    if (s.handler_installed) return;
    s.handler_installed = 1;
#if TD__EMU_ASAN
    __sanitizer_set_death_callback(on_asan_death);
#else
    stack_t alt = {};
    alt.ss_size = 1 << 16;
    alt.ss_sp = malloc(alt.ss_size);
    sigaltstack(&alt, nullptr);
    struct sigaction sa = {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
#endif
}

/* A buffer of `bytes` for kernels to use, aligned to `align`, its end against an inaccessible
 * page; `name` appears in reports. */
inline char *alloc_bytes(size_t bytes, size_t align, const char *name) {
    state_t &s = state();
    install_handler();
    buffer b;
    b.name = name;
    b.bytes = bytes;
#if TD__EMU_ASAN
    (void)align;
    b.map = (char *)malloc(bytes ? bytes : 1);
    b.map_bytes = bytes;
    b.data = b.map;
#else
    size_t page = page_size(), span = (bytes + align + page - 1) / page * page;
    b.map_bytes = span + 2 * page;
    void *m =
        mmap(nullptr, b.map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) fail("no memory for buffer '%s' (%zu bytes)", name, bytes);
    b.map = (char *)m;
    mprotect(b.map, page, PROT_NONE);
    mprotect(b.map + page + span, page, PROT_NONE);
    uintptr_t end = (uintptr_t)(b.map + page + span);
    b.data = (char *)((end - bytes) & ~(uintptr_t)(align - 1));
    memset(b.map + page, 0xa5, (size_t)(b.data - (b.map + page)));
    memset(b.data + bytes, 0xa5, (size_t)(end - (uintptr_t)(b.data + bytes)));
#endif
    s.buffers.push_back(b);
    return s.buffers.back().data;
}

/* The canary bytes around every buffer, intact after a launch of `kernel`. */
inline void check_canaries(const char *kernel) {
#if !TD__EMU_ASAN
    state_t &s = state();
    size_t page = page_size();
    for (const buffer &b : s.buffers) {
        const char *lo = b.map + page, *hi = b.map + b.map_bytes - page;
        for (const char *p = lo; p < hi; p++) {
            if (p == b.data) p += b.bytes;
            if (p < hi && *p != (char)0xa5)
                fail("kernel %s wrote byte %lld of buffer '%s' (%zu bytes), outside it", kernel,
                     (long long)(p - b.data), b.name.c_str(), b.bytes);
        }
    }
#else
    (void)kernel;
#endif
}

inline void release(void *p) {
    state_t &s = state();
    for (size_t i = 0; i < s.buffers.size(); i++) {
        buffer &b = s.buffers[i];
        if (b.data != p) continue;
#if TD__EMU_ASAN
        free(b.map);
#else
        munmap(b.map, b.map_bytes);
#endif
        s.buffers.erase(s.buffers.begin() + (long)i);
        return;
    }
    fail("release(%p): not a buffer of the emulation", p);
}

/* n elements of T in a guarded buffer (uninitialised: filled with 0xa5 bytes). */
template <typename T> inline T *alloc(size_t n, const char *name) {
    T *p = (T *)alloc_bytes(n * sizeof(T), alignof(T), name);
    memset((void *)p, 0xa5, n * sizeof(T));
    return p;
}

} /* namespace td__emu */

/* ---- the runtime calls and device functions kernels and their launches use ---- */

#define threadIdx (static_cast<const uint3 &>(td__emu::state().current->tid))
#define blockIdx (static_cast<const uint3 &>(td__emu::state().block_idx))
#define blockDim (static_cast<const dim3 &>(td__emu::state().block_dim))
#define gridDim (static_cast<const dim3 &>(td__emu::state().grid_dim))

#define __syncthreads() td__emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) td__emu::site{__FILE__, __LINE__}.syncwarp(__VA_ARGS__)
#define __shfl_sync(...) td__emu::site{__FILE__, __LINE__}.shuffle(td__emu::SHFL, __VA_ARGS__)
#define __shfl_up_sync(...) td__emu::site{__FILE__, __LINE__}.shuffle(td__emu::SHFL_UP, __VA_ARGS__)
#define __shfl_down_sync(...) \
    td__emu::site{__FILE__, __LINE__}.shuffle(td__emu::SHFL_DOWN, __VA_ARGS__)
#define __shfl_xor_sync(...) \
    td__emu::site{__FILE__, __LINE__}.shuffle(td__emu::SHFL_XOR, __VA_ARGS__)
#define __ballot_sync(mask, p) \
    ((unsigned)td__emu::site{__FILE__, __LINE__}.vote(td__emu::BALLOT, mask, p))
#define __any_sync(mask, p) ((int)td__emu::site{__FILE__, __LINE__}.vote(td__emu::ANY, mask, p))
#define __all_sync(mask, p) ((int)td__emu::site{__FILE__, __LINE__}.vote(td__emu::ALL, mask, p))

/* Dynamic shared memory as an array of T named `name`. */
#define TD__DYNAMIC_SHARED(T, name) T *name = reinterpret_cast<T *>(td__emu::state().dynamic_shared)

namespace td__emu {

inline void syncthreads(const char *file, int line) {
    state_t &s = state();
    fiber *f = s.current;
    if (!f) fail("__syncthreads() outside a kernel (%s:%d)", file, line);
    f->state = AT_BARRIER;
    f->file = file;
    f->line = line;
    yield();
}

/* Where a warp primitive is called, and the primitives themselves. */
struct site {
    const char *file;
    int line;
    void syncwarp(unsigned mask = 0xffffffffu) const {
        warp_op(WARP_SYNC, mask, 0, 0, 32, file, line);
    }
    uint64_t vote(int op, unsigned mask, int p) const {
        return warp_op(op, mask, p != 0, 0, 32, file, line);
    }
    template <typename T> T shuffle(int op, unsigned mask, T v, int arg, int width = 32) const {
        static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "a shuffled value");
        uint64_t bits = 0;
        memcpy(&bits, &v, sizeof v);
        bits = warp_op(op, mask, bits, arg, width, file, line);
        T out;
        memcpy(&out, &bits, sizeof out);
        return out;
    }
};

} /* namespace td__emu */

/* Atomics: plain read-modify-writes, as fibers switch only at barriers and warp primitives. */
template <typename T, typename F> inline T td__emu_atomic(T *p, F update) {
    T old = *p;
    *p = update(old);
    return old;
}
template <typename T> inline T atomicAdd(T *p, T v) {
    return td__emu_atomic(p, [v](T o) { return o + v; });
}
template <typename T> inline T atomicMin(T *p, T v) {
    return td__emu_atomic(p, [v](T o) { return v < o ? v : o; });
}
template <typename T> inline T atomicMax(T *p, T v) {
    return td__emu_atomic(p, [v](T o) { return v > o ? v : o; });
}
template <typename T> inline T atomicOr(T *p, T v) {
    return td__emu_atomic(p, [v](T o) { return o | v; });
}
template <typename T> inline T atomicExch(T *p, T v) {
    return td__emu_atomic(p, [v](T) { return v; });
}
template <typename T> inline T atomicCAS(T *p, T expected, T v) {
    return td__emu_atomic(p, [expected, v](T o) { return o == expected ? v : o; });
}

enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

/* Opts a kernel in to more dynamic shared memory, as on a Hopper (at most 232448 bytes). */
template <typename K> inline int cudaFuncSetAttribute(K *kernel, cudaFuncAttribute, int bytes) {
    if (bytes < 0 || bytes > 232448)
        td__emu::fail("cudaFuncSetAttribute: %d bytes of dynamic shared memory (at most 232448)",
                      bytes);
    td__emu::state().opt_in.emplace_back((const void *)kernel, bytes);
    return 0;
}

#endif
