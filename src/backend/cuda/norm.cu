// RMSNorm kernel (norm.cuh): one block per row, launched by launch_pdl.
#include "backend/cuda/norm.cuh"

#include "backend/cuda/common.cuh"
#include "backend/cuda/device.cuh"

namespace prescope::cuda {

namespace {

__global__ void rms_norm_kernel(const float *x, const float *__restrict__ w, int64_t n, int64_t stride, float eps,
                                float *y) {
    __shared__ float scratch[kWarp];
    pdl_wait();
    pdl_trigger();
    const float *xr = x + int64_t(blockIdx.x) * stride;
    float *yr = y + int64_t(blockIdx.x) * stride;
    const float scale = rms_scale(xr, n, eps, scratch);  // its block_sum orders every read of x before the writes
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = w[i] * (xr[i] * scale);
}

} // namespace

void rms_norm(const float *x, const float *w, int64_t n_rows, int64_t n, float eps, float *y, cudaStream_t stream,
              int64_t row_stride) {
    CUDA_ASSERT(n > 0 && n_rows >= 0 && n_rows < (int64_t(1) << 31) && (row_stride == 0 || row_stride >= n));
    if (n_rows == 0) return;
    launch_pdl(rms_norm_kernel, dim3(unsigned(n_rows)), dim3(unsigned(row_threads(n))), 0, stream, x, w, n,
               row_stride > 0 ? row_stride : n, eps, y);
    launch_check("rms_norm", stream);
}

} // namespace prescope::cuda
