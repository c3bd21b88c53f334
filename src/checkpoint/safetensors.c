/* One safetensors file (https://github.com/huggingface/safetensors format), written atomically
 * and read strictly: u64 little-endian header size N, N bytes of JSON padded with spaces to a
 * multiple of 8, then the byte buffer, which the tensors' [begin, end) offsets cover exactly,
 * with no holes.
 *
 * Reading is strict: anything the format does not allow is TD_EFORMAT naming the file and the
 * tensor. What a file means beyond its own tensors (a sharded checkpoint's index or part) is
 * sharded.c's business, and checking a reader's expectations is the front's (checkpoint.c). It
 * assumes a little-endian host, as the format stores bytes as they are. */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tandem/checkpoint.h"
#include "tandem/device.h"

#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/json_impl.h"
#include "checkpoint/temporary_impl.h"
#include "core/core_impl.h"

#define MAX_HEADER (100u << 20) /* the Python package's limit */

typedef td__checkpoint_entry entry;

static const struct {
    const char *name;
    td_dtype dtype;
} dtype_names[] = {
    {"F32", TD_F32}, {"F64", TD_F64}, {"BF16", TD_BF16}, {"F16", TD_F16},
    {"I32", TD_I32}, {"I64", TD_I64}, {"U8", TD_U8},
};

const char *td__safetensors_dtype(td_dtype d) {
    for (size_t i = 0; i < sizeof dtype_names / sizeof *dtype_names; i++)
        if (dtype_names[i].dtype == d) return dtype_names[i].name;
    return NULL;
}

static int st_to_dtype(const char *s, td_dtype *d) {
    for (size_t i = 0; i < sizeof dtype_names / sizeof *dtype_names; i++)
        if (strcmp(dtype_names[i].name, s) == 0) {
            *d = dtype_names[i].dtype;
            return 1;
        }
    return 0;
}

/* Text read from a file (a tensor name, a dtype, a metadata key or value) as a message shows it:
 * escaped, since a damaged file may hold any bytes there, and cut with "..." when longer than
 * cap allows (cap >= 4). */
const char *td__checkpoint_shown(char *buf, size_t cap, const char *text) {
    if (td__json_escape(buf, cap - 3, text, strlen(text)) >= cap - 3) strcat(buf, "...");
    return buf;
}
#define shown td__checkpoint_shown

/* ---- writing ------------------------------------------------------------------------ */

void td__checkpoint_text_put(td__checkpoint_text *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->len + n + 1) nc *= 2;
        char *p = realloc(b->s, nc);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->s = p;
        b->cap = nc;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

void td__checkpoint_text_printf(td__checkpoint_text *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) td__checkpoint_text_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

void td__checkpoint_text_json(td__checkpoint_text *b, const char *s) {
    size_t n = strlen(s), need = td__json_escape(NULL, 0, s, n);
    char *text = malloc(need + 1);
    if (!text) {
        b->oom = 1;
        return;
    }
    td__json_escape(text, need + 1, s, n);
    td__checkpoint_text_put(b, "\"", 1);
    td__checkpoint_text_put(b, text, need);
    td__checkpoint_text_put(b, "\"", 1);
    free(text);
}

static int write_all(int fd, const void *data, size_t len) {
    const char *p = data;
    while (len > 0) {
        ssize_t w = write(fd, p, len > (1u << 30) ? (1u << 30) : len);
        if (w < 0) {
            if (errno == EINTR) continue;
            return 0;
        }
        p += w;
        len -= (size_t)w;
    }
    return 1;
}

/* A tensor's bytes into fd; one on a GPU goes through a host copy. NULL, or what failed. */
static const char *write_tensor(int fd, const td_param *t) {
    size_t bytes = t->count * td_dtype_size(t->dtype);
    if (t->device.type == TD_DEVICE_CPU)
        return write_all(fd, t->data, bytes) ? NULL : "writing tensor data";
    void *host = malloc(bytes ? bytes : 1);
    const char *what = NULL;
    if (!host)
        what = "allocating a host copy of a GPU tensor";
    else if (td_device_copy(td_device_cpu(), host, t->device, t->data, bytes) != TD_OK)
        what = "copying a tensor from its GPU";
    else if (!write_all(fd, host, bytes))
        what = "writing tensor data";
    free(host);
    return what;
}

static td_status check_save_args(const char *path, const td_param *t, size_t n,
                                 const td_checkpoint_meta *meta, size_t n_meta) {
    if (!path) return td__fail(TD_EINVAL, "td_checkpoint_save: path is NULL");
    if (!t && n) return td__fail(TD_EINVAL, "%s: tensors is NULL with n = %zu", path, n);
    if (!meta && n_meta)
        return td__fail(TD_EINVAL, "%s: meta is NULL with n_meta = %zu", path, n_meta);
    char text[160];
    for (size_t i = 0; i < n; i++) {
        if (!t[i].name) return td__fail(TD_EINVAL, "%s: tensors[%zu] has no name", path, i);
        if (!td__utf8_valid(t[i].name, strlen(t[i].name)))
            return td__fail(TD_EINVAL, "%s: tensor name \"%s\" is not UTF-8 text", path,
                            shown(text, sizeof text, t[i].name));
        if (strcmp(t[i].name, "__metadata__") == 0)
            return td__fail(TD_EINVAL, "%s: a tensor may not be named __metadata__", path);
        if (!td__safetensors_dtype(t[i].dtype))
            return td__fail(TD_EDTYPE, "%s: tensor %s has invalid dtype %d", path, t[i].name,
                            (int)t[i].dtype);
        if (t[i].ndim < 0 || t[i].ndim > TD_MAX_DIMS)
            return td__fail(TD_EINVAL, "%s: tensor %s has ndim %d", path, t[i].name, t[i].ndim);
        size_t prod = 1;
        for (int d = 0; d < t[i].ndim; d++) {
            if (t[i].shape[d] < 0)
                return td__fail(TD_ESHAPE, "%s: tensor %s has shape[%d] = %lld", path, t[i].name, d,
                                (long long)t[i].shape[d]);
            prod *= (size_t)t[i].shape[d];
        }
        if (prod != t[i].count)
            return td__fail(TD_ESHAPE,
                            "%s: tensor %s has count %zu but its shape holds %zu elements", path,
                            t[i].name, t[i].count, prod);
        if (!t[i].data && t[i].count)
            return td__fail(TD_EINVAL, "%s: tensor %s has no data", path, t[i].name);
        for (size_t j = 0; j < i; j++)
            if (strcmp(t[j].name, t[i].name) == 0)
                return td__fail(TD_EINVAL, "%s: tensor name %s appears twice", path, t[i].name);
    }
    for (size_t i = 0; i < n_meta; i++) {
        if (!meta[i].key || !meta[i].value)
            return td__fail(TD_EINVAL, "%s: metadata entry %zu has a NULL key or value", path, i);
        if (!td__utf8_valid(meta[i].key, strlen(meta[i].key)) ||
            !td__utf8_valid(meta[i].value, strlen(meta[i].value)))
            return td__fail(TD_EINVAL, "%s: metadata entry %zu (\"%s\") is not UTF-8 text", path, i,
                            shown(text, sizeof text, meta[i].key));
        for (size_t j = 0; j < i; j++)
            if (strcmp(meta[j].key, meta[i].key) == 0)
                return td__fail(TD_EINVAL, "%s: metadata key %s appears twice", path, meta[i].key);
    }
    return TD_OK;
}

td_status td_checkpoint_save(const char *path, const td_param *t, size_t n,
                             const td_checkpoint_meta *meta, size_t n_meta) {
    td_status st = check_save_args(path, t, n, meta, n_meta);
    if (st != TD_OK) return st;
    struct stat ps;
    /* Caught here rather than by rename(2) after the whole file has been written. */
    if (stat(path, &ps) == 0 && S_ISDIR(ps.st_mode))
        return td__fail(TD_EINVAL, "%s: is a directory; a checkpoint path must name a file", path);
    td__checkpoint_text h = {0};
    td__checkpoint_text_put(&h, "{", 1);
    int first = 1;
    if (n_meta) {
        td__checkpoint_text_put(&h, "\"__metadata__\":{", 16);
        for (size_t i = 0; i < n_meta; i++) {
            if (i) td__checkpoint_text_put(&h, ",", 1);
            td__checkpoint_text_json(&h, meta[i].key);
            td__checkpoint_text_put(&h, ":", 1);
            td__checkpoint_text_json(&h, meta[i].value);
        }
        td__checkpoint_text_put(&h, "}", 1);
        first = 0;
    }
    uint64_t offset = 0;
    for (size_t i = 0; i < n; i++) {
        if (!first) td__checkpoint_text_put(&h, ",", 1);
        first = 0;
        td__checkpoint_text_json(&h, t[i].name);
        td__checkpoint_text_printf(&h, ":{\"dtype\":\"%s\",\"shape\":[",
                                   td__safetensors_dtype(t[i].dtype));
        for (int d = 0; d < t[i].ndim; d++)
            td__checkpoint_text_printf(&h, d ? ",%lld" : "%lld", (long long)t[i].shape[d]);
        uint64_t bytes = (uint64_t)t[i].count * td_dtype_size(t[i].dtype);
        td__checkpoint_text_printf(&h, "],\"data_offsets\":[%llu,%llu]}",
                                   (unsigned long long)offset,
                                   (unsigned long long)(offset + bytes));
        offset += bytes;
    }
    td__checkpoint_text_put(&h, "}", 1);
    while (!h.oom && h.len % 8)
        td__checkpoint_text_put(&h, " ", 1); /* the byte buffer starts 8-aligned */
    if (h.oom) {
        free(h.s);
        return td__fail(TD_ENOMEM, "%s: out of memory building the header", path);
    }
    if (h.len > MAX_HEADER) {
        free(h.s);
        return td__fail(TD_EINVAL, "%s: header of %zu bytes exceeds the format's %u-byte limit",
                        path, h.len, MAX_HEADER);
    }

    char *tmp = NULL;
    int fd = td__checkpoint_temporary(path, &tmp);
    if (fd < 0) {
        st = td__fail(errno == ENOMEM ? TD_ENOMEM : TD_EIO,
                      "%s: cannot create a temporary file next to it: %s", path, strerror(errno));
        free(h.s);
        return st;
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)h.len >> (8 * i));
    const char *what = NULL;
    if (!write_all(fd, len8, 8) || !write_all(fd, h.s, h.len)) what = "writing the header";
    for (size_t i = 0; i < n && !what; i++) what = write_tensor(fd, &t[i]);
    if (!what && fchmod(fd, 0644) != 0) what = "fchmod";
    if (!what && fsync(fd) != 0) what = "fsync";
    int saved_errno = errno;
    /* The lock must outlive the name, so the descriptor is closed only after the rename. Once
     * fsync has succeeded, close has no data left to report errors about. */
    if (!what && rename(tmp, path) != 0) {
        what = "rename";
        saved_errno = errno;
    }
    if (what) {
        unlink(tmp);
        close(fd);
        st = td__fail(TD_EIO, "%s: %s failed: %s (the previous file, if any, is unchanged)", path,
                      what, strerror(saved_errno));
    } else {
        if (close(fd) != 0) td__log(TD_LOG_WARN, "%s: close after the rename failed", path);
        /* The rename is durable only once the directory entry is. */
        char *dcopy = strdup(path);
        if (dcopy) {
            int dfd = open(dirname(dcopy), O_RDONLY | O_DIRECTORY);
            if (dfd >= 0) {
                if (fsync(dfd) != 0)
                    td__log(TD_LOG_WARN, "%s: fsync of its directory failed", path);
                close(dfd);
            }
            free(dcopy);
        }
    }
    free(tmp);
    free(h.s);
    return st;
}

/* ---- reading ------------------------------------------------------------------------ */

/* Reads `len` bytes at byte `off` of an open file, retrying short reads; 0 on failure. */
static int read_at(int fd, void *buf, size_t len, uint64_t off) {
    char *p = buf;
    while (len > 0) {
        ssize_t r = pread(fd, p, len > (1u << 30) ? (1u << 30) : len, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return 0;
        p += r;
        len -= (size_t)r;
        off += (uint64_t)r;
    }
    return 1;
}

static int cmp_begin(const void *a, const void *b) {
    const entry *x = *(const entry *const *)a, *y = *(const entry *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* One tensor's header entry: exactly dtype, shape and data_offsets, consistent with each other. */
static td_status parse_entry(const char *path, const char *key, const td__json *v,
                             uint64_t data_len, entry *e) {
    char name[160], field[80];
    shown(name, sizeof name, key);
    if (v->kind != TD__JSON_OBJECT)
        return td__fail(TD_EFORMAT, "%s: tensor %s: header entry is not an object", path, name);
    for (size_t k = 0; k < v->n; k++)
        if (strcmp(v->keys[k], "dtype") && strcmp(v->keys[k], "shape") &&
            strcmp(v->keys[k], "data_offsets"))
            return td__fail(TD_EFORMAT, "%s: tensor %s: unknown field \"%s\"", path, name,
                            shown(field, sizeof field, v->keys[k]));
    const td__json *dt = td__json_get(v, "dtype"), *sh = td__json_get(v, "shape"),
                   *off = td__json_get(v, "data_offsets");
    if (!dt || dt->kind != TD__JSON_STRING)
        return td__fail(TD_EFORMAT, "%s: tensor %s: missing string field \"dtype\"", path, name);
    if (!st_to_dtype(dt->string, &e->dtype))
        return td__fail(TD_EDTYPE,
                        "%s: tensor %s: dtype \"%s\" is not one of F32 F64 BF16 F16 I32 I64 U8",
                        path, name, shown(field, sizeof field, dt->string));
    if (!sh || sh->kind != TD__JSON_ARRAY)
        return td__fail(TD_EFORMAT, "%s: tensor %s: missing array field \"shape\"", path, name);
    if (sh->n > TD_MAX_DIMS)
        return td__fail(TD_EFORMAT, "%s: tensor %s: %zu dims, at most %d supported", path, name,
                        sh->n, TD_MAX_DIMS);
    uint64_t count = 1;
    int overflow = 0;
    e->ndim = (int)sh->n;
    for (size_t d = 0; d < sh->n; d++) {
        const td__json *x = &sh->items[d];
        if (x->kind != TD__JSON_NUMBER || !x->is_uint || x->uint > (uint64_t)INT64_MAX)
            return td__fail(TD_EFORMAT, "%s: tensor %s: shape[%zu] is not a non-negative integer",
                            path, name, d);
        e->shape[d] = (int64_t)x->uint;
        if (x->uint && count > UINT64_MAX / 16 / x->uint)
            overflow = 1;
        else
            count *= x->uint;
    }
    if (!off || off->kind != TD__JSON_ARRAY || off->n != 2 ||
        off->items[0].kind != TD__JSON_NUMBER || off->items[1].kind != TD__JSON_NUMBER ||
        !off->items[0].is_uint || !off->items[1].is_uint)
        return td__fail(TD_EFORMAT,
                        "%s: tensor %s: data_offsets must be [begin, end] non-negative integers",
                        path, name);
    e->begin = off->items[0].uint;
    e->end = off->items[1].uint;
    if (e->end < e->begin)
        return td__fail(TD_EFORMAT,
                        "%s: tensor %s: data_offsets [%llu, %llu] end before they begin", path,
                        name, (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end > data_len)
        return td__fail(
            TD_EFORMAT,
            "%s: tensor %s: data_offsets [%llu, %llu] beyond the %llu data bytes in the file", path,
            name, (unsigned long long)e->begin, (unsigned long long)e->end,
            (unsigned long long)data_len);
    uint64_t want = count * td_dtype_size(e->dtype);
    if (overflow || want != e->end - e->begin)
        return td__fail(TD_EFORMAT,
                        "%s: tensor %s: shape needs %llu bytes of %s but data_offsets span %llu",
                        path, name, (unsigned long long)want, td__safetensors_dtype(e->dtype),
                        (unsigned long long)(e->end - e->begin));
    e->count = (size_t)count;
    return TD_OK;
}

static td_status parse_header(td__safetensors *c, const char *path, const td__json *root,
                              uint64_t data_len) {
    if (root->kind != TD__JSON_OBJECT)
        return td__fail(TD_EFORMAT, "%s: header is not a JSON object", path);
    c->entries = calloc(root->n ? root->n : 1, sizeof *c->entries);
    if (!c->entries) return td__fail(TD_ENOMEM, "%s: out of memory", path);
    char key[160], other[160];
    for (size_t i = 0; i < root->n; i++) {
        const char *name = root->keys[i];
        const td__json *v = &root->items[i];
        if (strcmp(name, "__metadata__") == 0) {
            if (v->kind != TD__JSON_OBJECT)
                return td__fail(TD_EFORMAT, "%s: __metadata__ is not an object", path);
            c->meta_keys = calloc(v->n ? v->n : 1, sizeof *c->meta_keys);
            c->meta_values = calloc(v->n ? v->n : 1, sizeof *c->meta_values);
            if (!c->meta_keys || !c->meta_values)
                return td__fail(TD_ENOMEM, "%s: out of memory", path);
            for (size_t k = 0; k < v->n; k++) {
                if (v->items[k].kind != TD__JSON_STRING)
                    return td__fail(TD_EFORMAT, "%s: __metadata__ value of \"%s\" is not a string",
                                    path, shown(key, sizeof key, v->keys[k]));
                c->meta_keys[k] = strdup(v->keys[k]);
                c->meta_values[k] = strdup(v->items[k].string);
                c->n_meta++;
                if (!c->meta_keys[k] || !c->meta_values[k])
                    return td__fail(TD_ENOMEM, "%s: out of memory", path);
            }
            continue;
        }
        entry *e = &c->entries[c->n];
        td_status st = parse_entry(path, name, v, data_len, e);
        if (st != TD_OK) return st;
        e->name = strdup(name);
        if (!e->name) return td__fail(TD_ENOMEM, "%s: out of memory", path);
        c->n++;
    }
    /* The byte buffer must be covered exactly: sorted by begin, each tensor starts where the
     * previous one ends, the last ends at the end of the file. */
    entry **order = malloc((c->n ? c->n : 1) * sizeof *order);
    if (!order) return td__fail(TD_ENOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < c->n; i++) order[i] = &c->entries[i];
    qsort(order, c->n, sizeof *order, cmp_begin);
    uint64_t at = 0;
    td_status st = TD_OK;
    for (size_t i = 0; i < c->n && st == TD_OK; i++) {
        if (order[i]->begin < at)
            st = td__fail(TD_EFORMAT, "%s: tensors %s and %s overlap (bytes %llu..%llu)", path,
                          shown(other, sizeof other, order[i - 1]->name),
                          shown(key, sizeof key, order[i]->name),
                          (unsigned long long)order[i]->begin, (unsigned long long)at);
        else if (order[i]->begin > at)
            st = td__fail(TD_EFORMAT, "%s: bytes %llu..%llu before tensor %s belong to no tensor",
                          path, (unsigned long long)at, (unsigned long long)order[i]->begin,
                          shown(key, sizeof key, order[i]->name));
        at = order[i]->end;
    }
    free(order);
    if (st == TD_OK && at != data_len)
        st = td__fail(TD_EFORMAT, "%s: tensors cover %llu data bytes but the file has %llu", path,
                      (unsigned long long)at, (unsigned long long)data_len);
    return st;
}

/* Opens one file; `follow` opens the parts an index names (a part may not be an index). */

td_status td__safetensors_open(td__safetensors *c, const char *path) {
    memset(c, 0, sizeof *c);
    c->fd = -1;
    td_status st = TD_OK;
    char *text = NULL;
    td__json *root = NULL;
    c->path = strdup(path);
    if (!c->path) {
        st = td__fail(TD_ENOMEM, "%s: out of memory", path);
        goto done;
    }
    /* O_NONBLOCK only so that opening a FIFO does not wait for a writer; it is refused below
     * and the flag is cleared for the regular file that remains. */
    c->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (c->fd < 0) {
        st = td__fail(errno == ENOENT || errno == ENOTDIR ? TD_ENOTFOUND : TD_EIO,
                      "%s: cannot open: %s", path, strerror(errno));
        goto done;
    }
    struct stat sb;
    if (fstat(c->fd, &sb) != 0) {
        st = td__fail(TD_EIO, "%s: fstat: %s", path, strerror(errno));
        goto done;
    }
    /* A wrong path, not damaged data: without this a directory reads as "4096 bytes, too
     * short". TD_EINVAL because retrying cannot help and nothing failed to read. */
    if (S_ISDIR(sb.st_mode)) {
        st = td__fail(TD_EINVAL, "%s: is a directory, not a checkpoint file", path);
        goto done;
    }
    if (!S_ISREG(sb.st_mode)) {
        st = td__fail(TD_EINVAL, "%s: is %s, not a regular file, so not a checkpoint", path,
                      S_ISFIFO(sb.st_mode)   ? "a FIFO"
                      : S_ISCHR(sb.st_mode)  ? "a character device"
                      : S_ISBLK(sb.st_mode)  ? "a block device"
                      : S_ISSOCK(sb.st_mode) ? "a socket"
                                             : "a special file");
        goto done;
    }
    fcntl(c->fd, F_SETFL, fcntl(c->fd, F_GETFL) & ~O_NONBLOCK);
    uint64_t size = (uint64_t)sb.st_size;
    unsigned char len8[8];
    if (size < 8 || !read_at(c->fd, len8, 8, 0)) {
        st = td__fail(TD_EFORMAT, "%s: file has %llu bytes, too short for the 8-byte header length",
                      path, (unsigned long long)size);
        goto done;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | len8[i];
    if (hlen < 2 || hlen > MAX_HEADER || hlen > size - 8) {
        st = td__fail(TD_EFORMAT,
                      "%s: header length %llu does not fit the file (%llu bytes, limit %u)", path,
                      (unsigned long long)hlen, (unsigned long long)size, MAX_HEADER);
        goto done;
    }
    text = malloc((size_t)hlen);
    if (!text) {
        st = td__fail(TD_ENOMEM, "%s: cannot allocate a %llu-byte header", path,
                      (unsigned long long)hlen);
        goto done;
    }
    if (!read_at(c->fd, text, (size_t)hlen, 8)) {
        st = td__fail(TD_EIO, "%s: cannot read the header: %s", path, strerror(errno));
        goto done;
    }
    if (text[0] != '{') {
        st = td__fail(TD_EFORMAT, "%s: header does not start with '{'", path);
        goto done;
    }
    char err[160];
    root = td__json_parse(text, (size_t)hlen, err, sizeof err);
    if (!root) {
        st = td__fail(TD_EFORMAT, "%s: header is not valid JSON: %s", path, err);
        goto done;
    }
    c->data_start = 8 + hlen;
    st = parse_header(c, path, root, size - c->data_start);
done:
    td__json_free(root);
    free(text);
    if (st != TD_OK) td__safetensors_close(c);
    return st;
}

void td__safetensors_close(td__safetensors *c) {
    if (c->fd >= 0) close(c->fd);
    for (size_t i = 0; i < c->n; i++) free(c->entries[i].name);
    for (size_t i = 0; i < c->n_meta; i++) {
        free(c->meta_keys[i]);
        free(c->meta_values[i]);
    }
    free(c->entries);
    free(c->meta_keys);
    free(c->meta_values);
    free(c->path);
    memset(c, 0, sizeof *c);
    c->fd = -1;
}

const char *td__safetensors_meta(const td__safetensors *c, const char *key) {
    for (size_t i = 0; i < c->n_meta; i++)
        if (strcmp(c->meta_keys[i], key) == 0) return c->meta_values[i];
    return NULL;
}

td_status td__safetensors_read(const td__safetensors *c, const entry *e, size_t offset,
                               size_t count, void *dst) {
    size_t es = td_dtype_size(e->dtype);
    if (count && !read_at(c->fd, dst, count * es, c->data_start + e->begin + offset * es))
        return td__fail(TD_EIO, "%s: tensor %s: read failed (file changed while open?)", c->path,
                        e->name);
    return TD_OK;
}
