/* The Open MPI backend's collectives: each td__coll becomes one non-blocking MPI
 * collective (MPI_Iallreduce, MPI_Ibcast, ...) polled against the group's timeout.
 *
 * Before every collective the ranks exchange a 48-byte header (kind, seq, dtype, count, op,
 * root) with MPI_Iallgather, so that ranks calling different collectives get TD_EMISMATCH
 * naming both calls instead of undefined behaviour or a hang. That doubles the latency of
 * small collectives and costs nothing noticeable on large ones; TANDEM_MPI_CHECK=0 turns
 * it off once a program is known to be right.
 *
 * Reductions on bf16 and f16 run in f32 (converted into scratch buffers and back); AVG on
 * u8 and i32 sums in i64 so that the sum cannot wrap, then divides (integer division
 * truncates toward zero). The other dtypes reduce natively. It does not chunk: one call
 * moves at most INT_MAX elements per rank, MPI's count limit. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/mpi/mpi_impl.h"
#include "core/core_impl.h"

/* "allreduce #4 (f32, 1009 elements, sum)" for an error message. */
static void describe(const int64_t h[TD__MPI_HDR], char *out, size_t cap) {
    if (h[0] == TD__MPI_KIND_SPLIT)
        snprintf(out, cap, "split");
    else
        td__coll_describe(out, cap, (td__coll_kind)h[0], (uint64_t)h[1], (td_dtype)h[2],
                          (size_t)h[3], (td_reduce_op)h[4], (int)h[5]);
}

td_status td__mpi_agree(td__mpi_ctx *ctx, const int64_t hdr[TD__MPI_HDR], const char *error_msg,
                        double timeout_s) {
    enum { H = TD__MPI_HDR, MSG = 192 };
    int64_t *all = malloc((size_t)ctx->size * H * sizeof *all);
    if (!all) return td__fail(TD_ENOMEM, "mpi: out of memory for call headers");
    MPI_Request req;
    td__mpi_lock();
    int rc = MPI_Iallgather(hdr, H, MPI_INT64_T, all, H, MPI_INT64_T, ctx->comm, &req);
    td__mpi_unlock();
    if (rc != MPI_SUCCESS) {
        free(all);
        return td__mpi_error(rc, "MPI_Iallgather (call headers)");
    }
    char what[192], mine[128];
    describe(hdr, mine, sizeof mine);
    snprintf(what, sizeof what, "%s (waiting for every rank to start it)", mine);
    td_status st = td__mpi_wait(ctx, &req, NULL, timeout_s, what);
    if (st != TD_OK) {
        ctx->broken = 1;
        return st; /* `all` may still be written to by MPI: leave it */
    }
    /* Rejected arguments first: one more exchange carries the reasons, and every rank reports
     * the lowest rejecting rank. */
    int bad = -1;
    for (int r = 0; r < ctx->size && bad < 0; r++)
        if (all[H * r + 6]) bad = r;
    if (bad >= 0) {
        char *msgs = calloc((size_t)ctx->size, MSG), msg[MSG] = {0};
        if (!msgs) {
            free(all);
            return td__fail(TD_ENOMEM, "mpi: out of memory for call headers");
        }
        snprintf(msg, sizeof msg, "%s", error_msg ? error_msg : "");
        td__mpi_lock();
        rc = MPI_Iallgather(msg, MSG, MPI_CHAR, msgs, MSG, MPI_CHAR, ctx->comm, &req);
        td__mpi_unlock();
        st = rc != MPI_SUCCESS ? td__mpi_error(rc, "MPI_Iallgather (rejected arguments)")
                               : td__mpi_wait(ctx, &req, NULL, timeout_s, what);
        if (st != TD_OK) {
            ctx->broken = 1;
            free(all);
            return st;
        }
        char theirs[128];
        describe(all + H * bad, theirs, sizeof theirs);
        msgs[(size_t)bad * MSG + MSG - 1] = 0;
        st = td__fail((td_status)all[H * bad + 6], "rank %d: %s: %s", bad, theirs,
                      msgs + (size_t)bad * MSG);
        free(msgs);
        free(all);
        return st;
    }
    /* Every rank compares against rank 0, so all of them report the same pair. */
    for (int r = 1; r < ctx->size && st == TD_OK; r++) {
        const int64_t *a = all, *b = all + H * r;
        int same = a[0] == b[0] && (a[0] == TD__MPI_KIND_SPLIT || memcmp(a, b, H * sizeof *a) == 0);
        if (!same) {
            char da[128], db[128];
            describe(a, da, sizeof da);
            describe(b, db, sizeof db);
            st = td__fail(TD_EMISMATCH,
                          "ranks called different collectives: rank 0 called %s but rank %d "
                          "called %s",
                          da, r, db);
        }
    }
    free(all);
    return st;
}

static MPI_Datatype mpi_type(td_dtype dtype) {
    switch (dtype) {
    case TD_F32:
        return MPI_FLOAT;
    case TD_F64:
        return MPI_DOUBLE;
    case TD_I32:
        return MPI_INT32_T;
    case TD_I64:
        return MPI_INT64_T;
    case TD_U8:
        return MPI_UINT8_T;
    case TD_BF16:
    case TD_F16:
        return MPI_UINT16_T; /* moved as bits; reduced through f32 */
    default:
        return MPI_DATATYPE_NULL;
    }
}

static MPI_Op mpi_op(td_reduce_op op) {
    switch (op) {
    case TD_OP_PROD:
        return MPI_PROD;
    case TD_OP_MIN:
        return MPI_MIN;
    case TD_OP_MAX:
        return MPI_MAX;
    default:
        return MPI_SUM; /* SUM, and AVG before its division */
    }
}

/* The dtype a reduction is computed in. */
static td_dtype compute_dtype(td_dtype dtype, td_reduce_op op) {
    if (dtype == TD_BF16 || dtype == TD_F16) return TD_F32;
    if (op == TD_OP_AVG && (dtype == TD_U8 || dtype == TD_I32)) return TD_I64;
    return dtype;
}

static void widen(const void *src, td_dtype dtype, void *dst, size_t n) {
    float *f = dst;
    int64_t *l = dst;
    for (size_t i = 0; i < n; i++) {
        switch (dtype) {
        case TD_BF16:
            f[i] = td_bf16_to_f32(((const uint16_t *)src)[i]);
            break;
        case TD_F16:
            f[i] = td_f16_to_f32(((const uint16_t *)src)[i]);
            break;
        case TD_U8:
            l[i] = ((const uint8_t *)src)[i];
            break;
        case TD_I32:
            l[i] = ((const int32_t *)src)[i];
            break;
        default:
            return;
        }
    }
}

/* dst (dtype) = src (its compute dtype) / divisor. */
static void narrow(const void *src, void *dst, td_dtype dtype, size_t n, int divisor) {
    const float *f = src;
    const int64_t *l = src;
    for (size_t i = 0; i < n; i++) {
        switch (dtype) {
        case TD_BF16:
            ((uint16_t *)dst)[i] = td_f32_to_bf16(f[i] / (float)divisor);
            break;
        case TD_F16:
            ((uint16_t *)dst)[i] = td_f32_to_f16(f[i] / (float)divisor);
            break;
        case TD_U8:
            ((uint8_t *)dst)[i] = (uint8_t)(l[i] / divisor);
            break;
        case TD_I32:
            ((int32_t *)dst)[i] = (int32_t)(l[i] / divisor);
            break;
        default:
            return;
        }
    }
}

/* AVG's division, in place, for dtypes reduced natively. */
static void divide(void *buf, td_dtype dtype, size_t n, int divisor) {
    for (size_t i = 0; i < n; i++) {
        switch (dtype) {
        case TD_F32:
            ((float *)buf)[i] /= (float)divisor;
            break;
        case TD_F64:
            ((double *)buf)[i] /= (double)divisor;
            break;
        case TD_I64:
            ((int64_t *)buf)[i] /= divisor;
            break;
        default:
            return;
        }
    }
}

static int overlaps(const void *a, size_t na, const void *b, size_t nb) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return na && nb && x < y + nb && y < x + na;
}

/* Scratch memory of one collective. On a timeout MPI may still write to it, so it is then
 * deliberately leaked along with the group. */
typedef struct {
    void *p[3];
} scratch;

static void *scratch_alloc(scratch *s, size_t bytes) {
    for (int i = 0; i < 3; i++)
        if (!s->p[i]) return s->p[i] = malloc(bytes ? bytes : 1);
    return NULL;
}

static void *scratch_copy(scratch *s, const void *src, size_t bytes) {
    void *p = scratch_alloc(s, bytes);
    if (p) memcpy(p, src, bytes);
    return p;
}

static void scratch_free(scratch *s) {
    for (int i = 0; i < 3; i++) free(s->p[i]);
}

/* Starts the MPI call for `c`; fills *post with what to do after it completes. */
typedef struct {
    void *reduced; /* the reduction's result in the compute dtype (NULL: none here) */
    void *result;  /* where the caller wants it */
    size_t count;
    td_dtype cdtype;
    int convert; /* narrow reduced -> result */
    int divisor; /* AVG: group size, else 1 */
} post_step;

static td_status start(td__mpi_ctx *ctx, const td__coll *c, scratch *s, post_step *post,
                       MPI_Request *req) {
    const int rank = ctx->rank, size = ctx->size, n = (int)c->count;
    const size_t es = td_dtype_size(c->dtype), bytes = c->count * es,
                 all_bytes = bytes * (size_t)size;
    MPI_Datatype t = mpi_type(c->dtype);
    MPI_Comm comm = ctx->comm;
    const void *send = c->send;
    void *recv = c->recv;
    const int in_place = c->send == c->recv;
    int rc = MPI_SUCCESS;
    const char *call = "";
    memset(post, 0, sizeof *post);

    if (td__coll_is_reduction(c->kind)) {
        td_dtype cd = compute_dtype(c->dtype, c->op);
        const int convert = cd != c->dtype;
        const int root_here = c->kind != TD__COLL_REDUCE || rank == c->root;
        const size_t in_count =
            c->kind == TD__COLL_REDUCE_SCATTER ? c->count * (size_t)size : c->count;
        const size_t ces = td_dtype_size(cd);
        MPI_Datatype ct = mpi_type(cd);
        void *in, *out; /* MPI's send and receive buffers, in the compute dtype */
        if (convert) {
            in = scratch_alloc(s, in_count * ces);
            out = c->kind == TD__COLL_REDUCE_SCATTER ? scratch_alloc(s, c->count * ces) : in;
            if (!in || !out)
                return td__fail(TD_ENOMEM, "mpi %s: out of memory for f32 scratch",
                                td__coll_name(c->kind));
            widen(send, c->dtype, in, in_count);
        } else {
            in = (void *)send;
            out = recv;
            if (!in_place && overlaps(send, in_count * es, recv, root_here ? c->count * es : 0)) {
                in = scratch_copy(s, send, in_count * es);
                if (!in)
                    return td__fail(TD_ENOMEM, "mpi %s: out of memory", td__coll_name(c->kind));
            }
        }
        /* When in == out MPI wants MPI_IN_PLACE (reduce_scatter: input in recv, size * count). */
        const void *mpi_in = in == out ? MPI_IN_PLACE : in;
        switch (c->kind) {
        case TD__COLL_ALLREDUCE:
            call = "MPI_Iallreduce";
            rc = MPI_Iallreduce(mpi_in, out, n, ct, mpi_op(c->op), comm, req);
            break;
        case TD__COLL_REDUCE:
            call = "MPI_Ireduce";
            if (!root_here) mpi_in = in; /* MPI_IN_PLACE is for the root only */
            rc = MPI_Ireduce(mpi_in, root_here ? out : NULL, n, ct, mpi_op(c->op), c->root, comm,
                             req);
            break;
        default:
            call = "MPI_Ireduce_scatter_block";
            if (convert) mpi_in = in;
            rc = MPI_Ireduce_scatter_block(mpi_in, out, n, ct, mpi_op(c->op), comm, req);
            break;
        }
        if (root_here) {
            post->reduced = out;
            post->result = recv;
            post->count = c->count;
            post->cdtype = cd;
            post->convert = convert;
            post->divisor = c->op == TD_OP_AVG ? size : 1;
        }
    } else {
        switch (c->kind) {
        case TD__COLL_BROADCAST:
            call = "MPI_Ibcast";
            rc = MPI_Ibcast(recv, n, t, c->root, comm, req);
            break;
        case TD__COLL_ALLGATHER:
        case TD__COLL_GATHER: {
            const int gets = c->kind == TD__COLL_ALLGATHER || rank == c->root;
            const void *in = send;
            if (gets && (const char *)send == (char *)recv + (size_t)rank * bytes) {
                in = MPI_IN_PLACE; /* NCCL's in place: own part already in position */
            } else if (gets && overlaps(send, bytes, recv, all_bytes)) {
                in = scratch_copy(s, send, bytes); /* e.g. send == recv on rank > 0 */
                if (!in)
                    return td__fail(TD_ENOMEM, "mpi %s: out of memory", td__coll_name(c->kind));
            }
            if (c->kind == TD__COLL_ALLGATHER) {
                call = "MPI_Iallgather";
                rc = MPI_Iallgather(in, n, t, recv, n, t, comm, req);
            } else {
                call = "MPI_Igather";
                rc = MPI_Igather(in, n, t, gets ? recv : NULL, n, t, c->root, comm, req);
            }
            break;
        }
        case TD__COLL_SCATTER: {
            const void *in = send;
            void *out = recv;
            if (rank == c->root) {
                if ((char *)recv == (const char *)send + (size_t)rank * bytes) {
                    out = MPI_IN_PLACE;
                } else if (overlaps(send, all_bytes, recv, bytes)) {
                    in = scratch_copy(s, send, all_bytes);
                    if (!in) return td__fail(TD_ENOMEM, "mpi scatter: out of memory");
                }
            }
            call = "MPI_Iscatter";
            rc = MPI_Iscatter(rank == c->root ? in : NULL, n, t, out, n, t, c->root, comm, req);
            break;
        }
        case TD__COLL_ALLTOALL: {
            const void *in = send;
            if (overlaps(send, all_bytes, recv, all_bytes)) { /* in place included */
                in = scratch_copy(s, send, all_bytes);
                if (!in) return td__fail(TD_ENOMEM, "mpi alltoall: out of memory");
            }
            call = "MPI_Ialltoall";
            rc = MPI_Ialltoall(in, n, t, recv, n, t, comm, req);
            break;
        }
        default:
            call = "MPI_Ibarrier";
            rc = MPI_Ibarrier(comm, req);
            break;
        }
    }
    return rc == MPI_SUCCESS ? TD_OK : td__mpi_error(rc, call);
}

/* Arguments that are the same on every rank once the headers agree, so every rank fails
 * alike and none is left waiting. */
static td_status validate(const td__mpi_ctx *ctx, const td__coll *c) {
    const char *name = td__coll_name(c->kind);
    if (c->kind < 0 || c->kind >= TD__COLL_COUNT)
        return td__fail(TD_EINVAL, "mpi: unknown collective %d", (int)c->kind);
    if (c->kind == TD__COLL_BARRIER) return TD_OK;
    if (mpi_type(c->dtype) == MPI_DATATYPE_NULL)
        return td__fail(TD_EDTYPE, "mpi %s: invalid dtype %d", name, (int)c->dtype);
    if (td__coll_is_reduction(c->kind) && (c->op < 0 || c->op >= TD_OP_COUNT))
        return td__fail(TD_EINVAL, "mpi %s: invalid reduce op %d", name, (int)c->op);
    if (td__coll_is_rooted(c->kind) && (c->root < 0 || c->root >= ctx->size))
        return td__fail(TD_EINVAL, "mpi %s: root %d is not a rank of this group of %d", name,
                        c->root, ctx->size);
    size_t limit =
        c->kind == TD__COLL_REDUCE_SCATTER ? (size_t)INT_MAX / (size_t)ctx->size : (size_t)INT_MAX;
    if (c->count > limit)
        return td__fail(TD_EUNSUPPORTED,
                        "mpi %s: count %zu is more than MPI's per-call limit (%zu)", name, c->count,
                        limit);
    return TD_OK;
}

td_status td__mpi_collective(void *vctx, const td__coll *c, double timeout_s) {
    td__mpi_ctx *ctx = vctx;
    if (ctx->broken)
        return td__fail(TD_ESTATE, "mpi %s: the group is unusable after an earlier timeout",
                        td__coll_name(c->kind));
    if (c->error && !ctx->check) /* nobody to tell (TANDEM_MPI_CHECK=0) */
        return td__fail(c->error, "rank %d: %s", ctx->rank, c->error_msg);
    if (ctx->check) {
        int64_t hdr[TD__MPI_HDR] = {c->kind, (int64_t)c->seq, -1, 0, -1, -1, c->error};
        if (c->kind != TD__COLL_BARRIER) {
            hdr[2] = c->dtype;
            hdr[3] = (int64_t)c->count;
        }
        if (td__coll_is_reduction(c->kind)) hdr[4] = c->op;
        if (td__coll_is_rooted(c->kind)) hdr[5] = c->root;
        td_status st = td__mpi_agree(ctx, hdr, c->error_msg, timeout_s);
        if (st != TD_OK) return st;
    }
    td_status st = validate(ctx, c);
    if (st != TD_OK) return st;
    scratch s = {{NULL, NULL, NULL}};
    post_step post;
    MPI_Request req;
    td__mpi_lock();
    st = start(ctx, c, &s, &post, &req);
    td__mpi_unlock();
    if (st != TD_OK) {
        scratch_free(&s);
        return st;
    }
    char what[128];
    td__coll_describe(what, sizeof what, c->kind, c->seq, c->dtype, c->count, c->op, c->root);
    st = td__mpi_wait(ctx, &req, NULL, timeout_s, what);
    if (st != TD_OK) {
        ctx->broken = 1; /* the call may still complete into the buffers: keep scratch alive */
        return st;
    }
    if (post.reduced) {
        if (post.convert)
            narrow(post.reduced, post.result, c->dtype, post.count, post.divisor);
        else if (post.divisor > 1)
            divide(post.reduced, post.cdtype, post.count, post.divisor);
    }
    scratch_free(&s);
    return TD_OK;
}
