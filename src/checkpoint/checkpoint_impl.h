/* What the checkpoint reader's files share: an opened checkpoint, which is either one
 * safetensors file (safetensors.c) or the index of a sharded checkpoint whose tensors are
 * assembled from parts in other files (sharded.c), and the reads both serve. Not installed. */
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

struct td_checkpoint {
    char *path;
    int fd;
    uint64_t data_start;           /* 8 + N */
    td__checkpoint_entry *entries; /* (n) */
    size_t n;
    char **meta_keys;   /* (n_meta) */
    char **meta_values; /* (n_meta) */
    size_t n_meta;
    td_checkpoint **parts; /* (n_parts) a sharded checkpoint's part files, opened */
    size_t n_parts;
};

/* The metadata key that makes a checkpoint file the index of a sharded one: a JSON array of the
 * part files' names, relative to the index's directory. */
#define TD__CHECKPOINT_PARTS_KEY "tandem.parts"

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

/* Reads `bytes` at byte `off` of an open file, retrying short reads; 0 on failure. */
int td__checkpoint_read_at(int fd, void *buf, size_t bytes, uint64_t off);

/* td_checkpoint_open of a file that must not be a sharded checkpoint's index (a part). */
td_status td__checkpoint_open_part(td_checkpoint **out, const char *path);

/* A sharded index just parsed (no tensors, TD__CHECKPOINT_PARTS_KEY in its metadata): opens the
 * parts and fills c->entries with the tensors they hold together, checking that the parts agree
 * on each tensor's dtype and shape and cover every element once (sharded.c). */
td_status td__checkpoint_open_parts(td_checkpoint *c);

/* Elements [offset, offset + count) of a sharded checkpoint's tensor e into dst (sharded.c). */
td_status td__checkpoint_read_pieces(td_checkpoint *c, const td__checkpoint_entry *e, size_t offset,
                                     size_t count, void *dst);

#endif
