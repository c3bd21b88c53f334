/* Tensor metadata (name, shape, dtype, element count) and layouts: the plain row-major
 * descriptor of a shape and element offsets in channel-blocked ones. Creating tensors and
 * moving their values in and out is the graph's job (src/graph). No math here. */
#include <string.h>

#include "tensor/tensor_impl.h"

dnnl_data_type_t td__dnnl_dtype(td_dtype dtype) {
    switch (dtype) {
    case TD_BF16:
        return dnnl_bf16;
    case TD_F16:
        return dnnl_f16;
    case TD_I32:
        return dnnl_s32;
    case TD_U8:
        return dnnl_u8;
    default:
        return dnnl_f32;
    }
}

/* The plain row-major md of a shape in a oneDNN data type. */
static void plain(dnnl_memory_desc_t *md, const td_shape *shape, dnnl_data_type_t type) {
    static const dnnl_format_tag_t tags[] = {dnnl_a,      dnnl_a,       dnnl_ab,
                                             dnnl_abc,    dnnl_abcd,    dnnl_abcde,
                                             dnnl_abcdef, dnnl_abcdefg, dnnl_abcdefgh};
    dnnl_dims_t dims = {1};
    int nd = shape->ndim ? shape->ndim : 1;
    for (int i = 0; i < shape->ndim; i++) dims[i] = shape->dim[i];
    dnnl_memory_desc_init_by_tag(md, nd, dims, type, tags[nd]);
}

void td__md_plain(dnnl_memory_desc_t *md, const td_shape *shape, td_dtype dtype) {
    plain(md, shape, td__dnnl_dtype(dtype));
}

int td__md_is_plain(const dnnl_memory_desc_t *md, const td_shape *shape) {
    dnnl_memory_desc_t p;
    plain(&p, shape, md->data_type);
    return dnnl_memory_desc_equal(md, &p);
}

int64_t td__md_offset4(const dnnl_memory_desc_t *md, int64_t n, int64_t c, int64_t h, int64_t w) {
    if (md->ndims != 4 || md->format_kind != dnnl_blocked) return -1;
    const dnnl_blocking_desc_t *b = &md->format_desc.blocking;
    int64_t blk = 1;
    if (b->inner_nblks == 1 && b->inner_idxs[0] == 1)
        blk = b->inner_blks[0];
    else if (b->inner_nblks != 0)
        return -1;
    return n * b->strides[0] + (c / blk) * b->strides[1] + h * b->strides[2] + w * b->strides[3] +
           (c % blk);
}

const char *td_tensor_name(const td_tensor *t) { return t ? t->name : ""; }

td_shape td_tensor_shape(const td_tensor *t) {
    if (t) return t->shape;
    td_shape s;
    memset(&s, 0, sizeof s);
    return s;
}

td_dtype td_tensor_dtype(const td_tensor *t) { return t ? t->dtype : TD_DTYPE_COUNT; }

int64_t td_tensor_numel(const td_tensor *t) { return t ? td_shape_numel(&t->shape) : 0; }
