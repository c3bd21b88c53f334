/* The shm backend's point-to-point messages: one single-producer single-consumer byte ring
 * per ordered pair of ranks in the group's segment. A message is a 16-byte header (i32 tag,
 * u32 magic, u64 bytes) and its payload, streamed through the ring in as many pieces as it
 * takes. Progress happens inside the caller's send/recv/wait/test calls: every call pushes
 * pending sends and drains every incoming ring, into the matching posted receive or, when
 * none is posted yet, into a heap copy (an "unexpected" message). Draining eagerly is what
 * lets two ranks isend large messages to each other and then wait, without deadlock.
 * Messages from one sender with one tag are matched in the order sent. It does not do
 * collectives or any cross-group traffic. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/recorder.h"
#include "comm/shm/shm_impl.h"

#define P2P_MAGIC 0x70326474u
#define P2P_HDR 16

struct shm_p2p_req {
    int is_send, peer, tag;
    unsigned char *buf;
    size_t bytes, moved;
    int hdr_sent, complete;
    td_status status;
    char error[512];
    struct shm_unexpected *bound; /* a receive waiting for an unexpected message to finish */
    shm_p2p_req *next;
};

/* A message that arrived before its receive was posted. */
typedef struct shm_unexpected {
    int src, tag, complete;
    unsigned char *data;
    size_t bytes, got;
    shm_p2p_req *req; /* bound receive, if posted while the message was still arriving */
    struct shm_unexpected *next;
} shm_unexpected;

/* The message currently being read from one sender's ring. */
typedef struct shm_incoming {
    int active, tag;
    size_t bytes, got;
    unsigned char *dst; /* NULL: discard (size mismatch) */
    shm_p2p_req *req;
    shm_unexpected *ux;
} shm_incoming;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void ring_copy_in(unsigned char *ring, uint64_t pos, const void *src, size_t len) {
    size_t off = (size_t)(pos % SHM_RING), first = len < SHM_RING - off ? len : SHM_RING - off;
    memcpy(ring + off, src, first);
    if (len > first) memcpy(ring, (const unsigned char *)src + first, len - first);
}

static void ring_copy_out(void *dst, const unsigned char *ring, uint64_t pos, size_t len) {
    size_t off = (size_t)(pos % SHM_RING), first = len < SHM_RING - off ? len : SHM_RING - off;
    if (dst) {
        memcpy(dst, ring + off, first);
        if (len > first) memcpy((unsigned char *)dst + first, ring, len - first);
    }
}

static unsigned char *ring_data(shm_ctx *c, int src, int dst) {
    return c->ring_data + ((size_t)src * c->size + dst) * SHM_RING;
}

static void ring_bell(shm_ctx *c, int r) {
    /* Orders our ring update before reading the sleeper count (the waiter does the reverse). */
    atomic_thread_fence(memory_order_seq_cst);
    if (!atomic_load(&c->ranks[r].p2p_sleeping)) return;
    atomic_fetch_add(&c->ranks[r].p2p_bell, 1);
    td__shm_futex_wake(&c->ranks[r].p2p_bell);
}

static void req_finish(shm_p2p_req *r, td_status s) {
    r->complete = 1;
    r->status = s;
}

static void list_remove(shm_p2p_req **list, shm_p2p_req *r) {
    for (shm_p2p_req **p = list; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            r->next = NULL;
            return;
        }
}

static void progress_sends(shm_ctx *c) {
    unsigned char blocked[256] = {0}; /* one message at a time per destination keeps order */
    for (shm_p2p_req *r = c->sends, *next; r; r = next) {
        next = r->next;
        if (r->peer < 256 && blocked[r->peer]) continue;
        shm_ring *ring = &c->rings[(size_t)c->rank * c->size + r->peer];
        uint64_t head = atomic_load_explicit(&ring->head, memory_order_relaxed);
        uint64_t space =
            SHM_RING - (head - atomic_load_explicit(&ring->tail, memory_order_acquire));
        unsigned char *data = ring_data(c, c->rank, r->peer);
        uint64_t start = head;
        if (!r->hdr_sent && space >= P2P_HDR) {
            unsigned char h[P2P_HDR];
            int32_t tag = r->tag;
            uint32_t magic = P2P_MAGIC;
            uint64_t bytes = r->bytes;
            memcpy(h, &tag, 4);
            memcpy(h + 4, &magic, 4);
            memcpy(h + 8, &bytes, 8);
            ring_copy_in(data, head, h, P2P_HDR);
            head += P2P_HDR;
            space -= P2P_HDR;
            r->hdr_sent = 1;
        }
        if (r->hdr_sent && r->moved < r->bytes && space) {
            size_t n = r->bytes - r->moved < space ? r->bytes - r->moved : (size_t)space;
            ring_copy_in(data, head, r->buf + r->moved, n);
            head += n;
            r->moved += n;
        }
        if (head != start) {
            atomic_store_explicit(&ring->head, head, memory_order_release);
            ring_bell(c, r->peer);
        }
        if (r->hdr_sent && r->moved == r->bytes) {
            list_remove(&c->sends, r);
            req_finish(r, TD_OK);
        } else if (r->peer < 256) {
            blocked[r->peer] = 1;
        }
    }
}

/* Decides where a newly announced message goes. */
static void match_incoming(shm_ctx *c, int src, shm_incoming *in) {
    for (shm_p2p_req *r = c->recvs; r; r = r->next) {
        if (r->peer != src || r->tag != in->tag) continue;
        list_remove(&c->recvs, r);
        in->req = r;
        if (r->bytes != in->bytes) {
            snprintf(r->error, sizeof r->error,
                     "recv from %s tag %d: %s posted %zu bytes but the sender sent %zu",
                     td__who(c->names, src).s, in->tag, td__who(c->names, c->rank).s, r->bytes,
                     in->bytes);
            in->dst = NULL;
        } else {
            in->dst = r->buf;
        }
        return;
    }
    shm_unexpected *u = calloc(1, sizeof *u);
    if (u) u->data = malloc(in->bytes ? in->bytes : 1);
    if (!u || !u->data) {
        free(u);
        td__shm_poison(c, TD_ENOMEM, "p2p: %s: out of memory for a %zu-byte message from %s",
                       td__who(c->names, c->rank).s, in->bytes, td__who(c->names, src).s);
        in->dst = NULL;
        return;
    }
    u->src = src;
    u->tag = in->tag;
    u->bytes = in->bytes;
    shm_unexpected **tail = &c->unexpected;
    while (*tail) tail = &(*tail)->next;
    *tail = u;
    in->ux = u;
    in->dst = u->data;
}

static void deliver_unexpected(shm_ctx *c, shm_unexpected *u);

static void incoming_done(shm_ctx *c, shm_incoming *in) {
    if (in->req) req_finish(in->req, in->req->error[0] ? TD_EMISMATCH : TD_OK);
    if (in->ux) {
        in->ux->complete = 1;
        if (in->ux->req) deliver_unexpected(c, in->ux);
    }
    memset(in, 0, sizeof *in);
}

static void progress_recvs(shm_ctx *c) {
    for (int src = 0; src < c->size; src++) {
        if (src == c->rank) continue;
        shm_ring *ring = &c->rings[(size_t)src * c->size + c->rank];
        shm_incoming *in = &c->incoming[src];
        const unsigned char *data = ring_data(c, src, c->rank);
        uint64_t tail = atomic_load_explicit(&ring->tail, memory_order_relaxed), start = tail;
        for (;;) {
            uint64_t avail = atomic_load_explicit(&ring->head, memory_order_acquire) - tail;
            if (!in->active) {
                if (avail < P2P_HDR) break;
                unsigned char h[P2P_HDR];
                ring_copy_out(h, data, tail, P2P_HDR);
                tail += P2P_HDR;
                avail -= P2P_HDR;
                int32_t tag;
                uint32_t magic;
                uint64_t bytes;
                memcpy(&tag, h, 4);
                memcpy(&magic, h + 4, 4);
                memcpy(&bytes, h + 8, 8);
                if (magic != P2P_MAGIC) {
                    td__shm_poison(c, TD_EPEER, "p2p: %s: corrupt message header from %s",
                                   td__who(c->names, c->rank).s, td__who(c->names, src).s);
                    break;
                }
                memset(in, 0, sizeof *in);
                in->active = 1;
                in->tag = tag;
                in->bytes = (size_t)bytes;
                match_incoming(c, src, in);
            }
            size_t n = in->bytes - in->got < avail ? in->bytes - in->got : (size_t)avail;
            ring_copy_out(in->dst ? in->dst + in->got : NULL, data, tail, n);
            tail += n;
            in->got += n;
            if (in->got == in->bytes) {
                incoming_done(c, in);
                continue;
            }
            break;
        }
        if (tail != start) {
            atomic_store_explicit(&ring->tail, tail, memory_order_release);
            ring_bell(c, src);
        }
    }
}

static void progress(shm_ctx *c) {
    progress_sends(c);
    progress_recvs(c);
}

/* Copies a finished unexpected message into its bound receive and frees it. */
static void deliver_unexpected(shm_ctx *c, shm_unexpected *u) {
    shm_p2p_req *r = u->req;
    if (r->bytes == u->bytes) {
        if (u->bytes) memcpy(r->buf, u->data, u->bytes);
        req_finish(r, TD_OK);
    } else {
        snprintf(r->error, sizeof r->error,
                 "recv from %s tag %d: %s posted %zu bytes but the sender sent %zu",
                 td__who(c->names, u->src).s, u->tag, td__who(c->names, c->rank).s, r->bytes,
                 u->bytes);
        req_finish(r, TD_EMISMATCH);
    }
    for (shm_unexpected **p = &c->unexpected; *p; p = &(*p)->next)
        if (*p == u) {
            *p = u->next;
            break;
        }
    free(u->data);
    free(u);
}

static td_status ensure_incoming(shm_ctx *c) {
    if (!c->incoming) c->incoming = calloc((size_t)c->size, sizeof *c->incoming);
    return c->incoming ? TD_OK : td__fail(TD_ENOMEM, "p2p: out of memory");
}

static td_status post(shm_ctx *c, int is_send, void *buf, size_t bytes, int peer, int tag,
                      void **out) {
    if (atomic_load(&c->head->poison)) return td__shm_poisoned(c, is_send ? "send" : "recv");
    if (peer == c->rank)
        return td__fail(TD_EINVAL, "p2p: rank %d cannot %s itself", c->rank,
                        is_send ? "send to" : "receive from");
    shm_p2p_req *r = calloc(1, sizeof *r);
    if (!r) return td__fail(TD_ENOMEM, "p2p: out of memory");
    r->is_send = is_send;
    r->buf = buf;
    r->bytes = bytes;
    r->peer = peer;
    r->tag = tag;
    pthread_mutex_lock(&c->p2p_lock);
    td_status s = ensure_incoming(c);
    if (s) {
        pthread_mutex_unlock(&c->p2p_lock);
        free(r);
        return s;
    }
    if (is_send) {
        shm_p2p_req **tail = &c->sends;
        while (*tail) tail = &(*tail)->next;
        *tail = r;
    } else {
        shm_unexpected *u = c->unexpected;
        while (u && (u->src != peer || u->tag != tag || u->req)) u = u->next;
        if (u) {
            u->req = r;
            if (u->complete) deliver_unexpected(c, u);
        } else {
            shm_p2p_req **tail = &c->recvs;
            while (*tail) tail = &(*tail)->next;
            *tail = r;
        }
    }
    progress(c);
    pthread_mutex_unlock(&c->p2p_lock);
    *out = r;
    return TD_OK;
}

td_status td__shm_isend(void *ctx, const void *buf, size_t bytes, int dst, int tag, void **req) {
    return post(ctx, 1, (void *)buf, bytes, dst, tag, req);
}

td_status td__shm_irecv(void *ctx, void *buf, size_t bytes, int src, int tag, void **req) {
    return post(ctx, 0, buf, bytes, src, tag, req);
}

/* Forgets a request that ends with an error while still listed. */
static void detach(shm_ctx *c, shm_p2p_req *r) {
    list_remove(&c->sends, r);
    list_remove(&c->recvs, r);
    for (int i = 0; c->incoming && i < c->size; i++)
        if (c->incoming[i].req == r) {
            c->incoming[i].req = NULL;
            c->incoming[i].dst = NULL;
        }
    for (shm_unexpected *u = c->unexpected; u; u = u->next)
        if (u->req == r) u->req = NULL;
}

static td_status finish(shm_p2p_req *r) {
    td_status s = r->status;
    if (s) s = td__fail(s, "%s", r->error[0] ? r->error : "p2p failed");
    free(r);
    return s;
}

td_status td__shm_p2p_test(void *ctx, void *req, int *done) {
    shm_ctx *c = ctx;
    shm_p2p_req *r = req;
    pthread_mutex_lock(&c->p2p_lock);
    progress(c);
    int complete = r->complete;
    if (!complete && atomic_load(&c->head->poison)) {
        detach(c, r);
        pthread_mutex_unlock(&c->p2p_lock);
        *done = 1;
        td_status s = td__shm_poisoned(c, r->is_send ? "send" : "recv");
        free(r);
        return s;
    }
    pthread_mutex_unlock(&c->p2p_lock);
    *done = complete;
    return complete ? finish(r) : TD_OK;
}

td_status td__shm_p2p_wait(void *ctx, void *req, double timeout_s) {
    shm_ctx *c = ctx;
    shm_p2p_req *r = req;
    shm_rank *me = &c->ranks[c->rank];
    uint64_t start = td_time_ns(), deadline = start + (uint64_t)(timeout_s * 1e9),
             next_check = start + 5000000ull;
    unsigned spins = 0;
    for (;;) {
        /* Spin first; only a sleeper asks peers to ring its bell. */
        int sleeper = td_time_ns() - start >= c->spin_ns;
        if (sleeper) atomic_fetch_add(&me->p2p_sleeping, 1);
        uint32_t bell = atomic_load(&me->p2p_bell);
        pthread_mutex_lock(&c->p2p_lock);
        progress(c);
        int complete = r->complete;
        pthread_mutex_unlock(&c->p2p_lock);
        td_status s = TD_OK;
        uint64_t now = td_time_ns();
        const char *what = r->is_send ? "send" : "recv";
        if (complete) {
        } else if (atomic_load(&c->head->poison)) {
            s = td__shm_poisoned(c, what);
        } else if (now >= next_check) {
            next_check = now + 5000000ull;
            int pid = c->ranks[r->peer].pid;
            if (td__pid_dead(pid))
                s = td__shm_poison(c, TD_EPEER, "%s: %s: peer %s (pid %d) died", what,
                                   td__who(c->names, c->rank).s, td__who(c->names, r->peer).s,
                                   pid);
            else if (now >= deadline)
                s = td__shm_poison(
                    c, TD_ETIMEOUT,
                    "%s (tag %d, %zu bytes): %s: %s did not %s within %.1f s", what, r->tag,
                    r->bytes, td__who(c->names, c->rank).s, td__who(c->names, r->peer).s,
                    r->is_send ? "receive" : "send", timeout_s);
        }
        if (!complete && !s && sleeper) {
            td__rec_waits(now, r->peer);
            td__shm_futex_wait(&me->p2p_bell, bell, 10000000ull);
        }
        if (sleeper) atomic_fetch_sub(&me->p2p_sleeping, 1);
        if (complete) return finish(r);
        if (s) {
            pthread_mutex_lock(&c->p2p_lock);
            detach(c, r);
            pthread_mutex_unlock(&c->p2p_lock);
            free(r);
            return s;
        }
        if (!sleeper && c->yield && ++spins % 64 == 0)
            sched_yield(); /* a peer on our core needs it (share_cores) */
        else if (!sleeper)
            cpu_relax();
    }
}

void td__shm_p2p_free(shm_ctx *c) {
    for (shm_unexpected *u = c->unexpected, *next; u; u = next) {
        next = u->next;
        free(u->data);
        free(u);
    }
    c->unexpected = NULL;
    free(c->incoming);
    c->incoming = NULL;
    /* Requests the user never completed are the user's to free; forget them here. */
    c->sends = c->recvs = NULL;
}
