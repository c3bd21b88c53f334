/* The env contract a rank starts with (torchrun's variables plus the job token), the token
 * itself, a free port for the rendezvous store, and the split of the allowed cores among the
 * ranks of a host. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "launch/launch_impl.h"

static void set_int(const char *name, long v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%ld", v);
    setenv(name, buf, 1);
}

void td__rank_env_apply(const td__rank_env *e, int threads) {
    set_int("RANK", e->rank);
    set_int("WORLD_SIZE", e->world_size);
    set_int("LOCAL_RANK", e->local_rank);
    set_int("LOCAL_WORLD_SIZE", e->local_world_size);
    set_int("GROUP_RANK", e->node_rank);
    set_int("NODE_RANK", e->node_rank);
    setenv("MASTER_ADDR", e->master_addr, 1);
    set_int("MASTER_PORT", e->master_port);
    setenv("TANDEM_TOKEN", e->token, 1);
    if (!getenv("OMP_NUM_THREADS")) set_int("OMP_NUM_THREADS", threads);
}

td_status td__job_token(char out[33]) {
    unsigned char raw[16];
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return td__fail(TD_EIO, "cannot open /dev/urandom for the job token: %s", strerror(errno));
    size_t got = 0;
    while (got < sizeof raw) {
        ssize_t r = read(fd, raw + got, sizeof raw - got);
        if (r <= 0) {
            if (r < 0 && errno == EINTR) continue;
            close(fd);
            return td__fail(TD_EIO, "cannot read /dev/urandom for the job token");
        }
        got += (size_t)r;
    }
    close(fd);
    for (size_t k = 0; k < sizeof raw; k++) snprintf(out + 2 * k, 3, "%02x", raw[k]);
    return TD_OK;
}

int td__free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof addr;
    int port = -1;
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) == 0 &&
        getsockname(fd, (struct sockaddr *)&addr, &len) == 0)
        port = ntohs(addr.sin_port);
    close(fd);
    return port;
}

int td__allowed_cpus(int *cpus, int cap) {
    cpu_set_t allowed;
    int n = 0;
    if (sched_getaffinity(0, sizeof allowed, &allowed) == 0)
        for (int c = 0; c < CPU_SETSIZE && n < cap; c++)
            if (CPU_ISSET(c, &allowed)) cpus[n++] = c;
    if (n == 0) cpus[n++] = 0;
    return n;
}

void td__rank_cpus(int local_rank, int nlocal, const int *cpus, int ncpus, cpu_set_t *set) {
    CPU_ZERO(set);
    if (nlocal <= ncpus) {
        int lo = (int)((long)local_rank * ncpus / nlocal);
        int hi = (int)((long)(local_rank + 1) * ncpus / nlocal);
        for (int c = lo; c < hi; c++) CPU_SET(cpus[c], set);
    } else {
        CPU_SET(cpus[local_rank % ncpus], set);
    }
}

double td__now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
