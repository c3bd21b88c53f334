/* Sharded checkpoints (checkpoint.h): part files that ranks write side by side, the index that
 * commits a save by naming them, the removal of the files of other saves, and the assembly of
 * whole tensors from the parts when an index is opened.
 *
 * A part file is a safetensors file whose tensors are 1-D runs of whole tensors; its metadata
 * "tandem.part" is a JSON object {"<name>": [offset, [dims...]], ...} giving for each run where it
 * starts in its tensor and the tensor's whole shape, and "tandem.save", "tandem.rank" and
 * "tandem.world_size" say whose part it is: the save's id (16 hex digits), the rank that wrote it
 * and the world size. The index is a safetensors file with no tensors whose metadata
 * "tandem.parts" is a JSON array of the part files' names (beside the index; a name holding '/'
 * is refused), rank 0's first, and "tandem.save" the save's id: a part is accepted only where the
 * index lists it, carrying the index's save, its rank and world size, so a part of another save
 * under this save's file name is refused. Files are read and written through safetensors.c.
 * Nothing here communicates: the caller makes sure every part is written before it publishes. */
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
#define PARTS_KEY "tandem.parts"
#define SAVE_KEY "tandem.save"
#define RANK_KEY "tandem.rank"
#define WORLD_KEY "tandem.world_size"

typedef td__checkpoint_entry entry;

struct td__sharded {
    char *index;            /* the index's path, for messages */
    td__safetensors *parts; /* (n_parts) opened */
    size_t n_parts;
    entry *entries; /* (n) the whole tensors, in the order they were saved */
    size_t n;
};

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
    char save[17], rank_text[16], world_text[16];
    snprintf(save, sizeof save, "%016llx", (unsigned long long)id);
    snprintf(rank_text, sizeof rank_text, "%d", rank);
    snprintf(world_text, sizeof world_text, "%d", world_size);
    td_checkpoint_meta m[] = {
        {PART_KEY, meta.s}, {SAVE_KEY, save}, {RANK_KEY, rank_text}, {WORLD_KEY, world_text}};
    if (s == TD_OK) s = td_checkpoint_save(file, runs, n, m, sizeof m / sizeof *m);
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

/* Opens files[0..n), the parts of save `save` (16 hex digits) at `index` in rank order, checks
 * that each is that save's part of its rank and world size, and assembles them (below). */
static td_status sharded_open_files(td__sharded **out, const char *index, char *const *files,
                                    size_t n, const char *save);

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
    char **files = calloc(n, sizeof *files), save[17];
    snprintf(save, sizeof save, "%016llx", (unsigned long long)id);
    td_checkpoint_meta *all = calloc(n_meta + 2, sizeof *all);
    td__checkpoint_text list = {0};
    td_status s = files && all ? TD_OK : td__fail(TD_ENOMEM, "%s: out of memory", path);
    for (size_t r = 0; s == TD_OK && r < n; r++)
        if (!(files[r] = part_path(path, id, (int)r, world_size)))
            s = td__fail(TD_ENOMEM, "%s: out of memory", path);
    /* What the index will promise is checked first: every part there, of this save, whole. */
    td__sharded *check = NULL;
    if (s == TD_OK) s = sharded_open_files(&check, path, files, n, save);
    td__sharded_close(check);
    td__checkpoint_text_put(&list, "[", 1);
    for (size_t r = 0; r < n && files && files[r]; r++) {
        if (r) td__checkpoint_text_put(&list, ",", 1);
        td__checkpoint_text_json(&list, base_name(files[r]));
    }
    td__checkpoint_text_put(&list, "]", 1);
    if (s == TD_OK && list.oom) s = td__fail(TD_ENOMEM, "%s: out of memory", path);
    if (s == TD_OK) {
        if (n_meta) memcpy(all, meta, n_meta * sizeof *all);
        all[n_meta] = (td_checkpoint_meta){PARTS_KEY, list.s};
        all[n_meta + 1] = (td_checkpoint_meta){SAVE_KEY, save};
        s = td_checkpoint_save(path, NULL, 0, all, n_meta + 2);
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
static td_status part_info(const td__safetensors *part, const td__json *info, const char *name,
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
static td_status collect_runs(const td__sharded *c, run **out, size_t *n_out) {
    size_t total = 0;
    for (size_t p = 0; p < c->n_parts; p++) total += c->parts[p].n;
    run *runs = calloc(total ? total : 1, sizeof *runs);
    if (!runs) return td__fail(TD_ENOMEM, "%s: out of memory", c->index);
    size_t k = 0;
    td_status s = TD_OK;
    for (size_t p = 0; p < c->n_parts && s == TD_OK; p++) {
        const td__safetensors *part = &c->parts[p];
        const char *text = td__safetensors_meta(part, PART_KEY);
        char err[160];
        td__json *info = text ? td__json_parse(text, strlen(text), err, sizeof err) : NULL;
        if (!info || info->kind != TD__JSON_OBJECT)
            s = td__fail(TD_EFORMAT, "%s: metadata \"" PART_KEY "\" %s", part->path,
                         text ? "is not a JSON object" : "is missing: not a part file");
        for (size_t e = 0; s == TD_OK && e < part->n; e++, k++) {
            const entry *pe = &part->entries[e];
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
static td_status check_cover(const td__sharded *c, const run *r, size_t n) {
    size_t at = 0, whole = 1;
    for (int d = 0; d < r[0].ndim; d++) whole *= (size_t)r[0].shape[d];
    for (size_t i = 0; i < n; i++) {
        int same = r[i].dtype == r[0].dtype && r[i].ndim == r[0].ndim;
        for (int d = 0; same && d < r[0].ndim; d++) same = r[i].shape[d] == r[0].shape[d];
        if (!same)
            return td__fail(TD_EFORMAT, "%s: tensor %s has another dtype or shape in %s than in %s",
                            c->index, r[0].name, c->parts[r[i].part].path,
                            c->parts[r[0].part].path);
        if (r[i].offset != at)
            return td__fail(TD_EFORMAT,
                            "%s: tensor %s: elements [%zu, %zu) are %s (the part files do not "
                            "cover it exactly once: one is missing or damaged)",
                            c->index, r[0].name, at < r[i].offset ? at : r[i].offset,
                            at < r[i].offset ? r[i].offset : at,
                            at < r[i].offset ? "in no part" : "in two parts");
        at += r[i].count;
    }
    if (at != whole)
        return td__fail(TD_EFORMAT,
                        "%s: tensor %s: elements [%zu, %zu) are in no part (a part file is "
                        "missing or damaged)",
                        c->index, r[0].name, at, whole);
    return TD_OK;
}

static int cmp_entry_order(const void *a, const void *b) {
    const entry *x = a, *y = b; /* begin holds the first run's order here */
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* Fills c->entries with the whole tensors c->parts hold. */
static td_status assemble(td__sharded *c) {
    run *runs = NULL;
    size_t n = 0;
    TD__TRY(collect_runs(c, &runs, &n));
    qsort(runs, n, sizeof *runs, cmp_run);
    c->entries = calloc(n ? n : 1, sizeof *c->entries);
    td_status s = c->entries ? TD_OK : td__fail(TD_ENOMEM, "%s: out of memory", c->index);
    for (size_t i = 0; s == TD_OK && i < n;) {
        size_t j = i, first = runs[i].order;
        for (; j < n && !strcmp(runs[j].name, runs[i].name); j++)
            if (runs[j].order < first) first = runs[j].order;
        s = check_cover(c, runs + i, j - i);
        entry *e = &c->entries[c->n];
        if (s == TD_OK) {
            e->name = strdup(runs[i].name);
            e->pieces = calloc(j - i, sizeof *e->pieces);
            if (!e->name || !e->pieces) s = td__fail(TD_ENOMEM, "%s: out of memory", c->index);
            c->n++;
        }
        if (s != TD_OK) break;
        e->dtype = runs[i].dtype;
        e->ndim = runs[i].ndim;
        memcpy(e->shape, runs[i].shape, sizeof e->shape);
        e->count = 0;
        e->begin = first;
        for (size_t k = i; k < j; k++) {
            const entry *pe = &c->parts[runs[k].part].entries[runs[k].entry];
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

/* Whether part p (at `file`) says it is rank p's part of save `save` at world size n; else the
 * error, naming the file and both identities. */
static td_status check_identity(const td__sharded *c, size_t p, size_t n, const char *save) {
    const td__safetensors *part = &c->parts[p];
    if (td__sharded_is_index(part))
        return td__fail(TD_EFORMAT, "%s: part %zu (%s) is itself a sharded checkpoint's index",
                        c->index, p, part->path);
    const char *its_save = td__safetensors_meta(part, SAVE_KEY),
               *its_rank = td__safetensors_meta(part, RANK_KEY),
               *its_world = td__safetensors_meta(part, WORLD_KEY);
    char rank[24], world[24];
    snprintf(rank, sizeof rank, "%zu", p);
    snprintf(world, sizeof world, "%zu", n);
    if (its_save && its_rank && its_world && !strcmp(its_save, save) && !strcmp(its_rank, rank) &&
        !strcmp(its_world, world))
        return TD_OK;
    char a[40], b[40], w[40];
    return td__fail(TD_EFORMAT,
                    "%s: part %zu (%s) is the part of rank %s of %s of save %s, but the index "
                    "lists it as rank %zu of %zu of save %s: a part file of another save under "
                    "this save's name",
                    c->index, p, part->path,
                    its_rank ? td__checkpoint_shown(a, sizeof a, its_rank) : "?",
                    its_world ? td__checkpoint_shown(w, sizeof w, its_world) : "?",
                    its_save ? td__checkpoint_shown(b, sizeof b, its_save) : "(none)", p, n, save);
}

static td_status sharded_open_files(td__sharded **out, const char *index, char *const *files,
                                    size_t n, const char *save) {
    *out = NULL;
    td__sharded *c = calloc(1, sizeof *c);
    if (c) c->index = strdup(index);
    if (c) c->parts = calloc(n ? n : 1, sizeof *c->parts);
    if (!c || !c->index || !c->parts) {
        td__sharded_close(c);
        return td__fail(TD_ENOMEM, "%s: out of memory", index);
    }
    td_status s = TD_OK;
    for (size_t p = 0; s == TD_OK && p < n; p++) {
        s = td__safetensors_open(&c->parts[p], files[p]);
        if (s != TD_OK) {
            char msg[600];
            snprintf(msg, sizeof msg, "%s", td_last_error());
            s = td__fail(s, "%s: part %zu of %zu: %s", index, p, n, msg);
            break;
        }
        c->n_parts++;
        s = check_identity(c, p, n, save);
    }
    if (s == TD_OK) s = assemble(c);
    if (s != TD_OK)
        td__sharded_close(c);
    else
        *out = c;
    return s;
}

int td__sharded_is_index(const td__safetensors *f) {
    return td__safetensors_meta(f, PARTS_KEY) ||
           (td__safetensors_meta(f, SAVE_KEY) && !td__safetensors_meta(f, PART_KEY));
}

td_status td__sharded_open(td__sharded **out, const td__safetensors *index) {
    *out = NULL;
    const char *path = index->path, *text = td__safetensors_meta(index, PARTS_KEY),
               *save = td__safetensors_meta(index, SAVE_KEY);
    if (index->n)
        return td__fail(TD_EFORMAT, "%s: a sharded checkpoint's index holds no tensors", path);
    if (!text)
        return td__fail(TD_EFORMAT,
                        "%s: the index of a sharded checkpoint without its \"" PARTS_KEY
                        "\" list (which names its part files)",
                        path);
    if (!save || strlen(save) != 16 || strspn(save, "0123456789abcdef") != 16)
        return td__fail(TD_EFORMAT,
                        "%s: a sharded checkpoint's index without the save's id (\"" SAVE_KEY
                        "\", 16 hex digits) that its parts must carry",
                        path);
    char err[160];
    td__json *list = td__json_parse(text, strlen(text), err, sizeof err);
    td_status s = TD_OK;
    if (!list || list->kind != TD__JSON_ARRAY || list->n == 0)
        s = td__fail(TD_EFORMAT,
                     "%s: metadata \"" PARTS_KEY "\" is not a JSON array of part file names", path);
    char *dir = dir_of(path), **files = calloc(list && list->n ? list->n : 1, sizeof *files);
    if (s == TD_OK && (!dir || !files)) s = td__fail(TD_ENOMEM, "%s: out of memory", path);
    for (size_t p = 0; s == TD_OK && p < list->n; p++) {
        const td__json *name = &list->items[p];
        if (name->kind != TD__JSON_STRING || !name->string[0] || strchr(name->string, '/') ||
            strlen(name->string) != name->string_len) {
            char shown[160];
            s = td__fail(TD_EFORMAT, "%s: part %zu (\"%s\") is not a file name beside the index",
                         path, p,
                         name->kind == TD__JSON_STRING
                             ? td__checkpoint_shown(shown, sizeof shown, name->string)
                             : "?");
            break;
        }
        size_t len = strlen(dir) + name->string_len + 1;
        if (!(files[p] = malloc(len)))
            s = td__fail(TD_ENOMEM, "%s: out of memory", path);
        else
            snprintf(files[p], len, "%s%s", dir, name->string);
    }
    if (s == TD_OK) s = sharded_open_files(out, path, files, list->n, save);
    for (size_t p = 0; files && list && p < list->n; p++) free(files[p]);
    free(files);
    free(dir);
    td__json_free(list);
    return s;
}

void td__sharded_close(td__sharded *c) {
    if (!c) return;
    for (size_t p = 0; p < c->n_parts; p++) td__safetensors_close(&c->parts[p]);
    for (size_t i = 0; i < c->n; i++) {
        free(c->entries[i].name);
        free(c->entries[i].pieces);
    }
    free(c->entries);
    free(c->parts);
    free(c->index);
    free(c);
}

const td__checkpoint_entry *td__sharded_entries(const td__sharded *c, size_t *n) {
    *n = c->n;
    return c->entries;
}

const td__safetensors *td__sharded_part(const td__sharded *c, size_t i) {
    return c && i < c->n_parts ? &c->parts[i] : NULL;
}

td_status td__sharded_read(const td__sharded *c, const td__checkpoint_entry *e, size_t offset,
                           size_t count, void *dst) {
    size_t es = td_dtype_size(e->dtype), end = offset + count;
    unsigned char *out = dst;
    for (size_t i = 0; i < e->n_pieces && offset < end; i++) {
        const td__checkpoint_piece *p = &e->pieces[i];
        if (p->offset + p->count <= offset) continue;
        size_t take = (p->offset + p->count < end ? p->offset + p->count : end) - offset;
        /* the part's run, as its own file describes it, from element offset - p->offset */
        const td__safetensors *part = &c->parts[p->part];
        td__checkpoint_entry run = {.name = e->name, .dtype = e->dtype, .begin = p->begin};
        TD__TRY(td__safetensors_read(part, &run, offset - p->offset, take, out));
        out += take * es;
        offset += take;
    }
    return TD_OK;
}
