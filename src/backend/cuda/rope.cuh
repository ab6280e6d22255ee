// Rotary position embedding on the GPU, the CUDA twin of cpu::rope (NORM and NEOX pairings).
#pragma once

#include "backend/cpu/ops.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prescope::cuda {

using RopeMode = cpu::RopeMode;

/// Rotates x: [n_tok][n_head][head_dim] F32 on the device in place; token t sits at position pos[t]
/// (pos: [n_tok] int32 on the device). Pair i < head_dim/2 turns by theta = pos * inv_freq_i with
/// inv_freq_i = 1 / freq_base^(2i/head_dim), all in F32 as HF computes them (the power and the cosine
/// and sine are evaluated in double and rounded, to match the CPU's correctly rounded powf/cosf/sinf).
/// NORM pairs (x[2i], x[2i+1]); NEOX pairs (x[i], x[i + head_dim/2]). head_dim even.
/// Asynchronous on `stream`.
void rope(float *x, int64_t n_tok, int64_t n_head, int64_t head_dim, const int32_t *pos, float freq_base,
          RopeMode mode, cudaStream_t stream);

} // namespace prescope::cuda
