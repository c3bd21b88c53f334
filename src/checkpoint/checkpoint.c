/* The checkpoint front: opens either kind of checkpoint — one safetensors file (safetensors.c),
 * or a sharded checkpoint's index, whose tensors sharded.c assembles from the part files — and
 * serves the reads of both, each checked against what the reader expects (name, dtype, shape) in
 * one place. It writes nothing; td_checkpoint_save is safetensors.c's, the sharded writers are
 * sharded.c's. */
#include "tandem/checkpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/device.h"

#include "checkpoint/checkpoint_impl.h"
#include "core/core_impl.h"

typedef td__checkpoint_entry entry;
#define shown td__checkpoint_shown

td_status td_checkpoint_open(td_checkpoint **out, const char *path) {
    if (!out || !path)
        return td__fail(TD_EINVAL, "td_checkpoint_open: out and path must not be NULL");
    *out = NULL;
    td_checkpoint *c = calloc(1, sizeof *c);
    if (!c) return td__fail(TD_ENOMEM, "%s: out of memory", path);
    td_status s = td__safetensors_open(&c->file, path);
    if (s != TD_OK) {
        free(c);
        return s;
    }
    c->entries = c->file.entries;
    c->n = c->file.n;
    if (td__sharded_is_index(&c->file)) {
        s = td__sharded_open(&c->sharded, &c->file);
        if (s == TD_OK) c->entries = td__sharded_entries(c->sharded, &c->n);
    }
    if (s != TD_OK)
        td_checkpoint_close(c);
    else
        *out = c;
    return s;
}

void td_checkpoint_close(td_checkpoint *c) {
    if (!c) return;
    td__sharded_close(c->sharded);
    td__safetensors_close(&c->file);
    free(c);
}

size_t td_checkpoint_count(const td_checkpoint *c) { return c ? c->n : 0; }

td_status td_checkpoint_tensor(const td_checkpoint *c, size_t i, td_param *info) {
    if (!c || !info)
        return td__fail(TD_EINVAL, "td_checkpoint_tensor: checkpoint and info must not be NULL");
    if (i >= c->n)
        return td__fail(TD_EINVAL, "%s: tensor index %zu, the file has %zu", c->file.path, i, c->n);
    const entry *e = &c->entries[i];
    memset(info, 0, sizeof *info);
    info->name = e->name;
    info->count = e->count;
    info->dtype = e->dtype;
    info->ndim = e->ndim;
    for (int d = 0; d < e->ndim; d++) info->shape[d] = e->shape[d];
    return TD_OK;
}

const char *td_checkpoint_get_meta(const td_checkpoint *c, const char *key) {
    return c && key ? td__safetensors_meta(&c->file, key) : NULL;
}

static td_status meta_out_of_range(const td_checkpoint *c, const char *key, const char *range) {
    char value[80];
    return td__fail(TD_EFORMAT, "%s: metadata \"%s\" is \"%s\", out of the range %s", c->file.path,
                    key, shown(value, sizeof value, td_checkpoint_get_meta(c, key)), range);
}

/* Looks up key and parses its value as decimal digits, after one '-' when is_signed, with
 * nothing else around them. On TD_OK *negative and *magnitude hold the number; range is the
 * caller's "[min, max]" for the messages. */
static td_status meta_decimal(const td_checkpoint *c, const char *key, int is_signed,
                              const char *range, int *negative, uint64_t *magnitude) {
    const char *v = td_checkpoint_get_meta(c, key);
    if (!v) return td__fail(TD_ENOTFOUND, "%s: metadata key \"%s\" is missing", c->file.path, key);
    const char *p = v;
    *negative = is_signed && *p == '-';
    if (*negative) p++;
    int digits = *p != '\0', overflow = 0;
    uint64_t m = 0;
    for (; *p; p++) {
        if (*p < '0' || *p > '9') {
            digits = 0;
            break;
        }
        unsigned d = (unsigned)(*p - '0');
        if (m > (UINT64_MAX - d) / 10)
            overflow = 1;
        else
            m = m * 10 + d;
    }
    if (!digits) {
        char value[80];
        return td__fail(TD_EFORMAT,
                        "%s: metadata \"%s\" is \"%s\", not a decimal integer (expected one in %s)",
                        c->file.path, key, shown(value, sizeof value, v), range);
    }
    if (overflow) return meta_out_of_range(c, key, range);
    *magnitude = m;
    return TD_OK;
}

td_status td_checkpoint_get_meta_i64(const td_checkpoint *c, const char *key, int64_t min,
                                     int64_t max, int64_t *out) {
    if (!c || !key || !out)
        return td__fail(TD_EINVAL,
                        "td_checkpoint_get_meta_i64: checkpoint, key and out must not be NULL");
    if (min > max)
        return td__fail(TD_EINVAL, "%s: metadata \"%s\": empty range [%lld, %lld]", c->file.path,
                        key, (long long)min, (long long)max);
    char range[64];
    snprintf(range, sizeof range, "[%lld, %lld]", (long long)min, (long long)max);
    int negative;
    uint64_t m;
    TD__TRY(meta_decimal(c, key, 1, range, &negative, &m));
    int64_t v;
    if (m <= (uint64_t)INT64_MAX)
        v = negative ? -(int64_t)m : (int64_t)m;
    else if (negative && m == (uint64_t)INT64_MAX + 1) /* the one that fits only negated */
        v = INT64_MIN;
    else
        return meta_out_of_range(c, key, range);
    if (v < min || v > max) return meta_out_of_range(c, key, range);
    *out = v;
    return TD_OK;
}

td_status td_checkpoint_get_meta_u64(const td_checkpoint *c, const char *key, uint64_t min,
                                     uint64_t max, uint64_t *out) {
    if (!c || !key || !out)
        return td__fail(TD_EINVAL,
                        "td_checkpoint_get_meta_u64: checkpoint, key and out must not be NULL");
    if (min > max)
        return td__fail(TD_EINVAL, "%s: metadata \"%s\": empty range [%llu, %llu]", c->file.path,
                        key, (unsigned long long)min, (unsigned long long)max);
    char range[64];
    snprintf(range, sizeof range, "[%llu, %llu]", (unsigned long long)min, (unsigned long long)max);
    int negative;
    uint64_t m;
    TD__TRY(meta_decimal(c, key, 0, range, &negative, &m));
    if (m < min || m > max) return meta_out_of_range(c, key, range);
    *out = m;
    return TD_OK;
}

static const entry *find(const td_checkpoint *c, const char *name) {
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->entries[i].name, name) == 0) return &c->entries[i];
    return NULL;
}

/* The entry holding the tensor `want` describes (its name, dtype, shape and count; its data is
 * not read), or TD_ENOTFOUND, TD_EDTYPE or TD_ESHAPE naming the file, the tensor and both sides.
 * Every read checks here, so no reader takes a tensor of another shape that happens to hold as
 * many elements. */
static td_status find_like(const td_checkpoint *c, const td_param *want, const entry **out) {
    const char *path = c->file.path;
    const entry *e = find(c, want->name);
    if (!e) return td__fail(TD_ENOTFOUND, "%s: tensor %s is not in the file", path, want->name);
    if (e->dtype != want->dtype) {
        const char *w = td__safetensors_dtype(want->dtype);
        return td__fail(TD_EDTYPE, "%s: tensor %s: expected dtype %s, file has %s", path,
                        want->name, w ? w : "invalid", td__safetensors_dtype(e->dtype));
    }
    int same = e->ndim == want->ndim;
    for (int d = 0; same && d < e->ndim; d++) same = e->shape[d] == want->shape[d];
    if (!same) {
        char w[160], got[160];
        td__dims_str(w, sizeof w, want->ndim, want->shape);
        td__dims_str(got, sizeof got, e->ndim, e->shape);
        return td__fail(TD_ESHAPE, "%s: tensor %s: expected shape %s, file has %s", path,
                        want->name, w, got);
    }
    if (e->count != want->count)
        return td__fail(TD_ESHAPE, "%s: tensor %s: count %zu does not match its shape (%zu)", path,
                        want->name, want->count, e->count);
    *out = e;
    return TD_OK;
}

/* Elements [offset, offset + count) of e into host memory dst, from this file or the parts. */
static td_status read_span(const td_checkpoint *c, const entry *e, size_t offset, size_t count,
                           void *dst) {
    return c->sharded ? td__sharded_read(c->sharded, e, offset, count, dst)
                      : td__safetensors_read(&c->file, e, offset, count, dst);
}

/* Entry e's bytes into t's buffer; one on a GPU through a host copy. */
static td_status read_tensor(const td_checkpoint *c, const entry *e, td_param *t) {
    if (t->device.type == TD_DEVICE_CPU) return read_span(c, e, 0, t->count, t->data);
    size_t bytes = t->count * td_dtype_size(e->dtype);
    void *buf = malloc(bytes ? bytes : 1);
    if (!buf)
        return td__fail(TD_ENOMEM, "%s: tensor %s: no memory for a host copy", c->file.path,
                        t->name);
    td_status st = read_span(c, e, 0, t->count, buf);
    if (st == TD_OK) st = td_device_copy(t->device, t->data, td_device_cpu(), buf, bytes);
    free(buf);
    return st;
}

/* A tensor-parallel slice (td_param.split) of entry e into t's buffer: for each run of the
 * dimensions before the cut and each block of it, the rank's piece, with everything after. */
static td_status read_slice(const td_checkpoint *c, const entry *e, td_param *t) {
    const td_param_split *sp = &t->split;
    if (t->device.type != TD_DEVICE_CPU)
        return td__fail(TD_EUNSUPPORTED, "%s: tensor %s: a tensor-parallel slice on a GPU",
                        c->file.path, t->name);
    size_t inner = 1, outer = 1, es = td_dtype_size(e->dtype);
    for (int d = 0; d < t->ndim; d++) {
        if (d < sp->dim) outer *= (size_t)t->shape[d];
        if (d > sp->dim) inner *= (size_t)t->shape[d];
    }
    size_t parts = sp->parts > 1 ? (size_t)sp->parts : 1, mine = (size_t)t->shape[sp->dim];
    size_t piece = mine / parts, whole = mine * (size_t)sp->ranks;
    for (size_t o = 0; o < outer; o++)
        for (size_t b = 0; b < parts; b++) {
            size_t from = (o * whole + b * (whole / parts) + (size_t)sp->rank * piece) * inner;
            TD__TRY(read_span(c, e, from, piece * inner,
                              (char *)t->data + (o * mine + b * piece) * inner * es));
        }
    return TD_OK;
}

/* The whole tensor t is a slice of (t itself when it is no slice), as find_like checks it. */
static td_param whole_of(const td_param *t) {
    td_param w = *t;
    if (t->split.ranks <= 0 || t->split.dim < 0 || t->split.dim >= t->ndim) return w;
    w.shape[t->split.dim] *= t->split.ranks;
    w.count = t->count * (size_t)t->split.ranks;
    return w;
}

td_status td_checkpoint_read(td_checkpoint *c, td_param *t, size_t n) {
    if (!c || (!t && n))
        return td__fail(TD_EINVAL, "td_checkpoint_read: checkpoint and tensors must not be NULL");
    const entry *e;
    for (size_t i = 0; i < n; i++) {
        if (!t[i].name) return td__fail(TD_EINVAL, "%s: tensors[%zu] has no name", c->file.path, i);
        td_param whole = whole_of(&t[i]);
        TD__TRY(find_like(c, &whole, &e));
        if (!t[i].data && e->count)
            return td__fail(TD_EINVAL, "%s: tensor %s has no data buffer", c->file.path, t[i].name);
    }
    for (size_t i = 0; i < n; i++) {
        td_status st = t[i].split.ranks > 0 ? read_slice(c, find(c, t[i].name), &t[i])
                                            : read_tensor(c, find(c, t[i].name), &t[i]);
        /* a graph's copies of the weights follow (a failed read leaves them invalid) */
        if (t[i].written) t[i].written(t[i].written_ctx, t[i].data, 0, st ? 0 : t[i].count);
        TD__TRY(st);
    }
    return TD_OK;
}

td_status td_checkpoint_read_range(td_checkpoint *c, const td_param *tensor, size_t offset,
                                   size_t count, void *dst) {
    if (!c || !tensor || !tensor->name || (!dst && count))
        return td__fail(TD_EINVAL,
                        "td_checkpoint_read_range: checkpoint, tensor, its name and dst must not "
                        "be NULL");
    const entry *e;
    TD__TRY(find_like(c, tensor, &e));
    if (offset > e->count || count > e->count - offset)
        return td__fail(TD_ESHAPE, "%s: tensor %s: elements [%zu, %zu) asked for, it has %zu",
                        c->file.path, tensor->name, offset, offset + count, e->count);
    return read_span(c, e, offset, count, dst);
}

td_status td_checkpoint_load(const char *path, td_param *t, size_t n) {
    td_checkpoint *c = NULL;
    td_status st = td_checkpoint_open(&c, path);
    if (st != TD_OK) return st;
    st = td_checkpoint_read(c, t, n);
    td_checkpoint_close(c);
    return st;
}
