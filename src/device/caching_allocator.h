/* A stream-ordered caching allocator, as PyTorch's CUDA allocator is one: device memory is
 * asked from the driver in segments and then cached; a request is served from the smallest
 * cached block of its stream that fits, split when the rest is worth keeping, and a freed block
 * merges with its free neighbours. Sizes as PyTorch's: requests round up to 512 bytes; those of
 * 1 MiB or less share 2 MiB segments (the small pool), larger ones take a 20 MiB segment below
 * 10 MiB and otherwise a segment of their own size rounded up to 2 MiB (the large pool), so a
 * large request costs at most 2 MiB more than it asks. A block belongs to the stream it was
 * allocated on (work on that stream runs in order, so a later kernel cannot overtake the last
 * reader); one that other streams used (td__allocator_record_stream) returns to the cache once
 * events recorded on those streams at free time have passed. Where the driver runs out, the
 * cached segments are given back and the request tried again. The bookkeeping is plain C over a
 * table of raw operations, so it runs (and is tested) over host memory as well as device
 * memory. Not installed. */
#ifndef TANDEM_CACHING_ALLOCATOR_H
#define TANDEM_CACHING_ALLOCATOR_H

#include <pthread.h>

#include "tandem/device.h"

/* Where segments come from and how streams are followed. */
typedef struct {
    void *ctx;
    td_status (*alloc)(void *ctx, size_t bytes, void **ptr); /* TD_ENOMEM when none is left */
    void (*free)(void *ctx, void *ptr);
    td_status (*event_record)(void *ctx, void *stream, void **event);
    int (*event_done)(void *ctx, void *event);
    void (*event_destroy)(void *ctx, void *event);
} td__raw_memory;

#define TD__BLOCK_STREAMS 4 /* other streams one block may be used on */

/* A block of a segment: handed out, waiting for other streams, or free in its pool. */
typedef struct td__block {
    char *ptr;
    size_t size;
    void *stream;                  /* the stream its segment belongs to */
    int state;                     /* TD__BLOCK_IN_USE, _PENDING or _FREE */
    int large;                     /* of the large pool */
    struct td__block *prev, *next; /* its neighbours in the segment, by address */
    struct td__block *link;        /* the list it is on (in use, pending, or its pool) */
    void *used_on[TD__BLOCK_STREAMS];
    int nused_on;
    void *events[TD__BLOCK_STREAMS]; /* recorded at free on used_on */
    int nevents;
} td__block;

enum { TD__BLOCK_IN_USE, TD__BLOCK_PENDING, TD__BLOCK_FREE };

#define TD__ALLOC_BUCKETS 256 /* blocks in use hashed by address */

typedef struct {
    char name[32]; /* "cuda:0", for messages */
    td__raw_memory raw;
    pthread_mutex_t lock;
    td__block *pool[2]; /* free blocks: the small pool, the large pool */
    td__block *pending; /* freed, waiting until other streams pass their events */
    td__block *in_use[TD__ALLOC_BUCKETS];
    td_device_memory_stats stats;
} td__caching_allocator;

/* What a request of `bytes` takes from a block: bytes rounded up to a multiple of 512. */
size_t td__block_size(size_t bytes);
/* The segment the driver is asked for when no cached block fits a block of `size`. */
size_t td__segment_size(size_t size);

void td__allocator_init(td__caching_allocator *a, const char *name, td__raw_memory raw);
/* Gives every segment back to the raw source (blocks still in use included). */
void td__allocator_destroy(td__caching_allocator *a);

td_status td__allocator_alloc(td__caching_allocator *a, size_t bytes, void *stream, void **out);
td_status td__allocator_free(td__caching_allocator *a, void *ptr);
/* ptr (handed out by a) is also used on stream: it is reused only after that stream passed
 * the point where it was freed. */
td_status td__allocator_record_stream(td__caching_allocator *a, void *ptr, void *stream);
/* Gives back every cached segment no block of which is in use or waits for a stream. */
void td__allocator_empty_cache(td__caching_allocator *a);
td_device_memory_stats td__allocator_stats(td__caching_allocator *a);

#endif
