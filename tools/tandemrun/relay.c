/* Relays a rank's stdout and stderr to the launcher's own, one whole line at a time and
 * prefixed with "[rank K] ", so lines of different ranks never interleave mid-line.
 * It only formats and writes; reading the pipes and deciding when a stream ended is
 * supervise.c's job. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandemrun.h"

/* A line longer than this is written out in pieces, each prefixed, rather than buffered
 * without bound. */
#define TR_MAX_LINE (64 * 1024)

void tr_write_all(int fd, const char *buf, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, buf, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return;
        }
        buf += w;
        n -= (size_t)w;
    }
}

/* Writes one line (with its newline) as a single write, so that it stays whole even when
 * another process shares the launcher's output. */
static void emit_line(tr_rank *rank, tr_stream *s, const char *line, size_t n, int prefix) {
    char head[32];
    int hn = prefix ? snprintf(head, sizeof head, "[rank %d] ", rank->rank) : 0;
    char *tmp = malloc((size_t)hn + n + 1);
    if (!tmp) { /* out of memory: still deliver the text, unprefixed */
        tr_write_all(s->out_fd, line, n);
        return;
    }
    memcpy(tmp, head, (size_t)hn);
    memcpy(tmp + hn, line, n);
    size_t total = (size_t)hn + n;
    if (n == 0 || line[n - 1] != '\n') tmp[total++] = '\n';
    tr_write_all(s->out_fd, tmp, total);
    if (rank->log_fd >= 0) tr_write_all(rank->log_fd, tmp + hn, total - (size_t)hn);
    free(tmp);
}

void tr_relay_bytes(tr_rank *rank, tr_stream *s, const char *data, size_t n, int prefix) {
    while (n > 0) {
        const char *nl = memchr(data, '\n', n);
        size_t take = nl ? (size_t)(nl - data) + 1 : n;
        if (s->len == 0 && nl) { /* the common case: a whole line, no copy */
            emit_line(rank, s, data, take, prefix);
        } else {
            if (s->len + take > s->cap) {
                size_t cap = s->cap ? s->cap : 256;
                while (cap < s->len + take) cap *= 2;
                char *grown = realloc(s->buf, cap);
                if (!grown) { /* deliver what we have rather than lose it */
                    tr_relay_flush(rank, s, prefix);
                    emit_line(rank, s, data, take, prefix);
                    data += take;
                    n -= take;
                    continue;
                }
                s->buf = grown;
                s->cap = cap;
            }
            memcpy(s->buf + s->len, data, take);
            s->len += take;
            if (nl || s->len >= TR_MAX_LINE) tr_relay_flush(rank, s, prefix);
        }
        data += take;
        n -= take;
    }
}

void tr_relay_flush(tr_rank *rank, tr_stream *s, int prefix) {
    if (s->len == 0) return;
    emit_line(rank, s, s->buf, s->len, prefix);
    s->len = 0;
}
