/* The caching allocator's bookkeeping (see caching_allocator.h): size classes, per-class
 * lists of cached blocks, a hash of blocks in use, events for blocks other streams used, and
 * the counters torch.cuda.memory_stats also keeps. */
#include "device/caching_allocator.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"

size_t td__size_class(size_t bytes, int *cls) {
    if (bytes <= 512) {
        *cls = 0;
        return 512;
    }
    int k = 63 - __builtin_clzll((unsigned long long)(bytes - 1)); /* 2^k < bytes <= 2^(k+1) */
    size_t step = (size_t)1 << (k - 2);                            /* an eighth of 2^(k+1) */
    size_t m = (bytes + step - 1) / step;                          /* 5..8 */
    *cls = 1 + (k - 9) * 4 + (int)(m - 5);
    return m * step;
}

static size_t bucket_of(const void *p) { return ((uintptr_t)p >> 9) % TD__ALLOC_BUCKETS; }

void td__allocator_init(td__caching_allocator *a, const char *name, td__raw_memory raw) {
    memset(a, 0, sizeof *a);
    snprintf(a->name, sizeof a->name, "%s", name);
    a->raw = raw;
    pthread_mutex_init(&a->lock, NULL);
}

static void release(td__caching_allocator *a, td__block *b) {
    for (int i = 0; i < b->nevents; i++) a->raw.event_destroy(a->raw.ctx, b->events[i]);
    a->raw.free(a->raw.ctx, b->ptr);
    a->stats.reserved -= b->size;
    free(b);
}

void td__allocator_destroy(td__caching_allocator *a) {
    for (int c = 0; c < TD__SIZE_CLASSES; c++)
        while (a->cached[c]) {
            td__block *b = a->cached[c];
            a->cached[c] = b->next;
            release(a, b);
        }
    for (int h = 0; h < TD__ALLOC_BUCKETS; h++)
        while (a->in_use[h]) {
            td__block *b = a->in_use[h];
            a->in_use[h] = b->next;
            release(a, b);
        }
    pthread_mutex_destroy(&a->lock);
}

/* 1 once every stream that used b has passed its free; its events are then dropped. */
static int passed(td__caching_allocator *a, td__block *b) {
    for (int i = 0; i < b->nevents; i++)
        if (!a->raw.event_done(a->raw.ctx, b->events[i])) return 0;
    for (int i = 0; i < b->nevents; i++) a->raw.event_destroy(a->raw.ctx, b->events[i]);
    b->nevents = 0;
    return 1;
}

static void empty_locked(td__caching_allocator *a) {
    for (int c = 0; c < TD__SIZE_CLASSES; c++) {
        td__block **at = &a->cached[c];
        while (*at) {
            td__block *b = *at;
            if (passed(a, b)) {
                *at = b->next;
                release(a, b);
            } else {
                at = &b->next;
            }
        }
    }
}

void td__allocator_empty_cache(td__caching_allocator *a) {
    pthread_mutex_lock(&a->lock);
    empty_locked(a);
    pthread_mutex_unlock(&a->lock);
}

static void hand_out(td__caching_allocator *a, td__block *b) {
    size_t h = bucket_of(b->ptr);
    b->next = a->in_use[h];
    a->in_use[h] = b;
    a->stats.in_use += b->size;
    a->stats.allocations++;
    if (a->stats.in_use > a->stats.peak_in_use) a->stats.peak_in_use = a->stats.in_use;
}

td_status td__allocator_alloc(td__caching_allocator *a, size_t bytes, void *stream, void **out) {
    if (!out) return td__fail(TD_EINVAL, "%s: alloc: out is NULL", a->name);
    *out = NULL;
    int cls;
    size_t size = td__size_class(bytes ? bytes : 1, &cls);
    if (cls >= TD__SIZE_CLASSES)
        return td__fail(TD_EINVAL, "%s: alloc of %zu bytes is too large", a->name, bytes);
    pthread_mutex_lock(&a->lock);
    for (td__block **at = &a->cached[cls]; *at; at = &(*at)->next) {
        td__block *b = *at;
        if (b->stream != stream || !passed(a, b)) continue;
        *at = b->next;
        b->nused_on = 0;
        hand_out(a, b);
        a->stats.cache_hits++;
        pthread_mutex_unlock(&a->lock);
        *out = b->ptr;
        return TD_OK;
    }
    td__block *b = calloc(1, sizeof *b);
    td_status s = b ? a->raw.alloc(a->raw.ctx, size, &b->ptr) : TD_ENOMEM;
    if (s == TD_ENOMEM && b) { /* give the cache back to the driver and ask again */
        empty_locked(a);
        s = a->raw.alloc(a->raw.ctx, size, &b->ptr);
    }
    if (s != TD_OK) {
        td_device_memory_stats st = a->stats;
        pthread_mutex_unlock(&a->lock);
        free(b);
        if (s == TD_ENOMEM)
            return td__fail(TD_ENOMEM,
                            "%s: out of memory allocating %zu bytes (%zu in use, %zu reserved by "
                            "tandem)",
                            a->name, bytes, st.in_use, st.reserved);
        return s;
    }
    b->size = size;
    b->stream = stream;
    a->stats.reserved += size;
    a->stats.driver_allocs++;
    if (a->stats.reserved > a->stats.peak_reserved) a->stats.peak_reserved = a->stats.reserved;
    hand_out(a, b);
    pthread_mutex_unlock(&a->lock);
    *out = b->ptr;
    return TD_OK;
}

/* The in-use block at ptr, unlinked when unlink is set; NULL when ptr is not one. */
static td__block *find(td__caching_allocator *a, void *ptr, int unlink) {
    for (td__block **at = &a->in_use[bucket_of(ptr)]; *at; at = &(*at)->next)
        if ((*at)->ptr == ptr) {
            td__block *b = *at;
            if (unlink) *at = b->next;
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
    td_status s = TD_OK;
    for (int i = 0; i < b->nused_on && s == TD_OK; i++) {
        s = a->raw.event_record(a->raw.ctx, b->used_on[i], &b->events[b->nevents]);
        if (s == TD_OK) b->nevents++;
    }
    a->stats.in_use -= b->size;
    int cls;
    td__size_class(b->size, &cls);
    b->next = a->cached[cls];
    a->cached[cls] = b;
    pthread_mutex_unlock(&a->lock);
    return s;
}

td_device_memory_stats td__allocator_stats(td__caching_allocator *a) {
    pthread_mutex_lock(&a->lock);
    td_device_memory_stats s = a->stats;
    pthread_mutex_unlock(&a->lock);
    return s;
}
