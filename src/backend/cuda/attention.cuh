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
/// ws: up to attention_workspace_bytes(...) (may be empty). Options as cpu::attention's (gpt-oss): sinks [n_head]
/// F32 on the device, one extra unscaled score per query head in each row's denominator; window > 0: the query at
/// position p sees positions (p - window, p] only. pos0_dev non-null: pos0 is ignored and read on the device from
/// *pos0_dev when the kernels run, with the same split plan (so the same result) as the host's for that position;
/// the launch then does not depend on the position, as a CUDA graph replayed at every position needs. Asynchronous
/// on `stream`.
void attention(const float *q, const float *k_cache, const float *v_cache, int64_t n_tok, int64_t pos0, int64_t n_head,
               int64_t n_head_kv, int64_t head_dim, float scale, float *out, Workspace ws, cudaStream_t stream,
               const float *sinks = nullptr, int64_t window = 0, const int32_t *pos0_dev = nullptr);

/// Workspace bytes attention_latent needs for these sizes on the current device (0 when it does not split the keys).
size_t attention_latent_workspace_bytes(int64_t n_tok, int64_t pos0, int64_t n_head, int64_t dv);

/// Causal attention of n_tok queries at positions [pos0, pos0 + n_tok) against one shared KV head whose values
/// are the first dv floats of its keys: DeepSeek's MLA with absorbed weights (llama.cpp src/models/deepseek2.cpp
/// runs it as MQA over the cached latent rows; runtime/context.cpp mla_attention_block). q: [n_tok][n_head][dk];
/// cache: [>= pos0 + n_tok][dk] rows (every position up to pos0 + n_tok - 1 stored); out: [n_tok][n_head][dv]
/// = softmax(scale * q.k) . v in F32 (online softmax; split keys merged as attention's). All F32 on the device.
/// dk <= 1024, dv <= min(dk, 1024) (others throw Error). ws: up to attention_latent_workspace_bytes(...) (may
/// be empty). Asynchronous on `stream`.
void attention_latent(const float *q, const float *cache, int64_t n_tok, int64_t pos0, int64_t n_head, int64_t dk,
                      int64_t dv, float scale, float *out, Workspace ws, cudaStream_t stream);

} // namespace prescope::cuda
