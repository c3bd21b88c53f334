/* Checkpoints in the safetensors format: an 8-byte little-endian header length, a JSON
 * header {"name": {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}, then the raw
 * little-endian tensor bytes. Files load in Python's safetensors package and vice versa.
 *
 * Saves are atomic (temp file in the same directory, fsync, rename). Loads validate the
 * whole header before touching the caller's memory. It does not memory-map or convert dtypes. */
#ifndef TANDEM_CHECKPOINT_H
#define TANDEM_CHECKPOINT_H

#include <stdint.h>

#include "tandem/core.h"
#include "tandem/param.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One string entry of the header's "__metadata__" (epoch, step, rng state, ...). */
typedef struct {
    const char *key;
    const char *value;
} td_checkpoint_meta;

/* Writes tensors[0..n) (by name, data only) and meta[0..n_meta) to path, replacing any file
 * there only once the new one is complete on disk. The temporary is "<path>.tmp.XXXXXX";
 * ones left by a save that was killed are removed by the next save of the same path. */
td_status td_checkpoint_save(const char *path, const td_param *tensors, size_t n,
                             const td_checkpoint_meta *meta, size_t n_meta);

/* An opened, fully validated checkpoint file. */
typedef struct td_checkpoint td_checkpoint;

/* Opens path and validates its header: length vs file size, JSON syntax, known dtypes,
 * shape x dtype size == byte span, offsets in bounds, contiguous and non-overlapping.
 * A path that is a directory or not a regular file is TD_EINVAL, a missing one TD_ENOTFOUND. */
td_status td_checkpoint_open(td_checkpoint **out, const char *path);

/* Closes the file and frees the parsed header; NULL-safe. */
void td_checkpoint_close(td_checkpoint *checkpoint);

/* Number of tensors in the file. */
size_t td_checkpoint_count(const td_checkpoint *checkpoint);

/* Description of the i-th tensor (in header order); name is owned by the checkpoint and data,
 * grad are NULL. */
td_status td_checkpoint_tensor(const td_checkpoint *checkpoint, size_t i, td_param *info);

/* Reads each tensors[i] by name into tensors[i].data, after checking that every one exists
 * with the same dtype and shape; tensors the file has beyond these are ignored. A
 * tensor-parallel slice (tensors[i].split) reads its part of the whole tensor of its name,
 * whose shape the file must have: a checkpoint holds whole tensors, whatever layout wrote it. */
td_status td_checkpoint_read(td_checkpoint *checkpoint, td_param *tensors, size_t n);

/* The metadata value of key, or NULL when absent; owned by the checkpoint. */
const char *td_checkpoint_get_meta(const td_checkpoint *checkpoint, const char *key);

/* The metadata value of key as a decimal integer ("-?[0-9]+", nothing around it) in
 * [min, max]: TD_ENOTFOUND when key is absent, TD_EFORMAT naming the file, key, value and
 * range when the value is not such a number; *out is written only on success. */
td_status td_checkpoint_get_meta_i64(const td_checkpoint *checkpoint, const char *key, int64_t min,
                                     int64_t max, int64_t *out);

/* The same for unsigned values ("[0-9]+", no sign), e.g. RNG seeds and offsets. */
td_status td_checkpoint_get_meta_u64(const td_checkpoint *checkpoint, const char *key, uint64_t min,
                                     uint64_t max, uint64_t *out);

/* Open, read, close in one call. */
td_status td_checkpoint_load(const char *path, td_param *tensors, size_t n);

/* Elements [offset, offset + count) of a tensor flattened in row-major order into host memory
 * dst. `tensor` describes the whole tensor the reader expects (name, dtype, shape, count; its data
 * is not read): checked as td_checkpoint_read checks, so another shape of as many elements is
 * TD_ESHAPE naming both shapes; elements beyond the tensor are TD_ESHAPE too. */
td_status td_checkpoint_read_range(td_checkpoint *checkpoint, const td_param *tensor, size_t offset,
                                   size_t count, void *dst);

/* ---- sharded checkpoints ----------------------------------------------------------------
 *
 * A sharded checkpoint at `path` is a set of part files beside it, each written by one rank with
 * the parts of tensors that rank holds, and `path` itself, the index: a safetensors file with no
 * tensors whose metadata names the part files (key "tandem.parts") besides the caller's. It
 * opens as one checkpoint: td_checkpoint_open on the index gives the whole tensors, assembled
 * from the parts (which must cover each exactly once), so every reader above reads either kind.
 * Part files are "<path>.shard-<id>-<rank>-of-<world_size>", id (16 hex digits) naming the save;
 * each part's metadata carries the save's id, its rank and the world size too, and the index the
 * id, so that a part file of another save under this save's name is refused when the index is
 * opened (TD_EFORMAT naming the file and both identities). Writing the index is the save's commit:
 * until its rename, `path` is the previous checkpoint, whole, whatever process dies
 * (docs/zero.md). */

/* A part of a tensor: elements [offset, offset + count) of `tensor` flattened in row-major order
 * (tensor's name, dtype and shape describe the whole; its data is not read), from data. */
typedef struct {
    td_param tensor;
    size_t offset, count;
    const void *data;
} td_checkpoint_part;

/* Writes the part file of `rank` for save `id` of the sharded checkpoint at path (atomically,
 * as td_checkpoint_save). A tensor appears at most once per part file. Every save of a path
 * needs its own id: draw it at random. */
td_status td_checkpoint_save_part(const char *path, uint64_t id, int rank, int world_size,
                                  const td_checkpoint_part *parts, size_t n);

/* Commits save `id`: checks that its world_size part files are that save's, of their ranks, and
 * cover every tensor they name exactly once with one dtype and shape, writes the index at path
 * with meta (keys beginning "tandem." are reserved) atomically, then removes the part files of
 * every other save of path. Call it once, after every rank's td_checkpoint_save_part of the save
 * succeeded. */
td_status td_checkpoint_publish(const char *path, uint64_t id, int world_size,
                                const td_checkpoint_meta *meta, size_t n_meta);

/* Writes the checkpoint at path (sharded or not) as one safetensors file at out, with its
 * metadata and every tensor whose name begins with none of drop[0..n_drop) ("optim." leaves the
 * model alone), whole: what PyTorch's safetensors.torch.load_file reads. A checkpoint with no
 * tensors is TD_EFORMAT, and an out that is the checkpoint's index or one of its parts TD_EINVAL,
 * with nothing written. */
td_status td_checkpoint_consolidate(const char *path, const char *out, const char *const *drop,
                                    size_t n_drop);

#ifdef __cplusplus
}
#endif
#endif
