/* hosts-delay: a fixed propagation delay for the emulated hosts of scripts/hosts.sh, on
 * kernels built without tc's netem (sch_netem). An iptables NFQUEUE rule on the host's
 * ingress (mangle PREROUTING) hands every arriving packet to this program; it holds each
 * one until DELAY_US microseconds after the kernel received it (only the packet's id: the
 * kernel keeps the bytes, copy mode "meta") and then accepts it, in arrival order, with
 * one batch verdict for all packets that are due. The sender's tbf has already shaped the
 * rate, so a packet is serialised, then propagates: like a real link.
 *
 * Usage (inside the host's network namespace, after
 *   iptables -t mangle -A PREROUTING -i DEV -j NFQUEUE --queue-num Q --queue-bypass):
 *   hosts-delay Q DELAY_US
 *
 * It does not drop, reorder, add jitter or shape rate. Each packet's delay counts from the
 * kernel's timestamp of it, and the timer, a user-space wake-up, learns how late it fires
 * and aims that much early, so the one-way delay is DELAY_US give or take the wake-up
 * jitter (~10-20 us on a small VM) plus the netlink round trip (a few us). scripts/hosts.sh runs it at real-time priority (chrt -f) so that
 * busy-polling ranks on the same cores cannot starve the emulated wire. When it
 * is not running the rule's --queue-bypass lets packets through undelayed, and a full queue
 * or a missed netlink message lets the packet through too (NFQA_CFG_F_FAIL_OPEN). Plain
 * Linux netlink, no libnetfilter_queue. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RING 65536 /* power of two; also the kernel queue's length */

static struct {
    uint32_t id;
    int64_t due_ns;
} ring[RING];
static unsigned head, tail; /* tail - head packets are held */
static volatile sig_atomic_t stop;

static void on_signal(int sig) {
    (void)sig;
    stop = 1;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Appends one attribute to the message in buf. */
static void put_attr(char *buf, uint16_t type, const void *data, size_t len) {
    struct nlmsghdr *nh = (struct nlmsghdr *)buf;
    struct nlattr *a = (struct nlattr *)(buf + NLMSG_ALIGN(nh->nlmsg_len));
    a->nla_type = type;
    a->nla_len = (uint16_t)(NLA_HDRLEN + len);
    memcpy((char *)a + NLA_HDRLEN, data, len);
    nh->nlmsg_len = NLMSG_ALIGN(nh->nlmsg_len) + NLA_ALIGN(a->nla_len);
}

static void start_msg(char *buf, uint16_t msg, uint16_t flags, uint16_t queue) {
    struct nlmsghdr *nh = (struct nlmsghdr *)buf;
    memset(buf, 0, NLMSG_SPACE(sizeof(struct nfgenmsg)));
    nh->nlmsg_len = NLMSG_LENGTH(sizeof(struct nfgenmsg));
    nh->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | msg;
    nh->nlmsg_flags = NLM_F_REQUEST | flags;
    struct nfgenmsg *g = NLMSG_DATA(nh);
    g->nfgen_family = AF_UNSPEC;
    g->version = NFNETLINK_V0;
    g->res_id = htons(queue);
}

static int send_msg(int fd, const char *buf) {
    const struct nlmsghdr *nh = (const struct nlmsghdr *)buf;
    struct sockaddr_nl to = {.nl_family = AF_NETLINK};
    for (;;) {
        ssize_t n = sendto(fd, buf, nh->nlmsg_len, 0, (struct sockaddr *)&to, sizeof to);
        if (n >= 0) return 0;
        if (errno != EINTR) return -1;
    }
}

/* Sends a config message and waits for the kernel's acknowledgement. */
static int configure(int fd, const char *buf, const char *what) {
    char ack[4096];
    if (send_msg(fd, buf)) {
        fprintf(stderr, "hosts-delay: %s: %s\n", what, strerror(errno));
        return -1;
    }
    ssize_t n = recv(fd, ack, sizeof ack, 0);
    if (n < 0) {
        fprintf(stderr, "hosts-delay: %s: %s\n", what, strerror(errno));
        return -1;
    }
    struct nlmsghdr *nh = (struct nlmsghdr *)ack;
    if (nh->nlmsg_type == NLMSG_ERROR) {
        struct nlmsgerr *e = NLMSG_DATA(nh);
        if (e->error) {
            fprintf(stderr, "hosts-delay: %s: %s\n", what, strerror(-e->error));
            return -1;
        }
    }
    return 0;
}

static int verdict_upto(int fd, uint16_t queue, uint32_t id) {
    char buf[128];
    start_msg(buf, NFQNL_MSG_VERDICT_BATCH, 0, queue);
    struct nfqnl_msg_verdict_hdr v = {.verdict = htonl(NF_ACCEPT), .id = htonl(id)};
    put_attr(buf, NFQA_VERDICT_HDR, &v, sizeof v);
    return send_msg(fd, buf);
}

/* When the kernel received a packet, on CLOCK_MONOTONIC, from its NFQA_TIMESTAMP (wall
 * clock, stamped on receive because our socket asked for timestamps; packets on the
 * output path carry none). Falls back to `seen`, when we read it, if implausible. */
static int64_t queued_at(const struct nfqnl_msg_packet_timestamp *ts, int64_t seen) {
    int64_t t = (int64_t)be64toh(ts->sec) * 1000000000 + (int64_t)be64toh(ts->usec) * 1000;
    struct timespec r;
    clock_gettime(CLOCK_REALTIME, &r);
    int64_t real = (int64_t)r.tv_sec * 1000000000 + r.tv_nsec, mono = now_ns();
    if (t > real || real - t > 100000000) return seen;
    t = mono - (real - t);
    return t < seen ? t : seen;
}

/* Records every packet message in buf[0..len) as due `delay` after it was queued. */
static void take_packets(const char *buf, ssize_t len, int64_t delay, int fd, uint16_t queue) {
    for (const struct nlmsghdr *nh = (const struct nlmsghdr *)buf; NLMSG_OK(nh, len);
         nh = NLMSG_NEXT(nh, len)) {
        if (nh->nlmsg_type != ((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET)) continue;
        const char *p = (const char *)NLMSG_DATA(nh) + NLMSG_ALIGN(sizeof(struct nfgenmsg));
        const char *end = (const char *)nh + nh->nlmsg_len;
        int64_t seen = now_ns(), queued = seen;
        int have_id = 0;
        struct nfqnl_msg_packet_hdr ph;
        while (p + NLA_HDRLEN <= end) {
            const struct nlattr *a = (const struct nlattr *)p;
            if (a->nla_len < NLA_HDRLEN) break;
            if ((a->nla_type & NLA_TYPE_MASK) == NFQA_PACKET_HDR) {
                memcpy(&ph, p + NLA_HDRLEN, sizeof ph);
                have_id = 1;
            } else if ((a->nla_type & NLA_TYPE_MASK) == NFQA_TIMESTAMP) {
                struct nfqnl_msg_packet_timestamp ts;
                memcpy(&ts, p + NLA_HDRLEN, sizeof ts);
                queued = queued_at(&ts, seen);
            }
            p += NLA_ALIGN(a->nla_len);
        }
        if (!have_id) continue;
        if (tail - head == RING) { /* full: let the oldest go now */
            verdict_upto(fd, queue, ring[head % RING].id);
            head++;
        }
        ring[tail % RING].id = ntohl(ph.packet_id);
        ring[tail % RING].due_ns = queued + delay;
        tail++;
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: hosts-delay QUEUE_NUM DELAY_US\n");
        return 2;
    }
    uint16_t queue = (uint16_t)atoi(argv[1]);
    int64_t delay = (int64_t)(atof(argv[2]) * 1000.0);
    prctl(PR_SET_TIMERSLACK, 1UL); /* wake-ups as close to the due time as the kernel can */
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);

    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
    if (fd < 0) {
        perror("hosts-delay: netlink socket");
        return 1;
    }
    int one = 1, rcvbuf = 8 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf);
    /* Any socket asking for timestamps makes the kernel stamp packets that have none, so
     * that NFQA_TIMESTAMP tells when each packet was queued. */
    setsockopt(fd, SOL_SOCKET, SO_TIMESTAMP, &one, sizeof one);
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    struct sockaddr_nl self = {.nl_family = AF_NETLINK};
    if (bind(fd, (struct sockaddr *)&self, sizeof self)) {
        perror("hosts-delay: bind");
        return 1;
    }

    char buf[256];
    start_msg(buf, NFQNL_MSG_CONFIG, NLM_F_ACK, queue);
    struct nfqnl_msg_config_cmd cmd = {.command = NFQNL_CFG_CMD_BIND, .pf = htons(AF_INET)};
    put_attr(buf, NFQA_CFG_CMD, &cmd, sizeof cmd);
    if (configure(fd, buf, "bind queue")) return 1;

    start_msg(buf, NFQNL_MSG_CONFIG, NLM_F_ACK, queue);
    struct nfqnl_msg_config_params params = {.copy_range = htonl(0), .copy_mode = NFQNL_COPY_META};
    put_attr(buf, NFQA_CFG_PARAMS, &params, sizeof params);
    uint32_t maxlen = htonl(RING);
    put_attr(buf, NFQA_CFG_QUEUE_MAXLEN, &maxlen, sizeof maxlen);
    uint32_t flags = htonl(NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN);
    put_attr(buf, NFQA_CFG_FLAGS, &flags, sizeof flags);
    put_attr(buf, NFQA_CFG_MASK, &flags, sizeof flags);
    if (configure(fd, buf, "queue parameters")) return 1;

    /* Timed wake-ups come late, by about wake_ns (learned here), so the timer aims that
     * much early and fires on time on average. A packet's delay counts from when the
     * kernel queued it (its timestamp), so the wake-up it waited for us is not added. */
    int64_t wake_ns = 0;
    static char rx[1 << 16];
    while (!stop) {
        int64_t now = now_ns();
        if (head != tail && ring[head % RING].due_ns - wake_ns <= now) {
            uint32_t last = 0;
            while (head != tail && ring[head % RING].due_ns - wake_ns <= now)
                last = ring[head++ % RING].id;
            verdict_upto(fd, queue, last);
        }
        struct timespec ts, *tsp = NULL;
        int64_t aim = 0;
        if (head != tail) {
            aim = ring[head % RING].due_ns - wake_ns;
            int64_t wait = aim - now;
            if (wait < 0) wait = 0;
            ts.tv_sec = wait / 1000000000;
            ts.tv_nsec = wait % 1000000000;
            tsp = &ts;
        }
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int r = ppoll(&pfd, 1, tsp, NULL);
        int64_t woke = now_ns();
        if (r < 0 && errno != EINTR) {
            perror("hosts-delay: ppoll");
            return 1;
        }
        if (r == 0) { /* timer: learn how late it fired (samples capped, a preemption is rare) */
            int64_t late = woke - aim;
            if (late > 100000) late = 100000;
            if (late < 0) late = 0;
            wake_ns += (late - wake_ns) / 8;
            if (wake_ns > delay / 2) wake_ns = delay / 2;
        }
        if (r <= 0) continue;
        for (;;) {
            ssize_t n = recv(fd, rx, sizeof rx, MSG_DONTWAIT);
            if (n < 0) {
                if (errno == EAGAIN || errno == EINTR || errno == ENOBUFS) break;
                perror("hosts-delay: recv");
                return 1;
            }
            take_packets(rx, n, delay, fd, queue);
        }
    }
    if (head != tail) verdict_upto(fd, queue, ring[(tail - 1) % RING].id);
    return 0;
}
