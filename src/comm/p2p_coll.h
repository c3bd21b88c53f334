/* Private to the backends whose transport moves bytes between pairs of ranks (mpi, ucx): the
 * point-to-point operations a transport gives, and the collectives built from them in
 * p2p_coll.c, as NCCL and Gloo build theirs from a transport's sends and receives.
 *
 * Every collective opens with an agreement: every rank's call header (kind, seq, dtype, count,
 * op, root, rejected arguments) reaches every rank in ceil(log2 n) rounds of messages (Bruck's
 * dissemination allgather; the first round goes to the next rank), so that all ranks take the
 * same decision on mismatched calls and rejected arguments. Small collectives ride inside the
 * agreement (each rank's header carries its data, and everyone reduces or picks locally): one
 * round trip between two ranks, with the check for free. Large ones follow with ring
 * reduce-scatter and all-gather, a pipelined chain broadcast, or direct sends.
 *
 * The messages of collectives travel on a channel of their own (tags 0 .. 2^30-1 there), never
 * matched by the user's point-to-point messages. A rank that gives up on a collective (a peer
 * failed, a wait timed out, the calls differ) sends a notice to every other member, and every
 * wait watches for one: all ranks then fail naming the first cause, not the rank that left
 * after seeing it. A rank that gives up on hearing a notice passes it on before it leaves, so
 * that a member that sees it leave before the first notice arrives still names the cause.
 * Not installed. */
#ifndef TANDEM_P2P_COLL_H
#define TANDEM_P2P_COLL_H

#include "comm/comm_impl.h"

/* Tags on the collectives' channel are below 2^TD__P2P_TAG_BITS (or the fewer bits a
 * transport gives, at least 15). Tag 0 is never a collective's: transports carry failure
 * notices on it. */
#define TD__P2P_TAG_BITS 30
#define TD__P2P_NOTICE_TAG 0
/* Longest failure notice, in bytes. */
#define TD__P2P_NOTICE_MAX 512

/* Internal kinds in call headers, beside the td__coll_kind values. */
#define TD__P2P_KIND_SPLIT 100

/* What a transport provides, on one group whose ranks are 0 .. size-1. */
typedef struct {
    /* Starts sending `bytes` (<= 2^30) to `peer` on the collectives' channel with `tag`. */
    td_status (*isend)(void *t, const void *buf, size_t bytes, int peer, uint32_t tag, void **req);
    /* Starts receiving at most `cap` bytes (<= 2^30) from `peer` with `tag`. */
    td_status (*irecv)(void *t, void *buf, size_t cap, int peer, uint32_t tag, void **req);
    /* Progresses and checks `req`; when *done, it is freed and *bytes holds a receive's length.
     * A message longer than its receive is TD_EMISMATCH; a peer known to be gone TD_EPEER. */
    td_status (*test)(void *t, void *req, int *done, size_t *bytes);
    /* Gives up on a request that is not done (a receive is cancelled) and frees it. */
    void (*cancel)(void *t, void *req);
    /* Nothing completed for `waited_ns`: let other work run (yield, or sleep until the
     * transport has events), briefly. */
    void (*idle)(void *t, uint64_t waited_ns);
    /* "rank 3 (host tdhost1)": a member, as messages name it. */
    void (*describe_peer)(void *t, int peer, char *out, size_t cap);
    /* Failure notices: `notify` tells every other member why this rank gives up on the group
     * (best effort, bounded); `noticed` returns 1 and the text once such a notice arrived. */
    void (*notify)(void *t, const char *why);
    int (*noticed)(void *t, char *why, size_t cap);
} td__p2p_ops;

/* The collectives' state of one group. */
typedef struct {
    const td__p2p_ops *ops;
    void *t;
    int rank, size;
    int tag_bits;       /* tags are below 2^tag_bits */
    size_t eager;       /* the transport sends messages up to this size at once (0: any) */
    uint32_t op;        /* collectives started, so successive ones never share a tag */
    int broken;         /* a collective failed mid-flight: its messages may still arrive */
    unsigned char *agree; /* the agreement's blocks (n headers + the small payloads) */
    size_t agree_cap;
    void *scratch; /* the large algorithms' working memory */
    size_t scratch_cap;
} td__p2p;

/* Sets up `g` for a group of `size` ranks whose transport takes tags below 2^tag_bits and
 * sends messages of up to `eager` bytes without a handshake (0: no such limit): small payloads
 * go in pieces that size rather than wait for one. TD_ENOMEM when its buffers cannot be had. */
td_status td__p2p_init(td__p2p *g, const td__p2p_ops *ops, void *t, int rank, int size,
                       int tag_bits, size_t eager);

/* Frees what td__p2p_init and the collectives allocated. */
void td__p2p_free(td__p2p *g);

/* Runs one collective (see comm_impl.h for the error contract). */
td_status td__p2p_collective(td__p2p *g, const td__coll *c, double timeout_s);

/* Every rank's `bytes` of `mine` into all[rank * bytes] once every rank is known to make the
 * same internal call (kind TD__P2P_KIND_SPLIT; `bytes` <= 64 KiB): a split's rendezvous. */
td_status td__p2p_exchange(td__p2p *g, const void *mine, void *all, size_t bytes, double timeout_s);

#endif
