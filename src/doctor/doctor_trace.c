/* The dumps' calls as a trace: every call a rank's dump holds that waited past the spin becomes
 * a span on that rank's row, from when it began waiting to when it ended (or to the dump, for a
 * call still in flight), joined across the ranks by group and sequence number, so that the
 * trace layer's merged writer draws who arrived last. Appended to a trace tandem wrote
 * (tandemrun --trace) as its last events, the hang shows at the end of the job's timeline. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/trace.h"

#include "core/core_impl.h"
#include "doctor/doctor_impl.h"

/* How td_trace_write_merged ends a file, and begins one. */
static const char trace_tail[] = "\n],\"displayTimeUnit\":\"ms\"}\n";
static const char trace_head[] = "{\"traceEvents\":[\n";

static uint64_t link_of(const char *key, uint64_t seq) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *p = key; *p; p++) h = (h ^ (unsigned char)*p) * 0x100000001b3ull;
    h = (h ^ seq) * 0x100000001b3ull;
    return h | 1;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1))) {
            *len = fread(buf, 1, (size_t)n, f);
            buf[*len] = 0;
        }
    }
    fclose(f);
    return buf;
}

/* Writes `path` as `old` with the events of `add` (both files of td_trace_write_merged) put
 * before old's end. */
static td_status splice(const char *path, const char *old, size_t old_len, const char *add,
                        size_t add_len) {
    size_t tail = sizeof trace_tail - 1, head = sizeof trace_head - 1;
    if (add_len < head + tail || memcmp(add, trace_head, head) != 0)
        return td__fail(TD_EFORMAT, "td_doctor_trace: the dumps' trace came out malformed");
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.doctor.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return td__fail(TD_EIO, "td_doctor_trace: %s: %s", tmp, strerror(errno));
    fwrite(old, 1, old_len - tail, f);
    fputs(",\n", f);
    fwrite(add + head, 1, add_len - head, f);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad || rename(tmp, path) != 0) {
        unlink(tmp);
        return td__fail(TD_EIO, "td_doctor_trace: cannot write %s", path);
    }
    return TD_OK;
}

td_status td_doctor_trace(const char *dir, const char *path) {
    if (!dir || !path) return td__fail(TD_EINVAL, "td_doctor_trace: NULL directory or path");
    dr_job job;
    TD__TRY(td__doctor_load(dir, &job));
    td_trace **traces = calloc((size_t)job.n + 1, sizeof *traces);
    size_t n = 0;
    td_status s = traces ? TD_OK : td__fail(TD_ENOMEM, "td_doctor_trace: out of memory");
    for (int r = 0; !s && r < job.n; r++) {
        const dr_rank *k = &job.ranks[r];
        if (!k->have_dump) continue;
        td_trace *t = NULL;
        s = td_trace_create(&t, r);
        if (!s) traces[n++] = t;
        if (!s) s = td_trace_set_host(t, k->host);
        if (!s) s = td_trace_name_thread(t, "calls in the dump");
        for (int g = 0; !s && g < k->ngroups; g++) {
            const dr_group *grp = &k->groups[g];
            for (int c = 0; !s && c < grp->ncalls; c++) {
                const dr_call *call = &grp->calls[c];
                if (call->wait_s <= 0) continue;
                double ago = call->ended_s_ago >= 0 ? call->ended_s_ago : 0;
                uint64_t end = k->time_ns - (uint64_t)(ago * 1e9),
                         start = end - (uint64_t)(call->wait_s * 1e9);
                char name[400];
                snprintf(name, sizeof name, "%s%s%s%s (%s)", call->desc, call->tag[0] ? " [" : "",
                         call->tag, call->tag[0] ? "]" : "", call->state);
                s = call->coll ? td_trace_span_linked(t, name, "doctor",
                                                      link_of(grp->key, call->seq), start, end)
                               : td_trace_span(t, name, "doctor", start, end);
            }
        }
    }
    if (!s && n == 0) s = td__fail(TD_ENOTFOUND, "td_doctor_trace: %s holds no dump", dir);
    size_t old_len = 0, add_len = 0;
    char *old = s ? NULL : read_file(path, &old_len);
    int append = old && old_len > sizeof trace_tail &&
                 strcmp(old + old_len - (sizeof trace_tail - 1), trace_tail) == 0;
    if (!s && !append) {
        s = td_trace_write_merged((const td_trace *const *)traces, n, path);
    } else if (!s) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.dumps.%d", path, (int)getpid());
        s = td_trace_write_merged((const td_trace *const *)traces, n, tmp);
        char *add = s ? NULL : read_file(tmp, &add_len);
        unlink(tmp);
        if (!s)
            s = add ? splice(path, old, old_len, add, add_len)
                    : td__fail(TD_EIO, "td_doctor_trace: cannot read back %s", tmp);
        free(add);
    }
    free(old);
    for (size_t i = 0; i < n; i++) td_trace_destroy(traces[i]);
    free(traces);
    td__doctor_free(&job);
    return s;
}
