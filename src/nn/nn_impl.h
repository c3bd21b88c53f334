/* What the files of src/nn share beyond the public nn.h: marking a layer list as one of the
 * reference models. Not installed. */
#ifndef TANDEM_NN_IMPL_H
#define TANDEM_NN_IMPL_H

#include "tandem/nn.h"

/* Marks a description as reference model `kind` (td_model.kind of what it builds). */
void td__sequential_set_kind(td_sequential *s, td_model_kind kind);

/* Marks a description whose last layer gives each rank of the graph's group its own columns of
 * the logits (a tensor-parallel GPT's vocabulary slice): td_sequential_loss takes the
 * vocabulary-parallel cross-entropy. */
void td__sequential_set_split_logits(td_sequential *s);

#endif
