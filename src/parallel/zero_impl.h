/* What td_zero's files share: the layout of units and flat buffers (zero_layout.c), memory whose
 * pages go back to the system while its addresses stay reserved, and the byte accounting
 * (zero_region.c). The sharded gradient reducer (zero_reduce.c) reads the layout through
 * td_ddp's reducer_ctx. Not installed. */
#ifndef TANDEM_ZERO_IMPL_H
#define TANDEM_ZERO_IMPL_H

#include "tandem/zero.h"

#include "parallel/ddp_impl.h"

/* ---- memory (zero_region.c) ------------------------------------------------------------ */

/* The group's memory (td_comm_alloc: on one host every rank's collectives read it in place),
 * whose pages exist only while they are written and used: a freed copy gives its pages back,
 * reads as zeros, and keeps its address for the next use. */
typedef struct {
    unsigned char *base; /* (bytes), page aligned, or NULL */
    size_t bytes;
    td_comm *comm; /* what it came from */
} td__zero_region;

/* Collective: bytes (a multiple of the page size, the same on every rank) of comm's memory, all
 * reading as zeros; TD_ENOMEM naming `what` otherwise. */
td_status td__zero_region_alloc(td__zero_region *r, td_comm *comm, size_t bytes, int rank,
                                const char *what);

void td__zero_region_free(td__zero_region *r);

/* Makes the whole pages inside [off, off + bytes) of r this process's own memory, reading as
 * zeros: pages the other ranks never read, which may then move (td__zero_pool). */
td_status td__zero_region_private(td__zero_region *r, size_t off, size_t bytes);

/* Gives the whole pages inside [p, p + bytes) back to the system: they read as zeros after. */
void td__zero_release(void *p, size_t bytes);

/* Pages of a region's private parts kept for reuse instead of given back: a freed gathered copy
 * parks its pages (moved, not copied: mremap) at the same offset of a shadow reservation, and
 * the next gather moves them into place, so that neither the kernel's freeing and zeroing nor a
 * fault per page comes between two uses. At most `budget` bytes wait; the rest goes back. */
typedef struct {
    unsigned char *home;   /* the region's base */
    unsigned char *shadow; /* (bytes) reserved address space where parked pages wait */
    size_t bytes, budget, held;
    struct zero_parked {
        size_t at, bytes; /* parked pages at shadow + at */
    } * parked;
    size_t n_parked, cap;
} td__zero_pool;

/* A pool for the region `home` of `bytes`; budget 0 makes one that parks nothing. */
td_status td__zero_pool_init(td__zero_pool *p, unsigned char *home, size_t bytes, size_t budget,
                             int rank);

void td__zero_pool_free(td__zero_pool *p);

/* Frees the whole pages inside [at, at + bytes) of home: parked while the pool has room, else
 * given back (they read as zeros after either way). Returns the bytes parked. */
size_t td__zero_pool_park(td__zero_pool *p, size_t at, size_t bytes);

/* Moves parked pages into the whole pages inside [at, at + bytes) of home, as many as there are
 * (their old contents come along: the caller overwrites them). Returns the bytes moved. */
size_t td__zero_pool_take(td__zero_pool *p, size_t at, size_t bytes);

/* bytes rounded up to whole pages. */
size_t td__zero_pages(size_t bytes);

/* What the bytes a rank holds are for (td_zero_bytes without the optimizer's). */
enum { ZERO_PARAMS, ZERO_GRADS, ZERO_GATHERED, ZERO_REDUCING, ZERO_CACHED, ZERO_KINDS };

typedef struct {
    size_t now[ZERO_KINDS], peak[ZERO_KINDS];
    size_t total, peak_total;
} td__zero_account;

/* Adds (or with a negative delta takes away) bytes of a kind, keeping the peaks. */
void td__zero_account_add(td__zero_account *a, int kind, long long delta);

/* ---- layout (zero_layout.c) ------------------------------------------------------------ */

/* A flat buffer: the parameters of one dtype in one unit, back to back, padded to chunk *
 * world_size elements; rank r holds elements [r * chunk, (r + 1) * chunk). */
typedef struct {
    td_dtype dtype;
    size_t unit;
    size_t *members; /* (n_members) parameter indices, registration order */
    size_t *offset;  /* (n_members) each one's first element in the flat, 64-byte aligned */
    size_t n_members;
    size_t count;     /* elements the members span */
    size_t chunk;     /* elements per rank, a multiple of 64 bytes */
    size_t at;        /* the flat's byte offset in the parameter and gradient regions */
    size_t span;      /* its bytes there: chunk * world_size elements, whole pages */
    void *grad_shard; /* (chunk) the rank's reduced gradients (zero_reduce.c), or NULL */
    td_request *req;  /* stage 3: its gather in flight, or NULL */
} td__zero_flat;

/* A unit: consecutive parameters, gathered and freed together at stage 3. */
typedef struct {
    size_t first_param, n_params;
    size_t first_flat, n_flats;
    size_t forward_done;  /* parameters past their last forward read in this forward */
    size_t backward_done; /* parameters past their last backward read in this backward */
    int whole;            /* stage 3: gathered (or gathering: its flats' req are set) */
} td__zero_unit;

/* One entry of the optimizer's view: elements [param_offset, param_offset + count) of a
 * parameter, which are elements [flat_offset, ...) of its flat, in this rank's chunk. */
typedef struct {
    size_t param, param_offset, count;
    size_t flat, flat_offset;
} td__zero_view;

typedef struct {
    int rank, world;
    size_t chunk_bytes;   /* every chunk is a multiple of it (and of 64 bytes) */
    td__zero_flat *flats; /* (n_flats) in unit order, each unit's by dtype */
    size_t n_flats;
    td__zero_unit *units; /* (n_units) */
    size_t n_units;
    size_t *unit_of, *flat_of, *member_of; /* (n_params) */
    size_t region_bytes;                   /* the sum of the flats' spans */
    td__zero_view *views;                  /* (n_views) this rank's parts, flat by flat */
    size_t n_views;
    td__zero_account acct;
} td__zero_layout;

/* Plans units, flats and this rank's views over params[0..n): units begin at the first
 * parameter named `units[k]` or "<units[k]>.*" (units NULL: at each change of the names' part
 * before the first '.'); chunks are multiples of chunk_bytes (and of 64 bytes). TD_ENOTFOUND
 * names a unit that begins nowhere. */
td_status td__zero_plan(td__zero_layout *lay, const td_param *params, size_t n,
                        const char *const *units, size_t n_units, int rank, int world,
                        size_t chunk_bytes);

void td__zero_layout_free(td__zero_layout *lay);

/* ---- what the checkpoint functions read (zero.c) ------------------------------------- */

typedef struct {
    td_comm *comm;
    int rank, stage;
    td_param *params; /* (n_params) the caller's, data in the group's region */
    size_t n_params;
    const td__zero_layout *lay;
    td_param *views; /* (lay->n_views) the optimizer's entries */
} td__zero_parts;

void td__zero_parts_of(td_zero *z, td__zero_parts *out);

/* A load wrote the parameters (whole at stages 1 and 2, the chunks at stage 3): copies held
 * whole at stage 3 are gathered again. Collective when it gathers. */
td_status td__zero_loaded(td_zero *z);

/* ---- for a caller that clips over more groups than ZeRO's (the pipeline's stages) ---- */

/* Whether the gradients end sharded (stages 2 and 3 outside deterministic mode): then only the
 * views hold this rank's reduced part, else params[i].grad is whole on every rank once
 * td__zero_whole_grads ran (collective in deterministic mode). */
int td__zero_grads_sharded(const td_zero *z);
td_status td__zero_whole_grads(td_zero *z);

/* The bytes of flat f's chunk for `rank` inside its span. */
static inline size_t td__zero_chunk_at(const td__zero_flat *f, int rank) {
    return (size_t)rank * f->chunk * td_dtype_size(f->dtype);
}

#endif
