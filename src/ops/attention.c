/* The causal multi-head self-attention op (F.scaled_dot_product_attention(is_causal=True) after
 * nanoGPT's split): from the fused projection qkv (rows of [q | k | v], T rows per sequence) to
 * the heads side by side in (rows, C). Kernels: cpu/attention.c, cuda/attention.cu. */
#include "ops/op.h"

static td_status att_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    int heads = n->attr.attn.heads;
    int64_t T = n->attr.attn.seq_len, W = x->shape.ndim ? x->shape.dim[x->shape.ndim - 1] : 0;
    if (!td__is_float(x->dtype) || x->shape.ndim < 2)
        return td__fail(TD_ESHAPE, "attention: qkv '%s' must be (rows, 3C) of a float dtype",
                        x->name);
    if (heads < 1 || W % 3 || (W / 3) % heads)
        return td__fail(TD_ESHAPE,
                        "attention: qkv '%s' is %lld wide: 3C with C a multiple of %d heads",
                        x->name, (long long)W, heads);
    int64_t rows = td_shape_numel(&x->shape) / W;
    if (T < 1 || rows % T || (x->shape.ndim == 3 && x->shape.dim[1] != T))
        return td__fail(TD_ESHAPE,
                        "attention: qkv '%s' has %lld rows, not whole sequences of %lld positions",
                        x->name, (long long)rows, (long long)T);
    *shape = x->shape;
    shape->dim[shape->ndim - 1] = W / 3;
    *dtype = x->dtype;
    return TD_OK;
}

/* The GPU's backward reads y (each row's do . y, as FlashAttention's does); the CPU's does not. */
const td__op td__op_attention = {
    .name = "attention",
    .id = TD__OP_ATTENTION,
    .infer = att_infer,
    .backward_reads_output = 1,
    .precision = TD__PREC_LOW,
};
