/* SGD and AdamW with torch.optim's update rules (single-tensor, non-fused paths of PyTorch
 * 1.13), over td_param arrays, plus the state they expose for checkpoints. A parameter stored
 * in bf16 or f16 gets f32 master weights here unless its master_dtype is its own dtype
 * (mixed precision's O2 and O3): with them, each step updates the master from the converted
 * gradient and writes the rounded values back to the parameter, so small updates accumulate
 * instead of vanishing in the low dtype (apex's master weights); without them (apex's O3), the
 * parameter and its momentum or Adam moments are stored in the low dtype and each step
 * computes on them in f32, block by block, and rounds the results once.
 *
 * Scalars follow PyTorch: hyperparameters and bias corrections are computed in double (as
 * Python floats) and cast to float where PyTorch passes them into a float kernel. It does
 * not handle sparse gradients, amsgrad, maximize or per-group hyperparameters.
 *
 * A parameter whose writer hook is set (td_param.written: a graph laying out copies of its
 * weights) hears of each block as it is written, while the block is in cache.
 *
 * Parameters on a GPU (a graph placed there) keep their optimizer state on that GPU too, and
 * a step is one multi-tensor launch (src/device/multi_tensor.h) with the same arithmetic. */
#include "tandem/optim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "device/device_impl.h"

/* The update loops are the hot part and -O2's cheapest vectorizer cost model leaves them
 * scalar. (AdamW's sqrtf vectorizes only when the build passes -fno-math-errno.) */
#if defined(__GNUC__) && !defined(__clang__)
#define TD__VECTORIZE __attribute__((optimize("O3")))
#else
#define TD__VECTORIZE
#endif

enum { KIND_SGD, KIND_ADAMW };

struct td_optim {
    int kind;
    td_param *params; /* caller's array, (n) */
    size_t n;
    double lr;
    td_sgd_params sgd;
    td_adamw_params adamw;
    int64_t *steps;  /* (n) steps taken by each parameter */
    void **buf1;     /* (n) momentum_buffer or exp_avg, each (params[i].count) of the state
                        dtype (state_dtype), or NULL */
    void **buf2;     /* (n) exp_avg_sq, the same, or NULL */
    float **master;  /* (n) f32 master weights of low-precision parameters, or NULL */
    td_param *state; /* (n_state) */
    size_t n_state;
    char **names;      /* (n_state) owned strings behind state[].name */
    td_device device;  /* where every parameter, gradient and buffer lives */
    td__mt_tensor *mt; /* (n) the multi-tensor list of a step on a GPU */
    void *mt_scratch;  /* its device copy (multi_tensor.h) */
    size_t mt_scratch_bytes;
};

td_sgd_params td_sgd_default_params(void) {
    td_sgd_params p = {0};
    p.lr = 0.01;
    return p;
}

td_adamw_params td_adamw_default_params(void) {
    td_adamw_params p = {0};
    p.lr = 1e-3;
    p.beta1 = 0.9;
    p.beta2 = 0.999;
    p.eps = 1e-8;
    p.weight_decay = 1e-2;
    return p;
}

/* Zeroed state of `bytes` on the optimizer's device. */
static td_status state_alloc(td_optim *o, size_t bytes, void **out) {
    if (o->device.type == TD_DEVICE_CPU) {
        *out = calloc(1, bytes ? bytes : 1);
        return *out ? TD_OK : TD_ENOMEM;
    }
    *out = NULL;
    TD__TRY(td_device_alloc(o->device, bytes ? bytes : 1, out));
    return td__device_memset(o->device, *out, 0, bytes, "optimizer state");
}

static void state_free(td_optim *o, void *p) {
    if (p) td_device_free(o->device, p);
}

void td_optim_destroy(td_optim *o) {
    if (!o) return;
    for (size_t i = 0; i < o->n; i++) {
        if (o->buf1) state_free(o, o->buf1[i]);
        if (o->buf2) state_free(o, o->buf2[i]);
        if (o->master) state_free(o, o->master[i]);
    }
    if (o->mt_scratch) td_device_free(o->device, o->mt_scratch);
    free(o->mt);
    free(o->master);
    for (size_t i = 0; i < o->n_state; i++) free(o->names[i]);
    free(o->names);
    free(o->state);
    free(o->buf1);
    free(o->buf2);
    free(o->steps);
    free(o);
}

/* The dtype of parameter i's optimizer state: f32, unless the parameter is low-precision and
 * stepped without master weights, when it is the parameter's own. */
static td_dtype state_dtype(const td_optim *o, size_t i) {
    return o->master[i] ? TD_F32 : o->params[i].dtype;
}

static td_status check_params(const char *who, const td_param *params, size_t n) {
    if (!params && n) return td__fail(TD_EINVAL, "%s: params is NULL with n = %zu", who, n);
    for (size_t i = 0; i < n; i++) {
        const td_param *p = &params[i];
        if (!p->name) return td__fail(TD_EINVAL, "%s: params[%zu] has no name", who, i);
        if (p->device.type != params[0].device.type || p->device.index != params[0].device.index) {
            char a[32], b[32];
            td_device_format(params[0].device, a, sizeof a);
            td_device_format(p->device, b, sizeof b);
            return td__fail(TD_EINVAL, "%s: parameter %s is on %s but %s is on %s: one device", who,
                            p->name, b, params[0].name, a);
        }
        if (!td__is_float(p->dtype))
            return td__fail(TD_EDTYPE, "%s: parameter %s is %s, expected f32, bf16 or f16", who,
                            p->name, td_dtype_name(p->dtype));
        if (!p->data && p->count)
            return td__fail(TD_EINVAL, "%s: parameter %s has no data", who, p->name);
        if (p->master_dtype != TD_F32 && p->master_dtype != p->dtype)
            return td__fail(TD_EDTYPE,
                            "%s: parameter %s is %s with master_dtype %s, expected f32 (master "
                            "weights) or %s (none)",
                            who, p->name, td_dtype_name(p->dtype), td_dtype_name(p->master_dtype),
                            td_dtype_name(p->dtype));
        for (size_t j = 0; j < i; j++)
            if (strcmp(params[j].name, p->name) == 0)
                return td__fail(TD_EINVAL,
                                "%s: parameter name %s appears twice (params[%zu] and [%zu])", who,
                                p->name, j, i);
    }
    return TD_OK;
}

/* Names and describes state buffer `data` of parameter p ("optim.<name>.<suffix>", of p's shape
 * and tensor-parallel slice), or with p NULL the per-parameter step counts ("optim.<suffix>",
 * one per parameter). */
static td_status add_state(td_optim *o, const td_param *p, const char *suffix, void *data,
                           size_t count, td_dtype dtype) {
    const char *param_name = p ? p->name : "";
    size_t len = strlen(param_name) + strlen(suffix) + 8;
    char *name = malloc(len);
    if (!name) return td__fail(TD_ENOMEM, "optimizer state: out of memory");
    if (param_name[0])
        snprintf(name, len, "optim.%s.%s", param_name, suffix);
    else
        snprintf(name, len, "optim.%s", suffix);
    td_param *s = &o->state[o->n_state];
    memset(s, 0, sizeof *s);
    s->device = dtype != TD_I64 ? o->device : td_device_cpu(); /* the step counts stay here */
    o->names[o->n_state] = name;
    o->n_state++;
    s->name = name;
    s->data = data;
    s->count = count;
    s->dtype = dtype;
    s->ndim = p ? p->ndim : 1;
    s->shape[0] = (int64_t)count;
    for (int d = 0; p && d < p->ndim; d++) s->shape[d] = p->shape[d];
    if (p) s->split = p->split;
    return TD_OK;
}

/* Allocates the per-parameter buffers (zeros, so a fresh state saves deterministically). */
static td_status create_common(td_optim **out, int kind, td_param *params, size_t n, int nbufs,
                               const char *suffix1, const char *suffix2) {
    td_optim *o = calloc(1, sizeof *o);
    if (!o) return td__fail(TD_ENOMEM, "optimizer: out of memory");
    o->kind = kind;
    o->params = params;
    o->n = n;
    o->device = n ? params[0].device : td_device_cpu();
    o->steps = calloc(n ? n : 1, sizeof *o->steps);
    o->buf1 = calloc(n ? n : 1, sizeof *o->buf1);
    o->buf2 = calloc(n ? n : 1, sizeof *o->buf2);
    o->master = calloc(n ? n : 1, sizeof *o->master);
    o->state = calloc(1 + 3 * n, sizeof *o->state);
    o->names = calloc(1 + 3 * n, sizeof *o->names);
    if (!o->steps || !o->buf1 || !o->buf2 || !o->master || !o->state || !o->names) {
        td_optim_destroy(o);
        return td__fail(TD_ENOMEM, "optimizer: out of memory");
    }
    td_status st;
    for (size_t i = 0; i < n; i++) {
        if (params[i].dtype == TD_F32 || params[i].master_dtype == params[i].dtype) continue;
        size_t c = params[i].count;
        if (state_alloc(o, c * sizeof(float), (void **)&o->master[i]) != TD_OK) {
            st =
                td__fail(TD_ENOMEM, "optimizer: cannot allocate master weights for %s (%zu floats)",
                         params[i].name, c);
            goto fail;
        }
        if (o->device.type == TD_DEVICE_CPU) {
            td__convert(o->master[i], TD_F32, params[i].data, params[i].dtype, c);
        } else {
            td__mt_args a = {.op = TD__MT_MASTER_INIT};
            td__mt_tensor t = {.param = params[i].data,
                               .master = o->master[i],
                               .count = c,
                               .dtype = (int32_t)params[i].dtype};
            st = td__device_multi_tensor(o->device, &a, &t, 1, &o->mt_scratch, &o->mt_scratch_bytes,
                                         NULL, "optimizer");
            if (st != TD_OK) goto fail;
        }
    }
    if ((st = add_state(o, NULL, "step", o->steps, n, TD_I64)) != TD_OK) goto fail;
    for (size_t i = 0; i < n && nbufs > 0; i++) {
        size_t c = params[i].count;
        td_dtype sd = state_dtype(o, i);
        if (state_alloc(o, c * td_dtype_size(sd), &o->buf1[i]) != TD_OK ||
            (nbufs > 1 && state_alloc(o, c * td_dtype_size(sd), &o->buf2[i]) != TD_OK)) {
            st = td__fail(TD_ENOMEM, "optimizer: cannot allocate state for %s (%zu elements)",
                          params[i].name, c);
            goto fail;
        }
        st = add_state(o, &params[i], suffix1, o->buf1[i], c, sd);
        if (st != TD_OK) goto fail;
        if (nbufs > 1) {
            st = add_state(o, &params[i], suffix2, o->buf2[i], c, sd);
            if (st != TD_OK) goto fail;
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (!o->master[i]) continue;
        st = add_state(o, &params[i], "master", o->master[i], params[i].count, TD_F32);
        if (st != TD_OK) goto fail;
    }
    *out = o;
    return TD_OK;
fail:
    td_optim_destroy(o);
    return st;
}

td_status td_optim_create_sgd(td_optim **out, td_param *params, size_t n, const td_sgd_params *hp) {
    if (!out || !hp) return td__fail(TD_EINVAL, "td_optim_create_sgd: out and hp must not be NULL");
    *out = NULL;
    td_status st = check_params("td_optim_create_sgd", params, n);
    if (st != TD_OK) return st;
    if (!(hp->lr >= 0))
        return td__fail(TD_EINVAL, "td_optim_create_sgd: lr %g, expected >= 0", hp->lr);
    if (!(hp->momentum >= 0))
        return td__fail(TD_EINVAL, "td_optim_create_sgd: momentum %g, expected >= 0", hp->momentum);
    if (!(hp->weight_decay >= 0))
        return td__fail(TD_EINVAL, "td_optim_create_sgd: weight_decay %g, expected >= 0",
                        hp->weight_decay);
    if (hp->nesterov && (hp->momentum <= 0 || hp->dampening != 0))
        return td__fail(TD_EINVAL,
                        "td_optim_create_sgd: nesterov needs momentum > 0 and dampening 0, got "
                        "momentum %g dampening %g",
                        hp->momentum, hp->dampening);
    td_optim *o = NULL;
    st = create_common(&o, KIND_SGD, params, n, hp->momentum != 0 ? 1 : 0, "momentum_buffer", NULL);
    if (st != TD_OK) return st;
    o->sgd = *hp;
    o->lr = hp->lr;
    *out = o;
    return TD_OK;
}

td_status td_optim_create_adamw(td_optim **out, td_param *params, size_t n,
                                const td_adamw_params *hp) {
    if (!out || !hp)
        return td__fail(TD_EINVAL, "td_optim_create_adamw: out and hp must not be NULL");
    *out = NULL;
    td_status st = check_params("td_optim_create_adamw", params, n);
    if (st != TD_OK) return st;
    if (!(hp->lr >= 0))
        return td__fail(TD_EINVAL, "td_optim_create_adamw: lr %g, expected >= 0", hp->lr);
    if (!(hp->eps >= 0))
        return td__fail(TD_EINVAL, "td_optim_create_adamw: eps %g, expected >= 0", hp->eps);
    if (!(hp->beta1 >= 0 && hp->beta1 < 1) || !(hp->beta2 >= 0 && hp->beta2 < 1))
        return td__fail(TD_EINVAL, "td_optim_create_adamw: betas (%g, %g), expected each in [0, 1)",
                        hp->beta1, hp->beta2);
    if (!(hp->weight_decay >= 0))
        return td__fail(TD_EINVAL, "td_optim_create_adamw: weight_decay %g, expected >= 0",
                        hp->weight_decay);
    td_optim *o = NULL;
    st = create_common(&o, KIND_ADAMW, params, n, 2, "exp_avg", "exp_avg_sq");
    if (st != TD_OK) return st;
    o->adamw = *hp;
    o->lr = hp->lr;
    *out = o;
    return TD_OK;
}

TD__VECTORIZE static void sgd_block(const td_sgd_params *hp, double lr, float *restrict p,
                                    const float *restrict g, float *restrict buf, size_t count,
                                    int first) {
    const float wd = (float)hp->weight_decay, mom = (float)hp->momentum;
    const float keep = (float)(1.0 - hp->dampening), neg_lr = (float)(-lr);
    if (!buf) {
        for (size_t j = 0; j < count; j++) {
            float d = wd != 0 ? g[j] + wd * p[j] : g[j];
            p[j] = p[j] + neg_lr * d;
        }
        return;
    }
    if (first) { /* torch: buf = clone(d_p) on a parameter's first step */
        for (size_t j = 0; j < count; j++) buf[j] = wd != 0 ? g[j] + wd * p[j] : g[j];
    } else {
        for (size_t j = 0; j < count; j++) {
            float d = wd != 0 ? g[j] + wd * p[j] : g[j];
            buf[j] = buf[j] * mom + keep * d;
        }
    }
    if (hp->nesterov) {
        for (size_t j = 0; j < count; j++) {
            float d = wd != 0 ? g[j] + wd * p[j] : g[j];
            p[j] = p[j] + neg_lr * (d + mom * buf[j]);
        }
    } else {
        for (size_t j = 0; j < count; j++) p[j] = p[j] + neg_lr * buf[j];
    }
}

enum { BLOCK = 2048 }; /* floats per block: a few blocks of state stay in L1 */

/* Elements [j, j + len) of a buffer of dtype dt as f32: the buffer itself when it is f32,
 * else widened into scratch. */
static float *widen(float *scratch, const void *src, td_dtype dt, size_t j, size_t len) {
    if (dt == TD_F32) return (float *)src + j;
    td__convert(scratch, TD_F32, (const uint16_t *)src + j, dt, len);
    return scratch;
}

/* Stores a block that widen (or a master) gave back into elements [j, j + len) of dst;
 * nothing to do when dst is f32, as the block then is dst's own memory. */
static void narrow(void *dst, td_dtype dt, size_t j, const float *block, size_t len) {
    if (dt != TD_F32) td__convert((uint16_t *)dst + j, dt, block, TD_F32, len);
}

/* Block by block, so the momentum written by the first loop is still in L1 when the second
 * reads it: one pass over memory instead of two (a third less traffic on large layers). A
 * low-precision parameter updates its f32 master block, or without one a widened copy of its
 * own block, from the widened gradient block, and takes the rounded result. */
static void sgd_update(const td_sgd_params *hp, double lr, const td_param *prm, float *master,
                       void *buf, td_dtype sd, int first) {
    float p32[BLOCK], g32[BLOCK], b32[BLOCK];
    size_t count = prm->count;
    for (size_t j = 0; j < count; j += BLOCK) {
        size_t len = count - j < BLOCK ? count - j : BLOCK;
        float *p = master ? master + j : widen(p32, prm->data, prm->dtype, j, len);
        float *b = buf ? widen(b32, buf, sd, j, len) : NULL;
        sgd_block(hp, lr, p, widen(g32, prm->grad, prm->dtype, j, len), b, len, first);
        narrow(prm->data, prm->dtype, j, p, len);
        if (b) narrow(buf, sd, j, b, len);
        if (prm->written) prm->written(prm->written_ctx, prm->data, j, j + len);
    }
}

TD__VECTORIZE static void adamw_update(const td_adamw_params *hp, double lr, int64_t step,
                                       float *restrict p, const float *restrict g,
                                       float *restrict m, float *restrict v, size_t count) {
    const float decay = (float)(1.0 - lr * hp->weight_decay);
    const float b1 = (float)hp->beta1, b2 = (float)hp->beta2;
    const float one_b1 = (float)(1.0 - hp->beta1), one_b2 = (float)(1.0 - hp->beta2);
    const double bc1 = 1.0 - pow(hp->beta1, (double)step), bc2 = 1.0 - pow(hp->beta2, (double)step);
    const float neg_step_size = (float)(-(lr / bc1));
    const float bc2_sqrt = (float)sqrt(bc2), eps = (float)hp->eps;
    for (size_t j = 0; j < count; j++) {
        float pj = p[j] * decay;
        float mj = m[j] * b1 + one_b1 * g[j];
        float vj = v[j] * b2 + one_b2 * g[j] * g[j];
        float denom = sqrtf(vj) / bc2_sqrt + eps;
        m[j] = mj;
        v[j] = vj;
        p[j] = pj + neg_step_size * (mj / denom);
    }
}

/* AdamW on parameter i, through its master weights when it has them, block by block as SGD. */
static void adamw_step(td_optim *o, size_t i) {
    const td_param *prm = &o->params[i];
    float *master = o->master[i], p32[BLOCK], g32[BLOCK], m32[BLOCK], v32[BLOCK];
    td_dtype sd = state_dtype(o, i);
    for (size_t j = 0; j < prm->count; j += BLOCK) {
        size_t len = prm->count - j < BLOCK ? prm->count - j : BLOCK;
        float *p = master ? master + j : widen(p32, prm->data, prm->dtype, j, len);
        float *m = widen(m32, o->buf1[i], sd, j, len), *v = widen(v32, o->buf2[i], sd, j, len);
        adamw_update(&o->adamw, o->lr, o->steps[i], p, widen(g32, prm->grad, prm->dtype, j, len), m,
                     v, len);
        narrow(prm->data, prm->dtype, j, p, len);
        narrow(o->buf1[i], sd, j, m, len);
        narrow(o->buf2[i], sd, j, v, len);
        if (prm->written) prm->written(prm->written_ctx, prm->data, j, j + len);
    }
}

/* Every parameter's update in one launch on the optimizer's GPU; the step counts stay on the
 * host, which also computes each parameter's scalars as adamw_update does. */
static td_status device_step(td_optim *o) {
    if (!o->mt && !(o->mt = calloc(o->n ? o->n : 1, sizeof *o->mt)))
        return td__fail(TD_ENOMEM, "td_optim_step: out of memory");
    td__mt_args a = {.op = o->kind == KIND_SGD ? TD__MT_SGD : TD__MT_ADAMW};
    if (o->kind == KIND_SGD) {
        a.neg_lr = (float)(-o->lr);
        a.weight_decay = (float)o->sgd.weight_decay;
        a.momentum = (float)o->sgd.momentum;
        a.keep = (float)(1.0 - o->sgd.dampening);
        a.nesterov = o->sgd.nesterov;
    } else {
        const td_adamw_params *hp = &o->adamw;
        a.decay = (float)(1.0 - o->lr * hp->weight_decay);
        a.beta1 = (float)hp->beta1;
        a.beta2 = (float)hp->beta2;
        a.one_b1 = (float)(1.0 - hp->beta1);
        a.one_b2 = (float)(1.0 - hp->beta2);
        a.eps = (float)hp->eps;
    }
    for (size_t i = 0; i < o->n; i++) {
        td_param *p = &o->params[i];
        td__mt_tensor *t = &o->mt[i];
        *t = (td__mt_tensor){.param = p->data,
                             .grad = p->grad,
                             .buf1 = o->buf1[i],
                             .buf2 = o->buf2[i],
                             .master = o->master[i],
                             .count = p->count,
                             .dtype = (int32_t)p->dtype,
                             .state_dtype = (int32_t)state_dtype(o, i),
                             .first = o->steps[i] == 0};
        if (!p->grad) continue;
        o->steps[i]++;
        if (o->kind == KIND_ADAMW) {
            double bc1 = 1.0 - pow(o->adamw.beta1, (double)o->steps[i]);
            double bc2 = 1.0 - pow(o->adamw.beta2, (double)o->steps[i]);
            t->neg_step = (float)(-(o->lr / bc1));
            t->bc2_sqrt = (float)sqrt(bc2);
        }
    }
    return td__device_multi_tensor(o->device, &a, o->mt, o->n, &o->mt_scratch, &o->mt_scratch_bytes,
                                   NULL, "td_optim_step");
}

td_status td_optim_step(td_optim *o) {
    if (!o) return td__fail(TD_EINVAL, "td_optim_step: optimizer is NULL");
    for (size_t i = 0; i < o->n; i++)
        if (o->params[i].grad && o->steps[i] < 0)
            return td__fail(TD_ESTATE,
                            "td_optim_step: optim.step of %s is %lld (a bad checkpoint?)",
                            o->params[i].name, (long long)o->steps[i]);
    if (o->device.type != TD_DEVICE_CPU) return device_step(o);
    for (size_t i = 0; i < o->n; i++) {
        td_param *p = &o->params[i];
        if (!p->grad) continue;
        if (o->kind == KIND_SGD) {
            sgd_update(&o->sgd, o->lr, p, o->master[i], o->buf1[i], state_dtype(o, i),
                       o->steps[i] == 0);
            o->steps[i]++;
        } else {
            o->steps[i]++;
            adamw_step(o, i);
        }
    }
    return TD_OK;
}

void td_optim_zero_grad(td_optim *o) {
    if (!o) return;
    for (size_t i = 0; i < o->n; i++)
        if (o->params[i].grad)
            td__device_memset(o->device, o->params[i].grad, 0,
                              o->params[i].count * td_dtype_size(o->params[i].dtype),
                              "td_optim_zero_grad");
}

void td_optim_parameters(const td_optim *o, td_param **params, size_t *n) {
    if (params) *params = o ? o->params : NULL;
    if (n) *n = o ? o->n : 0;
}

void td_optim_set_lr(td_optim *o, double lr) {
    if (o) o->lr = lr;
}

double td_optim_get_lr(const td_optim *o) { return o ? o->lr : 0.0; }

void td_optim_state(td_optim *o, td_param **state, size_t *n_state) {
    if (state) *state = o ? o->state : NULL;
    if (n_state) *n_state = o ? o->n_state : 0;
}
