/* The UCX backend: ranks on any hosts, bytes between them through UCX's tag API (chosen for
 * tandemrun --nnodes over Open MPI's dynamic processes: no daemons to start, a bootstrap of
 * one store entry per rank, and a failed peer reported by its endpoint within milliseconds;
 * docs/multihost.md has the measurements).
 *
 * Bootstrap: every rank makes a UCX context and worker, publishes its worker's address, pid,
 * host and node in the rendezvous store (hosted by rank 0, or by tandemrun --nnodes when
 * TANDEM_STORE_HOSTED=1), reads everyone else's, opens an endpoint to each (errors reported
 * per peer), and passes a barrier; then the store is closed. A store serves several worlds in
 * turn: a counter of arrivals numbers them. The world's UCX objects are shared by its splits;
 * groups tell their messages apart by an id in the tag (ucx_impl.h).
 *
 * Collectives are p2p_coll.c's over ucx_transport.c; point-to-point is here. It does not
 * choose UCX's transports (UCX_TLS, UCX_NET_DEVICES do) and does not launch processes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/store.h"

#include "comm/recorder.h"
#include "comm/ucx/ucx_impl.h"
#include "core/core_impl.h"

/* What a rank publishes at the rendezvous; its worker address follows. */
typedef struct {
    int32_t node, pid;
    uint32_t address_bytes;
    char host[64];
} ucx_record;

/* ---------------------------------------------------------------- the world's objects */

static void world_release(td__ucx_world *w) {
    if (!w || atomic_fetch_sub(&w->refs, 1) != 1) return;
    for (int r = 0; w->eps && r < w->size; r++) {
        if (!w->eps[r]) continue;
        ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                 .flags = UCP_EP_CLOSE_FLAG_FORCE};
        ucs_status_ptr_t req = ucp_ep_close_nbx(w->eps[r], &p);
        /* A forced close does not wait for the peer; still, never hang on one that is gone. */
        uint64_t until = td_time_ns() + 1000000000u;
        while (UCS_PTR_IS_PTR(req) && ucp_request_check_status(req) == UCS_INPROGRESS &&
               td_time_ns() < until)
            ucp_worker_progress(w->worker);
        if (UCS_PTR_IS_PTR(req)) ucp_request_free(req);
    }
    if (w->worker) ucp_worker_destroy(w->worker);
    if (w->context) ucp_cleanup(w->context);
    pthread_mutex_destroy(&w->lock);
    free(w->eps);
    free((void *)w->failed);
    free(w->hosts);
    free(w->keys);
    free(w->peers);
    free(w);
}

static td_status ucx_error(ucs_status_t st, const char *call) {
    return td__fail(TD_EBACKEND, "ucx: %s failed: %s", call, ucs_status_string(st));
}

static td_status world_new(int rank, int size, td__ucx_world **out) {
    td__ucx_world *w = calloc(1, sizeof *w);
    if (!w) return td__fail(TD_ENOMEM, "ucx: out of memory");
    w->refs = 1;
    w->rank = rank;
    w->size = size;
    w->efd = -1;
    w->next_group = 1; /* the world is group 0 */
    pthread_mutex_init(&w->lock, NULL);
    w->eps = calloc((size_t)size, sizeof *w->eps);
    w->failed = calloc((size_t)size, sizeof *w->failed);
    w->hosts = calloc((size_t)size, sizeof *w->hosts);
    w->keys = calloc((size_t)size, sizeof *w->keys);
    w->peers = malloc((size_t)size * sizeof *w->peers);
    if (!w->eps || !w->failed || !w->hosts || !w->keys || !w->peers) {
        world_release(w);
        return td__fail(TD_ENOMEM, "ucx: out of memory for %d ranks", size);
    }
    for (int r = 0; r < size; r++) w->peers[r] = (struct td__ucx_peer){w, r};
    ucp_config_t *config = NULL;
    ucs_status_t st = ucp_config_read(NULL, NULL, &config);
    ucp_params_t cp = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                       .features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP,
                       .mt_workers_shared = 0};
    if (st == UCS_OK) {
        st = ucp_init(&cp, config, &w->context);
        ucp_config_release(config);
    }
    if (st != UCS_OK) {
        world_release(w);
        return ucx_error(st, "ucp_init");
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE |
                                            UCP_WORKER_PARAM_FIELD_EVENTS,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED,
                              .events = UCP_WAKEUP_TAG_SEND | UCP_WAKEUP_TAG_RECV |
                                        UCP_WAKEUP_RX | UCP_WAKEUP_TX};
    st = ucp_worker_create(w->context, &wp, &w->worker);
    if (st == UCS_OK) st = ucp_worker_get_efd(w->worker, &w->efd);
    if (st != UCS_OK) {
        world_release(w);
        return ucx_error(st, "ucp_worker_create");
    }
    *out = w;
    return TD_OK;
}

/* Runs inside ucp_worker_progress (under the world's lock): remember why the peer is gone, so
 * that every wait for it ends (ucx_transport.c). */
static void on_peer_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    struct td__ucx_peer *peer = arg;
    atomic_store(&peer->w->failed[peer->rank], (int)status);
}

/* ---------------------------------------------------------------- groups */

static void group_free(td__ucx_group *g) {
    if (!g) return;
    td__ucx_notice_cancel(g);
    td__p2p_free(&g->p2p);
    free(g->world);
    world_release(g->w);
    free(g);
}

/* A group of `n` world ranks `members` (this one among them) with id `id`; its shape: ranks on
 * this host by the world's host keys. */
static td_status group_new(td__ucx_world *w, uint32_t id, const int *members, int n,
                           td__ucx_group **out, td__group_shape *shape) {
    td__ucx_group *g = calloc(1, sizeof *g);
    int *world = malloc((size_t)n * sizeof *world);
    if (!g || !world) {
        free(g);
        free(world);
        return td__fail(TD_ENOMEM, "ucx: out of memory for a group");
    }
    memcpy(world, members, (size_t)n * sizeof *world);
    g->w = w;
    atomic_fetch_add(&w->refs, 1);
    g->id = id;
    g->size = n;
    g->world = world;
    g->rank = -1;
    for (int i = 0; i < n; i++)
        if (members[i] == w->rank) g->rank = i;
    /* Hosts in the order of their lowest rank; a rank's local rank counts its host's below it. */
    *shape = (td__group_shape){.rank = g->rank, .size = n};
    const char *mine = w->keys[w->rank];
    int found = 0;
    for (int i = 0; i < n; i++) {
        const char *h = w->keys[members[i]];
        int first = 1, here = strcmp(h, mine) == 0;
        for (int j = 0; j < i && first; j++) first = strcmp(w->keys[members[j]], h) != 0;
        if (first) {
            if (here) found = 1;
            if (!found) shape->node++; /* a host first seen before mine */
            shape->nodes++;
        }
        if (here) {
            if (i < g->rank) shape->local_rank++;
            shape->local_size++;
        }
    }
    td_status s = td__p2p_init(&g->p2p, &td__ucx_transport, g, g->rank, n, TD__P2P_TAG_BITS, 0);
    if (!s) s = td__ucx_notice_post(g);
    if (s) {
        group_free(g);
        return s;
    }
    *out = g;
    return TD_OK;
}

/* ---------------------------------------------------------------- point-to-point */

/* A user message: what a receive must bring. */
typedef struct {
    void *msg;
    int recv, peer, tag;
    size_t bytes;
} ucx_p2p;

static td_status p2p_start(td__ucx_group *g, void *buf, size_t bytes, int peer, int tag, int recv,
                           void **req) {
    const char *what = recv ? "irecv" : "isend";
    if (peer < 0 || peer >= g->size || peer == g->rank)
        return td__fail(TD_EINVAL, "ucx %s: peer rank %d is not another rank of this group of %d",
                        what, peer, g->size);
    if (tag < 0) return td__fail(TD_EINVAL, "ucx %s: tag %d is negative", what, tag);
    ucx_p2p *p = malloc(sizeof *p);
    if (!p) return td__fail(TD_ENOMEM, "ucx %s: out of memory", what);
    *p = (ucx_p2p){.recv = recv, .peer = peer, .tag = tag, .bytes = bytes};
    td_status s = td__ucx_msg_start(g, 0, buf, bytes, peer, (uint32_t)tag, recv, &p->msg);
    if (s) {
        free(p);
        return s;
    }
    *req = p;
    return TD_OK;
}

static td_status ucx_isend(void *ctx, const void *buf, size_t bytes, int dst, int tag, void **req) {
    return p2p_start(ctx, (void *)buf, bytes, dst, tag, 0, req);
}

static td_status ucx_irecv(void *ctx, void *buf, size_t bytes, int src, int tag, void **req) {
    return p2p_start(ctx, buf, bytes, src, tag, 1, req);
}

/* One look at a user message; frees it when done. */
static td_status p2p_check(td__ucx_group *g, ucx_p2p *p, int *done) {
    size_t got = 0;
    td_status s = td__ucx_msg_test(g, p->msg, done, &got);
    if (!*done) return s;
    if (s == TD_OK && p->recv && got != p->bytes)
        s = td__fail(TD_EMISMATCH,
                     "rank %d received %zu bytes from rank %d with tag %d, expected %zu (sender "
                     "and receiver disagree on count or dtype)",
                     g->rank, got, p->peer, p->tag, p->bytes);
    else if (s != TD_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", td_last_error());
        s = td__fail(s, "%s with rank %d, tag %d: %s", p->recv ? "recv" : "send", p->peer, p->tag,
                     why);
    }
    free(p);
    return s;
}

static td_status ucx_p2p_wait(void *ctx, void *req, double timeout_s) {
    td__ucx_group *g = ctx;
    ucx_p2p *p = req;
    uint64_t start = td_time_ns(), limit = (uint64_t)(timeout_s * 1e9);
    for (;;) {
        int done = 0;
        int recv = p->recv, peer = p->peer, tag = p->tag;
        td_status s = p2p_check(g, p, &done);
        if (done) return s;
        uint64_t waited = td_time_ns() - start;
        if (waited > limit) {
            td__ucx_msg_cancel(g, p->msg);
            free(p);
            char who[96], me[96];
            td__ucx_describe(g, peer, who, sizeof who);
            td__ucx_describe(g, g->rank, me, sizeof me);
            return td__fail(TD_ETIMEOUT, "%s with %s, tag %d, on %s timed out after %.3g s",
                            recv ? "recv" : "send", who, tag, me, timeout_s);
        }
        if (waited > 100000) td__rec_waits(start + waited, peer);
        td__ucx_idle(g->w, waited);
    }
}

static td_status ucx_p2p_test(void *ctx, void *req, int *done) { return p2p_check(ctx, req, done); }

/* ---------------------------------------------------------------- collectives and splits */

static td_status ucx_collective(void *ctx, const td__coll *c, double timeout_s) {
    return td__p2p_collective(&((td__ucx_group *)ctx)->p2p, c, timeout_s);
}

static td_status ucx_split(void *ctx, int color, int key, double timeout_s, void **child,
                           td__group_shape *shape, int *child_members) {
    td__ucx_group *g = ctx;
    td__ucx_world *w = g->w;
    *child = NULL;
    int32_t mine[3] = {color < 0 ? -1 : color, key, (int32_t)w->next_group};
    int32_t *all = malloc((size_t)g->size * sizeof mine);
    int *members = malloc((size_t)g->size * sizeof *members);
    if (!all || !members) {
        free(all);
        free(members);
        return td__fail(TD_ENOMEM, "ucx split: out of memory");
    }
    td_status s = td__p2p_exchange(&g->p2p, mine, all, sizeof mine, timeout_s);
    /* Members ordered by (key, old rank), as MPI_Comm_split orders them; the new group's id is
     * one that none of its members uses yet. */
    int m = 0;
    uint32_t id = 0;
    for (int r = 0; s == TD_OK && mine[0] >= 0 && r < g->size; r++) {
        if (all[3 * r] != mine[0]) continue;
        int i = m++;
        while (i > 0 && all[3 * members[i - 1] + 1] > all[3 * r + 1]) {
            members[i] = members[i - 1];
            i--;
        }
        members[i] = r;
        if ((uint32_t)all[3 * r + 2] > id) id = (uint32_t)all[3 * r + 2];
    }
    if (s == TD_OK && m > 0 && id >= (1u << TD__UCX_GROUP_BITS))
        s = td__fail(TD_EUNSUPPORTED, "ucx split: more than %d groups in one world",
                     (1 << TD__UCX_GROUP_BITS) - 1);
    if (s == TD_OK && m > 0) {
        memcpy(child_members, members, (size_t)m * sizeof *members);
        for (int i = 0; i < m; i++) members[i] = g->world[members[i]];
        w->next_group = id + 1 > w->next_group ? id + 1 : w->next_group;
        td__ucx_group *k = NULL;
        s = group_new(w, id, members, m, &k, shape);
        if (s == TD_OK) *child = k;
    }
    free(all);
    free(members);
    return s;
}

static void ucx_destroy(void *ctx) { group_free(ctx); }

static void ucx_set_names(void *ctx, const td__names *names) {
    ((td__ucx_group *)ctx)->names = names;
}

static const td__backend_ops ucx_ops = {
    .name = "ucx",
    .collective = ucx_collective,
    .isend = ucx_isend,
    .irecv = ucx_irecv,
    .p2p_wait = ucx_p2p_wait,
    .p2p_test = ucx_p2p_test,
    .split = ucx_split,
    .set_names = ucx_set_names,
    .destroy = ucx_destroy,
};

/* ---------------------------------------------------------------- bootstrap */

/* Publishes this rank's record and reads everyone's; opens the endpoints. The store stays
 * open (*out) until every rank has read it: rank 0 may be the one hosting it. */
static td_status rendezvous(td__ucx_world *w, const td_comm_params *p, td_store **out) {
    td_store_params sp = td_store_default_params();
    sp.host = p->master_addr;
    sp.port = p->master_port;
    sp.is_server = w->rank == 0 && !p->store_hosted;
    sp.token = p->token;
    sp.timeout_s = p->timeout_s;
    td_store *store = NULL;
    td_status s = td_store_create(&store, &sp);
    if (s) {
        char why[512];
        snprintf(why, sizeof why, "%s", td_last_error());
        return td__fail(s, "ucx: rank %d cannot %s the rendezvous store at %s:%d: %s", w->rank,
                        sp.is_server ? "host" : "reach", p->master_addr, p->master_port, why);
    }
    ucp_address_t *address = NULL;
    size_t address_bytes = 0;
    pthread_mutex_lock(&w->lock);
    ucs_status_t st = ucp_worker_get_address(w->worker, &address, &address_bytes);
    pthread_mutex_unlock(&w->lock);
    size_t cap = sizeof(ucx_record) + 4096;
    ucx_record *rec = calloc(1, cap);
    if (st != UCS_OK || !rec || address_bytes > 4096) {
        td_store_destroy(store);
        free(rec);
        if (st == UCS_OK) ucp_worker_release_address(w->worker, address);
        return st != UCS_OK ? ucx_error(st, "ucp_worker_get_address")
                            : td__fail(TD_ENOMEM, "ucx: out of memory for the rendezvous");
    }
    rec->node = p->node_rank;
    rec->pid = (int32_t)getpid();
    rec->address_bytes = (uint32_t)address_bytes;
    gethostname(rec->host, sizeof rec->host - 1);
    memcpy(rec + 1, address, address_bytes);
    ucp_worker_release_address(w->worker, address);
    int64_t arrival = 0;
    char key[96];
    s = td_store_add(store, "tandem/ucx/arrivals", 1, &arrival);
    long world_no = (long)((arrival - 1) / w->size);
    snprintf(key, sizeof key, "tandem/ucx/%ld/%d", world_no, w->rank);
    if (!s) s = td_store_set(store, key, rec, sizeof *rec + address_bytes);
    for (int r = 0; s == TD_OK && r < w->size; r++) {
        size_t len = 0;
        snprintf(key, sizeof key, "tandem/ucx/%ld/%d", world_no, r);
        s = td_store_get(store, key, rec, cap, &len);
        if (s == TD_ETIMEOUT)
            s = td__fail(TD_ETIMEOUT,
                         "ucx: rank %d waited %.3g s for rank %d at the rendezvous (%s:%d): did "
                         "it start, with the same MASTER_ADDR, MASTER_PORT and TANDEM_TOKEN?",
                         w->rank, p->timeout_s, r, p->master_addr, p->master_port);
        else if (s) /* the store's host gave up first (often on the same missing rank) */
            s = td__fail(s, "ucx: rank %d lost the rendezvous store (%s:%d) while waiting for "
                            "rank %d: %s", w->rank, p->master_addr, p->master_port, r,
                         td_last_error());
        if (s) break;
        if (len < sizeof *rec || len != sizeof *rec + rec->address_bytes) {
            s = td__fail(TD_EBACKEND, "ucx: rank %d's rendezvous record is malformed", r);
            break;
        }
        memcpy(w->hosts[r], rec->host, sizeof w->hosts[r]);
        w->hosts[r][sizeof w->hosts[r] - 1] = 0;
        /* The launcher's word for the host counts, where it gave one (NODE_RANK). */
        if (rec->node >= 0)
            snprintf(w->keys[r], sizeof w->keys[r], "#%d", (int)rec->node);
        else
            memcpy(w->keys[r], w->hosts[r], sizeof w->keys[r]);
        if (r == w->rank) continue;
        ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                            UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                            UCP_EP_PARAM_FIELD_ERR_HANDLER,
                              .address = (const ucp_address_t *)(rec + 1),
                              .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                              .err_handler = {.cb = on_peer_error, .arg = &w->peers[r]}};
        pthread_mutex_lock(&w->lock);
        st = ucp_ep_create(w->worker, &ep, &w->eps[r]);
        pthread_mutex_unlock(&w->lock);
        if (st != UCS_OK) s = ucx_error(st, "ucp_ep_create");
    }
    free(rec);
    if (s) {
        td_store_destroy(store);
        return s;
    }
    *out = store;
    return TD_OK;
}

td_status td__ucx_create(const td_comm_params *p, void **ctx, td__group_shape *shape,
                         const td__backend_ops **ops) {
    int n = p->world_size, rank = p->rank;
    if (n < 1 || rank < 0 || rank >= n || n > (1 << TD__UCX_RANK_BITS))
        return td__fail(TD_EINVAL, "ucx: rank %d / world_size %d out of range", rank, n);
    td__ucx_world *w = NULL;
    TD__TRY(world_new(rank, n, &w));
    td_status s = TD_OK;
    td_store *store = NULL;
    if (n > 1) {
        s = rendezvous(w, p, &store);
    } else {
        gethostname(w->hosts[0], sizeof w->hosts[0] - 1);
        memcpy(w->keys[0], w->hosts[0], sizeof w->keys[0]);
    }
    int *members = malloc((size_t)n * sizeof *members);
    td__ucx_group *g = NULL;
    for (int r = 0; members && r < n; r++) members[r] = r;
    if (s == TD_OK) s = members ? group_new(w, 0, members, n, &g, shape) : td__fail(TD_ENOMEM, "ucx: out of memory");
    free(members);
    world_release(w); /* the group holds it now, or nobody does */
    /* Every endpoint answers before anyone relies on it; once through, every rank has also
     * read the store, so it can go. */
    td__coll barrier = {.kind = TD__COLL_BARRIER, .error_rank = rank};
    if (s == TD_OK) s = td__p2p_collective(&g->p2p, &barrier, p->timeout_s);
    td_store_destroy(store);
    if (s) {
        group_free(g);
        return s;
    }
    *ctx = g;
    *ops = &ucx_ops;
    return TD_OK;
}
