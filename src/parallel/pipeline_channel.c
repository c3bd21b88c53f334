/* The pipeline's transfer channels: one thread per direction and peer (activations out and in,
 * gradients out and in) that runs its queue of sends or receives in order with blocking p2p
 * calls. A blocked call keeps all of the group's transfers moving, so payloads larger than the
 * shm mailbox stream while the stage's own thread computes, and a dead or stuck peer turns into
 * the comm's error (peer died, timeout) on the job. It does not know what the bytes are: the
 * schedule fills and checks the headers. */
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/core_impl.h"
#include "parallel/pipeline_impl.h"

static void *channel_main(void *arg) {
    pp_channel *c = arg;
    if (c->trace) (void)td_trace_name_thread(c->trace, c->what); /* its row: "send gradients" */
    /* A transfer thread sleeps almost always and must run the moment its peer has moved data:
     * at the compute thread's priority the scheduler lets it wait for milliseconds, and both
     * stages with it. Raising it needs the privilege to; without, it runs as it is. */
    int nice = c->nice;
    if (nice && setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice) != 0) nice = 0;
    pthread_mutex_lock(&c->lock);
    c->nice = nice;
    c->ready = 1;
    pthread_cond_broadcast(&c->cond);
    for (;;) {
        while (!c->head && !c->stop) pthread_cond_wait(&c->cond, &c->lock);
        if (!c->head) break;
        pp_job *j = c->head;
        pthread_mutex_unlock(&c->lock);
        uint64_t t0 = td_time_ns();
        td_comm_tag(c->comm, "pipeline %s mb %d", c->what, j->micro_batch);
        td_status s = c->is_send ? td_comm_send(c->comm, j->buf, j->bytes, TD_U8, c->peer, c->tag)
                                 : td_comm_recv(c->comm, j->buf, j->bytes, TD_U8, c->peer, c->tag);
        uint64_t t1 = td_time_ns();
        if (c->trace && s == TD_OK) {
            char name[64];
            snprintf(name, sizeof name, "%s %d", c->what, j->micro_batch);
            (void)td_trace_span(c->trace, name, "transfer", t0, t1);
        }
        pthread_mutex_lock(&c->lock);
        j->status = s;
        if (s != TD_OK) snprintf(j->error, sizeof j->error, "%s", td_last_error());
        j->state = PP_JOB_DONE;
        c->head = j->next;
        if (!c->head) c->tail = NULL;
        j->next = NULL;
        pthread_cond_broadcast(&c->cond);
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

td_status td__pp_channel_start(pp_channel *c, td_comm *comm, int peer, int tag, int is_send,
                               const char *what, td_trace *trace, int nice) {
    memset(c, 0, sizeof *c);
    c->nice = nice;
    c->comm = comm;
    c->peer = peer;
    c->tag = tag;
    c->is_send = is_send;
    c->what = what;
    c->trace = trace;
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->cond, NULL);
    if (pthread_create(&c->thread, NULL, channel_main, c) != 0) {
        pthread_cond_destroy(&c->cond);
        pthread_mutex_destroy(&c->lock);
        return td__fail(TD_ESTATE, "pipeline: cannot start the '%s' thread", what);
    }
    c->started = 1;
    pthread_mutex_lock(&c->lock);
    while (!c->ready) pthread_cond_wait(&c->cond, &c->lock);
    pthread_mutex_unlock(&c->lock);
    return TD_OK;
}

int td__pp_channel_nice(const pp_channel *c) { return c->started ? c->nice : 0; }

void td__pp_channel_stop(pp_channel *c) {
    if (!c->started) return;
    pthread_mutex_lock(&c->lock);
    c->stop = 1;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
    pthread_join(c->thread, NULL);
    pthread_cond_destroy(&c->cond);
    pthread_mutex_destroy(&c->lock);
    c->started = 0;
}

void td__pp_channel_submit(pp_channel *c, pp_job *job) {
    pthread_mutex_lock(&c->lock);
    job->state = PP_JOB_QUEUED;
    job->status = TD_OK;
    job->error[0] = 0;
    job->next = NULL;
    if (c->tail)
        c->tail->next = job;
    else
        c->head = job;
    c->tail = job;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
}

td_status td__pp_job_wait(pp_channel *c, pp_job *job) {
    if (!c->started) return TD_OK;
    pthread_mutex_lock(&c->lock);
    while (job->state == PP_JOB_QUEUED) pthread_cond_wait(&c->cond, &c->lock);
    td_status s = job->state == PP_JOB_DONE ? job->status : TD_OK;
    job->state = PP_JOB_IDLE;
    pthread_mutex_unlock(&c->lock);
    return s ? td__fail(s, "%s", job->error) : TD_OK;
}
