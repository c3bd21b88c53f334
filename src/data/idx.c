/* IDX file reader (the MNIST format): 4-byte magic {0, 0, dtype, ndim}, ndim big-endian
 * uint32 dims, then the data in big-endian order, plain or gzip-compressed (told apart by the
 * gzip magic, 1f 8b).
 *
 * Every length is checked against the header, and a gzip file is inflated to the end of its
 * stream: zlib checks the trailer's CRC-32 and length there, and a stream that stops before
 * its trailer is refused, so a file cut short or damaged anywhere is an error naming it, even
 * when every byte of data came out. It does not accept IDX's i8 / i16 types, which no dataset
 * we load uses. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "tandem/data.h"

#include "core/core_impl.h"
#include "data_impl.h"

/* A file read through: its bytes as they are, or the gzip stream in it inflated. zlib's own
 * gzread is not used: it takes a stream that ends inside its trailer for a clean end of file
 * once it has read the whole file (and then never checks the CRC). */
typedef struct {
    FILE *f;
    const char *path;
    int gzip;
    int member_done; /* the current gzip member reached its end, trailer checked */
    z_stream z;
    unsigned char in[1 << 16];
    char why[160]; /* what went wrong, for the caller's message */
} idx_source;

static size_t refill(idx_source *s) {
    size_t n = fread(s->in, 1, sizeof s->in, s->f);
    s->z.next_in = s->in;
    s->z.avail_in = (uInt)n;
    if (n == 0 && ferror(s->f)) snprintf(s->why, sizeof s->why, "read error");
    return n;
}

static td_status source_open(idx_source *s, const char *path) {
    memset(s, 0, sizeof *s);
    s->path = path;
    size_t size;
    TD__TRY(td__data_open(path, "", &s->f, &size));
    refill(s);
    s->gzip = s->z.avail_in >= 2 && s->in[0] == 0x1f && s->in[1] == 0x8b;
    if (s->gzip && inflateInit2(&s->z, 16 + MAX_WBITS) != Z_OK) {
        fclose(s->f);
        return td__fail(TD_ENOMEM, "%s: cannot start zlib", path);
    }
    return TD_OK;
}

static void source_close(idx_source *s) {
    if (s->gzip) inflateEnd(&s->z);
    if (s->f) fclose(s->f);
}

/* Reads up to len bytes into buf; returns how many came. Fewer than len: the data ended (a
 * gzip stream with its trailer checked, or a plain file) with why empty, or something went
 * wrong, said in why ("unexpected end of file" for a gzip stream cut short). */
static size_t source_read(idx_source *s, void *buf, size_t len) {
    size_t done = 0;
    while (done < len && !s->why[0]) {
        if (!s->gzip) {
            if (!s->z.avail_in && !refill(s)) break;
            size_t n = len - done < s->z.avail_in ? len - done : s->z.avail_in;
            memcpy((char *)buf + done, s->z.next_in, n);
            s->z.next_in += n;
            s->z.avail_in -= n;
            done += n;
            continue;
        }
        if (s->member_done) {
            /* Another gzip member may follow (gzip -c a b > ab); anything else is not ours. */
            if (!s->z.avail_in && !refill(s)) break;
            if (s->z.next_in[0] != 0x1f) {
                snprintf(s->why, sizeof s->why, "stray bytes after the gzip stream");
                break;
            }
            inflateReset(&s->z);
            s->member_done = 0;
        }
        if (!s->z.avail_in && !refill(s)) {
            if (!s->why[0]) snprintf(s->why, sizeof s->why, "unexpected end of file");
            break;
        }
        size_t want = len - done < UINT_MAX ? len - done : UINT_MAX;
        s->z.next_out = (Bytef *)buf + done;
        s->z.avail_out = (uInt)want;
        int ret = inflate(&s->z, Z_NO_FLUSH);
        done += want - s->z.avail_out;
        if (ret == Z_STREAM_END)
            s->member_done = 1;
        else if (ret != Z_OK && ret != Z_BUF_ERROR)
            snprintf(s->why, sizeof s->why, "%s", s->z.msg ? s->z.msg : "damaged data");
    }
    return done;
}

/* Whether the source stopped on a cut (the file ends too soon) rather than on damage. */
static int cut_short(const idx_source *s) {
    return !s->why[0] || !strcmp(s->why, "unexpected end of file");
}

static void swap_bytes(void *data, size_t count, size_t size) {
    unsigned char *p = data;
    for (size_t i = 0; i < count; i++, p += size) {
        for (size_t a = 0, b = size - 1; a < b; a++, b--) {
            unsigned char t = p[a];
            p[a] = p[b];
            p[b] = t;
        }
    }
}

static td_status read_idx(idx_source *s, td_idx *out, unsigned char **data) {
    const char *path = s->path, *sep;
    unsigned char magic[4];
    size_t got = source_read(s, magic, 4);
    sep = s->why[0] ? ": " : "";
    if (got < 4 && !cut_short(s))
        return td__fail(TD_EFORMAT, "%s: cannot read the IDX magic: %s", path, s->why);
    if (got < 4)
        return td__fail(TD_EFORMAT, "%s: expected a 4-byte IDX magic, file has %zu bytes%s%s",
                        path, got, sep, s->why);
    if (magic[0] != 0 || magic[1] != 0)
        return td__fail(TD_EFORMAT,
                        "%s: bad IDX magic %02x %02x %02x %02x (expected 00 00 type ndim)", path,
                        magic[0], magic[1], magic[2], magic[3]);
    switch (magic[2]) {
    case 0x08:
        out->dtype = TD_U8;
        break;
    case 0x0C:
        out->dtype = TD_I32;
        break;
    case 0x0D:
        out->dtype = TD_F32;
        break;
    case 0x0E:
        out->dtype = TD_F64;
        break;
    default:
        return td__fail(
            TD_EFORMAT,
            "%s: IDX type byte 0x%02x is not one of 08 (u8), 0C (i32), 0D (f32), 0E (f64)", path,
            magic[2]);
    }
    int ndim = magic[3];
    if (ndim < 1 || ndim > TD_MAX_DIMS)
        return td__fail(TD_EFORMAT, "%s: IDX ndim %d, expected 1..%d", path, ndim, TD_MAX_DIMS);
    unsigned char dimbuf[4 * TD_MAX_DIMS];
    got = source_read(s, dimbuf, (size_t)4 * ndim);
    sep = s->why[0] ? ": " : "";
    if (got < (size_t)4 * ndim)
        return td__fail(TD_EFORMAT, "%s: header ends inside the %d dims%s%s", path, ndim, sep,
                        s->why);
    out->ndim = ndim;
    size_t elem = td_dtype_size(out->dtype);
    size_t count = 1;
    for (int i = 0; i < ndim; i++) {
        const unsigned char *d = dimbuf + 4 * i;
        uint32_t v = ((uint32_t)d[0] << 24) | ((uint32_t)d[1] << 16) | ((uint32_t)d[2] << 8) | d[3];
        out->dims[i] = v;
        if (v != 0 && count > (SIZE_MAX / 16) / v)
            return td__fail(TD_EFORMAT, "%s: dims overflow the address space", path);
        count *= v;
    }
    size_t bytes = count * elem;
    /* A lying header must not make us allocate terabytes before the read finds out. */
    if (bytes > ((size_t)1 << 36))
        return td__fail(TD_EFORMAT,
                        "%s: header claims %zu bytes of data, more than the 64 GiB limit", path,
                        bytes);
    *data = malloc(bytes ? bytes : 1);
    if (!*data) return td__fail(TD_ENOMEM, "%s: cannot allocate %zu bytes", path, bytes);
    got = source_read(s, *data, bytes);
    sep = s->why[0] ? ": " : "";
    if (got < bytes && !cut_short(s))
        return td__fail(TD_EFORMAT, "%s: damaged gzip data after %zu of the %zu bytes of data: %s",
                        path, got, bytes, s->why);
    if (got < bytes)
        return td__fail(TD_EFORMAT, "%s: expected %zu bytes of data, file ends after %zu%s%s",
                        path, bytes, got, sep, s->why);
    /* The end: nothing more, and for gzip the trailer, whose CRC-32 and length zlib checks
     * when the stream reaches them. */
    unsigned char extra;
    if (source_read(s, &extra, 1))
        return td__fail(TD_EFORMAT,
                        "%s: extra bytes after the %zu bytes of data the header announces", path,
                        bytes);
    if (s->why[0] && !strcmp(s->why, "unexpected end of file"))
        return td__fail(TD_EFORMAT,
                        "%s: the gzip stream ends before its trailer (CRC-32 and length), so the "
                        "%zu bytes of data cannot be checked: unexpected end of file",
                        path, bytes);
    if (s->why[0])
        return td__fail(TD_EFORMAT, "%s: damaged gzip data (all %zu bytes of data read): %s",
                        path, bytes, s->why);
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (elem > 1) swap_bytes(*data, count, elem);
#endif
    out->count = count;
    return TD_OK;
}

td_status td_idx_read(const char *path, td_idx *out) {
    if (!path || !out) return td__fail(TD_EINVAL, "td_idx_read: path and out must not be NULL");
    memset(out, 0, sizeof *out);
    idx_source s;
    TD__TRY(source_open(&s, path));
    unsigned char *data = NULL;
    td_status st = read_idx(&s, out, &data);
    source_close(&s);
    if (st != TD_OK) {
        free(data);
        memset(out, 0, sizeof *out);
        return st;
    }
    out->data = data;
    return TD_OK;
}

void td_idx_free(td_idx *idx) {
    if (!idx) return;
    free(idx->data);
    memset(idx, 0, sizeof *idx);
}
