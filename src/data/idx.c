/* IDX file reader (the MNIST format): 4-byte magic {0, 0, dtype, ndim}, ndim big-endian
 * uint32 dims, then the data in big-endian order. zlib's gzread reads gzip files and passes
 * plain files through, so both work.
 *
 * Every length is checked against the header, and a gzip file must end with its whole
 * trailer (CRC-32 and length): zlib verifies the CRC there, so a file cut short or damaged
 * anywhere is an error. It does not accept IDX's i8 / i16 types, which no dataset we load
 * uses. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "tandem/data.h"

#include "core/core_impl.h"

/* gzread inflates a large request straight into the caller's buffer and, when the stream
 * turns out damaged, returns -1 without saying how much of it was good; reading in pieces of
 * this size keeps the count of good bytes, which the error message reports. */
#define READ_PIECE ((size_t)1 << 16)

static size_t read_full(gzFile f, void *buf, size_t len, int *zerr) {
    size_t done = 0;
    *zerr = 0;
    while (done < len) {
        size_t want = len - done < READ_PIECE ? len - done : READ_PIECE;
        int got = gzread(f, (char *)buf + done, (unsigned)want);
        if (got < 0) {
            *zerr = 1;
            break;
        }
        if (got == 0) break;
        done += (size_t)got;
    }
    return done;
}

/* zlib's message for the last error, without the "path: " it puts in front (the caller's
 * message names the file once), or NULL when zlib reports none. gzread takes a stream that
 * ends before its trailer for a plain end of file (Z_BUF_ERROR), so callers ask at the end. */
static const char *gz_message(gzFile f, const char *path) {
    int code = 0;
    const char *msg = gzerror(f, &code);
    if (code == Z_OK || !msg) return NULL;
    size_t n = strlen(path);
    if (!strncmp(msg, path, n) && !strncmp(msg + n, ": ", 2)) msg += n + 2;
    return *msg ? msg : "read error";
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

td_status td_idx_read(const char *path, td_idx *out) {
    if (!path || !out) return td__fail(TD_EINVAL, "td_idx_read: path and out must not be NULL");
    memset(out, 0, sizeof *out);
    gzFile f = gzopen(path, "rb");
    if (!f) return td__fail(TD_EIO, "%s: cannot open: %s", path, strerror(errno));
    td_status st = TD_OK;
    unsigned char *data = NULL;
    int zerr = 0;
    unsigned char magic[4];
    size_t got = read_full(f, magic, 4, &zerr);
    if (zerr) {
        st = td__fail(TD_EFORMAT, "%s: cannot read the IDX magic: %s", path, gz_message(f, path));
        goto done;
    }
    if (got < 4) {
        const char *why = gz_message(f, path);
        st = td__fail(TD_EFORMAT, "%s: expected a 4-byte IDX magic, file has %zu bytes%s%s", path,
                      got, why ? ": " : "", why ? why : "");
        goto done;
    }
    if (magic[0] != 0 || magic[1] != 0) {
        st =
            td__fail(TD_EFORMAT, "%s: bad IDX magic %02x %02x %02x %02x (expected 00 00 type ndim)",
                     path, magic[0], magic[1], magic[2], magic[3]);
        goto done;
    }
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
        st =
            td__fail(TD_EFORMAT,
                     "%s: IDX type byte 0x%02x is not one of 08 (u8), 0C (i32), 0D (f32), 0E (f64)",
                     path, magic[2]);
        goto done;
    }
    int ndim = magic[3];
    if (ndim < 1 || ndim > TD_MAX_DIMS) {
        st = td__fail(TD_EFORMAT, "%s: IDX ndim %d, expected 1..%d", path, ndim, TD_MAX_DIMS);
        goto done;
    }
    unsigned char dimbuf[4 * TD_MAX_DIMS];
    got = read_full(f, dimbuf, (size_t)4 * ndim, &zerr);
    if (zerr || got < (size_t)4 * ndim) {
        const char *why = gz_message(f, path);
        st = td__fail(TD_EFORMAT, "%s: header ends inside the %d dims%s%s", path, ndim,
                      why ? ": " : "", why ? why : "");
        goto done;
    }
    out->ndim = ndim;
    size_t elem = td_dtype_size(out->dtype);
    size_t count = 1;
    for (int i = 0; i < ndim; i++) {
        const unsigned char *d = dimbuf + 4 * i;
        uint32_t v = ((uint32_t)d[0] << 24) | ((uint32_t)d[1] << 16) | ((uint32_t)d[2] << 8) | d[3];
        out->dims[i] = v;
        if (v != 0 && count > (SIZE_MAX / 16) / v) {
            st = td__fail(TD_EFORMAT, "%s: dims overflow the address space", path);
            goto done;
        }
        count *= v;
    }
    size_t bytes = count * elem;
    /* A lying header must not make us allocate terabytes before the read finds out. */
    if (bytes > ((size_t)1 << 36)) {
        st = td__fail(TD_EFORMAT, "%s: header claims %zu bytes of data, more than the 64 GiB limit",
                      path, bytes);
        goto done;
    }
    data = malloc(bytes ? bytes : 1);
    if (!data) {
        st = td__fail(TD_ENOMEM, "%s: cannot allocate %zu bytes", path, bytes);
        goto done;
    }
    got = read_full(f, data, bytes, &zerr);
    if (zerr) {
        st = td__fail(TD_EFORMAT, "%s: damaged gzip data after %zu of the %zu bytes of data: %s",
                      path, got, bytes, gz_message(f, path));
        goto done;
    }
    if (got < bytes) {
        const char *why = gz_message(f, path);
        st = td__fail(TD_EFORMAT, "%s: expected %zu bytes of data, file ends after %zu%s%s", path,
                      bytes, got, why ? ": " : "", why ? why : "");
        goto done;
    }
    /* The end: nothing more, and for gzip the trailer, whose CRC-32 and length zlib checks
     * when it reaches them; a stream cut inside the trailer reads as a clean end of file, so
     * zlib is asked whether it ended where it should. */
    unsigned char extra;
    size_t more = read_full(f, &extra, 1, &zerr);
    const char *why = gz_message(f, path);
    if (more) {
        st =
            td__fail(TD_EFORMAT, "%s: extra bytes after the %zu bytes of data the header announces",
                     path, bytes);
        goto done;
    }
    if (zerr) {
        st = td__fail(TD_EFORMAT, "%s: damaged gzip data (all %zu bytes of data read): %s", path,
                      bytes, why);
        goto done;
    }
    if (why) {
        st = td__fail(TD_EFORMAT,
                      "%s: the gzip stream ends before its trailer (CRC-32 and length), so the "
                      "%zu bytes of data cannot be checked: %s",
                      path, bytes, why);
        goto done;
    }
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (elem > 1) swap_bytes(data, count, elem);
#endif
    out->count = count;
    out->data = data;
    data = NULL;
done:
    free(data);
    gzclose(f);
    if (st != TD_OK) memset(out, 0, sizeof *out);
    return st;
}

void td_idx_free(td_idx *idx) {
    if (!idx) return;
    free(idx->data);
    memset(idx, 0, sizeof *idx);
}
