/* A loader for the op fixtures in tests/fixtures/ops (written by make_fixtures.py there):
 * a text header of "attr name value" and "array name dtype ndim dims..." lines closed by
 * "end", then the raw little-endian values of every array in header order. Header-only,
 * for tests; it checks the file fully (a truncated or malformed fixture is an error naming
 * the file, never a crash) but does not know what any op means. */
#ifndef TANDEM_TEST_FIXTURE_H
#define TANDEM_TEST_FIXTURE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/core.h"

#include "core/core_impl.h"

#define FIXTURE_MAX_ATTRS 16
#define FIXTURE_MAX_ARRAYS 16

typedef struct {
    char name[32];
    td_dtype dtype; /* TD_F32, TD_I64 or TD_U8 */
    int ndim;
    int64_t shape[8];
    size_t count;
    void *data; /* (count) elements, malloc'd, suitably aligned */
} fixture_array;

typedef struct {
    char path[512];
    char op[32];
    int nattr, narray;
    char attr_name[FIXTURE_MAX_ATTRS][32];
    double attr_value[FIXTURE_MAX_ATTRS];
    fixture_array arrays[FIXTURE_MAX_ARRAYS];
} fixture;

/* The fixture directory: $TD_FIXTURES_DIR, else tests/fixtures/ops under the current
 * directory (tests run from the repository root). */
static inline const char *fixture_dir(void) {
    const char *d = getenv("TD_FIXTURES_DIR");
    return d && *d ? d : "tests/fixtures/ops";
}

static inline void fixture_free(fixture *f) {
    for (int i = 0; i < f->narray; i++) free(f->arrays[i].data);
    f->narray = 0;
}

/* Reads one header line (up to '\n') from *pos; 0 at the end of the buffer. */
static inline int fixture_line(const char *buf, size_t len, size_t *pos, char *line, size_t cap) {
    size_t i = 0;
    if (*pos >= len) return 0;
    while (*pos < len && buf[*pos] != '\n') {
        if (i + 1 < cap) line[i++] = buf[*pos];
        (*pos)++;
    }
    if (*pos < len) (*pos)++; /* the newline */
    line[i] = '\0';
    return 1;
}

/* Loads <dir>/<name>.tdf into f (which the caller frees with fixture_free). */
static inline td_status fixture_load(fixture *f, const char *name) {
    memset(f, 0, sizeof *f);
    snprintf(f->path, sizeof f->path, "%s/%s.tdf", fixture_dir(), name);
    FILE *fp = fopen(f->path, "rb");
    if (!fp) return td__fail(TD_EIO, "%s: cannot open (set TD_FIXTURES_DIR?)", f->path);
    fseek(fp, 0, SEEK_END);
    long flen = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *buf = malloc(flen > 0 ? (size_t)flen : 1);
    size_t len = buf ? fread(buf, 1, (size_t)(flen > 0 ? flen : 0), fp) : 0;
    fclose(fp);
    if (!buf) return td__fail(TD_ENOMEM, "%s: out of memory", f->path);

    char line[256];
    size_t pos = 0;
    td_status st = TD_OK;
    int ended = 0;
    if (!fixture_line(buf, len, &pos, line, sizeof line) || strcmp(line, "tandem-fixture 1")) {
        st = td__fail(TD_EFORMAT, "%s: not a version 1 fixture", f->path);
        goto done;
    }
    while (!ended && fixture_line(buf, len, &pos, line, sizeof line)) {
        char key[32], dt[8];
        int used = 0;
        if (!strcmp(line, "end")) {
            ended = 1;
        } else if (sscanf(line, "op %31s", f->op) == 1) {
        } else if (!strncmp(line, "attr ", 5)) {
            if (f->nattr == FIXTURE_MAX_ATTRS ||
                sscanf(line, "attr %31s %lf", f->attr_name[f->nattr], &f->attr_value[f->nattr]) !=
                    2) {
                st = td__fail(TD_EFORMAT, "%s: bad attr line '%s'", f->path, line);
                goto done;
            }
            f->nattr++;
        } else if (sscanf(line, "array %31s %7s %n", key, dt, &used) == 2 && used > 0) {
            fixture_array *a = &f->arrays[f->narray];
            const char *p = line + used;
            int n = 0;
            if (f->narray == FIXTURE_MAX_ARRAYS || sscanf(p, "%d%n", &a->ndim, &n) != 1 ||
                a->ndim < 0 || a->ndim > 8) {
                st = td__fail(TD_EFORMAT, "%s: bad array line '%s'", f->path, line);
                goto done;
            }
            snprintf(a->name, sizeof a->name, "%s", key);
            a->dtype = !strcmp(dt, "f32")   ? TD_F32
                       : !strcmp(dt, "i64") ? TD_I64
                       : !strcmp(dt, "u8")  ? TD_U8
                                            : TD_DTYPE_COUNT;
            if (a->dtype == TD_DTYPE_COUNT) {
                st = td__fail(TD_EFORMAT, "%s: array %s has unknown dtype '%s'", f->path, key, dt);
                goto done;
            }
            a->count = 1;
            for (int d = 0; d < a->ndim; d++) {
                p += n;
                long long v;
                if (sscanf(p, "%lld%n", &v, &n) != 1 || v < 0 || v > (1 << 24)) {
                    st = td__fail(TD_EFORMAT, "%s: array %s has a bad dim %d", f->path, key, d);
                    goto done;
                }
                a->shape[d] = v;
                a->count *= (size_t)v;
            }
            f->narray++;
        } else {
            st = td__fail(TD_EFORMAT, "%s: unknown header line '%s'", f->path, line);
            goto done;
        }
    }
    if (!ended) {
        st = td__fail(TD_EFORMAT, "%s: header has no 'end' line", f->path);
        goto done;
    }
    for (int i = 0; i < f->narray; i++) {
        fixture_array *a = &f->arrays[i];
        size_t bytes = a->count * td_dtype_size(a->dtype);
        if (len - pos < bytes) {
            st = td__fail(TD_EFORMAT, "%s: truncated in array %s (%zu bytes left, %zu needed)",
                          f->path, a->name, len - pos, bytes);
            goto done;
        }
        a->data = malloc(bytes ? bytes : 1);
        if (!a->data) {
            st = td__fail(TD_ENOMEM, "%s: out of memory", f->path);
            goto done;
        }
        memcpy(a->data, buf + pos, bytes);
        pos += bytes;
    }
    if (pos != len) st = td__fail(TD_EFORMAT, "%s: %zu trailing bytes", f->path, len - pos);
done:
    free(buf);
    if (st != TD_OK) fixture_free(f);
    return st;
}

/* The array called `name`, or NULL. */
static inline const fixture_array *fixture_get(const fixture *f, const char *name) {
    for (int i = 0; i < f->narray; i++)
        if (!strcmp(f->arrays[i].name, name)) return &f->arrays[i];
    return NULL;
}

/* The f32 data of array `name`, or NULL when it is missing or not f32. */
static inline float *fixture_f32(const fixture *f, const char *name) {
    const fixture_array *a = fixture_get(f, name);
    return a && a->dtype == TD_F32 ? (float *)a->data : NULL;
}

/* The value of attr `name`, or `fallback`. */
static inline double fixture_attr(const fixture *f, const char *name, double fallback) {
    for (int i = 0; i < f->nattr; i++)
        if (!strcmp(f->attr_name[i], name)) return f->attr_value[i];
    return fallback;
}

#endif
