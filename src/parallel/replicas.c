/* td_ddp's and td_zero's entries in the replicas' table (replicas.h): the public calls of each,
 * and what only ZeRO needs (parameters it moves, hooks around their use, sharded gradients). */
#include "parallel/replicas.h"

#include "core/core_impl.h"
#include "parallel/zero_impl.h"

/* ---- DDP ---------------------------------------------------------------------------------- */

static td_status ddp_create(void **out, td_comm *comm, td_param *params, size_t n_params,
                            td_param *buffers, size_t n_buffers, const td_ddp_params *ddp,
                            int zero_stage) {
    (void)zero_stage;
    return td_ddp_create((td_ddp **)out, comm, params, n_params, buffers, n_buffers, ddp);
}

static void ddp_destroy(void *impl) { td_ddp_destroy(impl); }

static td_status ddp_attach(void *impl, td_graph *g, td_graph *first) {
    (void)first;
    td_graph_set_grad_ready_hook(g, td_ddp_grad_ready_hook, impl);
    return TD_OK;
}

static td_status ddp_set_sync(void *impl, int sync) { return td_ddp_set_sync(impl, sync); }
static td_status ddp_prepare_forward(void *impl) { return td_ddp_prepare_forward(impl); }
static td_status ddp_finish_backward(void *impl) { return td_ddp_finish_backward(impl); }

/* DDP steps the graph's own parameters and keeps their gradients whole: no shards for the
 * optimizer or the norm. */
static td_status ddp_no_shards(void *impl, td_param **shards, size_t *n) {
    (void)impl;
    *shards = NULL;
    *n = 0;
    return TD_OK;
}

const td__replicas_ops td__replicas_ddp = {
    .create = ddp_create,
    .destroy = ddp_destroy,
    .attach = ddp_attach,
    .grad_ready = td_ddp_grad_ready_hook,
    .set_sync = ddp_set_sync,
    .prepare_forward = ddp_prepare_forward,
    .finish_backward = ddp_finish_backward,
    .parameters = ddp_no_shards,
    .norm_grads = ddp_no_shards,
};

/* ---- ZeRO --------------------------------------------------------------------------------- */

static td_status zero_create(void **out, td_comm *comm, td_param *params, size_t n_params,
                             td_param *buffers, size_t n_buffers, const td_ddp_params *ddp,
                             int zero_stage) {
    td_zero_params zp = td_zero_default_params();
    zp.stage = zero_stage;
    zp.ddp = *ddp;
    return td_zero_create((td_zero **)out, comm, params, n_params, buffers, n_buffers, &zp);
}

static void zero_destroy(void *impl) { td_zero_destroy(impl); }

static td_status zero_attach(void *impl, td_graph *g, td_graph *first) {
    /* ZeRO moved the parameters into its region: every graph reads them there. */
    if (g != first) TD__TRY(td_graph_share_params(g, first));
    td_graph_set_grad_ready_hook(g, td_zero_grad_ready_hook, impl);
    td_graph_set_param_use_hook(g, td_zero_param_use_hook, impl);
    return TD_OK;
}

static td_status zero_set_sync(void *impl, int sync) { return td_zero_set_sync(impl, sync); }
static td_status zero_prepare_forward(void *impl) { return td_zero_prepare_forward(impl); }
static td_status zero_finish_backward(void *impl) { return td_zero_finish_backward(impl); }

static td_status zero_parameters(void *impl, td_param **params, size_t *n) {
    return td_zero_parameters(impl, params, n);
}

static td_status zero_norm_grads(void *impl, td_param **shards, size_t *n) {
    *shards = NULL;
    *n = 0;
    if (!td__zero_grads_sharded(impl)) return td__zero_whole_grads(impl);
    return td_zero_parameters(impl, shards, n);
}

const td__replicas_ops td__replicas_zero = {
    .create = zero_create,
    .destroy = zero_destroy,
    .attach = zero_attach,
    .grad_ready = td_zero_grad_ready_hook,
    .set_sync = zero_set_sync,
    .prepare_forward = zero_prepare_forward,
    .finish_backward = zero_finish_backward,
    .parameters = zero_parameters,
    .norm_grads = zero_norm_grads,
};
