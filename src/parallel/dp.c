/* DataParallel: one process, one replica graph per worker thread, and torch.nn.DataParallel's eight
 * steps per iteration run from the calling thread (see dp.h).
 *
 * Every transfer between "devices" is an explicit copy into memory the receiving replica owns
 * (parameters out, batch slices, outputs in, output gradients out, gradients in), so the
 * memory each replica holds and the time the single coordinating thread spends are what
 * DataParallel costs on real devices, minus the bus. Only forward and backward run on the
 * worker threads; everything else is serial, as in torch.nn.DataParallel. With a comm (DDP2)
 * replica 0's gradients go through a td_ddp as step (7) finishes each one, so the buckets'
 * all-reduces across hosts overlap the rest of the summing.
 *
 * Replicas may train on GPUs (td_dp_params.devices, as DataParallel's device_ids): then the
 * copies are real ones between devices and the host, and the gradients are summed on the host
 * in the same order and sent back to replica 0's GPU, the bus's cost that DataParallel pays.
 * Replicas that share a GPU share its compute stream and record no CUDA graphs. */
#include "tandem/dp.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/tensor.h"

#include "core/core_impl.h"

typedef enum { JOB_NONE = 0, JOB_BUILD, JOB_FORWARD, JOB_BACKWARD, JOB_DESTROY, JOB_QUIT } job_kind;

typedef struct {
    td_dp *dp;
    int index;
    td_graph *g;
    td_model m;
    td_param *params, *buffers;
    size_t n_params, n_buffers;
    float *dy; /* (b, classes): this replica's slice of the output gradient */
    pthread_t thread;
    td_status status; /* of the last job */
    char error[256];  /* td_last_error() of the worker thread when status != TD_OK */
} dp_replica;

struct td_dp {
    td_dp_params p;
    td_device *device; /* (n) where each replica trains */
    int n;
    int64_t b;      /* per-replica batch */
    int64_t sample; /* floats per input sample */
    int64_t classes;
    dp_replica *r;
    /* replica 0's extra memory */
    float *batch_x;          /* (B, sample): the whole batch before scatter */
    int64_t *batch_y;        /* (B) */
    float *gathered;         /* (B, classes) log-probabilities */
    float *gathered_dy;      /* (B, classes) */
    unsigned char *staging;  /* (grad_bytes): another replica's gradients, copied in */
    unsigned char *host_sum; /* (grad_bytes) with a replica on a GPU: replica 0's gradients
                                summed on the host; NULL otherwise */
    size_t grad_bytes;
    td_optim *optim;
    td_ddp *ddp;    /* DDP2: replica 0's parameters across hosts, or NULL */
    size_t *offset; /* (n_params) each parameter's first byte in staging */
    double phase_s[TD_DP_PHASE_COUNT];
    /* worker dispatch */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    job_kind job;
    int only; /* the one replica that runs `job`, or -1 for all */
    uint64_t generation;
    int pending;
    int n_started; /* worker threads running */
};

td_dp_params td_dp_default_params(void) {
    td_dp_params p;
    memset(&p, 0, sizeof p);
    p.n_devices = 2;
    p.global_batch = 128;
    p.model = TD_MODEL_MLP;
    p.seed = 0;
    p.build = NULL;
    p.build_ctx = NULL;
    p.graph = td_graph_default_params();
    p.sgd = td_sgd_default_params();
    p.pin_threads = 1;
    p.ddp = td_ddp_default_params();
    return p;
}

const char *td_dp_phase_name(td_dp_phase phase) {
    static const char *names[TD_DP_PHASE_COUNT] = {"replicate", "scatter",  "forward", "gather",
                                                   "loss",      "backward", "reduce",  "optimizer"};
    return (unsigned)phase < TD_DP_PHASE_COUNT ? names[phase] : "invalid";
}

/* The d % ncores-th core of the process's affinity mask, so that two replicas share a core
 * only when there are more replicas than cores. */
static void pin_to_device(int d) {
    cpu_set_t allowed, one;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
    int ncores = CPU_COUNT(&allowed);
    if (ncores <= 0) return;
    int want = d % ncores, seen = 0;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &allowed)) continue;
        if (seen++ == want) {
            CPU_ZERO(&one);
            CPU_SET(c, &one);
            pthread_setaffinity_np(pthread_self(), sizeof one, &one);
            return;
        }
    }
}

static td_status build_replica(td_dp *dp, int d);

/* A graph is built, run and destroyed on its replica's own thread: oneDNN's library-managed
 * scratchpad belongs to the thread that created a primitive, and executing the primitive on
 * another thread finds none (a crash, not an error). */
static td_status run_job(dp_replica *r, job_kind job) {
    if (job == JOB_BUILD) return build_replica(r->dp, r->index);
    if (job == JOB_DESTROY) {
        td_graph_destroy(r->g);
        r->g = NULL;
        return TD_OK;
    }
    if (job == JOB_FORWARD) {
        /* Replicas start every iteration with fresh gradients, as torch's replicas do. */
        td_status s = td_graph_zero_grad(r->g);
        if (s != TD_OK) return s;
        return td_graph_forward(r->g);
    }
    if (job == JOB_BACKWARD) return td_graph_backward_from(r->g, r->m.output, r->dy);
    return TD_OK;
}

static void *worker_main(void *arg) {
    dp_replica *r = arg;
    td_dp *dp = r->dp;
    if (dp->p.pin_threads) pin_to_device(r->index);
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&dp->mu);
        while (dp->generation == seen) pthread_cond_wait(&dp->go, &dp->mu);
        seen = dp->generation;
        job_kind job = dp->job;
        int mine = dp->only < 0 || dp->only == r->index;
        pthread_mutex_unlock(&dp->mu);
        if (job == JOB_QUIT) break;
        if (!mine) continue;
        td_status s = run_job(r, job);
        r->status = s;
        if (s != TD_OK) {
            strncpy(r->error, td_last_error(), sizeof r->error - 1);
            r->error[sizeof r->error - 1] = '\0';
        }
        pthread_mutex_lock(&dp->mu);
        if (--dp->pending == 0) pthread_cond_signal(&dp->done);
        pthread_mutex_unlock(&dp->mu);
    }
    return NULL;
}

/* Runs `job` on replica `only`'s thread (or on every started one for -1) and waits. */
static td_status run_on(td_dp *dp, job_kind job, int only, const char *what) {
    pthread_mutex_lock(&dp->mu);
    dp->job = job;
    dp->only = only;
    dp->pending = only >= 0 ? 1 : dp->n_started;
    for (int d = 0; d < dp->n_started; d++)
        if (only < 0 || only == d) dp->r[d].status = TD_OK;
    dp->generation++;
    pthread_cond_broadcast(&dp->go);
    while (dp->pending > 0) pthread_cond_wait(&dp->done, &dp->mu);
    pthread_mutex_unlock(&dp->mu);
    for (int d = 0; d < dp->n_started; d++)
        if ((only < 0 || only == d) && dp->r[d].status != TD_OK)
            return td__fail(dp->r[d].status, "%s on replica %d: %s", what, d, dp->r[d].error);
    return TD_OK;
}

static td_status build_replica(td_dp *dp, int d) {
    dp_replica *r = &dp->r[d];
    td_graph_params o = dp->p.graph;   /* the same mixed precision on every device */
    o.seed = dp->p.seed + (uint64_t)d; /* each device has its own dropout stream */
    o.grad_enabled = 1;
    o.device = dp->device[d];
    /* Replicas sharing a GPU queue on its one compute stream from their own threads: one's
     * recording would take in the other's kernels. */
    for (int e = 0; e < dp->n; e++)
        if (e != d && dp->device[e].type == o.device.type &&
            dp->device[e].index == o.device.index && o.device.type != TD_DEVICE_CPU)
            o.cuda_graphs = 0;
    td_status s = td_graph_create(&r->g, &o);
    if (s != TD_OK) return s;
    memset(&r->m, 0, sizeof r->m);
    if (dp->p.build)
        s = dp->p.build(r->g, dp->b, d, dp->p.build_ctx, &r->m);
    else
        s = td_model_build(r->g, dp->p.model, dp->b, dp->p.seed, &r->m);
    if (s != TD_OK) return s;
    if (!r->m.input || !r->m.labels || !r->m.output)
        return td__fail(TD_EINVAL,
                        "td_dp_create: replica %d's builder left input, labels or output NULL", d);
    td_shape xs = td_tensor_shape(r->m.input), ys = td_tensor_shape(r->m.labels);
    td_shape os = td_tensor_shape(r->m.output);
    if (xs.ndim < 1 || xs.dim[0] != dp->b || td_tensor_dtype(r->m.input) != TD_F32)
        return td__fail(TD_ESHAPE,
                        "td_dp_create: replica %d's input '%s' must be f32 with %lld rows", d,
                        td_tensor_name(r->m.input), (long long)dp->b);
    if (ys.ndim != 1 || ys.dim[0] != dp->b || td_tensor_dtype(r->m.labels) != TD_I64)
        return td__fail(TD_ESHAPE, "td_dp_create: replica %d's labels '%s' must be i64 (%lld)", d,
                        td_tensor_name(r->m.labels), (long long)dp->b);
    if (os.ndim != 2 || os.dim[0] != dp->b || td_tensor_dtype(r->m.output) != TD_F32)
        return td__fail(TD_ESHAPE,
                        "td_dp_create: replica %d's output '%s' must be f32 (%lld, classes)", d,
                        td_tensor_name(r->m.output), (long long)dp->b);
    int64_t sample = td_shape_numel(&xs) / dp->b;
    if (d == 0) {
        dp->sample = sample;
        dp->classes = os.dim[1];
    } else if (sample != dp->sample || os.dim[1] != dp->classes) {
        return td__fail(TD_ESHAPE,
                        "td_dp_create: replica %d has %lld floats per sample and %lld classes, "
                        "replica 0 has %lld and %lld",
                        d, (long long)sample, (long long)os.dim[1], (long long)dp->sample,
                        (long long)dp->classes);
    }
    TD__TRY(td_graph_parameters(r->g, &r->params, &r->n_params));
    TD__TRY(td_graph_buffers(r->g, &r->buffers, &r->n_buffers));
    r->dy = malloc((size_t)(dp->b * dp->classes) * sizeof(float));
    if (!r->dy) return td__fail(TD_ENOMEM, "td_dp_create: out of memory for replica %d", d);
    return TD_OK;
}

/* Replicas must agree with replica 0 parameter by parameter, or replication would copy
 * garbage. */
static td_status check_same_layout(const td_dp *dp, int d) {
    const dp_replica *a = &dp->r[0], *b = &dp->r[d];
    if (a->n_params != b->n_params || a->n_buffers != b->n_buffers)
        return td__fail(TD_ESHAPE,
                        "td_dp_create: replica %d has %zu parameters and %zu buffers, replica 0 "
                        "has %zu and %zu",
                        d, b->n_params, b->n_buffers, a->n_params, a->n_buffers);
    for (size_t i = 0; i < a->n_params + a->n_buffers; i++) {
        const td_param *x = i < a->n_params ? &a->params[i] : &a->buffers[i - a->n_params];
        const td_param *y = i < a->n_params ? &b->params[i] : &b->buffers[i - a->n_params];
        if (x->count != y->count || x->dtype != y->dtype || strcmp(x->name, y->name) != 0)
            return td__fail(TD_ESHAPE,
                            "td_dp_create: replica %d's '%s' (%zu elements) differs from replica "
                            "0's '%s' (%zu)",
                            d, y->name, y->count, x->name, x->count);
        if (i < a->n_params && (!x->grad || !y->grad || !td__is_float(x->dtype)))
            return td__fail(TD_EDTYPE,
                            "td_dp_create: parameter '%s' must be f32, bf16 or f16 with a gradient",
                            x->name);
    }
    return TD_OK;
}

td_status td_dp_create(td_dp **out, const td_dp_params *params) {
    if (!out || !params) return td__fail(TD_EINVAL, "td_dp_create: NULL argument");
    *out = NULL;
    if (params->n_devices < 1)
        return td__fail(TD_EINVAL, "td_dp_create: n_devices is %d, must be >= 1",
                        params->n_devices);
    if (params->global_batch < params->n_devices || params->global_batch % params->n_devices != 0)
        return td__fail(
            TD_EINVAL, "td_dp_create: global_batch %lld is not a positive multiple of n_devices %d",
            (long long)params->global_batch, params->n_devices);
    if (!params->build && ((unsigned)params->model >= TD_MODEL_COUNT))
        return td__fail(TD_EINVAL, "td_dp_create: model kind %d is not a td_model_kind",
                        (int)params->model);
    td_dp *dp = calloc(1, sizeof *dp);
    if (!dp) return td__fail(TD_ENOMEM, "td_dp_create: out of memory");
    dp->p = *params;
    dp->n = params->n_devices;
    dp->b = params->global_batch / params->n_devices;
    dp->r = calloc((size_t)dp->n, sizeof *dp->r);
    dp->device = calloc((size_t)dp->n, sizeof *dp->device);
    if (!dp->r || !dp->device) {
        free(dp->r);
        free(dp->device);
        free(dp);
        return td__fail(TD_ENOMEM, "td_dp_create: out of memory");
    }
    int on_gpu = 0; /* some replica trains on a GPU: its gradients are summed through the host */
    for (int d = 0; d < dp->n; d++) {
        dp->device[d] = params->devices ? params->devices[d] : params->graph.device;
        on_gpu |= dp->device[d].type != TD_DEVICE_CPU;
    }
    dp->p.devices = dp->device;
    pthread_mutex_init(&dp->mu, NULL);
    pthread_cond_init(&dp->go, NULL);
    pthread_cond_init(&dp->done, NULL);
    td_status s = TD_OK;
    for (int d = 0; d < dp->n && s == TD_OK; d++) {
        dp->r[d].dp = dp;
        dp->r[d].index = d;
        if (pthread_create(&dp->r[d].thread, NULL, worker_main, &dp->r[d]) != 0)
            s = td__fail(TD_ENOMEM, "td_dp_create: cannot start the worker thread of replica %d",
                         d);
        else
            dp->n_started++;
    }
    /* One at a time, so that a builder sharing build_ctx across replicas needs no locking. */
    for (int d = 0; d < dp->n && s == TD_OK; d++) {
        s = run_on(dp, JOB_BUILD, d, "td_dp_create: building");
        if (s == TD_OK && d > 0) s = check_same_layout(dp, d);
    }
    if (s == TD_OK) {
        const dp_replica *r0 = &dp->r[0];
        dp->offset = malloc((r0->n_params ? r0->n_params : 1) * sizeof *dp->offset);
        if (!dp->offset) s = td__fail(TD_ENOMEM, "td_dp_create: out of memory");
        for (size_t i = 0; dp->offset && i < r0->n_params; i++) {
            dp->offset[i] = dp->grad_bytes;
            dp->grad_bytes += r0->params[i].count * td_dtype_size(r0->params[i].dtype);
        }
    }
    if (s == TD_OK) {
        size_t B = (size_t)params->global_batch;
        dp->batch_x = malloc(B * (size_t)dp->sample * sizeof(float));
        dp->batch_y = malloc(B * sizeof(int64_t));
        dp->gathered = malloc(B * (size_t)dp->classes * sizeof(float));
        dp->gathered_dy = malloc(B * (size_t)dp->classes * sizeof(float));
        dp->staging = dp->n > 1 ? malloc(dp->grad_bytes ? dp->grad_bytes : 1) : NULL;
        dp->host_sum = dp->n > 1 && on_gpu ? malloc(dp->grad_bytes ? dp->grad_bytes : 1) : NULL;
        if (!dp->batch_x || !dp->batch_y || !dp->gathered || !dp->gathered_dy ||
            (dp->n > 1 && !dp->staging) || (dp->n > 1 && on_gpu && !dp->host_sum))
            s = td__fail(TD_ENOMEM, "td_dp_create: out of memory for replica 0's gather buffers");
    }
    /* DDP2: every host starts from rank 0's replica 0 (collective over comm). */
    if (s == TD_OK && params->comm)
        s = td_ddp_create(&dp->ddp, params->comm, dp->r[0].params, dp->r[0].n_params,
                          dp->r[0].buffers, dp->r[0].n_buffers, &params->ddp);
    if (s == TD_OK)
        s = td_optim_create_sgd(&dp->optim, dp->r[0].params, dp->r[0].n_params, &params->sgd);
    if (s != TD_OK) {
        td_dp_destroy(dp);
        return s;
    }
    *out = dp;
    return TD_OK;
}

void td_dp_destroy(td_dp *dp) {
    if (!dp) return;
    td_ddp_destroy(dp->ddp); /* gives replica 0 its gradient memory back */
    if (dp->n_started > 0) (void)run_on(dp, JOB_DESTROY, -1, "td_dp_destroy");
    pthread_mutex_lock(&dp->mu);
    dp->job = JOB_QUIT;
    dp->generation++;
    pthread_cond_broadcast(&dp->go);
    pthread_mutex_unlock(&dp->mu);
    for (int d = 0; d < dp->n; d++) {
        if (d < dp->n_started) pthread_join(dp->r[d].thread, NULL);
        free(dp->r[d].dy);
    }
    td_optim_destroy(dp->optim);
    pthread_cond_destroy(&dp->go);
    pthread_cond_destroy(&dp->done);
    pthread_mutex_destroy(&dp->mu);
    free(dp->batch_x);
    free(dp->batch_y);
    free(dp->gathered);
    free(dp->gathered_dy);
    free(dp->staging);
    free(dp->host_sum);
    free(dp->offset);
    free(dp->r);
    free(dp->device);
    free(dp);
}

/* (1) Broadcast replica 0's parameters and buffers to the others (device to device where
 * they are on GPUs, after replica 0's optimizer step has run). */
static td_status replicate(td_dp *dp) {
    const dp_replica *r0 = &dp->r[0];
    td_device from = dp->device[0];
    if (dp->n > 1 && from.type != TD_DEVICE_CPU) TD__TRY(td_device_synchronize(from));
    for (int d = 1; d < dp->n; d++) {
        dp_replica *r = &dp->r[d];
        for (size_t i = 0; i < r0->n_params + r0->n_buffers; i++) {
            const td_param *a = i < r0->n_params ? &r0->params[i] : &r0->buffers[i - r0->n_params];
            const td_param *b = i < r0->n_params ? &r->params[i] : &r->buffers[i - r0->n_params];
            TD__TRY(td_device_copy(dp->device[d], b->data, from, a->data,
                                   a->count * td_dtype_size(a->dtype)));
        }
    }
    return TD_OK;
}

/* (2) The batch lands on replica 0, then each replica receives its slice. */
static td_status scatter(td_dp *dp, const float *images, const int64_t *labels) {
    size_t B = (size_t)dp->p.global_batch;
    /* Checked before any replica's loss node could index with a bad label. */
    for (size_t i = 0; i < B; i++)
        if (labels[i] < 0 || labels[i] >= dp->classes)
            return td__fail(TD_EINVAL, "td_dp_step: label %lld of sample %zu is outside [0, %lld)",
                            (long long)labels[i], i, (long long)dp->classes);
    memcpy(dp->batch_x, images, B * (size_t)dp->sample * sizeof(float));
    memcpy(dp->batch_y, labels, B * sizeof(int64_t));
    for (int d = 0; d < dp->n; d++) {
        dp_replica *r = &dp->r[d];
        TD__TRY(td_tensor_write(r->m.input, dp->batch_x + (size_t)(d * dp->b * dp->sample)));
        TD__TRY(td_tensor_write(r->m.labels, dp->batch_y + (size_t)(d * dp->b)));
    }
    return TD_OK;
}

/* (4) Every replica's log-probabilities, in replica order, onto replica 0. */
static td_status gather(td_dp *dp) {
    for (int d = 0; d < dp->n; d++)
        TD__TRY(
            td_tensor_read(dp->r[d].m.output, dp->gathered + (size_t)(d * dp->b * dp->classes)));
    return TD_OK;
}

/* (5) Mean NLL over the gathered batch and its gradient: -1/B at each sample's label. */
static void loss_on_replica0(td_dp *dp, float *loss) {
    int64_t B = dp->p.global_batch, C = dp->classes;
    memset(dp->gathered_dy, 0, (size_t)(B * C) * sizeof(float));
    double sum = 0.0;
    const float g = -1.0f / (float)B;
    for (int64_t i = 0; i < B; i++) {
        int64_t y = dp->batch_y[i];
        sum -= dp->gathered[i * C + y];
        dp->gathered_dy[i * C + y] = g;
    }
    if (loss) *loss = (float)(sum / (double)B);
}

/* (7) Each other replica's gradients are copied onto replica 0, then added to its own; last
 * parameter first, as DDP lays its first bucket out, so that with DDP2 each parameter goes to
 * DDP as soon as it is summed and full buckets cross hosts while the rest are summed. */
static td_status reduce_grads(td_dp *dp) {
    dp_replica *r0 = &dp->r[0];
    td_device cpu = td_device_cpu();
    for (size_t i = r0->n_params; i-- > 0;) {
        const td_param *p = &r0->params[i];
        size_t bytes = p->count * td_dtype_size(p->dtype);
        unsigned char *in = dp->staging + dp->offset[i];
        /* On GPUs the sum is made on the host, in the same order, and goes back up. */
        void *sum = dp->host_sum ? dp->host_sum + dp->offset[i] : p->grad;
        if (dp->host_sum) TD__TRY(td_device_copy(cpu, sum, dp->device[0], p->grad, bytes));
        for (int d = 1; d < dp->n; d++) {
            TD__TRY(td_device_copy(cpu, in, dp->device[d], dp->r[d].params[i].grad, bytes));
            td__accumulate(sum, in, p->dtype, p->count);
        }
        if (dp->host_sum) TD__TRY(td_device_copy(dp->device[0], p->grad, cpu, sum, bytes));
        if (dp->ddp) TD__TRY(td_ddp_grad_ready(dp->ddp, i));
    }
    return dp->ddp ? td_ddp_finish_backward(dp->ddp) : TD_OK;
}

static void lap(td_dp *dp, td_dp_phase phase, uint64_t *t) {
    uint64_t now = td_time_ns();
    dp->phase_s[phase] += (double)(now - *t) * 1e-9;
    *t = now;
}

td_status td_dp_step(td_dp *dp, const float *images, const int64_t *labels, float *loss) {
    if (!dp || !images || !labels) return td__fail(TD_EINVAL, "td_dp_step: NULL argument");
    uint64_t t = td_time_ns();
    if (dp->ddp) TD__TRY(td_ddp_prepare_forward(dp->ddp)); /* buffers from rank 0 */
    TD__TRY(replicate(dp));
    lap(dp, TD_DP_REPLICATE, &t);
    TD__TRY(scatter(dp, images, labels));
    lap(dp, TD_DP_SCATTER, &t);
    TD__TRY(run_on(dp, JOB_FORWARD, -1, "td_dp_step: forward"));
    lap(dp, TD_DP_FORWARD, &t);
    TD__TRY(gather(dp));
    lap(dp, TD_DP_GATHER, &t);
    loss_on_replica0(dp, loss);
    lap(dp, TD_DP_LOSS, &t);
    /* (6) The output gradient goes back out before the parallel backward. */
    for (int d = 0; d < dp->n; d++)
        memcpy(dp->r[d].dy, dp->gathered_dy + (size_t)(d * dp->b * dp->classes),
               (size_t)(dp->b * dp->classes) * sizeof(float));
    TD__TRY(run_on(dp, JOB_BACKWARD, -1, "td_dp_step: backward"));
    lap(dp, TD_DP_BACKWARD, &t);
    TD__TRY(reduce_grads(dp));
    lap(dp, TD_DP_REDUCE, &t);
    TD__TRY(td_optim_step(dp->optim));
    lap(dp, TD_DP_OPTIMIZER, &t);
    return TD_OK;
}

int td_dp_replicas(const td_dp *dp) { return dp ? dp->n : 0; }

td_graph *td_dp_graph(td_dp *dp, int replica) {
    return dp && replica >= 0 && replica < dp->n ? dp->r[replica].g : NULL;
}

const td_model *td_dp_model(const td_dp *dp, int replica) {
    return dp && replica >= 0 && replica < dp->n ? &dp->r[replica].m : NULL;
}

td_status td_dp_memory_stats(const td_dp *dp, int replica, td_dp_memory *out) {
    if (!dp || !out) return td__fail(TD_EINVAL, "td_dp_memory_stats: NULL argument");
    if (replica < 0 || replica >= dp->n)
        return td__fail(TD_EINVAL, "td_dp_memory_stats: replica %d, there are %d", replica, dp->n);
    const dp_replica *r = &dp->r[replica];
    memset(out, 0, sizeof *out);
    for (size_t i = 0; i < r->n_params; i++)
        out->param_bytes += r->params[i].count * td_dtype_size(r->params[i].dtype);
    for (size_t i = 0; i < r->n_buffers; i++)
        out->param_bytes += r->buffers[i].count * td_dtype_size(r->buffers[i].dtype);
    out->graph_bytes = td_graph_memory_bytes(r->g);
    size_t B = (size_t)dp->p.global_batch, b = (size_t)dp->b;
    out->input_bytes = b * ((size_t)dp->sample * sizeof(float) + sizeof(int64_t));
    out->output_bytes = b * (size_t)dp->classes * sizeof(float);
    if (replica == 0) {
        out->input_bytes += B * ((size_t)dp->sample * sizeof(float) + sizeof(int64_t));
        out->output_bytes += 2 * B * (size_t)dp->classes * sizeof(float);
        out->reduce_bytes =
            (dp->staging ? dp->grad_bytes : 0) + (dp->host_sum ? dp->grad_bytes : 0);
        td_param *state = NULL;
        size_t n_state = 0;
        td_optim_state(dp->optim, &state, &n_state);
        for (size_t i = 0; i < n_state; i++)
            out->optimizer_bytes += state[i].count * td_dtype_size(state[i].dtype);
    }
    out->total_bytes = out->param_bytes + out->graph_bytes + out->input_bytes + out->output_bytes +
                       out->reduce_bytes + out->optimizer_bytes;
    return TD_OK;
}

void td_dp_phase_seconds(const td_dp *dp, double seconds[TD_DP_PHASE_COUNT]) {
    for (int i = 0; i < TD_DP_PHASE_COUNT; i++) seconds[i] = dp ? dp->phase_s[i] : 0.0;
}
