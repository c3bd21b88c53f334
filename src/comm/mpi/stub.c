/* The mpi backend's entry point for builds without MPI (the Makefile compiles this file in place
 * of the backend's others): it reports TD_EUNSUPPORTED, so that asking for TD_BACKEND_MPI fails
 * with a message instead of a link error. */
#include "comm/comm_impl.h"
#include "core/core_impl.h"

td_status td__mpi_create(const td_comm_params *params, void **ctx, td__group_shape *shape,
                         const td__backend_ops **ops) {
    (void)params, (void)ctx, (void)shape, (void)ops;
    return td__fail(TD_EUNSUPPORTED,
                    "the mpi backend was not built (no mpicc when tandem was compiled)");
}
