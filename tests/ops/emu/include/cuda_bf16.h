// Stand-in for the CUDA header of this name in the CPU emulation (tests/ops/emu/cuda-emu.h).
#pragma once
#include "../cuda-emu.h"
