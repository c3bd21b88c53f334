/* Which backend runs a graph on a device: the CPU's, or a GPU's from libtandem_cuda.so. */
#include "ops/backend.h"

#include "device/cuda_api.h"

td_status td__backend_for(td_device device, const char *what, const td__backend **out) {
    char name[32];
    td_device_format(device, name, sizeof name);
    if (device.type == TD_DEVICE_CPU) {
        *out = &td__backend_cpu;
        return TD_OK;
    }
    if (device.type != TD_DEVICE_CUDA)
        return td__fail(TD_EINVAL, "%s: device type %d is neither the CPU nor CUDA", what,
                        (int)device.type);
    int n;
    TD__TRY(td_cuda_device_count(&n));
    if (n == 0)
        return td__fail(TD_EUNSUPPORTED, "%s: %s: no GPU can be used here: %s", what, name,
                        td_cuda_unavailable());
    if (device.index < 0 || device.index >= n)
        return td__fail(TD_EINVAL, "%s: %s does not exist (%d CUDA device%s visible)", what, name,
                        n, n == 1 ? " is" : "s are");
    const td__cuda_api *api = td__cuda();
    if (api->tensor_size != sizeof(td_tensor) || api->node_size != sizeof(td__node) ||
        api->op_ctx_size != sizeof(td__op_ctx))
        return td__fail(TD_EUNSUPPORTED,
                        "%s: %s: libtandem_cuda.so was built from other sources than this "
                        "program (struct sizes differ): rebuild both",
                        what, name);
    *out = api->backend;
    return TD_OK;
}
