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

/// The query, key and value heads of an attention block's projections, between the q/k/v products and the
/// attention, in one launch (decision 0143). All pointers are F32 / int32 on the device.
struct QkNormRopeArgs {
    float *q = nullptr;              // [n_tok][n_head][head_dim], in place
    const float *k = nullptr;        // [n_tok][n_head_kv][head_dim]
    float *k_out = nullptr;          // key rows: row rows[t] (or t) of [..][n_head_kv][head_dim]; may be k
    const float *v = nullptr;        // [n_tok][n_head_kv][head_dim] or nullptr: no values to move
    float *v_out = nullptr;          // value rows as k_out's; may be v
    const float *bq = nullptr, *bk = nullptr, *bv = nullptr;  // [n_head * head_dim] etc. biases, or nullptr
    const float *q_norm = nullptr, *k_norm = nullptr;        // [head_dim] per-head RMSNorm weights, or nullptr
    const int32_t *rows = nullptr;   // [n_tok] destination rows of keys and values, or nullptr: row t
    const int32_t *pos = nullptr;    // [n_tok] positions
    const float *inv_freq = nullptr; // [head_dim / 2] (cpu::rope_inv_freq)
    int64_t n_head = 0, n_head_kv = 0, head_dim = 0;
    float eps = 0.0f, mscale = 1.0f;
};

/// For each token t < n_tok: each query head q and key head k gets its bias added (add_bias), its per-head RMSNorm
/// (rms_norm with n = head_dim, when q_norm / k_norm are given) and its rotation at pos[t] (rope), the same F32
/// operations as those calls in that order, so the results equal them bit for bit; queries stay in place, keys go
/// to k_out row rows[t], values (bias added) to v_out row rows[t]. head_dim even, <= 1024. The keys and values
/// of one token may be written in place (k_out == k, rows == nullptr). Asynchronous on `stream`.
void qk_norm_rope(const QkNormRopeArgs &args, int64_t n_tok, RopeMode mode, cudaStream_t stream);

} // namespace prescope::cuda
