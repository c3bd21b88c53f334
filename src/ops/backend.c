/* Which backend runs a graph on a device: the CPU's, or the one the device's library exports
 * (device_impl.h's td__device_library), checked against the structs this program was built
 * with. */
#include "ops/backend.h"

#include "device/device_impl.h"

td_status td__backend_for(td_device device, const char *what, const td__backend **out) {
    if (device.type == TD_DEVICE_CPU) {
        *out = &td__backend_cpu;
        return TD_OK;
    }
    const void *table;
    TD__TRY(td__device_library(device, TD__DEVICE_BACKEND, what, &table));
    const td__backend_library *lib = table;
    if (lib->abi != TD__BACKEND_ABI || lib->tensor_size != sizeof(td_tensor) ||
        lib->node_size != sizeof(td__node) || lib->op_ctx_size != sizeof(td__op_ctx)) {
        char name[32];
        td_device_format(device, name, sizeof name);
        return td__fail(TD_EUNSUPPORTED,
                        "%s: %s: its library was built from other sources than this program "
                        "(backend ABI %d, want %d, or struct sizes differ): rebuild both",
                        what, name, lib->abi, TD__BACKEND_ABI);
    }
    *out = lib->backend;
    return TD_OK;
}
