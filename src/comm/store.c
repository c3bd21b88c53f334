/* The rendezvous store (see tandem/store.h): a poll-based server thread hosted by one
 * process, and a blocking client with deadlines. It does not persist anything, does not
 * encrypt, and is not meant for bulk data.
 *
 * Wire format (all integers little-endian). A request is a 16-byte header
 *     u8 op, u8 0, u8 0, u8 0, u32 key_len, u32 value_len, u32 arg
 * followed by key_len key bytes and value_len value bytes. Ops: 1 AUTH (value = token;
 * must be a connection's first request), 2 SET, 3 GET (arg = milliseconds to wait for the
 * key), 4 ADD (value = i64 delta), 5 WAIT (arg = milliseconds). A reply is an 8-byte header
 *     u8 status, u8 0, u8 0, u8 0, u32 value_len
 * and value_len bytes: status 0 ok (GET: the value, ADD: the new i64), 1 key did not
 * appear in time. The server closes a connection that sends a wrong token, an unknown op,
 * a key over TD_STORE_MAX_KEY or a value over TD_STORE_MAX_VALUE, or that leaves a request
 * (or its authentication) unfinished for STORE_IO_TIMEOUT_S; one slow client never
 * blocks the others. */
#include "tandem/store.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/core_impl.h"

#define STORE_IO_TIMEOUT_S 10.0 /* an unfinished request or handshake is dropped after this */
#define STORE_MAX_CONNS 1024
#define STORE_REQ_HDR 16
#define STORE_REP_HDR 8

enum { OP_AUTH = 1, OP_SET = 2, OP_GET = 3, OP_ADD = 4, OP_WAIT = 5 };
enum { ST_OK = 0, ST_MISSING = 1 };

typedef struct {
    char *key;
    unsigned char *value;
    size_t len;
} store_entry;

typedef struct {
    int fd;
    int authed;
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

typedef struct {
    int listen_fd;
    int wake[2];
    pthread_t thread;
    char *token;
    store_entry *entries;
    size_t n_entries, cap_entries;
    store_conn *conns;
    size_t n_conns;
} store_server;

struct td_store {
    int fd;
    int port;
    double timeout_s;
    pthread_mutex_t lock;
    store_server *server;
};

static void put_u32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static uint32_t get_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_i64(unsigned char *p, int64_t v) {
    put_u32(p, (uint32_t)((uint64_t)v & 0xffffffffu));
    put_u32(p + 4, (uint32_t)((uint64_t)v >> 32));
}

static int64_t get_i64(const unsigned char *p) {
    return (int64_t)((uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32);
}

/* Compares without an early exit, so the token cannot be guessed byte by byte by timing. */
static int token_equal(const unsigned char *a, size_t alen, const char *b) {
    size_t blen = strlen(b);
    unsigned diff = (unsigned)(alen != blen);
    for (size_t i = 0; i < alen && i < blen; i++) diff |= (unsigned)(a[i] ^ (unsigned char)b[i]);
    return diff == 0;
}

/* ---------------------------------------------------------------- server */

static store_entry *entry_find(store_server *s, const char *key) {
    for (size_t i = 0; i < s->n_entries; i++)
        if (strcmp(s->entries[i].key, key) == 0) return &s->entries[i];
    return NULL;
}

static store_entry *entry_put(store_server *s, const char *key, const unsigned char *v,
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
    c->fd = -1;
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

static void wake_waiters(store_server *s, const char *key) {
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

/* Handles one complete request; returns -1 to drop the connection. */
static int conn_handle(store_server *s, store_conn *c) {
    const unsigned char *h = c->in;
    int op = h[0];
    uint32_t klen = get_u32(h + 4), vlen = get_u32(h + 8), arg = get_u32(h + 12);
    const unsigned char *kp = h + STORE_REQ_HDR, *vp = kp + klen;
    if (!c->authed) {
        if (op != OP_AUTH || !token_equal(vp, vlen, s->token)) {
            td__log(TD_LOG_WARN, "store: dropped a connection that presented a wrong token");
            return -1;
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

/* Reads what is available; handles a request once it is complete. */
static void conn_read(store_server *s, store_conn *c) {
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
        if (c->in_len == 0 && c->authed)
            c->deadline_ns = td_time_ns() + (uint64_t)(STORE_IO_TIMEOUT_S * 1e9);
        c->in_len += (size_t)r;
        if (c->in_len < c->in_need) continue;
        if (c->in_need == STORE_REQ_HDR) {
            uint32_t klen = get_u32(c->in + 4), vlen = get_u32(c->in + 8);
            int op = c->in[0];
            if (op < OP_AUTH || op > OP_WAIT || c->in[1] || c->in[2] || c->in[3] ||
                klen > TD_STORE_MAX_KEY || vlen > TD_STORE_MAX_VALUE) {
                td__log(TD_LOG_WARN, "store: dropped a connection that sent a malformed request");
                conn_close(c);
                return;
            }
            c->in_need = STORE_REQ_HDR + (size_t)klen + vlen;
            if (c->in_len < c->in_need) continue;
        }
        int rc = conn_handle(s, c);
        c->in_len = 0;
        c->in_need = STORE_REQ_HDR;
        c->deadline_ns = 0;
        if (rc) {
            conn_close(c);
            return;
        }
    }
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

static void server_accept(store_server *s) {
    for (;;) {
        int fd = accept(s->listen_fd, NULL, NULL);
        if (fd < 0) return;
        size_t slot = s->n_conns;
        for (size_t i = 0; i < s->n_conns; i++)
            if (s->conns[i].fd < 0) {
                slot = i;
                break;
            }
        if (slot == STORE_MAX_CONNS) {
            close(fd);
            continue;
        }
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (slot == s->n_conns) s->n_conns++;
        store_conn *c = &s->conns[slot];
        memset(c, 0, sizeof *c);
        c->fd = fd;
        c->in_need = STORE_REQ_HDR;
        c->deadline_ns = td_time_ns() + (uint64_t)(STORE_IO_TIMEOUT_S * 1e9);
    }
}

static void *server_main(void *arg) {
    store_server *s = arg;
    struct pollfd *pfd = malloc((STORE_MAX_CONNS + 2) * sizeof *pfd);
    if (!pfd) return NULL;
    for (;;) {
        uint64_t now = td_time_ns(), next = now + 1000000000ull;
        /* Expire parked waits and drop connections that stalled mid-request. */
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
                td__log(TD_LOG_WARN, "store: dropped a connection that stalled mid-request");
                conn_close(c);
            }
            if (c->fd < 0) continue;
            if (c->waiting && c->wait_deadline_ns < next) next = c->wait_deadline_ns;
            if (c->deadline_ns && c->deadline_ns < next) next = c->deadline_ns;
        }
        while (s->n_conns && s->conns[s->n_conns - 1].fd < 0) s->n_conns--;
        pfd[0] = (struct pollfd){.fd = s->wake[0], .events = POLLIN};
        pfd[1] = (struct pollfd){.fd = s->listen_fd, .events = POLLIN};
        for (size_t i = 0; i < s->n_conns; i++) {
            store_conn *c = &s->conns[i];
            pfd[i + 2] = (struct pollfd){.fd = c->fd,
                                         .events = (short)(POLLIN | (c->out_len ? POLLOUT : 0))};
        }
        int ms = (int)((next - now) / 1000000ull) + 1;
        int n = poll(pfd, s->n_conns + 2, ms);
        if (n < 0 && errno != EINTR) break;
        if (n <= 0) continue;
        if (pfd[0].revents) break;
        if (pfd[1].revents & POLLIN) server_accept(s);
        size_t nc = s->n_conns; /* accept may add slots not in pfd yet */
        for (size_t i = 0; i < nc && i + 2 < (size_t)STORE_MAX_CONNS + 2; i++) {
            store_conn *c = &s->conns[i];
            short ev = pfd[i + 2].revents;
            if (c->fd < 0 || c->fd != pfd[i + 2].fd || !ev) continue;
            if (ev & (POLLIN | POLLHUP | POLLERR)) conn_read(s, c);
            if (c->fd >= 0 && c->out_len) conn_write(c);
        }
    }
    free(pfd);
    return NULL;
}

static void server_free(store_server *s) {
    if (!s) return;
    if (s->listen_fd >= 0) close(s->listen_fd);
    if (s->wake[0] >= 0) close(s->wake[0]);
    if (s->wake[1] >= 0) close(s->wake[1]);
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

static td_status resolve(const char *host, int port, struct sockaddr_in *addr) {
    memset(addr, 0, sizeof *addr);
    addr->sin_family = AF_INET;
    addr->sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &addr->sin_addr) == 1) return TD_OK;
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(host, NULL, &hints, &res);
    if (rc != 0 || !res)
        return td__fail(TD_EINVAL, "store: cannot resolve host '%s': %s", host, gai_strerror(rc));
    addr->sin_addr = ((struct sockaddr_in *)res->ai_addr)->sin_addr;
    freeaddrinfo(res);
    return TD_OK;
}

static td_status server_start(store_server **out, const char *host, int *port, const char *token) {
    store_server *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "store: out of memory");
    s->listen_fd = s->wake[0] = s->wake[1] = -1;
    s->token = strdup(token);
    s->conns = calloc(STORE_MAX_CONNS, sizeof *s->conns);
    if (!s->token || !s->conns) {
        server_free(s);
        return td__fail(TD_ENOMEM, "store: out of memory");
    }
    struct sockaddr_in addr;
    td_status st = resolve(host, *port, &addr);
    if (st) {
        server_free(s);
        return st;
    }
    /* Listening on every interface lets clients use any of the host's addresses. */
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    s->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (s->listen_fd >= 0) setsockopt(s->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (s->listen_fd < 0 || bind(s->listen_fd, (struct sockaddr *)&addr, sizeof addr) != 0 ||
        listen(s->listen_fd, 128) != 0) {
        int e = errno;
        server_free(s);
        return td__fail(TD_EIO, "store: cannot listen on port %d: %s", *port, strerror(e));
    }
    socklen_t alen = sizeof addr;
    getsockname(s->listen_fd, (struct sockaddr *)&addr, &alen);
    *port = ntohs(addr.sin_port);
    fcntl(s->listen_fd, F_SETFL, fcntl(s->listen_fd, F_GETFL) | O_NONBLOCK);
    if (pipe2(s->wake, O_CLOEXEC) != 0 || pthread_create(&s->thread, NULL, server_main, s) != 0) {
        server_free(s);
        return td__fail(TD_EIO, "store: cannot start the server thread");
    }
    *out = s;
    return TD_OK;
}

static void server_stop(store_server *s) {
    if (!s) return;
    char b = 1;
    if (write(s->wake[1], &b, 1) != 1) td__log(TD_LOG_WARN, "store: cannot wake the server thread");
    pthread_join(s->thread, NULL);
    server_free(s);
}

/* ---------------------------------------------------------------- client */

static uint64_t deadline_after(double seconds) { return td_time_ns() + (uint64_t)(seconds * 1e9); }

/* Moves all `len` bytes in direction `out` before the deadline. */
static td_status io_all(int fd, void *buf, size_t len, int out, uint64_t deadline,
                        const char *what) {
    unsigned char *p = buf;
    while (len) {
        uint64_t now = td_time_ns();
        if (now >= deadline) return td__fail(TD_ETIMEOUT, "store: %s timed out", what);
        struct pollfd pf = {.fd = fd, .events = out ? POLLOUT : POLLIN};
        int ms = (int)((deadline - now) / 1000000ull) + 1;
        int n = poll(&pf, 1, ms);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) continue;
        ssize_t r = out ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (r <= 0)
            return td__fail(TD_EPEER, "store: %s: the store host closed the connection%s%s", what,
                            r < 0 ? ": " : "", r < 0 ? strerror(errno) : "");
        p += r;
        len -= (size_t)r;
    }
    return TD_OK;
}

/* One request/reply exchange. `reply` gets the value (up to cap); *rlen the full length. */
static td_status request(td_store *st, int op, const char *key, const void *value, size_t vlen,
                         uint32_t arg, uint64_t deadline, int *status, void *reply, size_t cap,
                         size_t *rlen, const char *what) {
    size_t klen = key ? strlen(key) : 0;
    if (klen > TD_STORE_MAX_KEY)
        return td__fail(TD_EINVAL, "store: key '%.40s...' is over %d bytes", key, TD_STORE_MAX_KEY);
    if (vlen > TD_STORE_MAX_VALUE)
        return td__fail(TD_EINVAL, "store: value of '%s' is over %u bytes", key,
                        TD_STORE_MAX_VALUE);
    unsigned char hdr[STORE_REQ_HDR] = {0};
    hdr[0] = (unsigned char)op;
    put_u32(hdr + 4, (uint32_t)klen);
    put_u32(hdr + 8, (uint32_t)vlen);
    put_u32(hdr + 12, arg);
    td_status s = io_all(st->fd, hdr, sizeof hdr, 1, deadline, what);
    if (!s && klen) s = io_all(st->fd, (void *)key, klen, 1, deadline, what);
    if (!s && vlen) s = io_all(st->fd, (void *)value, vlen, 1, deadline, what);
    unsigned char rep[STORE_REP_HDR];
    if (!s) s = io_all(st->fd, rep, sizeof rep, 0, deadline, what);
    if (s) return s;
    uint32_t len = get_u32(rep + 4);
    if (len > TD_STORE_MAX_VALUE) return td__fail(TD_EPEER, "store: %s: malformed reply", what);
    unsigned char *tmp = malloc(len ? len : 1);
    if (!tmp) return td__fail(TD_ENOMEM, "store: out of memory");
    s = io_all(st->fd, tmp, len, 0, deadline, what);
    if (!s) {
        if (reply) memcpy(reply, tmp, len < cap ? len : cap);
        if (rlen) *rlen = len;
        *status = rep[0];
    }
    free(tmp);
    return s;
}

td_store_params td_store_default_params(void) {
    td_store_params p = {.host = "127.0.0.1", .port = 29500, .timeout_s = 30.0};
    return p;
}

td_status td_store_create(td_store **out, const td_store_params *params) {
    if (!out || !params) return td__fail(TD_EINVAL, "td_store_create: NULL argument");
    *out = NULL;
    const char *host = params->host ? params->host : "127.0.0.1";
    const char *token = params->token ? params->token : "";
    double timeout = params->timeout_s > 0 ? params->timeout_s : 30.0;
    int port = params->port;
    if (port < 0 || port > 65535 || (port == 0 && !params->is_server))
        return td__fail(TD_EINVAL, "td_store_create: bad port %d", port);
    if (strlen(token) > TD_STORE_MAX_VALUE)
        return td__fail(TD_EINVAL, "td_store_create: token too long");
    td_store *st = calloc(1, sizeof *st);
    if (!st) return td__fail(TD_ENOMEM, "td_store_create: out of memory");
    st->fd = -1;
    st->timeout_s = timeout;
    pthread_mutex_init(&st->lock, NULL);
    td_status s = TD_OK;
    if (params->is_server) s = server_start(&st->server, host, &port, token);
    st->port = port;
    struct sockaddr_in addr;
    if (!s) s = resolve(host, port, &addr);
    uint64_t deadline = deadline_after(timeout);
    int last_errno = 0;
    while (!s) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            s = td__fail(TD_EIO, "store: socket: %s", strerror(errno));
            break;
        }
        if (connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0) {
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            st->fd = fd;
            break;
        }
        last_errno = errno;
        close(fd);
        if (td_time_ns() >= deadline) {
            s = td__fail(TD_ETIMEOUT, "store: cannot connect to %s:%d within %.1f s: %s", host,
                         port, timeout, strerror(last_errno));
            break;
        }
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (!s) {
        int status = -1;
        s = request(st, OP_AUTH, NULL, token, strlen(token), 0, deadline_after(timeout), &status,
                    NULL, 0, NULL, "authentication");
        if (s == TD_EPEER || (!s && status != ST_OK))
            s = td__fail(TD_EAUTH,
                         "store: %s:%d rejected this process's token (TANDEM_TOKEN differs?)", host,
                         port);
    }
    if (s) {
        td_store_destroy(st);
        return s;
    }
    *out = st;
    return TD_OK;
}

void td_store_destroy(td_store *store) {
    if (!store) return;
    if (store->fd >= 0) close(store->fd);
    server_stop(store->server);
    pthread_mutex_destroy(&store->lock);
    free(store);
}

int td_store_port(const td_store *store) { return store ? store->port : 0; }

td_status td_store_set_timeout(td_store *store, double seconds) {
    if (!store || !(seconds > 0))
        return td__fail(TD_EINVAL, "td_store_set_timeout: need a store and seconds > 0");
    store->timeout_s = seconds;
    return TD_OK;
}

static td_status check_key(const td_store *store, const char *key, const char *fn) {
    if (!store || !key || !key[0]) return td__fail(TD_EINVAL, "%s: NULL store or empty key", fn);
    return TD_OK;
}

td_status td_store_set(td_store *store, const char *key, const void *value, size_t len) {
    td_status s = check_key(store, key, "td_store_set");
    if (s) return s;
    if (!value && len)
        return td__fail(TD_EINVAL, "td_store_set('%s'): NULL value with length %zu", key, len);
    int status;
    pthread_mutex_lock(&store->lock);
    s = request(store, OP_SET, key, value, len, 0, deadline_after(store->timeout_s), &status, NULL,
                0, NULL, "set");
    pthread_mutex_unlock(&store->lock);
    return s;
}

static td_status wait_op(td_store *store, int op, const char *key, double timeout, void *value,
                         size_t cap, size_t *len, const char *what) {
    int status;
    uint32_t ms = timeout * 1000 > 4e9 ? 4000000000u : (uint32_t)(timeout * 1000) + 1;
    pthread_mutex_lock(&store->lock);
    /* The server answers "missing" at its own deadline; allow for the round trip. */
    td_status s = request(store, op, key, NULL, 0, ms, deadline_after(timeout + 5.0), &status,
                          value, cap, len, what);
    pthread_mutex_unlock(&store->lock);
    if (!s && status != ST_OK)
        s = td__fail(TD_ETIMEOUT, "store: key '%s' did not appear within %.1f s", key, timeout);
    return s;
}

td_status td_store_get(td_store *store, const char *key, void *value, size_t cap, size_t *len) {
    td_status s = check_key(store, key, "td_store_get");
    if (s) return s;
    if (!value && cap) return td__fail(TD_EINVAL, "td_store_get('%s'): NULL buffer", key);
    size_t got = 0;
    s = wait_op(store, OP_GET, key, store->timeout_s, value, cap, &got, "get");
    if (!s && len) *len = got;
    return s;
}

td_status td_store_wait(td_store *store, const char *key, double timeout_s) {
    td_status s = check_key(store, key, "td_store_wait");
    if (s) return s;
    return wait_op(store, OP_WAIT, key, timeout_s > 0 ? timeout_s : store->timeout_s, NULL, 0, NULL,
                   "wait");
}

td_status td_store_add(td_store *store, const char *key, int64_t delta, int64_t *result) {
    td_status s = check_key(store, key, "td_store_add");
    if (s) return s;
    unsigned char b[8], r[8];
    put_i64(b, delta);
    int status;
    size_t rlen = 0;
    pthread_mutex_lock(&store->lock);
    s = request(store, OP_ADD, key, b, 8, 0, deadline_after(store->timeout_s), &status, r, 8, &rlen,
                "add");
    pthread_mutex_unlock(&store->lock);
    if (!s && rlen != 8) s = td__fail(TD_EPEER, "store: add('%s'): malformed reply", key);
    if (!s && result) *result = get_i64(r);
    return s;
}
