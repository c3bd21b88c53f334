/* ZeRO's memory: regions whose addresses stay for the life of the group and whose pages come and
 * go, the pool where freed pages wait for their next use, and the count of the bytes a rank
 * holds.
 *
 * A parameter keeps one address for the life of the group, so that whoever reads it (a graph,
 * an evaluation graph that shares its parameters, a hand-written trainer) never has to be told
 * it moved; freeing a gathered copy gives its pages up, after which they read as zeros until
 * written again. The regions are the group's memory (td_comm_alloc), so that on one host the
 * all-gathers and reduce-scatters read the other ranks' regions in place instead of copying
 * through the backend's staging slots: shared memory, whose pages go back with MADV_REMOVE (a
 * hole punched in the memory file); elsewhere private memory, MADV_DONTNEED. Only pages in use
 * count against the system's memory. Giving pages back and faulting them in again costs more
 * than the copies they hold (the kernel frees, zeroes and maps each page), so stage 3's gathered
 * copies, which lie in parts of the region made private to the rank, park their pages in a
 * pool instead and the next gather takes them back. (FSDP resizes a flat parameter's storage to
 * zero and back, its caching allocator keeping the memory; on a GPU this is what the CUDA
 * driver's virtual memory calls give.) */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
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

td_status td__zero_region_alloc(td__zero_region *r, td_comm *comm, size_t bytes, int rank,
                                const char *what) {
    r->base = NULL;
    r->bytes = 0;
    r->comm = comm;
    if (bytes == 0) return TD_OK;
    void *p = NULL;
    td_status s = td_comm_alloc(comm, bytes, &p);
    if (s != TD_OK)
        return td__fail(s, "zero rank %d: no memory for %s: %s", rank, what, td_last_error());
    if ((uintptr_t)p % page_size()) {
        td_comm_free(comm, p);
        return td__fail(TD_EBACKEND, "zero rank %d: the group's memory for %s is not page aligned",
                        rank, what);
    }
    r->base = p;
    r->bytes = bytes;
    td__zero_release(p, bytes); /* zeros, whatever the allocator left there */
    return TD_OK;
}

void td__zero_region_free(td__zero_region *r) {
    if (r->base) td_comm_free(r->comm, r->base);
    r->base = NULL;
    r->bytes = 0;
}

void td__zero_release(void *p, size_t bytes) {
    size_t ps = page_size();
    uintptr_t lo = ((uintptr_t)p + ps - 1) / ps * ps, hi = ((uintptr_t)p + bytes) / ps * ps;
    if (hi <= lo) return;
    /* Shared memory keeps its pages under MADV_DONTNEED (only this mapping lets go of them):
     * MADV_REMOVE frees them; it refuses private memory, which MADV_DONTNEED frees. */
    if (madvise((void *)lo, hi - lo, MADV_REMOVE) != 0)
        (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

td_status td__zero_region_private(td__zero_region *r, size_t off, size_t bytes) {
    size_t ps = page_size();
    uintptr_t lo = ((uintptr_t)r->base + off + ps - 1) / ps * ps;
    uintptr_t hi = ((uintptr_t)r->base + off + bytes) / ps * ps;
    if (hi <= lo) return TD_OK;
    void *p = mmap((void *)lo, hi - lo, PROT_READ | PROT_WRITE,
                   MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? td__fail(TD_ENOMEM, "zero: cannot map %zu private bytes: %s",
                                      (size_t)(hi - lo), strerror(errno))
                           : TD_OK;
}

/* ---- parked pages ----------------------------------------------------------------------- */

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4 /* Linux 5.7 */
#endif

/* Moves the pages of [from, from + bytes) to `to`, leaving `from` mapped and empty. The system
 * call itself: a transport library's memory hook that takes mremap's place (UCX's does) may
 * drop the new address, and the kernel would then map the pages wherever a register pointed. */
static int move_pages(unsigned char *from, unsigned char *to, size_t bytes) {
    long r = syscall(SYS_mremap, from, bytes, bytes,
                     MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, to);
    return r == (long)(uintptr_t)to ? 0 : -1;
}

td_status td__zero_pool_init(td__zero_pool *p, unsigned char *home, size_t bytes, size_t budget,
                             int rank) {
    memset(p, 0, sizeof *p);
    p->home = home;
    if (!budget || !bytes) return TD_OK;
    void *s = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (s == MAP_FAILED)
        return td__fail(TD_ENOMEM, "zero rank %d: cannot reserve %zu bytes for parked pages", rank,
                        bytes);
    p->shadow = s;
    p->bytes = bytes;
    p->budget = budget;
    return TD_OK;
}

void td__zero_pool_free(td__zero_pool *p) {
    if (p->shadow) munmap(p->shadow, p->bytes);
    free(p->parked);
    memset(p, 0, sizeof *p);
}

size_t td__zero_pool_park(td__zero_pool *p, size_t at, size_t bytes) {
    size_t ps = page_size(), lo = (at + ps - 1) / ps * ps, hi = (at + bytes) / ps * ps;
    if (hi <= lo) return 0;
    size_t room = p->budget > p->held ? (p->budget - p->held) / ps * ps : 0;
    size_t n = hi - lo < room ? hi - lo : room;
    if (n && p->n_parked == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 16;
        struct zero_parked *grown = realloc(p->parked, cap * sizeof *grown);
        if (grown) p->parked = grown, p->cap = cap;
    }
    if (n && (p->n_parked == p->cap || move_pages(p->home + lo, p->shadow + lo, n) != 0)) {
        p->budget = 0; /* no mremap here (an older kernel): give pages back from now on */
        n = 0;
    }
    if (n) {
        p->parked[p->n_parked++] = (struct zero_parked){lo, n};
        p->held += n;
    }
    td__zero_release(p->home + lo + n, hi - lo - n);
    return n;
}

size_t td__zero_pool_take(td__zero_pool *p, size_t at, size_t bytes) {
    size_t ps = page_size(), lo = (at + ps - 1) / ps * ps, hi = (at + bytes) / ps * ps, moved = 0;
    while (hi > lo + moved && p->n_parked) {
        struct zero_parked *r = &p->parked[p->n_parked - 1];
        size_t n = hi - lo - moved < r->bytes ? hi - lo - moved : r->bytes;
        if (move_pages(p->shadow + r->at + r->bytes - n, p->home + hi - moved - n, n) != 0) break;
        r->bytes -= n;
        p->held -= n;
        moved += n;
        if (!r->bytes) p->n_parked--;
    }
    return moved;
}

void td__zero_account_add(td__zero_account *a, int kind, long long delta) {
    a->now[kind] = (size_t)((long long)a->now[kind] + delta);
    a->total = (size_t)((long long)a->total + delta);
    if (a->now[kind] > a->peak[kind]) a->peak[kind] = a->now[kind];
    if (a->total > a->peak_total) a->peak_total = a->total;
}
