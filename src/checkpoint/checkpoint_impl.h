/* What the checkpoint files share. A checkpoint opens through the front (checkpoint.c), which
 * reads either kind: one safetensors file (safetensors.c), or the index of a sharded checkpoint
 * whose tensors are assembled from its part files (sharded.c). safetensors.c knows nothing of
 * sharding, sharded.c reads and writes its files through safetensors.c, and neither calls the
 * front. Not installed. */
#ifndef TANDEM_CHECKPOINT_IMPL_H
#define TANDEM_CHECKPOINT_IMPL_H

#include <stdint.h>

#include "tandem/checkpoint.h"

#include "core/core_impl.h"

/* Where elements [offset, offset + count) of a sharded checkpoint's tensor lie: bytes from
 * `begin` of part file `part`'s data. */
typedef struct {
    size_t part;
    uint64_t begin;
    size_t offset, count;
} td__checkpoint_piece;

/* A tensor as a reader sees it: bytes [begin, end) of one file's byte buffer, or pieces of a
 * sharded checkpoint's part files. */
typedef struct {
    char *name;
    td_dtype dtype;
    int ndim;
    int64_t shape[TD_MAX_DIMS];
    size_t count;
    uint64_t begin, end;          /* one file: bytes relative to the start of the byte buffer */
    td__checkpoint_piece *pieces; /* sharded: (n_pieces) in offset order, covering [0, count) */
    size_t n_pieces;
} td__checkpoint_entry;

/* ---- one safetensors file (safetensors.c) ---------------------------------------------- */

/* An open safetensors file whose header has been validated. */
typedef struct {
    char *path;
    int fd;
    uint64_t data_start;           /* 8 + N */
    td__checkpoint_entry *entries; /* (n) */
    size_t n;
    char **meta_keys;   /* (n_meta) */
    char **meta_values; /* (n_meta) */
    size_t n_meta;
} td__safetensors;

/* Opens path and validates its header (checkpoint.h's td_checkpoint_open says what); on failure
 * *f is left closed. */
td_status td__safetensors_open(td__safetensors *f, const char *path);

/* Closes the file and frees what td__safetensors_open allocated; a closed one is left alone. */
void td__safetensors_close(td__safetensors *f);

/* The metadata value of key, or NULL. */
const char *td__safetensors_meta(const td__safetensors *f, const char *key);

/* Elements [offset, offset + count) of f's tensor e into host memory dst. */
td_status td__safetensors_read(const td__safetensors *f, const td__checkpoint_entry *e,
                               size_t offset, size_t count, void *dst);

/* The format's name of a dtype ("F32"), or NULL for one it cannot hold. */
const char *td__safetensors_dtype(td_dtype dtype);

/* Text built piece by piece (a header, a metadata value): oom is set once an allocation failed,
 * after which nothing more is added. */
typedef struct {
    char *s; /* NUL-terminated, (len) characters */
    size_t len, cap;
    int oom;
} td__checkpoint_text;

void td__checkpoint_text_put(td__checkpoint_text *b, const char *s, size_t n);
void td__checkpoint_text_printf(td__checkpoint_text *b, const char *fmt, ...) TD__PRINTF(2, 3);
/* s as a quoted, escaped JSON string. */
void td__checkpoint_text_json(td__checkpoint_text *b, const char *s);

/* Text read from a file as a message shows it: escaped, cut with "..." past cap (cap >= 4). */
const char *td__checkpoint_shown(char *buf, size_t cap, const char *text);

/* ---- sharded checkpoints (sharded.c) --------------------------------------------------- */

/* The parts of a sharded checkpoint, open, checked to be the index's save and assembled. */
typedef struct td__sharded td__sharded;

/* Whether an open file is a sharded checkpoint's index (its metadata names the parts, or the
 * save, without being a part). */
int td__sharded_is_index(const td__safetensors *f);

/* Opens the parts the index names, checks that each is the part of the index's save, of its rank
 * and world size, and that together they hold every tensor whole, exactly once, with one dtype
 * and shape; assembles the tensors. */
td_status td__sharded_open(td__sharded **out, const td__safetensors *index);

/* Closes the parts; NULL-safe. */
void td__sharded_close(td__sharded *s);

/* The whole tensors the parts hold, in the order they were saved. */
const td__checkpoint_entry *td__sharded_entries(const td__sharded *s, size_t *n);

/* Elements [offset, offset + count) of tensor e (one of td__sharded_entries) into host memory. */
td_status td__sharded_read(const td__sharded *s, const td__checkpoint_entry *e, size_t offset,
                           size_t count, void *dst);

/* The i-th part file (i < the number of parts), or NULL. */
const td__safetensors *td__sharded_part(const td__sharded *s, size_t i);

/* ---- the front (checkpoint.c) ----------------------------------------------------------- */

struct td_checkpoint {
    td__safetensors file;                /* what was opened: the tensors' file, or an index */
    td__sharded *sharded;                /* an index's parts, else NULL */
    const td__checkpoint_entry *entries; /* (n) the tensors: file's own or the parts' */
    size_t n;
};

#endif
