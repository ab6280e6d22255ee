// AVX-512 inner loops (F, BW, VL, VNNI: Cascade Lake / Ice Lake and later; 16 F32 lanes, 32 vector
// registers), with vec-dot-x86.h's integer dot products on vpdpbusd. Compiled for that target whatever
// the build's -march; ops.cpp only calls kernels_avx512() on a CPU that reports these features.
#include "backend/cpu/kernels.h"
#include "core/dtype.h"

// GCC 12 reports the deliberately undefined source operand inside avx512fintrin.h's own inlines.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif

namespace {

/// vec-dot-x86.h's byte products with AVX-512 VNNI (256-bit form): one vpdpbusd.
struct IntVnni {
    static __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
};

} // namespace

#include "backend/cpu/vec-dot-x86.h"

namespace {

struct VecAvx512 {
    using Quant = X86Quant<IntVnni>;
    using V = __m512;
    static constexpr int N = 16;
    static constexpr int max_tokens = 8;  // 8 accumulators + weights + x in 32 zmm registers
    // Register blocks of the GEMM: 1..4 vectors of 16 tokens x 12, 8, 6, 6 rows (12 to 24 accumulators
    // of 32 zmm registers: at least 8 chains to cover the FMA latency).
    static constexpr int gemm_vecs = 4, gemm_row_pad = 24;
    static constexpr int gemm_rows[gemm_vecs] = {12, 8, 6, 6};
    static V zero() { return _mm512_setzero_ps(); }
    static V set1(float a) { return _mm512_set1_ps(a); }
    static V load(const float *p) { return _mm512_loadu_ps(p); }
    static void store(float *p, V v) { _mm512_storeu_ps(p, v); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static float reduce(V v) { return _mm512_reduce_add_ps(v); }
    static V load_f16(const uint16_t *p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
    }
    static V load_bf16(const uint16_t *p) {
        const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    }
    static V load_q8(const int8_t *p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
    }
    static float f16(uint16_t h) { return _cvtsh_ss(h); }
    /// dst[c * ldd + r] = src[r * lds + c] for r, c < 8 (unpack, shuffle, then swap 128-bit lanes).
    static void transpose8(const float *src, int64_t lds, float *dst, int64_t ldd) {
        __m256 r[8], t[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
        for (int i = 0; i < 8; i += 2) {
            t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
            t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
            r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
            r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
            r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
            r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
        }
        for (int i = 0; i < 4; ++i) {
            _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
            _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
        }
    }
    /// Scales of nb consecutive blocks: 16 at a time by a gather of the dwords at 34-byte strides
    /// (each starts with the block's F16 scale), narrowed to 16 bits and converted.
    static void q8_scales(const prescope::BlockQ8_0 *blk, int64_t nb, float *out) {
        const __m512i offsets = _mm512_setr_epi32(0, 34, 68, 102, 136, 170, 204, 238, 272, 306, 340, 374, 408, 442,
                                                  476, 510);
        static_assert(sizeof(prescope::BlockQ8_0) == 34);
        int64_t b = 0;
        for (; b + 16 <= nb; b += 16) {
            const __m512i g = _mm512_i32gather_epi32(offsets, static_cast<const void *>(blk + b), 1);
            _mm512_storeu_ps(out + b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
        }
        for (; b < nb; ++b) out[b] = f16(blk[b].d);
    }
};

} // namespace

#include "backend/cpu/kernels-impl.h"

namespace prescope::cpu {

const KernelTable &kernels_avx512() {
    static const KernelTable table = make_kernel_table<VecAvx512>();
    return table;
}

} // namespace prescope::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
