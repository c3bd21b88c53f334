/* Reference embeddings: the token lookup table[idx] with its scatter-add backward, and the
 * learned position embedding added to each sequence. */
#include <string.h>

#include "ops/ref/ref.h"

void td__ref_embedding_forward(float *y, const int64_t *idx, const float *table, size_t n, int C) {
    for (size_t i = 0; i < n; i++) memcpy(y + i * C, table + idx[i] * C, (size_t)C * sizeof *y);
}

void td__ref_embedding_backward(float *dtable, const float *dy, const int64_t *idx, size_t n, int V,
                                int C) {
    for (size_t i = 0; i < (size_t)V * C; i++) dtable[i] = 0.f;
    for (size_t i = 0; i < n; i++)
        for (int c = 0; c < C; c++) dtable[idx[i] * C + c] += dy[i * C + c];
}

void td__ref_position_embedding_forward(float *y, const float *x, const float *table, int S, int T,
                                        int C) {
    for (size_t s = 0; s < (size_t)S; s++)
        for (size_t t = 0; t < (size_t)T; t++)
            for (int c = 0; c < C; c++) {
                size_t at = (s * T + t) * C + c;
                y[at] = x[at] + table[t * C + c];
            }
}

void td__ref_position_embedding_backward(float *dtable, const float *dy, int S, int T, int C) {
    for (size_t t = 0; t < (size_t)T; t++)
        for (int c = 0; c < C; c++) {
            double sum = 0.0;
            for (size_t s = 0; s < (size_t)S; s++) sum += dy[(s * T + t) * C + c];
            dtable[t * C + c] = (float)sum;
        }
}
