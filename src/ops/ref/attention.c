/* Reference causal multi-head self-attention (llm.c's attention_forward / _backward, in
 * double): scores q.k / sqrt(hs) for keys up to the query's position, softmax, weighted sum of
 * values; backward through the stored probabilities of one row at a time. */
#include <math.h>
#include <stdlib.h>

#include "ops/ref/ref.h"

/* Probabilities p[0..t] of query t of (b, head h). */
static void row_probs(double *p, const float *qkv, int b, int t, int h, int T, int C, int NH) {
    int hs = C / NH;
    const float *q = qkv + ((size_t)b * T + t) * 3 * C + h * hs;
    double scale = 1.0 / sqrt((double)hs), m = -INFINITY, sum = 0.0;
    for (int s = 0; s <= t; s++) {
        const float *k = qkv + ((size_t)b * T + s) * 3 * C + C + h * hs;
        double d = 0.0;
        for (int i = 0; i < hs; i++) d += (double)q[i] * k[i];
        p[s] = d * scale;
        if (p[s] > m) m = p[s];
    }
    for (int s = 0; s <= t; s++) sum += p[s] = exp(p[s] - m);
    for (int s = 0; s <= t; s++) p[s] /= sum;
}

void td__ref_attention_forward(float *y, const float *qkv, int B, int T, int C, int NH) {
    int hs = C / NH;
    double *p = malloc((size_t)T * sizeof *p);
    if (!p) return;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < NH; h++) {
                row_probs(p, qkv, b, t, h, T, C, NH);
                for (int i = 0; i < hs; i++) {
                    double o = 0.0;
                    for (int s = 0; s <= t; s++)
                        o += p[s] * qkv[((size_t)b * T + s) * 3 * C + 2 * C + h * hs + i];
                    y[((size_t)b * T + t) * C + h * hs + i] = (float)o;
                }
            }
    free(p);
}

void td__ref_attention_backward(float *dqkv, const float *dy, const float *qkv, int B, int T, int C,
                                int NH) {
    int hs = C / NH;
    double scale = 1.0 / sqrt((double)hs);
    double *p = malloc((size_t)T * sizeof *p), *dp = malloc((size_t)T * sizeof *dp);
    double *acc = calloc((size_t)B * T * 3 * C, sizeof *acc);
    if (!p || !dp || !acc) goto done;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < NH; h++) {
                row_probs(p, qkv, b, t, h, T, C, NH);
                const float *g = dy + ((size_t)b * T + t) * C + h * hs;
                double dot = 0.0;
                for (int s = 0; s <= t; s++) { /* dp_s = do . v_s; dv_s += p_s do */
                    size_t vs = ((size_t)b * T + s) * 3 * C + 2 * C + h * hs;
                    dp[s] = 0.0;
                    for (int i = 0; i < hs; i++) {
                        dp[s] += (double)g[i] * qkv[vs + i];
                        acc[vs + i] += p[s] * g[i];
                    }
                    dot += p[s] * dp[s];
                }
                size_t qt = ((size_t)b * T + t) * 3 * C + h * hs;
                for (int s = 0; s <= t; s++) { /* through the softmax and the scores */
                    double ds = p[s] * (dp[s] - dot) * scale;
                    size_t ks = ((size_t)b * T + s) * 3 * C + C + h * hs;
                    for (int i = 0; i < hs; i++) {
                        acc[qt + i] += ds * qkv[ks + i];
                        acc[ks + i] += ds * qkv[qt + i];
                    }
                }
            }
    for (size_t i = 0; i < (size_t)B * T * 3 * C; i++) dqkv[i] = (float)acc[i];
done:
    free(p);
    free(dp);
    free(acc);
}
