// Causal grouped-query attention over a GPU KV cache, the CUDA twin of cpu::attention: one kernel for
// decode and prefill (flash-attention style online softmax, F32), with the keys split over several
// blocks when too few (token, KV head) pairs would occupy the GPU (flash-decoding).
#pragma once

#include "backend/cuda/common.cuh"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace prescope::cuda {

/// Workspace bytes attention needs for these sizes on the current device (0 when it does not split
/// the keys; a smaller workspace than this makes it split less, down to not at all).
size_t attention_workspace_bytes(int64_t n_tok, int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim);

/// Causal GQA of n_tok new queries at positions [pos0, pos0 + n_tok) of one sequence.
/// q: [n_tok][n_head][head_dim]; k_cache, v_cache: [>= pos0 + n_tok][n_head_kv][head_dim] holding every
/// position up to pos0 + n_tok - 1 (the new tokens' k and v already stored: a cudaMemcpyAsync of
/// [n_tok][n_head_kv][head_dim] to position pos0); out: [n_tok][n_head][head_dim]. All F32 on the device,
/// 16-byte aligned. Query head h reads KV head h / (n_head / n_head_kv); scores = (q * scale) . k,
/// softmax in F32. head_dim in {16, 32, 64, 128, 256}; n_head / n_head_kv <= 16 (others throw Error).
/// ws: up to attention_workspace_bytes(...) (may be empty). Asynchronous on `stream`.
void attention(const float *q, const float *k_cache, const float *v_cache, int64_t n_tok, int64_t pos0, int64_t n_head,
               int64_t n_head_kv, int64_t head_dim, float scale, float *out, Workspace ws, cudaStream_t stream);

} // namespace prescope::cuda
