/* Gradient-norm clipping with torch.nn.utils.clip_grad_norm_'s rule (L2 over all gradients,
 * scale by max_norm / (norm + 1e-6) when the norm exceeds max_norm).
 *
 * The norm is summed in double, so it can differ from PyTorch's float reduction in the last
 * bits. A non-finite norm is returned as is and leaves the gradients untouched. bf16 and f16
 * gradients (mixed precision) are read and scaled through f32. */
#include <math.h>

#include "tandem/optim.h"

#include "core/core_impl.h"

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
