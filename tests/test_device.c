/* Devices: naming them, the caching allocator's bookkeeping (over host memory, where the
 * "streams" are counters this test advances by hand, so that which block may be reused when
 * is decided here, not by timing), the loader's account of why no GPU can be used, and, where
 * a GPU is visible, memory and copies on it. Cases that need a GPU skip with one line. */
#include "tandem/device.h"

#include "device/caching_allocator.h"
#include "test.h"

static void parse_and_format(void) {
    td_device d;
    char buf[32];
    CHECK_OK(td_device_parse("cpu", &d));
    CHECK_EQ(d.type, TD_DEVICE_CPU);
    CHECK_OK(td_device_parse("cuda", &d));
    CHECK(d.type == TD_DEVICE_CUDA && d.index == 0);
    CHECK_OK(td_device_parse("cuda:3", &d));
    CHECK(d.type == TD_DEVICE_CUDA && d.index == 3);
    td_device_format(d, buf, sizeof buf);
    CHECK(strcmp(buf, "cuda:3") == 0);
    td_device_format(td_device_cpu(), buf, sizeof buf);
    CHECK(strcmp(buf, "cpu") == 0);
    const char *bad[] = {"gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1x", "cuda:64", "CUDA:0", ""};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        CHECK_STATUS(td_device_parse(bad[i], &d), TD_EINVAL);
        char quoted[40];
        snprintf(quoted, sizeof quoted, "'%s'", bad[i]);
        CHECK(strstr(td_last_error(), quoted) != NULL);
    }
}

#define MIB ((size_t)1 << 20)

/* Sizes as PyTorch's allocator takes them: blocks in multiples of 512 bytes, small requests
 * from 2 MiB segments, larger ones from 20 MiB below 10 MiB, else their own size rounded up to
 * 2 MiB: a whole graph's 32.1 GiB costs 32.1 GiB, not a size class 25% above it. */
static void large_requests_round_up_to_2_mib(void) {
    CHECK_EQ(td__block_size(1), 512);
    CHECK_EQ(td__block_size(512), 512);
    CHECK_EQ(td__block_size(513), 1024);
    CHECK_EQ(td__block_size(MIB + 1), MIB + 512);
    CHECK_EQ(td__segment_size(512), 2 * MIB);
    CHECK_EQ(td__segment_size(MIB), 2 * MIB);
    CHECK_EQ(td__segment_size(MIB + 512), 20 * MIB);
    CHECK_EQ(td__segment_size(10 * MIB), 10 * MIB);
    CHECK_EQ(td__segment_size(10 * MIB + 512), 12 * MIB);
    size_t graph = (size_t)(32.1 * 1024) * MIB + 4096; /* 32.1 GiB and a bit */
    CHECK_EQ(td__segment_size(td__block_size(graph)), graph - 4096 + 2 * MIB);
    for (size_t b = 1; b < ((size_t)1 << 40); b = b * 9 / 7 + 1) {
        size_t blk = td__block_size(b), seg = td__segment_size(blk);
        CHECK(blk >= b && blk - b < 512 && blk % 512 == 0);
        CHECK(seg >= blk && (blk < 10 * MIB || seg - blk < 2 * MIB));
    }
}

/* Host memory with a capacity, and streams as counters: an event recorded on a stream is done
 * once the test has completed that stream past the point it was recorded at. */
typedef struct {
    int submitted, completed;
} stream;
typedef struct {
    stream *s;
    int at;
} event;
typedef struct {
    size_t capacity, used;
    int frees;
} host_memory;

static td_status h_alloc(void *ctx, size_t bytes, void **ptr) {
    host_memory *h = ctx;
    if (h->used + bytes > h->capacity) return TD_ENOMEM;
    *ptr = malloc(bytes + sizeof(size_t));
    if (!*ptr) return TD_ENOMEM;
    *(size_t *)*ptr = bytes;
    *ptr = (size_t *)*ptr + 1;
    h->used += bytes;
    return TD_OK;
}
static void h_free(void *ctx, void *ptr) {
    host_memory *h = ctx;
    size_t *p = (size_t *)ptr - 1;
    h->used -= *p;
    h->frees++;
    free(p);
}
static td_status h_record(void *ctx, void *s, void **ev) {
    (void)ctx;
    event *e = malloc(sizeof *e);
    if (!e) return TD_ENOMEM;
    e->s = s;
    e->at = ++e->s->submitted;
    *ev = e;
    return TD_OK;
}
static int h_done(void *ctx, void *ev) {
    (void)ctx;
    event *e = ev;
    return e->s->completed >= e->at;
}
static void h_event_destroy(void *ctx, void *ev) {
    (void)ctx;
    free(ev);
}

static void allocator_over(td__caching_allocator *a, host_memory *h, size_t capacity) {
    memset(h, 0, sizeof *h);
    h->capacity = capacity;
    td__raw_memory raw = {h, h_alloc, h_free, h_record, h_done, h_event_destroy};
    td__allocator_init(a, "host:test", raw);
}

static void allocator_reuses_blocks_on_their_stream(void) {
    td__caching_allocator a;
    host_memory h;
    stream s1 = {0, 0}, s2 = {0, 0};
    allocator_over(&a, &h, 64 * MIB);
    void *p, *q, *r;
    CHECK_OK(td__allocator_alloc(&a, 1000, &s1, &p));
    memset(p, 1, 1000);
    CHECK_OK(td__allocator_free(&a, p));
    CHECK_OK(td__allocator_alloc(&a, 900, &s1, &q)); /* same stream: the same block */
    CHECK(q == p);
    CHECK_OK(td__allocator_alloc(&a, 900, &s2, &r)); /* another stream gets its own segment */
    CHECK(r != p);
    td_device_memory_stats st = td__allocator_stats(&a);
    CHECK_EQ(st.allocations, 3);
    CHECK_EQ(st.cache_hits, 1);
    CHECK_EQ(st.driver_allocs, 2);
    CHECK_EQ(st.in_use, 2048);
    CHECK_EQ(st.reserved, 4 * MIB);
    CHECK_EQ(st.peak_in_use, 2048);
    CHECK_OK(td__allocator_free(&a, q));
    CHECK_OK(td__allocator_free(&a, r));
    st = td__allocator_stats(&a);
    CHECK_EQ(st.in_use, 0);
    CHECK_EQ(st.reserved, 4 * MIB); /* cached, not returned */
    td__allocator_empty_cache(&a);
    st = td__allocator_stats(&a);
    CHECK_EQ(st.reserved, 0);
    CHECK_EQ(h.used, 0);
    CHECK_EQ(st.peak_reserved, 4 * MIB);
    td__allocator_destroy(&a);
}

/* Blocks split from one segment, side by side, and merge back when freed, so the segment goes
 * back whole; a large cached block is split for a smaller request only when more than 1 MiB
 * is left. */
static void blocks_split_and_merge_as_pytorchs(void) {
    td__caching_allocator a;
    host_memory h;
    stream s1 = {0, 0};
    allocator_over(&a, &h, 64 * MIB);
    void *p, *q, *r;
    CHECK_OK(td__allocator_alloc(&a, 1000, &s1, &p));
    CHECK_OK(td__allocator_alloc(&a, 3000, &s1, &q));
    CHECK_OK(td__allocator_alloc(&a, 512, &s1, &r));
    CHECK((char *)q == (char *)p + 1024 && (char *)r == (char *)q + 3072);
    CHECK_EQ(td__allocator_stats(&a).driver_allocs, 1);
    CHECK_OK(td__allocator_free(&a, q));
    td__allocator_empty_cache(&a); /* the segment has blocks in use: it stays */
    CHECK_EQ(td__allocator_stats(&a).reserved, 2 * MIB);
    void *t;
    CHECK_OK(td__allocator_alloc(&a, 2048, &s1, &t)); /* the best fit: q's hole */
    CHECK(t == q);
    CHECK_OK(td__allocator_free(&a, p));
    CHECK_OK(td__allocator_free(&a, r));
    CHECK_OK(td__allocator_free(&a, t));
    td__allocator_empty_cache(&a); /* merged whole again: back to the driver */
    CHECK_EQ(td__allocator_stats(&a).reserved, 0);
    CHECK_EQ(h.frees, 1);
    /* 12 MiB of its own; 10.5 MiB from it leaves 1.5 MiB, split off; 11.5 MiB would leave
     * 0.5 MiB, kept in the block. */
    CHECK_OK(td__allocator_alloc(&a, 12 * MIB, &s1, &p));
    CHECK_EQ(td__allocator_stats(&a).reserved, 12 * MIB);
    CHECK_OK(td__allocator_free(&a, p));
    CHECK_OK(td__allocator_alloc(&a, 10 * MIB + MIB / 2, &s1, &q));
    CHECK(q == p);
    CHECK_EQ(td__allocator_stats(&a).in_use, 10 * MIB + MIB / 2);
    CHECK_OK(td__allocator_free(&a, q));
    CHECK_OK(td__allocator_alloc(&a, 11 * MIB + MIB / 2, &s1, &q));
    CHECK(q == p);
    CHECK_EQ(td__allocator_stats(&a).in_use, 12 * MIB);
    CHECK_EQ(td__allocator_stats(&a).driver_allocs, 2);
    CHECK_OK(td__allocator_free(&a, q));
    td__allocator_destroy(&a);
    CHECK_EQ(h.used, 0);
}

static void block_used_on_another_stream_waits_for_it(void) {
    td__caching_allocator a;
    host_memory h;
    stream s1 = {0, 0}, s2 = {0, 0};
    allocator_over(&a, &h, 64 * MIB);
    void *p, *q;
    CHECK_OK(td__allocator_alloc(&a, 4096, &s1, &p));
    CHECK_OK(td__allocator_record_stream(&a, p, &s2)); /* s2 reads it too */
    CHECK_OK(td__allocator_free(&a, p));               /* while s2 may still be reading */
    CHECK_OK(td__allocator_alloc(&a, 4096, &s1, &q));
    CHECK(q != p); /* s2 has not passed the free yet */
    CHECK_OK(td__allocator_free(&a, q));
    td__allocator_empty_cache(&a);
    CHECK_EQ(td__allocator_stats(&a).reserved, 2 * MIB); /* p still waits: the segment stays */
    s2.completed = s2.submitted;                         /* s2 passes it */
    void *r, *t;
    CHECK_OK(td__allocator_alloc(&a, 4096, &s1, &r));
    CHECK_OK(td__allocator_alloc(&a, 4096, &s1, &t));
    CHECK((r == p && t == q) || (r == q && t == p));
    CHECK_EQ(td__allocator_stats(&a).driver_allocs, 1);
    CHECK_OK(td__allocator_free(&a, r));
    CHECK_OK(td__allocator_free(&a, t));
    td__allocator_destroy(&a);
    CHECK_EQ(h.used, 0);
}

static void out_of_memory_empties_the_cache_then_names_the_sizes(void) {
    td__caching_allocator a;
    host_memory h;
    stream s1 = {0, 0};
    allocator_over(&a, &h, 30 * MIB);
    void *p, *q;
    CHECK_OK(td__allocator_alloc(&a, 12 * MIB, &s1, &p));
    CHECK_OK(td__allocator_free(&a, p));                  /* 12 MiB cached */
    CHECK_OK(td__allocator_alloc(&a, 24 * MIB, &s1, &q)); /* fits only once the cache is gone */
    CHECK_EQ(h.frees, 1);
    CHECK_EQ(td__allocator_stats(&a).reserved, 24 * MIB);
    void *r = (void *)1;
    CHECK_STATUS(td__allocator_alloc(&a, 4 * MIB, &s1, &r), TD_ENOMEM);
    CHECK(r == NULL);
    CHECK(strstr(td_last_error(), "host:test: out of memory allocating 4194304 bytes (a segment "
                                  "of 20971520; 25165824 in use") != NULL);
    CHECK_EQ(td__allocator_stats(&a).in_use, 24 * MIB); /* the failure changed nothing */
    CHECK_OK(td__allocator_free(&a, q));
    td__allocator_destroy(&a);
    CHECK_EQ(h.used, 0);
}

static void foreign_and_double_frees_are_refused_by_name(void) {
    td__caching_allocator a;
    host_memory h;
    stream s1 = {0, 0};
    allocator_over(&a, &h, 64 * MIB);
    void *p;
    int x;
    CHECK_OK(td__allocator_alloc(&a, 100, &s1, &p));
    CHECK_STATUS(td__allocator_free(&a, &x), TD_EINVAL);
    CHECK(strstr(td_last_error(), "host:test: free:") != NULL);
    CHECK_OK(td__allocator_free(&a, p));
    CHECK_STATUS(td__allocator_free(&a, p), TD_EINVAL);
    CHECK(strstr(td_last_error(), "freed twice") != NULL);
    CHECK_STATUS(td__allocator_record_stream(&a, p, &s1), TD_EINVAL);
    CHECK_EQ(td__allocator_stats(&a).in_use, 0);
    td__allocator_destroy(&a);
    CHECK_EQ(h.used, 0);
}

/* Where no GPU can be used the library says why, and GPU calls fail naming it. */
static void without_a_gpu_the_reason_is_named(void) {
    int n = -1;
    CHECK_OK(td_cuda_device_count(&n));
    if (n > 0) {
        CHECK(td_cuda_unavailable() == NULL);
        return;
    }
    const char *why = td_cuda_unavailable();
    CHECK(why != NULL && *why);
    printf("no GPU here: %s\n", why ? why : "?");
    /* Built with nvcc, the library lies in the build's lib/ and the driver is what is missing. */
    char lib[4096];
    ssize_t len = readlink("/proc/self/exe", lib, sizeof lib - 64);
    lib[len > 0 ? len : 0] = 0;
    char *slash = strrchr(lib, '/');
    if (slash) strcpy(slash, "/../lib/libtandem_cuda.so");
    if (access(lib, R_OK) == 0 && why) CHECK(strstr(why, "libtandem_cuda.so not found") == NULL);
    td_device d;
    CHECK_OK(td_device_local(&d));
    CHECK_EQ(d.type, TD_DEVICE_CPU);
    /* a program's --device: the CPU is always there, a GPU is refused saying why */
    CHECK_OK(td_device_choose("cpu", &d));
    CHECK_EQ(d.type, TD_DEVICE_CPU);
    CHECK_STATUS(td_device_choose("cuda", &d), TD_EUNSUPPORTED);
    CHECK(strstr(td_last_error(), "device 'cuda': no GPU can be used here: ") != NULL);
    CHECK_STATUS(td_device_choose("cuda:1", &d), TD_EUNSUPPORTED);
    CHECK_STATUS(td_device_choose("gpu", &d), TD_EINVAL);
    void *p = NULL;
    CHECK_STATUS(td_device_alloc(td_device_cuda(0), 64, &p), TD_EUNSUPPORTED);
    CHECK(strstr(td_last_error(), "td_device_alloc: cuda:0: no GPU can be used here") != NULL);
    td_device_memory_stats st;
    CHECK_STATUS(td_device_memory(td_device_cuda(0), &st), TD_EUNSUPPORTED);
    CHECK_STATUS(td_device_memory(td_device_cpu(), &st), TD_EINVAL);
}

static void cpu_is_a_device_too(void) {
    td_device_properties p;
    CHECK_OK(td_device_get_properties(td_device_cpu(), &p));
    CHECK(p.multiprocessors >= 1 && p.total_memory > 0);
    void *a = NULL;
    CHECK_OK(td_device_alloc(td_device_cpu(), 100, &a));
    CHECK(((uintptr_t)a & 63) == 0);
    char src[100], back[100];
    for (int i = 0; i < 100; i++) src[i] = (char)i;
    CHECK_OK(td_device_copy(td_device_cpu(), a, td_device_cpu(), src, sizeof src));
    CHECK_OK(td_device_copy(td_device_cpu(), back, td_device_cpu(), a, sizeof back));
    CHECK(memcmp(src, back, sizeof src) == 0);
    CHECK_OK(td_device_synchronize(td_device_cpu()));
    CHECK_OK(td_device_free(td_device_cpu(), a));
}

static int gpus(void) {
    int n = 0;
    td_cuda_device_count(&n);
    return n;
}

/* Round trips of odd sizes through device memory, and the allocator's counters on the GPU. */
static void gpu_memory_round_trips(void) {
    if (!gpus()) {
        SKIP("no CUDA device");
        return;
    }
    td_device g = td_device_cuda(0);
    td_device_properties p;
    CHECK_OK(td_device_get_properties(g, &p));
    printf("cuda:0 is %s, %zu MiB, %d SMs, sm_%d%d\n", p.name, p.total_memory >> 20,
           p.multiprocessors, p.major, p.minor);
    CHECK(p.total_memory > 0 && p.multiprocessors > 0 && p.major >= 7);
    td_device_memory_stats before, st;
    CHECK_OK(td_device_memory(g, &before));
    const size_t sizes[] = {1, 511, 4097, 1 << 20, (3 << 20) + 5};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        size_t n = sizes[i];
        unsigned char *host = malloc(n), *back = malloc(n);
        for (size_t k = 0; k < n; k++) host[k] = (unsigned char)(k * 31 + i);
        void *d1, *d2;
        CHECK_OK(td_device_alloc(g, n, &d1));
        CHECK_OK(td_device_alloc(g, n, &d2));
        CHECK_OK(td_device_copy(g, d1, td_device_cpu(), host, n));
        CHECK_OK(td_device_copy(g, d2, g, d1, n));
        memset(back, 0, n);
        CHECK_OK(td_device_copy(td_device_cpu(), back, g, d2, n));
        CHECK(memcmp(host, back, n) == 0);
        CHECK_OK(td_device_free(g, d1));
        CHECK_OK(td_device_free(g, d2));
        free(host);
        free(back);
    }
    void *again;
    CHECK_OK(td_device_alloc(g, 1 << 20, &again)); /* served from the cache */
    CHECK_OK(td_device_memory(g, &st));
    CHECK(st.cache_hits > before.cache_hits);
    CHECK_EQ(st.in_use - before.in_use, 1 << 20);
    CHECK_OK(td_device_free(g, again));
    CHECK_OK(td_device_empty_cache(g));
    CHECK_OK(td_device_memory(g, &st));
    CHECK_EQ(st.in_use, before.in_use);
    CHECK_EQ(st.reserved, before.reserved);
}

/* Asking for more than the GPU has fails by name and leaves the allocator as it was. */
static void gpu_out_of_memory_is_named(void) {
    if (!gpus()) {
        SKIP("no CUDA device");
        return;
    }
    td_device g = td_device_cuda(0);
    td_device_properties p;
    CHECK_OK(td_device_get_properties(g, &p));
    td_device_memory_stats before, after;
    CHECK_OK(td_device_memory(g, &before));
    void *ptr = (void *)1;
    CHECK_STATUS(td_device_alloc(g, p.total_memory * 2, &ptr), TD_ENOMEM);
    CHECK(ptr == NULL);
    CHECK(strstr(td_last_error(), "cuda:0: out of memory allocating") != NULL);
    CHECK_OK(td_device_memory(g, &after));
    CHECK_EQ(after.in_use, before.in_use);
    void *ok;
    CHECK_OK(td_device_alloc(g, 4096, &ok)); /* the failure did not stick */
    CHECK_OK(td_device_free(g, ok));
}

/* torchrun's recipe: LOCAL_RANK picks the GPU among the visible ones. */
static void local_rank_picks_the_gpu(void) {
    int n = gpus();
    if (!n) {
        SKIP("no CUDA device");
        return;
    }
    td_device d;
    char v[16];
    snprintf(v, sizeof v, "%d", n - 1);
    setenv("LOCAL_RANK", v, 1);
    CHECK_OK(td_device_local(&d));
    CHECK(d.type == TD_DEVICE_CUDA && d.index == n - 1);
    snprintf(v, sizeof v, "%d", n);
    setenv("LOCAL_RANK", v, 1);
    CHECK_STATUS(td_device_local(&d), TD_EINVAL);
    CHECK(strstr(td_last_error(), "one rank per GPU") != NULL);
    snprintf(v, sizeof v, "cuda:%d", n);
    CHECK_STATUS(td_device_choose(v, &d), TD_EINVAL);
    CHECK(strstr(td_last_error(), "visible") != NULL);
    setenv("LOCAL_RANK", "0", 1);
    CHECK_OK(td_device_choose("cuda", &d));
    CHECK(d.type == TD_DEVICE_CUDA && d.index == 0);
    unsetenv("LOCAL_RANK");
}

int main(void) {
    RUN(parse_and_format);
    RUN(large_requests_round_up_to_2_mib);
    RUN(allocator_reuses_blocks_on_their_stream);
    RUN(blocks_split_and_merge_as_pytorchs);
    RUN(block_used_on_another_stream_waits_for_it);
    RUN(out_of_memory_empties_the_cache_then_names_the_sizes);
    RUN(foreign_and_double_frees_are_refused_by_name);
    RUN(without_a_gpu_the_reason_is_named);
    RUN(cpu_is_a_device_too);
    RUN(gpu_memory_round_trips);
    RUN(gpu_out_of_memory_is_named);
    RUN(local_rank_picks_the_gpu);
    TEST_END();
}
