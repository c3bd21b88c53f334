/* ZeRO's memory: regions whose addresses are reserved once and whose pages come and go, and the
 * count of the bytes a rank holds.
 *
 * A parameter or gradient keeps one address for the life of the group, so that whoever reads it
 * (a graph, an evaluation graph that shares its parameters, a hand-written trainer) never has to
 * be told it moved; freeing a gathered copy gives its pages back with MADV_DONTNEED, after which
 * they read as zeros until written again. The reservation is MAP_NORESERVE: only pages in use
 * count against the system's memory. (FSDP resizes a flat parameter's storage to zero and back
 * for the same effect; on a GPU this is what the CUDA driver's virtual memory calls give.) */
#include <sys/mman.h>
#include <unistd.h>

#include "core/core_impl.h"
#include "parallel/zero_impl.h"

static size_t page_size(void) {
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : 4096;
}

size_t td__zero_pages(size_t bytes) {
    size_t p = page_size();
    return (bytes + p - 1) / p * p;
}

td_status td__zero_region_reserve(td__zero_region *r, size_t bytes, int rank, const char *what) {
    r->base = NULL;
    r->bytes = 0;
    if (bytes == 0) return TD_OK;
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED)
        return td__fail(TD_ENOMEM, "zero rank %d: cannot reserve %zu bytes for %s", rank, bytes,
                        what);
    r->base = p;
    r->bytes = bytes;
    return TD_OK;
}

void td__zero_region_free(td__zero_region *r) {
    if (r->base) munmap(r->base, r->bytes);
    r->base = NULL;
    r->bytes = 0;
}

void td__zero_release(void *p, size_t bytes) {
    size_t ps = page_size();
    uintptr_t lo = ((uintptr_t)p + ps - 1) / ps * ps, hi = ((uintptr_t)p + bytes) / ps * ps;
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

void td__zero_account_add(td__zero_account *a, int kind, long long delta) {
    a->now[kind] = (size_t)((long long)a->now[kind] + delta);
    a->total = (size_t)((long long)a->total + delta);
    if (a->now[kind] > a->peak[kind]) a->peak[kind] = a->now[kind];
    if (a->total > a->peak_total) a->peak_total = a->total;
}
