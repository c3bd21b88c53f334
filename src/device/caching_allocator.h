/* A stream-ordered caching allocator, as PyTorch's CUDA allocator is one: device memory is
 * asked from the driver once and then cached; a freed block goes back to its size class and
 * is handed out again on the stream it was allocated on (work on that stream runs in order,
 * so a later kernel cannot overtake the last reader). A block that other streams used
 * (td__allocator_record_stream) waits until events recorded on those streams at free time
 * have passed. Where the driver runs out, the cache is emptied and the request tried again.
 * The bookkeeping is plain C over a table of raw operations, so it runs (and is tested) over
 * host memory as well as device memory. Not installed. */
#ifndef TANDEM_CACHING_ALLOCATOR_H
#define TANDEM_CACHING_ALLOCATOR_H

#include <pthread.h>

#include "tandem/device.h"

/* Where blocks come from and how streams are followed. */
typedef struct {
    void *ctx;
    td_status (*alloc)(void *ctx, size_t bytes, void **ptr); /* TD_ENOMEM when none is left */
    void (*free)(void *ctx, void *ptr);
    td_status (*event_record)(void *ctx, void *stream, void **event);
    int (*event_done)(void *ctx, void *event);
    void (*event_destroy)(void *ctx, void *event);
} td__raw_memory;

#define TD__BLOCK_STREAMS 4 /* other streams one block may be used on */

typedef struct td__block {
    void *ptr;
    size_t size;  /* its size class */
    void *stream; /* the stream it belongs to */
    void *used_on[TD__BLOCK_STREAMS];
    int nused_on;
    void *events[TD__BLOCK_STREAMS]; /* recorded at free on used_on */
    int nevents;
    struct td__block *next;
} td__block;

#define TD__SIZE_CLASSES 224
#define TD__ALLOC_BUCKETS 256 /* in-use blocks hashed by address */

typedef struct {
    char name[32]; /* "cuda:0", for messages */
    td__raw_memory raw;
    pthread_mutex_t lock;
    td__block *cached[TD__SIZE_CLASSES];
    td__block *in_use[TD__ALLOC_BUCKETS];
    td_device_memory_stats stats;
} td__caching_allocator;

/* The size class a request of `bytes` is served from: 512 bytes at least, then four classes
 * per power of two (at most 25% rounding); *cls gets its index. */
size_t td__size_class(size_t bytes, int *cls);

void td__allocator_init(td__caching_allocator *a, const char *name, td__raw_memory raw);
/* Gives every block back to the raw source (blocks still in use included). */
void td__allocator_destroy(td__caching_allocator *a);

td_status td__allocator_alloc(td__caching_allocator *a, size_t bytes, void *stream, void **out);
td_status td__allocator_free(td__caching_allocator *a, void *ptr);
/* ptr (handed out by a) is also used on stream: it is reused only after that stream passed
 * the point where it was freed. */
td_status td__allocator_record_stream(td__caching_allocator *a, void *ptr, void *stream);
/* Frees every cached block whose streams have passed it. */
void td__allocator_empty_cache(td__caching_allocator *a);
td_device_memory_stats td__allocator_stats(td__caching_allocator *a);

#endif
