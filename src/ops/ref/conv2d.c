/* Reference 2-d convolution (cross-correlation, groups = 1) with stride, zero padding and
 * dilation, forward and backward, written as direct loops over the output so that each
 * gradient is the transpose of the same index map. Not fast and not meant to be. */
#include "ops/ref/ref.h"

void td__ref_conv2d_out(const td__ref_conv2d_dims *d, int *OH, int *OW) {
    int eff_kh = d->dil_h * (d->KH - 1) + 1, eff_kw = d->dil_w * (d->KW - 1) + 1;
    int sh = d->stride_h > 0 ? d->stride_h : 1, sw = d->stride_w > 0 ? d->stride_w : 1;
    int h = d->H + 2 * d->pad_h - eff_kh, w = d->W + 2 * d->pad_w - eff_kw;
    *OH = h < 0 ? 0 : h / sh + 1;
    *OW = w < 0 ? 0 : w / sw + 1;
}

/* Input coordinate that output (oh, ow) reads at kernel tap (kh, kw); -1 when in padding. */
static long conv_in_index(const td__ref_conv2d_dims *d, int oh, int ow, int kh, int kw) {
    int ih = oh * d->stride_h - d->pad_h + kh * d->dil_h;
    int iw = ow * d->stride_w - d->pad_w + kw * d->dil_w;
    if (ih < 0 || ih >= d->H || iw < 0 || iw >= d->W) return -1;
    return (long)ih * d->W + iw;
}

void td__ref_conv2d_forward(float *y, const float *x, const float *w, const float *b,
                            const td__ref_conv2d_dims *d) {
    int OH, OW;
    td__ref_conv2d_out(d, &OH, &OW);
    size_t plane = (size_t)d->H * d->W, ksize = (size_t)d->KH * d->KW;
    for (int n = 0; n < d->N; n++)
        for (int oc = 0; oc < d->OC; oc++)
            for (int oh = 0; oh < OH; oh++)
                for (int ow = 0; ow < OW; ow++) {
                    double s = b ? b[oc] : 0.0;
                    for (int c = 0; c < d->C; c++) {
                        const float *xp = x + ((size_t)n * d->C + c) * plane;
                        const float *wp = w + ((size_t)oc * d->C + c) * ksize;
                        for (int kh = 0; kh < d->KH; kh++)
                            for (int kw = 0; kw < d->KW; kw++) {
                                long i = conv_in_index(d, oh, ow, kh, kw);
                                if (i >= 0) s += (double)xp[i] * wp[kh * d->KW + kw];
                            }
                    }
                    y[(((size_t)n * d->OC + oc) * OH + oh) * OW + ow] = (float)s;
                }
}

void td__ref_conv2d_backward(float *dx, float *dw, float *db, const float *dy, const float *x,
                             const float *w, const td__ref_conv2d_dims *d) {
    int OH, OW;
    td__ref_conv2d_out(d, &OH, &OW);
    size_t plane = (size_t)d->H * d->W, ksize = (size_t)d->KH * d->KW;
    size_t oplane = (size_t)OH * OW;
    if (db) {
        for (int oc = 0; oc < d->OC; oc++) {
            double s = 0.0;
            for (int n = 0; n < d->N; n++)
                for (size_t p = 0; p < oplane; p++) s += dy[((size_t)n * d->OC + oc) * oplane + p];
            db[oc] = (float)s;
        }
    }
    if (dw) {
        for (int oc = 0; oc < d->OC; oc++)
            for (int c = 0; c < d->C; c++)
                for (int kh = 0; kh < d->KH; kh++)
                    for (int kw = 0; kw < d->KW; kw++) {
                        double s = 0.0;
                        for (int n = 0; n < d->N; n++) {
                            const float *xp = x + ((size_t)n * d->C + c) * plane;
                            const float *dyp = dy + ((size_t)n * d->OC + oc) * oplane;
                            for (int oh = 0; oh < OH; oh++)
                                for (int ow = 0; ow < OW; ow++) {
                                    long i = conv_in_index(d, oh, ow, kh, kw);
                                    if (i >= 0) s += (double)xp[i] * dyp[oh * OW + ow];
                                }
                        }
                        dw[((size_t)oc * d->C + c) * ksize + kh * d->KW + kw] = (float)s;
                    }
    }
    if (dx) {
        /* Scatter in double so that every input sum is accumulated at full precision. */
        for (int n = 0; n < d->N; n++)
            for (int c = 0; c < d->C; c++) {
                float *dxp = dx + ((size_t)n * d->C + c) * plane;
                for (int ih = 0; ih < d->H; ih++)
                    for (int iw = 0; iw < d->W; iw++) {
                        double s = 0.0;
                        for (int oc = 0; oc < d->OC; oc++) {
                            const float *wp = w + ((size_t)oc * d->C + c) * ksize;
                            const float *dyp = dy + ((size_t)n * d->OC + oc) * oplane;
                            for (int kh = 0; kh < d->KH; kh++) {
                                int t = ih + d->pad_h - kh * d->dil_h;
                                if (t < 0 || t % d->stride_h) continue;
                                int oh = t / d->stride_h;
                                if (oh >= OH) continue;
                                for (int kw = 0; kw < d->KW; kw++) {
                                    int u = iw + d->pad_w - kw * d->dil_w;
                                    if (u < 0 || u % d->stride_w) continue;
                                    int ow = u / d->stride_w;
                                    if (ow >= OW) continue;
                                    s += (double)wp[kh * d->KW + kw] * dyp[oh * OW + ow];
                                }
                            }
                        }
                        dxp[ih * d->W + iw] = (float)s;
                    }
            }
    }
}
