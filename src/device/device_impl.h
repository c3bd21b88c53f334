/* What the layers above use of a device beyond the public device.h: work queued on the
 * device's compute stream without waiting for it (filling memory, the multi-tensor kernels of
 * multi_tensor.h). Each names `what` in its errors; on the CPU they run at once. Not
 * installed. */
#ifndef TANDEM_DEVICE_IMPL_H
#define TANDEM_DEVICE_IMPL_H

#include "tandem/device.h"

#include "device/multi_tensor.h"

/* bytes of ptr set to value (a byte), ordered on d's compute stream. */
td_status td__device_memset(td_device d, void *ptr, int value, size_t bytes, const char *what);

/* One multi-tensor launch on GPU d's compute stream (cuda_api.h's multi_tensor says what list,
 * scratch and result are). */
td_status td__device_multi_tensor(td_device d, const td__mt_args *args, td__mt_tensor *list,
                                  size_t n, void **scratch, size_t *scratch_bytes, double *result,
                                  const char *what);

#endif
