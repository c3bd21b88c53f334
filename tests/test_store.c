/* The rendezvous store over real sockets: set/get/wait/add, timeouts, several processes,
 * and hostile connections (garbage, a wrong token, an oversize length, a half-open socket)
 * that must be dropped without disturbing a legitimate client. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>

#include "tandem/store.h"

#include "test_comm_util.h"

static td_store *host(const char *token) {
    td_store_params p = td_store_default_params();
    p.is_server = 1;
    p.port = 0;
    p.token = token;
    p.timeout_s = 5;
    td_store *s = NULL;
    CHECK_OK(td_store_create(&s, &p));
    return s;
}

static td_status client(td_store **out, int port, const char *token) {
    td_store_params p = td_store_default_params();
    p.port = port;
    p.token = token;
    p.timeout_s = 5;
    return td_store_create(out, &p);
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

static int raw_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

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

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    RUN(set_get_add_wait);
    RUN(wrong_token_is_refused);
    RUN(several_processes);
    RUN(hostile_clients_do_not_disturb);
    TEST_END();
}
