/* Point-to-point messages a rank sends to itself, as MPI allows: a send is matched with the
 * oldest receive of its tag already posted, or else copied into the mailbox, so it completes
 * at once whatever its size and whether or not the receive comes first; a receive takes the
 * oldest message of its tag or waits for one. Messages of one tag arrive in the order sent.
 * The same calls as a backend's p2p (isend, irecv, wait, test over opaque handles); no other
 * rank is involved. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm_impl.h"
#include "comm/recorder.h"
#include "core/core_impl.h"

typedef struct self_msg {
    int tag;
    size_t bytes;
    unsigned char *data;
    struct self_msg *next;
} self_msg;

typedef struct self_req {
    int is_recv, tag, done;
    void *buf;
    size_t bytes;
    td_status status;
    char error[160];
    struct self_req *next; /* posted receives, oldest first */
} self_req;

struct td__self_box {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    self_msg *msgs;  /* sent, not yet received, oldest first */
    self_req *recvs; /* posted, not yet matched, oldest first */
};

td_status td__self_box_create(td__self_box **out) {
    td__self_box *b = calloc(1, sizeof *b);
    if (!b) return td__fail(TD_ENOMEM, "p2p: out of memory");
    pthread_mutex_init(&b->lock, NULL);
    pthread_cond_init(&b->cond, NULL);
    *out = b;
    return TD_OK;
}

void td__self_box_destroy(td__self_box *b) {
    if (!b) return;
    while (b->msgs) {
        self_msg *m = b->msgs;
        b->msgs = m->next;
        free(m->data);
        free(m);
    }
    pthread_cond_destroy(&b->cond);
    pthread_mutex_destroy(&b->lock);
    free(b);
}

/* Delivers `bytes` at `data` into receive r (sizes must agree, as between two ranks). */
static void deliver(self_req *r, const void *data, size_t bytes, int rank) {
    if (bytes == r->bytes) {
        if (bytes) memcpy(r->buf, data, bytes);
        r->status = TD_OK;
    } else {
        r->status = TD_EMISMATCH;
        snprintf(r->error, sizeof r->error,
                 "recv: rank %d sent itself %zu bytes with tag %d, the receive expects %zu", rank,
                 bytes, r->tag, r->bytes);
    }
    r->done = 1;
}

td_status td__self_send(td__self_box *b, const void *buf, size_t bytes, int tag, int rank,
                        void **req) {
    self_req *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "send: out of memory");
    s->tag = tag;
    s->done = 1;
    pthread_mutex_lock(&b->lock);
    self_req **p = &b->recvs;
    while (*p && (*p)->tag != tag) p = &(*p)->next;
    if (*p) {
        self_req *r = *p;
        *p = r->next;
        deliver(r, buf, bytes, rank);
    } else {
        self_msg *m = calloc(1, sizeof *m);
        if (m) m->data = malloc(bytes ? bytes : 1);
        if (!m || !m->data) {
            pthread_mutex_unlock(&b->lock);
            if (m) free(m);
            free(s);
            return td__fail(TD_ENOMEM, "send: out of memory for %zu bytes to this rank", bytes);
        }
        m->tag = tag;
        m->bytes = bytes;
        if (bytes) memcpy(m->data, buf, bytes);
        self_msg **q = &b->msgs;
        while (*q) q = &(*q)->next;
        *q = m;
    }
    pthread_cond_broadcast(&b->cond);
    pthread_mutex_unlock(&b->lock);
    *req = s;
    return TD_OK;
}

td_status td__self_recv(td__self_box *b, void *buf, size_t bytes, int tag, int rank, void **req) {
    self_req *r = calloc(1, sizeof *r);
    if (!r) return td__fail(TD_ENOMEM, "recv: out of memory");
    r->is_recv = 1;
    r->tag = tag;
    r->buf = buf;
    r->bytes = bytes;
    pthread_mutex_lock(&b->lock);
    self_msg **p = &b->msgs;
    while (*p && (*p)->tag != tag) p = &(*p)->next;
    if (*p) {
        self_msg *m = *p;
        *p = m->next;
        deliver(r, m->data, m->bytes, rank);
        free(m->data);
        free(m);
    } else {
        self_req **q = &b->recvs;
        while (*q) q = &(*q)->next;
        *q = r;
    }
    pthread_mutex_unlock(&b->lock);
    *req = r;
    return TD_OK;
}

static td_status finish(self_req *r) {
    td_status s = r->status ? td__fail(r->status, "%s", r->error) : TD_OK;
    free(r);
    return s;
}

td_status td__self_wait(td__self_box *b, void *req, double timeout_s, int rank) {
    self_req *r = req;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    double t = (double)until.tv_sec + (double)until.tv_nsec * 1e-9 + timeout_s;
    until.tv_sec = (time_t)t;
    until.tv_nsec = (long)((t - (double)until.tv_sec) * 1e9);
    pthread_mutex_lock(&b->lock);
    int rc = 0;
    if (!r->done) td__rec_waits(td_time_ns(), rank);
    while (!r->done && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&b->cond, &b->lock, &until);
    if (!r->done) { /* never matched: take it back */
        self_req **p = &b->recvs;
        while (*p && *p != r) p = &(*p)->next;
        if (*p) *p = r->next;
        r->status = TD_ETIMEOUT;
        snprintf(r->error, sizeof r->error,
                 "recv: rank %d waited %.3g s for a message to itself with tag %d", rank, timeout_s,
                 r->tag);
    }
    pthread_mutex_unlock(&b->lock);
    return finish(r);
}

td_status td__self_test(td__self_box *b, void *req, int *done) {
    self_req *r = req;
    pthread_mutex_lock(&b->lock);
    *done = r->done;
    pthread_mutex_unlock(&b->lock);
    return *done ? finish(r) : TD_OK;
}
