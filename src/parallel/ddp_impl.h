/* What the files of the reducer share: the td_ddp struct, its buckets, and the entry points of
 * deterministic mode (ddp_shard_tree.c) and uneven inputs (ddp_join.c) that ddp.c calls at
 * the steps of an iteration. Not installed. */
#ifndef TANDEM_DDP_IMPL_H
#define TANDEM_DDP_IMPL_H

#include "tandem/ddp.h"

#define DDP_SLOTS 2 /* after a bucket's gradients: the unready count, then the loss */

typedef struct {
    void *buf;       /* (count + DDP_SLOTS) of dtype: gradients at their offsets, then the slots */
    td_dtype dtype;  /* of every gradient in the bucket */
    void *wire;      /* (count + DDP_SLOTS) of comm_dtype, what travels when it differs, or NULL */
    size_t count;    /* gradient elements, alignment padding included */
    size_t *members; /* (n_members) parameter indices in layout order */
    size_t n_members;
    size_t pending;  /* members not yet ready in this backward */
    td_request *req; /* non-NULL while the all-reduce is in flight */
    uint64_t t_launch;
} ddp_bucket;

/* Deterministic mode (ddp_shard_tree.c): the gradients of the S fixed shards of a global batch
 * are summed in one fixed pairwise tree. Each level holds the layout of every bucket, padded
 * to world_size segments, and after them the tail: the buffers, the unready count and the
 * loss of a shard, summed by the same tree. */
typedef struct {
    size_t shards;      /* S */
    size_t local;       /* L = S / world_size: this rank's shards, leaves [rank L, rank L + L) */
    int levels;         /* floor(log2 L) */
    size_t shard;       /* this rank's shard of the step under way, 0 .. L-1 */
    size_t flat;        /* floats per level */
    size_t *base, *seg; /* (n_buckets + 1) where bucket k starts, its per-rank segment; tail last */
    float *mem;         /* (levels + 2) * flat */
    float **level;      /* (levels + 1): level[l] holds a node of 2^l leaves */
    float *spare;       /* an odd shard's gradients; at the step's end, the all-to-all's receive */
    float *buffers0;    /* (n_buffer_floats) the buffers at the start of the step */
    size_t n_buffer_floats;
    td_request **req; /* (n_buckets + 1) */
    size_t next_launch; /* buckets [0, next_launch) have their all-to-all queued */
} ddp_tree;

/* Uneven inputs (ddp_join.c). */
typedef struct {
    double samples;   /* td_ddp_set_samples, for this rank's next synchronised backward */
    double *all;      /* (size) every rank's samples of the step under way */
    float weight;     /* this rank's gradients are multiplied by it before the average */
    int uniform;      /* every rank has the same samples: a plain average */
    int authority;    /* the lowest rank with samples in the last step that had any */
    double total;     /* samples of the step under way over all ranks */
} ddp_join;

struct td_ddp {
    td_comm *comm;
    int rank, size;
    td_param *params; /* (n_params), the caller's array */
    size_t n_params;
    td_param *buffers; /* (n_buffers), the caller's array */
    size_t n_buffers;
    td_ddp_params opt;
    void **orig_grad;    /* (n_params) grad pointers at creation, restored by destroy */
    ddp_bucket *buckets; /* (n_buckets) */
    size_t n_buckets;
    void *grad_mem; /* every bucket's buf, from td_comm_alloc: in-place all-reduces skip a copy */
    size_t *bucket_of;      /* (n_params) */
    size_t *offset_of;      /* (n_params) element offset inside its bucket */
    unsigned char *ready;   /* (n_params) grad_ready seen in this synchronised backward */
    unsigned char *touched; /* (n_params) grad_ready seen since the last reduction */
    size_t *order;          /* (n_params) ready order of the first synchronised backward */
    size_t n_order;
    size_t next_bucket; /* buckets [0, next_bucket) are launched */
    size_t n_ready;
    int sync;
    int open;          /* an iteration began (prepare_forward or grad_ready) and is not finished */
    void **moved_from; /* (n_params) where gradient i lived before the last move, or NULL */
    void *moved_mem;   /* old bucket memory, freed once moved_from has been checked */
    int moved;         /* gradients moved since the last synchronised backward */
    float loss;        /* td_ddp_set_loss of the backward (or shard) under way */
    float loss_all;    /* the last synchronised step's reduced loss */
    ddp_tree *tree;    /* deterministic mode, or NULL */
    ddp_join *join;    /* uneven inputs, or NULL */
    td_status err;     /* first error of this backward, message kept in err_msg */
    char err_msg[768];
    td_ddp_stats stats;
};

/* Keeps the first error of a backward; later ones (usually consequences) are dropped. */
void td__ddp_note_error(td_ddp *d, td_status s);

/* Broadcasts t[0..n)'s data from `root` in a few coalesced collectives. */
td_status td__ddp_broadcast_tensors(td_ddp *d, td_param *t, size_t n, int root);

/* Assigns parameters to buckets in `order` (first bucket first_bucket_bytes, then bucket_bytes,
 * a new bucket at each change of dtype); fills each bucket's dtype, count and members and
 * bucket_of / offset_of, allocates no gradient memory. */
td_status td__ddp_plan_buckets(td_ddp *d, const size_t *order, ddp_bucket **buckets,
                               size_t *n_buckets, size_t **bucket_of, size_t **offset_of);

/* Frees n planned buckets' member lists and the array. */
void td__ddp_free_buckets(ddp_bucket *b, size_t n);

/* Moves parameter i's gradient to dst (its values copied, a canary left behind). */
void td__ddp_move_gradient(td_ddp *d, size_t i, void *dst);

/* Checks, after the first synchronised step, that nothing wrote where gradients lived before
 * DDP moved them (their old memory holds a canary), and frees old bucket memory. */
td_status td__ddp_check_moved(td_ddp *d);

/* Deterministic mode (ddp_shard_tree.c). create: checks the shard count against the world
 * size and the parameters, lays out the levels and moves the gradients there. */
td_status td__ddp_tree_create(td_ddp *d);
void td__ddp_tree_destroy(td_ddp *d);
/* Waits for the tree's collectives still in flight (before destroy copies gradients out). */
void td__ddp_tree_wait(td_ddp *d);
/* A shard begins: buffers back to the step's start (from the second shard on), gradients
 * pointed where this shard's go. */
td_status td__ddp_tree_prepare(td_ddp *d);
/* Parameter i's gradient of this shard is final: folds it into the tree; on the last shard
 * launches the buckets that became complete. */
td_status td__ddp_tree_grad_ready(td_ddp *d, size_t i);
/* A shard ends; the last one of the step reduces across ranks and leaves the result. */
td_status td__ddp_tree_finish(td_ddp *d);
/* Zeroes where the next shard's gradients go. */
void td__ddp_tree_zero_grad(td_ddp *d);

/* Uneven inputs (ddp_join.c). create allocates the state; prepare exchanges every rank's
 * samples for the step and broadcasts the buffers from the lowest rank that has any. */
td_status td__ddp_join_create(td_ddp *d);
void td__ddp_join_destroy(td_ddp *d);
td_status td__ddp_join_prepare(td_ddp *d, double samples);

#endif
