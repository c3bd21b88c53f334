/* The UCX backend's messages: tagged sends and receives (ucp_tag_send_nbx, ucp_tag_recv_nbx)
 * through the world's one worker, progressed while polled, and cut short when a peer's
 * endpoint fails: a tag receive is not tied to an endpoint, so a receive from a peer that is
 * gone would wait forever, and is cancelled instead. Also the transport table p2p_coll.c
 * builds the collectives on, and the idle policy (spin, then sleep on the worker's event
 * descriptor: spinning ranks that outnumber the cores would starve the ones with work). */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/ucx/ucx_impl.h"
#include "core/core_impl.h"

#define SPIN_NS 50000 /* a wait spins this long before it sleeps */
#define NOTICE_GRACE_NS 200000000u /* how long a peer's failure waits for the group's notice */

typedef struct {
    void *req; /* the UCX request, NULL when the operation completed at once */
    int recv, peer; /* peer: world rank */
    ucs_status_t status;
    ucp_tag_recv_info_t info;
} ucx_msg;

static ucp_tag_t tag_of(const td__ucx_group *g, int coll, int src_world, uint32_t tag) {
    return ((ucp_tag_t)(coll != 0) << 63) | ((ucp_tag_t)g->id << 51) | ((ucp_tag_t)src_world << 31) |
           (ucp_tag_t)tag;
}

/* The source bits of a tag, left out when matching a notice from anyone. */
#define SOURCE_MASK ((((ucp_tag_t)1 << TD__UCX_RANK_BITS) - 1) << 31)

void td__ucx_describe(const td__ucx_group *g, int rank, char *out, size_t cap) {
    int w = rank >= 0 && rank < g->size ? g->world[rank] : -1;
    const char *host = w >= 0 ? g->w->hosts[w] : NULL;
    if (!g->names && w >= 0 && g->size != g->w->size)
        snprintf(out, cap, "world rank %d on %s", w, host); /* a group the user never sees */
    else
        snprintf(out, cap, "%s", td__who_on(g->names, rank, host).s);
}

/* The message for a peer whose endpoint failed with `st`. A peer that gave up on the group
 * sent its notice before it left (p2p_coll.c), but UCX may report the endpoint's failure
 * before the notice is read, and a process's exit is seen at once where a killed one's
 * endpoint fails only when UCX next checks it: a survivor that left because of the dead rank
 * can fail here first. So the group's notice is awaited a little before the peer is named
 * (the caller then names the notice's cause instead). */
static td_status peer_failed(td__ucx_group *g, int world, ucs_status_t st) {
    td__ucx_world *w = g->w;
    uint64_t start = td_time_ns();
    for (uint64_t waited = 0; g->notice_req && waited < NOTICE_GRACE_NS;
         waited = td_time_ns() - start) {
        pthread_mutex_lock(&w->lock);
        int events = (int)ucp_worker_progress(w->worker);
        int done = ucp_request_check_status(g->notice_req) != UCS_INPROGRESS;
        pthread_mutex_unlock(&w->lock);
        if (done) break;
        if (!events) td__ucx_idle(w, SPIN_NS);
    }
    return td__fail(TD_EPEER, "the connection to rank %d on %s failed: %s", world, w->hosts[world],
                    ucs_status_string(st));
}

td_status td__ucx_msg_start(td__ucx_group *g, int coll, void *buf, size_t bytes, int peer,
                            uint32_t tag, int recv, void **out) {
    td__ucx_world *w = g->w;
    int pw = g->world[peer];
    /* A receive from a peer that is gone may still find its last message already here. */
    ucs_status_t gone = (ucs_status_t)atomic_load(&w->failed[pw]);
    if (gone && !recv) return peer_failed(g, pw, gone);
    ucx_msg *m = calloc(1, sizeof *m);
    if (!m) return td__fail(TD_ENOMEM, "ucx: out of memory for a message");
    m->recv = recv;
    m->peer = pw;
    ucp_request_param_t p = {.op_attr_mask = 0};
    ucs_status_ptr_t r;
    pthread_mutex_lock(&w->lock);
    if (recv) {
        p.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
        p.recv_info.tag_info = &m->info;
        r = ucp_tag_recv_nbx(w->worker, buf, bytes, tag_of(g, coll, pw, tag), ~(ucp_tag_t)0, &p);
    } else {
        r = ucp_tag_send_nbx(w->eps[pw], buf, bytes, tag_of(g, coll, w->rank, tag), &p);
    }
    pthread_mutex_unlock(&w->lock);
    if (UCS_PTR_IS_ERR(r)) {
        free(m);
        ucs_status_t st = UCS_PTR_STATUS(r);
        return st == UCS_ERR_CONNECTION_RESET || st == UCS_ERR_ENDPOINT_TIMEOUT
                   ? peer_failed(g, pw, st)
                   : td__fail(TD_EBACKEND, "ucx: %s to rank %d failed: %s",
                              recv ? "a receive" : "a send", pw, ucs_status_string(st));
    }
    m->req = r; /* NULL: done already (a receive's info is filled) */
    *out = m;
    return TD_OK;
}

td_status td__ucx_msg_test(td__ucx_group *g, void *msg, int *done, size_t *bytes) {
    td__ucx_world *w = g->w;
    ucx_msg *m = msg;
    ucs_status_t st = UCS_OK;
    pthread_mutex_lock(&w->lock);
    if (m->req) {
        ucp_worker_progress(w->worker);
        st = m->recv ? ucp_tag_recv_request_test(m->req, &m->info) : ucp_request_check_status(m->req);
        if (st != UCS_INPROGRESS) {
            ucp_request_free(m->req);
            m->req = NULL;
        }
    }
    pthread_mutex_unlock(&w->lock);
    *done = st != UCS_INPROGRESS;
    if (!*done) {
        int peer = m->peer;
        ucs_status_t gone = (ucs_status_t)atomic_load(&w->failed[peer]);
        if (!gone) return TD_OK;
        td__ucx_msg_cancel(g, m);
        *done = 1;
        return peer_failed(g, peer, gone);
    }
    size_t len = m->info.length;
    int peer = m->peer;
    free(m);
    if (st == UCS_ERR_MESSAGE_TRUNCATED)
        return td__fail(TD_EMISMATCH, "rank %d (host %s) sent more than the receive's count",
                        peer, w->hosts[peer]);
    if (st != UCS_OK) {
        ucs_status_t gone = (ucs_status_t)atomic_load(&w->failed[peer]);
        return peer_failed(g, peer, gone ? gone : st);
    }
    *bytes = len;
    return TD_OK;
}

void td__ucx_msg_cancel(td__ucx_group *g, void *msg) {
    td__ucx_world *w = g->w;
    ucx_msg *m = msg;
    pthread_mutex_lock(&w->lock);
    if (m->req) {
        /* A send cannot be taken back, nor a receive whose message has begun to arrive (over a
         * link that went down it never ends): give either 100 ms, then let UCX free it whenever
         * it ends. The group is unusable afterwards anyway. */
        if (m->recv) ucp_request_cancel(w->worker, m->req);
        uint64_t until = td_time_ns() + 100000000u;
        while (m->recv && ucp_request_check_status(m->req) == UCS_INPROGRESS && td_time_ns() < until)
            ucp_worker_progress(w->worker);
        ucp_request_free(m->req);
    }
    pthread_mutex_unlock(&w->lock);
    free(m);
}

void td__ucx_idle(td__ucx_world *w, uint64_t waited_ns) {
    if (waited_ns < SPIN_NS) return;
    pthread_mutex_lock(&w->lock);
    ucs_status_t st = ucp_worker_arm(w->worker);
    pthread_mutex_unlock(&w->lock);
    if (st != UCS_OK) return; /* events are pending: progress them */
    struct pollfd p = {.fd = w->efd, .events = POLLIN};
    poll(&p, 1, 1);
}

/* ---------------------------------------------------------------- the collectives' channel */

static td_status t_isend(void *t, const void *buf, size_t bytes, int peer, uint32_t tag,
                         void **req) {
    return td__ucx_msg_start(t, 1, (void *)buf, bytes, peer, tag, 0, req);
}

static td_status t_irecv(void *t, void *buf, size_t cap, int peer, uint32_t tag, void **req) {
    return td__ucx_msg_start(t, 1, buf, cap, peer, tag, 1, req);
}

static td_status t_test(void *t, void *req, int *done, size_t *bytes) {
    return td__ucx_msg_test(t, req, done, bytes);
}

static void t_cancel(void *t, void *req) { td__ucx_msg_cancel(t, req); }

static void t_idle(void *t, uint64_t waited_ns) { td__ucx_idle(((td__ucx_group *)t)->w, waited_ns); }

static void t_describe(void *t, int peer, char *out, size_t cap) { td__ucx_describe(t, peer, out, cap); }

td_status td__ucx_notice_post(td__ucx_group *g) {
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL};
    pthread_mutex_lock(&g->w->lock);
    ucs_status_ptr_t r = ucp_tag_recv_nbx(g->w->worker, g->notice, sizeof g->notice,
                                          tag_of(g, 1, 0, TD__P2P_NOTICE_TAG), ~SOURCE_MASK, &p);
    pthread_mutex_unlock(&g->w->lock);
    if (UCS_PTR_IS_ERR(r))
        return td__fail(TD_EBACKEND, "ucx: cannot post a receive: %s",
                        ucs_status_string(UCS_PTR_STATUS(r)));
    g->notice_req = r;
    return TD_OK;
}

void td__ucx_notice_cancel(td__ucx_group *g) {
    if (!g->notice_req) return;
    td__ucx_world *w = g->w;
    pthread_mutex_lock(&w->lock);
    ucp_request_cancel(w->worker, g->notice_req);
    uint64_t until = td_time_ns() + 100000000u;
    while (ucp_request_check_status(g->notice_req) == UCS_INPROGRESS && td_time_ns() < until)
        ucp_worker_progress(w->worker);
    ucp_request_free(g->notice_req);
    pthread_mutex_unlock(&w->lock);
    g->notice_req = NULL;
}

/* Sends `why` to every other member that is not known to be gone, and gives the sends 50 ms:
 * the rank usually leaves right after, taking unsent messages with it. */
static void t_notify(void *t, const char *why) {
    td__ucx_group *g = t;
    td__ucx_world *w = g->w;
    size_t len = strlen(why) + 1 < TD__P2P_NOTICE_MAX ? strlen(why) + 1 : TD__P2P_NOTICE_MAX;
    void **reqs = calloc((size_t)g->size, sizeof *reqs);
    if (!reqs) return;
    pthread_mutex_lock(&w->lock);
    for (int r = 0; r < g->size; r++) {
        int pw = g->world[r];
        if (r == g->rank || atomic_load(&w->failed[pw])) continue;
        ucp_request_param_t p = {.op_attr_mask = 0};
        ucs_status_ptr_t q = ucp_tag_send_nbx(w->eps[pw], why, len, tag_of(g, 1, w->rank, TD__P2P_NOTICE_TAG), &p);
        reqs[r] = UCS_PTR_IS_PTR(q) ? q : NULL;
    }
    uint64_t until = td_time_ns() + 50000000u;
    for (int pending = 1; pending && td_time_ns() < until;) {
        ucp_worker_progress(w->worker);
        pending = 0;
        for (int r = 0; r < g->size; r++)
            if (reqs[r] && ucp_request_check_status(reqs[r]) == UCS_INPROGRESS) pending = 1;
    }
    for (int r = 0; r < g->size; r++)
        if (reqs[r]) ucp_request_free(reqs[r]);
    pthread_mutex_unlock(&w->lock);
    free(reqs);
}

static int t_noticed(void *t, char *why, size_t cap) {
    td__ucx_group *g = t;
    if (!g->noticed && g->notice_req) {
        pthread_mutex_lock(&g->w->lock);
        ucp_worker_progress(g->w->worker);
        ucs_status_t st = ucp_request_check_status(g->notice_req);
        if (st != UCS_INPROGRESS) {
            ucp_request_free(g->notice_req);
            g->notice_req = NULL;
            g->noticed = st == UCS_OK;
        }
        pthread_mutex_unlock(&g->w->lock);
    }
    if (!g->noticed) return 0;
    g->notice[sizeof g->notice - 1] = 0;
    snprintf(why, cap, "%s", g->notice);
    return 1;
}

const td__p2p_ops td__ucx_transport = {
    .isend = t_isend,
    .irecv = t_irecv,
    .test = t_test,
    .cancel = t_cancel,
    .idle = t_idle,
    .describe_peer = t_describe,
    .notify = t_notify,
    .noticed = t_noticed,
};
