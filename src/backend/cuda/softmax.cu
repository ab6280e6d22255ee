// Row softmax kernel (softmax.cuh): one block per row, three passes over the row (it stays in L1/L2).
#include "backend/cuda/softmax.cuh"

#include "backend/cuda/common.cuh"
#include "backend/cuda/device.cuh"

namespace prescope::cuda {

namespace {

__global__ void softmax_kernel(float *x, int64_t n) {
    __shared__ float scratch[kWarp];
    float *xr = x + int64_t(blockIdx.x) * n;
    float mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, xr[i]);
    mx = block_max(mx, scratch);
    float sum = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = expf(xr[i] - mx);
        xr[i] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    const float inv = float(1.0 / double(sum));
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) xr[i] *= inv;
}

} // namespace

void softmax(float *x, int64_t n_rows, int64_t n, cudaStream_t stream) {
    CUDA_ASSERT(n > 0 && n_rows >= 0 && n_rows < (int64_t(1) << 31));
    if (n_rows == 0) return;
    softmax_kernel<<<unsigned(n_rows), row_threads(n), 0, stream>>>(x, n);
    launch_check("softmax", stream);
}

} // namespace prescope::cuda
