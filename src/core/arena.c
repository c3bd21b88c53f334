/* A bump allocator made of a chain of blocks. Reset keeps the blocks, so a graph that
 * allocates the same activations every step stops calling malloc after the first. */
#include <stdlib.h>

#include "core_impl.h"

#define TD_ARENA_ALIGN 64

typedef struct block {
    struct block *next;
    size_t size; /* usable bytes after the header */
    size_t used;
} block;

struct td_arena {
    block *head; /* first block; allocation walks from `current` */
    block *current;
    size_t block_bytes;
    size_t used;
    size_t peak;
};

static size_t align_up(size_t n) {
    return (n + TD_ARENA_ALIGN - 1) & ~(size_t)(TD_ARENA_ALIGN - 1);
}

static size_t header_bytes(void) { return align_up(sizeof(block)); }

td_status td_arena_create(td_arena **out, size_t block_bytes) {
    if (!out) return td__fail(TD_EINVAL, "td_arena_create: out is NULL");
    td_arena *a = calloc(1, sizeof *a);
    if (!a) return td__fail(TD_ENOMEM, "td_arena_create: out of memory");
    a->block_bytes = block_bytes ? block_bytes : (size_t)1 << 20;
    *out = a;
    return TD_OK;
}

void td_arena_destroy(td_arena *arena) {
    if (!arena) return;
    for (block *b = arena->head; b;) {
        block *next = b->next;
        free(b);
        b = next;
    }
    free(arena);
}

static block *block_new(size_t size) {
    block *b = aligned_alloc(TD_ARENA_ALIGN, align_up(header_bytes() + size));
    if (!b) return NULL;
    b->next = NULL;
    b->size = size;
    b->used = 0;
    return b;
}

void *td_arena_alloc(td_arena *arena, size_t bytes) {
    bytes = align_up(bytes ? bytes : 1);
    block *b = arena->current;
    while (b && b->size - b->used < bytes) b = b->next;
    if (!b) {
        size_t size = bytes > arena->block_bytes ? bytes : arena->block_bytes;
        b = block_new(size);
        if (!b) return NULL;
        if (arena->current) { /* splice after current so the reuse order stays stable */
            b->next = arena->current->next;
            arena->current->next = b;
        } else {
            b->next = arena->head;
            arena->head = b;
        }
    }
    arena->current = b;
    void *p = (char *)b + header_bytes() + b->used;
    b->used += bytes;
    arena->used += bytes;
    if (arena->used > arena->peak) arena->peak = arena->used;
    return p;
}

void td_arena_reset(td_arena *arena) {
    for (block *b = arena->head; b; b = b->next) b->used = 0;
    arena->current = arena->head;
    arena->used = 0;
}

size_t td_arena_used(const td_arena *arena) { return arena->used; }

size_t td_arena_peak(const td_arena *arena) { return arena->peak; }
