/* tandemrun's rendezvous of the nodes of a job started once per host (torchrun's multi-node
 * form, --nnodes N --node-rank R): node 0 hosts the store on --master-addr:--master-port
 * (listening on that address only), every node presents the job's token, claims its node rank,
 * publishes its ranks' count and host, and waits for the others; ranks are numbered node by
 * node. While the job runs, a watcher thread on a connection of its own waits for the job's
 * end: the first failure anywhere is written under one key ("code|message") and every node
 * stops its ranks on seeing it; a store that goes away (node 0's tandemrun is gone) ends the
 * job too. A node whose ranks all succeeded says so; node 0 keeps the store up until every
 * node has, or has stopped answering. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tandem/store.h"

#include "tandemrun.h"

/* What a node publishes. */
typedef struct {
    int32_t nnodes, nproc, pid;
    char host[64];
} node_record;

#define KEY_END "tandem/job/end"
#define KEY_DONE "tandem/job/done"

static void *watch_main(void *arg) {
    tr_rdzv *z = arg;
    char buf[sizeof z->end];
    while (!atomic_load(&z->stop)) {
        size_t len = 0;
        td_status s = td_store_get(z->watch, KEY_END, buf, sizeof buf - 1, &len);
        if (s == TD_ETIMEOUT) {
            if (z->node_rank > 0) { /* a heartbeat, so that node 0 can tell a node is gone */
                char key[64];
                snprintf(key, sizeof key, "tandem/job/beat/%d", z->node_rank);
                td_store_add(z->watch, key, 1, NULL);
            }
            continue;
        }
        if (atomic_load(&z->stop)) break;
        pthread_mutex_lock(&z->lock);
        if (s == TD_OK) {
            buf[len < sizeof buf ? len : sizeof buf - 1] = 0;
            snprintf(z->end, sizeof z->end, "%s", buf);
        } else {
            snprintf(z->end, sizeof z->end,
                     "1|lost the rendezvous store at %s:%d (node 0's tandemrun is gone): %s",
                     z->addr, z->port, td_last_error());
        }
        pthread_mutex_unlock(&z->lock);
        unsigned char wake = 0;
        ssize_t unused = write(z->wake_fd, &wake, 1);
        (void)unused;
        break;
    }
    return NULL;
}

/* Which of the nodes have not published their record yet, as "node 1, node 3". */
static int missing_nodes(tr_rdzv *z, char *out, size_t cap) {
    int n = 0;
    size_t at = 0;
    out[0] = 0;
    for (int r = 0; r < z->nnodes; r++) {
        char key[64];
        snprintf(key, sizeof key, "tandem/rdzv/node/%d", r);
        if (td_store_wait(z->store, key, 0.01) == TD_OK) continue;
        if (at < cap) at += (size_t)snprintf(out + at, cap - at, "%snode %d", n ? ", " : "", r);
        n++;
    }
    return n;
}

/* A signal that arrived on the supervisor's self-pipe while the nodes wait for each other
 * (SIGINT, SIGTERM, SIGHUP): its number, or 0. */
static int signalled(int sig_fd) {
    struct pollfd p = {.fd = sig_fd, .events = POLLIN};
    unsigned char b;
    while (poll(&p, 1, 0) > 0 && read(sig_fd, &b, 1) == 1)
        if (b != SIGCHLD && b != 0) return b;
    return 0;
}

/* The address of the last connection the store refused for another token (store.h's
 * TD_STORE_KEY_DENIED): 1 with it in `from`, or 0. */
static int denied(tr_rdzv *z, char *from, size_t cap) {
    size_t len = 0;
    if (td_store_wait(z->store, TD_STORE_KEY_DENIED, 0.001) != TD_OK ||
        td_store_get(z->store, TD_STORE_KEY_DENIED, from, cap - 1, &len) != TD_OK)
        return 0;
    from[len < cap ? len : cap - 1] = 0;
    return 1;
}

/* Waits for `key` until `deadline` in short slices, so that a signal stops the wait, and so
 * that a node that came with another token ends it at once: TD_OK, TD_ETIMEOUT, another store
 * error, TD_ESTATE with *sig set, or TD_EAUTH with the refused connection's address in
 * `from`. */
static td_status wait_key(tr_rdzv *z, const char *key, uint64_t deadline, int sig_fd, int *sig,
                          char *from, size_t cap) {
    for (;;) {
        if ((*sig = signalled(sig_fd))) return TD_ESTATE;
        uint64_t now = td_time_ns();
        if (now >= deadline) return TD_ETIMEOUT;
        double left = (double)(deadline - now) / 1e9;
        td_status s = td_store_wait(z->store, key, left < 0.2 ? left + 0.001 : 0.2);
        if (s != TD_ETIMEOUT) return s;
        if (denied(z, from, cap)) return TD_EAUTH;
    }
}

int tr_rdzv_join(const tr_options *o, int wake_fd, int sig_fd, tr_rdzv *z) {
    memset(z, 0, sizeof *z);
    z->nnodes = o->nnodes;
    z->node_rank = o->node_rank;
    z->addr = o->master_addr;
    z->port = o->master_port;
    z->wake_fd = wake_fd;
    pthread_mutex_init(&z->lock, NULL);
    gethostname(z->host, sizeof z->host - 1);
    td_store_params sp = td_store_default_params();
    sp.host = o->master_addr;
    sp.port = o->master_port;
    sp.is_server = o->node_rank == 0;
    sp.token = o->token;
    sp.timeout_s = o->rdzv_timeout_s;
    uint64_t deadline = td_time_ns() + (uint64_t)(o->rdzv_timeout_s * 1e9);
    td_status s;
    int sig = 0;
    if (sp.is_server) {
        s = td_store_create(&z->store, &sp);
    } else { /* connect attempts of a second each, so that a signal stops them */
        sp.timeout_s = 1;
        do {
            s = td_store_create(&z->store, &sp);
        } while (s != TD_OK && s != TD_EAUTH && td_time_ns() < deadline &&
                 !(sig = signalled(sig_fd)));
        if (s == TD_OK) td_store_set_timeout(z->store, o->rdzv_timeout_s);
    }
    if (sig) {
        fprintf(stderr, "tandemrun: signal %d during the rendezvous; leaving\n", sig);
        return 128 + sig;
    }
    if (s == TD_EAUTH) {
        fprintf(stderr,
                "tandemrun: the rendezvous store at %s:%d refused node %d's token: another job "
                "uses that port, or the nodes were given different tokens (--token or "
                "TANDEM_TOKEN must be the same on every node)\n",
                o->master_addr, o->master_port, o->node_rank);
        return 1;
    }
    if (s != TD_OK && o->node_rank == 0) {
        fprintf(stderr,
                "tandemrun: node 0 cannot host the rendezvous store on %s:%d: %s (is another "
                "job using port %d, or is %s not an address of this host?)\n",
                o->master_addr, o->master_port, td_last_error(), o->master_port, o->master_addr);
        return 1;
    }
    if (s != TD_OK) {
        fprintf(stderr,
                "tandemrun: node %d cannot reach the rendezvous store at %s:%d within %g s: %s "
                "(is node 0, tandemrun --node-rank 0, running there?)\n",
                o->node_rank, o->master_addr, o->master_port, o->rdzv_timeout_s, td_last_error());
        return 1;
    }
    char key[64];
    int64_t claims = 0;
    snprintf(key, sizeof key, "tandem/rdzv/claim/%d", o->node_rank);
    s = td_store_add(z->store, key, 1, &claims);
    if (s == TD_OK && claims > 1) {
        fprintf(stderr,
                "tandemrun: node rank %d is already taken by another tandemrun of this job: "
                "give each node its own --node-rank (0 to %d)\n",
                o->node_rank, o->nnodes - 1);
        return 2;
    }
    node_record mine = {.nnodes = o->nnodes, .nproc = o->nproc, .pid = (int32_t)getpid()};
    memcpy(mine.host, z->host, sizeof mine.host);
    snprintf(key, sizeof key, "tandem/rdzv/node/%d", o->node_rank);
    if (s == TD_OK) s = td_store_set(z->store, key, &mine, sizeof mine);
    /* Everyone's record, within the rendezvous timeout. */
    for (int r = 0; s == TD_OK && r < o->nnodes; r++) {
        node_record theirs;
        size_t len = 0;
        snprintf(key, sizeof key, "tandem/rdzv/node/%d", r);
        char from[64];
        s = wait_key(z, key, deadline, sig_fd, &sig, from, sizeof from);
        if (sig) {
            fprintf(stderr, "tandemrun: signal %d during the rendezvous; leaving\n", sig);
            return 128 + sig;
        }
        char missing[256];
        int k = s == TD_EAUTH ? missing_nodes(z, missing, sizeof missing) : 0;
        if (s == TD_EAUTH && k == 0) s = TD_OK; /* the node came meanwhile after all */
        if (s == TD_EAUTH) {
            fprintf(stderr,
                    "tandemrun: the rendezvous store at %s:%d refused a connection from %s that "
                    "presented another token, and %s %s not arrived: was %s given a different "
                    "--token (or TANDEM_TOKEN)? Every node of the job must give the same\n",
                    o->master_addr, o->master_port, from, missing, k == 1 ? "has" : "have",
                    k == 1 ? "it" : "one");
            return 1;
        }
        if (s == TD_OK) s = td_store_get(z->store, key, &theirs, sizeof theirs, &len);
        if (s == TD_ETIMEOUT) {
            k = missing_nodes(z, missing, sizeof missing);
            fprintf(stderr,
                    "tandemrun: rendezvous timed out after %g s: %d of %d nodes arrived, "
                    "missing %s (start tandemrun --nnodes %d --node-rank R on each of them, with "
                    "the same --master-addr, --master-port and --token)\n",
                    o->rdzv_timeout_s, o->nnodes - k, o->nnodes, missing, o->nnodes);
            return 1;
        }
        if (s == TD_OK && (len != sizeof theirs || theirs.nnodes != o->nnodes)) {
            fprintf(stderr,
                    "tandemrun: node %d (host %.63s) was started with --nnodes %d, this node "
                    "with --nnodes %d: every node must give the same\n",
                    r, theirs.host, (int)theirs.nnodes, o->nnodes);
            return 2;
        }
        if (s == TD_OK) {
            if (r < o->node_rank) z->rank_offset += theirs.nproc;
            z->world_size += theirs.nproc;
        }
    }
    if (s != TD_OK) {
        fprintf(stderr, "tandemrun: rendezvous at %s:%d failed: %s\n", o->master_addr,
                o->master_port, td_last_error());
        return 1;
    }
    /* From now on a store that does not answer within seconds is a lost node 0 (its host's
     * link may be down): nothing may hang on it. */
    td_store_set_timeout(z->store, 10);
    sp.is_server = 0;
    sp.timeout_s = 1; /* the watcher's waits: one second each */
    s = td_store_create(&z->watch, &sp);
    if (s == TD_OK && pthread_create(&z->thread, NULL, watch_main, z) == 0) {
        z->thread_started = 1;
    } else {
        fprintf(stderr, "tandemrun: cannot watch the job's rendezvous store: %s\n",
                s ? td_last_error() : strerror(errno));
        return 1;
    }
    return 0;
}

int tr_rdzv_end_job(tr_rdzv *z, int code, const char *what, int *job_code, char *job_what,
                    size_t cap) {
    char buf[sizeof z->end];
    int64_t first = 0;
    snprintf(buf, sizeof buf, "%d|%s", code, what);
    *job_code = code;
    snprintf(job_what, cap, "%s", what);
    /* The first end anywhere is the job's: later ones (the others giving up) do not replace it. */
    if (td_store_add(z->store, KEY_END "/claims", 1, &first) != TD_OK) return 1;
    if (first == 1) {
        td_store_set(z->store, KEY_END, buf, strlen(buf) + 1);
        return 1;
    }
    size_t len = 0;
    if (td_store_get(z->store, KEY_END, buf, sizeof buf - 1, &len) != TD_OK) return 1;
    buf[len < sizeof buf ? len : sizeof buf - 1] = 0;
    char *bar = strchr(buf, '|');
    *job_code = atoi(buf);
    snprintf(job_what, cap, "%s", bar ? bar + 1 : buf);
    return 0;
}

int tr_rdzv_ended(tr_rdzv *z, int *code, char *what, size_t cap) {
    pthread_mutex_lock(&z->lock);
    int ended = z->end[0] != 0;
    if (ended) {
        char *bar = strchr(z->end, '|');
        *code = atoi(z->end);
        snprintf(what, cap, "%s", bar ? bar + 1 : z->end);
    }
    pthread_mutex_unlock(&z->lock);
    return ended;
}

void tr_rdzv_leave(tr_rdzv *z, int ok) {
    if (ok) {
        int64_t done = 0;
        td_store_add(z->store, KEY_DONE, 1, &done);
        /* Node 0 serves the store until every node finished, failed, or fell silent. */
        int64_t *beats = calloc((size_t)z->nnodes, sizeof *beats);
        double *since = calloc((size_t)z->nnodes, sizeof *since);
        while (z->node_rank == 0 && beats && since && done < z->nnodes) {
            int code;
            char what[8];
            if (tr_rdzv_ended(z, &code, what, sizeof what)) break;
            struct timespec pause = {0, 100000000};
            nanosleep(&pause, NULL);
            td_store_add(z->store, KEY_DONE, 0, &done);
            int silent = -1;
            for (int r = 1; r < z->nnodes; r++) {
                char key[64];
                int64_t beat = 0;
                snprintf(key, sizeof key, "tandem/job/beat/%d", r);
                td_store_add(z->store, key, 0, &beat);
                if (beat != beats[r] || since[r] == 0)
                    beats[r] = beat, since[r] = ((double)td_time_ns() * 1e-9);
                if (((double)td_time_ns() * 1e-9) - since[r] > 10) silent = r;
            }
            if (silent >= 0) {
                fprintf(stderr,
                        "tandemrun: node %d stopped answering the rendezvous store; "
                        "leaving\n",
                        silent);
                break;
            }
        }
        free(beats);
        free(since);
    }
    atomic_store(&z->stop, 1);
    if (z->thread_started) pthread_join(z->thread, NULL);
    td_store_destroy(z->watch);
    td_store_destroy(z->store);
    pthread_mutex_destroy(&z->lock);
}
