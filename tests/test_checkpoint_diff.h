/* The DDP equivalence check on programs' outputs: how far apart the f32 tensors of two
 * checkpoints are (a distributed run's and one process's on the same global batch), as a whole
 * and per tensor. Header-only; needs test.h. */
#ifndef TANDEM_TEST_CHECKPOINT_DIFF_H
#define TANDEM_TEST_CHECKPOINT_DIFF_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "tandem/checkpoint.h"

#include "test.h"

/* ||a - b|| / ||a|| over all the f32 tensors of two checkpoints together, and in *worst the
 * largest relative difference of one tensor and its name. */
static inline double checkpoint_distance(const char *pa, const char *pb, double *worst,
                                         char *worst_name, size_t cap) {
    td_checkpoint *a, *b;
    CHECK_OK(td_checkpoint_open(&a, pa));
    CHECK_OK(td_checkpoint_open(&b, pb));
    double num_all = 0, den_all = 0;
    *worst = 0;
    size_t n = td_checkpoint_count(a), compared = 0;
    CHECK_EQ(n, td_checkpoint_count(b));
    for (size_t i = 0; i < n; i++) {
        td_param info;
        CHECK_OK(td_checkpoint_tensor(a, i, &info));
        if (info.dtype != TD_F32) continue;
        float *x = malloc(info.count * sizeof *x), *y = malloc(info.count * sizeof *y);
        td_param ta = info, tb = info;
        ta.data = x;
        tb.data = y;
        CHECK_OK(td_checkpoint_read(a, &ta, 1));
        CHECK_OK(td_checkpoint_read(b, &tb, 1));
        double num = 0, den = 0;
        for (size_t k = 0; k < info.count; k++) {
            num += ((double)x[k] - y[k]) * ((double)x[k] - y[k]);
            den += (double)x[k] * x[k];
        }
        double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        if (rel > *worst) {
            *worst = rel;
            snprintf(worst_name, cap, "%s", info.name);
        }
        num_all += num;
        den_all += den;
        compared++;
        free(x);
        free(y);
    }
    CHECK(compared >= 6);
    td_checkpoint_close(a);
    td_checkpoint_close(b);
    return den_all > 0 ? sqrt(num_all / den_all) : sqrt(num_all);
}

/* Largest relative difference between the f32 tensors of two checkpoints. */
static inline double checkpoint_difference(const char *pa, const char *pb) {
    double worst;
    char name[8];
    checkpoint_distance(pa, pb, &worst, name, sizeof name);
    return worst;
}

#endif
