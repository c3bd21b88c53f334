/* The rendezvous store's server (see tandem/store.h, and store_impl.h for the wire format):
 * one thread polls every connection, so one slow client never blocks the others. It does
 * not persist anything, does not encrypt, and is not meant for bulk data.
 *
 * It listens only on the addresses it was given (every IPv4 address of a name), never on an
 * interface nobody asked for. Anyone who reaches the port can still open connections, so a
 * connection that has not authenticated (a stranger) is cheap to drop: it gets
 * STORE_AUTH_TIMEOUT_S to present the token and may send nothing else, and when every slot
 * (or every file descriptor) is taken, the oldest stranger is closed to make room for a
 * newcomer. An authenticated client is never shed; when only authenticated clients are
 * left, a newcomer is told the store is full. The server also closes a client that sends an
 * unknown op, a key over TD_STORE_MAX_KEY or a value over TD_STORE_MAX_VALUE, or that leaves
 * a request unfinished for STORE_IO_TIMEOUT_S. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "store/store_impl.h"
#include "core/core_impl.h"

#define STORE_IO_TIMEOUT_S 10.0  /* an authenticated client's unfinished request is dropped then */
#define STORE_AUTH_TIMEOUT_S 2.0 /* a new connection must have presented its token by then */
/* Slots cost ~100 bytes each; what usually binds first is the host's open-file limit (often
 * 1024), which the server treats the same way. */
#define STORE_MAX_CONNS 4096
#define STORE_MAX_LISTEN 8 /* addresses one host name may resolve to */
/* A rendezvous opens one connection per rank at once; an accept queue that overflows makes
 * the kernel drop SYNs and a rank wait a second for the retransmit. The kernel caps it at
 * net.core.somaxconn. */
#define STORE_BACKLOG 4096
#define STORE_ACCEPT_BATCH 256 /* accepts per poll round, so a flood cannot starve the clients */

typedef struct {
    char *key;
    unsigned char *value;
    size_t len;
} store_entry;

typedef struct {
    int fd;
    int authed;
    uint64_t serial;   /* order of acceptance: the oldest stranger is shed first; 0 when free */
    unsigned char *in; /* header + key + value of the request being read */
    size_t in_len, in_need, in_cap;
    unsigned char *out; /* reply not yet written */
    size_t out_len, out_off;
    uint64_t deadline_ns; /* for the unfinished request or handshake; 0 when idle */
    /* A GET or WAIT parked until its key is set. */
    int waiting, wait_op;
    char *wait_key;
    uint64_t wait_deadline_ns;
} store_conn;

struct td__store_server {
    int listen_fd[STORE_MAX_LISTEN];
    size_t n_listen;
    int wake[2];
    int spare_fd; /* /dev/null, given up for a moment to answer "full" when out of fds */
    uint64_t accept_paused_until_ns;
    pthread_t thread;
    char *token;
    store_entry *entries;
    size_t n_entries, cap_entries;
    store_conn *conns;
    size_t n_conns;
    uint64_t next_serial;
    /* Connections dropped since the last log line: a flood logs one line a second. */
    size_t n_shed, n_refused, n_denied, n_strangers;
    uint64_t log_due_ns;
};

/* Compares without an early exit, so the token cannot be guessed byte by byte by timing. */
static int token_equal(const unsigned char *a, size_t alen, const char *b) {
    size_t blen = strlen(b);
    unsigned diff = (unsigned)(alen != blen);
    for (size_t i = 0; i < alen && i < blen; i++) diff |= (unsigned)(a[i] ^ (unsigned char)b[i]);
    return diff == 0;
}

static store_entry *entry_find(td__store_server *s, const char *key) {
    for (size_t i = 0; i < s->n_entries; i++)
        if (strcmp(s->entries[i].key, key) == 0) return &s->entries[i];
    return NULL;
}

static store_entry *entry_put(td__store_server *s, const char *key, const unsigned char *v,
                              size_t len) {
    store_entry *e = entry_find(s, key);
    unsigned char *copy = malloc(len ? len : 1);
    if (!copy) return NULL;
    if (len) memcpy(copy, v, len);
    if (!e) {
        if (s->n_entries == s->cap_entries) {
            size_t cap = s->cap_entries ? 2 * s->cap_entries : 16;
            store_entry *grown = realloc(s->entries, cap * sizeof *grown);
            if (!grown) {
                free(copy);
                return NULL;
            }
            s->entries = grown;
            s->cap_entries = cap;
        }
        char *k = strdup(key);
        if (!k) {
            free(copy);
            return NULL;
        }
        e = &s->entries[s->n_entries++];
        e->key = k;
        e->value = NULL;
    }
    free(e->value);
    e->value = copy;
    e->len = len;
    return e;
}

static void conn_close(store_conn *c) {
    if (c->fd >= 0) close(c->fd);
    free(c->in);
    free(c->out);
    free(c->wait_key);
    memset(c, 0, sizeof *c);
    c->fd = -1;
}

/* Queues a reply; the poll loop writes what the socket does not take now. */
static int conn_reply(store_conn *c, int status, const void *value, size_t len) {
    unsigned char *buf = realloc(c->out, c->out_len + STORE_REP_HDR + len);
    if (!buf) return -1;
    c->out = buf;
    unsigned char *p = buf + c->out_len;
    memset(p, 0, STORE_REP_HDR);
    p[0] = (unsigned char)status;
    put_u32(p + 4, (uint32_t)len);
    if (len) memcpy(p + STORE_REP_HDR, value, len);
    c->out_len += STORE_REP_HDR + len;
    return 0;
}

static void conn_write(store_conn *c) {
    while (c->out_off < c->out_len) {
        ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
            conn_close(c);
            return;
        }
        c->out_off += (size_t)w;
    }
    c->out_len = c->out_off = 0;
}

static void wake_waiters(td__store_server *s, const char *key) {
    for (size_t i = 0; i < s->n_conns; i++) {
        store_conn *c = &s->conns[i];
        if (c->fd < 0 || !c->waiting || strcmp(c->wait_key, key) != 0) continue;
        store_entry *e = entry_find(s, key);
        c->waiting = 0;
        free(c->wait_key);
        c->wait_key = NULL;
        int rc = c->wait_op == OP_GET ? conn_reply(c, ST_OK, e->value, e->len)
                                      : conn_reply(c, ST_OK, NULL, 0);
        if (rc) conn_close(c);
    }
}

/* Keeps the address of a connection refused for its token under TD_STORE_KEY_DENIED, so that
 * a client waiting for a peer learns that the peer came with another token (store.h). */
static void record_denied(td__store_server *s, int fd) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    char text[INET_ADDRSTRLEN + 8] = "an unknown address";
    char ip[INET_ADDRSTRLEN];
    if (getpeername(fd, (struct sockaddr *)&a, &len) == 0 && a.sin_family == AF_INET &&
        inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip))
        snprintf(text, sizeof text, "%s:%d", ip, ntohs(a.sin_port));
    if (entry_put(s, TD_STORE_KEY_DENIED, (const unsigned char *)text, strlen(text) + 1))
        wake_waiters(s, TD_STORE_KEY_DENIED);
}

/* Handles one complete request; returns -1 to drop the connection, 1 to drop it once the
 * queued reply is sent. */
static int conn_handle(td__store_server *s, store_conn *c) {
    const unsigned char *h = c->in;
    int op = h[0];
    uint32_t klen = get_u32(h + 4), vlen = get_u32(h + 8), arg = get_u32(h + 12);
    const unsigned char *kp = h + STORE_REQ_HDR, *vp = kp + klen;
    if (!c->authed) {
        /* An explicit answer, so that the client blames the token only when it is wrong. */
        if (!token_equal(vp, vlen, s->token)) {
            s->n_denied++;
            record_denied(s, c->fd);
            return conn_reply(c, ST_DENIED, NULL, 0) ? -1 : 1;
        }
        c->authed = 1;
        return conn_reply(c, ST_OK, NULL, 0);
    }
    if (klen == 0) return -1;
    char key[TD_STORE_MAX_KEY + 1];
    memcpy(key, kp, klen);
    key[klen] = 0;
    if (strlen(key) != klen) return -1; /* embedded NUL */
    switch (op) {
    case OP_SET:
        if (!entry_put(s, key, vp, vlen)) return -1;
        wake_waiters(s, key);
        return conn_reply(c, ST_OK, NULL, 0);
    case OP_ADD: {
        if (vlen != 8) return -1;
        store_entry *e = entry_find(s, key);
        int64_t v = 0;
        if (e && e->len == 8) v = get_i64(e->value);
        v = (int64_t)((uint64_t)v + (uint64_t)get_i64(vp));
        unsigned char b[8];
        put_i64(b, v);
        if (!entry_put(s, key, b, 8)) return -1;
        wake_waiters(s, key);
        return conn_reply(c, ST_OK, b, 8);
    }
    case OP_GET:
    case OP_WAIT: {
        store_entry *e = entry_find(s, key);
        if (e)
            return op == OP_GET ? conn_reply(c, ST_OK, e->value, e->len)
                                : conn_reply(c, ST_OK, NULL, 0);
        if (arg == 0) return conn_reply(c, ST_MISSING, NULL, 0);
        c->wait_key = strdup(key);
        if (!c->wait_key) return -1;
        c->waiting = 1;
        c->wait_op = op;
        c->wait_deadline_ns = td_time_ns() + (uint64_t)arg * 1000000ull;
        return 0;
    }
    default:
        return -1;
    }
}

/* A request header that is not worth reading further: from a stranger, anything but a
 * token of plausible size (so strangers cannot make the server buffer megabytes). */
static int header_bad(const store_conn *c) {
    const unsigned char *h = c->in;
    uint32_t klen = get_u32(h + 4), vlen = get_u32(h + 8);
    int op = h[0];
    if (op < OP_AUTH || op > OP_WAIT || h[1] || h[2] || h[3]) return 1;
    if (!c->authed) return op != OP_AUTH || klen != 0 || vlen > TD_STORE_MAX_TOKEN;
    return op == OP_AUTH || klen > TD_STORE_MAX_KEY || vlen > TD_STORE_MAX_VALUE;
}

/* Reads what is available; handles a request once it is complete. */
static void conn_read(td__store_server *s, store_conn *c) {
    for (;;) {
        size_t want = c->in_need - c->in_len;
        if (c->in_cap < c->in_need) {
            unsigned char *grown = realloc(c->in, c->in_need);
            if (!grown) {
                conn_close(c);
                return;
            }
            c->in = grown;
            c->in_cap = c->in_need;
        }
        ssize_t r = recv(c->fd, c->in + c->in_len, want, 0);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            conn_close(c);
            return;
        }
        if (r < 0) return;
        /* A client with a parked request must not send more: a protocol error. */
        if (c->waiting) {
            conn_close(c);
            return;
        }
        /* A stranger's deadline runs from its arrival and is never extended. */
        if (c->in_len == 0 && c->authed)
            c->deadline_ns = td_time_ns() + (uint64_t)(STORE_IO_TIMEOUT_S * 1e9);
        c->in_len += (size_t)r;
        if (c->in_len < c->in_need) continue;
        if (c->in_need == STORE_REQ_HDR) {
            if (header_bad(c)) {
                if (c->authed)
                    td__log(TD_LOG_WARN, "store: dropped a client that sent a malformed request");
                else
                    s->n_strangers++;
                conn_close(c);
                return;
            }
            c->in_need = STORE_REQ_HDR + (size_t)get_u32(c->in + 4) + get_u32(c->in + 8);
            if (c->in_len < c->in_need) continue;
        }
        int rc = conn_handle(s, c);
        c->in_len = 0;
        c->in_need = STORE_REQ_HDR;
        c->deadline_ns = 0;
        if (rc > 0) conn_write(c); /* the verdict fits any socket buffer: send it, then close */
        if (rc) {
            conn_close(c);
            return;
        }
    }
}

/* The connection accepted first among those that have not authenticated (NULL if none);
 * *held counts the open connections. */
static store_conn *oldest_stranger(td__store_server *s, size_t *held) {
    store_conn *oldest = NULL;
    *held = 0;
    for (size_t i = 0; i < s->n_conns; i++) {
        store_conn *c = &s->conns[i];
        if (c->fd < 0) continue;
        ++*held;
        if (!c->authed && (!oldest || c->serial < oldest->serial)) oldest = c;
    }
    return oldest;
}

/* A slot for a new connection: a free one, else the oldest stranger's, closed to make room;
 * NULL when every slot holds an authenticated client. */
static store_conn *slot_take(td__store_server *s, size_t *held) {
    for (size_t i = 0; i < s->n_conns; i++)
        if (s->conns[i].fd < 0) return &s->conns[i];
    if (s->n_conns < STORE_MAX_CONNS) return &s->conns[s->n_conns++];
    store_conn *c = oldest_stranger(s, held);
    if (!c) return NULL;
    conn_close(c);
    s->n_shed++;
    return c;
}

/* Tells a newcomer the store is full, in place of the answer to the token it is about to
 * send, and closes it. */
static void refuse_full(td__store_server *s, int fd, size_t held, size_t limit, int which) {
    unsigned char b[STORE_REP_HDR + STORE_FULL_LEN] = {ST_FULL};
    put_u32(b + 4, STORE_FULL_LEN);
    put_u32(b + 8, (uint32_t)held);
    put_u32(b + 12, (uint32_t)limit);
    put_u32(b + 16, (uint32_t)which);
    ssize_t w = send(fd, b, sizeof b, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w; /* a newcomer that cannot take 20 bytes learns nothing either way */
    /* Reading what it already sent lets close() end with FIN, not a reset that could race
     * the answer. */
    unsigned char junk[512];
    for (int i = 0; i < 16 && recv(fd, junk, sizeof junk, MSG_DONTWAIT) > 0; i++) {
    }
    close(fd);
    s->n_refused++;
}

static size_t fd_limit(void) {
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return 0;
    return (size_t)r.rlim_cur;
}

/* Out of file descriptors: close the oldest stranger, or, when only authenticated clients
 * hold descriptors, give up the spare one for a moment to tell the newcomer so. Returns 1
 * when accepting may go on. */
static int accept_out_of_fds(td__store_server *s, int lfd) {
    size_t held;
    store_conn *c = oldest_stranger(s, &held);
    if (c) {
        conn_close(c);
        s->n_shed++;
        return 1;
    }
    int fd = -1;
    if (s->spare_fd >= 0) {
        close(s->spare_fd);
        fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd >= 0) refuse_full(s, fd, held, fd_limit(), FULL_FILES);
        s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    if (fd >= 0) return 1;
    /* Nothing to give: stop polling the listener for a moment rather than spin on it. */
    s->accept_paused_until_ns = td_time_ns() + 100000000ull;
    return 0;
}

static void server_accept(td__store_server *s, int lfd) {
    for (int n = 0; n < STORE_ACCEPT_BATCH; n++) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if ((errno == EMFILE || errno == ENFILE) && accept_out_of_fds(s, lfd)) continue;
            if (errno == ENOBUFS || errno == ENOMEM)
                s->accept_paused_until_ns = td_time_ns() + 100000000ull;
            return;
        }
        size_t held = 0;
        store_conn *c = slot_take(s, &held);
        if (!c) {
            refuse_full(s, fd, held, STORE_MAX_CONNS, FULL_SLOTS);
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        memset(c, 0, sizeof *c);
        c->fd = fd;
        c->serial = ++s->next_serial;
        c->in_need = STORE_REQ_HDR;
        c->deadline_ns = td_time_ns() + (uint64_t)(STORE_AUTH_TIMEOUT_S * 1e9);
        /* A client sends its token right after connecting: if it is here already, the
         * connection is no longer a stranger that a later arrival could shed. */
        conn_read(s, c);
        if (c->fd >= 0 && c->out_len) conn_write(c);
    }
}

/* One line for the connections dropped since the last one. */
static void log_drops(td__store_server *s) {
    char msg[512];
    int len = 0;
    const struct {
        size_t n;
        const char *what;
    } parts[] = {
        {s->n_shed, "closed to make room (store full)"},
        {s->n_refused, "refused (store full of authenticated clients)"},
        {s->n_denied, "presented a wrong token"},
        {s->n_strangers, "sent no token in time or sent something else"},
    };
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
        if (parts[i].n && len >= 0 && (size_t)len < sizeof msg)
            len += snprintf(msg + len, sizeof msg - (size_t)len, "%s%zu %s", len ? ", " : "",
                            parts[i].n, parts[i].what);
    if (len > 0) td__log(TD_LOG_WARN, "store: dropped connections: %s", msg);
    s->n_shed = s->n_refused = s->n_denied = s->n_strangers = 0;
}

/* Expires parked waits and drops connections past their deadline; lowers *next to the
 * earliest deadline left. */
static void server_expire(td__store_server *s, uint64_t now, uint64_t *next) {
    for (size_t i = 0; i < s->n_conns; i++) {
        store_conn *c = &s->conns[i];
        if (c->fd < 0) continue;
        if (c->waiting && c->wait_deadline_ns <= now) {
            c->waiting = 0;
            free(c->wait_key);
            c->wait_key = NULL;
            if (conn_reply(c, ST_MISSING, NULL, 0)) conn_close(c);
        }
        if (c->fd >= 0 && c->deadline_ns && c->deadline_ns <= now) {
            /* A token that arrived while the server was busy still counts. */
            if (!c->authed) conn_read(s, c);
            if (c->fd >= 0 && c->deadline_ns && c->deadline_ns <= now) {
                if (c->authed)
                    td__log(TD_LOG_WARN, "store: dropped a client that stalled mid-request");
                else
                    s->n_strangers++;
                conn_close(c);
            }
        }
        if (c->fd < 0) continue;
        if (c->waiting && c->wait_deadline_ns < *next) *next = c->wait_deadline_ns;
        if (c->deadline_ns && c->deadline_ns < *next) *next = c->deadline_ns;
    }
    while (s->n_conns && s->conns[s->n_conns - 1].fd < 0) s->n_conns--;
}

static void *server_main(void *arg) {
    td__store_server *s = arg;
    size_t base = 1 + s->n_listen;
    struct pollfd *pfd = malloc((base + STORE_MAX_CONNS) * sizeof *pfd);
    uint64_t *polled = malloc(STORE_MAX_CONNS * sizeof *polled); /* serials behind pfd */
    while (pfd && polled) {
        uint64_t now = td_time_ns(), next = now + 1000000000ull;
        server_expire(s, now, &next);
        if (s->n_shed || s->n_refused || s->n_denied || s->n_strangers) {
            if (now >= s->log_due_ns) {
                log_drops(s);
                s->log_due_ns = now + 1000000000ull;
            } else if (s->log_due_ns < next) {
                next = s->log_due_ns;
            }
        }
        int accepting = now >= s->accept_paused_until_ns;
        if (!accepting && s->accept_paused_until_ns < next) next = s->accept_paused_until_ns;
        pfd[0] = (struct pollfd){.fd = s->wake[0], .events = POLLIN};
        for (size_t l = 0; l < s->n_listen; l++)
            pfd[1 + l] = (struct pollfd){.fd = accepting ? s->listen_fd[l] : -1, .events = POLLIN};
        for (size_t i = 0; i < s->n_conns; i++) {
            store_conn *c = &s->conns[i];
            pfd[base + i] = (struct pollfd){.fd = c->fd,
                                            .events = (short)(POLLIN | (c->out_len ? POLLOUT : 0))};
            polled[i] = c->serial;
        }
        size_t nc = s->n_conns;
        int ms = (int)((next - now) / 1000000ull) + 1;
        int n = poll(pfd, base + nc, ms);
        if (n < 0 && errno != EINTR) break;
        if (n <= 0) continue;
        if (pfd[0].revents) break;
        /* Clients first, then newcomers: a newcomer may take the slot of a client that
         * just left, and must not receive that client's events. */
        for (size_t i = 0; i < nc; i++) {
            store_conn *c = &s->conns[i];
            short ev = pfd[base + i].revents;
            if (c->fd < 0 || c->serial != polled[i] || !ev) continue;
            if (ev & (POLLIN | POLLHUP | POLLERR)) conn_read(s, c);
            if (c->fd >= 0 && c->out_len) conn_write(c);
        }
        for (size_t l = 0; l < s->n_listen; l++)
            if (pfd[1 + l].revents & POLLIN) server_accept(s, s->listen_fd[l]);
    }
    log_drops(s);
    free(pfd);
    free(polled);
    return NULL;
}

static void server_free(td__store_server *s) {
    if (!s) return;
    for (size_t l = 0; l < s->n_listen; l++) close(s->listen_fd[l]);
    if (s->wake[0] >= 0) close(s->wake[0]);
    if (s->wake[1] >= 0) close(s->wake[1]);
    if (s->spare_fd >= 0) close(s->spare_fd);
    for (size_t i = 0; i < s->n_conns; i++) conn_close(&s->conns[i]);
    for (size_t i = 0; i < s->n_entries; i++) {
        free(s->entries[i].key);
        free(s->entries[i].value);
    }
    free(s->entries);
    free(s->conns);
    free(s->token);
    free(s);
}

/* Listens on a:port; returns the socket, or -1 with errno set. */
static int listen_on(struct in_addr a, int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = sockaddr_of(a, port);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, STORE_BACKLOG) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

/* Listens on every address of `host`, all on one port (*port, or one the kernel picks for
 * the first address when 0). */
static td_status server_listen(td__store_server *s, const char *host, int *port) {
    struct in_addr addrs[STORE_MAX_LISTEN];
    size_t n;
    int numeric;
    td_status st = td__store_resolve(host, addrs, STORE_MAX_LISTEN, &n, &numeric);
    if (st) return st;
    char ip[INET_ADDRSTRLEN];
    if (!numeric) {
        size_t loop = 0;
        while (loop < n && ntohl(addrs[loop].s_addr) >> 24 == 127) loop++;
        inet_ntop(AF_INET, &addrs[0], ip, sizeof ip);
        if (loop == n && strncmp(host, "localhost", 9) != 0)
            td__log(TD_LOG_WARN,
                    "store: '%s' resolves to %s here, a loopback address: only processes on "
                    "this host can reach the store (give this host's network address when "
                    "ranks on other hosts need it)",
                    host, ip);
    }
    /* With port 0 the kernel picks the first address's port, which may be taken on another;
     * a few fresh picks settle it. */
    for (int attempt = 0;; attempt++) {
        int p = *port;
        size_t k = 0;
        for (; k < n; k++) {
            int fd = listen_on(addrs[k], p);
            if (fd < 0) break;
            s->listen_fd[s->n_listen++] = fd;
            if (p == 0) {
                struct sockaddr_in sa;
                socklen_t alen = sizeof sa;
                getsockname(fd, (struct sockaddr *)&sa, &alen);
                p = ntohs(sa.sin_port);
            }
        }
        if (k == n) {
            *port = p;
            return TD_OK;
        }
        int e = errno;
        while (s->n_listen) close(s->listen_fd[--s->n_listen]);
        if (e == EADDRINUSE && *port == 0 && k > 0 && attempt < 8) continue;
        inet_ntop(AF_INET, &addrs[k], ip, sizeof ip);
        char where[300];
        if (numeric)
            snprintf(where, sizeof where, "%s:%d", ip, p);
        else
            snprintf(where, sizeof where, "%s (%s) port %d", host, ip, p);
        return td__fail(TD_EIO, "store: cannot listen on %s: %s%s", where, strerror(e),
                        e == EADDRNOTAVAIL ? " (not an address of this host; the store listens "
                                             "only on the address it is given)"
                                           : "");
    }
}

td_status td__store_server_start(td__store_server **out, const char *host, int *port,
                                 const char *token) {
    td__store_server *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "store: out of memory");
    s->wake[0] = s->wake[1] = -1;
    s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    s->token = strdup(token);
    s->conns = calloc(STORE_MAX_CONNS, sizeof *s->conns);
    if (!s->token || !s->conns) {
        server_free(s);
        return td__fail(TD_ENOMEM, "store: out of memory");
    }
    td_status st = server_listen(s, host, port);
    if (st) {
        server_free(s);
        return st;
    }
    if (pipe2(s->wake, O_CLOEXEC) != 0 || pthread_create(&s->thread, NULL, server_main, s) != 0) {
        server_free(s);
        return td__fail(TD_EIO, "store: cannot start the server thread");
    }
    *out = s;
    return TD_OK;
}

void td__store_server_stop(td__store_server *s) {
    if (!s) return;
    char b = 1;
    if (write(s->wake[1], &b, 1) != 1) td__log(TD_LOG_WARN, "store: cannot wake the server thread");
    pthread_join(s->thread, NULL);
    server_free(s);
}
