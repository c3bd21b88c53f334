/* The SyncBatchNorm op (torch.nn.SyncBatchNorm): batch norm whose training statistics are
 * those of the whole group's batch, a collective op. Kernels: cpu/sync_batch_norm.c, and
 * sync_batch_norm_device.c on every other backend. */
#include "ops/sync_batch_norm.h"

static td_status sbn_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    return td__op_batch_norm.infer(n, shape, dtype);
}

/* Statistics, weight and bias are f32 at every AMP level below O3, as batch norm's. */
static td_dtype sbn_input_dtype(const td__node *n, int i, td_dtype dtype) {
    (void)n;
    return i == 0 ? dtype : TD_F32;
}

const td__op td__op_sync_batch_norm = {
    .name = "sync_batch_norm2d",
    .id = TD__OP_SYNC_BATCH_NORM,
    .generic = &td__sync_batch_norm_device,
    .propagates_layout = 1,
    .infer = sbn_infer,
    .precision = TD__PREC_F32,
    .input_dtype = sbn_input_dtype,
    .collective = 1,
};
