/* Text corpora for language models: the bytes of a text (byte-level tokens, vocabulary 256, so
 * no tokenizer is needed), read from a plain text file or from the R lazy-load database Debian's
 * r-cran-janeaustenr ships Jane Austen's six novels in, and the fixed-length windows a sampler
 * picks from. The database (data/Rdata.rdb) is a run of entries, each a big-endian u32 length
 * and a zlib stream of one object in R's XDR serialization; the novels are character vectors,
 * one element per line, which this joins with newlines in the file's order. R is not needed.
 * Anything else in the file is an error naming the offset, never a crash. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "tandem/data.h"

#include "core/core_impl.h"
#include "data_impl.h"

const char *td_corpus_default_path(void) {
    return "/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb";
}

/* A growing byte buffer, never past TD_CORPUS_MAX_BYTES. */
typedef struct {
    uint8_t *p;
    size_t n, cap;
    int too_big; /* a put would have passed the bound */
} bytes;

static int put(bytes *b, const void *src, size_t n) {
    if (n > TD_CORPUS_MAX_BYTES - b->n) {
        b->too_big = 1;
        return 0;
    }
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 1 << 20;
        while (cap < b->n + n) cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) return 0;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
    return 1;
}

static uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* One serialized object: a character vector's lines are appended to out; another object is
 * skipped. Returns 0 when the bytes are not R's XDR serialization. */
static int r_object(const uint8_t *p, size_t n, bytes *out, int *lines) {
    size_t at = 2;
    if (n < 14 || p[0] != 'X' || p[1] != '\n') return 0;
    uint32_t version = be32(p + at);
    at += 12; /* version, writer's R version, oldest R version that reads it */
    if (version == 3) {
        if (at + 4 > n) return 0;
        at += 4 + be32(p + at); /* the native encoding's name */
    } else if (version != 2) {
        return 0;
    }
    if (at + 8 > n) return 0;
    if ((be32(p + at) & 0xff) != 16) return 1; /* not a character vector (STRSXP) */
    uint32_t count = be32(p + at + 4);
    at += 8;
    for (uint32_t i = 0; i < count; i++) {
        if (at + 8 > n || (be32(p + at) & 0xff) != 9) return 0; /* CHARSXP */
        uint32_t len = be32(p + at + 4);
        at += 8;
        if (len == 0xffffffffu) continue; /* NA */
        if (len > n - at) return 0;
        if (!put(out, p + at, len) || !put(out, "\n", 1)) return 0;
        at += len;
        (*lines)++;
    }
    return 1;
}

static td_status read_rdb(const uint8_t *raw, size_t size, const char *path, bytes *out) {
    size_t at = 0;
    int lines = 0;
    uint8_t *obj = NULL;
    td_status st = TD_OK;
    while (st == TD_OK && at < size) {
        if (size - at < 5) {
            st = td__fail(TD_EFORMAT, "%s: a truncated entry at offset %zu", path, at);
            break;
        }
        uint32_t len = be32(raw + at);
        if (len > TD_CORPUS_MAX_BYTES) {
            st = td__fail(TD_EFORMAT,
                          "%s: the entry at offset %zu claims %u bytes, more than a text may hold "
                          "(TD_CORPUS_MAX_BYTES, 1 GiB; is this an R lazy-load database, "
                          "data/Rdata.rdb?)",
                          path, at, len);
            break;
        }
        uint8_t *o = realloc(obj, len ? len : 1);
        if (!o) {
            st = td__fail(TD_ENOMEM, "%s: out of memory for an entry of %u bytes", path, len);
            break;
        }
        obj = o;
        z_stream z;
        memset(&z, 0, sizeof z);
        z.next_in = (Bytef *)(raw + at + 4);
        z.avail_in = (uInt)(size - at - 4);
        z.next_out = obj;
        z.avail_out = len;
        int zs = inflateInit(&z);
        if (zs == Z_OK) zs = inflate(&z, Z_FINISH);
        size_t used = (size - at - 4) - z.avail_in, got = len - z.avail_out;
        inflateEnd(&z);
        int parsed = zs == Z_STREAM_END && got == len && r_object(obj, len, out, &lines);
        if (out->too_big)
            st = td__fail(TD_EINVAL,
                          "%s: the novels unpack to more than a text may hold (TD_CORPUS_MAX_BYTES, "
                          "1 GiB)",
                          path);
        else if (!parsed)
            st = td__fail(TD_EFORMAT,
                          "%s: the entry at offset %zu is not a zlib-compressed R object (is "
                          "this an R lazy-load database, data/Rdata.rdb?)",
                          path, at);
        at += 4 + used;
    }
    free(obj);
    if (st == TD_OK && lines == 0)
        st = td__fail(TD_EFORMAT, "%s: holds no character vectors", path);
    return st;
}

td_status td_corpus_load(td_corpus *out, const char *path) {
    if (!out || !path) return td__fail(TD_EINVAL, "td_corpus_load: NULL argument");
    memset(out, 0, sizeof *out);
    FILE *f;
    size_t size;
    TD__TRY(td__data_open(path,
                          " (Jane Austen's novels come with Debian's r-cran-janeaustenr: sh "
                          "scripts/deps.sh installs it; or give a plain text file)",
                          &f, &size));
    if (size > TD_CORPUS_MAX_BYTES) {
        fclose(f);
        return td__fail(TD_EINVAL,
                        "%s: %zu bytes, more than a text may hold (TD_CORPUS_MAX_BYTES, 1 GiB: "
                        "every rank reads the whole text into its memory)",
                        path, size);
    }
    bytes raw = {0};
    uint8_t buf[1 << 16];
    size_t n;
    int ok = 1;
    while (ok && (n = fread(buf, 1, sizeof buf, f)) > 0) ok = put(&raw, buf, n);
    int err = ferror(f);
    fclose(f);
    if (!ok || err) {
        free(raw.p);
        if (raw.too_big)
            return td__fail(TD_EINVAL, "%s: grew past the %zu bytes a text may hold while read",
                            path, TD_CORPUS_MAX_BYTES);
        return td__fail(ok ? TD_EIO : TD_ENOMEM, "%s: %s while reading", path,
                        ok ? "an I/O error" : "out of memory");
    }
    size_t len = strlen(path);
    if (len >= 4 && strcmp(path + len - 4, ".rdb") == 0) {
        bytes text = {0};
        td_status st = read_rdb(raw.p, raw.n, path, &text);
        free(raw.p);
        if (st != TD_OK) {
            free(text.p);
            return st;
        }
        raw = text;
    }
    if (raw.n < 2) {
        free(raw.p);
        return td__fail(TD_EFORMAT, "%s: %zu bytes of text, too few to train on", path, raw.n);
    }
    out->bytes = raw.p;
    out->size = raw.n;
    return TD_OK;
}

void td_corpus_free(td_corpus *c) {
    if (!c) return;
    free(c->bytes);
    memset(c, 0, sizeof *c);
}

size_t td_corpus_windows(size_t size, int64_t T) {
    return T > 0 && size > 1 ? (size - 1) / (size_t)T : 0;
}

void td_corpus_window(const uint8_t *text, size_t k, int64_t T, float *x, int64_t *y) {
    const uint8_t *w = text + k * (size_t)T;
    for (int64_t t = 0; t < T; t++) {
        if (x) x[t] = (float)w[t];
        if (y) y[t] = w[t + 1];
    }
}
