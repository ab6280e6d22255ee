// RoPE kernel (rope.cuh): one thread per rotated pair.
#include "backend/cuda/rope.cuh"

#include "backend/cuda/common.cuh"
#include "backend/cuda/device.cuh"

namespace prescope::cuda {

namespace {

constexpr int kRopeThreads = 256;

/// The two elements pair i of a head rotates: NORM (2i, 2i + 1), NEOX (i, i + head_dim / 2).
template <RopeMode M> __device__ __forceinline__ int64_t pair_first(int64_t i) { return M == RopeMode::NORM ? 2 * i : i; }
template <RopeMode M> __device__ __forceinline__ int64_t pair_second(int64_t i, int64_t half) {
    return M == RopeMode::NORM ? 2 * i + 1 : i + half;
}

/// (a, b) turned by theta = float(pos) * inv_freq: cos and sin in double, rounded to F32, times mscale.
__device__ __forceinline__ void rotate(float &a, float &b, int32_t pos, float inv_freq, float mscale) {
    const float theta = float(pos) * inv_freq;
    double s, c;
    sincos(double(theta), &s, &c);
    const float x = a, y = b, cf = float(c) * mscale, sf = float(s) * mscale;
    a = x * cf - y * sf;
    b = x * sf + y * cf;
}

template <RopeMode M>
__global__ void __launch_bounds__(kRopeThreads)
    rope_kernel(float *x, int64_t n_pairs, int64_t n_head, int64_t head_dim, int64_t head_stride,
                const int32_t *__restrict__ pos, const float *__restrict__ inv_freq, float mscale) {
    const int64_t half = head_dim / 2;
    for (int64_t idx = int64_t(blockIdx.x) * kRopeThreads + threadIdx.x; idx < n_pairs;
         idx += int64_t(gridDim.x) * kRopeThreads) {
        const int64_t i = idx % half, th = idx / half;  // th = t * n_head + h
        const int64_t t = th / n_head;
        float *v = x + th * head_stride;
        const int64_t i0 = pair_first<M>(i), i1 = pair_second<M>(i, half);
        rotate(v[i0], v[i1], pos[t], inv_freq[i], mscale);
    }
}

// qk_norm_rope: one block of row_threads(head_dim) threads per (token, head) of the queries, keys and values (in
// that order along blockIdx.x): the bias added, the RMSNorm scale as rms_norm_kernel computes it (rms_scale at the
// same block size), the normalized row through shared memory, then each pair rotated as rope_kernel rotates it.
template <RopeMode M>
__global__ void __launch_bounds__(512) qk_norm_rope_kernel(const QkNormRopeArgs a) {
    __shared__ float scratch[kWarp];
    extern __shared__ __align__(16) float row[];  // [head_dim]
    pdl_wait();  // launched by launch_pdl
    pdl_trigger();
    const int64_t hd = a.head_dim, t = blockIdx.y;
    const int64_t h = blockIdx.x;
    const int64_t nq = a.n_head, nkv = a.n_head_kv;
    const int64_t dst_row = a.rows != nullptr ? int64_t(a.rows[t]) : t;
    const float *src, *bias, *norm;
    float *dst;
    if (h < nq) {
        src = a.q + (t * nq + h) * hd, dst = a.q + (t * nq + h) * hd;
        bias = a.bq != nullptr ? a.bq + h * hd : nullptr, norm = a.q_norm;
    } else if (h < nq + nkv) {
        const int64_t j = h - nq;
        src = a.k + (t * nkv + j) * hd, dst = a.k_out + (dst_row * nkv + j) * hd;
        bias = a.bk != nullptr ? a.bk + j * hd : nullptr, norm = a.k_norm;
    } else {  // values: bias and copy only
        const int64_t j = h - nq - nkv;
        src = a.v + (t * nkv + j) * hd, dst = a.v_out + (dst_row * nkv + j) * hd;
        for (int64_t i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = a.bv != nullptr ? src[i] + a.bv[j * hd + i] : src[i];
        return;
    }
    for (int64_t i = threadIdx.x; i < hd; i += blockDim.x) row[i] = bias != nullptr ? src[i] + bias[i] : src[i];
    __syncthreads();
    if (norm != nullptr) {
        const float scale = rms_scale(row, hd, a.eps, scratch);  // its block_sum orders the reads before the writes
        for (int64_t i = threadIdx.x; i < hd; i += blockDim.x) row[i] = norm[i] * (row[i] * scale);
        __syncthreads();
    }
    const int64_t half = hd / 2;
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
        const int64_t i0 = pair_first<M>(i), i1 = pair_second<M>(i, half);
        float x0 = row[i0], x1 = row[i1];
        rotate(x0, x1, a.pos[t], a.inv_freq[i], a.mscale);
        dst[i0] = x0;
        dst[i1] = x1;
    }
}

} // namespace

void qk_norm_rope(const QkNormRopeArgs &a, int64_t n_tok, RopeMode mode, cudaStream_t stream) {
    CUDA_ASSERT(a.head_dim > 0 && a.head_dim % 2 == 0 && a.head_dim <= 1024 && a.n_head > 0 && a.n_head_kv > 0);
    CUDA_ASSERT(n_tok >= 0 && n_tok < 65536 && a.q && a.k && a.k_out && a.pos && a.inv_freq);
    CUDA_ASSERT((a.v == nullptr) == (a.v_out == nullptr) && (a.q_norm == nullptr) == (a.k_norm == nullptr));
    if (n_tok == 0) return;
    const dim3 grid(unsigned(a.n_head + a.n_head_kv * (a.v != nullptr ? 2 : 1)), unsigned(n_tok));
    const int threads = row_threads(a.head_dim);
    const size_t smem = size_t(a.head_dim) * 4;
    if (mode == RopeMode::NORM) {
        launch_pdl(qk_norm_rope_kernel<RopeMode::NORM>, grid, dim3(unsigned(threads)), smem, stream, a);
    } else {
        launch_pdl(qk_norm_rope_kernel<RopeMode::NEOX>, grid, dim3(unsigned(threads)), smem, stream, a);
    }
    launch_check("qk_norm_rope", stream);
}

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
