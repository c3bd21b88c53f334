/* Consolidation: a checkpoint of either kind written as one safetensors file of whole tensors
 * (tandem-consolidate), with its metadata less the sharded checkpoint's own keys. It reads
 * through the front and writes with td_checkpoint_save, so the file appears whole or not at all.
 * It refuses a checkpoint that holds no tensors (an index that lost its list of parts reads as
 * one) and an output that is the checkpoint's own index or one of its parts, which the write
 * would replace under the reader. */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tandem/checkpoint.h"

#include "checkpoint/checkpoint_impl.h"
#include "core/core_impl.h"

/* Whether the open file f is the file `out` names (the same inode). */
static int same_file(const td__safetensors *f, const struct stat *out) {
    struct stat sb;
    return fstat(f->fd, &sb) == 0 && sb.st_dev == out->st_dev && sb.st_ino == out->st_ino;
}

/* TD_EINVAL naming both when out is c's index or one of its part files. */
static td_status check_out(const td_checkpoint *c, const char *path, const char *out) {
    struct stat sb;
    if (stat(out, &sb) != 0) return TD_OK; /* not there yet: none of c's files */
    if (same_file(&c->file, &sb))
        return td__fail(TD_EINVAL,
                        "%s: is the checkpoint %s itself; write the consolidated file elsewhere",
                        out, path);
    const td__safetensors *part;
    for (size_t i = 0; (part = td__sharded_part(c->sharded, i)) != NULL; i++)
        if (same_file(part, &sb))
            return td__fail(TD_EINVAL,
                            "%s: is part %zu of the checkpoint %s; write the consolidated file "
                            "elsewhere",
                            out, i, path);
    return TD_OK;
}

td_status td_checkpoint_consolidate(const char *path, const char *out, const char *const *drop,
                                    size_t n_drop) {
    if (!path || !out || (!drop && n_drop))
        return td__fail(TD_EINVAL, "td_checkpoint_consolidate: path, out or drop is NULL");
    td_checkpoint *c;
    TD__TRY(td_checkpoint_open(&c, path));
    td_status s = check_out(c, path, out);
    if (s == TD_OK && c->n == 0)
        s = td__fail(TD_EFORMAT, "%s: holds no tensors, so there is nothing to consolidate", path);
    const td__safetensors *f = &c->file;
    td_param *keep = calloc(c->n ? c->n : 1, sizeof *keep);
    td_checkpoint_meta *meta = calloc(f->n_meta ? f->n_meta : 1, sizeof *meta);
    if (s == TD_OK && (!keep || !meta)) s = td__fail(TD_ENOMEM, "%s: out of memory", path);
    size_t n = 0, n_meta = 0;
    for (size_t i = 0; s == TD_OK && i < c->n; i++) {
        int dropped = 0;
        for (size_t k = 0; k < n_drop && !dropped; k++)
            dropped = drop[k] && !strncmp(c->entries[i].name, drop[k], strlen(drop[k]));
        if (dropped) continue;
        s = td_checkpoint_tensor(c, i, &keep[n]);
        size_t bytes = keep[n].count * td_dtype_size(keep[n].dtype);
        if (s == TD_OK && !(keep[n].data = malloc(bytes ? bytes : 1)))
            s = td__fail(TD_ENOMEM, "%s: out of memory for tensor %s (%zu bytes)", path,
                         keep[n].name, bytes);
        if (s == TD_OK) s = td_checkpoint_read(c, &keep[n], 1);
        n++;
    }
    /* "tandem.*" keys say how the sharded checkpoint was stored, which the one file is not. */
    for (size_t i = 0; s == TD_OK && i < f->n_meta; i++)
        if (strncmp(f->meta_keys[i], "tandem.", 7))
            meta[n_meta++] = (td_checkpoint_meta){f->meta_keys[i], f->meta_values[i]};
    if (s == TD_OK) s = td_checkpoint_save(out, keep, n, meta, n_meta);
    for (size_t i = 0; keep && i < n; i++) free(keep[i].data);
    free(keep);
    free(meta);
    td_checkpoint_close(c);
    return s;
}
