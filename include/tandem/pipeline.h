/* Pipeline parallelism: a td_sequential model cut into P consecutive stages, one per rank,
 * trained on micro-batches with the naive, GPipe or 1F1B schedule, and optionally replicated:
 * P stages x D replicas on P * D ranks, each stage's D replicas a DDP group (or a ZeRO group:
 * zero_stage).
 *
 * Ranks: rank = replica * P + stage, in the group given to td_pipeline_create. Each rank builds
 * only its stage's layers, as graphs for one micro-batch of batch / M samples that share
 * parameter and gradient storage: one graph per micro-batch whose activations must be alive at
 * once (GPipe M, 1F1B min(M, P - stage), naive 1). A stage's input takes a gradient, and its
 * backward hands that gradient upstream. Activations go downstream and gradients upstream with
 * a small header (step, micro-batch, shape) through per-direction transfer threads over
 * td_comm p2p, so they move while the stage computes.
 *
 * Schedules (PyTorch's names):
 *  - naive: the whole batch as one micro-batch, stage after stage (model parallelism as
 *    PyTorch's model-parallel tutorial splits a ResNet-50: at any moment one stage works and
 *    the others wait);
 *  - GPipe: forwards of micro-batches 0..M-1, then their backwards; bubble (P-1)/(M+P-1);
 *  - 1F1B (PipeDream-flush): P - stage - 1 warm-up forwards, then one forward and one backward
 *    in turn, then the remaining backwards; the same bubble with at most P - stage
 *    micro-batches' activations alive.
 * Every schedule accumulates the micro-batches' gradients (each loss scaled by 1/M, so the sum
 * is the batch mean's gradient) and ends the step with the gradient of the whole batch, averaged
 * over replicas; the caller then runs its optimizer on td_pipeline_parameters. Gradients need
 * no zeroing: the first backward of a step writes them.
 *
 * Batch norm normalises each micro-batch with its own statistics and updates the running ones
 * micro-batch by micro-batch in order (as torch.distributed.pipelining does). Dropout draws each
 * micro-batch's masks from a stream of (seed, stage, step, micro-batch), so every schedule gives
 * the same masks and a run replays bit for bit.
 *
 * Tied parameters (Megatron-LM's shared word embedding): a parameter of one name on several
 * stages is one weight that the stages' layers each hold, as a GPT's output projection reuses
 * its token embedding (td_gpt_sequential: the head, built without the embedding, holds its own
 * copy). td_pipeline_create finds them, makes every copy equal to the lowest stage's, and each
 * step ends by summing each such weight's gradient over the stages that hold it, so that every
 * copy holds the whole model's gradient and, stepped by the same optimizer, stays equal.
 * td_pipeline_clip_grad_norm is the whole model's gradient norm across stages, counting a tied
 * weight once.
 *
 * Mixed precision (graph.amp in the params) works inside each stage; activations and their
 * gradients cross stages in f32. td_pipeline_step applies no loss scale, which bf16 does not
 * need; f16 levels would need one and are not scaled here.
 *
 * Errors: td_pipeline_create checks, on every rank, that all ranks agree on the model and the
 * options and that the activations crossing each cut have the same shape on every rank
 * (TD_ESHAPE naming the cut and both shapes). Every td_pipeline_step begins with a check on the
 * group it was created on (td_comm_agree) that every rank starts the same call, so a rank that
 * issues another collective on that group, or another pipeline call, fails at once on every
 * rank with both calls named (TD_EMISMATCH), as does a dead rank (TD_EPEER, the group naming
 * it); td_pipeline_evaluate checks the same among its replica's stages (with one replica, on
 * that group too). Any error in a step ends the pipeline's groups
 * (td_comm_abort) so that no rank waits for it: every rank's error names its stage, what it was
 * doing and the group's own message. Destroy a pipeline after an error. Not thread-safe: drive
 * it from one thread. It does not own the group it is given (which must outlive it), the model
 * description, or an optimizer. */
#ifndef TANDEM_PIPELINE_H
#define TANDEM_PIPELINE_H

#include "tandem/comm.h"
#include "tandem/core.h"
#include "tandem/ddp.h"
#include "tandem/graph.h"
#include "tandem/mesh.h"
#include "tandem/nn.h"
#include "tandem/param.h"
#include "tandem/trace.h"
#include "tandem/zero.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most stages of one pipeline. */
#define TD_PIPELINE_MAX_STAGES 16

/* An opaque pipeline stage: this rank's part of the pipeline. */
typedef struct td_pipeline td_pipeline;

/* How micro-batches flow through the stages. */
typedef enum {
    TD_SCHEDULE_NAIVE = 0,
    TD_SCHEDULE_GPIPE = 1,
    TD_SCHEDULE_1F1B = 2,
} td_pipeline_schedule;

/* Options of td_pipeline_create; fill with td_pipeline_default_params. Every rank must pass
 * the same values (checked). */
typedef struct {
    td_pipeline_schedule schedule;
    int stages;            /* P >= 1; the group holds P * replicas ranks */
    int micro_batches;     /* M >= 1 (the naive schedule uses 1) */
    int64_t batch;         /* samples per step per replica, a multiple of M */
    const char *split;     /* where stages 1.. start: "layer3" (P = 2) or "layer2,layer4" (P = 3),
                              each a td_sequential_find name; NULL: balanced from measured time */
    uint64_t seed;         /* parameter initialisation and the dropout streams */
    int balance_reps;      /* timed forward+backward runs per layer when balancing */
    int transfer_nice;     /* nice value of the transfer threads (-10; 0: as created). They sleep
                              almost always, but when data moves they must run at once, not after
                              the compute thread's time slice; raising them needs CAP_SYS_NICE or
                              RLIMIT_NICE, and without it they stay as they are */
    td_graph_params graph; /* options of the stage graphs (conv_winograd, arena blocks) */
    td_ddp_params ddp;     /* the replicas' DDP, when there is more than one replica */
    int zero_stage;        /* 0: each stage's replicas are a DDP group; 1, 2, 3: a ZeRO group
                              of that stage (tandem/zero.h: ddp's options, default units) whose
                              shards td_pipeline_parameters gives; at stage 3 an evaluation
                              gathers parameters too, so every replica evaluates alike */
    td_trace *trace;       /* NULL, or where forward, backward and transfer spans are recorded */
    const td_mesh *mesh;   /* NULL: the group is cut into stages x replicas as above; else a
                              mesh over that group with a "pp" dimension of `stages`: its pp
                              groups are the pipelines, its dp groups the replicas and its tp
                              group every stage graph's group (graph.comm), so the stages of a
                              tensor-parallel model (td_gpt_params.tensor_parallel) are split
                              over tp; the mesh must outlive the pipeline, and an error ends
                              its pp and dp groups as it ends the pipeline's own */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64 - sizeof(const td_mesh *)];
} td_pipeline_params;

/* 1F1B, 2 stages, 4 micro-batches, batch 128, balanced split, seed 0, 5 reps, transfer
 * threads at nice -10, the graph's and DDP's defaults, no trace. */
td_pipeline_params td_pipeline_default_params(void);

/* Where this rank sits and what it holds. */
typedef struct {
    int stage, stages;     /* this rank's stage of P */
    int replica, replicas; /* this rank's replica of D */
    int micro_batches;     /* M as run (1 for the naive schedule) */
    int64_t micro_batch;   /* samples per micro-batch */
    size_t first_layer;    /* this stage holds layers [first_layer, last_layer) */
    size_t last_layer;
    size_t stage_first[TD_PIPELINE_MAX_STAGES + 1]; /* every stage's first layer, then count */
    int graphs;                                     /* micro-batch graphs this stage keeps */
    int tied_params;   /* this stage's parameters that other stages hold too (tied) */
    int transfer_nice; /* the transfer threads' nice value (0 when it could not be set) */
} td_pipeline_info;

/* Measurements of the last step on this rank (td_time_ns clock, shared by a host's ranks). */
typedef struct {
    uint64_t steps;               /* steps run so far */
    uint64_t start_ns, end_ns;    /* the last step's start and end on this rank */
    uint64_t busy_ns;             /* forward and backward compute in it */
    uint64_t wait_ns;             /* waiting for activations, gradients or send buffers */
    uint64_t sync_ns;             /* waiting for the replicas' gradient all-reduce at the end */
    int peak_in_flight;           /* most micro-batches forwarded and not yet backwarded at once */
    size_t activation_bytes;      /* memory one micro-batch graph holds apart from parameters and
                                     their gradients: activations, their gradients, workspaces */
    size_t peak_activation_bytes; /* peak_in_flight * activation_bytes */
} td_pipeline_stats;

/* Collective over `comm`: splits it into pipeline and replica groups, decides the cut (the
 * split names, or measured layer times averaged over every rank and td_pipeline_balance),
 * builds this stage's micro-batch graphs from `model`, checks that every rank agrees (options,
 * model, the shapes crossing each cut) and, with replicas, creates the stage's DDP (which
 * broadcasts replica 0's parameters). `p` may be NULL for the defaults. */
td_status td_pipeline_create(td_pipeline **out, td_comm *comm, const td_sequential *model,
                             const td_pipeline_params *p);

/* Waits for transfers in flight, frees the stage's graphs, DDP, threads and groups. */
void td_pipeline_destroy(td_pipeline *pp);

/* One training step on a batch of p->batch samples: x (batch, sample...) f32 is read on stage
 * 0 and labels on the last stage (either may be NULL elsewhere), one i64 per row of the last
 * layer's (rows, classes) logits as td_model_build_sequential takes them: (batch) for a
 * classifier, (batch * T) for a GPT's sequences of T. Leaves the batch mean's gradient
 * (averaged over replicas, summed over the stages of a tied parameter) in
 * td_pipeline_parameters' grads, and the mean loss over the batch's rows in *loss on the last
 * stage (NaN on the others; loss may be NULL). Collective over the pipeline's ranks. */
td_status td_pipeline_step(td_pipeline *pp, const float *x, const int64_t *labels, float *loss);

/* Forward only, in eval mode (batch norm's running statistics, no dropout), over the first n
 * <= batch samples of x and their labels (one per row, as td_pipeline_step), pipelined in
 * micro-batches. On the last stage sets *loss_sum to the cross-entropy summed over the rows and
 * *correct to the number of rows whose argmax is the label (zero on the other stages). Training
 * mode returns afterwards. Collective over the stages of this rank's replica (each replica may
 * evaluate its own batches). */
td_status td_pipeline_evaluate(td_pipeline *pp, const float *x, const int64_t *labels, int64_t n,
                               double *loss_sum, int64_t *correct);

/* This stage's parameters (those an optimizer steps: with zero_stage, this rank's shards of
 * them, td_zero_parameters) and buffers, owned by the pipeline; the array is stable, and grads
 * are read afresh as ddp.h says. */
td_status td_pipeline_parameters(td_pipeline *pp, td_param **params, size_t *n);
td_status td_pipeline_buffers(td_pipeline *pp, td_param **buffers, size_t *n);

/* The lowest stage holding this stage's parameter i (td_pipeline_parameters' order): this
 * stage for a parameter of its own, or another for a tied one this stage holds a copy of
 * (write or count each tied weight once, on its owner). -1 for an i out of range. */
int td_pipeline_param_owner(const td_pipeline *pp, size_t i);

/* torch.nn.utils.clip_grad_norm_ over the whole model's gradients across the stages (each
 * tied weight counted once): every stage gets the same norm and scales its gradients by the
 * same max_norm / (norm + 1e-6) when that is below 1. Call it after td_pipeline_step and before
 * the optimizer. Collective over the stages of this rank's replica; total_norm may be NULL. */
td_status td_pipeline_clip_grad_norm(td_pipeline *pp, double max_norm, double *total_norm);

/* This rank's place in the pipeline. */
td_pipeline_info td_pipeline_get_info(const td_pipeline *pp);

/* Measurements of the last step. */
td_pipeline_stats td_pipeline_get_stats(const td_pipeline *pp);

/* "naive", "gpipe", "1f1b". */
const char *td_pipeline_schedule_name(td_pipeline_schedule schedule);

/* Parses a schedule name; TD_EINVAL names the bad string. */
td_status td_pipeline_schedule_parse(const char *name, td_pipeline_schedule *out);

/* Seconds of one forward + backward of each layer of `model` alone at batch `micro_batch`
 * (the fastest of `reps` timed runs after one warm-up: a busy machine only adds time), into
 * seconds[0 .. count). Local. */
td_status td_pipeline_profile_layers(const td_sequential *model, int64_t micro_batch, int reps,
                                     double *seconds);

/* Cuts n_layers layers of the given costs into `stages` consecutive non-empty runs so that the
 * largest run's total is as small as it can be; first[s] is where stage s starts. */
td_status td_pipeline_balance(const double *cost, size_t n_layers, int stages, size_t *first);

#ifdef __cplusplus
}
#endif
#endif
