// Device-side helpers of the CUDA ops: warp and block reductions, F16/BF16 bit conversions, reading
// 8 consecutive weights of any weight dtype, and cp.async staging into shared memory.
// Included by .cu files only.
#pragma once

#include "backend/cuda/common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace prescope::cuda {

constexpr int kWarp = 32;

/// Weights are read in chunks of 8 consecutive elements, whatever the dtype (a quarter of a Q8_0 block,
/// 16 bytes of F16/BF16, 32 bytes of F32), so every kernel requires rows of a multiple of 8 elements.
constexpr int kChunk = 8;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
/// `scratch`: 32 floats of shared memory, free again when the call returns.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();  // scratch may be reused right after
    return v;
}

/// Maximum over the block; same contract as block_sum.
__device__ __forceinline__ float block_max(float v, float *scratch) {
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, n_warps = blockDim.x / kWarp;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : -INFINITY;
    v = warp_max(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

/// Reads chunk c (elements 8c .. 8c+7) of a weight row starting at `row`, converted to F32 exactly
/// (Q8_0: d * q as ggml dequantize_row_q8_0 computes it; d * q is exact in F32).
/// Alignment: F32, F16, BF16 rows 16-byte aligned (16-byte loads); Q8_0 rows 2-byte aligned (34-byte
/// blocks: the F16 scale, then four 16-bit loads of quants). Global or shared memory.
template <DType T>
__device__ __forceinline__ void load_chunk(const uint8_t *row, int64_t c, float w[kChunk]) {
    if constexpr (T == DType::F32) {
        const float4 *p = reinterpret_cast<const float4 *>(row) + 2 * c;
        const float4 a = p[0], b = p[1];
        w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
    } else if constexpr (T == DType::F16) {
        const uint4 u = reinterpret_cast<const uint4 *>(row)[c];
        const uint32_t v[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            w[2 * k] = f16_bits_to_f32(uint16_t(v[k] & 0xffffu));
            w[2 * k + 1] = f16_bits_to_f32(uint16_t(v[k] >> 16));
        }
    } else if constexpr (T == DType::BF16) {
        const uint4 u = reinterpret_cast<const uint4 *>(row)[c];
        const uint32_t v[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            w[2 * k] = __uint_as_float(v[k] << 16);
            w[2 * k + 1] = __uint_as_float(v[k] & 0xffff0000u);
        }
    } else {
        static_assert(T == DType::Q8_0);
        const uint8_t *blk = row + (c >> 2) * int64_t(sizeof(BlockQ8_0));
        const float d = f16_bits_to_f32(*reinterpret_cast<const uint16_t *>(blk));
        const uint16_t *q = reinterpret_cast<const uint16_t *>(blk + 2 + (c & 3) * kChunk);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint16_t v = q[k];
            w[2 * k] = d * float(int8_t(v & 0xffu));
            w[2 * k + 1] = d * float(int8_t(v >> 8));
        }
    }
}

/// F32 -> F16 with saturation to +-65504 (activations beyond the F16 range would otherwise become inf).
__device__ __forceinline__ __half f32_to_f16_sat(float v) {
    return __float2half_rn(fminf(fmaxf(v, -65504.0f), 65504.0f));
}

/// Writes 8 floats as dtype `T` (F32, F16 saturating, BF16 round-to-nearest-even) at out, which must
/// be 16-byte aligned.
template <DType T>
__device__ __forceinline__ void store_chunk(uint8_t *out, const float v[kChunk]) {
    if constexpr (T == DType::F32) {
        float4 *p = reinterpret_cast<float4 *>(out);
        p[0] = make_float4(v[0], v[1], v[2], v[3]);
        p[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else if constexpr (T == DType::F16) {
        uint32_t u[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            u[k] = uint32_t(__half_as_ushort(f32_to_f16_sat(v[2 * k]))) |
                   uint32_t(__half_as_ushort(f32_to_f16_sat(v[2 * k + 1]))) << 16;
        *reinterpret_cast<uint4 *>(out) = make_uint4(u[0], u[1], u[2], u[3]);
    } else {
        static_assert(T == DType::BF16);
        uint32_t u[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            u[k] = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v[2 * k]))) |
                   uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v[2 * k + 1]))) << 16;
        *reinterpret_cast<uint4 *>(out) = make_uint4(u[0], u[1], u[2], u[3]);
    }
}

/// 16-byte asynchronous copy global -> shared (sm_80+: cp.async.cg, bypassing L1); both addresses
/// 16-byte aligned. Older targets copy synchronously through registers.
__device__ __forceinline__ void cp_async_16(void *smem, const void *gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned saddr = unsigned(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(gmem) : "memory");
#else
    *static_cast<uint4 *>(smem) = *static_cast<const uint4 *>(gmem);
#endif
}

/// Closes the group of cp.async copies issued by this thread since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/// Threads of a block that reduces one row of n elements (norms, softmax): enough to keep a few
/// elements per thread, never fewer than a warp.
constexpr int row_threads(int64_t n) { return n >= 4096 ? 512 : n >= 1024 ? 256 : n >= 256 ? 128 : n >= 64 ? 64 : 32; }

/// Ceiling division for launch grids.
PRESCOPE_HOST_DEVICE constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

} // namespace prescope::cuda
