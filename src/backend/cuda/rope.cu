// RoPE kernel (rope.cuh): one thread per rotated pair.
#include "backend/cuda/rope.cuh"

#include "backend/cuda/common.cuh"
#include "backend/cuda/device.cuh"

namespace prescope::cuda {

namespace {

constexpr int kRopeThreads = 256;

template <RopeMode M>
__global__ void __launch_bounds__(kRopeThreads)
    rope_kernel(float *x, int64_t n_pairs, int64_t n_head, int64_t head_dim, int64_t head_stride,
                const int32_t *__restrict__ pos, const float *__restrict__ inv_freq, float mscale) {
    const int64_t half = head_dim / 2;
    for (int64_t idx = int64_t(blockIdx.x) * kRopeThreads + threadIdx.x; idx < n_pairs;
         idx += int64_t(gridDim.x) * kRopeThreads) {
        const int64_t i = idx % half, th = idx / half;  // th = t * n_head + h
        const int64_t t = th / n_head;
        const float theta = float(pos[t]) * inv_freq[i];
        double s, c;
        sincos(double(theta), &s, &c);
        float *v = x + th * head_stride;
        const int64_t i0 = M == RopeMode::NORM ? 2 * i : i, i1 = M == RopeMode::NORM ? 2 * i + 1 : i + half;
        const float a = v[i0], b = v[i1], cf = float(c) * mscale, sf = float(s) * mscale;
        v[i0] = a * cf - b * sf;
        v[i1] = a * sf + b * cf;
    }
}

} // namespace

void rope(float *x, int64_t n_tok, int64_t n_head, int64_t head_dim, int64_t head_stride, const int32_t *pos,
          const float *inv_freq, float mscale, RopeMode mode, cudaStream_t stream) {
    CUDA_ASSERT(head_dim > 0 && head_dim % 2 == 0 && head_stride >= head_dim && n_head > 0 && n_tok >= 0);
    const int64_t n_pairs = n_tok * n_head * (head_dim / 2);
    if (n_pairs == 0) return;
    const int64_t blocks = ceil_div(n_pairs, kRopeThreads);
    const unsigned grid = unsigned(blocks < 65536 ? blocks : 65536);
    if (mode == RopeMode::NORM) {
        rope_kernel<RopeMode::NORM><<<grid, kRopeThreads, 0, stream>>>(x, n_pairs, n_head, head_dim, head_stride, pos, inv_freq,
                                                                     mscale);
    } else {
        rope_kernel<RopeMode::NEOX><<<grid, kRopeThreads, 0, stream>>>(x, n_pairs, n_head, head_dim, head_stride, pos, inv_freq,
                                                                     mscale);
    }
    launch_check("rope", stream);
}

} // namespace prescope::cuda
