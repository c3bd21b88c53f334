/* Reference 2-d max and average pooling (floor mode, no dilation), forward and backward,
 * following PyTorch's CPU kernels: max pooling ignores padding and keeps the first maximum
 * in row-major window order; average pooling divides by the window size including padding
 * (count_include_pad = true). Not ceil mode, not divisor_override. */
#include <math.h>

#include "ops/ref/ref.h"

void td__ref_pool2d_out(const td__ref_pool2d_dims *d, int *OH, int *OW) {
    int sh = d->stride_h > 0 ? d->stride_h : 1, sw = d->stride_w > 0 ? d->stride_w : 1;
    int h = d->H + 2 * d->pad_h - d->KH, w = d->W + 2 * d->pad_w - d->KW;
    *OH = h < 0 ? 0 : h / sh + 1;
    *OW = w < 0 ? 0 : w / sw + 1;
}

/* Flat index into the input plane of the first maximum of window (oh, ow), or -1 if the
 * window holds only padding. NaN wins, as in PyTorch. */
static long max_index(const float *xp, const td__ref_pool2d_dims *d, int oh, int ow) {
    long best = -1;
    float bv = 0.0f;
    int h0 = oh * d->stride_h - d->pad_h, w0 = ow * d->stride_w - d->pad_w;
    for (int ih = h0; ih < h0 + d->KH; ih++) {
        if (ih < 0 || ih >= d->H) continue;
        for (int iw = w0; iw < w0 + d->KW; iw++) {
            if (iw < 0 || iw >= d->W) continue;
            float v = xp[ih * d->W + iw];
            if (best < 0 || v > bv || isnan(v)) {
                best = (long)ih * d->W + iw;
                bv = v;
                if (isnan(v)) return best;
            }
        }
    }
    return best;
}

void td__ref_maxpool2d_forward(float *y, int64_t *argmax, const float *x,
                               const td__ref_pool2d_dims *d) {
    int OH, OW;
    td__ref_pool2d_out(d, &OH, &OW);
    size_t plane = (size_t)d->H * d->W, oplane = (size_t)OH * OW;
    for (size_t nc = 0; nc < (size_t)d->N * d->C; nc++) {
        const float *xp = x + nc * plane;
        for (int oh = 0; oh < OH; oh++)
            for (int ow = 0; ow < OW; ow++) {
                long i = max_index(xp, d, oh, ow);
                size_t o = nc * oplane + (size_t)oh * OW + ow;
                y[o] = i >= 0 ? xp[i] : -INFINITY;
                if (argmax) argmax[o] = i;
            }
    }
}

void td__ref_maxpool2d_backward(float *dx, const float *dy, const float *x,
                                const td__ref_pool2d_dims *d) {
    int OH, OW;
    td__ref_pool2d_out(d, &OH, &OW);
    size_t plane = (size_t)d->H * d->W, oplane = (size_t)OH * OW;
    for (size_t nc = 0; nc < (size_t)d->N * d->C; nc++) {
        const float *xp = x + nc * plane;
        float *dxp = dx + nc * plane;
        /* Overlapping windows may pick the same input: accumulate, as PyTorch does. */
        for (size_t i = 0; i < plane; i++) dxp[i] = 0.0f;
        for (int oh = 0; oh < OH; oh++)
            for (int ow = 0; ow < OW; ow++) {
                long i = max_index(xp, d, oh, ow);
                if (i >= 0) dxp[i] += dy[nc * oplane + (size_t)oh * OW + ow];
            }
    }
}

/* Window bounds clipped to the padded input, the divisor, then clipped to the input. */
static int avg_window(const td__ref_pool2d_dims *d, int oh, int ow, int *h0, int *h1, int *w0,
                      int *w1) {
    int hs = oh * d->stride_h - d->pad_h, ws = ow * d->stride_w - d->pad_w;
    int he = hs + d->KH, we = ws + d->KW;
    if (he > d->H + d->pad_h) he = d->H + d->pad_h;
    if (we > d->W + d->pad_w) we = d->W + d->pad_w;
    int count = (he - hs) * (we - ws);
    *h0 = hs < 0 ? 0 : hs;
    *w0 = ws < 0 ? 0 : ws;
    *h1 = he > d->H ? d->H : he;
    *w1 = we > d->W ? d->W : we;
    return count;
}

void td__ref_avgpool2d_forward(float *y, const float *x, const td__ref_pool2d_dims *d) {
    int OH, OW;
    td__ref_pool2d_out(d, &OH, &OW);
    size_t plane = (size_t)d->H * d->W, oplane = (size_t)OH * OW;
    for (size_t nc = 0; nc < (size_t)d->N * d->C; nc++) {
        const float *xp = x + nc * plane;
        for (int oh = 0; oh < OH; oh++)
            for (int ow = 0; ow < OW; ow++) {
                int h0, h1, w0, w1;
                int count = avg_window(d, oh, ow, &h0, &h1, &w0, &w1);
                double s = 0.0;
                for (int ih = h0; ih < h1; ih++)
                    for (int iw = w0; iw < w1; iw++) s += xp[ih * d->W + iw];
                y[nc * oplane + (size_t)oh * OW + ow] = (float)(s / count);
            }
    }
}

void td__ref_avgpool2d_backward(float *dx, const float *dy, const td__ref_pool2d_dims *d) {
    int OH, OW;
    td__ref_pool2d_out(d, &OH, &OW);
    size_t plane = (size_t)d->H * d->W, oplane = (size_t)OH * OW;
    for (size_t nc = 0; nc < (size_t)d->N * d->C; nc++) {
        float *dxp = dx + nc * plane;
        for (size_t i = 0; i < plane; i++) dxp[i] = 0.0f;
        for (int oh = 0; oh < OH; oh++)
            for (int ow = 0; ow < OW; ow++) {
                int h0, h1, w0, w1;
                int count = avg_window(d, oh, ow, &h0, &h1, &w0, &w1);
                float g = dy[nc * oplane + (size_t)oh * OW + ow] / (float)count;
                for (int ih = h0; ih < h1; ih++)
                    for (int iw = w0; iw < w1; iw++) dxp[ih * d->W + iw] += g;
            }
    }
}
