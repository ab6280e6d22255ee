// Device-side helpers of the CUDA ops: warp and block reductions, F16/BF16 bit conversions, reading
// 8 consecutive weights of any weight dtype (dequantized bit for bit as on the CPU), and cp.async
// staging into shared memory.
// Included by .cu files only.
#pragma once

#include "backend/cuda/common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace prescope::cuda {

constexpr int kWarp = 32;

// Programmatic dependent launch (PDL, sm_90+; decision 0150). A kernel launched by launch_pdl may start while the
// kernel before it in the stream is still running, so that its launch and its prologue hide behind that kernel's
// tail. Such a kernel calls pdl_wait() in every block before it reads anything an earlier kernel wrote, writes
// anything, or returns: pdl_wait() returns once the kernel before it has completed and its writes are visible (and,
// every block having waited, this kernel's completion implies that one's for the kernel after it). pdl_trigger()
// lets the kernel after this one launch (it then waits in its own pdl_wait()). Both are no-ops in a kernel launched
// without the attribute and below sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// `kernel<<<grid, block, smem, stream>>>(args...)`, with programmatic stream serialization when
/// pdl_enabled(kernel): the kernel must follow pdl_wait()'s contract. The caller checks the launch (launch_check).
template <class... P, class... A>
void launch_pdl(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A &&...args) {
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = pdl_enabled(reinterpret_cast<const void *>(kernel)) ? 1 : 0;
    (void)cudaLaunchKernelEx(&config, kernel, std::forward<A>(args)...);  // an error stays for launch_check
}

/// Weights are read in chunks of 8 consecutive elements, whatever the dtype (a quarter of a 32-block, a
/// 32nd of a 256-superblock, 16 bytes of F16/BF16, 32 bytes of F32), so every kernel requires rows of a
/// multiple of 8 elements (and of the block size).
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

/// The RMSNorm scale 1 / sqrt(mean(x^2) + eps) of the n floats at x (cpu::rms_norm's formula) as a block of
/// `virt_threads` threads (a multiple of 32, at most 1024) computes it: virtual thread v's FMA chain over elements
/// v, v + virt_threads, ..., block_sum's two warp_sum stages over the virtual warps, the division and root in
/// double. Any block (a multiple of 32 threads) gets that value bit for bit: thread t runs the chains of virtual
/// threads t, t + blockDim.x, ... (decision 0149: the GEMV normalises its row as rms_norm_kernel would). Every
/// thread of the block must call it and gets the result. `scratch`: 32 floats of shared memory.
__device__ __forceinline__ float rms_scale_as(const float *x, int64_t n, float eps, int virt_threads, float *scratch) {
    const int lane = int(threadIdx.x) % kWarp;
    for (int vt0 = 0; vt0 < virt_threads; vt0 += int(blockDim.x)) {
        const int vt = vt0 + int(threadIdx.x);
        float sum = 0.0f;
        if (vt < virt_threads) {
            for (int64_t i = vt; i < n; i += virt_threads) sum = fmaf(x[i], x[i], sum);
        }
        sum = warp_sum(sum);  // vt and its warp's lanes form one virtual warp (vt0 is a multiple of 32)
        if (lane == 0 && vt < virt_threads) scratch[vt / kWarp] = sum;
    }
    __syncthreads();
    float v = lane < virt_threads / kWarp ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();  // scratch may be reused right after
    return float(1.0 / sqrt(double(v) / double(n) + double(eps)));
}

/// rms_scale_as at the block's own size: kernels that call it agree bit for bit at equal block sizes
/// (row_threads(n)). `scratch`: 32 floats of shared memory.
__device__ __forceinline__ float rms_scale(const float *x, int64_t n, float eps, float *scratch) {
    return rms_scale_as(x, n, eps, int(blockDim.x), scratch);
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

/// The 16 entries of an int8 code book packed little-endian in two words (device code cannot read
/// core/dtype.h's host arrays; scalar constexpr values it can).
constexpr uint64_t pack_book(const int8_t *v) {
    uint64_t r = 0;
    for (int i = 7; i >= 0; --i) r = r << 8 | uint8_t(v[i]);
    return r;
}
constexpr uint64_t kIq4nlLo = pack_book(kIq4nlValues), kIq4nlHi = pack_book(kIq4nlValues + 8);
constexpr uint64_t kMxfp4Lo = pack_book(kMxfp4Values), kMxfp4Hi = pack_book(kMxfp4Values + 8);

/// Entry q (0..15) of a packed code book.
__device__ __forceinline__ float book_value(uint64_t lo, uint64_t hi, int q) {
    return float(int8_t(uint8_t((q < 8 ? lo : hi) >> (8 * (q & 7)))));
}

/// The block struct of a 32-block weight type.
template <DType T> struct BlockOf;
template <> struct BlockOf<DType::Q4_0> { using type = BlockQ4_0; };
template <> struct BlockOf<DType::Q4_1> { using type = BlockQ4_1; };
template <> struct BlockOf<DType::Q5_0> { using type = BlockQ5_0; };
template <> struct BlockOf<DType::Q5_1> { using type = BlockQ5_1; };
template <> struct BlockOf<DType::IQ4_NL> { using type = BlockIQ4_NL; };
template <> struct BlockOf<DType::MXFP4> { using type = BlockMXFP4; };

__device__ __forceinline__ uint16_t ld_u16(const uint8_t *p) { return *reinterpret_cast<const uint16_t *>(p); }
__device__ __forceinline__ float ld_f16(const uint8_t *p) { return f16_bits_to_f32(ld_u16(p)); }

/// Scale and min of group j of a Q4_K / Q5_K block's packed scales (core/dtype.h k4_scale_min).
__device__ __forceinline__ void k4_scale_min_dev(int j, const uint8_t *q, int &sc, int &m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/// Reads chunk c (elements 8c .. 8c+7) of a weight row starting at `row`, converted to F32 exactly as
/// core/dtype.h's dequantize_row (ggml's dequantize_row_*): the same F32 operations, the multiply and the
/// add or subtract of a min rounded separately (__fmul_rn / __fsub_rn: never contracted into an FMA), so
/// the values are bit for bit the CPU's.
/// Alignment (weight_alignment): F32, F16, BF16 rows 16-byte aligned (16-byte loads); MXFP4 rows any
/// address (byte loads); the other block types 2-byte aligned (their F16 fields are read as 16-bit words,
/// everything else bytewise). Global or shared memory.
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
    } else if constexpr (T == DType::Q8_0) {
        const uint8_t *blk = row + (c >> 2) * int64_t(sizeof(BlockQ8_0));
        const float d = f16_bits_to_f32(*reinterpret_cast<const uint16_t *>(blk));
        const uint16_t *q = reinterpret_cast<const uint16_t *>(blk + 2 + (c & 3) * kChunk);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint16_t v = q[k];
            w[2 * k] = d * float(int8_t(v & 0xffu));
            w[2 * k + 1] = d * float(int8_t(v >> 8));
        }
    } else if constexpr (T == DType::Q4_0 || T == DType::Q4_1 || T == DType::Q5_0 || T == DType::Q5_1 ||
                         T == DType::IQ4_NL || T == DType::MXFP4) {
        // 32-blocks with nibbles: weight j < 16 is the low nibble of qs[j], weight j >= 16 the high one of
        // qs[j - 16]; chunk (c & 3) holds weights 8 (c & 3) .. +7.
        using B = typename BlockOf<T>::type;
        const uint8_t *blk = row + (c >> 2) * int64_t(sizeof(B));
        const int j0 = int(c & 3) * kChunk;
        const uint8_t *qs = blk + offsetof(B, qs) + (j0 & 15);
        const int shift = j0 >= 16 ? 4 : 0;
        uint32_t qh = 0;
        if constexpr (T == DType::Q5_0 || T == DType::Q5_1) {
            const uint8_t *h = blk + offsetof(B, qh);
            qh = uint32_t(ld_u16(h)) | uint32_t(ld_u16(h + 2)) << 16;
        }
#pragma unroll
        for (int k = 0; k < kChunk; ++k) {
            const int q = (qs[k] >> shift) & 0xF;
            if constexpr (T == DType::Q4_0) {
                w[k] = float(q - 8) * ld_f16(blk);
            } else if constexpr (T == DType::Q4_1) {
                w[k] = __fadd_rn(__fmul_rn(float(q), ld_f16(blk)), ld_f16(blk + 2));
            } else if constexpr (T == DType::Q5_0) {
                w[k] = float((q | int((qh >> (j0 + k)) & 1) << 4) - 16) * ld_f16(blk);
            } else if constexpr (T == DType::Q5_1) {
                w[k] = __fadd_rn(__fmul_rn(float(q | int((qh >> (j0 + k)) & 1) << 4), ld_f16(blk)), ld_f16(blk + 2));
            } else if constexpr (T == DType::IQ4_NL) {
                w[k] = ld_f16(blk) * book_value(kIq4nlLo, kIq4nlHi, q);
            } else {
                const uint32_t e = blk[0];
                const float d = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);  // e8m0_to_fp32_half
                w[k] = book_value(kMxfp4Lo, kMxfp4Hi, q) * d;
            }
        }
    } else {
        // Super-blocks of 256: chunk (c & 31) holds elements e .. e + 7 of block c / 32.
        const int e = int(c & 31) * kChunk;
        if constexpr (T == DType::Q4_K || T == DType::Q5_K) {
            constexpr size_t kBytes = T == DType::Q4_K ? sizeof(BlockQ4_K) : sizeof(BlockQ5_K);
            const uint8_t *blk = row + (c >> 5) * int64_t(kBytes);
            const int g = e / 32, l = e % 32;  // group of 32; nibbles of qs[32 (g / 2) + l ...] >> 4 (g % 2)
            int sc, m;
            k4_scale_min_dev(g, blk + 4, sc, m);
            const float d1 = __fmul_rn(ld_f16(blk), float(sc)), m1 = __fmul_rn(ld_f16(blk + 2), float(m));
            const uint8_t *qs = blk + (T == DType::Q4_K ? 16 : 48) + 32 * (g / 2) + l;
#pragma unroll
            for (int k = 0; k < kChunk; ++k) {
                int q = (qs[k] >> (4 * (g % 2))) & 0xF;
                if constexpr (T == DType::Q5_K) q |= ((blk[16 + l + k] >> g) & 1) << 4;
                w[k] = __fsub_rn(__fmul_rn(d1, float(q)), m1);
            }
        } else if constexpr (T == DType::Q6_K) {
            const uint8_t *blk = row + (c >> 5) * int64_t(sizeof(BlockQ6_K));
            const int half = e / 128, quarter = (e % 128) / 32, l = e % 32;
            const uint8_t *ql = blk + 64 * half + 32 * (quarter & 1) + l, *qh = blk + 128 + 32 * half + l;
            const float dl = __fmul_rn(ld_f16(blk + 208), float(int8_t(blk[192 + 8 * half + 2 * quarter + l / 16])));
#pragma unroll
            for (int k = 0; k < kChunk; ++k) {
                const int q = (((ql[k] >> (4 * (quarter >> 1))) & 0xF) | (((qh[k] >> (2 * quarter)) & 3) << 4)) - 32;
                w[k] = __fmul_rn(dl, float(q));
            }
        } else if constexpr (T == DType::Q2_K || T == DType::Q3_K) {
            // Per 128-half: 4 shifts of 2 bits over qs[32 half ..], each covering 32 weights in 2 groups of 16.
            const int half = e / 128, j = (e % 128) / 32, part = (e % 32) / 16, l = e % 16;
            const int g = 8 * half + 2 * j + part;
            if constexpr (T == DType::Q2_K) {
                const uint8_t *blk = row + (c >> 5) * int64_t(sizeof(BlockQ2_K));
                const uint8_t sc = blk[g];
                const float dl = __fmul_rn(ld_f16(blk + 80), float(sc & 0xF));
                const float ml = __fmul_rn(ld_f16(blk + 82), float(sc >> 4));
                const uint8_t *qs = blk + 16 + 32 * half + 16 * part + l;
#pragma unroll
                for (int k = 0; k < kChunk; ++k) w[k] = __fsub_rn(__fmul_rn(dl, float((qs[k] >> (2 * j)) & 3)), ml);
            } else {
                const uint8_t *blk = row + (c >> 5) * int64_t(sizeof(BlockQ3_K));
                const uint8_t *sp = blk + 96;  // 12 packed scales: low 4 bits in bytes 0-7, high 2 in bytes 8-11
                const int lo = g < 8 ? sp[g] & 0xF : sp[g - 8] >> 4, hi = (sp[8 + g % 4] >> (2 * (g / 4))) & 3;
                const float dl = __fmul_rn(ld_f16(blk + 108), float((lo | hi << 4) - 32));
                const uint8_t *qs = blk + 32 + 32 * half + 16 * part + l, *hm = blk + 16 * part + l;
#pragma unroll
                for (int k = 0; k < kChunk; ++k) {
                    const int q = ((qs[k] >> (2 * j)) & 3) - (((hm[k] >> (4 * half + j)) & 1) ? 0 : 4);
                    w[k] = __fmul_rn(dl, float(q));
                }
            }
        } else {
            static_assert(T == DType::IQ4_XS);
            const uint8_t *blk = row + (c >> 5) * int64_t(sizeof(BlockIQ4_XS));
            const int g = e / 32, l = e % 32;
            const int ls = ((blk[4 + g / 2] >> (4 * (g % 2))) & 0xF) | (((ld_u16(blk + 2) >> (2 * g)) & 3) << 4);
            const float dl = __fmul_rn(ld_f16(blk), float(ls - 32));
            const uint8_t *qs = blk + 8 + 16 * g + (l & 15);
            const int shift = l >= 16 ? 4 : 0;
#pragma unroll
            for (int k = 0; k < kChunk; ++k) w[k] = __fmul_rn(dl, book_value(kIq4nlLo, kIq4nlHi, (qs[k] >> shift) & 0xF));
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
    // cp.async faults on a misaligned address: so does this (the CPU emulator of tests/ops/emu included).
    assert(reinterpret_cast<uintptr_t>(smem) % 16 == 0 && reinterpret_cast<uintptr_t>(gmem) % 16 == 0);
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

/// Calls f(std::integral_constant<DType, T>{}) for the weight type t (kernels are templates on it).
template <class F> void dispatch_weight_type(DType t, F &&f) {
    switch (t) {
    case DType::F32: f(std::integral_constant<DType, DType::F32>{}); return;
    case DType::F16: f(std::integral_constant<DType, DType::F16>{}); return;
    case DType::BF16: f(std::integral_constant<DType, DType::BF16>{}); return;
    case DType::Q8_0: f(std::integral_constant<DType, DType::Q8_0>{}); return;
    case DType::Q4_0: f(std::integral_constant<DType, DType::Q4_0>{}); return;
    case DType::Q4_1: f(std::integral_constant<DType, DType::Q4_1>{}); return;
    case DType::Q5_0: f(std::integral_constant<DType, DType::Q5_0>{}); return;
    case DType::Q5_1: f(std::integral_constant<DType, DType::Q5_1>{}); return;
    case DType::Q2_K: f(std::integral_constant<DType, DType::Q2_K>{}); return;
    case DType::Q3_K: f(std::integral_constant<DType, DType::Q3_K>{}); return;
    case DType::Q4_K: f(std::integral_constant<DType, DType::Q4_K>{}); return;
    case DType::Q5_K: f(std::integral_constant<DType, DType::Q5_K>{}); return;
    case DType::Q6_K: f(std::integral_constant<DType, DType::Q6_K>{}); return;
    case DType::IQ4_NL: f(std::integral_constant<DType, DType::IQ4_NL>{}); return;
    case DType::IQ4_XS: f(std::integral_constant<DType, DType::IQ4_XS>{}); return;
    case DType::MXFP4: f(std::integral_constant<DType, DType::MXFP4>{}); return;
    case DType::Q8_1:
    case DType::Q8_K: break;
    }
    cuda_unsupported("q8_1 / q8_K are activation types, not weights");
}

/// Threads of a block that reduces one row of n elements (norms, softmax): enough to keep a few
/// elements per thread, never fewer than a warp.
constexpr int row_threads(int64_t n) { return n >= 4096 ? 512 : n >= 1024 ? 256 : n >= 256 ? 128 : n >= 64 ? 64 : 32; }

/// Ceiling division for launch grids.
PRESCOPE_HOST_DEVICE constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

} // namespace prescope::cuda
