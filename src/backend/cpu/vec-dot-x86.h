// x86 integer dot products of quantized weight rows with activations quantized to their vec-dot type
// (core/dtype.h vec_dot_type), and the activation quantizers, on 256-bit vectors. The technique is
// ggml-cpu's (arch/x86/quants.c): weights unpacked to bytes, u8 x s8 products summed in pairs by
// vpmaddubsw (never saturating here: |u8| <= 128 and |s8| <= 127 give at most 32512), weighted by the
// 16-bit group scales with vpmaddwd, integer sums per super-block, F32 across blocks.
//
// Include from kernels-avx2.cpp / kernels-avx512.cpp inside their target region, after defining I:
// I::dot_u8s8(u, s) = 8 int32 lanes, each the sum of 4 adjacent products u[k] * s[k] (u unsigned, s
// signed bytes): vpmaddubsw + vpmaddwd on AVX2, vpdpbusd with VNNI.
#pragma once

#include "core/dtype.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using namespace prescope;

inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

inline float f16(uint16_t h) { return _cvtsh_ss(h); }

inline __m256i load256(const void *p) { return _mm256_loadu_si256(static_cast<const __m256i *>(p)); }

/// The 32 nibbles of 16 bytes in a 32-block's weight order: low nibbles in bytes 0-15, high in 16-31.
inline __m256i nibbles32(const uint8_t *p) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

/// The bits of a little-endian u32 as 32 bytes: byte j is 0xFF where bit j is set, else 0.
inline __m256i bits32(const uint8_t *p) {
    uint32_t u;
    std::memcpy(&u, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(int(u)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    const __m256i probe = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(probe, _mm256_set1_epi64x(-1));
}

/// A 16-entry int8 code book in both 128-bit lanes, for vpshufb lookups of nibbles.
inline __m256i code_book(const int8_t *values) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(values)));
}

/// Broadcasts 16-bit lane g (0..7) of each 128-bit half to all lanes of that half.
inline __m256i broadcast_i16(__m256i v, int g) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16(short(0x0100 + 0x0202 * g)));
}

/// 16 int16 lanes: lanes 0-7 = s[a], lanes 8-15 = s[a + 1] (the scales of two groups of 16), from 16
/// signed (or, with unsigned_scales, unsigned) bytes s.
inline __m256i pair_scales(__m128i s, int a, bool unsigned_scales) {
    const __m128i pick = _mm_shuffle_epi8(
        s, _mm_set_epi64x(int64_t(0x0101010101010101ull * uint64_t(a + 1)), int64_t(0x0101010101010101ull * uint64_t(a))));
    return unsigned_scales ? _mm256_cvtepu8_epi16(pick) : _mm256_cvtepi8_epi16(pick);
}

/// roundf of each lane (half away from zero), exact for |v| < 2^23.
inline __m256 round_half_away(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 sign = _mm256_and_ps(v, _mm256_set1_ps(-0.0f));
    const __m256 frac = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(v, t));
    const __m256 step = _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ),
                                      _mm256_or_ps(sign, _mm256_set1_ps(1.0f)));
    return _mm256_add_ps(t, step);
}

/// 32 int32 values (within int8 range) as 32 bytes in order.
inline __m256i pack_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline float abs_max(const float *x, int64_t n) {
    __m256 m = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(x + j)));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Weights of one 32-block as 32 bytes in element order (signed; unsigned for Q4_1 / Q5_1) and its scale.
struct UnpackQ8_0 {
    static __m256i q(const BlockQ8_0 &b) { return load256(b.qs); }
    static float d(const BlockQ8_0 &b) { return f16(b.d); }
};
struct UnpackQ4_0 {
    static __m256i q(const BlockQ4_0 &b) { return _mm256_sub_epi8(nibbles32(b.qs), _mm256_set1_epi8(8)); }
    static float d(const BlockQ4_0 &b) { return f16(b.d); }
};
struct UnpackQ5_0 {
    // q - 16: the nibble where bit 4 is set, the nibble | 0xF0 (= nibble - 16) where it is clear.
    static __m256i q(const BlockQ5_0 &b) {
        return _mm256_or_si256(nibbles32(b.qs), _mm256_andnot_si256(bits32(b.qh), _mm256_set1_epi8(char(0xF0))));
    }
    static float d(const BlockQ5_0 &b) { return f16(b.d); }
};
struct UnpackIQ4_NL {
    static __m256i q(const BlockIQ4_NL &b) { return _mm256_shuffle_epi8(code_book(kIq4nlValues), nibbles32(b.qs)); }
    static float d(const BlockIQ4_NL &b) { return f16(b.d); }
};
struct UnpackMXFP4 {
    static __m256i q(const BlockMXFP4 &b) { return _mm256_shuffle_epi8(code_book(kMxfp4Values), nibbles32(b.qs)); }
    static float d(const BlockMXFP4 &b) { return e8m0_to_fp32_half(b.e); }
};
struct UnpackQ4_1 {
    static __m256i q(const BlockQ4_1 &b) { return nibbles32(b.qs); }
};
struct UnpackQ5_1 {
    static __m256i q(const BlockQ5_1 &b) {
        return _mm256_or_si256(nibbles32(b.qs), _mm256_and_si256(bits32(b.qh), _mm256_set1_epi8(0x10)));
    }
};

template <class I> struct X86Quant {
    /// 8 int32 lanes of sums of 4 signed x signed byte products (the sign moved onto y).
    static __m256i dot_s8s8(__m256i x, __m256i y) { return I::dot_u8s8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x)); }

    // ---- activation quantizers (bit for bit core/dtype.h's references) ----

    /// One block of 32 (Q8_0 / Q8_1): the quants at qs, their sum; returns the F32 scale amax / 127.
    static float quantize_32(const float *x, int8_t *qs, int32_t &sum) {
        const float d = abs_max(x, 32) / 127.0f;
        const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m256i q[4];
        for (int k = 0; k < 4; ++k)
            q[k] = _mm256_cvtps_epi32(round_half_away(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), id)));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(qs), pack_i8(q[0], q[1], q[2], q[3]));
        sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        return d;
    }
    static void quantize_q8_0(const float *x, void *dst, int64_t n) {
        auto *b = static_cast<BlockQ8_0 *>(dst);
        int32_t sum;
        for (int64_t i = 0; i < n / QK8_0; ++i) b[i].d = fp32_to_fp16(quantize_32(x + i * QK8_0, b[i].qs, sum));
    }
    static void quantize_q8_1(const float *x, void *dst, int64_t n) {
        auto *b = static_cast<BlockQ8_1 *>(dst);
        int32_t sum;
        for (int64_t i = 0; i < n / QK8_1; ++i) {
            const float d = quantize_32(x + i * QK8_1, b[i].qs, sum);
            b[i].d = fp32_to_fp16(d);
            b[i].s = fp32_to_fp16(float(sum) * d);
        }
    }
    static void quantize_q8_K(const float *x, void *dst, int64_t n) {
        auto *b = static_cast<BlockQ8_K *>(dst);
        for (int64_t i = 0; i < n / QK_K; ++i, x += QK_K) {
            const float amax = abs_max(x, QK_K);
            if (amax == 0.0f) {
                b[i] = BlockQ8_K{};
                continue;
            }
            int64_t j = 0;
            while (std::fabs(x[j]) != amax) ++j;  // the first element of largest magnitude, as ggml
            const float iscale = -127.0f / x[j];
            const __m256 s = _mm256_set1_ps(iscale);
            const __m256i top = _mm256_set1_epi32(127);
            for (int k = 0; k < QK_K; k += 32) {
                __m256i q[4];
                // vcvtps2dq rounds half to even (MXCSR default), as nearest_int's magic-number add does.
                for (int u = 0; u < 4; ++u)
                    q[u] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(s, _mm256_loadu_ps(x + k + 8 * u))), top);
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(b[i].qs + k), pack_i8(q[0], q[1], q[2], q[3]));
            }
            for (int g = 0; g < QK_K / 16; ++g) {
                const __m128i q16 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b[i].qs + 16 * g));
                b[i].bsums[g] = int16_t(hsum_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(q16), _mm256_set1_epi16(1))));
            }
            b[i].d = 1.0f / iscale;
        }
    }

    // ---- dot products: one weight row against T tokens' activations (a[t], t < T); the weights are
    // unpacked once per block for all T ----

    /// Up to this many tokens per weight unpack (qgemv).
    static constexpr int kMaxTokens = 4;

    /// Types with one scale per 32-block against Q8_0; U::q(block): the weights as 32 signed bytes,
    /// U::d(block): the block's F32 scale.
    template <class U, int T, class B> static void dot_blocks32(int64_t n, const B *x, const BlockQ8_0 *const *y, float *out) {
        const int64_t nb = n / 32;
        if constexpr (T == 1) {
            // One token: two accumulator chains over alternate blocks.
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            const BlockQ8_0 *y0 = y[0];
            int64_t i = 0;
            for (; i + 2 <= nb; i += 2) {
                const __m256i p0 = dot_s8s8(U::q(x[i]), load256(y0[i].qs));
                const __m256i p1 = dot_s8s8(U::q(x[i + 1]), load256(y0[i + 1].qs));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(U::d(x[i]) * f16(y0[i].d)), _mm256_cvtepi32_ps(p0), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(U::d(x[i + 1]) * f16(y0[i + 1].d)), _mm256_cvtepi32_ps(p1), acc1);
            }
            if (i < nb) {
                const __m256i p0 = dot_s8s8(U::q(x[i]), load256(y0[i].qs));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(U::d(x[i]) * f16(y0[i].d)), _mm256_cvtepi32_ps(p0), acc0);
            }
            out[0] = hsum_ps(_mm256_add_ps(acc0, acc1));
        } else {
            __m256 acc[T];
            for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
            for (int64_t i = 0; i < nb; ++i) {
                const __m256i q = U::q(x[i]), aq = _mm256_sign_epi8(q, q);
                const float dx = U::d(x[i]);
#pragma GCC unroll 4
                for (int t = 0; t < T; ++t) {
                    const __m256i p = I::dot_u8s8(aq, _mm256_sign_epi8(load256(y[t][i].qs), q));
                    acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dx * f16(y[t][i].d)), _mm256_cvtepi32_ps(p), acc[t]);
                }
            }
            for (int t = 0; t < T; ++t) out[t] = hsum_ps(acc[t]);
        }
    }

    /// Q4_1 / Q5_1 against Q8_1: U::q(block) the unsigned weights; d_x d_y sum(q y) + m_x s_y.
    template <class U, int T, class B> static void dot_blocks32_min(int64_t n, const B *x, const BlockQ8_1 *const *y, float *out) {
        __m256 acc[T];
        float mins[T];
        for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps(), mins[t] = 0.0f;
        for (int64_t i = 0; i < n / 32; ++i) {
            const __m256i q = U::q(x[i]);
            const float dx = f16(x[i].d), mx = f16(x[i].m);
#pragma GCC unroll 4
            for (int t = 0; t < T; ++t) {
                const __m256i p = I::dot_u8s8(q, load256(y[t][i].qs));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dx * f16(y[t][i].d)), _mm256_cvtepi32_ps(p), acc[t]);
                mins[t] += mx * f16(y[t][i].s);
            }
        }
        for (int t = 0; t < T; ++t) out[t] = hsum_ps(acc[t]) + mins[t];
    }

    /// Q4_K / Q5_K against Q8_K: 8 groups of 32 with 6-bit scales and mins (the min term through bsums).
    template <int T, class B> static void dot_k4(int64_t n, const B *x, const BlockQ8_K *const *y, float *out) {
        constexpr bool kFiveBits = requires { x->qh; };
        const __m256i m4 = _mm256_set1_epi8(0x0F), m1 = _mm256_set1_epi8(1);
        __m256 acc[T];
        __m128 acc_m[T];
        for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps(), acc_m[t] = _mm_setzero_ps();
        for (int64_t i = 0; i < n / QK_K; ++i) {
            // The 12 packed bytes as 8 scales then 8 mins (get_scale_min_k4 for all groups at once).
            uint32_t u[4];
            std::memcpy(u, x[i].scales, 12);
            constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
            u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
            const uint32_t mins_lo = u[1] & kmask1;
            u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
            u[2] = mins_lo;
            u[0] &= kmask1;
            const __m256i sm = _mm256_cvtepu8_epi16(_mm_set_epi32(int(u[3]), int(u[2]), int(u[1]), int(u[0])));
            const __m128i mins = _mm256_extracti128_si256(sm, 1), sc128 = _mm256_castsi256_si128(sm);
            const __m256i scales = _mm256_set_m128i(sc128, sc128);
            const float dx = f16(x[i].d), dmx = f16(x[i].dmin);
            for (int t = 0; t < T; ++t) {
                const __m256i bsums = load256(y[t][i].bsums);
                const __m128i gsums = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
                acc_m[t] = _mm_fmadd_ps(_mm_set1_ps(-y[t][i].d * dmx), _mm_cvtepi32_ps(_mm_madd_epi16(mins, gsums)),
                                        acc_m[t]);
            }
            __m256i hbits = _mm256_setzero_si256();
            if constexpr (kFiveBits) hbits = load256(x[i].qh);
            __m256i sumi[T];
            for (int t = 0; t < T; ++t) sumi[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                const __m256i qbits = load256(x[i].qs + 32 * j);
                __m256i ql = _mm256_and_si256(qbits, m4), qh = _mm256_and_si256(_mm256_srli_epi16(qbits, 4), m4);
                if constexpr (kFiveBits) {
                    ql = _mm256_or_si256(ql, _mm256_slli_epi16(_mm256_and_si256(hbits, m1), 4));
                    qh = _mm256_or_si256(qh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 1), m1), 4));
                    hbits = _mm256_srli_epi16(hbits, 2);
                }
                const __m256i sl = broadcast_i16(scales, 2 * j), sh = broadcast_i16(scales, 2 * j + 1);
#pragma GCC unroll 4
                for (int t = 0; t < T; ++t) {
                    const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(ql, load256(y[t][i].qs + 64 * j)));
                    const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(qh, load256(y[t][i].qs + 64 * j + 32)));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(pl, ph));
                }
            }
            for (int t = 0; t < T; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * dx), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < T; ++t) {
            __m128 m = _mm_add_ps(acc_m[t], _mm_movehl_ps(acc_m[t], acc_m[t]));
            m = _mm_add_ss(m, _mm_movehdup_ps(m));
            out[t] = hsum_ps(acc[t]) + _mm_cvtss_f32(m);
        }
    }

    template <int T> static void dot_q6_k(int64_t n, const BlockQ6_K *x, const BlockQ8_K *const *y, float *out) {
        const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
        __m256 acc[T];
        for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n / QK_K; ++i) {
            const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i *>(x[i].scales));
            __m256i sumi[T];
            for (int t = 0; t < T; ++t) sumi[t] = _mm256_setzero_si256();
            for (int half = 0; half < 2; ++half) {
                const __m256i lo = load256(x[i].ql + 64 * half), hi = load256(x[i].ql + 64 * half + 32);
                const __m256i hb = load256(x[i].qh + 32 * half);
                // Chunk k of 32 weights: nibble (low of lo, low of hi, high of lo, high of hi) | 2 bits of hb << 4.
                const __m256i q[4] = {
                    _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4)),
                    _mm256_or_si256(_mm256_and_si256(hi, m4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(hi, 4), m4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4)),
                };
#pragma GCC unroll 4
                for (int k = 0; k < 4; ++k) {
                    const __m256i sc = pair_scales(scales, 8 * half + 2 * k, false);
#pragma GCC unroll 4
                    for (int t = 0; t < T; ++t) {
                        const __m256i a = load256(y[t][i].qs + 128 * half + 32 * k);
                        // (q - 32) . a = q . a - 32 * sum(a), both in int16 pairs.
                        const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q[k], a), _mm256_maddubs_epi16(m32, a));
                        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(sc, p));
                    }
                }
            }
            const float dx = f16(x[i].d);
            for (int t = 0; t < T; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * dx), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < T; ++t) out[t] = hsum_ps(acc[t]);
    }

    template <int T> static void dot_q3_k(int64_t n, const BlockQ3_K *x, const BlockQ8_K *const *y, float *out) {
        const __m256i m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
        __m256 acc[T];
        for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n / QK_K; ++i) {
            int8_t s6[16];
            q3k_scales(x[i].scales, s6);
            const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i *>(s6));
            __m256i hbits = load256(x[i].hmask);
            __m256i sumi[T];
            for (int t = 0; t < T; ++t) sumi[t] = _mm256_setzero_si256();
            for (int half = 0; half < 2; ++half) {
                const __m256i qbits = load256(x[i].qs + 32 * half);
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) {
                    const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(qbits, 2 * j), m3);
                    // q = q2 - 4 where the high bit is clear: q . a = q2 . a - (4 * !hbit) . a.
                    const __m256i sub4 = _mm256_slli_epi16(_mm256_andnot_si256(hbits, m1), 2);
                    hbits = _mm256_srli_epi16(hbits, 1);
                    const __m256i sc = pair_scales(scales, 8 * half + 2 * j, false);
#pragma GCC unroll 4
                    for (int t = 0; t < T; ++t) {
                        const __m256i a = load256(y[t][i].qs + 128 * half + 32 * j);
                        const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q2, a), _mm256_maddubs_epi16(sub4, a));
                        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(sc, p));
                    }
                }
            }
            const float dx = f16(x[i].d);
            for (int t = 0; t < T; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * dx), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < T; ++t) out[t] = hsum_ps(acc[t]);
    }

    template <int T> static void dot_q2_k(int64_t n, const BlockQ2_K *x, const BlockQ8_K *const *y, float *out) {
        const __m256i m3 = _mm256_set1_epi8(3);
        const __m128i m4 = _mm_set1_epi8(0x0F);
        __m256 acc[T], acc_m[T];
        for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps(), acc_m[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n / QK_K; ++i) {
            const float dx = f16(x[i].d), dmx = f16(x[i].dmin);
            const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i *>(x[i].scales));
            const __m128i scales = _mm_and_si128(packed, m4);
            const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), m4));
            for (int t = 0; t < T; ++t) {
                acc_m[t] = _mm256_fmadd_ps(_mm256_set1_ps(-y[t][i].d * dmx),
                                           _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, load256(y[t][i].bsums))), acc_m[t]);
            }
            __m256i sumi[T];
            for (int t = 0; t < T; ++t) sumi[t] = _mm256_setzero_si256();
            for (int half = 0; half < 2; ++half) {
                const __m256i qbits = load256(x[i].qs + 32 * half);
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) {
                    const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(qbits, 2 * j), m3);
                    const __m256i sc = pair_scales(scales, 8 * half + 2 * j, true);
#pragma GCC unroll 4
                    for (int t = 0; t < T; ++t) {
                        const __m256i p = _mm256_maddubs_epi16(q2, load256(y[t][i].qs + 128 * half + 32 * j));
                        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(sc, p));
                    }
                }
            }
            for (int t = 0; t < T; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * dx), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < T; ++t) out[t] = hsum_ps(acc[t]) + hsum_ps(acc_m[t]);
    }

    template <int T> static void dot_iq4_xs(int64_t n, const BlockIQ4_XS *x, const BlockQ8_K *const *y, float *out) {
        const __m256i book = code_book(kIq4nlValues);
        __m256 acc[T];
        for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n / QK_K; ++i) {
            __m256i sumi[T];
            for (int t = 0; t < T; ++t) sumi[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int g = 0; g < 8; ++g) {
                const int ls = (((x[i].scales_l[g / 2] >> 4 * (g % 2)) & 0xF) | (((x[i].scales_h >> 2 * g) & 3) << 4)) - 32;
                const __m256i q = _mm256_shuffle_epi8(book, nibbles32(x[i].qs + 16 * g)), aq = _mm256_sign_epi8(q, q);
                const __m256i sc = _mm256_set1_epi16(short(ls));
#pragma GCC unroll 4
                for (int t = 0; t < T; ++t) {
                    const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(load256(y[t][i].qs + 32 * g), q));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(sc, p));
                }
            }
            const float dx = f16(x[i].d);
            for (int t = 0; t < T; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * dx), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < T; ++t) out[t] = hsum_ps(acc[t]);
    }

    // ---- dequantization for the GEMM tiles: the reference's F32 operations (float(q) * d, then - m or
    // + m, never fused), so the results are bit for bit dequantize_row's ----

    /// y[j] = float(q[j]) * d - m (kAdd: + m) for j < 8k, q the 8k bytes at p (signed or unsigned).
    template <bool kSigned, bool kAdd = false>
    static void emit(const uint8_t *p, int count, float d, float m, float *y) {
        const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
        for (int j = 0; j < count; j += 8) {
            const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p + j));
            const __m256 q = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
            const __m256 v = _mm256_mul_ps(q, vd);
            _mm256_storeu_ps(y + j, kAdd ? _mm256_add_ps(v, vm) : _mm256_sub_ps(v, vm));
        }
    }
    static void store32(uint8_t *buf, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i *>(buf), v); }

    template <DType D> static void dequant_row(const void *w, float *y, int64_t n) {
        alignas(32) uint8_t q[32];
        if constexpr (D == DType::Q4_0 || D == DType::Q5_0 || D == DType::IQ4_NL || D == DType::MXFP4) {
            using B = std::conditional_t<D == DType::Q4_0, BlockQ4_0,
                      std::conditional_t<D == DType::Q5_0, BlockQ5_0,
                      std::conditional_t<D == DType::IQ4_NL, BlockIQ4_NL, BlockMXFP4>>>;
            using U = std::conditional_t<D == DType::Q4_0, UnpackQ4_0,
                      std::conditional_t<D == DType::Q5_0, UnpackQ5_0,
                      std::conditional_t<D == DType::IQ4_NL, UnpackIQ4_NL, UnpackMXFP4>>>;
            const auto *x = static_cast<const B *>(w);
            for (int64_t i = 0; i < n / 32; ++i, y += 32) {
                store32(q, U::q(x[i]));
                emit<true>(q, 32, U::d(x[i]), 0.0f, y);
            }
        } else if constexpr (D == DType::Q4_1 || D == DType::Q5_1) {
            using B = std::conditional_t<D == DType::Q4_1, BlockQ4_1, BlockQ5_1>;
            using U = std::conditional_t<D == DType::Q4_1, UnpackQ4_1, UnpackQ5_1>;
            const auto *x = static_cast<const B *>(w);
            for (int64_t i = 0; i < n / 32; ++i, y += 32) {
                store32(q, U::q(x[i]));
                emit<false, true>(q, 32, f16(x[i].d), f16(x[i].m), y);
            }
        } else if constexpr (D == DType::Q4_K || D == DType::Q5_K) {
            using B = std::conditional_t<D == DType::Q4_K, BlockQ4_K, BlockQ5_K>;
            const auto *x = static_cast<const B *>(w);
            const __m256i m4 = _mm256_set1_epi8(0x0F), m1 = _mm256_set1_epi8(1);
            for (int64_t i = 0; i < n / QK_K; ++i) {
                const float d = f16(x[i].d), dmin = f16(x[i].dmin);
                __m256i hbits = _mm256_setzero_si256();
                if constexpr (D == DType::Q5_K) hbits = load256(x[i].qh);
                for (int j = 0; j < 4; ++j) {
                    const __m256i qbits = load256(x[i].qs + 32 * j);
                    __m256i ql = _mm256_and_si256(qbits, m4), qh = _mm256_and_si256(_mm256_srli_epi16(qbits, 4), m4);
                    if constexpr (D == DType::Q5_K) {
                        ql = _mm256_or_si256(ql, _mm256_slli_epi16(_mm256_and_si256(hbits, m1), 4));
                        qh = _mm256_or_si256(qh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 1), m1), 4));
                        hbits = _mm256_srli_epi16(hbits, 2);
                    }
                    for (int h = 0; h < 2; ++h, y += 32) {
                        uint8_t sc, m;
                        k4_scale_min(2 * j + h, x[i].scales, sc, m);
                        store32(q, h == 0 ? ql : qh);
                        emit<false>(q, 32, d * float(sc), dmin * float(m), y);
                    }
                }
            }
        } else if constexpr (D == DType::Q6_K) {
            const auto *x = static_cast<const BlockQ6_K *>(w);
            const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
            for (int64_t i = 0; i < n / QK_K; ++i) {
                const float d = f16(x[i].d);
                for (int half = 0; half < 2; ++half) {
                    const __m256i lo = load256(x[i].ql + 64 * half), hi = load256(x[i].ql + 64 * half + 32);
                    const __m256i hb = load256(x[i].qh + 32 * half);
                    const __m256i qk[4] = {
                        _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4)),
                        _mm256_or_si256(_mm256_and_si256(hi, m4),
                                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m4),
                                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(hi, 4), m4),
                                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4)),
                    };
                    for (int k = 0; k < 4; ++k, y += 32) {
                        store32(q, _mm256_sub_epi8(qk[k], m32));
                        const int g = 8 * half + 2 * k;
                        emit<true>(q, 16, d * float(x[i].scales[g]), 0.0f, y);
                        emit<true>(q + 16, 16, d * float(x[i].scales[g + 1]), 0.0f, y + 16);
                    }
                }
            }
        } else if constexpr (D == DType::Q3_K || D == DType::Q2_K) {
            using B = std::conditional_t<D == DType::Q3_K, BlockQ3_K, BlockQ2_K>;
            const auto *x = static_cast<const B *>(w);
            const __m256i m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
            for (int64_t i = 0; i < n / QK_K; ++i) {
                const float d = f16(x[i].d);
                int8_t s6[16];
                __m256i hbits = _mm256_setzero_si256();
                if constexpr (D == DType::Q3_K) {
                    q3k_scales(x[i].scales, s6);
                    hbits = load256(x[i].hmask);
                }
                for (int half = 0; half < 2; ++half) {
                    const __m256i qbits = load256(x[i].qs + 32 * half);
                    for (int j = 0; j < 4; ++j, y += 32) {
                        __m256i v = _mm256_and_si256(_mm256_srli_epi16(qbits, 2 * j), m3);
                        const int g = 8 * half + 2 * j;
                        if constexpr (D == DType::Q3_K) {
                            v = _mm256_sub_epi8(v, _mm256_slli_epi16(_mm256_andnot_si256(hbits, m1), 2));
                            hbits = _mm256_srli_epi16(hbits, 1);
                            store32(q, v);
                            emit<true>(q, 16, d * float(s6[g]), 0.0f, y);
                            emit<true>(q + 16, 16, d * float(s6[g + 1]), 0.0f, y + 16);
                        } else {
                            store32(q, v);
                            const float dmin = f16(x[i].dmin);
                            for (int p = 0; p < 2; ++p) {
                                const uint8_t sc = x[i].scales[g + p];
                                emit<false>(q + 16 * p, 16, d * float(sc & 0xF), dmin * float(sc >> 4), y + 16 * p);
                            }
                        }
                    }
                }
            }
        } else {
            static_assert(D == DType::IQ4_XS);
            const auto *x = static_cast<const BlockIQ4_XS *>(w);
            const __m256i book = code_book(kIq4nlValues);
            for (int64_t i = 0; i < n / QK_K; ++i) {
                const float d = f16(x[i].d);
                for (int g = 0; g < 8; ++g, y += 32) {
                    const int ls = ((x[i].scales_l[g / 2] >> 4 * (g % 2)) & 0xF) | (((x[i].scales_h >> 2 * g) & 3) << 4);
                    store32(q, _mm256_shuffle_epi8(book, nibbles32(x[i].qs + 16 * g)));
                    emit<true>(q, 32, d * float(ls - 32), 0.0f, y);
                }
            }
        }
    }

    /// out[t] = dot(weight row w of type D, activations a[t] of vec_dot_type(D)) for t < T, n elements.
    template <DType D, int T> static void dot(int64_t n, const void *w, const void *const *a, float *out) {
        const auto *a0 = reinterpret_cast<const BlockQ8_0 *const *>(a);
        const auto *a1 = reinterpret_cast<const BlockQ8_1 *const *>(a);
        const auto *ak = reinterpret_cast<const BlockQ8_K *const *>(a);
        if constexpr (D == DType::Q8_0) {
            dot_blocks32<UnpackQ8_0, T>(n, static_cast<const BlockQ8_0 *>(w), a0, out);
        } else if constexpr (D == DType::Q4_0) {
            dot_blocks32<UnpackQ4_0, T>(n, static_cast<const BlockQ4_0 *>(w), a0, out);
        } else if constexpr (D == DType::Q5_0) {
            dot_blocks32<UnpackQ5_0, T>(n, static_cast<const BlockQ5_0 *>(w), a0, out);
        } else if constexpr (D == DType::IQ4_NL) {
            dot_blocks32<UnpackIQ4_NL, T>(n, static_cast<const BlockIQ4_NL *>(w), a0, out);
        } else if constexpr (D == DType::MXFP4) {
            dot_blocks32<UnpackMXFP4, T>(n, static_cast<const BlockMXFP4 *>(w), a0, out);
        } else if constexpr (D == DType::Q4_1) {
            dot_blocks32_min<UnpackQ4_1, T>(n, static_cast<const BlockQ4_1 *>(w), a1, out);
        } else if constexpr (D == DType::Q5_1) {
            dot_blocks32_min<UnpackQ5_1, T>(n, static_cast<const BlockQ5_1 *>(w), a1, out);
        } else if constexpr (D == DType::Q4_K) {
            dot_k4<T>(n, static_cast<const BlockQ4_K *>(w), ak, out);
        } else if constexpr (D == DType::Q5_K) {
            dot_k4<T>(n, static_cast<const BlockQ5_K *>(w), ak, out);
        } else if constexpr (D == DType::Q6_K) {
            dot_q6_k<T>(n, static_cast<const BlockQ6_K *>(w), ak, out);
        } else if constexpr (D == DType::Q3_K) {
            dot_q3_k<T>(n, static_cast<const BlockQ3_K *>(w), ak, out);
        } else if constexpr (D == DType::Q2_K) {
            dot_q2_k<T>(n, static_cast<const BlockQ2_K *>(w), ak, out);
        } else {
            static_assert(D == DType::IQ4_XS);
            dot_iq4_xs<T>(n, static_cast<const BlockIQ4_XS *>(w), ak, out);
        }
    }
};

} // namespace
