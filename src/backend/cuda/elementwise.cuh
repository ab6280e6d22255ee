// Elementwise ops on the GPU: SwiGLU (the CUDA twin of cpu::swiglu), residual add, scaled add and
// bias add (the twin of cpu::add_bias). All F32 on the device, asynchronous on `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prescope::cuda {

/// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)), i < n. out may alias gate or up.
void swiglu(const float *gate, const float *up, float *out, int64_t n, cudaStream_t stream);

/// gpt-oss's clamped SwiGLU, the twin of cpu::swiglu_oai: g = min(gate[i], limit), u = clamp(up[i], -limit, limit),
/// out[i] = g / (1 + exp(-alpha g)) * (u + 1), i < n. out may alias gate or up.
void swiglu_oai(const float *gate, const float *up, float *out, int64_t n, float alpha, float limit,
                cudaStream_t stream);

/// out[i] = a[i] + b[i], i < n (the residual connection). out may alias a or b.
void add(const float *a, const float *b, float *out, int64_t n, cudaStream_t stream);

/// y[i] += s * x[i], i < n (a weighted expert output, a scaled branch). y must not alias x.
void scale_add(float *y, const float *x, float s, int64_t n, cudaStream_t stream);

/// y[t][o] += b[o] for t < n_tok, o < n_out (projection biases, e.g. Qwen2's q/k/v).
void add_bias(float *y, const float *b, int64_t n_tok, int64_t n_out, cudaStream_t stream);

} // namespace prescope::cuda
