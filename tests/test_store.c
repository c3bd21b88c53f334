/* The rendezvous store over real sockets: set/get/wait/add, timeouts, several processes,
 * hostile connections (garbage, a wrong token, an oversize length, a half-open socket)
 * that must be dropped without disturbing a legitimate client, a flood of connections that
 * never authenticate, a store full of real clients, and listening only where it is told. */
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "tandem/store.h"

#include "test_comm_util.h"

/* The store's slots (STORE_MAX_CONNS in src/store/store_server.c). */
#define STORE_SLOTS 4096

/* Hosts a store on `addr` (NULL: the default, 127.0.0.1) and a free port. */
static td_store *host_at(const char *addr, const char *token) {
    td_store_params p = td_store_default_params();
    if (addr) p.host = addr;
    p.is_server = 1;
    p.port = 0;
    p.token = token;
    p.timeout_s = 5;
    td_store *s = NULL;
    CHECK_OK(td_store_create(&s, &p));
    return s;
}

static td_store *host(const char *token) { return host_at(NULL, token); }

static td_status client_at(td_store **out, const char *addr, int port, const char *token) {
    td_store_params p = td_store_default_params();
    if (addr) p.host = addr;
    p.port = port;
    p.token = token;
    p.timeout_s = 5;
    return td_store_create(out, &p);
}

static td_status client(td_store **out, int port, const char *token) {
    return client_at(out, NULL, port, token);
}

static void set_get_add_wait(void) {
    td_store *srv = host("tok");
    if (!srv) return;
    td_store *c = NULL;
    CHECK_OK(client(&c, td_store_port(srv), "tok"));
    if (!c) {
        td_store_destroy(srv);
        return;
    }
    CHECK_OK(td_store_set(srv, "a", "hello", 6));
    char buf[16] = {0};
    size_t len = 0;
    CHECK_OK(td_store_get(c, "a", buf, sizeof buf, &len));
    CHECK_EQ(len, 6);
    CHECK(strcmp(buf, "hello") == 0);
    /* A value longer than the buffer: truncated copy, full length reported. */
    CHECK_OK(td_store_get(c, "a", buf, 2, &len));
    CHECK_EQ(len, 6);
    CHECK_OK(td_store_set(c, "a", "x", 1)); /* replace */
    CHECK_OK(td_store_get(srv, "a", buf, sizeof buf, &len));
    CHECK_EQ(len, 1);
    CHECK_EQ(buf[0], 'x');
    int64_t v = 0;
    CHECK_OK(td_store_add(c, "n", 5, &v));
    CHECK_EQ(v, 5);
    CHECK_OK(td_store_add(srv, "n", -7, &v));
    CHECK_EQ(v, -2);
    CHECK_OK(td_store_wait(c, "n", 1.0));
    /* Waiting for a key nobody sets times out, close to the asked bound. */
    uint64_t t0 = td_time_ns();
    CHECK_STATUS(td_store_wait(c, "never", 0.3), TD_ETIMEOUT);
    double waited = (double)(td_time_ns() - t0) / 1e9;
    CHECK(waited >= 0.25 && waited < 2.0);
    CHECK(strstr(td_last_error(), "never") != NULL);
    CHECK_OK(td_store_set_timeout(c, 0.2));
    CHECK_STATUS(td_store_get(c, "missing", buf, sizeof buf, &len), TD_ETIMEOUT);
    CHECK_STATUS(td_store_set(c, "", "x", 1), TD_EINVAL);
    /* After the host goes, a client sees a peer error, not a hang. */
    td_store_destroy(srv);
    CHECK_OK(td_store_set_timeout(c, 2));
    CHECK_STATUS(td_store_set(c, "b", "y", 1), TD_EPEER);
    td_store_destroy(c);
}

static void wrong_token_is_refused(void) {
    td_store *srv = host("right");
    if (!srv) return;
    td_store *c = NULL;
    CHECK_STATUS(client(&c, td_store_port(srv), "wrong"), TD_EAUTH);
    CHECK(c == NULL);
    CHECK_STATUS(client(&c, td_store_port(srv), NULL), TD_EAUTH);
    CHECK_OK(client(&c, td_store_port(srv), "right"));
    td_store_destroy(c);
    td_store_destroy(srv);
}

/* Forked clients of the store at port *arg: each adds 1, then all wait until the counter
 * reaches n (a barrier). */
static void barrier_rank(int rank, int size, int master_port, void *arg) {
    (void)master_port;
    int port = *(const int *)arg;
    td_store *c = NULL;
    CHECK_OK(client(&c, port, "tok"));
    if (!c) return;
    int64_t v = 0;
    CHECK_OK(td_store_add(c, "arrived", 1, &v));
    CHECK(v >= 1 && v <= size);
    if (v == size) CHECK_OK(td_store_set(c, "all", "", 0));
    CHECK_OK(td_store_wait(c, "all", 5));
    char key[32], val[32];
    snprintf(key, sizeof key, "r%d", rank);
    snprintf(val, sizeof val, "v%d", rank * 10);
    CHECK_OK(td_store_set(c, key, val, strlen(val) + 1));
    for (int r = 0; r < size; r++) {
        char want[32], got[32] = {0};
        size_t len;
        snprintf(key, sizeof key, "r%d", r);
        snprintf(want, sizeof want, "v%d", r * 10);
        CHECK_OK(td_store_get(c, key, got, sizeof got, &len));
        CHECK(strcmp(got, want) == 0);
    }
    td_store_destroy(c);
}

static void several_processes(void) {
    /* The host lives in this process; the children connect to its port. */
    td_store *srv = host("tok");
    if (!srv) return;
    int port = td_store_port(srv);
    CHECK_EQ(test_run_ranks(4, barrier_rank, &port, 30, 0), 0);
    int64_t v = 0;
    CHECK_OK(td_store_add(srv, "arrived", 0, &v));
    CHECK_EQ(v, 4);
    td_store_destroy(srv);
}

/* A plain TCP connection to ip:port; -1 with errno set when refused. */
static int raw_connect_at(const char *ip, int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, ip, &a.sin_addr);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int e = errno;
        if (fd >= 0) close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static int raw_connect(int port) { return raw_connect_at("127.0.0.1", port); }

/* 1 when the server closed the socket within ms. */
static int closed_within(int fd, int ms) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    uint64_t end = td_time_ns() + (uint64_t)ms * 1000000ull;
    while (td_time_ns() < end) {
        if (poll(&p, 1, 50) > 0) {
            char b[64];
            ssize_t r = recv(fd, b, sizeof b, 0);
            if (r == 0 || (r < 0 && errno == ECONNRESET)) return 1;
        }
    }
    return 0;
}

static void hostile_clients_do_not_disturb(void) {
    td_store *srv = host("secret");
    if (!srv) return;
    int port = td_store_port(srv);
    int half_open = raw_connect(port); /* connects and never speaks */
    int garbage = raw_connect(port);
    int stranger = raw_connect(port);
    int oversize = raw_connect(port);
    CHECK(half_open >= 0 && garbage >= 0 && stranger >= 0 && oversize >= 0);
    /* Half a header from another client must not block the server either. */
    unsigned char partial[5] = {1, 0, 0, 0, 0};
    CHECK_EQ(send(half_open, partial, sizeof partial, 0), 5);
    const char junk[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    CHECK_EQ(send(garbage, junk, sizeof junk, 0), (long long)sizeof junk);
    unsigned char auth[16 + 5] = {1, 0, 0, 0, 0, 0,   0,   0,   5,   0,  0,
                                  0, 0, 0, 0, 0, 'w', 'r', 'o', 'n', 'g'};
    CHECK_EQ(send(stranger, auth, sizeof auth, 0), (long long)sizeof auth);
    unsigned char huge[16] = {2,    0,    0,    0,    1, 0, 0, 0,
                              0xff, 0xff, 0xff, 0x7f, 0, 0, 0, 0}; /* 2 GB value */
    CHECK_EQ(send(oversize, huge, sizeof huge, 0), (long long)sizeof huge);
    CHECK(closed_within(garbage, 2000));
    CHECK(closed_within(stranger, 2000));
    CHECK(closed_within(oversize, 2000));
    /* The legitimate client is served promptly while the half-open socket sits there. */
    td_store *c = NULL;
    uint64_t t0 = td_time_ns();
    CHECK_OK(client(&c, port, "secret"));
    if (c) {
        CHECK_OK(td_store_set(c, "k", "v", 1));
        char b[4] = {0};
        size_t len;
        CHECK_OK(td_store_get(c, "k", b, sizeof b, &len));
        CHECK_EQ(b[0], 'v');
        int64_t v;
        CHECK_OK(td_store_add(c, "c", 3, &v));
        CHECK_EQ(v, 3);
        td_store_destroy(c);
    }
    CHECK((td_time_ns() - t0) < 1000000000ull);
    close(half_open);
    close(garbage);
    close(stranger);
    close(oversize);
    td_store_destroy(srv);
}

/* 1 when nothing accepts a connection on ip:port. */
static int refused_at(const char *ip, int port) {
    int fd = raw_connect_at(ip, port);
    if (fd < 0) return 1;
    close(fd);
    return 0;
}

/* 1 when a socket may be bound to ip (it is one of this machine's addresses). */
static int local_address(const char *ip) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    inet_pton(AF_INET, ip, &a.sin_addr);
    int ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    if (fd >= 0) close(fd);
    return ok;
}

static void listens_only_where_told(void) {
    td_store *srv = host("tok"); /* the default address, 127.0.0.1 */
    if (!srv) return;
    int port = td_store_port(srv);
    CHECK(!refused_at("127.0.0.1", port));
    /* All of 127/8 reaches this machine, but the store was told 127.0.0.1. */
    CHECK(refused_at("127.0.0.2", port));
    /* Nor does it answer on any other address of the machine. */
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) == 0) {
        for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
            if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
            char ip[INET_ADDRSTRLEN];
            inet_ntop(AF_INET, &((struct sockaddr_in *)(void *)i->ifa_addr)->sin_addr, ip,
                      sizeof ip);
            if (strcmp(ip, "127.0.0.1") != 0 && !refused_at(ip, port))
                TEST_FAIL_AT("the store told 127.0.0.1 accepts connections on %s", ip);
        }
        freeifaddrs(ifs);
    }
    td_store_destroy(srv);

    /* A name means where it resolves: localhost is 127.0.0.1, reached by name, not 127.0.0.2. */
    srv = host_at("localhost", "tok");
    if (srv) {
        port = td_store_port(srv);
        td_store *c = NULL;
        CHECK_OK(client_at(&c, "localhost", port, "tok"));
        if (c) CHECK_OK(td_store_set(c, "k", "v", 1));
        td_store_destroy(c);
        CHECK(refused_at("127.0.0.2", port));
        td_store_destroy(srv);
    }

    /* Another loopback address with a port picked by the kernel: served there only. */
    if (local_address("127.0.0.2")) {
        srv = host_at("127.0.0.2", "tok");
        if (srv) {
            port = td_store_port(srv);
            CHECK(port > 0);
            td_store *c = NULL;
            CHECK_OK(client_at(&c, "127.0.0.2", port, "tok"));
            if (c) CHECK_OK(td_store_add(c, "n", 1, NULL));
            td_store_destroy(c);
            CHECK(refused_at("127.0.0.1", port));
            td_store_destroy(srv);
        }
    }

    /* An address this machine does not have is an error at once that names it; listening
     * everywhere instead would leave a store nobody was meant to reach. */
    const char *foreign[] = {"203.0.113.77", "198.51.100.77", "192.0.2.77", "10.254.254.77"};
    for (size_t i = 0; i < sizeof foreign / sizeof foreign[0]; i++) {
        if (local_address(foreign[i])) continue;
        td_store_params p = td_store_default_params();
        p.host = foreign[i];
        p.port = 0;
        p.is_server = 1;
        p.token = "tok";
        p.timeout_s = 1;
        td_store *s = NULL;
        uint64_t t0 = td_time_ns();
        CHECK_STATUS(td_store_create(&s, &p), TD_EIO);
        CHECK(strstr(td_last_error(), foreign[i]) != NULL);
        CHECK((td_time_ns() - t0) < 500000000ull);
        CHECK(s == NULL);
        td_store_destroy(s);
        break;
    }
}

/* Raises this process's soft open-file limit towards `want` (the hard limit caps it). */
static long raise_fd_limit(long want) {
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) != 0) return 1024;
    if (r.rlim_cur != RLIM_INFINITY && (long)r.rlim_cur < want) {
        r.rlim_cur =
            r.rlim_max != RLIM_INFINITY && (long)r.rlim_max < want ? r.rlim_max : (rlim_t)want;
        setrlimit(RLIMIT_NOFILE, &r);
        getrlimit(RLIMIT_NOFILE, &r);
    }
    return r.rlim_cur == RLIM_INFINITY ? want : (long)r.rlim_cur;
}

/* Hosts a store in a child process, as rank 0 would, so that its descriptors do not count
 * against this one's; `fd_limit` > 0 lowers the child's open-file limit. Returns the port
 * (0 on failure); the child serves until *ctl is closed. */
static int host_in_child(const char *token, long fd_limit, pid_t *pid, int *ctl) {
    int up[2], down[2];
    if (pipe(up) != 0) return 0;
    if (pipe(down) != 0) {
        close(up[0]);
        close(up[1]);
        return 0;
    }
    fflush(NULL);
    *pid = fork();
    if (*pid == 0) {
        test_case_failed = 0;
        close(up[0]);
        close(down[1]);
        if (fd_limit > 0) {
            struct rlimit r;
            getrlimit(RLIMIT_NOFILE, &r);
            r.rlim_cur = (rlim_t)fd_limit;
            setrlimit(RLIMIT_NOFILE, &r);
        }
        td_store *s = host(token);
        int port = s ? td_store_port(s) : 0;
        if (write(up[1], &port, sizeof port) != (ssize_t)sizeof port) port = 0;
        char b;
        while (port && read(down[0], &b, 1) > 0) {
        }
        td_store_destroy(s);
        _exit(test_case_failed);
    }
    close(up[1]);
    close(down[0]);
    int port = 0;
    if (*pid < 0 || read(up[0], &port, sizeof port) != (ssize_t)sizeof port) port = 0;
    close(up[0]);
    *ctl = down[1];
    return port;
}

static void stop_child(pid_t pid, int ctl) {
    close(ctl);
    int status = 0;
    CHECK_EQ(waitpid(pid, &status, 0), pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        TEST_FAIL_AT("store host exited with status 0x%x", status);
}

/* Opens `n` connections that never authenticate to a store hosted with `fd_limit`, then a
 * rank joins. */
static void flood_then_join(int n, long fd_limit, int check_deadline) {
    pid_t pid;
    int ctl;
    int port = host_in_child("secret", fd_limit, &pid, &ctl);
    CHECK(port > 0);
    if (!port) return;
    struct pollfd *fds = calloc((size_t)n, sizeof *fds);
    int opened = 0;
    for (int i = 0; fds && i < n; i++) {
        fds[i] = (struct pollfd){.fd = raw_connect(port), .events = POLLIN};
        opened += fds[i].fd >= 0;
    }
    CHECK_EQ(opened, n);
    /* The rank arriving after them joins at once and is served. */
    uint64_t t0 = td_time_ns();
    td_store *c = NULL;
    CHECK_OK(client(&c, port, "secret"));
    if (c) {
        CHECK_OK(td_store_set(c, "k", "v", 1));
        char b[4] = {0};
        size_t len = 0;
        CHECK_OK(td_store_get(c, "k", b, sizeof b, &len));
        CHECK_EQ(b[0], 'v');
        td_store_destroy(c);
    }
    double took = (double)(td_time_ns() - t0) / 1e9;
    if (!(took < 2.0)) TEST_FAIL_AT("a rank took %.2f s to join past %d strangers", took, n);
    /* The strangers are gone by the authentication deadline (2 s), not kept the 10 s a
     * client gets to finish a request. */
    int open_left = opened;
    uint64_t end = td_time_ns() + 3500000000ull;
    while (check_deadline && fds && open_left > 0 && td_time_ns() < end) {
        if (poll(fds, (nfds_t)n, 50) <= 0) continue;
        for (int i = 0; i < n; i++)
            if (fds[i].fd >= 0 && fds[i].revents) {
                close(fds[i].fd);
                fds[i].fd = -1;
                open_left--;
            }
    }
    if (check_deadline) CHECK_EQ(open_left, 0);
    for (int i = 0; fds && i < n; i++)
        if (fds[i].fd >= 0) close(fds[i].fd);
    free(fds);
    stop_child(pid, ctl);
}

static void flood_of_strangers_does_not_lock_out_a_rank(void) {
    /* More connections than the store has slots, as a port scan or a runaway program opens. */
    long limit = raise_fd_limit(STORE_SLOTS + 512);
    int n = STORE_SLOTS + 104;
    if (n > limit - 128) n = (int)(limit - 128);
    flood_then_join(n, 0, 1);
    /* The same when what runs out first is the host's open files. */
    flood_then_join(300, 128, 0);
}

/* Fills a store hosted with `fd_limit` with authenticated clients; the next one must be told
 * the store is full, naming `limit_word`, and one that leaves makes room. */
static void fill_with_clients(long fd_limit, const char *limit_word) {
    pid_t pid;
    int ctl;
    int port = host_in_child("tok", fd_limit, &pid, &ctl);
    CHECK(port > 0);
    if (!port) return;
    int cap = STORE_SLOTS + 16, n = 0;
    td_store **cs = calloc((size_t)cap, sizeof *cs);
    td_status s = TD_OK;
    while (cs && n < cap && (s = client(&cs[n], port, "tok")) == TD_OK) n++;
    char err[1024];
    snprintf(err, sizeof err, "%s", td_last_error());
    if (s != TD_EBACKEND || !strstr(err, "is full") || !strstr(err, limit_word) ||
        strstr(err, "TANDEM_TOKEN"))
        TEST_FAIL_AT("client %d of a full store: %s: %s", n + 1, td_status_string(s), err);
    /* The store's own client holds one slot. */
    if (fd_limit == 0) CHECK_EQ(n, STORE_SLOTS - 1);
    /* The clients already in are not disturbed. */
    if (n > 1) {
        CHECK_OK(td_store_set(cs[0], "first", "1", 1));
        CHECK_OK(td_store_wait(cs[n - 1], "first", 1.0));
    }
    /* One leaves, and a newcomer takes its place (once the host has seen it go). */
    if (n > 0) {
        td_store_destroy(cs[--n]);
        uint64_t end = td_time_ns() + 2000000000ull;
        do s = client(&cs[n], port, "tok");
        while (s == TD_EBACKEND && td_time_ns() < end);
        CHECK_OK(s);
        if (!s) n++;
    }
    for (int i = 0; i < n; i++) td_store_destroy(cs[i]);
    free(cs);
    stop_child(pid, ctl);
}

static void full_store_says_full(void) {
    if (raise_fd_limit(STORE_SLOTS + 512) >= STORE_SLOTS + 512) fill_with_clients(0, "at most");
    /* Out of open files before out of slots: the answer says which limit to raise. */
    fill_with_clients(128, "RLIMIT_NOFILE");
}

/* An address that never answers costs the timeout, not the kernel's minutes of SYN retries:
 * a listener whose accept queue is full drops every new SYN. */
static void connect_honours_the_timeout(void) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    CHECK(l >= 0 && bind(l, (struct sockaddr *)&a, sizeof a) == 0 && listen(l, 0) == 0 &&
          getsockname(l, (struct sockaddr *)&a, &alen) == 0);
    int fill[4];
    for (int i = 0; i < 4; i++) {
        fill[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (connect(fill[i], (struct sockaddr *)&a, sizeof a) != 0) CHECK(errno == EINPROGRESS);
    }
    test_sleep_ms(50);
    td_store_params p = td_store_default_params();
    p.port = ntohs(a.sin_port);
    p.timeout_s = 0.5;
    td_store *s = NULL;
    uint64_t t0 = td_time_ns();
    CHECK_STATUS(td_store_create(&s, &p), TD_ETIMEOUT);
    double took = (double)(td_time_ns() - t0) / 1e9;
    if (!(took < 1.5)) TEST_FAIL_AT("a 0.5 s connect took %.2f s", took);
    td_store_destroy(s);
    for (int i = 0; i < 4; i++) close(fill[i]);
    close(l);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    RUN(set_get_add_wait);
    RUN(wrong_token_is_refused);
    RUN(several_processes);
    RUN(hostile_clients_do_not_disturb);
    RUN(listens_only_where_told);
    RUN(flood_of_strangers_does_not_lock_out_a_rank);
    RUN(full_store_says_full);
    RUN(connect_honours_the_timeout);
    TEST_END();
}
