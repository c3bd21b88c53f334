/* What the example's two modes share: one process or data-parallel training (main.c) and
 * pipeline-parallel training (pipeline.c, entered from main.c when the command line has
 * --pipeline): the options, the text, the learning-rate schedule, the baseline and the sample. */
#ifndef GPT_GPT_H
#define GPT_GPT_H

#include <stdio.h>
#include <stdlib.h>

#include "tandem/tandem.h"

/* A library call that must succeed: print the call, its status and message, and exit 1. */
#define CHECK(call)                                                                        \
    do {                                                                                   \
        td_status check_s_ = (call);                                                       \
        if (check_s_ != TD_OK) {                                                           \
            fprintf(stderr, "gpt: %s failed: %s: %s\n", #call, td_status_string(check_s_), \
                    td_last_error());                                                      \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

typedef struct {
    td_gpt_params model;
    int batch; /* global, in sequences */
    long steps, warmup, eval_every, eval_batches, checkpoint_every, sample, stop_at;
    double lr;
    uint64_t seed;
    const char *data, *checkpoint, *resume, *prompt;
    int amp, deterministic, shards, resume_auto;
    int zero;           /* 0: DDP; 1, 2, 3: the ZeRO stage (--zero) */
    const char *device; /* --device: "cpu", "cuda" (this rank's GPU) or "cuda:N" */
    int pipeline;       /* --pipeline given: the schedule, stages, micro-batches and cut below */
    td_pipeline_schedule schedule;
    int stages, micro;
    const char *split; /* NULL: balanced from measured time */
    int tp;            /* --tp: tensor-parallel ranks (0: TANDEM_TP, tandemrun --tp; else 1) */
    int sp;            /* --sequence-parallel */
    int tp_shards;     /* --tp-shards: deterministic mode's fixed shards of every tensor-parallel
                          layer (td_graph_params.tp_shards; 4 by default), 0 without */
    td_recompute_mode recompute; /* --recompute none|full|selective */
} options;

/* Loads --data and keeps its first 90% for training (*n_train bytes); returns the number of
 * training windows, exiting when they are fewer than one global batch. */
size_t gpt_load_text(const options *o, td_corpus *text, size_t *n_train);

/* The whole GPT for `batch` sequences into an empty graph, compiled, as a td_model. */
void gpt_build(const options *o, td_graph *g, int64_t batch, td_model *m);

/* The run's shape as checkpoint metadata: what a resumed run must share with it. */
void gpt_run_meta(const options *o, char *out, size_t cap);

/* Reads the checkpoint's step (and refuses a checkpoint of another run's shape, exiting): the
 * --resume file, or with --resume auto the --checkpoint file if there is one; 0 when there is
 * nothing to resume. *path gets the file resumed from. */
long gpt_resume_step(const options *o, const char **path);

/* The run's first line: the model, the world and the options. */
void gpt_banner(const options *o, int world, const char *more);

/* Cross-entropy of the validation text under the training text's byte frequencies (add-one). */
double gpt_unigram_baseline(const td_corpus *text, size_t n_train);

/* AdamW as the run steps it: --lr, betas 0.9 and 0.95, weight decay 0.1. */
td_adamw_params gpt_adamw(const options *o);

/* The learning rate of step `step`: a linear warm-up, then a cosine decay to a tenth. */
double gpt_lr_at(const options *o, long step);

/* Prints --sample bytes continuing --prompt, drawn from a whole model built for one sequence
 * (on any device: its input is written and its output read through copies). */
void gpt_sample(const options *o, td_graph *eval, const td_model *m);

/* The device mesh of a launched run: pp (the pipeline's stages, or 1) x dp x tp (--tp, or
 * TANDEM_TP), torchtitan's order; exits naming a layout that does not fit the world. With
 * --deterministic every layout trains to the same bits (docs/parallelism.md). */
td_mesh *gpt_mesh(const options *o, td_comm *comm);

/* The whole model on rank 0 built for one sequence (for the sample and the digest) from what
 * the ranks hold (td_mesh_gather_model); *g is NULL elsewhere. */
void gpt_whole_model(const options *o, td_mesh *mesh, const td_param *params, size_t n,
                     td_graph **g, td_model *m);

/* The pipeline mode's main (pipeline.c). */
int gpt_pipeline_main(const options *o);

#endif
