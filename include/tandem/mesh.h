/* A device mesh (torch.distributed's DeviceMesh, Megatron's parallel state): the ranks of one
 * group arranged as an array of named dimensions, "dp", "tp" and "pp" as a 3D-parallel job
 * names them, in the order the caller gives, the last varying fastest:
 *
 *     rank = (c[0] * size[1] + c[1]) * size[2] + c[2]     (c: the rank's coordinates)
 *
 * Each dimension's group holds the ranks that share every other coordinate, ordered along it:
 * with ("dp", "tp") = (2, 2) the tp groups are {0, 1} and {2, 3}, the dp groups {0, 2} and
 * {1, 3}. A mesh is built once, collectively, and handed to the strategies, which take the
 * groups they work on from it: DDP and ZeRO the dp group (ZeRO shards over dp only), a
 * tensor-parallel graph the tp group (td_graph_params.comm), the pipeline its stages along pp
 * and its replicas along dp (td_pipeline_params.mesh). docs/parallelism.md draws it.
 *
 * The mesh owns its groups, not the group it was made from (which must outlive it). */
#ifndef TANDEM_MESH_H
#define TANDEM_MESH_H

#include "tandem/checkpoint.h"
#include "tandem/comm.h"
#include "tandem/core.h"
#include "tandem/optim.h"
#include "tandem/param.h"
#include "tandem/zero.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most dimensions of one mesh. */
#define TD_MESH_MAX_DIMS 4

/* An opaque mesh over one process group. */
typedef struct td_mesh td_mesh;

/* The dimensions, outermost first; fill with td_mesh_default_params or by hand. */
typedef struct {
    int ndims;                           /* 1 .. TD_MESH_MAX_DIMS */
    const char *names[TD_MESH_MAX_DIMS]; /* distinct, 1 to 15 characters ("dp", "tp", "pp") */
    int sizes[TD_MESH_MAX_DIMS];         /* >= 1, or -1 for at most one dimension: what the
                                            group's size leaves (world / the others' product) */
    unsigned char reserved[64];          /* zeros: room for later options (core.h) */
} td_mesh_params;

/* The 3D layout tandemrun gives (--tp N --pp N set TANDEM_TP and TANDEM_PP; 1 when unset):
 * ("pp", "dp", "tp") of sizes (TANDEM_PP, -1, TANDEM_TP), torchtitan's order: the
 * tensor-parallel ranks, which talk in every layer, are neighbours (one host); data parallel
 * takes the rest. An unparsable value leaves the size 0, which td_mesh_create refuses, naming
 * the variable. */
td_mesh_params td_mesh_default_params(void);

/* Collective over `comm`: checks that every rank gives the same dimensions (TD_EINVAL naming
 * both) and that their sizes multiply to the group's size (TD_EINVAL naming the sizes), then
 * splits one group per dimension. p may be NULL for td_mesh_default_params(). */
td_status td_mesh_create(td_mesh **out, td_comm *comm, const td_mesh_params *p);

/* Frees the mesh's groups (after their work); NULL-safe. Every rank should call it. */
void td_mesh_destroy(td_mesh *mesh);

/* The group along dimension `dim` (ranks ordered by their coordinate there), owned by the
 * mesh; NULL for a name the mesh does not have. */
td_comm *td_mesh_group(const td_mesh *mesh, const char *dim);

/* The size of dimension `dim`; 1 for a name the mesh does not have (a job with no "pp" runs
 * one stage). */
int td_mesh_size(const td_mesh *mesh, const char *dim);

/* This rank's coordinate along `dim`; 0 for a name the mesh does not have. */
int td_mesh_coord(const td_mesh *mesh, const char *dim);

/* The group the mesh was made from. */
td_comm *td_mesh_comm(const td_mesh *mesh);

/* The rank (in td_mesh_comm) at coordinates coords[0 .. ndims), in the mesh's order; -1 when a
 * coordinate is out of range. */
int td_mesh_rank_at(const td_mesh *mesh, const int *coords);

/* The dimensions as created (sizes resolved: no -1 left). */
td_mesh_params td_mesh_get_params(const td_mesh *mesh);

/* "pp 2 x dp 1 x tp 2" into out (cap bytes); returns out. */
const char *td_mesh_format(const td_mesh *mesh, char *out, size_t cap);

/* ---- a model split over the mesh (td_param.split) ---------------------------------------- */

/* torch.nn.utils.clip_grad_norm_ over the whole model of which this rank holds params[0..n):
 * its tensor-parallel slices, counted on every tp rank, and whole tensors, counted on tp rank 0
 * only (every tp rank holds the same), their squares summed over the mesh's tp group, and over
 * its dp group too when dp_shards says params are this rank's shards of the gradients
 * (td_zero_parameters); every rank scales by the same factor max_norm / (norm + 1e-6) when
 * that is below 1. Whole gradients are DDP's (after td_ddp_finish_backward). Collective over
 * those groups; total_norm may be NULL. CPU gradients. */
td_status td_mesh_clip_grad_norm(const td_mesh *mesh, td_param *params, size_t n, int dp_shards,
                                 double max_norm, double *total_norm);

/* The whole model by name on mesh rank 0, from what each rank holds (params[0..n): its stage's
 * parameters, optimizer state or buffers, slices put back in place by td_param.split): *whole
 * gets the tensors of stage 0's tp rank 0, in its order, then each later stage's that are new
 * (a weight tied across stages is taken once), as td_param entries of the whole shapes in host
 * memory the caller frees with td_mesh_model_free; elsewhere *whole is NULL and *n_whole 0.
 * Collective over the ranks of dp coordinate 0 (the others return at once); every tp rank of a
 * stage must hold the slices of the same tensors in the same order (TD_EINVAL otherwise). */
td_status td_mesh_gather_model(const td_mesh *mesh, const td_param *params, size_t n,
                               td_param **whole, size_t *n_whole);

/* Frees what td_mesh_gather_model gave; NULL-safe. */
void td_mesh_model_free(td_param *whole, size_t n);

/* Writes the checkpoint one process training the whole model writes (td_checkpoint_save, by
 * rank 0, atomically) from what each rank holds: params[0..n) and, with optim (an optimizer
 * made over exactly these), its state, gathered by name into whole tensors
 * (td_mesh_gather_model), "optim.step" holding the whole model's counts in its parameters'
 * order. So any layout's checkpoint loads at any other, or in one process. Collective over the
 * mesh; every rank returns rank 0's outcome. */
td_status td_mesh_save(const td_mesh *mesh, const td_param *params, size_t n, td_optim *optim,
                       const char *path, const td_checkpoint_meta *meta, size_t n_meta);

/* Reads this rank's part of a checkpoint of whole tensors (td_mesh_save's, or one process's)
 * into params[0..n) and optim's state: slices by td_param.split, by name. The step counts must
 * be the same for every parameter (as AdamW and SGD keep them), since a rank holding part of
 * the model cannot place a whole model's list of them by name. Local. */
td_status td_mesh_load(const td_mesh *mesh, td_param *params, size_t n, td_optim *optim,
                       const char *path);

/* td_mesh_save for a rank whose slices ZeRO shards over the mesh's dp group (`zero` made on
 * td_mesh_group(mesh, "dp"), `optim` over its shards): ZeRO writes each slice beside path
 * (td_zero_save, collective over dp), which is read back, gathered as td_mesh_save gathers and
 * removed. Collective over the mesh. */
td_status td_mesh_save_zero(const td_mesh *mesh, td_zero *zero, td_optim *optim, const char *path,
                            const td_checkpoint_meta *meta, size_t n_meta);

/* td_mesh_load under ZeRO: dp rank 0 of each slice writes the slice's whole tensors beside path,
 * which ZeRO loads into its shards (td_zero_load, resharded) and which is then removed.
 * Collective over the dp group. */
td_status td_mesh_load_zero(const td_mesh *mesh, td_zero *zero, td_optim *optim, const char *path);

#ifdef __cplusplus
}
#endif
#endif
