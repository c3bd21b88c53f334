/* The caching allocator's bookkeeping (see caching_allocator.h): segments split into blocks
 * linked by address, a free list per pool searched for the best fit, blocks waiting for other
 * streams' events, a hash of blocks in use, and the counters torch.cuda.memory_stats also
 * keeps. The sizes are PyTorch's (c10/cuda/CUDACachingAllocator.cpp). */
#include "device/caching_allocator.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"

#define MIN_BLOCK 512                  /* every block is a multiple of it */
#define SMALL_SIZE ((size_t)1 << 20)   /* the small pool serves requests up to 1 MiB */
#define SMALL_BUFFER ((size_t)2 << 20) /* in segments of 2 MiB */
#define MIN_LARGE_ALLOC ((size_t)10 << 20)
#define LARGE_BUFFER ((size_t)20 << 20) /* the segment of a large request below 10 MiB */
#define ROUND_LARGE ((size_t)2 << 20)   /* larger ones round up to 2 MiB */

size_t td__block_size(size_t bytes) {
    return bytes < MIN_BLOCK ? MIN_BLOCK : (bytes + MIN_BLOCK - 1) / MIN_BLOCK * MIN_BLOCK;
}

size_t td__segment_size(size_t size) {
    if (size <= SMALL_SIZE) return SMALL_BUFFER;
    if (size < MIN_LARGE_ALLOC) return LARGE_BUFFER;
    return (size + ROUND_LARGE - 1) / ROUND_LARGE * ROUND_LARGE;
}

static size_t bucket_of(const void *p) { return ((uintptr_t)p >> 9) % TD__ALLOC_BUCKETS; }

void td__allocator_init(td__caching_allocator *a, const char *name, td__raw_memory raw) {
    memset(a, 0, sizeof *a);
    snprintf(a->name, sizeof a->name, "%s", name);
    a->raw = raw;
    pthread_mutex_init(&a->lock, NULL);
}

/* Unlinks b from the list at *head. */
static void unlink_from(td__block **head, td__block *b) {
    for (td__block **at = head; *at; at = &(*at)->link)
        if (*at == b) {
            *at = b->link;
            return;
        }
}

static void drop_events(td__caching_allocator *a, td__block *b) {
    for (int i = 0; i < b->nevents; i++) a->raw.event_destroy(a->raw.ctx, b->events[i]);
    b->nevents = 0;
}

/* b, no longer in use, back into its pool, merged with the free neighbours of its segment. */
static void free_block(td__caching_allocator *a, td__block *b) {
    b->state = TD__BLOCK_FREE;
    b->nused_on = 0;
    td__block *p = b->prev, *n = b->next;
    if (p && p->state == TD__BLOCK_FREE) {
        unlink_from(&a->pool[b->large], p);
        b->ptr = p->ptr;
        b->size += p->size;
        b->prev = p->prev;
        if (b->prev) b->prev->next = b;
        free(p);
    }
    if (n && n->state == TD__BLOCK_FREE) {
        unlink_from(&a->pool[b->large], n);
        b->size += n->size;
        b->next = n->next;
        if (b->next) b->next->prev = b;
        free(n);
    }
    b->link = a->pool[b->large];
    a->pool[b->large] = b;
}

/* Blocks whose other streams have passed them go back to their pools. */
static void process_pending(td__caching_allocator *a) {
    td__block **at = &a->pending;
    while (*at) {
        td__block *b = *at;
        int done = 1;
        for (int i = 0; i < b->nevents && done; i++)
            done = a->raw.event_done(a->raw.ctx, b->events[i]);
        if (!done) {
            at = &b->link;
            continue;
        }
        *at = b->link;
        drop_events(a, b);
        free_block(a, b);
    }
}

/* Gives back every free block that is a whole segment. */
static void release_cached(td__caching_allocator *a) {
    process_pending(a);
    for (int large = 0; large < 2; large++) {
        td__block **at = &a->pool[large];
        while (*at) {
            td__block *b = *at;
            if (b->prev || b->next) {
                at = &b->link;
                continue;
            }
            *at = b->link;
            a->raw.free(a->raw.ctx, b->ptr);
            a->stats.reserved -= b->size;
            free(b);
        }
    }
}

void td__allocator_empty_cache(td__caching_allocator *a) {
    pthread_mutex_lock(&a->lock);
    release_cached(a);
    pthread_mutex_unlock(&a->lock);
}

void td__allocator_destroy(td__caching_allocator *a) {
    /* Every block of every list; a segment is given back through its first block. */
    td__block *lists[3 + TD__ALLOC_BUCKETS] = {a->pool[0], a->pool[1], a->pending};
    memcpy(lists + 3, a->in_use, sizeof a->in_use);
    for (size_t l = 0; l < sizeof lists / sizeof *lists; l++)
        for (td__block *b = lists[l], *next; b; b = next) {
            next = b->link;
            drop_events(a, b);
            if (!b->prev) a->raw.free(a->raw.ctx, b->ptr);
            free(b);
        }
    memset(a->pool, 0, sizeof a->pool);
    a->pending = NULL;
    memset(a->in_use, 0, sizeof a->in_use);
    pthread_mutex_destroy(&a->lock);
}

/* The smallest free block of the pool on `stream` that holds size bytes (the lowest address
 * among equals), unlinked; NULL when none does. */
static td__block *best_fit(td__caching_allocator *a, int large, void *stream, size_t size) {
    td__block *best = NULL;
    for (td__block *b = a->pool[large]; b; b = b->link)
        if (b->stream == stream && b->size >= size &&
            (!best || b->size < best->size || (b->size == best->size && b->ptr < best->ptr)))
            best = b;
    if (best) unlink_from(&a->pool[large], best);
    return best;
}

/* A new segment of the pool for a block of size bytes, from the driver (the cache given back
 * and asked again when it has none left). */
static td_status new_segment(td__caching_allocator *a, int large, void *stream, size_t size,
                             td__block **out) {
    size_t bytes = td__segment_size(size);
    td__block *b = calloc(1, sizeof *b);
    if (!b) return td__fail(TD_ENOMEM, "%s: out of host memory", a->name);
    void *ptr;
    td_status s = a->raw.alloc(a->raw.ctx, bytes, &ptr);
    if (s == TD_ENOMEM) {
        release_cached(a);
        s = a->raw.alloc(a->raw.ctx, bytes, &ptr);
    }
    if (s != TD_OK) {
        free(b);
        if (s == TD_ENOMEM)
            return td__fail(TD_ENOMEM,
                            "%s: out of memory allocating %zu bytes (a segment of %zu; %zu in use, "
                            "%zu reserved by tandem)",
                            a->name, size, bytes, a->stats.in_use, a->stats.reserved);
        return s;
    }
    b->ptr = ptr;
    b->size = bytes;
    b->stream = stream;
    b->large = large;
    a->stats.reserved += bytes;
    a->stats.driver_allocs++;
    if (a->stats.reserved > a->stats.peak_reserved) a->stats.peak_reserved = a->stats.reserved;
    *out = b;
    return TD_OK;
}

td_status td__allocator_alloc(td__caching_allocator *a, size_t bytes, void *stream, void **out) {
    if (!out) return td__fail(TD_EINVAL, "%s: alloc: out is NULL", a->name);
    *out = NULL;
    if (bytes > SIZE_MAX / 2)
        return td__fail(TD_EINVAL, "%s: alloc of %zu bytes is too large", a->name, bytes);
    size_t size = td__block_size(bytes);
    int large = size > SMALL_SIZE;
    pthread_mutex_lock(&a->lock);
    process_pending(a);
    td__block *b = best_fit(a, large, stream, size);
    if (b) {
        a->stats.cache_hits++;
    } else {
        td_status s = new_segment(a, large, stream, size, &b);
        if (s != TD_OK) {
            pthread_mutex_unlock(&a->lock);
            return s;
        }
    }
    /* The rest becomes a free block of its own when worth keeping: any in the small pool, more
     * than 1 MiB in the large one. */
    size_t rest = b->size - size;
    if (large ? rest > SMALL_SIZE : rest >= MIN_BLOCK) {
        td__block *r = calloc(1, sizeof *r);
        if (r) {
            r->ptr = b->ptr + size;
            r->size = rest;
            r->stream = stream;
            r->large = large;
            r->state = TD__BLOCK_FREE;
            r->prev = b;
            r->next = b->next;
            if (r->next) r->next->prev = r;
            b->next = r;
            b->size = size;
            r->link = a->pool[large];
            a->pool[large] = r;
        }
    }
    b->state = TD__BLOCK_IN_USE;
    size_t h = bucket_of(b->ptr);
    b->link = a->in_use[h];
    a->in_use[h] = b;
    a->stats.in_use += b->size;
    a->stats.allocations++;
    if (a->stats.in_use > a->stats.peak_in_use) a->stats.peak_in_use = a->stats.in_use;
    pthread_mutex_unlock(&a->lock);
    *out = b->ptr;
    return TD_OK;
}

/* The in-use block at ptr, unlinked when unlink is set; NULL when ptr is not one. */
static td__block *find(td__caching_allocator *a, void *ptr, int unlink) {
    for (td__block **at = &a->in_use[bucket_of(ptr)]; *at; at = &(*at)->link)
        if ((*at)->ptr == ptr) {
            td__block *b = *at;
            if (unlink) *at = b->link;
            return b;
        }
    return NULL;
}

td_status td__allocator_record_stream(td__caching_allocator *a, void *ptr, void *stream) {
    pthread_mutex_lock(&a->lock);
    td__block *b = find(a, ptr, 0);
    td_status s = TD_OK;
    if (!b) {
        s = td__fail(TD_EINVAL, "%s: record_stream: %p is not memory in use from this device",
                     a->name, ptr);
    } else if (stream != b->stream) {
        int known = 0;
        for (int i = 0; i < b->nused_on; i++) known |= b->used_on[i] == stream;
        if (!known && b->nused_on == TD__BLOCK_STREAMS)
            s = td__fail(TD_EUNSUPPORTED, "%s: record_stream: %p is used on more than %d streams",
                         a->name, ptr, TD__BLOCK_STREAMS);
        else if (!known)
            b->used_on[b->nused_on++] = stream;
    }
    pthread_mutex_unlock(&a->lock);
    return s;
}

td_status td__allocator_free(td__caching_allocator *a, void *ptr) {
    if (!ptr) return TD_OK;
    pthread_mutex_lock(&a->lock);
    td__block *b = find(a, ptr, 1);
    if (!b) {
        pthread_mutex_unlock(&a->lock);
        return td__fail(TD_EINVAL,
                        "%s: free: %p is not memory in use from this device (freed "
                        "twice, or from another allocator)",
                        a->name, ptr);
    }
    a->stats.in_use -= b->size;
    td_status s = TD_OK;
    for (int i = 0; i < b->nused_on && s == TD_OK; i++) {
        s = a->raw.event_record(a->raw.ctx, b->used_on[i], &b->events[b->nevents]);
        if (s == TD_OK) b->nevents++;
    }
    if (b->nevents) {
        b->state = TD__BLOCK_PENDING;
        b->link = a->pending;
        a->pending = b;
    } else {
        free_block(a, b);
    }
    pthread_mutex_unlock(&a->lock);
    return s;
}

td_device_memory_stats td__allocator_stats(td__caching_allocator *a) {
    pthread_mutex_lock(&a->lock);
    td_device_memory_stats s = a->stats;
    pthread_mutex_unlock(&a->lock);
    return s;
}
