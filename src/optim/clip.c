/* Gradient-norm clipping with torch.nn.utils.clip_grad_norm_'s rule (L2 over all gradients,
 * scale by max_norm / (norm + 1e-6) when the norm exceeds max_norm).
 *
 * On the CPU the squares are summed exactly (core/fixed_sum.c) and rounded once to a double, so
 * the norm is the same bits however the gradients are split among tensors, shards, stages or
 * ranks, and can differ from PyTorch's float reduction in the last bits; on a GPU they are
 * summed in double. A non-finite norm is returned as is and leaves the gradients untouched. bf16
 * and f16 gradients (mixed precision) are read and scaled through f32. Gradients on a GPU are
 * summed and scaled there by two multi-tensor launches; reading the norm back is the one wait. The
 * strategies whose gradients are spread over ranks or stages (ZeRO's shards, a pipeline's
 * stages) sum their parts of the squares and apply the same rule through td__grads_clip. */
#include <math.h>
#include <stdlib.h>

#include "tandem/optim.h"

#include "core/core_impl.h"
#include "device/device_impl.h"
#include "optim/optim_impl.h"

/* One multi-tensor launch over the gradients of params (every one on params[0]'s GPU). */
static td_status grads_launch(td_param *params, size_t n, const td__mt_args *args, double *result,
                              const char *what) {
    td_device d = params[0].device;
    for (size_t i = 0; i < n; i++)
        if (params[i].device.type != d.type || params[i].device.index != d.index)
            return td__fail(TD_EINVAL, "%s: %s is on another device than %s", what,
                            params[i].name ? params[i].name : "?",
                            params[0].name ? params[0].name : "?");
    td__mt_tensor *list = calloc(n, sizeof *list);
    if (!list) return td__fail(TD_ENOMEM, "%s: out of memory", what);
    for (size_t i = 0; i < n; i++)
        list[i] = (td__mt_tensor){
            .grad = params[i].grad, .count = params[i].count, .dtype = (int32_t)params[i].dtype};
    void *scratch = NULL;
    size_t scratch_bytes = 0;
    td_status st =
        td__device_multi_tensor(d, args, list, n, &scratch, &scratch_bytes, result, what);
    if (scratch) td_device_free(d, scratch);
    free(list);
    return st;
}

td_status td__grads_scale(td_param *params, size_t n, float c, const char *what) {
    if (n && params[0].device.type != TD_DEVICE_CPU) {
        td__mt_args a = {.op = TD__MT_SCALE, .factor = c};
        return grads_launch(params, n, &a, NULL, what);
    }
    for (size_t i = 0; i < n; i++) {
        void *g = params[i].grad;
        if (!g) continue;
        if (params[i].dtype == TD_F32)
            for (size_t j = 0; j < params[i].count; j++) ((float *)g)[j] *= c;
        else
            for (size_t j = 0; j < params[i].count; j++)
                td__store(g, params[i].dtype, j, td__load(g, params[i].dtype, j) * c);
    }
    return TD_OK;
}

td_status td__grads_sumsq(const td_param *params, size_t n, td__sumsq *acc, const char *what) {
    float buf[1024];
    for (size_t i = 0; i < n; i++) {
        const void *g = params[i].grad;
        if (!g) continue;
        if (params[i].device.type != TD_DEVICE_CPU)
            return td__fail(TD_EUNSUPPORTED, "%s: the gradient of %s is on a GPU", what,
                            params[i].name ? params[i].name : "?");
        if (params[i].dtype == TD_F32) {
            td__sumsq_add_f32(acc, g, params[i].count);
            continue;
        }
        for (size_t j = 0; j < params[i].count; j += 1024) {
            size_t m = params[i].count - j < 1024 ? params[i].count - j : 1024;
            td__convert(buf, TD_F32, (const char *)g + j * td_dtype_size(params[i].dtype),
                        params[i].dtype, m);
            td__sumsq_add_f32(acc, buf, m);
        }
    }
    return TD_OK;
}

td_status td__grads_clip(td_param *params, size_t n, double max_norm, double sumsq,
                         double *total_norm, const char *what) {
    double norm = sqrt(sumsq);
    if (total_norm) *total_norm = norm;
    double coef = max_norm / (norm + 1e-6);
    return coef < 1.0 ? td__grads_scale(params, n, (float)coef, what) : TD_OK;
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
    double sum = 0.0;
    if (n && params[0].device.type != TD_DEVICE_CPU) {
        td__mt_args a = {.op = TD__MT_SQUARES};
        TD__TRY(grads_launch(params, n, &a, &sum, "td_clip_grad_norm"));
    } else {
        td__sumsq acc;
        td__sumsq_init(&acc);
        TD__TRY(td__grads_sumsq(params, n, &acc, "td_clip_grad_norm"));
        sum = td__sumsq_value(&acc);
    }
    return td__grads_clip(params, n, max_norm, sum, total_norm, "td_clip_grad_norm");
}
