/* The rendezvous store's client (see tandem/store.h; the wire format is in store_impl.h and
 * the server in store_server.c): blocking requests with deadlines, one at a time per
 * td_store. It tells the user what the store said: a wrong token, a full store, and a
 * connection closed unanswered are three different errors. */
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

#include "store/store_impl.h"
#include "core/core_impl.h"

struct td_store {
    int fd;
    int port;
    double timeout_s;
    pthread_mutex_t lock;
    td__store_server *server; /* when this process hosts the store */
};

td_status td__store_resolve(const char *host, struct in_addr *out, size_t cap, size_t *n,
                            int *numeric) {
    *n = 0;
    *numeric = inet_pton(AF_INET, host, &out[0]) == 1;
    if (*numeric) {
        *n = 1;
        return TD_OK;
    }
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(host, NULL, &hints, &res);
    if (rc != 0 || !res)
        return td__fail(TD_EINVAL, "store: cannot resolve host '%s': %s", host, gai_strerror(rc));
    for (struct addrinfo *ai = res; ai && *n < cap; ai = ai->ai_next) {
        struct in_addr a = ((struct sockaddr_in *)ai->ai_addr)->sin_addr;
        size_t k = 0;
        while (k < *n && out[k].s_addr != a.s_addr) k++;
        if (k == *n) out[(*n)++] = a;
    }
    freeaddrinfo(res);
    return TD_OK;
}

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

/* Waits for a non-blocking connect to finish; returns its errno (ETIMEDOUT at the deadline). */
static int connect_wait(int fd, uint64_t deadline) {
    for (;;) {
        uint64_t now = td_time_ns();
        if (now >= deadline) return ETIMEDOUT;
        struct pollfd pf = {.fd = fd, .events = POLLOUT};
        uint64_t ms = (deadline - now) / 1000000ull + 1;
        int n = poll(&pf, 1, ms > 1000 ? 1000 : (int)ms);
        if (n < 0 && errno != EINTR) return errno;
        if (n <= 0) continue;
        int err = 0;
        socklen_t len = sizeof err;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
        return err;
    }
}

/* Connects, retrying while nothing listens yet (the host may still be starting). The
 * socket is non-blocking, so an address that never answers costs the timeout, not the
 * kernel's two minutes of SYN retries; every later wait is a poll with a deadline too. */
static td_status connect_until(td_store *st, const struct sockaddr_in *addr, const char *host,
                               int port, double timeout, uint64_t deadline) {
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) return td__fail(TD_EIO, "store: socket: %s", strerror(errno));
        int e = connect(fd, (const struct sockaddr *)addr, sizeof *addr) == 0 ? 0 : errno;
        if (e == EINPROGRESS) e = connect_wait(fd, deadline);
        if (e == 0) {
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            st->fd = fd;
            return TD_OK;
        }
        close(fd);
        if (td_time_ns() >= deadline)
            return td__fail(TD_ETIMEOUT, "store: cannot connect to %s:%d within %.1f s: %s", host,
                            port, timeout, strerror(e));
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* Presents the token and reads the store's verdict. Only an explicit "wrong token" blames
 * the token: a connection closed before any answer (*closed set) was shed by a store under
 * a flood, or the port is not a store at all, and the caller may try again. */
static td_status authenticate(td_store *st, const char *host, int port, const char *token,
                              double timeout, int *closed) {
    uint64_t deadline = deadline_after(timeout);
    size_t tlen = strlen(token);
    unsigned char hdr[STORE_REQ_HDR] = {OP_AUTH};
    put_u32(hdr + 8, (uint32_t)tlen);
    td_status s = io_all(st->fd, hdr, sizeof hdr, 1, deadline, "authentication");
    if (!s && tlen) s = io_all(st->fd, (void *)token, tlen, 1, deadline, "authentication");
    /* A full store answers before reading the token and closes, so a failed send may still
     * leave the answer waiting. */
    unsigned char rep[STORE_REP_HDR + STORE_FULL_LEN];
    if (!s || s == TD_EPEER) s = io_all(st->fd, rep, STORE_REP_HDR, 0, deadline, "authentication");
    if (s == TD_EPEER) {
        *closed = 1;
        return s;
    }
    if (s == TD_ETIMEOUT)
        return td__fail(TD_ETIMEOUT,
                        "store: %s:%d did not answer this process's token within %.1f s", host,
                        port, timeout);
    if (s) return s;
    uint32_t len = get_u32(rep + 4);
    if (rep[0] == ST_OK && len == 0) return TD_OK;
    if (rep[0] == ST_DENIED)
        return td__fail(TD_EAUTH,
                        "store: %s:%d rejected this process's token (TANDEM_TOKEN differs?)", host,
                        port);
    if (rep[0] == ST_FULL && len == STORE_FULL_LEN &&
        io_all(st->fd, rep + STORE_REP_HDR, STORE_FULL_LEN, 0, deadline, "authentication") ==
            TD_OK) {
        unsigned held = get_u32(rep + 8), limit = get_u32(rep + 12), which = get_u32(rep + 16);
        if (which == FULL_FILES)
            return td__fail(TD_EBACKEND,
                            "store at %s:%d is full (%u connections, all authenticated clients): "
                            "its host process reached its open-file limit (RLIMIT_NOFILE %u); "
                            "raise it (ulimit -n) where the store is hosted",
                            host, port, held, limit);
        return td__fail(TD_EBACKEND,
                        "store at %s:%d is full (%u connections, all authenticated clients; it "
                        "serves at most %u): more clients than ranks, or clients left over from "
                        "another run with the same token",
                        host, port, held, limit);
    }
    return td__fail(TD_EPEER,
                    "store: %s:%d answered this process's token with status %d (%u bytes): not a "
                    "tandem store of this version?",
                    host, port, rep[0], len);
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
    if (strlen(token) > TD_STORE_MAX_TOKEN)
        return td__fail(TD_EINVAL, "td_store_create: token over %d bytes", TD_STORE_MAX_TOKEN);
    td_store *st = calloc(1, sizeof *st);
    if (!st) return td__fail(TD_ENOMEM, "td_store_create: out of memory");
    st->fd = -1;
    st->timeout_s = timeout;
    pthread_mutex_init(&st->lock, NULL);
    td_status s = TD_OK;
    if (params->is_server) s = td__store_server_start(&st->server, host, &port, token);
    st->port = port;
    struct in_addr a = {0};
    size_t n;
    int numeric;
    if (!s) s = td__store_resolve(host, &a, 1, &n, &numeric);
    struct sockaddr_in addr = sockaddr_of(a, port);
    uint64_t start = td_time_ns(), deadline = deadline_after(timeout);
    long pause_ms = 20;
    for (int tries = 1; !s; tries++) {
        s = connect_until(st, &addr, host, port, timeout, deadline);
        int closed = 0;
        if (!s) s = authenticate(st, host, port, token, timeout, &closed);
        if (!closed) break;
        close(st->fd);
        st->fd = -1;
        if (td_time_ns() >= deadline) {
            s = td__fail(TD_EPEER,
                         "store: %s:%d closed the connection before answering this process's "
                         "token, %d times in %.1f s: not a token rejection (the store answers "
                         "that); the store may be shedding a flood of connections, or what "
                         "listens there is not a tandem store",
                         host, port, tries, (double)(td_time_ns() - start) / 1e9);
            break;
        }
        struct timespec ts = {0, pause_ms * 1000 * 1000};
        nanosleep(&ts, NULL);
        if (pause_ms < 500) pause_ms *= 2;
        s = TD_OK;
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
    td__store_server_stop(store->server);
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
