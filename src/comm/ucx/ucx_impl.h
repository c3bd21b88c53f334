/* Private to the UCX backend: one world's UCX state, a group's context, and what its two files
 * share (ucx_backend.c: bootstrap through the store, groups, splits, the backend table;
 * ucx_transport.c: tagged messages, their progress, peer failure, waiting). Compiled only
 * when the build found UCX's headers (TD_HAVE_UCX). */
#ifndef TANDEM_UCX_IMPL_H
#define TANDEM_UCX_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <ucp/api/ucp.h>

#include "comm/comm_impl.h"
#include "comm/p2p_coll.h"

/* A tag is [collective: 1][group id: 12][source world rank: 20][tag: 31]. */
#define TD__UCX_GROUP_BITS 12
#define TD__UCX_RANK_BITS 20

/* One world's UCX objects in this process, shared by the world group and its splits: the
 * worker every message goes through, serialised by `lock`, and an endpoint per world rank. */
typedef struct td__ucx_world {
    _Atomic int refs;
    ucp_context_h context;
    ucp_worker_h worker;
    int efd; /* the worker's wake-up descriptor, to sleep in idle waits */
    pthread_mutex_t lock;
    int rank, size;          /* in the world */
    ucp_ep_h *eps;           /* (size) NULL for this rank */
    _Atomic int *failed;     /* (size) the ucs_status_t of a peer whose endpoint failed, or 0 */
    char (*hosts)[64];       /* (size) each world rank's host name, for messages */
    char (*keys)[64];        /* (size) what tells hosts apart: "#<node rank>" or the name */
    struct td__ucx_peer {
        struct td__ucx_world *w;
        int rank;
    } *peers; /* (size) the endpoints' error handlers' arguments */
    uint32_t next_group;     /* the lowest group id this process has not used */
} td__ucx_world;

/* One group: members are world ranks; its messages carry its id. */
typedef struct {
    td__ucx_world *w;
    uint32_t id;
    int rank, size;
    int *world; /* (size) each member's world rank */
    const td__names *names; /* how messages name the members (NULL: by world rank) */
    td__p2p p2p;
    void *notice_req;                   /* the receive of a failure notice from any member */
    char notice[TD__P2P_NOTICE_MAX];    /* its text */
    int noticed;
} td__ucx_group;

/* Posts the group's receive of failure notices; td__ucx_notice_cancel takes it back. */
td_status td__ucx_notice_post(td__ucx_group *g);
void td__ucx_notice_cancel(td__ucx_group *g);

/* Starts a send or receive of `bytes` with group rank `peer`: on the collectives' channel
 * (coll) or the user's; *msg is completed by td__ucx_msg_test / td__ucx_msg_cancel. */
td_status td__ucx_msg_start(td__ucx_group *g, int coll, void *buf, size_t bytes, int peer,
                            uint32_t tag, int recv, void **msg);

/* Progresses the worker and checks `msg`; when *done it is freed and *bytes is a receive's
 * length. TD_EPEER when the peer's endpoint failed (the message is then cancelled). */
td_status td__ucx_msg_test(td__ucx_group *g, void *msg, int *done, size_t *bytes);

/* Abandons an unfinished message (a receive is cancelled) and frees it. */
void td__ucx_msg_cancel(td__ucx_group *g, void *msg);

/* A wait made no progress for waited_ns: spin a little longer, then sleep until the worker
 * has events (at most 1 ms), so that more ranks than cores still run. */
void td__ucx_idle(td__ucx_world *w, uint64_t waited_ns);

/* "rank 3 on tdhost1", "world rank 3 on tdhost1 (rank 1 of group {1,3})" (td__who_on). */
void td__ucx_describe(const td__ucx_group *g, int rank, char *out, size_t cap);

/* The transport the collectives run on. */
extern const td__p2p_ops td__ucx_transport;

#endif
