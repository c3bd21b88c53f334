/* The shm backend's collective algorithms, built on the phase barrier of shm.c (see the
 * buffer-parity rule in shm_impl.h). It does not order, queue or validate calls: the generic
 * layer hands it one checked collective at a time.
 *
 *  - reductions (allreduce, reduce, reduce_scatter): small buffers are copied whole into each
 *    rank's staging slot and every rank reduces all of them (one barrier); large buffers go in
 *    chunk-sized pieces, pipelined: in phase p a rank copies chunk p into its slot, reduces its
 *    1/n share of chunk p-1 straight from its own buffer and the peers' slots into the shared
 *    result area (and its own output), and copies the other shares of chunk p-2 out;
 *  - an in-place allreduce on td_comm_alloc memory at the same offset on every rank is
 *    zero-copy: each rank reduces its share straight from the ranks' regions and writes it
 *    into every region (about half the memory traffic), then one barrier; so is a
 *    reduce-scatter whose send lies there (each rank reduces its window from the ranks'
 *    regions into its receive buffer) and an allgather whose receive buffer lies there (each
 *    rank copies the others' parts out of their regions): no staging copies, and a barrier at
 *    the end so that no rank changes its buffer while another still reads it;
 *  - broadcast and scatter stream the root's buffer through the root's slot;
 *  - allgather and gather stream every rank's buffer through its slot;
 *  - alltoall gives every destination a 1/n column of each slot.
 * The last phase of an operation needs no barrier of its own: the next operation's first
 * phase protects what it reads. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "comm/shm/shm_impl.h"

#define SHM_SMALL (64u * 1024u)    /* below this an allreduce reduces everything on every rank */
#define SHM_ZC_BLOCK (32u * 1024u) /* bytes a zero-copy all-reduce reduces before copying out */

#if defined(__x86_64__)
/* Streaming stores skip the read-for-ownership of an output that will not fit in cache anyway:
 * a third less memory traffic on large collectives. Copies whole 64-byte lines from the first
 * aligned one; returns the bytes copied. */
__attribute__((target("avx512f"))) static size_t
stream_lines_avx512(unsigned char *d, const unsigned char *s, size_t bytes) {
    size_t done = 0;
    for (; bytes - done >= 64; done += 64)
        _mm512_stream_si512((void *)(d + done), _mm512_loadu_si512((const void *)(s + done)));
    return done;
}
#endif

/* Copies the elements [lo, hi) of a stream (src holds element lo) that fall in the window
 * [wlo, whi) into out (which holds element wlo). */
static void copy_window(unsigned char *out, size_t wlo, size_t whi, const unsigned char *src,
                        size_t lo, size_t hi, size_t es, int stream) {
    size_t a = lo > wlo ? lo : wlo, b = hi < whi ? hi : whi;
    if (a >= b) return;
    unsigned char *d = out + (a - wlo) * es;
    const unsigned char *s = src + (a - lo) * es;
    size_t bytes = (b - a) * es;
#if defined(__x86_64__)
    if (stream && bytes >= 4096 && td__cpu_isa() >= TD__ISA_AVX512) {
        size_t head = (64 - ((uintptr_t)d & 63)) & 63;
        memcpy(d, s, head);
        d += head, s += head, bytes -= head;
        size_t done = stream_lines_avx512(d, s, bytes);
        d += done, s += done, bytes -= done;
    }
#else
    (void)stream;
#endif
    memcpy(d, s, bytes);
}

/* Bytes per pipeline chunk for a stream of `bytes` per rank. Every chunk is one barrier, at
 * which a rank waits for the slowest; on cores shared with other work each barrier can cost a
 * time slice, so large buffers take few, large chunks: an eighth of the stream (eight chunks
 * keep the pipeline full), at least SHM_PIPE_MIN, at most the staging slot. */
static size_t pipe_chunk(const shm_ctx *c, size_t bytes) {
    size_t e = (bytes / 8 + 4095) / 4096 * 4096;
    if (e < SHM_PIPE_MIN) e = SHM_PIPE_MIN;
    return e < c->chunk ? e : c->chunk;
}

/* Share [*lo, *hi) of rank j in a chunk of len elements, in 64-byte multiples. */
static void share_of(size_t len, int n, int j, size_t es, size_t *lo, size_t *hi) {
    size_t a = 64 / es;
    size_t per = ((len + (size_t)n - 1) / (size_t)n + a - 1) / a * a;
    *lo = (size_t)j * per < len ? (size_t)j * per : len;
    *hi = *lo + per < len ? *lo + per : len;
}

/* How the ranks posted the call of the phase just completed: 0 none registered, 1 all the same
 * (allocation, offset), 2 a mix. Every rank sees every header, so all decide alike. */
static int reg_mode(shm_ctx *c) {
    unsigned parity = c->phase & 1;
    const shm_call *first = &c->ranks[0].call[parity];
    int any = 0, same = 1;
    for (int r = 0; r < c->size; r++) {
        const shm_call *k = &c->ranks[r].call[parity];
        any |= k->reg != 0;
        same &= k->reg != 0 && k->reg == first->reg && k->reg_off == first->reg_off;
    }
    return same ? 1 : any ? 2 : 0;
}

/* In-place all-reduce of N elements at offset `off` of every rank's region of `g`, after the
 * phase in which every rank posted its input: rank j reduces share j block by block, from all
 * regions into its own, and copies each block into every other region. Only rank j touches
 * share j, so one closing barrier (every share written) is the only synchronisation. */
static td_status zero_copy(shm_ctx *c, const shm_reg *g, size_t off, size_t N, td_dtype dt,
                           td_reduce_op op, const void **src, uint64_t tmo) {
    size_t es = td_dtype_size(dt), lo, hi, B = SHM_ZC_BLOCK / es;
    int n = c->size, me = c->rank;
    share_of(N, n, me, es, &lo, &hi);
    unsigned char *mine = g->base + (size_t)me * g->region + off;
    /* Plain stores on purpose: streaming ones measured 20-40% slower here at 16-256 MB, as
     * the block is still in cache and the owner reads its region right after. */
    for (size_t a = lo; a < hi; a += B) {
        size_t len = hi - a < B ? hi - a : B;
        for (int j = 0; j < n; j++) src[j] = g->base + (size_t)j * g->region + off + a * es;
        td__reduce(mine + a * es, src, n, len, dt, op, n);
        for (int j = 0; j < n; j++)
            if (j != me) memcpy((void *)(uintptr_t)src[j], mine + a * es, len * es);
    }
    return td__shm_step(c, NULL, NULL, tmo);
}

/* Reduce-scatter of N elements at offset `off` of every rank's region of `g`, after the phase in
 * which every rank posted its input: this rank reduces its window [wlo, whi) from all regions into
 * `out` (which may be its own region's window: td__reduce reads each element before writing it). */
static td_status zero_copy_window(shm_ctx *c, const shm_reg *g, size_t off, unsigned char *out,
                                  size_t wlo, size_t whi, td_dtype dt, td_reduce_op op,
                                  const void **src, uint64_t tmo) {
    size_t es = td_dtype_size(dt);
    int n = c->size;
    for (int j = 0; j < n; j++) src[j] = g->base + (size_t)j * g->region + off + wlo * es;
    if (whi > wlo) td__reduce(out, src, n, whi - wlo, dt, op, n);
    return td__shm_step(c, NULL, NULL, tmo);
}

/* Reduces N elements of every rank's `send`; this rank receives [wlo, whi) in `out`. When
 * `call` carries a registration (an in-place all-reduce, or a reduce-scatter whose send is
 * td_comm_alloc memory) this rank's first phase copies nothing: after it, the ranks go zero-copy
 * when all posted the same registration, and otherwise start over with a plain first phase. */
static td_status reduce_window(shm_ctx *c, const shm_call *call, const unsigned char *send,
                               unsigned char *out, size_t N, size_t wlo, size_t whi, td_dtype dt,
                               td_reduce_op op, uint64_t tmo) {
    size_t es = td_dtype_size(dt);
    int n = c->size, me = c->rank;
    const void *srcs[64];
    const void **src = n <= 64 ? srcs : malloc((size_t)n * sizeof *src);
    if (!src) return td__fail(TD_ENOMEM, "shm: out of memory");
    td_status s = TD_OK;
    if (n == 1 || N * es <= SHM_SMALL) {
        unsigned wp = (c->phase + 1) & 1;
        if (n > 1 && N) memcpy(shm_staging(c, me, wp), send, N * es);
        s = td__shm_step(c, call, NULL, tmo);
        if (!s && whi > wlo) {
            for (int j = 0; j < n; j++)
                src[j] = (j == me ? send : shm_staging(c, j, wp)) + wlo * es;
            td__reduce(out, src, n, whi - wlo, dt, op, n);
        }
        if (src != srcs) free(src);
        return s;
    }
    size_t E = pipe_chunk(c, N * es) / es, nch = (N + E - 1) / E;
    int stream = (whi - wlo) * es >= c->stream_min;
    for (size_t p = 0; !s && p <= nch + 1; p++) {
        unsigned wp = (c->phase + 1) & 1, rp = wp ^ 1;
        size_t lo, hi;
        if (p < nch && !(p == 0 && call && call->reg)) { /* copy in chunk p, all but my share */
            size_t base = p * E, len = N - base < E ? N - base : E;
            share_of(len, n, me, es, &lo, &hi);
            unsigned char *slot = shm_staging(c, me, wp);
            memcpy(slot, send + base * es, lo * es);
            memcpy(slot + hi * es, send + (base + hi) * es, (len - hi) * es);
        }
        if (p >= 1 && p <= nch) { /* reduce my share of chunk p-1 */
            size_t base = (p - 1) * E, len = N - base < E ? N - base : E;
            share_of(len, n, me, es, &lo, &hi);
            for (int j = 0; j < n; j++)
                src[j] = j == me ? send + (base + lo) * es : shm_staging(c, j, rp) + lo * es;
            unsigned char *res = c->result + (size_t)wp * c->chunk + lo * es;
            td__reduce(res, src, n, hi - lo, dt, op, n);
            copy_window(out, wlo, whi, res, base + lo, base + hi, es, stream);
        }
        if (p >= 2) { /* copy out the other shares of chunk p-2 */
            size_t base = (p - 2) * E, len = N - base < E ? N - base : E;
            share_of(len, n, me, es, &lo, &hi);
            const unsigned char *res = c->result + (size_t)rp * c->chunk;
            copy_window(out, wlo, whi, res, base, base + lo, es, stream);
            copy_window(out, wlo, whi, res + hi * es, base + hi, base + len, es, stream);
        }
        if (p <= nch) s = td__shm_step(c, p == 0 ? call : NULL, NULL, tmo);
        int mode = p == 0 && !s && call ? reg_mode(c) : 0;
        if (mode == 1) {
            size_t off = 0;
            const shm_reg *g = td__shm_reg_find(c, send, N * es, &off);
            s = call->kind == TD__COLL_ALLREDUCE
                    ? zero_copy(c, g, off, N, dt, op, src, tmo)
                    : zero_copy_window(c, g, off, out, wlo, whi, dt, op, src, tmo);
            break;
        }
        if (mode == 2) {
            /* Only this first phase has run; its headers are checked, so no call again. */
            s = reduce_window(c, NULL, send, out, N, wlo, whi, dt, op, tmo);
            break;
        }
    }
#if defined(__x86_64__)
    if (stream) _mm_sfence();
#endif
    if (src != srcs) free(src);
    return s;
}

/* Streams the root's N elements; this rank receives [wlo, whi) in `out`. */
static td_status bcast_window(shm_ctx *c, const shm_call *call, const unsigned char *send,
                              unsigned char *out, size_t N, size_t wlo, size_t whi, size_t es,
                              int root, uint64_t tmo) {
    size_t E = pipe_chunk(c, N * es) / es, nch = (N + E - 1) / E;
    int me = c->rank;
    if (me == root && whi > wlo && out != send + wlo * es)
        memmove(out, send + wlo * es, (whi - wlo) * es);
    td_status s = TD_OK;
    for (size_t p = 0; !s && p <= nch; p++) {
        unsigned wp = (c->phase + 1) & 1, rp = wp ^ 1;
        if (me == root && p < nch) {
            size_t base = p * E, len = N - base < E ? N - base : E;
            memcpy(shm_staging(c, root, wp), send + base * es, len * es);
        }
        if (me != root && p >= 1) {
            size_t base = (p - 1) * E, len = N - base < E ? N - base : E;
            copy_window(out, wlo, whi, shm_staging(c, root, rp), base, base + len, es, 0);
        }
        if (p < nch || p == 0) s = td__shm_step(c, p == 0 ? call : NULL, NULL, tmo);
    }
    return s;
}

/* Every rank's `count` elements into out[rank * count] on the ranks with out != NULL. When `call`
 * carries a registration (an allgather into td_comm_alloc memory) this rank's first phase copies
 * nothing: after it, when every rank posted the same registration, each copies the others' parts
 * straight out of their regions, and otherwise all start over through the staging slots. */
static td_status gather_all(shm_ctx *c, const shm_call *call, const unsigned char *send,
                            unsigned char *out, size_t count, size_t es, uint64_t tmo) {
    size_t E = pipe_chunk(c, count * es) / es, nch = (count + E - 1) / E;
    int me = c->rank, n = c->size;
    if (out && count && out + (size_t)me * count * es != send)
        memmove(out + (size_t)me * count * es, send, count * es);
    td_status s = TD_OK;
    for (size_t p = 0; !s && p <= nch; p++) {
        unsigned wp = (c->phase + 1) & 1, rp = wp ^ 1;
        if (p < nch && !(p == 0 && call && call->reg)) {
            size_t base = p * E, len = count - base < E ? count - base : E;
            memcpy(shm_staging(c, me, wp), send + base * es, len * es);
        }
        if (out && p >= 1) {
            size_t base = (p - 1) * E, len = count - base < E ? count - base : E;
            for (int j = 0; j < n; j++)
                if (j != me)
                    memcpy(out + ((size_t)j * count + base) * es, shm_staging(c, j, rp), len * es);
        }
        if (p < nch || p == 0) s = td__shm_step(c, p == 0 ? call : NULL, NULL, tmo);
        int mode = p == 0 && !s && call ? reg_mode(c) : 0;
        if (mode == 1) {
            size_t off = 0, part = count * es;
            const shm_reg *g = td__shm_reg_find(c, out, (size_t)n * part, &off);
            for (int j = 0; j < n; j++)
                if (j != me)
                    memcpy(out + (size_t)j * part, g->base + (size_t)j * g->region + off + j * part,
                           part);
            return td__shm_step(c, NULL, NULL, tmo);
        }
        if (mode == 2) /* only this first phase has run; its headers are checked */
            return gather_all(c, NULL, out + (size_t)me * count * es, out, count, es, tmo);
    }
    return s;
}

static td_status alltoall(shm_ctx *c, const shm_call *call, const unsigned char *send,
                          unsigned char *out, size_t count, size_t es, uint64_t tmo) {
    int me = c->rank, n = c->size;
    size_t E = pipe_chunk(c, (size_t)n * count * es) / (size_t)n / es, nch = (count + E - 1) / E;
    if (count) memcpy(out + (size_t)me * count * es, send + (size_t)me * count * es, count * es);
    td_status s = TD_OK;
    for (size_t p = 0; !s && p <= nch; p++) {
        unsigned wp = (c->phase + 1) & 1, rp = wp ^ 1;
        if (p < nch) {
            size_t base = p * E, len = count - base < E ? count - base : E;
            for (int d = 0; d < n; d++)
                if (d != me)
                    memcpy(shm_staging(c, me, wp) + (size_t)d * E * es,
                           send + ((size_t)d * count + base) * es, len * es);
        }
        if (p >= 1) {
            size_t base = (p - 1) * E, len = count - base < E ? count - base : E;
            for (int j = 0; j < n; j++)
                if (j != me)
                    memcpy(out + ((size_t)j * count + base) * es,
                           shm_staging(c, j, rp) + (size_t)me * E * es, len * es);
        }
        if (p < nch || p == 0) s = td__shm_step(c, p == 0 ? call : NULL, NULL, tmo);
    }
    return s;
}

td_status td__shm_allgather_bytes(shm_ctx *c, const shm_call *call, const void *mine, void *all,
                                  size_t bytes, uint64_t timeout_ns) {
    return gather_all(c, call, mine, all, bytes, 1, timeout_ns);
}

/* a == b + off, without forming b + off (b may be NULL when nothing moves). */
static int at(const void *a, const void *b, size_t off) {
    return (uintptr_t)a == (uintptr_t)b + off;
}

static int overlaps(const void *a, size_t na, const void *b, size_t nb) {
    const char *x = a, *y = b;
    return na && nb && x < y + nb && y < x + na;
}

td_status td__shm_collective(void *ctx, const td__coll *k, double timeout_s) {
    shm_ctx *c = ctx;
    char what[160];
    if (atomic_load(&c->head->poison)) {
        td__coll_describe_call(what, sizeof what, k);
        return td__shm_poisoned(c, what);
    }
    c->next_seq = k->seq + 1;
    uint64_t tmo = (uint64_t)(timeout_s * 1e9);
    const td__coll *sig = td__coll_sig(k); /* what the ranks must agree on */
    shm_call call = {.kind = (uint32_t)sig->kind, .seq = sig->seq, .count = sig->count, .root = -1};
    int n = c->size, me = c->rank;
    size_t es = td_dtype_size(k->dtype), cnt = k->count;
    if (sig->kind != TD__COLL_BARRIER) call.dtype = (uint32_t)sig->dtype;
    if (td__coll_is_reduction(sig->kind)) call.op = (uint32_t)sig->op;
    if (td__coll_is_rooted(sig->kind)) call.root = sig->root;
    if (k->error) { /* this rank's arguments were rejected: only tell the others */
        call.error = k->error;
        call.error_rank = k->error_rank;
        return td__shm_step(c, &call, k->error_msg, tmo);
    }
    const unsigned char *send = k->send;
    unsigned char *recv = k->recv, *tmp = NULL;
    /* Sizes of the send and receive sides, to spot overlaps the algorithms cannot take. */
    size_t sbytes = 0, rbytes = 0;
    int safe = 0;
    switch (k->kind) {
    case TD__COLL_ALLREDUCE:
    case TD__COLL_REDUCE:
        sbytes = rbytes = cnt * es;
        safe = send == recv;
        break;
    case TD__COLL_REDUCE_SCATTER:
        sbytes = (size_t)n * cnt * es, rbytes = cnt * es;
        safe = at(recv, send, (size_t)me * cnt * es);
        break;
    case TD__COLL_ALLGATHER:
    case TD__COLL_GATHER:
        sbytes = cnt * es, rbytes = (size_t)n * cnt * es;
        safe = at(send, recv, (size_t)me * cnt * es);
        break;
    case TD__COLL_SCATTER:
        sbytes = (size_t)n * cnt * es, rbytes = cnt * es;
        safe = !send || at(recv, send, (size_t)me * cnt * es);
        break;
    case TD__COLL_ALLTOALL:
        sbytes = rbytes = (size_t)n * cnt * es;
        break;
    default:
        break;
    }
    if (!safe && send && recv && overlaps(send, sbytes, recv, rbytes)) {
        tmp = malloc(sbytes);
        if (!tmp)
            return td__fail(TD_ENOMEM, "shm: out of memory for an overlapping %s",
                            td__coll_name(k->kind));
        memcpy(tmp, send, sbytes);
        send = tmp;
    }
    td_status s;
    switch (k->kind) {
    case TD__COLL_ALLREDUCE:
        /* In place on td_comm_alloc memory: post where it lies (see reduce_window). */
        if (n > 1 && send == recv && cnt * es > SHM_SMALL) {
            size_t off = 0;
            const shm_reg *g = td__shm_reg_find(c, recv, cnt * es, &off);
            if (g) call.reg = g->id, call.reg_off = off;
        }
        s = reduce_window(c, &call, send, recv, cnt, 0, cnt, k->dtype, k->op, tmo);
        break;
    case TD__COLL_REDUCE:
        s = reduce_window(c, &call, send, recv, cnt, 0, me == k->root ? cnt : 0, k->dtype, k->op,
                          tmo);
        break;
    case TD__COLL_REDUCE_SCATTER:
        /* Send in td_comm_alloc memory: reduce from where it lies (see reduce_window). */
        if (n > 1 && send == k->send && (size_t)n * cnt * es > SHM_SMALL) {
            size_t off = 0;
            const shm_reg *g = td__shm_reg_find(c, send, (size_t)n * cnt * es, &off);
            if (g) call.reg = g->id, call.reg_off = off;
        }
        s = reduce_window(c, &call, send, recv, (size_t)n * cnt, (size_t)me * cnt,
                          (size_t)(me + 1) * cnt, k->dtype, k->op, tmo);
        break;
    case TD__COLL_BROADCAST:
        s = bcast_window(c, &call, recv, recv, cnt, 0, cnt, es, k->root, tmo);
        break;
    case TD__COLL_SCATTER:
        s = bcast_window(c, &call, send, recv, (size_t)n * cnt, (size_t)me * cnt,
                         (size_t)(me + 1) * cnt, es, k->root, tmo);
        break;
    case TD__COLL_ALLGATHER:
        /* Receive buffer in td_comm_alloc memory: gather from where it lies (see gather_all). */
        if (n > 1 && (size_t)n * cnt * es > SHM_SMALL) {
            size_t off = 0;
            const shm_reg *g = td__shm_reg_find(c, recv, (size_t)n * cnt * es, &off);
            if (g) call.reg = g->id, call.reg_off = off;
        }
        s = gather_all(c, &call, send, recv, cnt, es, tmo);
        break;
    case TD__COLL_GATHER:
        s = gather_all(c, &call, send, me == k->root ? recv : NULL, cnt, es, tmo);
        break;
    case TD__COLL_ALLTOALL:
        s = alltoall(c, &call, send, recv, cnt, es, tmo);
        break;
    case TD__COLL_BARRIER:
        s = td__shm_step(c, &call, NULL, tmo);
        break;
    default:
        s = td__fail(TD_EINVAL, "shm: unknown collective %d", (int)k->kind);
    }
    free(tmp);
    return s;
}
