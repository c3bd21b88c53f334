/* Sharded checkpoints (checkpoint.h): part files that ranks write side by side, the index that
 * commits a save by naming them, the removal of the files of other saves, the assembly of whole
 * tensors from the parts when an index is opened, and consolidation into one file.
 *
 * A part file is a safetensors file whose tensors are 1-D runs of whole tensors; its metadata
 * "tandem.part" is a JSON object {"<name>": [offset, [dims...]], ...} giving for each run where it
 * starts in its tensor and the tensor's whole shape. The index is a safetensors file with no
 * tensors whose metadata "tandem.parts" is a JSON array of the part files' names (beside the
 * index; a name holding '/' is refused). Nothing here communicates: the caller makes sure every
 * part is written before it publishes. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/json_impl.h"
#include "core/core_impl.h"

#define PART_KEY "tandem.part"

/* "<path>.shard-<id>-<rank>-of-<world_size>" */
static char *part_path(const char *path, uint64_t id, int rank, int world_size) {
    size_t len = strlen(path) + 64;
    char *p = malloc(len);
    if (p)
        snprintf(p, len, "%s.shard-%016llx-%05d-of-%05d", path, (unsigned long long)id, rank,
                 world_size);
    return p;
}

static const char *base_name(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

/* path's directory, with a trailing '/' ("" for the current one); malloc'd. */
static char *dir_of(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? strndup(path, (size_t)(slash - path + 1)) : strdup("");
}

/* ---- writing ------------------------------------------------------------------------ */

td_status td_checkpoint_save_part(const char *path, uint64_t id, int rank, int world_size,
                                  const td_checkpoint_part *parts, size_t n) {
    if (!path || (!parts && n))
        return td__fail(TD_EINVAL, "td_checkpoint_save_part: path or parts is NULL");
    if (world_size < 1 || rank < 0 || rank >= world_size)
        return td__fail(TD_EINVAL, "%s: part of rank %d of a world of %d", path, rank, world_size);
    for (size_t i = 0; i < n; i++) {
        const td_param *t = &parts[i].tensor;
        if (!t->name) return td__fail(TD_EINVAL, "%s: part %zu has no tensor name", path, i);
        size_t whole = 1;
        for (int d = 0; d < t->ndim && d < TD_MAX_DIMS; d++)
            whole *= t->shape[d] > 0 ? (size_t)t->shape[d] : 0;
        if (t->ndim < 0 || t->ndim > TD_MAX_DIMS || parts[i].offset > whole ||
            parts[i].count > whole - parts[i].offset)
            return td__fail(TD_ESHAPE,
                            "%s: part of %s holds elements [%zu, %zu) of a tensor of %zu", path,
                            t->name, parts[i].offset, parts[i].offset + parts[i].count, whole);
    }
    td_param *runs = calloc(n ? n : 1, sizeof *runs);
    td__checkpoint_text meta = {0};
    char *file = part_path(path, id, rank, world_size);
    if (!runs || !file) {
        free(runs);
        free(file);
        return td__fail(TD_ENOMEM, "%s: out of memory", path);
    }
    td__checkpoint_text_put(&meta, "{", 1);
    for (size_t i = 0; i < n; i++) {
        const td_param *t = &parts[i].tensor;
        runs[i] = (td_param){.name = t->name,
                             .data = (void *)parts[i].data,
                             .count = parts[i].count,
                             .dtype = t->dtype,
                             .ndim = 1,
                             .shape = {(int64_t)parts[i].count}};
        if (i) td__checkpoint_text_put(&meta, ",", 1);
        td__checkpoint_text_json(&meta, t->name);
        td__checkpoint_text_printf(&meta, ":[%zu,[", parts[i].offset);
        for (int d = 0; d < t->ndim; d++)
            td__checkpoint_text_printf(&meta, d ? ",%lld" : "%lld", (long long)t->shape[d]);
        td__checkpoint_text_put(&meta, "]]", 2);
    }
    td__checkpoint_text_put(&meta, "}", 1);
    td_status s = meta.oom ? td__fail(TD_ENOMEM, "%s: out of memory", path) : TD_OK;
    td_checkpoint_meta m = {PART_KEY, meta.s};
    if (s == TD_OK) s = td_checkpoint_save(file, runs, n, &m, 1);
    free(meta.s);
    free(runs);
    free(file);
    return s;
}

/* Removes the part files of path's saves other than `keep` (NULL: none kept) and their
 * temporaries: what a killed save or a superseded checkpoint left. Failures only cost disk. */
static void remove_other_parts(const char *path, char *const *keep, size_t n_keep) {
    char *dir = dir_of(path);
    size_t plen = strlen(base_name(path)) + 7;
    char *prefix = malloc(plen + 1);
    if (!dir || !prefix) {
        free(dir);
        free(prefix);
        return;
    }
    snprintf(prefix, plen + 1, "%s.shard-", base_name(path));
    DIR *d = opendir(*dir ? dir : ".");
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, prefix, plen) != 0) continue;
        int kept = 0;
        for (size_t i = 0; i < n_keep && !kept; i++) kept = !strcmp(base_name(keep[i]), e->d_name);
        if (kept) continue;
        size_t len = strlen(dir) + strlen(e->d_name) + 1;
        char *victim = malloc(len);
        struct stat sb;
        if (victim) {
            snprintf(victim, len, "%s%s", dir, e->d_name);
            if (lstat(victim, &sb) == 0 && S_ISREG(sb.st_mode)) unlink(victim);
        }
        free(victim);
    }
    if (d) closedir(d);
    free(dir);
    free(prefix);
}

/* Opens the given part files into a checkpoint of no file of its own and assembles them. */
static td_status assemble_files(td_checkpoint *c, char *const *files, size_t n);

td_status td_checkpoint_publish(const char *path, uint64_t id, int world_size,
                                const td_checkpoint_meta *meta, size_t n_meta) {
    if (!path || (!meta && n_meta) || world_size < 1)
        return td__fail(TD_EINVAL, "td_checkpoint_publish: bad path, meta or world size %d",
                        world_size);
    for (size_t i = 0; i < n_meta; i++)
        if (meta[i].key && !strncmp(meta[i].key, "tandem.", 7))
            return td__fail(TD_EINVAL,
                            "%s: metadata key \"%s\": keys beginning \"tandem.\" are "
                            "the sharded checkpoint's own",
                            path, meta[i].key);
    size_t n = (size_t)world_size;
    char **files = calloc(n, sizeof *files);
    td_checkpoint_meta *all = calloc(n_meta + 1, sizeof *all);
    td__checkpoint_text list = {0};
    td_status s = files && all ? TD_OK : td__fail(TD_ENOMEM, "%s: out of memory", path);
    for (size_t r = 0; s == TD_OK && r < n; r++)
        if (!(files[r] = part_path(path, id, (int)r, world_size)))
            s = td__fail(TD_ENOMEM, "%s: out of memory", path);
    /* What the index will promise is checked first: every part there, together whole. */
    td_checkpoint *check = calloc(1, sizeof *check);
    if (check) check->fd = -1;
    if (check && !(check->path = strdup(path))) {
        free(check);
        check = NULL;
    }
    if (s == TD_OK && !check) s = td__fail(TD_ENOMEM, "%s: out of memory", path);
    if (s == TD_OK) s = assemble_files(check, files, n);
    td_checkpoint_close(check);
    td__checkpoint_text_put(&list, "[", 1);
    for (size_t r = 0; r < n && files && files[r]; r++) {
        if (r) td__checkpoint_text_put(&list, ",", 1);
        td__checkpoint_text_json(&list, base_name(files[r]));
    }
    td__checkpoint_text_put(&list, "]", 1);
    if (s == TD_OK && list.oom) s = td__fail(TD_ENOMEM, "%s: out of memory", path);
    if (s == TD_OK) {
        if (n_meta) memcpy(all, meta, n_meta * sizeof *all);
        all[n_meta] = (td_checkpoint_meta){TD__CHECKPOINT_PARTS_KEY, list.s};
        s = td_checkpoint_save(path, NULL, 0, all, n_meta + 1);
    }
    if (s == TD_OK) remove_other_parts(path, files, n);
    for (size_t r = 0; files && r < n; r++) free(files[r]);
    free(files);
    free(all);
    free(list.s);
    return s;
}

/* ---- reading ------------------------------------------------------------------------ */

/* One run of a tensor in one part file, while the parts are assembled. */
typedef struct {
    const char *name;
    size_t part, entry; /* which file, which of its tensors */
    size_t order;       /* first appearance, so that tensors keep the order they were saved in */
    size_t offset, count;
    td_dtype dtype;
    int ndim;
    int64_t shape[TD_MAX_DIMS];
} run;

static int cmp_run(const void *a, const void *b) {
    const run *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* A part's "tandem.part" entry for its tensor name: [offset, [dims...]]. */
static td_status part_info(const td_checkpoint *part, const td__json *info, const char *name,
                           run *r) {
    char shown[160];
    td__checkpoint_shown(shown, sizeof shown, name);
    const td__json *v = td__json_get(info, name);
    if (!v || v->kind != TD__JSON_ARRAY || v->n != 2 || v->items[0].kind != TD__JSON_NUMBER ||
        !v->items[0].is_uint || v->items[1].kind != TD__JSON_ARRAY || v->items[1].n > TD_MAX_DIMS)
        return td__fail(TD_EFORMAT,
                        "%s: tensor %s has no [offset, [dims]] entry in its \"" PART_KEY "\"",
                        part->path, shown);
    r->offset = (size_t)v->items[0].uint;
    r->ndim = (int)v->items[1].n;
    size_t whole = 1;
    for (int d = 0; d < r->ndim; d++) {
        const td__json *x = &v->items[1].items[d];
        if (x->kind != TD__JSON_NUMBER || !x->is_uint || x->uint > (uint64_t)INT32_MAX)
            return td__fail(TD_EFORMAT, "%s: tensor %s: dim %d of its shape is not a size",
                            part->path, shown, d);
        r->shape[d] = (int64_t)x->uint;
        whole *= (size_t)x->uint;
    }
    if (r->offset > whole || r->count > whole - r->offset)
        return td__fail(TD_EFORMAT, "%s: tensor %s: elements [%zu, %zu) of a tensor of %zu",
                        part->path, shown, r->offset, r->offset + r->count, whole);
    return TD_OK;
}

/* Every run of every part, in part and entry order. */
static td_status collect_runs(td_checkpoint *c, run **out, size_t *n_out) {
    size_t total = 0;
    for (size_t p = 0; p < c->n_parts; p++) total += c->parts[p]->n;
    run *runs = calloc(total ? total : 1, sizeof *runs);
    if (!runs) return td__fail(TD_ENOMEM, "%s: out of memory", c->path);
    size_t k = 0;
    td_status s = TD_OK;
    for (size_t p = 0; p < c->n_parts && s == TD_OK; p++) {
        td_checkpoint *part = c->parts[p];
        const char *text = td_checkpoint_get_meta(part, PART_KEY);
        char err[160];
        td__json *info = text ? td__json_parse(text, strlen(text), err, sizeof err) : NULL;
        if (!info || info->kind != TD__JSON_OBJECT)
            s = td__fail(TD_EFORMAT, "%s: metadata \"" PART_KEY "\" %s", part->path,
                         text ? "is not a JSON object" : "is missing: not a part file");
        for (size_t e = 0; s == TD_OK && e < part->n; e++, k++) {
            const td__checkpoint_entry *pe = &part->entries[e];
            runs[k] = (run){.name = pe->name,
                            .part = p,
                            .entry = e,
                            .order = k,
                            .count = pe->count,
                            .dtype = pe->dtype};
            if (pe->ndim != 1)
                s = td__fail(TD_EFORMAT, "%s: tensor %s is not a 1-D run", part->path, pe->name);
            else
                s = part_info(part, info, pe->name, &runs[k]);
        }
        td__json_free(info);
    }
    if (s != TD_OK) {
        free(runs);
        return s;
    }
    *out = runs;
    *n_out = total;
    return TD_OK;
}

/* The runs of one tensor, sorted by offset: one dtype and shape, covering it exactly once. */
static td_status check_cover(const td_checkpoint *c, const run *r, size_t n) {
    size_t at = 0, whole = 1;
    for (int d = 0; d < r[0].ndim; d++) whole *= (size_t)r[0].shape[d];
    for (size_t i = 0; i < n; i++) {
        int same = r[i].dtype == r[0].dtype && r[i].ndim == r[0].ndim;
        for (int d = 0; same && d < r[0].ndim; d++) same = r[i].shape[d] == r[0].shape[d];
        if (!same)
            return td__fail(TD_EFORMAT, "%s: tensor %s has another dtype or shape in %s than in %s",
                            c->path, r[0].name, c->parts[r[i].part]->path,
                            c->parts[r[0].part]->path);
        if (r[i].offset != at)
            return td__fail(TD_EFORMAT,
                            "%s: tensor %s: elements [%zu, %zu) are %s (the part files do not "
                            "cover it exactly once: one is missing or from another save)",
                            c->path, r[0].name, at < r[i].offset ? at : r[i].offset,
                            at < r[i].offset ? r[i].offset : at,
                            at < r[i].offset ? "in no part" : "in two parts");
        at += r[i].count;
    }
    if (at != whole)
        return td__fail(TD_EFORMAT,
                        "%s: tensor %s: elements [%zu, %zu) are in no part (a part file is "
                        "missing or from another save)",
                        c->path, r[0].name, at, whole);
    return TD_OK;
}

static int cmp_entry_order(const void *a, const void *b) {
    const td__checkpoint_entry *x = a, *y = b; /* begin holds the first run's order here */
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* Fills c->entries with the whole tensors c->parts hold. */
static td_status assemble(td_checkpoint *c) {
    run *runs = NULL;
    size_t n = 0;
    TD__TRY(collect_runs(c, &runs, &n));
    qsort(runs, n, sizeof *runs, cmp_run);
    free(c->entries); /* the index's own (empty) list */
    c->entries = calloc(n ? n : 1, sizeof *c->entries);
    td_status s = c->entries ? TD_OK : td__fail(TD_ENOMEM, "%s: out of memory", c->path);
    for (size_t i = 0; s == TD_OK && i < n;) {
        size_t j = i, first = runs[i].order;
        for (; j < n && !strcmp(runs[j].name, runs[i].name); j++)
            if (runs[j].order < first) first = runs[j].order;
        s = check_cover(c, runs + i, j - i);
        td__checkpoint_entry *e = &c->entries[c->n];
        if (s == TD_OK) {
            e->name = strdup(runs[i].name);
            e->pieces = calloc(j - i, sizeof *e->pieces);
            if (!e->name || !e->pieces) s = td__fail(TD_ENOMEM, "%s: out of memory", c->path);
            c->n++;
        }
        if (s != TD_OK) break;
        e->dtype = runs[i].dtype;
        e->ndim = runs[i].ndim;
        memcpy(e->shape, runs[i].shape, sizeof e->shape);
        e->count = 0;
        e->begin = first;
        for (size_t k = i; k < j; k++) {
            const td__checkpoint_entry *pe = &c->parts[runs[k].part]->entries[runs[k].entry];
            e->pieces[e->n_pieces++] =
                (td__checkpoint_piece){runs[k].part, pe->begin, runs[k].offset, runs[k].count};
            e->count += runs[k].count;
        }
        i = j;
    }
    free(runs);
    if (s == TD_OK) {
        qsort(c->entries, c->n, sizeof *c->entries, cmp_entry_order);
        for (size_t i = 0; i < c->n; i++) c->entries[i].begin = c->entries[i].end = 0;
    }
    return s;
}

static td_status assemble_files(td_checkpoint *c, char *const *files, size_t n) {
    c->parts = calloc(n ? n : 1, sizeof *c->parts);
    if (!c->parts) return td__fail(TD_ENOMEM, "%s: out of memory", c->path);
    for (size_t p = 0; p < n; p++) {
        td_status s = td__checkpoint_open_part(&c->parts[p], files[p]);
        if (s != TD_OK) {
            char msg[600];
            snprintf(msg, sizeof msg, "%s", td_last_error());
            return td__fail(s, "%s: part %zu of %zu: %s", c->path, p, n, msg);
        }
        c->n_parts++;
    }
    return assemble(c);
}

td_status td__checkpoint_open_parts(td_checkpoint *c) {
    const char *text = td_checkpoint_get_meta(c, TD__CHECKPOINT_PARTS_KEY);
    char err[160];
    if (c->n)
        return td__fail(TD_EFORMAT, "%s: a sharded checkpoint's index holds no tensors", c->path);
    td__json *list = td__json_parse(text, strlen(text), err, sizeof err);
    td_status s = TD_OK;
    if (!list || list->kind != TD__JSON_ARRAY || list->n == 0)
        s = td__fail(TD_EFORMAT,
                     "%s: metadata \"" TD__CHECKPOINT_PARTS_KEY
                     "\" is not a JSON array of part file names",
                     c->path);
    char *dir = dir_of(c->path), **files = calloc(list && list->n ? list->n : 1, sizeof *files);
    if (s == TD_OK && (!dir || !files)) s = td__fail(TD_ENOMEM, "%s: out of memory", c->path);
    for (size_t p = 0; s == TD_OK && p < list->n; p++) {
        const td__json *name = &list->items[p];
        if (name->kind != TD__JSON_STRING || !name->string[0] || strchr(name->string, '/') ||
            strlen(name->string) != name->string_len) {
            char shown[160];
            s = td__fail(TD_EFORMAT, "%s: part %zu (\"%s\") is not a file name beside the index",
                         c->path, p,
                         name->kind == TD__JSON_STRING
                             ? td__checkpoint_shown(shown, sizeof shown, name->string)
                             : "?");
            break;
        }
        size_t len = strlen(dir) + name->string_len + 1;
        if (!(files[p] = malloc(len)))
            s = td__fail(TD_ENOMEM, "%s: out of memory", c->path);
        else
            snprintf(files[p], len, "%s%s", dir, name->string);
    }
    if (s == TD_OK) s = assemble_files(c, files, list->n);
    for (size_t p = 0; files && list && p < list->n; p++) free(files[p]);
    free(files);
    free(dir);
    td__json_free(list);
    return s;
}

td_status td__checkpoint_read_pieces(td_checkpoint *c, const td__checkpoint_entry *e, size_t offset,
                                     size_t count, void *dst) {
    size_t es = td_dtype_size(e->dtype), end = offset + count;
    unsigned char *out = dst;
    for (size_t i = 0; i < e->n_pieces && offset < end; i++) {
        const td__checkpoint_piece *p = &e->pieces[i];
        if (p->offset + p->count <= offset) continue;
        size_t take = (p->offset + p->count < end ? p->offset + p->count : end) - offset;
        const td_checkpoint *part = c->parts[p->part];
        uint64_t at = part->data_start + p->begin + (uint64_t)(offset - p->offset) * es;
        if (!td__checkpoint_read_at(part->fd, out, take * es, at))
            return td__fail(TD_EIO, "%s: tensor %s: reading its part in %s failed", c->path,
                            e->name, part->path);
        out += take * es;
        offset += take;
    }
    return TD_OK;
}

/* ---- consolidation ------------------------------------------------------------------ */

td_status td_checkpoint_consolidate(const char *path, const char *out, const char *const *drop,
                                    size_t n_drop) {
    if (!path || !out || (!drop && n_drop))
        return td__fail(TD_EINVAL, "td_checkpoint_consolidate: path, out or drop is NULL");
    td_checkpoint *c;
    TD__TRY(td_checkpoint_open(&c, path));
    td_param *keep = calloc(c->n ? c->n : 1, sizeof *keep);
    td_checkpoint_meta *meta = calloc(c->n_meta ? c->n_meta : 1, sizeof *meta);
    td_status s = keep && meta ? TD_OK : td__fail(TD_ENOMEM, "%s: out of memory", path);
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
    for (size_t i = 0; s == TD_OK && i < c->n_meta; i++)
        if (strcmp(c->meta_keys[i], TD__CHECKPOINT_PARTS_KEY))
            meta[n_meta++] = (td_checkpoint_meta){c->meta_keys[i], c->meta_values[i]};
    if (s == TD_OK) s = td_checkpoint_save(out, keep, n, meta, n_meta);
    for (size_t i = 0; keep && i < n; i++) free(keep[i].data);
    free(keep);
    free(meta);
    td_checkpoint_close(c);
    return s;
}
