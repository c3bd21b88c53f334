/* The element-wise activation op (ReLU, exact-erf GELU, GPT-2's tanh GELU), and the fusion
 * hooks that let a producer fold a ReLU in or run it in place. Kernels: cpu/eltwise.c,
 * cuda/eltwise.cu. */
#include "ops/op.h"

/* A ReLU that owns its output is what a producer may fold in or run in place. */
static td__activation elt_activation(const td__node *n) {
    return n->variant == TD__ELT_RELU && n->alias == TD__OWN_OUTPUT ? TD__ACT_RELU
                                                                    : TD__NO_ACTIVATION;
}

static void elt_set_alias(td__node *n, td__alias alias) {
    n->alias = alias;
    n->out->alias_of = n->in[0];
}

static td_status elt_infer(const td__node *n, td_shape *shape, td_dtype *dtype) {
    const td_tensor *x = n->in[0];
    if (!td__is_float(x->dtype))
        return td__fail(TD_EDTYPE, "%s: input '%s' must be f32, bf16 or f16", n->what, x->name);
    *shape = x->shape;
    *dtype = x->dtype;
    return TD_OK;
}

const td__op td__op_eltwise = {
    .name = "eltwise",
    .id = TD__OP_ELTWISE,
    .propagates_layout = 1,
    .infer = elt_infer,
    .activation = elt_activation,
    .set_alias = elt_set_alias,
};
