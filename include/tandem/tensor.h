/* Tensors as the graph engine sees them: a shape, a dtype and contiguous storage.
 *
 * A td_tensor is created by and owned by a td_graph (inputs, parameters, buffers and every
 * op's output); it lives until the graph is destroyed. The engine may keep an activation in
 * a blocked layout chosen by oneDNN (nChw16c and the like) between convolutions; inputs,
 * parameters, buffers and graph outputs are always plain row-major (PyTorch's contiguous
 * layout). td_tensor_read copies any tensor out in plain order. This header does no math. */
#ifndef TANDEM_TENSOR_H
#define TANDEM_TENSOR_H

#include "tandem/core.h"
#include "tandem/param.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A graph-owned tensor (opaque). */
typedef struct td_tensor td_tensor;

/* The tensor's name: "input", "conv1.weight", or "<op>:<index>" for activations. */
const char *td_tensor_name(const td_tensor *t);

/* The tensor's logical shape. */
td_shape td_tensor_shape(const td_tensor *t);

/* The tensor's element type. */
td_dtype td_tensor_dtype(const td_tensor *t);

/* Number of elements of the logical shape. */
int64_t td_tensor_numel(const td_tensor *t);

/* Plain row-major storage, or NULL while the graph is not compiled or when the engine
 * keeps this activation in a blocked layout (then use td_tensor_read). */
void *td_tensor_data(const td_tensor *t);

/* Plain row-major gradient storage (same rules as td_tensor_data); NULL when the tensor
 * takes no gradient. For parameters this is td_param.grad. */
void *td_tensor_grad(const td_tensor *t);

/* Copies the tensor's values out in plain row-major order (numel elements of its dtype). */
td_status td_tensor_read(const td_tensor *t, void *dst);

/* Copies the gradient out in plain row-major order (numel elements of the tensor's dtype, as
 * td_tensor_read does for the values); TD_ESTATE when the
 * tensor takes no gradient. */
td_status td_tensor_read_grad(const td_tensor *t, void *dst);

/* Copies numel elements (plain row-major) into an input, parameter or buffer. */
td_status td_tensor_write(td_tensor *t, const void *src);

/* td_tensor_write from memory on device `from`: host memory (then it is td_tensor_write), or
 * memory of the graph's own GPU, copied on the GPU's compute stream without waiting (a batch
 * a GPU loader handed out, as PyTorch's copy_(batch, non_blocking=True)). Unlike
 * td_tensor_set_data it keeps the tensor's memory, so recorded sweeps stay valid. */
td_status td_tensor_copy_from(td_tensor *t, td_device from, const void *src);

/* Points a graph input at caller memory (numel elements, plain, kept alive by the caller)
 * so that feeding a batch copies nothing. NULL goes back to the graph's own storage. The
 * memory must be on the graph's device (TD_EINVAL names both otherwise). */
td_status td_tensor_set_data(td_tensor *t, void *data);

#ifdef __cplusplus
}
#endif
#endif
