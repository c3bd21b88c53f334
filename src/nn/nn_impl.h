/* What the files of src/nn share beyond the public nn.h: marking a layer list as one of the
 * reference models. Not installed. */
#ifndef TANDEM_NN_IMPL_H
#define TANDEM_NN_IMPL_H

#include "tandem/nn.h"

/* Marks a description as reference model `kind` (td_model.kind of what it builds). */
void td__sequential_set_kind(td_sequential *s, td_model_kind kind);

#endif
