/* Plain-C reference kernels: the obviously-correct forward and backward of every op that
 * the graph engine runs through oneDNN, so tests can compare against something short
 * enough to check by eye (and that tests/fixtures/ops checks against PyTorch).
 *
 * All buffers are contiguous f32 (labels int64, masks u8) in NCHW or (N, C) layout, with
 * the shape given by the explicit dims. Sums are accumulated in double. Backward functions
 * OVERWRITE their gradient outputs (they do not accumulate); any gradient output may be
 * NULL to skip it. These kernels are for tests and for checking: they are slow, never
 * allocate, and do not validate dims beyond what a status return says. Each op's are in the
 * file of this folder named as its definition in src/ops/. Not installed. */
#ifndef TANDEM_OPS_REF_H
#define TANDEM_OPS_REF_H

#include <stddef.h>
#include <stdint.h>

#include "tandem/core.h"

/* ---- linear: y = x W^T + b ------------------------------------------------------------ */

void td__ref_linear_forward(float *y,       // (N, OUT)
                            const float *x, // (N, IN)
                            const float *w, // (OUT, IN)
                            const float *b, // (OUT) or NULL
                            int N, int IN, int OUT);

void td__ref_linear_backward(float *dx,       // (N, IN) or NULL
                             float *dw,       // (OUT, IN) or NULL
                             float *db,       // (OUT) or NULL
                             const float *dy, // (N, OUT)
                             const float *x,  // (N, IN)
                             const float *w,  // (OUT, IN)
                             int N, int IN, int OUT);

/* ---- conv2d (groups = 1) --------------------------------------------------------------- */

/* Dims of a 2-d convolution; the output size follows from them (td__ref_conv2d_out). */
typedef struct {
    int N, C, H, W; /* input */
    int OC, KH, KW; /* weight (OC, C, KH, KW) */
    int stride_h, stride_w;
    int pad_h, pad_w; /* zero padding on both sides */
    int dil_h, dil_w; /* 1 = dense kernel */
} td__ref_conv2d_dims;

/* Output height and width (PyTorch's floor formula); <= 0 when the kernel does not fit. */
void td__ref_conv2d_out(const td__ref_conv2d_dims *d, int *OH, int *OW);

void td__ref_conv2d_forward(float *y,       // (N, OC, OH, OW)
                            const float *x, // (N, C, H, W)
                            const float *w, // (OC, C, KH, KW)
                            const float *b, // (OC) or NULL
                            const td__ref_conv2d_dims *d);

void td__ref_conv2d_backward(float *dx,       // (N, C, H, W) or NULL
                             float *dw,       // (OC, C, KH, KW) or NULL
                             float *db,       // (OC) or NULL
                             const float *dy, // (N, OC, OH, OW)
                             const float *x,  // (N, C, H, W)
                             const float *w,  // (OC, C, KH, KW)
                             const td__ref_conv2d_dims *d);

/* ---- pooling ------------------------------------------------------------------------- */

/* Dims of a 2-d pooling window (floor mode, no dilation). */
typedef struct {
    int N, C, H, W;
    int KH, KW;
    int stride_h, stride_w;
    int pad_h, pad_w;
} td__ref_pool2d_dims;

/* Output height and width; <= 0 when the window does not fit. */
void td__ref_pool2d_out(const td__ref_pool2d_dims *d, int *OH, int *OW);

/* Max over each window; padding never wins. `argmax` (flat h*W+w index into the input
 * plane, PyTorch's `indices`) may be NULL. */
void td__ref_maxpool2d_forward(float *y,        // (N, C, OH, OW)
                               int64_t *argmax, // (N, C, OH, OW) or NULL
                               const float *x,  // (N, C, H, W)
                               const td__ref_pool2d_dims *d);

/* Routes each upstream gradient to its window's first maximum (PyTorch's tie rule). */
void td__ref_maxpool2d_backward(float *dx,       // (N, C, H, W)
                                const float *dy, // (N, C, OH, OW)
                                const float *x,  // (N, C, H, W)
                                const td__ref_pool2d_dims *d);

/* Mean over each window; the divisor counts padding (count_include_pad = true). */
void td__ref_avgpool2d_forward(float *y,       // (N, C, OH, OW)
                               const float *x, // (N, C, H, W)
                               const td__ref_pool2d_dims *d);

void td__ref_avgpool2d_backward(float *dx,       // (N, C, H, W)
                                const float *dy, // (N, C, OH, OW)
                                const td__ref_pool2d_dims *d);

/* ---- element-wise activations -------------------------------------------------------- */

/* Element-wise: every buffer below is (n) values in any layout. */
void td__ref_relu_forward(float *y, const float *x, size_t n);
/* Gradient passes where x > 0 (at 0 it is 0, like PyTorch). */
void td__ref_relu_backward(float *dx, const float *dy, const float *x, size_t n);

/* The exact (erf) form: 0.5 x (1 + erf(x / sqrt 2)). */
void td__ref_gelu_forward(float *y, const float *x, size_t n);
void td__ref_gelu_backward(float *dx, const float *dy, const float *x, size_t n);

/* GPT-2's tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
void td__ref_gelu_tanh_forward(float *y, const float *x, size_t n);
void td__ref_gelu_tanh_backward(float *dx, const float *dy, const float *x, size_t n);

/* Dropout with a given keep mask (1 keep, 0 drop) and scale = 1 / (1 - p). */
void td__ref_dropout_forward(float *y,            // (n)
                             const float *x,      // (n)
                             const uint8_t *mask, // (n)
                             float scale, size_t n);
void td__ref_dropout_backward(float *dx, const float *dy, const uint8_t *mask, float scale,
                              size_t n);

/* Dropout2d: one mask entry per channel plane, i.e. per (n, c), over `plane` = H*W values. */
void td__ref_dropout2d_forward(float *y,            // (N, C, plane)
                               const float *x,      // (N, C, plane)
                               const uint8_t *mask, // (N, C)
                               float scale, int N, int C, size_t plane);
void td__ref_dropout2d_backward(float *dx, const float *dy, const uint8_t *mask, float scale, int N,
                                int C, size_t plane);

/* ---- batch norm 2d ------------------------------------------------------------------- */

/* Training forward: normalises with the batch mean and biased variance, writes the saved
 * mean and 1/sqrt(var + eps) for backward, and updates the running statistics in place
 * (running_var with the UNBIASED batch variance, as PyTorch does). weight/bias NULL means
 * affine = false. running_* may be NULL (track_running_stats = false). */
void td__ref_batchnorm2d_forward_train(float *y,            // (N, C, H, W)
                                       float *save_mean,    // (C)
                                       float *save_invstd,  // (C)
                                       float *running_mean, // (C) in/out or NULL
                                       float *running_var,  // (C) in/out or NULL
                                       const float *x,      // (N, C, H, W)
                                       const float *weight, // (C) or NULL
                                       const float *bias,   // (C) or NULL
                                       int N, int C, int HW, float eps, float momentum);

/* Eval forward: normalises with the running statistics. */
void td__ref_batchnorm2d_forward_eval(float *y,                  // (N, C, H, W)
                                      const float *x,            // (N, C, H, W)
                                      const float *running_mean, // (C)
                                      const float *running_var,  // (C)
                                      const float *weight,       // (C) or NULL
                                      const float *bias,         // (C) or NULL
                                      int N, int C, int HW, float eps);

/* Training backward, through the batch statistics. */
void td__ref_batchnorm2d_backward_train(float *dx,                // (N, C, H, W) or NULL
                                        float *dweight,           // (C) or NULL
                                        float *dbias,             // (C) or NULL
                                        const float *dy,          // (N, C, H, W)
                                        const float *x,           // (N, C, H, W)
                                        const float *weight,      // (C) or NULL
                                        const float *save_mean,   // (C)
                                        const float *save_invstd, // (C)
                                        int N, int C, int HW);

/* Eval backward: the statistics are constants. */
void td__ref_batchnorm2d_backward_eval(float *dx,                 // (N, C, H, W) or NULL
                                       float *dweight,            // (C) or NULL
                                       float *dbias,              // (C) or NULL
                                       const float *dy,           // (N, C, H, W)
                                       const float *x,            // (N, C, H, W)
                                       const float *running_mean, // (C)
                                       const float *running_var,  // (C)
                                       const float *weight,       // (C) or NULL
                                       int N, int C, int HW, float eps);

/* ---- layer norm over the last dim ----------------------------------------------------- */

/* Each row normalised by its mean and biased variance; mean and rstd = 1/sqrt(var + eps) are
 * written for backward (either may be NULL). weight/bias NULL: no affine part. */
void td__ref_layer_norm_forward(float *y,            // (rows, C)
                                float *mean,         // (rows) or NULL
                                float *rstd,         // (rows) or NULL
                                const float *x,      // (rows, C)
                                const float *weight, // (C) or NULL
                                const float *bias,   // (C) or NULL
                                size_t rows, int C, float eps);

void td__ref_layer_norm_backward(float *dx,           // (rows, C) or NULL
                                 float *dweight,      // (C) or NULL
                                 float *dbias,        // (C) or NULL
                                 const float *dy,     // (rows, C)
                                 const float *x,      // (rows, C)
                                 const float *weight, // (C) or NULL
                                 size_t rows, int C, float eps);

/* ---- embeddings ---------------------------------------------------------------------- */

/* y[i] = table[idx[i]] over n ids; ids are checked by the caller. */
void td__ref_embedding_forward(float *y,           // (n, C)
                               const int64_t *idx, // (n)
                               const float *table, // (V, C)
                               size_t n, int C);
/* dtable = sum over i of dy[i] into row idx[i] (overwritten: rows never used are 0). */
void td__ref_embedding_backward(float *dtable,      // (V, C)
                                const float *dy,    // (n, C)
                                const int64_t *idx, // (n)
                                size_t n, int V, int C);

/* y[s, t] = x[s, t] + table[t] over S sequences of T positions. */
void td__ref_position_embedding_forward(float *y,           // (S, T, C)
                                        const float *x,     // (S, T, C)
                                        const float *table, // (>= T, C)
                                        int S, int T, int C);
/* dtable[t] = sum over s of dy[s, t] (rows [0, T) only); dx = dy needs no kernel. */
void td__ref_position_embedding_backward(float *dtable,   // (T, C)
                                         const float *dy, // (S, T, C)
                                         int S, int T, int C);

/* ---- causal self-attention ------------------------------------------------------------ */

/* qkv (B, T, 3C): row [q | k | v], NH heads of C / NH. y[b, t, head h] = sum over s <= t of
 * softmax_s(q_t . k_s / sqrt(hs)) v_s. */
void td__ref_attention_forward(float *y,         // (B, T, C)
                               const float *qkv, // (B, T, 3C)
                               int B, int T, int C, int NH);

void td__ref_attention_backward(float *dqkv,      // (B, T, 3C)
                                const float *dy,  // (B, T, C)
                                const float *qkv, // (B, T, 3C)
                                int B, int T, int C, int NH);

/* ---- structural ops ------------------------------------------------------------------ */

/* y = a + b (same shape); backward is the identity into both, so there is none here. */
void td__ref_add_forward(float *y, const float *a, const float *b, size_t n);

/* Concatenation along dim 1: input k is (N, C_k, inner), the output (N, sum C_k, inner). */
void td__ref_concat_forward(float *y,               // (N, sum C_k, inner)
                            const float *const *xs, // k inputs, (N, C_k, inner) each
                            const int *C, int k, int N, size_t inner);

/* Splits dy back into the k input gradients (NULL entries are skipped). */
void td__ref_concat_backward(float *const *dxs, // k outputs, (N, C_k, inner) each
                             const float *dy,   // (N, sum C_k, inner)
                             const int *C, int k, int N, size_t inner);

/* Flatten keeps the bytes: a copy forward and backward. */
void td__ref_flatten_forward(float *y, const float *x, size_t n);
void td__ref_flatten_backward(float *dx, const float *dy, size_t n);

/* ---- softmax over the last dim ------------------------------------------------------- */

void td__ref_softmax_forward(float *y,       // (rows, D)
                             const float *x, // (rows, D)
                             size_t rows, int D);
/* Uses the forward output y. */
void td__ref_softmax_backward(float *dx, const float *dy, const float *y, size_t rows, int D);

void td__ref_log_softmax_forward(float *y, const float *x, size_t rows, int D);
/* Uses the forward output y (log-probabilities). */
void td__ref_log_softmax_backward(float *dx, const float *dy, const float *y, size_t rows, int D);

/* ---- losses -------------------------------------------------------------------------- */

typedef enum { TD__REF_MEAN = 0, TD__REF_SUM = 1 } td__ref_reduction;

/* Negative log-likelihood of log-probabilities (N, C) at int64 labels (N). Labels equal to
 * ignore_index (PyTorch: -100) count for nothing; mean divides by the labels kept (NaN
 * when none are kept, as PyTorch). Fails with TD_EINVAL naming the sample when a label is
 * outside [0, C) and not ignore_index. */
td_status td__ref_nll_loss_forward(float *loss,           // (1)
                                   const float *logp,     // (N, C)
                                   const int64_t *labels, // (N)
                                   int N, int C, td__ref_reduction reduction, int64_t ignore_index);

/* dlogp for upstream gradient dloss (a scalar). */
td_status td__ref_nll_loss_backward(float *dlogp, // (N, C)
                                    float dloss,
                                    const int64_t *labels, // (N)
                                    int N, int C, td__ref_reduction reduction,
                                    int64_t ignore_index);

/* Cross entropy = nll_loss(log_softmax(logits)); same label rules. */
td_status td__ref_cross_entropy_forward(float *loss,           // (1)
                                        const float *logits,   // (N, C)
                                        const int64_t *labels, // (N)
                                        int N, int C, td__ref_reduction reduction,
                                        int64_t ignore_index);

td_status td__ref_cross_entropy_backward(float *dlogits, // (N, C)
                                         float dloss,
                                         const float *logits,   // (N, C)
                                         const int64_t *labels, // (N)
                                         int N, int C, td__ref_reduction reduction,
                                         int64_t ignore_index);

#endif
