/* A small GPT trained at a layout of a device mesh (pp, dp, tp), as the tensor-parallel and
 * layout tests train it: each rank's mesh, its model (a graph split over tp, or its stage of a
 * pipeline) and DDP or ZeRO over the mesh's dp group, one micro-batch's forward and backward and
 * the gradient-norm clip over the whole model. Header-only; include it after test.h. */
#ifndef TANDEM_TEST_MESH_LAYOUT_H
#define TANDEM_TEST_MESH_LAYOUT_H

#include "tandem/tandem.h"

#include "test.h"
#include "test_comm_util.h" /* test_comm_create */

/* The degrees of tensor, data and pipeline parallelism, sequence parallelism, the ZeRO stage
 * over dp (0: DDP) and what backward recomputes. */
typedef struct {
    int tp, dp, pp, sp, zero;
    td_recompute_mode recompute;
} mesh_layout;

/* One rank of a layout: at pp 1 its graph under DDP or ZeRO, at pp > 1 its pipeline stage. */
typedef struct {
    td_comm *comm;
    td_mesh *mesh;
    td_sequential *s;
    td_graph *g;
    td_model m;
    td_pipeline *pipe;
    td_ddp *ddp;
    td_zero *zero;
    td_param *p, *stepped; /* the rank's parameters, and those its optimizer steps */
    size_t n, n_stepped;
} mesh_rank;

/* Builds rank `rank` of L over the shm backend: the mesh, the GPT gp split over tp (with L's
 * sequence parallelism), and at pp > 1 the pipeline pp of L->pp stages over the mesh; at pp 1 a
 * graph of `rows` sequences with pp's graph parameters and seed under ZeRO (L->zero) or DDP with
 * pp's DDP parameters over dp (DDP also alone, where deterministic shards are summed by its
 * tree). The graph runs over the tp group with L's recompute. Returns 0, or -1 when a check
 * failed. */
static inline int mesh_rank_create(mesh_rank *r, int rank, int size, int port, const mesh_layout *L,
                                   td_gpt_params gp, td_pipeline_params pp, int64_t rows) {
    memset(r, 0, sizeof *r);
    CHECK_OK(test_comm_create(&r->comm, rank, size, port, 60));
    if (!r->comm) return -1;
    td_mesh_params mp = {.ndims = 3, .names = {"pp", "dp", "tp"}, .sizes = {L->pp, L->dp, L->tp}};
    CHECK_OK(td_mesh_create(&r->mesh, r->comm, &mp));
    if (!r->mesh) return -1;
    gp.tensor_parallel = 1;
    gp.sequence_parallel = L->sp;
    CHECK_OK(td_gpt_sequential(&gp, &r->s));
    pp.graph.comm = td_mesh_group(r->mesh, "tp");
    pp.graph.recompute = L->recompute;
    if (L->pp > 1) {
        pp.stages = L->pp;
        pp.mesh = r->mesh;
        CHECK_OK(td_pipeline_create(&r->pipe, r->comm, r->s, &pp));
        if (!r->pipe) return -1;
        CHECK_OK(td_pipeline_parameters(r->pipe, &r->p, &r->n));
        r->stepped = r->p, r->n_stepped = r->n;
        return 0;
    }
    CHECK_OK(td_graph_create(&r->g, &pp.graph));
    CHECK_OK(td_model_build_sequential(r->g, r->s, rows, pp.seed, &r->m));
    CHECK_OK(td_graph_parameters(r->g, &r->p, &r->n));
    r->stepped = r->p, r->n_stepped = r->n;
    td_comm *dp = td_mesh_group(r->mesh, "dp");
    if (L->zero) {
        td_zero_params zp = td_zero_default_params();
        zp.stage = L->zero;
        zp.ddp = pp.ddp;
        CHECK_OK(td_zero_create(&r->zero, dp, r->p, r->n, NULL, 0, &zp));
        CHECK_OK(td_zero_parameters(r->zero, &r->stepped, &r->n_stepped));
        td_graph_set_grad_ready_hook(r->g, td_zero_grad_ready_hook, r->zero);
        td_graph_set_param_use_hook(r->g, td_zero_param_use_hook, r->zero);
    } else if (L->dp > 1 || pp.ddp.deterministic) {
        CHECK_OK(td_ddp_create(&r->ddp, dp, r->p, r->n, NULL, 0, &pp.ddp));
        td_graph_set_grad_ready_hook(r->g, td_ddp_grad_ready_hook, r->ddp);
    }
    return 0;
}

/* One forward and backward of the rank's graph (pp 1) on sequences x and their next tokens y,
 * between DDP's or ZeRO's calls; the loss into *loss. */
static inline void mesh_rank_forward_backward(mesh_rank *r, const float *x, const int64_t *y,
                                              float *loss) {
    if (r->zero) CHECK_OK(td_zero_prepare_forward(r->zero));
    if (r->ddp) CHECK_OK(td_ddp_prepare_forward(r->ddp));
    CHECK_OK(td_tensor_write(r->m.input, x));
    CHECK_OK(td_tensor_write(r->m.labels, y));
    CHECK_OK(td_graph_forward(r->g));
    *loss = *(float *)td_tensor_data(r->m.loss);
    CHECK_OK(td_graph_zero_grad(r->g));
    CHECK_OK(td_graph_backward(r->g, r->m.loss));
    if (r->zero) CHECK_OK(td_zero_finish_backward(r->zero));
    if (r->ddp) CHECK_OK(td_ddp_finish_backward(r->ddp));
}

/* Clips the gradients to the whole model's norm max_norm: across the pipeline's stages, or
 * over the mesh (ZeRO's shards counted once). */
static inline void mesh_rank_clip_grad_norm(mesh_rank *r, double max_norm) {
    if (r->pipe)
        CHECK_OK(td_pipeline_clip_grad_norm(r->pipe, max_norm, NULL));
    else
        CHECK_OK(td_mesh_clip_grad_norm(r->mesh, r->stepped, r->n_stepped, r->zero != NULL,
                                        max_norm, NULL));
}

/* Frees what mesh_rank_create made (the optimizer over its parameters first). */
static inline void mesh_rank_destroy(mesh_rank *r) {
    if (r->g) td_graph_set_grad_ready_hook(r->g, NULL, NULL);
    if (r->g) td_graph_set_param_use_hook(r->g, NULL, NULL);
    td_pipeline_destroy(r->pipe);
    td_ddp_destroy(r->ddp);
    td_zero_destroy(r->zero);
    td_graph_destroy(r->g);
    td_sequential_destroy(r->s);
    td_mesh_destroy(r->mesh);
    td_comm_destroy(r->comm);
}

#endif
