/* td_params_sha256 (param.h): the digest of parameters wherever they live, so it sits with
 * the devices, whose copies bring a GPU's bytes to the host. */
#include <stdio.h>
#include <stdlib.h>

#include "tandem/device.h"
#include "tandem/param.h"

#include "core/core_impl.h"

td_status td_params_sha256(const td_param *params, size_t n, char hex[65]) {
    td_sha256_ctx ctx;
    td_sha256_init(&ctx);
    void *host = NULL;
    size_t cap = 0;
    td_status st = TD_OK;
    for (size_t i = 0; i < n && st == TD_OK; i++) {
        const td_param *p = &params[i];
        size_t bytes = p->count * td_dtype_size(p->dtype);
        if (!p->data) continue;
        if (p->device.type == TD_DEVICE_CPU) {
            td_sha256_update(&ctx, p->data, bytes);
            continue;
        }
        if (bytes > cap) {
            free(host);
            cap = bytes;
            if (!(host = malloc(cap))) {
                cap = 0;
                st = td__fail(TD_ENOMEM, "td_params_sha256: no memory for a host copy of %s",
                              p->name ? p->name : "a parameter");
                break;
            }
        }
        st = td_device_copy(td_device_cpu(), host, p->device, p->data, bytes);
        if (st == TD_OK) td_sha256_update(&ctx, host, bytes);
    }
    free(host);
    uint8_t d[32];
    td_sha256_final(&ctx, d);
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
    return st;
}
