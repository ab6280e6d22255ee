// RMSNorm on the GPU, the CUDA twin of cpu::rms_norm.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prescope::cuda {

/// y = x / sqrt(mean(x^2) + eps) * w over n_rows rows of n elements (HF Qwen3MoeRMSNorm; ggml_rms_norm
/// then mul), F32 throughout. x, y: [n_rows][n] F32 on the device, y may alias x; w: [n] F32 on the
/// device. Per-head q/k norms are the same call with n_rows = n_tok * n_head, n = head_dim. row_stride > n: row r
/// of x and y starts at r * row_stride instead (the first n floats of longer rows, e.g. MLA's latent part of each
/// cached row; the rest is untouched). Asynchronous on `stream`.
void rms_norm(const float *x, const float *w, int64_t n_rows, int64_t n, float eps, float *y, cudaStream_t stream,
              int64_t row_stride = 0);

} // namespace prescope::cuda
