// MoE routing kernels (moe.cuh): router top-k (one warp per token) and the expert-output combine.
#include "backend/cuda/moe.cuh"

#include "backend/cuda/common.cuh"
#include "backend/cuda/device.cuh"

#include <climits>

namespace prescope::cuda {

namespace {

// ---------------------------------------------------------------------------------------------
// router top-k: lane l holds experts l, l + 32, ...; k rounds of a warp arg-max pick the experts.

constexpr int kRouterWarps = 4;
constexpr int kRouterMaxK = 32;

// cpu::top_k's order: larger first, NaN after every number, ties to the lower id. A total order, so
// every lane of a butterfly reduction ends with the same winner.
__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) {
    const bool na = isnan(a), nb = isnan(b);
    if (na != nb) return nb;
    if (!na && a != b) return a > b;
    return ia < ib;
}

template <int L>
__global__ void __launch_bounds__(kRouterWarps *kWarp)
    router_topk_kernel(const float *__restrict__ logits, int64_t n_tok, int n_expert, int k, bool renorm,
                       float *probs, int32_t *ids, float *weights) {
    const int lane = int(threadIdx.x) % kWarp;
    const int64_t t = int64_t(blockIdx.x) * kRouterWarps + threadIdx.x / kWarp;
    if (t >= n_tok) return;  // whole warps leave together
    const float *row = logits + t * n_expert;

    float v[L];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < L; ++i) {
        const int e = i * kWarp + lane;
        v[i] = e < n_expert ? row[e] : -INFINITY;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < L; ++i) {
        const int e = i * kWarp + lane;
        v[i] = e < n_expert ? expf(v[i] - mx) : 0.0f;
        sum += v[i];
    }
    sum = warp_sum(sum);
    const float inv = float(1.0 / double(sum));
#pragma unroll
    for (int i = 0; i < L; ++i) {
        const int e = i * kWarp + lane;
        v[i] *= inv;
        if (probs != nullptr && e < n_expert) probs[t * n_expert + e] = v[i];
    }

    uint32_t taken = 0;  // bit i: expert i * 32 + lane already picked
    float pick_w = 0.0f, sum_w = 0.0f;
    int pick_id = 0;
    for (int r = 0; r < k; ++r) {
        float bv = 0.0f;
        int bi = INT_MAX;  // INT_MAX: no candidate
#pragma unroll
        for (int i = 0; i < L; ++i) {
            const int e = i * kWarp + lane;
            if (e < n_expert && !((taken >> i) & 1u) && (bi == INT_MAX || ranks_before(v[i], e, bv, bi))) {
                bv = v[i];
                bi = e;
            }
        }
#pragma unroll
        for (int o = kWarp / 2; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi != INT_MAX && (bi == INT_MAX || ranks_before(ov, oi, bv, bi))) {
                bv = ov;
                bi = oi;
            }
        }
        if (bi % kWarp == lane) taken |= 1u << (bi / kWarp);
        if (lane == r) {
            pick_w = bv;
            pick_id = bi;
        }
        sum_w += bv;
    }
    if (lane < k) {
        ids[t * k + lane] = pick_id;
        weights[t * k + lane] = renorm ? pick_w / sum_w : pick_w;
    }
}

// ---------------------------------------------------------------------------------------------
// combine: one thread per output element, the token's k slots read in order.

constexpr int kCombineThreads = 256;
constexpr int64_t kMaxGridY = 65535;

__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const float *__restrict__ y, const int32_t *__restrict__ pair_ids,
                       const float *__restrict__ weights, int64_t n_tok, int k, int64_t n_embd, bool accumulate,
                       float *__restrict__ out) {
    const int64_t i = int64_t(blockIdx.x) * kCombineThreads + threadIdx.x;
    if (i >= n_embd) return;
    for (int64_t t = blockIdx.y; t < n_tok; t += gridDim.y) {
        float acc = accumulate ? out[t * n_embd + i] : 0.0f;
        for (int j = 0; j < k; ++j) {
            const int32_t p = pair_ids[t * k + j];
            if (p >= 0) acc += weights[t * k + j] * y[int64_t(p) * n_embd + i];
        }
        out[t * n_embd + i] = acc;
    }
}

} // namespace

void router_topk(const float *logits, int64_t n_tok, int64_t n_expert, int64_t k, bool renorm, float *probs,
                 int32_t *ids, float *weights, cudaStream_t stream) {
    if (n_expert < 1 || n_expert > 32 * kWarp) cuda_unsupported("router_topk: n_expert must be 1..1024");
    if (k < 1 || k > kRouterMaxK || k > n_expert) cuda_unsupported("router_topk: k must be 1..min(32, n_expert)");
    if (n_tok <= 0) return;
    const unsigned grid = unsigned(ceil_div(n_tok, kRouterWarps));
    const int ne = int(n_expert), kk = int(k);
    const int threads = kRouterWarps * kWarp;
    const int slots = int(ceil_div(n_expert, kWarp));
    if (slots <= 1) {
        router_topk_kernel<1><<<grid, threads, 0, stream>>>(logits, n_tok, ne, kk, renorm, probs, ids, weights);
    } else if (slots <= 2) {
        router_topk_kernel<2><<<grid, threads, 0, stream>>>(logits, n_tok, ne, kk, renorm, probs, ids, weights);
    } else if (slots <= 4) {
        router_topk_kernel<4><<<grid, threads, 0, stream>>>(logits, n_tok, ne, kk, renorm, probs, ids, weights);
    } else if (slots <= 8) {
        router_topk_kernel<8><<<grid, threads, 0, stream>>>(logits, n_tok, ne, kk, renorm, probs, ids, weights);
    } else if (slots <= 16) {
        router_topk_kernel<16><<<grid, threads, 0, stream>>>(logits, n_tok, ne, kk, renorm, probs, ids, weights);
    } else {
        router_topk_kernel<32><<<grid, threads, 0, stream>>>(logits, n_tok, ne, kk, renorm, probs, ids, weights);
    }
    launch_check("router_topk", stream);
}

void moe_combine(const float *y, const int32_t *pair_ids, const float *weights, int64_t n_tok, int64_t k,
                 int64_t n_embd, bool accumulate, float *out, cudaStream_t stream) {
    CUDA_ASSERT(k >= 1 && k < INT_MAX && n_embd > 0 && n_tok >= 0);
    if (n_tok == 0) return;
    const dim3 grid(unsigned(ceil_div(n_embd, kCombineThreads)), unsigned(n_tok < kMaxGridY ? n_tok : kMaxGridY));
    moe_combine_kernel<<<grid, kCombineThreads, 0, stream>>>(y, pair_ids, weights, n_tok, int(k), n_embd, accumulate,
                                                             out);
    launch_check("moe_combine", stream);
}

} // namespace prescope::cuda
