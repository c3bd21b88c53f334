/* tandem: distributed training for C programs. The umbrella header: include this one. */
#ifndef TANDEM_TANDEM_H
#define TANDEM_TANDEM_H

#include "tandem/amp.h"
#include "tandem/args.h"
#include "tandem/checkpoint.h"
#include "tandem/comm.h"
#include "tandem/core.h"
#include "tandem/data.h"
#include "tandem/device.h"
#include "tandem/ddp.h"
#include "tandem/dp.h"
#include "tandem/graph.h"
#include "tandem/launch.h"
#include "tandem/mesh.h"
#include "tandem/nn.h"
#include "tandem/ops.h"
#include "tandem/optim.h"
#include "tandem/param.h"
#include "tandem/pipeline.h"
#include "tandem/spawn.h"
#include "tandem/store.h"
#include "tandem/tensor.h"
#include "tandem/trace.h"
#include "tandem/zero.h"

#endif
