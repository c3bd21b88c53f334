/* td_dp: DataParallel as torch.nn.DataParallel runs it, to measure why DDP replaced it.
 *
 * One process holds n_devices replicas of a model, one td_graph each, driven by one worker
 * thread per replica pinned to its "device" (a core: worker d runs on the d % ncores-th core
 * the process may use). The calling thread coordinates, and each td_dp_step does the eight
 * steps of torch.nn.DataParallel in order:
 *   (1) replicate: copy replica 0's parameters and buffers out to the other replicas;
 *   (2) scatter: the batch lands on replica 0, then each replica gets its slice of images and
 * labels; (3) parallel forward of every replica (one per worker thread); (4) gather every replica's
 * output (log-probabilities) onto replica 0; (5) loss on replica 0: mean NLL over the whole
 * gathered batch, and its output gradient; (6) scatter the output gradient back and run every
 * replica's backward in parallel; (7) reduce (sum) every replica's parameter gradients onto replica
 * 0; (8) one SGD step on replica 0's parameters. With models whose forward is per-sample (no
 * BatchNorm, no dropout) the result equals single-process training on the global batch. BatchNorm
 * normalises each replica's slice with that slice's statistics and only replica 0's running
 * statistics survive step (1), exactly as in PyTorch's DataParallel; each replica's dropout RNG is
 * seeded with seed + d. A device is one core: run with OMP_NUM_THREADS=1, or every pinned worker's
 * oneDNN calls start an OpenMP team that spins on that single core.
 *
 * DDP2 (PyTorch Lightning's name for "DataParallel inside a node, DDP across nodes"):
 * with params.comm set to a group of one process per host, replica 0's parameters are wrapped in
 * a td_ddp over that group: rank 0's parameters and buffers win at creation, and in step (7) each
 * parameter's gradient, once summed over the replicas, is handed to DDP, whose buckets are
 * all-reduced across hosts while the rest are still being summed; the optimizer then steps on
 * the average over every host's batch. td_dp_create and td_dp_step are then collective over
 * comm. Without comm it does not overlap communication with compute, shard anything or span
 * processes: that is td_ddp's job (ddp.h). */
#ifndef TANDEM_DP_H
#define TANDEM_DP_H

#include "tandem/comm.h"
#include "tandem/core.h"
#include "tandem/ddp.h"
#include "tandem/graph.h"
#include "tandem/nn.h"
#include "tandem/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A DataParallel trainer (opaque): owns its replicas' graphs, worker threads and optimizer. */
typedef struct td_dp td_dp;

/* Builds one replica into the empty graph `g` for `batch` samples and compiles it; fills
 * out->input (batch, ...) f32, out->labels (batch) i64 and out->output (batch, classes)
 * log-probabilities (kind and loss are ignored). Called once per replica, on that replica's
 * worker thread (oneDNN primitives must run on the thread that created them), one replica at
 * a time, with the same `ctx`; every replica must register the same parameters. */
typedef td_status (*td_dp_build_fn)(td_graph *g, int64_t batch, int replica, void *ctx,
                                    td_model *out);

/* Options of td_dp_create; fill with td_dp_default_params. */
typedef struct {
    int n_devices;         /* replicas, one worker thread each (2) */
    int64_t global_batch;  /* samples per step, split evenly: n_devices must divide it (128) */
    td_model_kind model;   /* the reference model built when build is NULL (TD_MODEL_MLP) */
    uint64_t seed;         /* initialisation seed given to td_model_build (0); replica d's
                              dropout stream is seeded with seed + d */
    td_dp_build_fn build;  /* NULL: td_model_build(model) */
    void *build_ctx;       /* passed to build */
    td_graph_params graph; /* every replica's graph: td_graph_default_params(); its amp level
                              (mixed precision) holds for every replica, its seed is replaced
                              as above and gradients are always enabled */
    const td_device *devices; /* (n_devices) where replica d trains, as DataParallel's
                                 device_ids (cuda:0, cuda:1, ...; one GPU may hold several);
                                 NULL: every replica on graph.device. Copied at creation */
    td_sgd_params sgd;     /* step (8): td_sgd_default_params() */
    int pin_threads;       /* 1: pin worker d to a core; 0: leave placement to the OS */
    td_comm *comm;         /* DDP2: NULL, or one process per host whose gradients DDP averages;
                              global_batch is then each host's share */
    td_ddp_params ddp;     /* DDP2's options (bucket sizes, comm_dtype, ...):
                              td_ddp_default_params() */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_dp_params;

/* n_devices 2, global_batch 128, the MLP, seed 0, default graph and DDP options, SGD defaults,
 * pinned threads, no comm. */
td_dp_params td_dp_default_params(void);

/* Builds n_devices replicas, starts their worker threads and the optimizer over replica 0's
 * parameters. TD_EINVAL names a bad option; a builder's error is returned as it is. */
td_status td_dp_create(td_dp **out, const td_dp_params *params);

/* Stops the worker threads and frees every replica; NULL-safe. */
void td_dp_destroy(td_dp *dp);

/* One training iteration, steps (1) to (8). images: global_batch samples in the input's
 * shape (f32, plain order); labels: global_batch class indices. loss (may be NULL) receives
 * the mean NLL over the global batch. A label outside [0, classes) is TD_EINVAL naming it. */
td_status td_dp_step(td_dp *dp, const float *images, const int64_t *labels, float *loss);

/* The number of replicas. */
int td_dp_replicas(const td_dp *dp);

/* Replica `replica`'s graph (replica 0's parameters are the trained ones), or NULL. */
td_graph *td_dp_graph(td_dp *dp, int replica);

/* Replica `replica`'s model tensors (batch is global_batch / n_devices), or NULL. */
const td_model *td_dp_model(const td_dp *dp, int replica);

/* Where one replica's memory goes; every field is bytes held for the whole run. */
typedef struct {
    size_t param_bytes;     /* parameters and buffers (each replica holds a full copy) */
    size_t graph_bytes;     /* td_graph_memory_bytes: activations and gradients */
    size_t input_bytes;     /* its image and label slice; replica 0 also the whole batch */
    size_t output_bytes;    /* its output-gradient slice; replica 0 also gathered outputs+grads */
    size_t reduce_bytes;    /* replica 0: the buffer other replicas' gradients are copied into */
    size_t optimizer_bytes; /* replica 0: the optimizer's state (momentum buffers) */
    size_t total_bytes;     /* the sum of the above */
} td_dp_memory;

/* Fills `out` for replica `replica`; TD_EINVAL names a bad index. */
td_status td_dp_memory_stats(const td_dp *dp, int replica, td_dp_memory *out);

/* The eight steps, for td_dp_phase_seconds. */
typedef enum {
    TD_DP_REPLICATE = 0,
    TD_DP_SCATTER,
    TD_DP_FORWARD,
    TD_DP_GATHER,
    TD_DP_LOSS,
    TD_DP_BACKWARD, /* scatter of the output gradient and the parallel backward */
    TD_DP_REDUCE,   /* with comm: also the all-reduce across hosts left after the sums */
    TD_DP_OPTIMIZER,
    TD_DP_PHASE_COUNT
} td_dp_phase;

/* Wall seconds spent in each step since creation, summed over td_dp_step calls. */
void td_dp_phase_seconds(const td_dp *dp, double seconds[TD_DP_PHASE_COUNT]);

/* "replicate", "scatter", "forward", "gather", "loss", "backward", "reduce", "optimizer". */
const char *td_dp_phase_name(td_dp_phase phase);

#ifdef __cplusplus
}
#endif
#endif
