/* Internals of the pipeline shared by src/parallel/pipeline*.c: the stage struct, its
 * micro-batch graphs ("slots"), the transfer channels and their jobs, the message header, and
 * the failure path. Not installed. */
#ifndef TANDEM_PIPELINE_IMPL_H
#define TANDEM_PIPELINE_IMPL_H

#include <pthread.h>

#include "tandem/pipeline.h"

#include "parallel/replicas.h"

#define PP_HDR 128           /* header bytes before every payload; keeps payloads 64-aligned */
#define PP_MAGIC 0x74645050u /* "PPdt" */
#define PP_TAG_ACT 101       /* activations, downstream */
#define PP_TAG_GRAD 102      /* gradients, upstream */
#define PP_TAG_TIED 103      /* deterministic mode: a micro-batch's tied gradients, downward */

/* What a message carries. */
typedef enum { PP_ACT = 1, PP_GRAD = 2, PP_EVAL = 3, PP_TIED = 4 } pp_kind;

/* The header in front of every payload: the receiver checks each field against what its own
 * schedule expects, so a stage out of step or of another shape is named, not misread. */
typedef struct {
    uint32_t magic, kind;
    int64_t step, micro_batch;
    int32_t from_stage, ndim;
    int64_t dims[TD_MAX_DIMS];
    int64_t bytes; /* payload bytes after the header */
} pp_header;

/* One transfer: a send or receive of buf[0 .. bytes) on a channel. */
typedef struct pp_job {
    unsigned char *buf;
    size_t bytes;
    int micro_batch;
    int state; /* PP_JOB_IDLE, _QUEUED, _DONE */
    td_status status;
    char error[768];
    struct pp_job *next;
} pp_job;

enum { PP_JOB_IDLE = 0, PP_JOB_QUEUED = 1, PP_JOB_DONE = 2 };

/* A thread that runs one direction's transfers to or from one peer in submission order, with
 * blocking p2p calls: while it waits it keeps the group's transfers moving (shm progress happens
 * inside calls), so a payload larger than the mailbox streams while the stage computes. */
typedef struct {
    td_comm *comm;
    int peer, tag, is_send;
    const char *what; /* "send activations" */
    td_trace *trace;
    int nice; /* the thread's nice value when it could set it, else 0 */
    pthread_t thread;
    int started, ready, stop; /* ready: the thread has set its priority */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    pp_job *head, *tail;
} pp_channel;

/* Starts the channel's thread, at nice value `nice` where allowed (0: as created). */
td_status td__pp_channel_start(pp_channel *c, td_comm *comm, int peer, int tag, int is_send,
                               const char *what, td_trace *trace, int nice);

/* The nice value the thread runs at: the one asked for, or 0 when it was not allowed. */
int td__pp_channel_nice(const pp_channel *c);

/* Lets queued jobs finish (they fail fast once the group is aborted), stops and joins. */
void td__pp_channel_stop(pp_channel *c);

/* Queues an idle job. */
void td__pp_channel_submit(pp_channel *c, pp_job *job);

/* Waits until the job is done (an idle job is done already) and makes it idle again; returns
 * its status with its message as this thread's last error. */
td_status td__pp_job_wait(pp_channel *c, pp_job *job);

/* A parameter of this stage that other stages also hold (by name: the layers of each built it
 * as the same weight, as a GPT's head reuses the token embedding). */
typedef struct {
    size_t param; /* index in the stage's parameters */
    int group;    /* its set of stages: index into tied_groups */
    uint64_t key; /* its name's hash: the order every stage of the set reduces in */
} pp_tied;

/* Deterministic mode's hand-down of tied gradients in one set of stages that tie weights: one
 * process's backward adds a tied weight's uses from the last layer back, so each micro-batch's
 * gradient of it starts on the set's highest stage, goes down to the next stage holding it,
 * which adds its own part to it as its backward runs, and so on to the lowest, whose shard tree
 * sums the micro-batches' whole gradients; after the step the lowest stage's sum is every
 * copy's. One message per micro-batch and step, of the set's tied parameters on this stage in
 * pp->tied's order (the same on every stage of the set), through a channel each way. */
typedef struct {
    td_comm *group; /* the set's stages, rank = stage order (pp->tied_groups[k]), or NULL */
    int up, down;   /* the ranks there of the next higher and lower holder, or -1 */
    size_t floats;  /* of the set's tied parameters on this stage, packed */
    pp_channel in, out;
    unsigned char **buf_in, **buf_out; /* (K) PP_HDR + floats each: per slot */
    pp_job *j_in, *j_out;              /* (K) */
    int captured; /* tied gradients of the current micro-batch copied out so far */
} pp_chain;

/* One micro-batch graph of this stage and its transfer buffers. */
typedef struct {
    td_graph *g;
    td_tensor *input;  /* (b, ...) the stage's input: images on stage 0, else activations */
    td_tensor *labels; /* (b * label_rows) i64, last stage */
    td_tensor *output; /* the stage's last layer output (the logits on the last stage) */
    td_tensor *logp, *loss;
    td_param *params, *buffers;
    size_t n_params, n_buffers;
    unsigned char *act_in, *act_out, *grad_in, *grad_out; /* PP_HDR + payload each, or NULL */
    pp_job j_act_in, j_act_out, j_grad_in, j_grad_out;
} pp_slot;

struct td_pipeline {
    td_pipeline_params opt; /* split is not kept */
    td_comm *pipe;          /* this replica's stages, rank = stage (owned, or the mesh's) */
    td_comm *dp;            /* this stage's replicas, rank = replica (owned, or the mesh's), or
                               NULL */
    td_comm *tp;            /* the stage graphs' group: the mesh's tp group, or NULL */
    int mesh_groups;        /* pipe and dp are the mesh's (opt.mesh), not owned */
    int rank, stage, P, replica, D, M;
    int64_t b;          /* micro-batch */
    int64_t label_rows; /* rows of the last stage's logits (and labels) per sample */
    size_t first_layer, last_layer, stage_first[TD_PIPELINE_MAX_STAGES + 1];
    td_shape in_shape, out_shape; /* of one micro-batch */
    size_t in_bytes, out_bytes;
    int K; /* slots */
    pp_slot *slots;
    pp_channel act_in, act_out, grad_in, grad_out;
    const td__replicas_ops *replicas; /* DDP's or ZeRO's, over dp; NULL without replicas */
    void *replicas_impl;              /* its td_ddp or td_zero (owned) */
    int *owner;    /* (slot 0's n_params) the lowest stage holding each parameter */
    pp_tied *tied; /* (n_tied) this stage's parameters that other stages hold too */
    int n_tied;
    td_comm **tied_groups; /* (n_tied_groups) the stages of each set that shares parameters,
                              rank = stage order (owned; NULL where this stage is not in it) */
    int n_tied_groups;
    int det;           /* deterministic mode (opt.ddp.deterministic): each micro-batch is one shard
                          of the replicas' shard tree, its backward one shard's */
    int cur_m;         /* the micro-batch whose backward runs */
    pp_chain *chains;  /* det mode: (n_tied_groups) the hand-down of each set's tied gradients */
    td_param *counted; /* (slot 0's n_params) scratch: the parameters a norm counts */
    td_comm *group;    /* the group given to td_pipeline_create (not owned) */
    int world;         /* its size */
    uint64_t step, evals; /* training steps and evaluations run: the headers' sequence numbers */
    struct pp_op *ops;    /* (2M) this stage's schedule */
    td_status failed;
    char failed_msg[1536];
    td_pipeline_stats stats;
};

/* Ends the pipeline after an error: keeps the first message, prefixed with this stage's place
 * (the message of a failed transfer or check is the group's own: it names a peer that died),
 * aborts the pipeline's groups so that no peer waits on this rank, and returns `s` with that
 * message. Later calls return the first error. */
td_status td__pp_fail(td_pipeline *pp, td_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* One entry of a stage's schedule: the forward or backward of micro-batch m. */
typedef struct pp_op {
    int forward;
    int m;
} pp_op;

/* "stage 1 (rank 3, replica 1)", or "stage 1 (rank 1)" without replicas: rank is the rank in
 * the group the pipeline was created on. */
void td__pp_stage_name(const td_pipeline *pp, int rank, char *out, size_t cap);

/* The step and evaluation sweeps (pipeline_schedule.c). */
td_status td__pp_run_step(td_pipeline *pp, const float *x, const int64_t *labels, float *loss);
td_status td__pp_run_eval(td_pipeline *pp, const float *x, const int64_t *labels, int64_t n,
                          double *loss_sum, int64_t *correct);

/* Finds the parameters this stage shares with others (the same name on several stages: one
 * weight tied across them), makes a group of each set of stages that shares some, and makes
 * every copy equal to the lowest stage's (pipeline_tied.c). Collective over the replica's
 * stages; a name held with different shapes is TD_ESHAPE on every rank. */
td_status td__pp_tie(td_pipeline *pp);

/* Sums each tied parameter's gradient over the stages that hold it, so that every copy steps
 * the same (the whole model's gradient of the one weight). Collective over the tied groups. */
td_status td__pp_reduce_tied(td_pipeline *pp);

/* Deterministic mode's tied gradients (pp_chain): start and stop the channels and buffers,
 * post the receive of micro-batch m, begin m's backward with the gradients the higher stages
 * handed down (the slot's graph adds its own to them), the grad-ready hook (ctx: the pipeline)
 * that copies a tied gradient out before the replicas' hook takes it and hands the micro-batch's
 * down once all are copied, wait for what is in flight, and after the step give every copy the
 * lowest stage's sum (td__pp_reduce_tied in this mode). */
td_status td__pp_chains_start(td_pipeline *pp);
void td__pp_chains_stop(td_pipeline *pp);
void td__pp_chains_post(td_pipeline *pp, int m);
td_status td__pp_chains_seed(td_pipeline *pp, int m);
void td__pp_chains_grad_ready(size_t param_index, void *pipeline);
td_status td__pp_chains_drain(td_pipeline *pp);

/* A message header for `kind` (its step: the training or evaluation count) of micro-batch m and
 * a payload of `shape`, and the receiver's check that what arrived from stage `from` is what
 * its schedule expects next (pipeline_schedule.c). */
void td__pp_put_header(const td_pipeline *pp, unsigned char *buf, pp_kind kind, int m,
                       const td_shape *shape);
td_status td__pp_check_header(td_pipeline *pp, const unsigned char *buf, pp_kind kind, int m,
                              int from, const td_shape *shape);

/* Where each stage starts (pipeline_split.c): the split names, or balanced from layer times
 * measured at micro_batch on every rank of `comm` and averaged. Collective when balancing. */
td_status td__pp_choose_split(td_comm *comm, const td_sequential *model, const char *split,
                              int stages, int64_t micro_batch, int reps, size_t *first);

#endif
