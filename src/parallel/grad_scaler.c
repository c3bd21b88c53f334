/* td_grad_scaler: dynamic loss scaling with torch.cuda.amp.GradScaler's rules (amp.h). The
 * unscale pass divides each gradient by the scale and notices inf/NaN in the same read; with a
 * process group the ranks then take the maximum of their flags, so all of them skip or step
 * together. It does not cast anything (the graph does) or own the optimizer. Gradients on a
 * GPU are unscaled there in one multi-tensor launch whose flag is read back: the one wait of
 * a step with loss scaling, since whether to skip must be known on the host. */
#include <math.h>
#include <stdlib.h>

#include "tandem/amp.h"

#include "core/core_impl.h"
#include "device/device_impl.h"

struct td_grad_scaler {
    td_grad_scaler_params p;
    double scale;           /* state "amp.scale" */
    int64_t growth_tracker; /* state "amp.growth_tracker": clean steps in a row */
    int64_t skipped;
    int unscaled;  /* this step's gradients are divided already */
    int found_inf; /* ... and had inf or NaN on some rank */
    td_param state[2];
    td__mt_tensor *list; /* (nlist) the unscale launch's list, for gradients on a GPU */
    size_t nlist;
    void *scratch; /* its device copy, on scratch_device */
    size_t scratch_bytes;
    td_device scratch_device;
};

td_grad_scaler_params td_grad_scaler_default_params(void) {
    td_grad_scaler_params p = {.init_scale = 65536.0,
                               .growth_factor = 2.0,
                               .backoff_factor = 0.5,
                               .growth_interval = 2000,
                               .dynamic = 1,
                               .comm = NULL};
    return p;
}

td_status td_grad_scaler_create(td_grad_scaler **out, const td_grad_scaler_params *params) {
    if (!out) return td__fail(TD_EINVAL, "td_grad_scaler_create: out is NULL");
    *out = NULL;
    td_grad_scaler_params p = params ? *params : td_grad_scaler_default_params();
    if (!(p.init_scale > 0 && isfinite(p.init_scale)) || !(p.growth_factor > 1) ||
        !(p.backoff_factor > 0 && p.backoff_factor < 1) || p.growth_interval < 1)
        return td__fail(TD_EINVAL,
                        "td_grad_scaler_create: init_scale %g (> 0), growth_factor %g (> 1), "
                        "backoff_factor %g (in (0, 1)), growth_interval %lld (>= 1)",
                        p.init_scale, p.growth_factor, p.backoff_factor,
                        (long long)p.growth_interval);
    td_grad_scaler *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "td_grad_scaler_create: out of memory");
    s->p = p;
    s->scale = p.init_scale;
    s->state[0] = (td_param){.name = "amp.scale",
                             .data = &s->scale,
                             .count = 1,
                             .dtype = TD_F64,
                             .ndim = 1,
                             .shape = {1}};
    s->state[1] = (td_param){.name = "amp.growth_tracker",
                             .data = &s->growth_tracker,
                             .count = 1,
                             .dtype = TD_I64,
                             .ndim = 1,
                             .shape = {1}};
    *out = s;
    return TD_OK;
}

void td_grad_scaler_destroy(td_grad_scaler *s) {
    if (!s) return;
    if (s->scratch) td_device_free(s->scratch_device, s->scratch);
    free(s->list);
    free(s);
}

/* unscale() over gradients on a GPU: 1 in *bad when any result is inf or NaN. */
static td_status unscale_on_device(td_grad_scaler *s, td_param *params, size_t n, float inv,
                                   int32_t *bad) {
    td_device d = params[0].device;
    if (s->nlist < n) {
        td__mt_tensor *l = realloc(s->list, n * sizeof *l);
        if (!l) return td__fail(TD_ENOMEM, "td_grad_scaler_unscale: out of memory");
        s->list = l;
        s->nlist = n;
    }
    if (s->scratch && (s->scratch_device.type != d.type || s->scratch_device.index != d.index)) {
        td_device_free(s->scratch_device, s->scratch);
        s->scratch = NULL;
        s->scratch_bytes = 0;
    }
    s->scratch_device = d;
    for (size_t i = 0; i < n; i++)
        s->list[i] = (td__mt_tensor){
            .grad = params[i].grad, .count = params[i].count, .dtype = (int32_t)params[i].dtype};
    td__mt_args a = {.op = TD__MT_UNSCALE, .factor = inv};
    double flag = 0;
    TD__TRY(td__device_multi_tensor(d, &a, s->list, n, &s->scratch, &s->scratch_bytes, &flag,
                                    "td_grad_scaler_unscale"));
    *bad = flag != 0;
    return TD_OK;
}

float td_grad_scaler_scale(const td_grad_scaler *s) { return s ? (float)s->scale : 1.0f; }

/* g *= inv over n elements of dtype dt; 1 when any result is inf or NaN. */
static int unscale(void *g, td_dtype dt, size_t n, float inv) {
    int bad = 0;
    if (dt == TD_F32) {
        float *f = g;
        for (size_t i = 0; i < n; i++) {
            f[i] *= inv;
            bad |= !isfinite(f[i]);
        }
        return bad;
    }
    enum { BLOCK = 1024 }; /* through f32 a block at a time: the conversions vectorise */
    float f[BLOCK];
    size_t es = td_dtype_size(dt);
    for (size_t j = 0; j < n; j += BLOCK) {
        size_t len = n - j < BLOCK ? n - j : BLOCK;
        void *at = (unsigned char *)g + j * es;
        td__convert(f, TD_F32, at, dt, len);
        for (size_t i = 0; i < len; i++) {
            f[i] *= inv;
            bad |= !isfinite(f[i]);
        }
        td__convert(at, dt, f, TD_F32, len);
    }
    return bad;
}

td_status td_grad_scaler_unscale(td_grad_scaler *s, td_optim *optim) {
    if (!s || !optim) return td__fail(TD_EINVAL, "td_grad_scaler_unscale: NULL argument");
    if (s->unscaled) return TD_OK;
    td_param *params;
    size_t n;
    td_optim_parameters(optim, &params, &n);
    /* In double, as PyTorch does, then to float: 1/2^k is exact either way. */
    float inv = (float)(1.0 / s->scale);
    int32_t bad = 0;
    if (n && params[0].device.type != TD_DEVICE_CPU)
        TD__TRY(unscale_on_device(s, params, n, inv, &bad));
    else
        for (size_t i = 0; i < n; i++)
            if (params[i].grad)
                bad |= unscale(params[i].grad, params[i].dtype, params[i].count, inv);
    if (s->p.comm) TD__TRY(td_comm_allreduce(s->p.comm, &bad, &bad, 1, TD_I32, TD_OP_MAX));
    s->found_inf = bad != 0;
    s->unscaled = 1;
    return TD_OK;
}

td_status td_grad_scaler_step(td_grad_scaler *s, td_optim *optim, int *skipped) {
    if (skipped) *skipped = 0;
    if (!s || !optim) return td__fail(TD_EINVAL, "td_grad_scaler_step: NULL argument");
    TD__TRY(td_grad_scaler_unscale(s, optim));
    if (s->found_inf) {
        s->skipped++;
        if (skipped) *skipped = 1;
        return TD_OK;
    }
    return td_optim_step(optim);
}

void td_grad_scaler_update(td_grad_scaler *s) {
    if (!s || !s->unscaled) return;
    if (s->p.dynamic) {
        if (s->found_inf) {
            s->scale *= s->p.backoff_factor;
            s->growth_tracker = 0;
        } else if (++s->growth_tracker == s->p.growth_interval) {
            s->scale *= s->p.growth_factor;
            s->growth_tracker = 0;
        }
    }
    s->unscaled = 0;
    s->found_inf = 0;
}

int64_t td_grad_scaler_skipped(const td_grad_scaler *s) { return s ? s->skipped : 0; }

void td_grad_scaler_state(td_grad_scaler *s, td_param **state, size_t *n_state) {
    if (state) *state = s ? s->state : NULL;
    if (n_state) *n_state = s ? 2 : 0;
}
