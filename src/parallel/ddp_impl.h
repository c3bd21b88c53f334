/* What the files of td_ddp share: the td_ddp struct (the front's state, the bucket layout and
 * the reducer's table and state), and the front's pieces a reducer may use: the bucket layout
 * and moving gradients into it (ddp_layout.c), running the buckets' collectives in order
 * (ddp_buckets.c), the buffer broadcast, the error of the backward and the unused-parameter rule
 * (ddp.c), and uneven inputs (ddp_join.c). Not installed. */
#ifndef TANDEM_DDP_IMPL_H
#define TANDEM_DDP_IMPL_H

#include "parallel/reducer.h"

#define DDP_SLOTS 2 /* after a bucket's gradients: the unready count, then the loss */

typedef struct {
    void *buf;       /* (count + DDP_SLOTS) of dtype: gradients at their offsets, then the slots */
    td_dtype dtype;  /* of every gradient in the bucket */
    void *wire;      /* (count + DDP_SLOTS) of comm_dtype, what travels when it differs, or NULL */
    size_t count;    /* gradient elements, alignment padding included */
    size_t *members; /* (n_members) parameter indices in layout order */
    size_t n_members;
    size_t pending;  /* members not yet ready in this backward */
    td_request *req; /* non-NULL while the bucket's collective is in flight */
    uint64_t t_launch;
} ddp_bucket;

/* Uneven inputs (ddp_join.c). */
typedef struct {
    double samples; /* td_ddp_set_samples, for this rank's next synchronised backward */
    double *all;    /* (size) every rank's samples of the step under way */
    float weight;   /* this rank's gradients are multiplied by it before the average */
    int uniform;    /* every rank has the same samples: a plain average */
    int authority;  /* the lowest rank with samples in the last step that had any */
    double total;   /* samples of the step under way over all ranks */
} ddp_join;

struct td_ddp {
    td_comm *comm;
    td_device device; /* where every parameter, gradient and buffer is (ddp_memory.c) */
    int rank, size;
    td_param *params; /* (n_params), the caller's array */
    size_t n_params;
    td_param *buffers; /* (n_buffers), the caller's array */
    size_t n_buffers;
    td_ddp_params opt;
    const td__ddp_reducer *reducer;
    void *reducer_ctx;   /* what the creator gave the reducer (td__ddp_create_with), or NULL */
    void *state;         /* the reducer's */
    void **orig_grad;    /* (n_params) grad pointers at creation, restored by destroy */
    size_t *order;       /* (n_params) the layout order: reverse registration, then rebuilt */
    ddp_bucket *buckets; /* (n_buckets) the layout */
    size_t n_buckets;
    size_t *bucket_of;      /* (n_params) */
    size_t *offset_of;      /* (n_params) element offset inside its bucket */
    unsigned char *ready;   /* (n_params) grad_ready seen in this synchronised backward */
    unsigned char *touched; /* (n_params) grad_ready seen since the last reduction */
    size_t n_ready;
    int sync;
    int open; /* an iteration began (prepare_forward or grad_ready) and is not finished */
    size_t shard_first, shard_count; /* td_ddp_shards */
    void **moved_from; /* (n_params) where gradient i lived before the last move, or NULL */
    void *moved_mem;   /* td_comm_alloc memory gradients left, freed once moved_from is checked */
    int moved;         /* gradients moved since the last synchronised backward */
    float loss;        /* td_ddp_set_loss of the backward (or shard) under way */
    float loss_all;    /* the last synchronised step's reduced loss */
    ddp_join *join;    /* uneven inputs, or NULL */
    td_status err;     /* first error of this backward, message kept in err_msg */
    char err_msg[768];
    td_ddp_stats stats;
};

/* Gradient memory on d->device (ddp_memory.c): bucket blocks (group memory on the CPU, device
 * memory on a GPU), zeroing, copies, dtype conversion, scaling, one element in or out (out
 * waits for the device), the canary's fill and the check that it is still there. */
td_status td__ddp_mem_alloc(td_ddp *d, size_t bytes, void **out);
/* The one device of every parameter and buffer, or TD_EINVAL naming one elsewhere. */
td_status td__ddp_device(const td_param *params, size_t n_params, const td_param *buffers,
                         size_t n_buffers, td_device *out);
/* Local working memory on d->device (not group memory). */
td_status td__ddp_mem_scratch(td_ddp *d, size_t bytes, void **out);
void td__ddp_mem_scratch_free(td_ddp *d, void *p);
void td__ddp_mem_free(td_ddp *d, void *p);
td_status td__ddp_mem_zero(td_ddp *d, void *p, size_t bytes);
td_status td__ddp_mem_copy(td_ddp *d, void *dst, const void *src, size_t bytes);
td_status td__ddp_mem_convert(td_ddp *d, void *dst, td_dtype dt, const void *src, td_dtype st,
                              size_t n);
td_status td__ddp_mem_put(td_ddp *d, void *p, td_dtype dt, size_t i, double v);
double td__ddp_mem_get(td_ddp *d, const void *p, td_dtype dt, size_t i);
td_status td__ddp_mem_scale(td_ddp *d, void *p, td_dtype dt, size_t n, float w);
td_status td__ddp_mem_fill(td_ddp *d, void *p, uint32_t bits, int size, size_t n);
int td__ddp_mem_holds(td_ddp *d, const void *p, uint32_t bits, int size, size_t n);
/* td_ddp_create with the reducer chosen by the caller: a strategy built on DDP's front (ZeRO's
 * sharded reducer lays gradients out by ZeRO's units, given as reducer_ctx). */
td_status td__ddp_create_with(td_ddp **out, td_comm *comm, td_param *params, size_t n_params,
                              td_param *buffers, size_t n_buffers, const td_ddp_params *p,
                              const td__ddp_reducer *reducer, void *reducer_ctx);

/* Keeps the first error of a backward; later ones (usually consequences) are dropped. */
void td__ddp_note_error(td_ddp *d, td_status s);

/* The error of the backward, returned with its message; the iteration's error is cleared. */
td_status td__ddp_take_error(td_ddp *d);

/* A synchronised backward is over: no parameter ready, no error, no iteration open. */
void td__ddp_end_iteration(td_ddp *d);

/* Parameter i's gradient is about to be written by backward (a trainer that says so: td_zero's
 * TD_PARAM_BEFORE_BACKWARD): the reducer's before_backward, in a synchronised iteration. */
void td__ddp_before_backward(td_ddp *d, size_t i);

/* Broadcasts t[0..n)'s data from `root` in a few coalesced collectives. */
td_status td__ddp_broadcast_tensors(td_ddp *d, td_param *t, size_t n, int root);

/* The buffers become the same on every rank at the start of a synchronised iteration: from
 * rank 0 (join: the lowest rank with data), when broadcast_buffers. Collective. */
td_status td__ddp_sync_buffers(td_ddp *d);

/* TD_EUNUSED naming the parameters this rank never marked ready (n_unready of them), or saying
 * that unready_all parameters of other ranks were (when this rank had none). */
td_status td__ddp_unused_error(const td_ddp *d, size_t n_unready, double unready_all);

/* Assigns parameters to buckets in `order` (the first bucket at most first_bucket_bytes and
 * never more than bucket_bytes, then bucket_bytes, a new bucket at each change of dtype); fills
 * each bucket's dtype, count and members and bucket_of / offset_of, allocates no gradient
 * memory (ddp_layout.c). */
td_status td__ddp_plan_buckets(td_ddp *d, const size_t *order, ddp_bucket **buckets,
                               size_t *n_buckets, size_t **bucket_of, size_t **offset_of);

/* Frees n planned buckets' member lists and the array. */
void td__ddp_free_buckets(ddp_bucket *b, size_t n);

/* Moves parameter i's gradient to dst (its values copied, a canary left behind). */
void td__ddp_move_gradient(td_ddp *d, size_t i, void *dst);

/* Checks, after the first synchronised step, that nothing wrote where gradients lived before
 * DDP moved them (their old memory holds a canary), and frees moved_mem. */
td_status td__ddp_check_moved(td_ddp *d);

/* Running a reducer's bucket collectives (ddp_buckets.c). Launches, from bucket *next up to
 * (not including) bucket upto, the buckets whose gradients are all ready (pending 0), in bucket
 * order, each counted as launched early; *next moves past them. */
void td__ddp_launch_ready(td_ddp *d, size_t *next, size_t upto,
                          void (*launch)(td_ddp *d, size_t k));

/* Bucket k's collective was started with status s: on failure it has no request and the error
 * is the backward's. */
void td__ddp_bucket_started(td_ddp *d, size_t k, td_status s);

/* Ends the collectives of buckets [0, upto) still in flight, in launch order: those finished
 * (wait 0, stopping at the first still running) or all of them (wait 1); done(d, k, status) is
 * what the reducer does when one ends. */
void td__ddp_complete_buckets(td_ddp *d, size_t upto, int wait,
                              void (*done)(td_ddp *d, size_t k, td_status s));

/* Uneven inputs (ddp_join.c). create allocates the state; prepare exchanges every rank's
 * samples for the step. */
td_status td__ddp_join_create(td_ddp *d);
void td__ddp_join_destroy(td_ddp *d);
td_status td__ddp_join_prepare(td_ddp *d, double samples);

#endif
