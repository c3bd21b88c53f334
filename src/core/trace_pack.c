/* A trace as bytes: packed for another process (td_trace_pack, td_trace_unpack), and kept in a
 * file as it records (td_trace_keep, td_trace_read), so that a process killed mid-run leaves
 * its spans behind for the launcher to merge.
 *
 * Both are one stream: "TDTRACE2", the rank, then records, each a type byte and its fields:
 * 'H' the host, 'R' a row's tid and name, 'S' a span's tid, start, duration, link, name and
 * category, and at the end of a packed trace 'E' with the number of spans. A string is a u32
 * length (0xffffffff for none) and its bytes; numbers are in this machine's order, as a trace
 * travels between processes of one architecture. A kept file has no 'E' until the keeping
 * ends (a killed process never writes one), and each record is one write(2): a file cut inside
 * its last record (a write stopped by SIGKILL or a full disk) reads back up to that record. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core_impl.h"
#include "trace_impl.h"

static const char pack_magic[8] = "TDTRACE2";
#define PACK_NULL 0xffffffffu /* the length of a NULL string */

typedef struct {
    unsigned char *p;
    size_t len, cap;
    int failed;
} packer;

static void put(packer *w, const void *data, size_t n) {
    if (w->failed) return;
    if (w->len + n > w->cap) {
        size_t cap = w->cap ? w->cap : 4096;
        while (cap < w->len + n) cap *= 2;
        unsigned char *grown = realloc(w->p, cap);
        if (!grown) {
            w->failed = 1;
            return;
        }
        w->p = grown;
        w->cap = cap;
    }
    memcpy(w->p + w->len, data, n);
    w->len += n;
}

static void put_str(packer *w, const char *s) {
    uint32_t n = s ? (uint32_t)strlen(s) : PACK_NULL;
    put(w, &n, sizeof n);
    if (s) put(w, s, n);
}

static void put_header(packer *w, const td_trace *t) {
    int32_t rank = t->rank;
    put(w, pack_magic, sizeof pack_magic);
    put(w, &rank, sizeof rank);
}

static void put_host(packer *w, const td_trace *t) {
    put(w, "H", 1);
    put_str(w, t->host);
}

static void put_row(packer *w, const td__trace_row *row) {
    int32_t tid = row->tid;
    put(w, "R", 1);
    put(w, &tid, sizeof tid);
    put_str(w, row->name);
}

static void put_span(packer *w, const td_trace_event *e) {
    int32_t tid = e->tid;
    uint64_t times[3] = {e->start_ns, e->dur_ns, e->link};
    put(w, "S", 1);
    put(w, &tid, sizeof tid);
    put(w, times, sizeof times);
    put_str(w, e->name);
    put_str(w, e->category);
}

/* Everything recorded so far, without the end. The caller holds the lock. */
static void put_trace(packer *w, const td_trace *t) {
    put_header(w, t);
    if (t->host) put_host(w, t);
    for (size_t i = 0; i < t->nrows; i++) put_row(w, &t->rows[i]);
    for (size_t i = 0; i < t->count; i++) put_span(w, &t->events[i]);
}

td_status td_trace_pack(const td_trace *trace, void **bytes, size_t *len) {
    if (!trace || !bytes || !len) return td__fail(TD_EINVAL, "td_trace_pack: NULL argument");
    packer w = {0};
    pthread_mutex_lock((pthread_mutex_t *)&trace->lock);
    put_trace(&w, trace);
    uint64_t nevents = trace->count;
    pthread_mutex_unlock((pthread_mutex_t *)&trace->lock);
    put(&w, "E", 1);
    put(&w, &nevents, sizeof nevents);
    if (w.failed) {
        free(w.p);
        return td__fail(TD_ENOMEM, "td_trace_pack: out of memory packing %llu spans",
                        (unsigned long long)nevents);
    }
    *bytes = w.p;
    *len = w.len;
    return TD_OK;
}

/* ---- reading a stream -------------------------------------------------------------------- */

typedef struct {
    const unsigned char *p, *end;
    int bad;
} unpacker;

static void get(unpacker *r, void *out, size_t n) {
    if (r->bad || (size_t)(r->end - r->p) < n) {
        r->bad = 1;
        memset(out, 0, n);
        return;
    }
    memcpy(out, r->p, n);
    r->p += n;
}

/* A malloc'd copy of the next string, or NULL (for a NULL string, or when bad). */
static char *get_str(unpacker *r) {
    uint32_t n;
    get(r, &n, sizeof n);
    if (r->bad || n == PACK_NULL) return NULL;
    if ((size_t)(r->end - r->p) < n) {
        r->bad = 1;
        return NULL;
    }
    char *s = malloc((size_t)n + 1);
    if (!s) {
        r->bad = 1;
        return NULL;
    }
    memcpy(s, r->p, n);
    s[n] = '\0';
    r->p += n;
    return s;
}

/* Reads one record into t; 'E' when it was the end (its count in *ends), 0 when the bytes
 * stopped inside the record (r->bad), '?' for a type that is none of ours. */
static int get_record(unpacker *r, td_trace *t, td_status *s, uint64_t *ends) {
    char type;
    get(r, &type, 1);
    if (r->bad) return 0;
    if (type == 'H') {
        char *host = get_str(r);
        if (host) *s = td_trace_set_host(t, host);
        free(host);
    } else if (type == 'R') {
        int32_t tid;
        get(r, &tid, sizeof tid);
        char *name = get_str(r);
        if (name) *s = td_trace_name_track(t, tid, name);
        free(name);
    } else if (type == 'S') {
        int32_t tid;
        uint64_t times[3];
        get(r, &tid, sizeof tid);
        get(r, times, sizeof times);
        char *name = get_str(r), *cat = get_str(r);
        if (!r->bad && name)
            *s = td__trace_record(t, name, cat, tid, times[2], times[0], times[0] + times[1]);
        else
            r->bad = 1;
        free(name);
        free(cat);
    } else if (type == 'E') {
        get(r, ends, sizeof *ends);
    } else {
        return '?';
    }
    return r->bad ? 0 : type;
}

/* The trace in len bytes. whole: they must be a packed trace to its end (td_trace_unpack);
 * else a kept file, taken up to its last whole record. `what` names the bytes in messages. */
static td_status parse(td_trace **out, const void *bytes, size_t len, int whole, const char *what) {
    *out = NULL;
    unpacker r = {bytes, (const unsigned char *)bytes + len, 0};
    char magic[sizeof pack_magic];
    get(&r, magic, sizeof magic);
    if (r.bad || memcmp(magic, pack_magic, sizeof magic) != 0)
        return td__fail(TD_EFORMAT, "%s: %zu bytes are not a packed trace", what, len);
    int32_t rank;
    get(&r, &rank, sizeof rank);
    td_trace *t;
    TD__TRY(td_trace_create(&t, rank));
    td_status s = TD_OK;
    uint64_t ends = 0;
    int type = 'S';
    while (!s && r.p < r.end && type != 'E' && type != '?' && type) {
        const unsigned char *at = r.p;
        type = get_record(&r, t, &s, &ends);
        if (!type && !whole) r.p = at; /* a kept file cut inside its last record */
    }
    if (!s && type == '?')
        s = td__fail(TD_EFORMAT, "%s: rank %d's trace has a record of unknown type", what,
                     (int)rank);
    else if (!s && whole && (type != 'E' || r.p != r.end || ends != t->count))
        s = td__fail(TD_EFORMAT, "%s: rank %d's packed trace is %s", what, (int)rank,
                     type != 'E' ? "cut short or damaged" : "followed by stray bytes");
    else if (!s && !whole && type == 'E' && r.p != r.end)
        s = td__fail(TD_EFORMAT, "%s: rank %d's trace is followed by stray bytes", what, (int)rank);
    if (s) {
        td_trace_destroy(t);
        return s;
    }
    *out = t;
    return TD_OK;
}

td_status td_trace_unpack(td_trace **out, const void *bytes, size_t len) {
    if (!out || (!bytes && len)) return td__fail(TD_EINVAL, "td_trace_unpack: NULL argument");
    return parse(out, bytes, len, 1, "td_trace_unpack");
}

td_status td_trace_read(td_trace **out, const char *path) {
    if (!out || !path) return td__fail(TD_EINVAL, "td_trace_read: NULL argument");
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return td__fail(TD_EIO, "%s: cannot open it: %s", path, strerror(errno));
    packer w = {0};
    char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) put(&w, buf, n);
    int err = ferror(f);
    fclose(f);
    td_status s;
    if (w.failed)
        s = td__fail(TD_ENOMEM, "%s: out of memory reading it", path);
    else if (err)
        s = td__fail(TD_EIO, "%s: read error", path);
    else
        s = parse(out, w.p, w.len, 0, path);
    free(w.p);
    return s;
}

/* ---- keeping ----------------------------------------------------------------------------- */

/* Writes the packed bytes to the kept file; on a failure cuts it back to its whole records
 * and stops the keeping. The caller holds the lock. */
static void keep_write(td_trace *t, packer *w) {
    ssize_t done = w->failed ? -1 : write(t->keep_fd, w->p, w->len);
    if (done == (ssize_t)w->len) {
        t->kept += (long long)w->len;
    } else {
        int e = done < 0 ? errno : ENOSPC; /* a short write: the disk filled */
        if (w->failed) e = ENOMEM;
        /* were the cut to fail too, a reader still stops before the torn record */
        int cut = ftruncate(t->keep_fd, (off_t)t->kept);
        (void)cut;
        close(t->keep_fd);
        t->keep_fd = -1;
        char why[512];
        snprintf(why, sizeof why, "%s stopped growing after %lld bytes: %s", t->keep_path, t->kept,
                 strerror(e));
        free(t->keep_error);
        t->keep_error = strdup(why);
    }
    free(w->p);
}

void td__trace_keep_span(td_trace *t, const td_trace_event *e) {
    packer w = {0};
    put_span(&w, e);
    keep_write(t, &w);
}

void td__trace_keep_row(td_trace *t, const td__trace_row *row) {
    packer w = {0};
    put_row(&w, row);
    keep_write(t, &w);
}

void td__trace_keep_host(td_trace *t) {
    packer w = {0};
    put_host(&w, t);
    keep_write(t, &w);
}

td_status td_trace_keep(td_trace *trace, const char *path) {
    if (!trace) return td__fail(TD_EINVAL, "td_trace_keep: the trace is NULL");
    td_status s = TD_OK;
    pthread_mutex_lock(&trace->lock);
    if (trace->keep_fd >= 0) { /* the end: a reader then knows the file is whole */
        packer w = {0};
        uint64_t n = trace->count;
        put(&w, "E", 1);
        put(&w, &n, sizeof n);
        keep_write(trace, &w);
        if (trace->keep_fd >= 0) close(trace->keep_fd);
        trace->keep_fd = -1;
    }
    free(trace->keep_path);
    trace->keep_path = NULL;
    free(trace->keep_error);
    trace->keep_error = NULL;
    trace->kept = 0;
    if (path) {
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        trace->keep_path = strdup(path);
        if (fd < 0 || !trace->keep_path) {
            s = td__fail(fd < 0 ? TD_EIO : TD_ENOMEM, "td_trace_keep: %s: %s", path,
                         fd < 0 ? strerror(errno) : "out of memory");
            if (fd >= 0) close(fd);
            free(trace->keep_path);
            trace->keep_path = NULL;
        } else {
            trace->keep_fd = fd;
            packer w = {0};
            put_trace(&w, trace);
            keep_write(trace, &w);
            if (trace->keep_fd < 0) {
                s = td__fail(TD_EIO, "td_trace_keep: %s", trace->keep_error);
                unlink(path);
            }
        }
    }
    pthread_mutex_unlock(&trace->lock);
    return s;
}

const char *td_trace_keep_error(const td_trace *trace) {
    if (!trace) return NULL;
    pthread_mutex_lock((pthread_mutex_t *)&trace->lock);
    const char *e = trace->keep_error;
    pthread_mutex_unlock((pthread_mutex_t *)&trace->lock);
    return e;
}
