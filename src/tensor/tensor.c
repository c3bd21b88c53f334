/* Tensor metadata: name, shape, dtype, element count. Creating tensors and moving their
 * values in and out is the graph's job (src/graph), recording their layouts the backend's
 * (src/ops/backend.h). No math here. */
#include <string.h>

#include "tensor/tensor_impl.h"

const char *td_tensor_name(const td_tensor *t) { return t ? t->name : ""; }

td_shape td_tensor_shape(const td_tensor *t) {
    if (t) return t->shape;
    td_shape s;
    memset(&s, 0, sizeof s);
    return s;
}

td_dtype td_tensor_dtype(const td_tensor *t) { return t ? t->dtype : TD_DTYPE_COUNT; }

int64_t td_tensor_numel(const td_tensor *t) { return t ? td_shape_numel(&t->shape) : 0; }
