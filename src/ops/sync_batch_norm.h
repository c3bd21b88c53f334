/* SyncBatchNorm's per-channel arithmetic on the host, shared by its CPU kernels
 * (cpu/sync_batch_norm.c) and its kernels for other devices (sync_batch_norm_device.c): the
 * statistics and coefficients each computes from the group's sums. Sums come as one array of
 * 2 Cp + 1 doubles: C per-channel sums at 0, C more at Cp, the element count at 2 Cp. Not
 * installed. */
#ifndef TANDEM_OPS_SYNC_BATCH_NORM_H
#define TANDEM_OPS_SYNC_BATCH_NORM_H

#include "ops/op.h"

/* A forward's statistics and its map y = (x - mean_f) a + c, per channel (C each). */
typedef struct {
    double *mean, *inv; /* inv = 1 / sqrt(var + eps) */
    float *mean_f, *a, *c;
} td__sbn_stats;

/* Evaluation: the running statistics rm and rv. */
void td__sbn_eval_stats(const td__node *n, int64_t C, const float *w, const float *b,
                        const float *rm, const float *rv, td__sbn_stats *st);

/* Training: the group's sums of x and x * x (and the count); moves rm and rv. */
void td__sbn_train_stats(const td__node *n, int64_t C, int64_t Cp, const double *sums,
                         const float *w, const float *b, float *rm, float *rv, td__sbn_stats *st);

/* Backward: from the group's sums of dy and dy * (x - mean), dx = k dy + (x - mean) da + dc
 * (training; eval: dx = k dy). */
void td__sbn_backward_coefficients(int64_t C, int64_t Cp, const double *sums, const float *w,
                                   double count, int trained, const td__sbn_stats *st, float *k,
                                   float *da, float *dc);

/* The op's kernels on every backend without its own (the GPU's). */
extern const td__kernels td__sync_batch_norm_device;

#endif
