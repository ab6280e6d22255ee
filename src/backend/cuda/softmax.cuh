// Row softmax on the GPU, the CUDA twin of cpu::softmax.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prescope::cuda {

/// In-place softmax over each of n_rows rows of n F32 values on the device: x = exp(x - max) / sum,
/// in F32. Asynchronous on `stream`.
void softmax(float *x, int64_t n_rows, int64_t n, cudaStream_t stream);

} // namespace prescope::cuda
