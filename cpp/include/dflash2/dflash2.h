// dflash2/dflash2.h: the umbrella header for C++ users.
#pragma once
#include "dflash2/arena.h"
#include "dflash2/build_info.h"
#include "dflash2/dtype.h"
#include "dflash2/engine.h"
#include "dflash2/error.h"
#include "dflash2/json.h"
#include "dflash2/ops.h"
#include "dflash2/safetensors.h"
#include "dflash2/tensor.h"
