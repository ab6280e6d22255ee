// Portable integer dot products of a quantized weight row with activations quantized to its vec-dot
// type (core/dtype.h vec_dot_type): the semantics of ggml-cpu's ggml_vec_dot_<type>_<vec_dot_type>
// (quants.c, generic versions): exact integer sums inside each block or group, their scales applied in
// F32. Included by kernels-scalar.cpp only.
#pragma once

#include "core/dtype.h"

#include <cstdint>
#include <cstring>

namespace {

using namespace prescope;

/// Integer sum of n products a[i] * b[i].
inline int32_t idot(const int8_t *a, const int8_t *b, int n) {
    int32_t s = 0;
    for (int i = 0; i < n; ++i) s += int32_t(a[i]) * int32_t(b[i]);
    return s;
}

/// The 32 integer weights of a 32-block: nibbles (low = weights 0-15, high = 16-31), an optional fifth
/// bit from qh, minus `offset`; or looked up in a code book.
inline void unpack_nibbles(const uint8_t *qs, const uint8_t *qh, int offset, int8_t q[32]) {
    uint32_t h = 0;
    if (qh) std::memcpy(&h, qh, 4);
    for (int j = 0; j < 16; ++j) {
        q[j] = int8_t(((qs[j] & 0xF) | (((h >> j) & 1) << 4)) - offset);
        q[j + 16] = int8_t(((qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4)) - offset);
    }
}

inline void unpack_table(const uint8_t *qs, const int8_t *table, int8_t q[32]) {
    for (int j = 0; j < 16; ++j) {
        q[j] = table[qs[j] & 0xF];
        q[j + 16] = table[qs[j] >> 4];
    }
}

struct ScalarQuant {
    static void quantize_q8_0(const float *x, void *dst, int64_t n) {
        quantize_row_q8_0(x, static_cast<BlockQ8_0 *>(dst), n);
    }
    static void quantize_q8_1(const float *x, void *dst, int64_t n) {
        quantize_row_q8_1(x, static_cast<BlockQ8_1 *>(dst), n);
    }
    static void quantize_q8_K(const float *x, void *dst, int64_t n) {
        quantize_row_q8_K(x, static_cast<BlockQ8_K *>(dst), n);
    }

    /// Row w of type D as F32: the reference.
    template <DType D> static void dequant_row(const void *w, float *y, int64_t n) { dequantize_row(D, w, y, n); }

    /// Tokens per call of dot() (qgemv): one, the portable code gains nothing from sharing the unpack.
    static constexpr int kMaxTokens = 1;
    /// out[t] = dot(weight row w of type D, activations a[t] of vec_dot_type(D)), n elements, t < T.
    template <DType D, int T> static void dot(int64_t n, const void *w, const void *const *a, float *out) {
        for (int t = 0; t < T; ++t) out[t] = dot1<D>(n, w, a[t]);
    }
    /// One token.
    template <DType D> static float dot1(int64_t n, const void *w, const void *a);
};

template <> inline float ScalarQuant::dot1<DType::Q8_0>(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const BlockQ8_0 *>(w);
    const auto *y = static_cast<const BlockQ8_0 *>(a);
    float s = 0.0f;
    for (int64_t i = 0; i < n / QK8_0; ++i)
        s += float(idot(x[i].qs, y[i].qs, 32)) * (fp16_to_fp32(x[i].d) * fp16_to_fp32(y[i].d));
    return s;
}

template <> inline float ScalarQuant::dot1<DType::Q4_0>(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const BlockQ4_0 *>(w);
    const auto *y = static_cast<const BlockQ8_0 *>(a);
    float s = 0.0f;
    int8_t q[32];
    for (int64_t i = 0; i < n / QK4_0; ++i) {
        unpack_nibbles(x[i].qs, nullptr, 8, q);
        s += float(idot(q, y[i].qs, 32)) * (fp16_to_fp32(x[i].d) * fp16_to_fp32(y[i].d));
    }
    return s;
}

template <> inline float ScalarQuant::dot1<DType::Q5_0>(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const BlockQ5_0 *>(w);
    const auto *y = static_cast<const BlockQ8_0 *>(a);
    float s = 0.0f;
    int8_t q[32];
    for (int64_t i = 0; i < n / QK5_0; ++i) {
        unpack_nibbles(x[i].qs, x[i].qh, 16, q);
        s += float(idot(q, y[i].qs, 32)) * (fp16_to_fp32(x[i].d) * fp16_to_fp32(y[i].d));
    }
    return s;
}

/// Q4_1 / Q5_1 (qh == nullptr for Q4_1): d_x d_y sum(q y) + m_x s_y.
template <class B> float dot_q_1(int64_t n, const B *x, const BlockQ8_1 *y) {
    float s = 0.0f;
    int8_t q[32];
    for (int64_t i = 0; i < n / 32; ++i) {
        const uint8_t *qh = nullptr;
        if constexpr (requires { x[i].qh; }) qh = x[i].qh;
        unpack_nibbles(x[i].qs, qh, 0, q);
        s += (fp16_to_fp32(x[i].d) * fp16_to_fp32(y[i].d)) * float(idot(q, y[i].qs, 32)) +
             fp16_to_fp32(x[i].m) * fp16_to_fp32(y[i].s);
    }
    return s;
}

template <> inline float ScalarQuant::dot1<DType::Q4_1>(int64_t n, const void *w, const void *a) {
    return dot_q_1(n, static_cast<const BlockQ4_1 *>(w), static_cast<const BlockQ8_1 *>(a));
}

template <> inline float ScalarQuant::dot1<DType::Q5_1>(int64_t n, const void *w, const void *a) {
    return dot_q_1(n, static_cast<const BlockQ5_1 *>(w), static_cast<const BlockQ8_1 *>(a));
}

template <> inline float ScalarQuant::dot1<DType::IQ4_NL>(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const BlockIQ4_NL *>(w);
    const auto *y = static_cast<const BlockQ8_0 *>(a);
    float s = 0.0f;
    int8_t q[32];
    for (int64_t i = 0; i < n / QK4_NL; ++i) {
        unpack_table(x[i].qs, kIq4nlValues, q);
        s += float(idot(q, y[i].qs, 32)) * (fp16_to_fp32(x[i].d) * fp16_to_fp32(y[i].d));
    }
    return s;
}

template <> inline float ScalarQuant::dot1<DType::MXFP4>(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const BlockMXFP4 *>(w);
    const auto *y = static_cast<const BlockQ8_0 *>(a);
    float s = 0.0f;
    int8_t q[32];
    for (int64_t i = 0; i < n / QK_MXFP4; ++i) {
        unpack_table(x[i].qs, kMxfp4Values, q);
        s += (fp16_to_fp32(y[i].d) * e8m0_to_fp32_half(x[i].e)) * float(idot(q, y[i].qs, 32));
    }
    return s;
}

// Super-blocks against Q8_K: integer sums per group of 16 or 32, times the group's integer scale,
// summed as integers; then the super-block scales; mins through the activation group sums (bsums).

/// Sum over groups g of scale[g] * dot(q, y) over the group's `len` elements.
inline int32_t scaled_groups(const int8_t *q, const int8_t *y, const int32_t *scale, int n_groups, int len) {
    int32_t s = 0;
    for (int g = 0; g < n_groups; ++g) s += scale[g] * idot(q + g * len, y + g * len, len);
    return s;
}

template <> inline float ScalarQuant::dot1<DType::Q2_K>(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const BlockQ2_K *>(w);
    const auto *y = static_cast<const BlockQ8_K *>(a);
    float s = 0.0f;
    int8_t q[QK_K];
    int32_t sc[16];
    for (int64_t i = 0; i < n / QK_K; ++i) {
        for (int half = 0; half < 2; ++half)
            for (int j = 0; j < 4; ++j)
                for (int l = 0; l < 32; ++l) q[128 * half + 32 * j + l] = int8_t((x[i].qs[32 * half + l] >> (2 * j)) & 3);
        int32_t mins = 0;
        for (int g = 0; g < 16; ++g) {
            sc[g] = x[i].scales[g] & 0xF;
            mins += (x[i].scales[g] >> 4) * y[i].bsums[g];
        }
        const int32_t sumi = scaled_groups(q, y[i].qs, sc, 16, 16);
        s += y[i].d * (fp16_to_fp32(x[i].d) * float(sumi) - fp16_to_fp32(x[i].dmin) * float(mins));
    }
    return s;
}

template <> inline float ScalarQuant::dot1<DType::Q3_K>(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const BlockQ3_K *>(w);
    const auto *y = static_cast<const BlockQ8_K *>(a);
    float s = 0.0f;
    int8_t q[QK_K], s6[16];
    int32_t sc[16];
    for (int64_t i = 0; i < n / QK_K; ++i) {
        for (int half = 0; half < 2; ++half)
            for (int j = 0; j < 4; ++j)
                for (int l = 0; l < 32; ++l) {
                    const int hbit = (x[i].hmask[l] >> (4 * half + j)) & 1;
                    q[128 * half + 32 * j + l] = int8_t(((x[i].qs[32 * half + l] >> (2 * j)) & 3) - (hbit ? 0 : 4));
                }
        q3k_scales(x[i].scales, s6);
        for (int g = 0; g < 16; ++g) sc[g] = s6[g];
        s += y[i].d * fp16_to_fp32(x[i].d) * float(scaled_groups(q, y[i].qs, sc, 16, 16));
    }
    return s;
}

/// Q4_K / Q5_K: 8 groups of 32 with 6-bit scales and mins.
template <class B> float dot_k4(int64_t n, const B *x, const BlockQ8_K *y) {
    float s = 0.0f;
    int8_t q[QK_K];
    int32_t sc[8];
    for (int64_t i = 0; i < n / QK_K; ++i) {
        for (int g = 0; g < 8; ++g) {
            for (int l = 0; l < 32; ++l) {
                int v = (x[i].qs[32 * (g / 2) + l] >> (4 * (g % 2))) & 0xF;
                if constexpr (requires { x[i].qh; }) v |= ((x[i].qh[l] >> g) & 1) << 4;
                q[32 * g + l] = int8_t(v);
            }
        }
        int32_t mins = 0;
        for (int g = 0; g < 8; ++g) {
            uint8_t scale, m;
            k4_scale_min(g, x[i].scales, scale, m);
            sc[g] = scale;
            mins += m * (y[i].bsums[2 * g] + y[i].bsums[2 * g + 1]);
        }
        const int32_t sumi = scaled_groups(q, y[i].qs, sc, 8, 32);
        s += y[i].d * (fp16_to_fp32(x[i].d) * float(sumi) - fp16_to_fp32(x[i].dmin) * float(mins));
    }
    return s;
}

template <> inline float ScalarQuant::dot1<DType::Q4_K>(int64_t n, const void *w, const void *a) {
    return dot_k4(n, static_cast<const BlockQ4_K *>(w), static_cast<const BlockQ8_K *>(a));
}

template <> inline float ScalarQuant::dot1<DType::Q5_K>(int64_t n, const void *w, const void *a) {
    return dot_k4(n, static_cast<const BlockQ5_K *>(w), static_cast<const BlockQ8_K *>(a));
}

template <> inline float ScalarQuant::dot1<DType::Q6_K>(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const BlockQ6_K *>(w);
    const auto *y = static_cast<const BlockQ8_K *>(a);
    float s = 0.0f;
    int8_t q[QK_K];
    int32_t sc[16];
    for (int64_t i = 0; i < n / QK_K; ++i) {
        for (int half = 0; half < 2; ++half) {
            const uint8_t *ql = x[i].ql + 64 * half, *qh = x[i].qh + 32 * half;
            int8_t *o = q + 128 * half;
            for (int l = 0; l < 32; ++l) {
                o[l] = int8_t(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                o[l + 32] = int8_t(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[l + 64] = int8_t(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[l + 96] = int8_t(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        for (int g = 0; g < 16; ++g) sc[g] = x[i].scales[g];
        s += y[i].d * fp16_to_fp32(x[i].d) * float(scaled_groups(q, y[i].qs, sc, 16, 16));
    }
    return s;
}

template <> inline float ScalarQuant::dot1<DType::IQ4_XS>(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const BlockIQ4_XS *>(w);
    const auto *y = static_cast<const BlockQ8_K *>(a);
    float s = 0.0f;
    int8_t q[QK_K];
    int32_t sc[8];
    for (int64_t i = 0; i < n / QK_K; ++i) {
        for (int g = 0; g < 8; ++g) {
            unpack_table(x[i].qs + 16 * g, kIq4nlValues, q + 32 * g);
            sc[g] = (((x[i].scales_l[g / 2] >> 4 * (g % 2)) & 0xF) | (((x[i].scales_h >> 2 * g) & 3) << 4)) - 32;
        }
        s += y[i].d * fp16_to_fp32(x[i].d) * float(scaled_groups(q, y[i].qs, sc, 8, 32));
    }
    return s;
}

} // namespace
