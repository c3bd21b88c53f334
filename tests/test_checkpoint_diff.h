/* The DDP equivalence check on programs' outputs: the largest relative difference between the
 * f32 tensors of two checkpoints (a distributed run's and one process's on the same global
 * batch). Header-only; needs test.h. */
#ifndef TANDEM_TEST_CHECKPOINT_DIFF_H
#define TANDEM_TEST_CHECKPOINT_DIFF_H

#include <math.h>
#include <stdlib.h>

#include "tandem/checkpoint.h"

#include "test.h"

/* Largest relative difference between the f32 tensors of two checkpoints. */
static inline double checkpoint_difference(const char *pa, const char *pb) {
    td_checkpoint *a, *b;
    CHECK_OK(td_checkpoint_open(&a, pa));
    CHECK_OK(td_checkpoint_open(&b, pb));
    double worst = 0;
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
        if (rel > worst) worst = rel;
        compared++;
        free(x);
        free(y);
    }
    CHECK(compared >= 6);
    td_checkpoint_close(a);
    td_checkpoint_close(b);
    return worst;
}

#endif
