/* The ucx backend's entry point for builds without UCX (the Makefile compiles this file in place
 * of the backend's others): it reports TD_EUNSUPPORTED, so that a job across hosts under
 * tandemrun fails with a message instead of a link error. */
#include "comm/comm_impl.h"
#include "core/core_impl.h"

td_status td__ucx_create(const td_comm_params *params, void **ctx, td__group_shape *shape,
                         const td__backend_ops **ops) {
    (void)params, (void)ctx, (void)shape, (void)ops;
    return td__fail(TD_EUNSUPPORTED, "the ucx backend was not built (no UCX headers when tandem "
                                     "was compiled: apt-get install libucx-dev)");
}
