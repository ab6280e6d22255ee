// Rotary position embedding on the GPU, the CUDA twin of cpu::rope (NORM and NEOX pairings, YaRN through the
// frequency table).
#pragma once

#include "backend/cpu/ops.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prescope::cuda {

using RopeMode = cpu::RopeMode;

/// Rotates the heads of x in place: head h of token t is the head_dim floats at x + (t * n_head + h) *
/// head_stride (head_stride >= head_dim; head_dim for packed [n_tok][n_head][head_dim]; larger to rotate
/// the rope part of a longer row, as DeepSeek's MLA does). Token t sits at position pos[t] (pos: [n_tok] int32
/// on the device). Pair i < head_dim/2 turns by theta = float(pos) * inv_freq[i] (inv_freq: [head_dim/2] F32
/// on the device, cpu::rope_inv_freq's table), cos and sin evaluated in double and rounded to F32 (the CPU's
/// correctly rounded cosf / sinf), then times mscale (RopeYarn::mscale; 1 without YaRN).
/// NORM pairs (x[2i], x[2i+1]); NEOX pairs (x[i], x[i + head_dim/2]). head_dim even. Asynchronous on `stream`.
void rope(float *x, int64_t n_tok, int64_t n_head, int64_t head_dim, int64_t head_stride, const int32_t *pos,
          const float *inv_freq, float mscale, RopeMode mode, cudaStream_t stream);

} // namespace prescope::cuda
