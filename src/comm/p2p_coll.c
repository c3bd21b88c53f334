/* Collectives from point-to-point messages (see p2p_coll.h): the agreement that opens every
 * collective, the small collectives that ride inside it, and the large algorithms (ring
 * reduce-scatter and all-gather, chained broadcast, direct gather, scatter and all-to-all).
 * It knows nothing of MPI or UCX: every byte goes through the transport's table.
 *
 * Reductions inside the agreement fold every rank's data in rank order (td__reduce), so
 * every rank gets the same bits as one process would. In a ring each hop adds its own
 * contribution to the partial sum it received: bf16 and f16 partials are rounded once per hop
 * (as NCCL's are); u8 and i32 averages run in i64 so that no partial sum wraps. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/p2p_coll.h"
#include "comm/recorder.h"
#include "core/core_impl.h"

enum {
    HDR = 256,                /* bytes of a call header in the agreement */
    WHY = 192,                /* of which the reason for rejected arguments */
    SMALL = 128 << 10,        /* all ranks' data together up to this: ride in the agreement */
    SMALL_PAIR = 2 << 20,     /* the same for two ranks, where a ring moves no fewer bytes */
    EXCHANGE_MAX = 1024,      /* bytes per rank td__p2p_exchange may carry */
    SEG = 512 << 10,        /* bytes per message of the large algorithms */
    SLICE = 8 << 20,          /* a ring works on at most this many bytes of each chunk at once */
    SUB_BITS = 12,            /* low tag bits: the message's place in its collective */
    SUB_DATA = 64,            /* first sub-tag after the agreement's rounds */
    SPIN_NS = 20000,          /* polls before the transport's idle is asked to let others run */
};

/* A call header as it travels. */
typedef struct {
    int64_t kind, seq, dtype, count, op, root; /* -1 where the kind has none */
    int32_t error, error_rank;
    uint64_t payload; /* bytes of data following this header in its block */
    char why[WHY];
} hdr;
_Static_assert(sizeof(hdr) == HDR, "call header size");

static size_t align64(size_t x) { return (x + 63) & ~(size_t)63; }

/* The tag of message `sub` of the current collective: never 0 (notices), repeating after
 * 2^(tag_bits - 12) - 1 collectives, long after any message of a finished one was taken. */
static uint32_t tag_of(const td__p2p *g, unsigned sub) {
    uint32_t op = 1 + g->op % ((1u << (g->tag_bits - SUB_BITS)) - 1);
    return (op << SUB_BITS) | (sub < (1u << SUB_BITS) ? sub : (1u << SUB_BITS) - 1);
}

/* What all ranks' data together may weigh to ride in the agreement: where that moves more
 * bytes than the large algorithms (an all-gather of everything, against a ring's 2(n-1)/n of
 * the buffer), only latency-bound sizes; between two ranks, where the bytes are the same and
 * the ring would take three round trips instead of one, much more. */
static size_t small_limit(const td__p2p *g) { return g->size == 2 ? SMALL_PAIR : SMALL; }

td_status td__p2p_init(td__p2p *g, const td__p2p_ops *ops, void *t, int rank, int size,
                       int tag_bits, size_t eager) {
    memset(g, 0, sizeof *g);
    if (tag_bits < 15)
        return td__fail(TD_EUNSUPPORTED, "p2p collectives: the transport's tags have %d bits, "
                                         "at least 15 are needed", tag_bits);
    g->tag_bits = tag_bits;
    g->eager = eager;
    g->ops = ops;
    g->t = t;
    g->rank = rank;
    g->size = size;
    /* Room for every header and the most data a call that rides in the agreement brings, so
     * that whatever another rank sends (even for another call) fits. */
    g->agree_cap = (size_t)size * (HDR + EXCHANGE_MAX + 64) + small_limit(g);
    g->agree = aligned_alloc(64, g->agree_cap);
    if (!g->agree) return td__fail(TD_ENOMEM, "p2p collectives: out of memory for %d ranks", size);
    return TD_OK;
}

void td__p2p_free(td__p2p *g) {
    /* After a failure in flight the transport may still write into these: keep them. */
    if (g->broken) return;
    free(g->agree);
    free(g->scratch);
}

static void *scratch(td__p2p *g, size_t bytes) {
    if (bytes <= g->scratch_cap) return g->scratch;
    void *p = aligned_alloc(64, align64(bytes));
    if (!p) return NULL;
    free(g->scratch);
    g->scratch = p;
    g->scratch_cap = align64(bytes);
    return p;
}

/* ---------------------------------------------------------------- waiting */

/* One request of a collective and what it should bring. */
typedef struct {
    void *req; /* NULL once done */
    int peer, recv;
    size_t want; /* a receive's exact length, or SIZE_MAX for any */
    size_t got;
} pend;

static void describe(const td__coll *c, char *out, size_t cap) {
    const td__coll *s = td__coll_sig(c);
    if (s->kind == (td__coll_kind)TD__P2P_KIND_SPLIT)
        snprintf(out, cap, "split");
    else
        td__coll_describe_call(out, cap, c);
}

/* Fails with the formatted message after telling every other member why (a notice), so that
 * they fail at once naming the cause rather than this rank when it leaves. */
static td_status give_up(td__p2p *g, td_status s, const char *fmt, ...) TD__PRINTF(3, 4);
static td_status give_up(td__p2p *g, td_status s, const char *fmt, ...) {
    char msg[TD__P2P_NOTICE_MAX - 16], notice[TD__P2P_NOTICE_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    g->broken = 1;
    snprintf(notice, sizeof notice, "%d|%s", (int)s, msg);
    g->ops->notify(g->t, notice);
    return td__fail(s, "%s", msg);
}

/* A notice from another member, if one came: its status (the failure it met), and its text
 * in `why`; TD_OK when none came. */
static td_status notice(td__p2p *g, char *why, size_t cap) {
    char text[TD__P2P_NOTICE_MAX];
    if (!g->ops->noticed(g->t, text, sizeof text)) return TD_OK;
    const char *bar = strchr(text, '|');
    td_status s = (td_status)atoi(text);
    snprintf(why, cap, "%s", bar ? bar + 1 : text);
    return s == TD_OK || s == TD_EINVAL || s == TD_EDTYPE ? TD_EPEER : s;
}

/* Gives up on every request still pending; the group is unusable afterwards. */
static void abandon(td__p2p *g, pend *p, int n) {
    for (int i = 0; i < n; i++)
        if (p[i].req) {
            g->ops->cancel(g->t, p[i].req);
            p[i].req = NULL;
        }
    g->broken = 1;
}

/* Fails `c` with the cause a notice brought (`told`, `why`), after passing the notice on to
 * every other member: one that sees this rank leave before the first notice reaches it then
 * still learns the cause, not this rank's leaving. */
static td_status pass_on(td__p2p *g, const td__coll *c, pend *p, int n, td_status told,
                         const char *why) {
    char what[160], me[96], relay[TD__P2P_NOTICE_MAX];
    describe(c, what, sizeof what);
    g->ops->describe_peer(g->t, g->rank, me, sizeof me);
    abandon(g, p, n);
    snprintf(relay, sizeof relay, "%d|%s", (int)told, why);
    g->ops->notify(g->t, relay);
    return td__fail(told, "%s: %s gave up: %s", what, me, why);
}

/* A request of `c` could not be started or failed with `s` (td_last_error says why): every
 * request is abandoned. A peer that left told us why first: then the cause named is its
 * notice's, not its leaving; else it is `s`, and every other member is told. */
static td_status fail_call(td__p2p *g, const td__coll *c, pend *p, int n, td_status s) {
    char what[160], me[96], why[TD__P2P_NOTICE_MAX];
    snprintf(why, sizeof why, "%s", td_last_error());
    td_status told = s == TD_EPEER ? notice(g, why, sizeof why) : TD_OK;
    if (told) return pass_on(g, c, p, n, told, why);
    describe(c, what, sizeof what);
    g->ops->describe_peer(g->t, g->rank, me, sizeof me);
    abandon(g, p, n);
    return give_up(g, s, "%s: %s: %s", what, me, why);
}

/* Waits until request `k` is done (every one when k < 0), progressing all of them. The bound
 * is `timeout_s` without any request completing. */
static td_status wait_for(td__p2p *g, pend *p, int n, int k, const td__coll *c, double timeout_s) {
    uint64_t limit = (uint64_t)(timeout_s * 1e9), last = td_time_ns();
    for (;;) {
        int pending = 0, progressed = 0;
        for (int i = 0; i < n; i++) {
            if (!p[i].req) continue;
            int done = 0;
            size_t got = 0;
            td_status s = g->ops->test(g->t, p[i].req, &done, &got);
            if (s != TD_OK || done) p[i].req = NULL;
            if (s == TD_OK && done && p[i].recv && p[i].want != SIZE_MAX && got != p[i].want) {
                char peer[96];
                g->ops->describe_peer(g->t, p[i].peer, peer, sizeof peer);
                s = td__fail(TD_EMISMATCH,
                             "%s sent %zu bytes where %zu were expected: the ranks called "
                             "different collectives",
                             peer, got, p[i].want);
            }
            if (s != TD_OK) return fail_call(g, c, p, n, s);
            if (done) {
                p[i].got = got;
                progressed = 1;
            } else {
                pending++;
            }
        }
        if (k >= 0 ? !p[k].req : pending == 0) return TD_OK;
        uint64_t now = td_time_ns();
        if (progressed) last = now;
        if (now - last > limit) {
            int w = k >= 0 ? k : -1;
            for (int i = 0; i < n && w < 0; i++)
                if (p[i].req && p[i].recv) w = i;
            for (int i = 0; i < n && w < 0; i++)
                if (p[i].req) w = i;
            char what[160], me[96], peer[96];
            describe(c, what, sizeof what);
            g->ops->describe_peer(g->t, g->rank, me, sizeof me);
            g->ops->describe_peer(g->t, p[w].peer, peer, sizeof peer);
            int recv = p[w].recv;
            abandon(g, p, n);
            return give_up(g, TD_ETIMEOUT,
                           "%s: %s waited %.3g s for %s %s: it failed, is slow, its host is "
                           "unreachable, or it did not make the same call",
                           what, me, timeout_s,
                           recv ? "a message from" : "its message to be taken by", peer);
        }
        if (now - last > SPIN_NS) {
            int w = -1; /* whom the recorder says this rank waits for: a receive's peer first */
            for (int i = 0; i < n && w < 0; i++)
                if (p[i].req && p[i].recv) w = p[i].peer;
            td__rec_waits(now, w);
            char why[TD__P2P_NOTICE_MAX];
            td_status told = notice(g, why, sizeof why);
            if (told) return pass_on(g, c, p, n, told, why);
            g->ops->idle(g->t, now - last);
        }
    }
}

/* Starts a send or receive of `c` into p[*n] (one message of at most 2^30 bytes); one that
 * cannot start fails the call as a failed request does. */
static td_status post(td__p2p *g, const td__coll *c, pend *p, int *n, int recv, void *buf,
                      size_t bytes, int peer, unsigned sub, size_t want) {
    pend *q = &p[*n];
    *q = (pend){.peer = peer, .recv = recv, .want = want};
    td_status s = recv ? g->ops->irecv(g->t, buf, bytes, peer, tag_of(g, sub), &q->req)
                       : g->ops->isend(g->t, buf, bytes, peer, tag_of(g, sub), &q->req);
    if (s != TD_OK) {
        q->req = NULL;
        return fail_call(g, c, p, *n, s);
    }
    (*n)++;
    return TD_OK;
}

/* ---------------------------------------------------------------- the agreement */

static size_t small_payload(const td__p2p *g, const td__coll *c, int rank, int *fits);

/* This rank's header for `c` carrying `payload` bytes. */
static void header_of(const td__coll *c, size_t payload, hdr *h) {
    const td__coll *s = td__coll_sig(c);
    memset(h, 0, sizeof *h);
    h->kind = s->kind;
    h->seq = (int64_t)s->seq;
    h->dtype = h->count = h->op = h->root = -1;
    if (s->kind != TD__COLL_BARRIER) {
        h->dtype = s->dtype;
        h->count = (int64_t)s->count;
    }
    if (td__coll_is_reduction(s->kind)) h->op = s->op;
    if (td__coll_is_rooted(s->kind)) h->root = s->root;
    if ((int)s->kind == TD__P2P_KIND_SPLIT) h->seq = -1;
    h->error = c->error;
    h->error_rank = c->error_rank;
    if (c->error) snprintf(h->why, sizeof h->why, "%s", c->error_msg ? c->error_msg : "");
    h->payload = payload;
}

static void describe_hdr(const hdr *h, char *out, size_t cap) {
    if (h->kind == TD__P2P_KIND_SPLIT)
        snprintf(out, cap, "split");
    else
        td__coll_describe(out, cap, (td__coll_kind)h->kind, (uint64_t)h->seq, (td_dtype)h->dtype,
                          (size_t)h->count, (td_reduce_op)h->op, (int)h->root);
}

/* Payload messages of the agreement are cut into at most this many eager pieces. */
#define PIECES 4

/* How many pieces `bytes` of payload travel in: eager-sized ones while that takes at most
 * PIECES, else one (a transport's handshake costs less than many pieces then). */
static int pieces(const td__p2p *g, size_t bytes) {
    if (!bytes) return 0;
    if (!g->eager || bytes > PIECES * g->eager) return 1;
    return (int)((bytes + g->eager - 1) / g->eager);
}

/* Posts pieces [first, pieces) of `bytes` at buf (see pieces) as sends or receives. */
static td_status post_pieces(td__p2p *g, const td__coll *c, pend *p, int *np, int recv,
                             unsigned char *buf, size_t bytes, int first, int peer, unsigned sub) {
    int k = pieces(g, bytes);
    size_t per = k > 1 ? g->eager : bytes;
    for (int i = first; i < k; i++) {
        size_t at = (size_t)i * per, len = i == k - 1 ? bytes - at : per;
        TD__TRY(post(g, c, p, np, recv, buf + at, len, peer, sub, recv ? len : SIZE_MAX));
    }
    return TD_OK;
}

/* Bruck's dissemination all-gather of every rank's header and payload: afterwards blocks[r] is
 * rank r's header and data[r] its payload. Round i sends what this rank holds so far (blocks of
 * ranks me, me-1, ..., in that order) to rank me + 2^i and appends those of rank me - 2^i: the
 * headers in one message and the payloads in a second one (when there are any), so that a
 * header never pushes a small payload past a transport's eager limit. g->agree holds the
 * headers (n slots) and then the payloads, back to back in block order. */
static td_status disseminate(td__p2p *g, const td__coll *c, const hdr *mine, const void *payload,
                             const hdr **blocks, const unsigned char **data, double timeout_s) {
    int n = g->size, me = g->rank;
    size_t *off = malloc(((size_t)n + 1) * sizeof *off); /* payload offsets, per held block */
    if (!off) return td__fail(TD_ENOMEM, "p2p agreement: out of memory");
    unsigned char *heads = g->agree, *pay = g->agree + (size_t)n * HDR;
    size_t pay_cap = g->agree_cap - (size_t)n * HDR;
    memcpy(heads, mine, HDR);
    if (mine->payload) memcpy(pay, payload, mine->payload);
    off[0] = 0;
    off[1] = align64(mine->payload);
    int held = 1;
    td_status s = TD_OK;
    for (int dist = 1, round = 0; s == TD_OK && dist < n; dist <<= 1, round++) {
        int k = dist < n - dist ? dist : n - dist;
        int to = (me + dist) % n, from = (me - dist + n) % n, fits = 1;
        /* What this call expects to come with those k blocks; the headers say for sure. */
        size_t expect = 0;
        for (int j = 0; !c->error && j < k; j++)
            expect += align64(small_payload(g, c, ((me - held - j) % n + n) % n, &fits));
        if (!fits) expect = 0;
        pend p[2 + 2 * PIECES];
        int np = 0, first = -1; /* p[first]: the first payload piece, posted before its header
                                   arrives when this call expects one (any length) */
        unsigned sub = 2 * (unsigned)round;
        s = post(g, c, p, &np, 1, heads + (size_t)held * HDR, (size_t)k * HDR, from, sub,
                 (size_t)k * HDR);
        if (s == TD_OK && expect) {
            first = np;
            s = post(g, c, p, &np, 1, pay + off[held], pay_cap - off[held], from, sub + 1, SIZE_MAX);
        }
        if (s == TD_OK) s = post(g, c, p, &np, 0, heads, (size_t)k * HDR, to, sub, SIZE_MAX);
        if (s == TD_OK) s = post_pieces(g, c, p, &np, 0, pay, off[k], 0, to, sub + 1);
        if (s == TD_OK) s = wait_for(g, p, np, 0, c, timeout_s);
        size_t in = 0;
        for (int j = 0; s == TD_OK && j < k; j++) {
            const hdr *h = (const hdr *)(heads + (size_t)(held + j) * HDR);
            if (h->payload > pay_cap || in + align64(h->payload) > pay_cap - off[held]) {
                char peer[96], what[160];
                g->ops->describe_peer(g->t, from, peer, sizeof peer);
                describe(c, what, sizeof what);
                abandon(g, p, np);
                s = give_up(g, TD_EMISMATCH,
                            "%s: %s announced %llu bytes, more than this call can take: the "
                            "ranks called different collectives",
                            what, peer, (unsigned long long)h->payload);
                break;
            }
            in += align64(h->payload);
            off[held + j + 1] = off[held] + in;
        }
        /* The headers say what comes: no payload (then nothing can match the early receive),
         * or pieces, the first of which the early receive takes. */
        if (s == TD_OK && first >= 0 && !in) {
            g->ops->cancel(g->t, p[first].req);
            p[first].req = NULL;
            first = -1;
        } else if (s == TD_OK) {
            s = post_pieces(g, c, p, &np, 1, pay + off[held], in, first >= 0, from, sub + 1);
        }
        if (s == TD_OK) s = wait_for(g, p, np, -1, c, timeout_s);
        if (s == TD_OK && first >= 0) {
            int kin = pieces(g, in);
            size_t len = kin > 1 ? g->eager : in;
            if (p[first].got != len)
                s = give_up(g, TD_EMISMATCH,
                            "p2p agreement: a %zu-byte payload piece arrived where the headers "
                            "announced %zu: the ranks called different collectives",
                            p[first].got, len);
        }
        held += k;
    }
    for (int r = 0; s == TD_OK && r < n; r++) {
        int j = (me - r + n) % n;
        blocks[r] = (const hdr *)(heads + (size_t)j * HDR);
        data[r] = pay + off[j];
    }
    free(off);
    return s;
}

/* The same decision on every rank: the rejected arguments of the lowest rank that has some,
 * else a mismatch against rank 0's call, else TD_OK. */
static td_status decide(td__p2p *g, const hdr *const *blocks) {
    int n = g->size, bad = -1;
    for (int r = 0; r < n; r++)
        if (blocks[r]->error && (bad < 0 || blocks[r]->error_rank < blocks[bad]->error_rank))
            bad = r;
    if (bad >= 0) {
        char what[160], why[WHY + 1];
        describe_hdr(blocks[bad], what, sizeof what);
        memcpy(why, blocks[bad]->why, WHY);
        why[WHY] = 0;
        return td__fail((td_status)blocks[bad]->error, "rank %d: %s: %s",
                        (int)blocks[bad]->error_rank, what, why);
    }
    const hdr *a = blocks[0];
    for (int r = 1; r < n; r++) {
        const hdr *b = blocks[r];
        if (a->kind == b->kind && a->seq == b->seq && a->dtype == b->dtype &&
            a->count == b->count && a->op == b->op && a->root == b->root)
            continue;
        char da[160], db[160], pa[96], pb[96];
        describe_hdr(a, da, sizeof da);
        describe_hdr(b, db, sizeof db);
        g->ops->describe_peer(g->t, 0, pa, sizeof pa);
        g->ops->describe_peer(g->t, r, pb, sizeof pb);
        g->broken = 1;
        return td__fail(TD_EMISMATCH, "ranks called different collectives: %s called %s but %s called %s",
                        pa, da, pb, db);
    }
    return TD_OK;
}

/* ---------------------------------------------------------------- small collectives */

/* Bytes `rank` carries inside the agreement when `c` rides in it; *fits = 0 when all ranks'
 * data together is too much to ride. */
static size_t small_payload(const td__p2p *g, const td__coll *c, int rank, int *fits) {
    size_t n = (size_t)g->size, e = td_dtype_size(c->dtype), b = c->count * e, total = 0, mine;
    int root = rank == c->root;
    *fits = 1;
    if (c->kind == TD__COLL_BARRIER || c->count == 0) return 0;
    if (b > small_limit(g)) {
        *fits = 0;
        return 0;
    }
    switch (c->kind) {
    case TD__COLL_BROADCAST:
        total = b, mine = root ? b : 0;
        break;
    case TD__COLL_SCATTER:
        total = n * b, mine = root ? n * b : 0;
        break;
    case TD__COLL_REDUCE_SCATTER:
    case TD__COLL_ALLTOALL:
        total = n * n * b, mine = n * b;
        break;
    default: /* allreduce, reduce, allgather, gather */
        total = n * b, mine = b;
        break;
    }
    if (total > small_limit(g) || total / n / n > b) *fits = 0;
    return *fits ? mine : 0;
}

/* The data of a small collective, from every rank's payload. */
static void small_finish(td__p2p *g, const td__coll *c, const unsigned char *const *data) {
    int n = g->size, me = g->rank;
    size_t e = td_dtype_size(c->dtype), b = c->count * e;
    const void **src = (const void **)g->scratch;
    unsigned char *recv = c->recv;
    switch (c->kind) {
    case TD__COLL_ALLREDUCE:
    case TD__COLL_REDUCE:
        if (c->kind == TD__COLL_REDUCE && me != c->root) return;
        for (int r = 0; r < n; r++) src[r] = data[r];
        td__reduce(recv, src, n, c->count, c->dtype, c->op, n);
        return;
    case TD__COLL_REDUCE_SCATTER:
        for (int r = 0; r < n; r++) src[r] = (const unsigned char *)data[r] + me * b;
        td__reduce(recv, src, n, c->count, c->dtype, c->op, n);
        return;
    case TD__COLL_BROADCAST:
        if (me != c->root) memcpy(recv, data[c->root], b);
        return;
    case TD__COLL_ALLGATHER:
    case TD__COLL_GATHER:
        if (c->kind == TD__COLL_GATHER && me != c->root) return;
        for (int r = 0; r < n; r++) memcpy(recv + (size_t)r * b, data[r], b);
        return;
    case TD__COLL_SCATTER:
        memcpy(recv, (const unsigned char *)data[c->root] + me * b, b);
        return;
    case TD__COLL_ALLTOALL:
        for (int r = 0; r < n; r++)
            memcpy(recv + (size_t)r * b, (const unsigned char *)data[r] + me * b, b);
        return;
    default:
        return;
    }
}

/* ---------------------------------------------------------------- large collectives */

static int overlaps(const void *a, size_t na, const void *b, size_t nb) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return na && nb && x < y + nb && y < x + na;
}

/* Chunk j of `len` elements split n ways, in 64-byte multiples: [*lo, *lo + *n_). */
static void chunk_of(size_t len, int n, int j, size_t es, size_t *lo, size_t *cnt) {
    size_t a = 64 / es;
    size_t per = ((len + (size_t)n - 1) / (size_t)n + a - 1) / a * a;
    size_t l = (size_t)j * per < len ? (size_t)j * per : len;
    *lo = l;
    *cnt = l + per < len ? per : len - l;
}

/* One step of a ring: sends sbytes at sbuf to the right neighbour while rbytes arrive from the
 * left into rbuf; with `own`, each arrived segment is reduced at once: dst = op(rbuf, own).
 * Segments of SEG bytes, so that reducing overlaps the rest of the transfer. */
static td_status ring_step(td__p2p *g, const td__coll *c, unsigned sub, const void *sbuf,
                           size_t sbytes, void *rbuf, size_t rbytes, void *dst, const void *own,
                           td_dtype dt, td_reduce_op op, int div, double timeout_s) {
    int n = g->size, right = (g->rank + 1) % n, left = (g->rank - 1 + n) % n;
    size_t ns = (sbytes + SEG - 1) / SEG, nr = (rbytes + SEG - 1) / SEG, es = td_dtype_size(dt);
    pend *p = malloc((ns + nr + 1) * sizeof *p);
    if (!p) return td__fail(TD_ENOMEM, "p2p ring: out of memory");
    int np = 0;
    td_status s = TD_OK;
    for (size_t j = 0; s == TD_OK && j < nr; j++) {
        size_t at = j * SEG, len = rbytes - at < SEG ? rbytes - at : SEG;
        s = post(g, c, p, &np, 1, (unsigned char *)rbuf + at, len, left, sub, len);
    }
    for (size_t j = 0; s == TD_OK && j < ns; j++) {
        size_t at = j * SEG, len = sbytes - at < SEG ? sbytes - at : SEG;
        s = post(g, c, p, &np, 0, (unsigned char *)sbuf + at, len, right, sub, SIZE_MAX);
    }
    for (size_t j = 0; s == TD_OK && own && j < nr; j++) {
        s = wait_for(g, p, np, (int)j, c, timeout_s);
        size_t at = j * SEG, len = rbytes - at < SEG ? rbytes - at : SEG;
        const void *src[2] = {(const unsigned char *)rbuf + at, (const unsigned char *)own + at};
        if (s == TD_OK) td__reduce((unsigned char *)dst + at, src, 2, len / es, dt, op, div);
    }
    if (s == TD_OK) s = wait_for(g, p, np, -1, c, timeout_s);
    free(p);
    return s;
}

/* Ring all-reduce of N elements: reduce-scatter (rank r ends holding chunk r) then all-gather,
 * slice by slice so that the received partial sums need at most SLICE bytes of scratch. */
static td_status ring_allreduce(td__p2p *g, const td__coll *c, const void *send, void *recv,
                                size_t N, td_dtype dt, td_reduce_op op, double timeout_s) {
    int n = g->size, me = g->rank;
    size_t es = td_dtype_size(dt), sl = SLICE / es, most, lo, cnt;
    if (n == 1) {
        if (send != recv) memmove(recv, send, N * es);
        return TD_OK;
    }
    chunk_of(N, n, 0, es, &lo, &most);
    unsigned char *tmp = scratch(g, (most < sl ? most : sl) * es);
    if (!tmp) return td__fail(TD_ENOMEM, "p2p allreduce: out of memory");
    const unsigned char *in = send;
    unsigned char *out = recv;
    unsigned sub = SUB_DATA;
    for (size_t o = 0; o < most; o += sl) {
        for (int s = 0; s < n - 1; s++, sub++) {
            int cs = ((me - s - 1) % n + n) % n, cr = ((me - s - 2) % n + n) % n;
            size_t slo, scnt, rlo, rcnt;
            chunk_of(N, n, cs, es, &lo, &cnt);
            slo = lo + o, scnt = cnt > o ? (cnt - o < sl ? cnt - o : sl) : 0;
            chunk_of(N, n, cr, es, &lo, &cnt);
            rlo = lo + o, rcnt = cnt > o ? (cnt - o < sl ? cnt - o : sl) : 0;
            int last = s == n - 2;
            td_reduce_op step_op = op == TD_OP_AVG && !last ? TD_OP_SUM : op;
            TD__TRY(ring_step(g, c, sub, (s == 0 ? in : out) + slo * es, scnt * es, tmp,
                              rcnt * es, out + rlo * es, in + rlo * es, dt, step_op, n, timeout_s));
        }
        for (int s = 0; s < n - 1; s++, sub++) {
            int cs = ((me - s) % n + n) % n, cr = ((me - s - 1) % n + n) % n;
            size_t slo, scnt, rlo, rcnt;
            chunk_of(N, n, cs, es, &lo, &cnt);
            slo = lo + o, scnt = cnt > o ? (cnt - o < sl ? cnt - o : sl) : 0;
            chunk_of(N, n, cr, es, &lo, &cnt);
            rlo = lo + o, rcnt = cnt > o ? (cnt - o < sl ? cnt - o : sl) : 0;
            TD__TRY(ring_step(g, c, sub, out + slo * es, scnt * es, out + rlo * es, rcnt * es,
                              NULL, NULL, dt, op, n, timeout_s));
        }
    }
    return TD_OK;
}

/* Ring reduce-scatter: rank r receives the reduction of every rank's send[r * count ..]. The
 * partial sums move through two scratch slices; the last step writes into recv. */
static td_status ring_reduce_scatter(td__p2p *g, const td__coll *c, const void *send, void *recv,
                                     size_t count, td_dtype dt, td_reduce_op op,
                                     double timeout_s) {
    int n = g->size, me = g->rank;
    size_t es = td_dtype_size(dt), sl = SLICE / es, w = count < sl ? count : sl;
    if (n == 1) {
        if (send != recv) memmove(recv, send, count * es);
        return TD_OK;
    }
    unsigned char *tmp = scratch(g, 3 * w * es);
    if (!tmp) return td__fail(TD_ENOMEM, "p2p reduce_scatter: out of memory");
    unsigned char *part[2] = {tmp + w * es, tmp + 2 * w * es};
    const unsigned char *in = send;
    unsigned sub = SUB_DATA;
    for (size_t o = 0; o < count; o += sl) {
        size_t len = count - o < sl ? count - o : sl;
        for (int s = 0; s < n - 1; s++, sub++) {
            int cs = ((me - s - 1) % n + n) % n, cr = ((me - s - 2) % n + n) % n;
            int last = s == n - 2;
            const unsigned char *sbuf = s == 0 ? in + ((size_t)cs * count + o) * es : part[(s - 1) & 1];
            unsigned char *out = (unsigned char *)recv + o * es;
            /* In place, the result may land on what this very step still sends: then after it. */
            int later = last && overlaps(out, len * es, sbuf, len * es);
            unsigned char *dst = last && !later ? out : part[s & 1];
            td_reduce_op step_op = op == TD_OP_AVG && !last ? TD_OP_SUM : op;
            TD__TRY(ring_step(g, c, sub, sbuf, len * es, tmp, len * es, dst,
                              in + ((size_t)cr * count + o) * es, dt, step_op, n, timeout_s));
            if (later) memcpy(out, dst, len * es);
        }
    }
    return TD_OK;
}

/* Ring all-gather straight into recv; this rank's block is already at recv[me * count]. */
static td_status ring_allgather(td__p2p *g, const td__coll *c, unsigned char *recv, size_t bytes,
                                double timeout_s) {
    int n = g->size, me = g->rank;
    for (int s = 0; s < n - 1; s++) {
        int cs = ((me - s) % n + n) % n, cr = ((me - s - 1) % n + n) % n;
        TD__TRY(ring_step(g, c, SUB_DATA + (unsigned)s, recv + (size_t)cs * bytes, bytes,
                          recv + (size_t)cr * bytes, bytes, NULL, NULL, TD_U8, TD_OP_SUM, 1,
                          timeout_s));
    }
    return TD_OK;
}

/* Chained broadcast in ring order from the root, segment by segment: each rank forwards a
 * segment the moment it has it. */
static td_status chain_broadcast(td__p2p *g, const td__coll *c, unsigned char *buf, size_t bytes,
                                 int root, double timeout_s) {
    int n = g->size, me = g->rank, pos = (me - root + n) % n;
    int prev = (me - 1 + n) % n, next = (me + 1) % n;
    size_t nseg = (bytes + SEG - 1) / SEG;
    pend *p = malloc((2 * nseg + 1) * sizeof *p);
    if (!p) return td__fail(TD_ENOMEM, "p2p broadcast: out of memory");
    int np = 0;
    td_status s = TD_OK;
    for (size_t j = 0; s == TD_OK && pos > 0 && j < nseg; j++) {
        size_t at = j * SEG, len = bytes - at < SEG ? bytes - at : SEG;
        s = post(g, c, p, &np, 1, buf + at, len, prev, SUB_DATA, len);
    }
    for (size_t j = 0; s == TD_OK && pos < n - 1 && j < nseg; j++) {
        size_t at = j * SEG, len = bytes - at < SEG ? bytes - at : SEG;
        if (pos > 0) s = wait_for(g, p, np, (int)j, c, timeout_s);
        if (s == TD_OK) s = post(g, c, p, &np, 0, buf + at, len, next, SUB_DATA, SIZE_MAX);
    }
    if (s == TD_OK) s = wait_for(g, p, np, -1, c, timeout_s);
    free(p);
    return s;
}

/* Direct messages of `bytes`: to every other rank (send_all, from send + j * bytes) or to
 * `send_to` (from send), and from every other rank (recv_all, into recv + j * bytes) or from
 * `recv_from` (into recv); pieces of at most 2^30 bytes. */
static td_status direct(td__p2p *g, const td__coll *c, const unsigned char *send, int send_all,
                        int send_to, unsigned char *recv, int recv_all, int recv_from,
                        size_t bytes, double timeout_s) {
    int n = g->size, me = g->rank;
    size_t piece = (size_t)1 << 30, np_max = 2 * (size_t)n * ((bytes + piece - 1) / piece + 1);
    pend *p = malloc(np_max * sizeof *p);
    if (!p) return td__fail(TD_ENOMEM, "p2p %s: out of memory", td__coll_name(c->kind));
    int np = 0;
    td_status s = TD_OK;
    for (int j = 0; j < n && s == TD_OK; j++) {
        if (j == me || !(recv_all || j == recv_from)) continue;
        for (size_t at = 0; at < bytes && s == TD_OK; at += piece) {
            size_t len = bytes - at < piece ? bytes - at : piece;
            s = post(g, c, p, &np, 1, recv + (recv_all ? (size_t)j * bytes : 0) + at, len, j,
                     SUB_DATA, len);
        }
    }
    for (int j = 0; j < n && s == TD_OK; j++) {
        if (j == me || !(send_all || j == send_to)) continue;
        for (size_t at = 0; at < bytes && s == TD_OK; at += piece) {
            size_t len = bytes - at < piece ? bytes - at : piece;
            s = post(g, c, p, &np, 0, (void *)(send + (send_all ? (size_t)j * bytes : 0) + at), len,
                     j, SUB_DATA, SIZE_MAX);
        }
    }
    if (s == TD_OK) s = wait_for(g, p, np, -1, c, timeout_s);
    free(p);
    return s;
}


/* u8 and i32 averages: summed in i64 (widened copies), then divided and narrowed. */
static td_status wide_average(td__p2p *g, const td__coll *c, double timeout_s) {
    size_t N = c->count;
    int64_t *w = calloc(N ? N : 1, sizeof *w);
    if (!w) return td__fail(TD_ENOMEM, "p2p %s: out of memory", td__coll_name(c->kind));
    for (size_t i = 0; i < N; i++)
        w[i] = c->dtype == TD_U8 ? ((const uint8_t *)c->send)[i] : ((const int32_t *)c->send)[i];
    td_status s = ring_allreduce(g, c, w, w, N, TD_I64, TD_OP_AVG, timeout_s);
    int gets = c->kind == TD__COLL_ALLREDUCE || g->rank == c->root;
    for (size_t i = 0; s == TD_OK && gets && i < N; i++) {
        if (c->dtype == TD_U8)
            ((uint8_t *)c->recv)[i] = (uint8_t)w[i];
        else
            ((int32_t *)c->recv)[i] = (int32_t)w[i];
    }
    if (s == TD_OK || !g->broken) free(w); /* after a failure in flight it may still be written */
    return s;
}

/* A private copy of `bytes` at `src`, for inputs the algorithms would overwrite while still
 * reading them; NULL (and *oom set) when memory runs out. */
static void *copy_of(const void *src, size_t bytes, int *oom) {
    void *p = malloc(bytes ? bytes : 1);
    if (p)
        memcpy(p, src, bytes);
    else
        *oom = 1;
    return p;
}

static td_status large(td__p2p *g, const td__coll *c, double timeout_s) {
    int n = g->size, me = g->rank, root = c->root, oom = 0;
    size_t e = td_dtype_size(c->dtype), b = c->count * e, all = b * (size_t)n;
    const unsigned char *send = c->send;
    unsigned char *recv = c->recv, *copy = NULL;
    td_status s = TD_OK;
    int wide = c->op == TD_OP_AVG && (c->dtype == TD_U8 || c->dtype == TD_I32);
    switch (c->kind) {
    case TD__COLL_ALLREDUCE:
        if (wide) return wide_average(g, c, timeout_s);
        if (send != recv && overlaps(send, b, recv, b)) send = copy = copy_of(send, b, &oom);
        if (!oom) s = ring_allreduce(g, c, send, recv, c->count, c->dtype, c->op, timeout_s);
        break;
    case TD__COLL_REDUCE:
        if (wide) return wide_average(g, c, timeout_s);
        /* An all-reduce whose result only the root keeps (elsewhere into scratch). */
        if (me != root || (send != recv && overlaps(send, b, recv, b))) {
            recv = copy = malloc(b);
            oom = !copy;
        }
        if (!oom) s = ring_allreduce(g, c, send, recv, c->count, c->dtype, c->op, timeout_s);
        if (!oom && s == TD_OK && me == root && copy) memcpy(c->recv, copy, b);
        break;
    case TD__COLL_REDUCE_SCATTER:
        if (recv != send && recv != send + (size_t)me * b && overlaps(send, all, recv, b))
            send = copy = copy_of(send, all, &oom);
        if (!oom) s = ring_reduce_scatter(g, c, send, recv, c->count, c->dtype, c->op, timeout_s);
        break;
    case TD__COLL_BROADCAST:
        s = chain_broadcast(g, c, recv, b, root, timeout_s);
        break;
    case TD__COLL_ALLGATHER:
    case TD__COLL_GATHER: {
        int gets = c->kind == TD__COLL_ALLGATHER || me == root;
        if (gets && send != recv + (size_t)me * b) {
            if (overlaps(send, b, recv, all)) send = copy = copy_of(send, b, &oom);
            if (!oom) memcpy(recv + (size_t)me * b, send, b);
        }
        if (oom) break;
        if (c->kind == TD__COLL_ALLGATHER)
            s = ring_allgather(g, c, recv, b, timeout_s);
        else
            s = direct(g, c, send, 0, root, recv, me == root, -1, b, timeout_s);
        break;
    }
    case TD__COLL_SCATTER:
        if (me == root && recv != send + (size_t)me * b) {
            if (overlaps(send, all, recv, b)) send = copy = copy_of(send, all, &oom);
            if (!oom) memcpy(recv, send + (size_t)me * b, b);
        }
        if (!oom) s = direct(g, c, send, me == root, -1, recv, 0, root, b, timeout_s);
        break;
    case TD__COLL_ALLTOALL:
        if (overlaps(send, all, recv, all)) send = copy = copy_of(send, all, &oom);
        if (oom) break;
        memcpy(recv + (size_t)me * b, send + (size_t)me * b, b);
        s = direct(g, c, send, 1, -1, recv, 1, -1, b, timeout_s);
        break;
    default:
        break;
    }
    if (oom) s = td__fail(TD_ENOMEM, "p2p %s: out of memory", td__coll_name(c->kind));
    if (s == TD_OK || !g->broken) free(copy); /* after a failure in flight it may be written */
    return s;
}

/* ---------------------------------------------------------------- entry points */

td_status td__p2p_collective(td__p2p *g, const td__coll *c, double timeout_s) {
    if (g->broken) {
        char what[160];
        describe(c, what, sizeof what);
        return td__fail(TD_ESTATE, "%s: the group is unusable after an earlier failure", what);
    }
    g->op++;
    if (c->error && c->error != TD_EINVAL && c->error != TD_EDTYPE) {
        /* Not rejected arguments but a failure this rank met elsewhere (hier.c's other groups):
         * every member hears of it, wherever it waits. */
        char what[160];
        describe(c, what, sizeof what);
        return give_up(g, c->error, "%s: rank %d: %s", what, c->error_rank,
                       c->error_msg ? c->error_msg : "failed");
    }
    int fits = 1;
    size_t mine = c->error ? 0 : small_payload(g, c, g->rank, &fits);
    const void *payload = c->kind == TD__COLL_BROADCAST ? c->recv : c->send;
    hdr h;
    header_of(c, mine, &h);
    const hdr **blocks = malloc((size_t)g->size * sizeof *blocks);
    const unsigned char **data = malloc((size_t)g->size * sizeof *data);
    if (!blocks || !data || !scratch(g, (size_t)g->size * sizeof(void *))) {
        free(blocks);
        free(data);
        return td__fail(TD_ENOMEM, "p2p %s: out of memory", td__coll_name(c->kind));
    }
    td_status s = disseminate(g, c, &h, payload, blocks, data, timeout_s);
    if (s == TD_OK) s = decide(g, blocks);
    if (s == TD_OK && fits) small_finish(g, c, data);
    free(blocks);
    free(data);
    if (s == TD_OK && !fits) s = large(g, c, timeout_s);
    return s;
}

td_status td__p2p_exchange(td__p2p *g, const void *mine, void *all, size_t bytes,
                           double timeout_s) {
    if (g->broken) return td__fail(TD_ESTATE, "split: the group is unusable after an earlier failure");
    if (bytes > EXCHANGE_MAX) return td__fail(TD_EINVAL, "p2p exchange: %zu bytes is too many", bytes);
    g->op++;
    td__coll c = {.kind = (td__coll_kind)TD__P2P_KIND_SPLIT, .count = bytes, .dtype = TD_U8};
    hdr h;
    header_of(&c, bytes, &h);
    h.dtype = TD_U8;
    const hdr **blocks = malloc((size_t)g->size * sizeof *blocks);
    const unsigned char **data = malloc((size_t)g->size * sizeof *data);
    if (!blocks || !data) {
        free(blocks);
        free(data);
        return td__fail(TD_ENOMEM, "split: out of memory");
    }
    td_status s = disseminate(g, &c, &h, mine, blocks, data, timeout_s);
    if (s == TD_OK) s = decide(g, blocks);
    for (int r = 0; s == TD_OK && r < g->size; r++) {
        if (blocks[r]->payload != bytes) {
            g->broken = 1;
            s = td__fail(TD_EMISMATCH, "split: rank %d sent %llu bytes, expected %zu", r,
                         (unsigned long long)blocks[r]->payload, bytes);
        } else {
            if (bytes) memcpy((unsigned char *)all + (size_t)r * bytes, data[r], bytes);
        }
    }
    free(blocks);
    free(data);
    return s;
}
