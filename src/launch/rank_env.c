/* The env contract a rank starts with (torchrun's variables plus the job token), the token
 * itself, a port for the rendezvous store, and the split of the allowed cores among the ranks
 * of a host. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tandem/launch.h"

#include "core/core_impl.h"

static int set_int(const char *name, long v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%ld", v);
    return setenv(name, buf, 1);
}

td_status td_rank_env_apply(const td_rank_env *e, int threads) {
    int bad = set_int("RANK", e->rank) | set_int("WORLD_SIZE", e->world_size) |
              set_int("LOCAL_RANK", e->local_rank) |
              set_int("LOCAL_WORLD_SIZE", e->local_world_size) |
              set_int("GROUP_RANK", e->node_rank) | set_int("NODE_RANK", e->node_rank) |
              setenv("MASTER_ADDR", e->master_addr ? e->master_addr : "127.0.0.1", 1) |
              set_int("MASTER_PORT", e->master_port) |
              setenv("TANDEM_TOKEN", e->token ? e->token : "", 1);
    if (!getenv("OMP_NUM_THREADS")) bad |= set_int("OMP_NUM_THREADS", threads);
    if (bad)
        return td__fail(TD_ENOMEM, "td_rank_env_apply: cannot set the environment of rank %d",
                        e->rank);
    return TD_OK;
}

static td_status random_bytes(unsigned char *out, size_t n, const char *what) {
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return td__fail(TD_EIO, "cannot open /dev/urandom for %s: %s", what, strerror(errno));
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, out + got, n - got);
        if (r <= 0) {
            if (r < 0 && errno == EINTR) continue;
            close(fd);
            return td__fail(TD_EIO, "cannot read /dev/urandom for %s", what);
        }
        got += (size_t)r;
    }
    close(fd);
    return TD_OK;
}

td_status td_job_token(char out[TD_JOB_TOKEN_LEN + 1]) {
    unsigned char raw[TD_JOB_TOKEN_LEN / 2];
    TD__TRY(random_bytes(raw, sizeof raw, "the job token"));
    for (size_t k = 0; k < sizeof raw; k++) snprintf(out + 2 * k, 3, "%02x", raw[k]);
    return TD_OK;
}

/* Binds a TCP socket to `port` on every address (0: the kernel picks); the port bound, or -1. */
static int try_bind(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof addr;
    int got = -1;
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) == 0 &&
        getsockname(fd, (struct sockaddr *)&addr, &len) == 0)
        got = ntohs(addr.sin_port);
    close(fd);
    return got;
}

/* A port handed out by the kernel for bind(0) or connect() comes from the ephemeral range, so
 * a port chosen that way may be taken again by any outgoing connection before the store binds
 * it; more so in another network namespace (an emulated host), whose connections never saw the
 * port in use. Ports from 20000 up to 65535, outside the range, are never handed out. */
td_status td_free_port(int *port) {
    int lo = 32768, hi = 60999; /* the kernel's default range */
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "re");
    if (f) {
        if (fscanf(f, "%d %d", &lo, &hi) != 2) lo = 32768, hi = 60999;
        fclose(f);
    }
    /* The candidates: [first, lo) and (hi, last], each clipped to [first, last]. */
    int first = 20000, last = 65535;
    int below = (lo < last + 1 ? lo : last + 1) - first;
    int above_from = hi + 1 > first ? hi + 1 : first;
    int above = last + 1 - above_from;
    if (below < 0) below = 0;
    if (above < 0) above = 0;
    unsigned char seed[8];
    TD__TRY(random_bytes(seed, sizeof seed, "a free port"));
    uint64_t x = 0;
    for (int k = 0; k < 8; k++) x = x << 8 | seed[k];
    for (int tries = 0; below + above > 0 && tries < 200; tries++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17; /* xorshift64 */
        int k = (int)(x % (uint64_t)(below + above));
        int p = k < below ? first + k : above_from + (k - below);
        if (try_bind(p) == p) {
            *port = p;
            return TD_OK;
        }
    }
    int p = try_bind(0);
    if (p <= 0) return td__fail(TD_EIO, "no free TCP port on this host: %s", strerror(errno));
    *port = p;
    return TD_OK;
}

int td_rank_cpus(int local_rank, int local_world_size, int *cpus, int cap) {
    if (cap <= 0 || local_rank < 0 || local_rank >= local_world_size) return 0;
    cpu_set_t allowed;
    int all[CPU_SETSIZE], n = 0;
    if (sched_getaffinity(0, sizeof allowed, &allowed) == 0)
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &allowed)) all[n++] = c;
    if (n == 0) all[n++] = 0;
    if (local_world_size > n) {
        cpus[0] = all[local_rank % n];
        return 1;
    }
    int lo = (int)((long)local_rank * n / local_world_size);
    int hi = (int)((long)(local_rank + 1) * n / local_world_size);
    int got = 0;
    for (int c = lo; c < hi && got < cap; c++) cpus[got++] = all[c];
    return got;
}
