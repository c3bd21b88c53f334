/* The batch loader: turns a sampler's per-rank index list into contiguous batches, with one
 * prefetch thread filling the next batch while the caller trains on the current one.
 *
 * Two slots (double buffering): the caller holds at most one, the thread fills the other in
 * batch order. It does no shuffling of its own (the sampler does) and no transforms.
 *
 * On a GPU (td_loader_params.device) a slot is page-locked host memory plus device memory:
 * the thread fills the host side and queues its upload on the GPU's copy stream, ordered after
 * the compute stream's last use of the device side (an event recorded when the caller gave the
 * slot back); handing a slot out makes the compute stream wait for its upload. The host side
 * is refilled only once its last upload has finished. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/data.h"

#include "core/core_impl.h"
#include "device/device_impl.h"

enum { SLOT_FREE, SLOT_FILLING, SLOT_FULL, SLOT_HELD };

typedef struct {
    float *x;   /* (batch_size, sample_shape...) in host memory */
    int64_t *y; /* (batch_size) */
    size_t size;
    size_t index;
    int state;
    float *x_dev; /* on a GPU: the device side of x and y */
    int64_t *y_dev;
    void *uploaded; /* event after the last upload from x and y, or NULL */
    void *released; /* event after the compute stream's last use of x_dev and y_dev, or NULL */
} slot;

struct td_loader {
    td_dataset *dataset; /* read-only here; the accessor wants a mutable pointer */
    td_loader_params p;
    td_sampler *sampler;
    size_t numel;    /* floats per sample */
    size_t per_rank; /* sampler indices per epoch */
    size_t nb;       /* batches per epoch */
    slot slots[2];
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    int busy; /* the thread is copying into a slot outside the lock */
    uint64_t epoch;
    size_t next_fill;     /* next batch the thread fills */
    size_t next_take;     /* next batch the caller gets */
    int held;             /* slot the caller holds, or -1 */
    size_t capacity;      /* samples a slot holds */
    void *compute, *copy; /* the GPU's streams, on a GPU */
    td_status err;        /* the prefetch thread's first failure, for td_loader_next */
    char err_msg[512];
};

td_loader_params td_loader_default_params(void) {
    td_loader_params p = {.batch_size = 64,
                          .drop_last = 0,
                          .sampler = td_sampler_default_params(),
                          .device = {TD_DEVICE_CPU, 0}};
    return p;
}

static int on_gpu(const td_loader *l) { return l->p.device.type != TD_DEVICE_CPU; }

/* On a GPU, before the thread refills slot s: its last upload is finished. */
static td_status before_fill(td_loader *l, slot *s) {
    if (!on_gpu(l) || !s->uploaded) return TD_OK;
    td_status st = td__device_event_synchronize(l->p.device, s->uploaded);
    td__device_event_free(l->p.device, s->uploaded);
    s->uploaded = NULL;
    return st;
}

/* On a GPU, after the thread filled slot s: its upload, after the device side's last use. */
static td_status after_fill(td_loader *l, slot *s) {
    if (!on_gpu(l)) return TD_OK;
    const char *what = "td_loader: uploading a batch";
    if (s->released) {
        TD__TRY(td__device_event_wait(l->p.device, l->copy, s->released, what));
        td__device_event_free(l->p.device, s->released);
        s->released = NULL;
    }
    TD__TRY(td__device_copy_async(l->p.device, s->x_dev, s->x, s->size * l->numel * sizeof(float),
                                  l->copy, what));
    TD__TRY(td__device_copy_async(l->p.device, s->y_dev, s->y, s->size * sizeof(int64_t), l->copy,
                                  what));
    return td__device_event_record(l->p.device, l->copy, &s->uploaded, what);
}

/* Where batch b lies in the sampler's indices: this rank's slice of global batch b when the
 * sampler shards, else the b-th run of batch_size. */
static void batch_range(const td_loader *l, size_t b, size_t *start, size_t *size) {
    if (l->p.sampler.global_batch) {
        td_sampler_batch(l->sampler, b, start, size);
        return;
    }
    *start = b * l->p.batch_size;
    *size = l->per_rank - *start;
    if (*size > l->p.batch_size) *size = l->p.batch_size;
}

static void fill(td_loader *l, slot *s, size_t b) {
    const size_t *idx = td_sampler_indices(l->sampler);
    const float *x = td_dataset_x(l->dataset);
    const int64_t *y = td_dataset_y(l->dataset);
    size_t start, size;
    batch_range(l, b, &start, &size);
    for (size_t i = 0; i < size; i++) {
        size_t j = idx[start + i];
        memcpy(s->x + i * l->numel, x + j * l->numel, l->numel * sizeof(float));
        s->y[i] = y[j];
    }
    s->size = size;
    s->index = b;
}

static int free_slot(const td_loader *l) {
    for (int i = 0; i < 2; i++)
        if (l->slots[i].state == SLOT_FREE) return i;
    return -1;
}

static void *prefetch_main(void *arg) {
    td_loader *l = arg;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (!l->stop && !(l->next_fill < l->nb && free_slot(l) >= 0))
            pthread_cond_wait(&l->cv, &l->mu);
        if (l->stop) break;
        int si = free_slot(l);
        slot *s = &l->slots[si];
        size_t b = l->next_fill++;
        s->state = SLOT_FILLING;
        l->busy = 1;
        pthread_mutex_unlock(&l->mu);
        td_status st = before_fill(l, s);
        if (st == TD_OK) fill(l, s, b);
        if (st == TD_OK) st = after_fill(l, s);
        pthread_mutex_lock(&l->mu);
        if (st != TD_OK && l->err == TD_OK) {
            l->err = st;
            snprintf(l->err_msg, sizeof l->err_msg, "%s", td_last_error());
        }
        l->busy = 0;
        s->state = SLOT_FULL;
        pthread_cond_broadcast(&l->cv);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* Frees what td_loader_create made, however far it got (the thread already joined). */
static void loader_free(td_loader *l) {
    for (int k = 0; k < 2; k++) {
        slot *s = &l->slots[k];
        if (s->uploaded) td__device_event_synchronize(l->p.device, s->uploaded);
        td__device_event_free(l->p.device, s->uploaded);
        td__device_event_free(l->p.device, s->released);
        if (s->x_dev || s->y_dev) td_device_synchronize(l->p.device); /* nothing reads them now */
        if (s->x_dev) td_device_free(l->p.device, s->x_dev);
        if (s->y_dev) td_device_free(l->p.device, s->y_dev);
        td__device_host_free(l->p.device, s->x);
        td__device_host_free(l->p.device, s->y);
    }
    td_sampler_destroy(l->sampler);
    free(l);
}

td_status td_loader_create(td_loader **out, const td_dataset *dataset,
                           const td_loader_params *params) {
    if (!out || !dataset || !params)
        return td__fail(TD_EINVAL, "td_loader_create: out, dataset and params must not be NULL");
    *out = NULL;
    if (params->batch_size < 1 && !params->sampler.global_batch)
        return td__fail(TD_EINVAL, "td_loader_create: batch_size is 0, expected >= 1");
    td_loader *l = calloc(1, sizeof *l);
    if (!l) return td__fail(TD_ENOMEM, "td_loader_create: out of memory");
    l->dataset = (td_dataset *)dataset;
    l->p = *params;
    l->held = -1;
    td_status st = td_sampler_create(&l->sampler, td_dataset_size(dataset), &params->sampler);
    if (st != TD_OK) {
        loader_free(l);
        return st;
    }
    l->numel = td_dataset_sample_numel(dataset);
    l->per_rank = td_sampler_size(l->sampler);
    size_t bs = params->batch_size;
    if (params->sampler.global_batch) { /* this rank's slices; the largest sets the capacity */
        size_t w = (size_t)params->sampler.world_size;
        bs = (params->sampler.global_batch + w - 1) / w;
        l->nb = td_sampler_batches(l->sampler);
    } else {
        l->nb = params->drop_last ? l->per_rank / bs : (l->per_rank + bs - 1) / bs;
        if (l->nb == 0) {
            size_t have = l->per_rank;
            loader_free(l);
            return td__fail(TD_EINVAL,
                            "td_loader_create: this rank's %zu samples make no batch of %zu and "
                            "drop_last drops the short one: an epoch would have no batch",
                            have, bs);
        }
    }
    l->capacity = bs;
    if (on_gpu(l)) st = td__device_streams(l->p.device, &l->compute, &l->copy, "td_loader_create");
    for (int i = 0; i < 2 && st == TD_OK; i++) {
        slot *s = &l->slots[i];
        size_t xb = bs * l->numel * sizeof(float) + 1, yb = bs * sizeof(int64_t) + 1;
        st = td__device_host_alloc(l->p.device, xb, (void **)&s->x, "td_loader_create");
        if (st == TD_OK)
            st = td__device_host_alloc(l->p.device, yb, (void **)&s->y, "td_loader_create");
        if (st == TD_OK && on_gpu(l)) st = td_device_alloc(l->p.device, xb, (void **)&s->x_dev);
        if (st == TD_OK && on_gpu(l)) st = td_device_alloc(l->p.device, yb, (void **)&s->y_dev);
    }
    if (st != TD_OK) {
        loader_free(l);
        return st;
    }
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    if (pthread_create(&l->thread, NULL, prefetch_main, l) != 0) {
        pthread_cond_destroy(&l->cv);
        pthread_mutex_destroy(&l->mu);
        loader_free(l);
        return td__fail(TD_ENOMEM, "td_loader_create: cannot start the prefetch thread");
    }
    *out = l;
    return TD_OK;
}

void td_loader_destroy(td_loader *l) {
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    l->stop = 1;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    pthread_join(l->thread, NULL);
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    loader_free(l);
}

td_status td_loader_seek(td_loader *l, uint64_t epoch, size_t batch) {
    if (!l) return td__fail(TD_EINVAL, "td_loader_seek: loader is NULL");
    if (batch > l->nb)
        return td__fail(TD_EINVAL, "td_loader_seek: batch %zu, the epoch has %zu batches", batch,
                        l->nb);
    pthread_mutex_lock(&l->mu);
    /* The thread reads the sampler's indices while it copies, so wait for it to finish. */
    while (l->busy) pthread_cond_wait(&l->cv, &l->mu);
    td_sampler_set_epoch(l->sampler, epoch);
    l->epoch = epoch;
    /* The batch the caller holds may still be read by queued work: its next upload waits. */
    td_status st = TD_OK;
    if (on_gpu(l) && l->held >= 0 && !l->slots[l->held].released)
        st = td__device_event_record(l->p.device, l->compute, &l->slots[l->held].released,
                                     "td_loader_seek");
    for (int i = 0; i < 2; i++) l->slots[i].state = SLOT_FREE;
    l->held = -1;
    l->next_fill = l->next_take = batch;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    return st;
}

td_status td_loader_set_epoch(td_loader *l, uint64_t epoch) { return td_loader_seek(l, epoch, 0); }

size_t td_loader_batches_per_epoch(const td_loader *l) { return l ? l->nb : 0; }

td_status td_loader_next(td_loader *l, td_batch *batch) {
    if (!l || !batch)
        return td__fail(TD_EINVAL, "td_loader_next: loader and batch must not be NULL");
    memset(batch, 0, sizeof *batch);
    batch->device = l->p.device;
    pthread_mutex_lock(&l->mu);
    batch->epoch = l->epoch;
    if (l->err != TD_OK) {
        td_status st = l->err;
        pthread_mutex_unlock(&l->mu);
        return td__fail(st, "%s", l->err_msg);
    }
    if (l->held >= 0) {
        slot *h = &l->slots[l->held];
        td_status st = TD_OK;
        /* The compute stream's use of the batch given out last ends here. */
        if (on_gpu(l) && !h->released)
            st = td__device_event_record(l->p.device, l->compute, &h->released, "td_loader_next");
        h->state = SLOT_FREE;
        l->held = -1;
        pthread_cond_broadcast(&l->cv);
        if (st != TD_OK) {
            pthread_mutex_unlock(&l->mu);
            return st;
        }
    }
    if (l->next_take >= l->nb) {
        batch->index = l->nb;
        pthread_mutex_unlock(&l->mu);
        return TD_OK;
    }
    int si = -1;
    for (;;) {
        for (int i = 0; i < 2; i++)
            if (l->slots[i].state == SLOT_FULL && l->slots[i].index == l->next_take) si = i;
        if (si >= 0 || l->err != TD_OK) break;
        pthread_cond_wait(&l->cv, &l->mu);
    }
    if (si < 0) {
        td_status st = l->err;
        pthread_mutex_unlock(&l->mu);
        return td__fail(st, "%s", l->err_msg);
    }
    slot *s = &l->slots[si];
    s->state = SLOT_HELD;
    l->held = si;
    l->next_take++;
    td_status st = TD_OK;
    if (on_gpu(l))
        st = td__device_event_wait(l->p.device, l->compute, s->uploaded, "td_loader_next");
    batch->x = on_gpu(l) ? s->x_dev : s->x;
    batch->y = on_gpu(l) ? s->y_dev : s->y;
    batch->size = s->size;
    batch->index = s->index;
    pthread_mutex_unlock(&l->mu);
    return st;
}
