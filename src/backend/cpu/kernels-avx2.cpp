// AVX2 + FMA + F16C inner loops (Haswell and later), with vec-dot-x86.h's integer dot products. Compiled
// for that target whatever the build's -march; ops.cpp only calls kernels_avx2() on a CPU that reports
// these features.
#include "backend/cpu/kernels.h"
#include "core/dtype.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace {

/// vec-dot-x86.h's byte products without VNNI: vpmaddubsw pairs, then vpmaddwd by 1.
struct IntAvx2 {
    static __m256i dot_u8s8(__m256i u, __m256i s) {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
    }
};

} // namespace

#include "backend/cpu/vec-dot-x86.h"

namespace {

struct VecAvx2 {
    using Quant = X86Quant<IntAvx2>;
    using V = __m256;
    static constexpr int N = 8;
    static constexpr int max_tokens = 4;  // 4 accumulators + weights + x in 16 ymm registers
    // Register blocks of the GEMM: 1..2 vectors of 8 tokens x 8, 6 rows (8 or 12 of 16 ymm registers).
    static constexpr int gemm_vecs = 2, gemm_row_pad = 24;
    static constexpr int gemm_rows[gemm_vecs] = {8, 6};
    static V zero() { return _mm256_setzero_ps(); }
    static V set1(float a) { return _mm256_set1_ps(a); }
    static V load(const float *p) { return _mm256_loadu_ps(p); }
    static void store(float *p, V v) { _mm256_storeu_ps(p, v); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static float reduce(V v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static V load_f16(const uint16_t *p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    }
    static V load_bf16(const uint16_t *p) {
        const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    }
    static V load_q8(const int8_t *p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
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
    static void q8_scales(const prescope::BlockQ8_0 *blk, int64_t nb, float *out) {
        for (int64_t b = 0; b < nb; ++b) out[b] = f16(blk[b].d);
    }
};

} // namespace

#include "backend/cpu/kernels-impl.h"

namespace prescope::cpu {

const KernelTable &kernels_avx2() {
    static const KernelTable table = make_kernel_table<VecAvx2>();
    return table;
}

} // namespace prescope::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
