/* Gradient-norm clipping with torch.nn.utils.clip_grad_norm_'s rule (L2 over all gradients,
 * scale by max_norm / (norm + 1e-6) when the norm exceeds max_norm).
 *
 * The norm is summed in double, so it can differ from PyTorch's float reduction in the last
 * bits. A non-finite norm is returned as is and leaves the gradients untouched. bf16 and f16
 * gradients (mixed precision) are read and scaled through f32. Gradients on a GPU are summed
 * and scaled there by two multi-tensor launches; reading the norm back is the one wait. */
#include <math.h>
#include <stdlib.h>

#include "tandem/optim.h"

#include "core/core_impl.h"
#include "device/device_impl.h"

/* The same rule over gradients on a GPU (every parameter on params[0]'s device). */
static td_status clip_on_device(td_param *params, size_t n, double max_norm, double *total_norm) {
    td_device d = params[0].device;
    td__mt_tensor *list = calloc(n, sizeof *list);
    if (!list) return td__fail(TD_ENOMEM, "td_clip_grad_norm: out of memory");
    void *scratch = NULL;
    size_t scratch_bytes = 0;
    td_status st = TD_OK;
    double sum = 0.0;
    for (int pass = 0; pass < 2 && st == TD_OK; pass++) {
        for (size_t i = 0; i < n; i++) {
            if (params[i].device.type != d.type || params[i].device.index != d.index)
                st = td__fail(TD_EINVAL, "td_clip_grad_norm: %s is on another device than %s",
                              params[i].name ? params[i].name : "?",
                              params[0].name ? params[0].name : "?");
            list[i] = (td__mt_tensor){.grad = params[i].grad,
                                      .count = params[i].count,
                                      .dtype = (int32_t)params[i].dtype};
        }
        if (st != TD_OK) break;
        if (pass == 0) {
            td__mt_args a = {.op = TD__MT_SQUARES};
            st = td__device_multi_tensor(d, &a, list, n, &scratch, &scratch_bytes, &sum,
                                         "td_clip_grad_norm");
            if (st == TD_OK && total_norm) *total_norm = sqrt(sum);
            if (st != TD_OK || !(max_norm / (sqrt(sum) + 1e-6) < 1.0)) break;
        } else {
            td__mt_args a = {.op = TD__MT_SCALE, .factor = (float)(max_norm / (sqrt(sum) + 1e-6))};
            st = td__device_multi_tensor(d, &a, list, n, &scratch, &scratch_bytes, NULL,
                                         "td_clip_grad_norm");
        }
    }
    if (scratch) td_device_free(d, scratch);
    free(list);
    return st;
}

td_status td_clip_grad_norm(td_param *params, size_t n, double max_norm, double *total_norm) {
    if (!params && n)
        return td__fail(TD_EINVAL, "td_clip_grad_norm: params is NULL with n = %zu", n);
    if (!(max_norm > 0))
        return td__fail(TD_EINVAL, "td_clip_grad_norm: max_norm %g, expected > 0", max_norm);
    for (size_t i = 0; i < n; i++)
        if (params[i].grad && !td__is_float(params[i].dtype))
            return td__fail(TD_EDTYPE,
                            "td_clip_grad_norm: gradient of %s is %s, expected f32, bf16 or f16",
                            params[i].name ? params[i].name : "?", td_dtype_name(params[i].dtype));
    if (n && params[0].device.type != TD_DEVICE_CPU)
        return clip_on_device(params, n, max_norm, total_norm);
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) {
        const void *g = params[i].grad;
        if (!g) continue;
        double s = 0.0;
        if (params[i].dtype == TD_F32)
            for (size_t j = 0; j < params[i].count; j++)
                s += (double)((const float *)g)[j] * ((const float *)g)[j];
        else
            for (size_t j = 0; j < params[i].count; j++) {
                double v = td__load(g, params[i].dtype, j);
                s += v * v;
            }
        sum += s;
    }
    double norm = sqrt(sum);
    if (total_norm) *total_norm = norm;
    double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) {
        const float c = (float)coef;
        for (size_t i = 0; i < n; i++) {
            void *g = params[i].grad;
            if (!g) continue;
            if (params[i].dtype == TD_F32)
                for (size_t j = 0; j < params[i].count; j++) ((float *)g)[j] *= c;
            else
                for (size_t j = 0; j < params[i].count; j++)
                    td__store(g, params[i].dtype, j, td__load(g, params[i].dtype, j) * c);
        }
    }
    return TD_OK;
}
