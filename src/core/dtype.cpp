#include "core/dtype.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>

namespace prescope {

namespace {

struct Traits {
    DType type;
    int64_t block_elems;
    size_t block_bytes;
    DType vec_dot;
    bool weight;  // PreScope computes with it as a weight
};

// ggml.c type_traits (block sizes) and ggml-cpu.c type_traits_cpu (vec_dot_type).
constexpr Traits kTraits[] = {
    {DType::F32, 1, 4, DType::F32, true},
    {DType::F16, 1, 2, DType::F32, true},
    {DType::Q4_0, QK4_0, sizeof(BlockQ4_0), DType::Q8_0, true},
    {DType::Q4_1, QK4_1, sizeof(BlockQ4_1), DType::Q8_1, true},
    {DType::Q5_0, QK5_0, sizeof(BlockQ5_0), DType::Q8_0, true},
    {DType::Q5_1, QK5_1, sizeof(BlockQ5_1), DType::Q8_1, true},
    {DType::Q8_0, QK8_0, sizeof(BlockQ8_0), DType::Q8_0, true},
    {DType::Q8_1, QK8_1, sizeof(BlockQ8_1), DType::Q8_1, false},
    {DType::Q2_K, QK_K, sizeof(BlockQ2_K), DType::Q8_K, true},
    {DType::Q3_K, QK_K, sizeof(BlockQ3_K), DType::Q8_K, true},
    {DType::Q4_K, QK_K, sizeof(BlockQ4_K), DType::Q8_K, true},
    {DType::Q5_K, QK_K, sizeof(BlockQ5_K), DType::Q8_K, true},
    {DType::Q6_K, QK_K, sizeof(BlockQ6_K), DType::Q8_K, true},
    {DType::Q8_K, QK_K, sizeof(BlockQ8_K), DType::Q8_K, false},
    {DType::IQ4_NL, QK4_NL, sizeof(BlockIQ4_NL), DType::Q8_0, true},
    {DType::IQ4_XS, QK_K, sizeof(BlockIQ4_XS), DType::Q8_K, true},
    {DType::BF16, 1, 2, DType::F32, true},
    {DType::MXFP4, QK_MXFP4, sizeof(BlockMXFP4), DType::Q8_0, true},
};

const Traits &traits(DType t) {
    for (const Traits &e : kTraits) {
        if (e.type == t) return e;
    }
    PRESCOPE_ASSERT(false);
}

} // namespace

std::optional<DType> dtype_from_ggml(uint32_t ggml_type) {
    for (const Traits &e : kTraits) {
        if (uint32_t(e.type) == ggml_type && e.weight) return e.type;
    }
    return std::nullopt;
}

const char *supported_weight_types() {
    return "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, mxfp4";
}

const char *dtype_name(DType t) {
    return ggml_type_name(uint32_t(t));
}

const char *ggml_type_name(uint32_t ggml_type) {
    // ggml.c type_traits[].type_name, in ggml_type order.
    static const char *names[] = {"f32",  "f16",  "q4_0", "q4_1", "q4_2", "q4_3", "q5_0",    "q5_1",
                                  "q8_0", "q8_1", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K",    "q8_K",
                                  "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s", "iq4_nl", "iq3_s", "iq2_s", "iq4_xs",
                                  "i8",   "i16",  "i32",  "i64",  "f64",  "iq1_m", "bf16", "q4_0_4_4",
                                  "q4_0_4_8", "q4_0_8_8", "tq1_0", "tq2_0", "iq4_nl_4_4", "iq4_nl_4_8",
                                  "iq4_nl_8_8", "mxfp4", "nvfp4"};
    if (ggml_type < sizeof(names) / sizeof(names[0])) return names[ggml_type];
    return "unknown";
}

int64_t dtype_block_elems(DType t) {
    return traits(t).block_elems;
}

size_t dtype_block_bytes(DType t) {
    return traits(t).block_bytes;
}

size_t dtype_row_bytes(DType t, int64_t n) {
    const Traits &x = traits(t);
    return size_t(n / x.block_elems) * x.block_bytes;
}

bool dtype_is_quantized(DType t) {
    return traits(t).block_elems > 1;
}

DType vec_dot_type(DType t) {
    return traits(t).vec_dot;
}

void q3k_scales(const uint8_t packed[12], int8_t out[16]) {
    // ggml dequantize_row_q3_K: low 4 bits in bytes 0-7 (two per byte), high 2 bits in bytes 8-11.
    uint32_t aux[4];
    std::memcpy(aux, packed, 12);
    constexpr uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
    const uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    uint8_t u[16];
    std::memcpy(u, aux, 16);
    for (int i = 0; i < 16; ++i) out[i] = int8_t(int(u[i]) - 32);
}

float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do {
                mant <<= 1;
                ++e;
            } while (!(mant & 0x400));
            bits = sign | uint32_t(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | mant << 13;
    } else {
        bits = sign | (exp + 112) << 23 | mant << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t fp32_to_fp16(float f) {
    // Round to nearest even (the bit-exact method of ggml_compute_fp32_to_fp16 / FP16 library).
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
    uint32_t w;
    std::memcpy(&w, &f, 4);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    float bias_f;
    std::memcpy(&bias_f, &bias_bits, 4);
    base = bias_f + base;
    uint32_t bits;
    std::memcpy(&bits, &base, 4);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

uint16_t fp32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 64);  // quiet NaN
    return uint16_t((u + (0x7fff + ((u >> 16) & 1))) >> 16);
}

// ---------------------------------------------------------------------------------------------
// dequantization (ggml-quants.c dequantize_row_*: the same F32 operations in the same order, so the
// results are bit-identical; the library is built with -ffp-contract=off)

namespace {

template <class B> const B *blocks(const void *p) { return static_cast<const B *>(p); }

void dequant_q4_0(const BlockQ4_0 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, y += 32) {
        const float d = fp16_to_fp32(x[i].d);
        for (int j = 0; j < 16; ++j) {
            y[j] = float((x[i].qs[j] & 0x0F) - 8) * d;
            y[j + 16] = float((x[i].qs[j] >> 4) - 8) * d;
        }
    }
}

void dequant_q4_1(const BlockQ4_1 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, y += 32) {
        const float d = fp16_to_fp32(x[i].d), m = fp16_to_fp32(x[i].m);
        for (int j = 0; j < 16; ++j) {
            y[j] = float(x[i].qs[j] & 0x0F) * d + m;
            y[j + 16] = float(x[i].qs[j] >> 4) * d + m;
        }
    }
}

/// Bit 4 of weights j and j + 16 of a Q5 block's qh.
inline int q5_high(uint32_t qh, int j, int half) { return int((qh >> (j + 16 * half)) & 1) << 4; }

void dequant_q5_0(const BlockQ5_0 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, y += 32) {
        const float d = fp16_to_fp32(x[i].d);
        uint32_t qh;
        std::memcpy(&qh, x[i].qh, 4);
        for (int j = 0; j < 16; ++j) {
            y[j] = float(((x[i].qs[j] & 0x0F) | q5_high(qh, j, 0)) - 16) * d;
            y[j + 16] = float(((x[i].qs[j] >> 4) | q5_high(qh, j, 1)) - 16) * d;
        }
    }
}

void dequant_q5_1(const BlockQ5_1 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, y += 32) {
        const float d = fp16_to_fp32(x[i].d), m = fp16_to_fp32(x[i].m);
        uint32_t qh;
        std::memcpy(&qh, x[i].qh, 4);
        for (int j = 0; j < 16; ++j) {
            y[j] = float((x[i].qs[j] & 0x0F) | q5_high(qh, j, 0)) * d + m;
            y[j + 16] = float((x[i].qs[j] >> 4) | q5_high(qh, j, 1)) * d + m;
        }
    }
}

template <class B> void dequant_q8(const B *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, y += 32) {
        const float d = fp16_to_fp32(x[i].d);
        for (int j = 0; j < 32; ++j) y[j] = float(x[i].qs[j]) * d;
    }
}

void dequant_q2_k(const BlockQ2_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d), dmin = fp16_to_fp32(x[i].dmin);
        const uint8_t *q = x[i].qs;
        int is = 0;
        for (int half = 0; half < 2; ++half, q += 32) {
            for (int shift = 0; shift < 8; shift += 2) {
                for (int part = 0; part < 2; ++part) {
                    const uint8_t sc = x[i].scales[is++];
                    const float dl = d * float(sc & 0xF), ml = dmin * float(sc >> 4);
                    for (int l = 0; l < 16; ++l) *y++ = dl * float((q[16 * part + l] >> shift) & 3) - ml;
                }
            }
        }
    }
}

void dequant_q3_k(const BlockQ3_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d);
        int8_t sc[16];
        q3k_scales(x[i].scales, sc);
        const uint8_t *q = x[i].qs;
        int is = 0;
        uint8_t m = 1;
        for (int half = 0; half < 2; ++half, q += 32) {
            for (int shift = 0; shift < 8; shift += 2, m = uint8_t(m << 1)) {
                for (int part = 0; part < 2; ++part) {
                    const float dl = d * float(sc[is++]);
                    for (int l = 16 * part; l < 16 * part + 16; ++l) {
                        *y++ = dl * float(((q[l] >> shift) & 3) - ((x[i].hmask[l] & m) ? 0 : 4));
                    }
                }
            }
        }
    }
}

void dequant_q4_k(const BlockQ4_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d), dmin = fp16_to_fp32(x[i].dmin);
        const uint8_t *q = x[i].qs;
        for (int g = 0; g < 8; g += 2, q += 32) {
            uint8_t sc, m;
            k4_scale_min(g, x[i].scales, sc, m);
            const float d1 = d * float(sc), m1 = dmin * float(m);
            k4_scale_min(g + 1, x[i].scales, sc, m);
            const float d2 = d * float(sc), m2 = dmin * float(m);
            for (int l = 0; l < 32; ++l) *y++ = d1 * float(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; ++l) *y++ = d2 * float(q[l] >> 4) - m2;
        }
    }
}

void dequant_q5_k(const BlockQ5_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d), dmin = fp16_to_fp32(x[i].dmin);
        const uint8_t *ql = x[i].qs, *qh = x[i].qh;
        uint8_t u1 = 1, u2 = 2;
        for (int g = 0; g < 8; g += 2, ql += 32, u1 = uint8_t(u1 << 2), u2 = uint8_t(u2 << 2)) {
            uint8_t sc, m;
            k4_scale_min(g, x[i].scales, sc, m);
            const float d1 = d * float(sc), m1 = dmin * float(m);
            k4_scale_min(g + 1, x[i].scales, sc, m);
            const float d2 = d * float(sc), m2 = dmin * float(m);
            for (int l = 0; l < 32; ++l) *y++ = d1 * float((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
            for (int l = 0; l < 32; ++l) *y++ = d2 * float((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        }
    }
}

void dequant_q6_k(const BlockQ6_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d);
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *sc = x[i].scales;
        for (int half = 0; half < 2; ++half, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; ++l) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * float(sc[is]) * float(q1);
                y[l + 32] = d * float(sc[is + 2]) * float(q2);
                y[l + 64] = d * float(sc[is + 4]) * float(q3);
                y[l + 96] = d * float(sc[is + 6]) * float(q4);
            }
        }
    }
}

void dequant_q8_k(const BlockQ8_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, y += QK_K) {
        for (int j = 0; j < QK_K; ++j) y[j] = x[i].d * float(x[i].qs[j]);
    }
}

void dequant_iq4_nl(const BlockIQ4_NL *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, y += 32) {
        const float d = fp16_to_fp32(x[i].d);
        for (int j = 0; j < 16; ++j) {
            y[j] = d * float(kIq4nlValues[x[i].qs[j] & 0xF]);
            y[j + 16] = d * float(kIq4nlValues[x[i].qs[j] >> 4]);
        }
    }
}

void dequant_iq4_xs(const BlockIQ4_XS *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d);
        const uint8_t *qs = x[i].qs;
        for (int ib = 0; ib < 8; ++ib, y += 32, qs += 16) {
            const int ls = ((x[i].scales_l[ib / 2] >> 4 * (ib % 2)) & 0xF) | (((x[i].scales_h >> 2 * ib) & 3) << 4);
            const float dl = d * float(ls - 32);
            for (int j = 0; j < 16; ++j) {
                y[j] = dl * float(kIq4nlValues[qs[j] & 0xF]);
                y[j + 16] = dl * float(kIq4nlValues[qs[j] >> 4]);
            }
        }
    }
}

void dequant_mxfp4(const BlockMXFP4 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, y += 32) {
        const float d = e8m0_to_fp32_half(x[i].e);
        for (int j = 0; j < 16; ++j) {
            y[j] = float(kMxfp4Values[x[i].qs[j] & 0xF]) * d;
            y[j + 16] = float(kMxfp4Values[x[i].qs[j] >> 4]) * d;
        }
    }
}

} // namespace

void dequantize_row(DType t, const void *src, float *dst, int64_t n) {
    const int64_t nb = n / dtype_block_elems(t);
    switch (t) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * 4); return;
    case DType::F16:
        for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(static_cast<const uint16_t *>(src)[i]);
        return;
    case DType::BF16:
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(static_cast<const uint16_t *>(src)[i]);
        return;
    case DType::Q4_0: dequant_q4_0(blocks<BlockQ4_0>(src), dst, nb); return;
    case DType::Q4_1: dequant_q4_1(blocks<BlockQ4_1>(src), dst, nb); return;
    case DType::Q5_0: dequant_q5_0(blocks<BlockQ5_0>(src), dst, nb); return;
    case DType::Q5_1: dequant_q5_1(blocks<BlockQ5_1>(src), dst, nb); return;
    case DType::Q8_0: dequant_q8(blocks<BlockQ8_0>(src), dst, nb); return;
    case DType::Q8_1: dequant_q8(blocks<BlockQ8_1>(src), dst, nb); return;
    case DType::Q2_K: dequant_q2_k(blocks<BlockQ2_K>(src), dst, nb); return;
    case DType::Q3_K: dequant_q3_k(blocks<BlockQ3_K>(src), dst, nb); return;
    case DType::Q4_K: dequant_q4_k(blocks<BlockQ4_K>(src), dst, nb); return;
    case DType::Q5_K: dequant_q5_k(blocks<BlockQ5_K>(src), dst, nb); return;
    case DType::Q6_K: dequant_q6_k(blocks<BlockQ6_K>(src), dst, nb); return;
    case DType::Q8_K: dequant_q8_k(blocks<BlockQ8_K>(src), dst, nb); return;
    case DType::IQ4_NL: dequant_iq4_nl(blocks<BlockIQ4_NL>(src), dst, nb); return;
    case DType::IQ4_XS: dequant_iq4_xs(blocks<BlockIQ4_XS>(src), dst, nb); return;
    case DType::MXFP4: dequant_mxfp4(blocks<BlockMXFP4>(src), dst, nb); return;
    }
    PRESCOPE_ASSERT(false);
}

// ---------------------------------------------------------------------------------------------
// activation quantization (ggml-quants.c quantize_row_q8_{0,1,K}_ref)

void quantize_row_q8_0(const float *src, BlockQ8_0 *dst, int64_t n) {
    PRESCOPE_ASSERT(n % QK8_0 == 0);
    for (int64_t i = 0; i < n / QK8_0; ++i) {
        const float *x = src + i * QK8_0;
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        dst[i].d = fp32_to_fp16(d);
        for (int j = 0; j < QK8_0; ++j) dst[i].qs[j] = int8_t(std::round(x[j] * id));
    }
}

void quantize_row_q8_1(const float *src, BlockQ8_1 *dst, int64_t n) {
    PRESCOPE_ASSERT(n % QK8_1 == 0);
    for (int64_t i = 0; i < n / QK8_1; ++i) {
        const float *x = src + i * QK8_1;
        float amax = 0.0f;
        for (int j = 0; j < QK8_1; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        dst[i].d = fp32_to_fp16(d);
        int sum = 0;
        for (int j = 0; j < QK8_1; ++j) {
            dst[i].qs[j] = int8_t(std::round(x[j] * id));
            sum += dst[i].qs[j];
        }
        dst[i].s = fp32_to_fp16(float(sum) * d);
    }
}

void quantize_row_q8_K(const float *src, BlockQ8_K *dst, int64_t n) {
    PRESCOPE_ASSERT(n % QK_K == 0);
    for (int64_t i = 0; i < n / QK_K; ++i) {
        const float *x = src + i * QK_K;
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < QK_K; ++j) {
            const float ax = std::fabs(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        BlockQ8_K &b = dst[i];
        if (amax == 0.0f) {
            b = BlockQ8_K{};
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < QK_K; ++j) {
            // Round half to even by the magic-number add of ggml's nearest_int (|x * iscale| <= 127).
            const float v = iscale * x[j] + 12582912.0f;
            int32_t bits;
            std::memcpy(&bits, &v, 4);
            b.qs[j] = int8_t(std::min((bits & 0x007fffff) - 0x00400000, 127));
        }
        for (int g = 0; g < QK_K / 16; ++g) {
            int sum = 0;
            for (int j = 0; j < 16; ++j) sum += b.qs[g * 16 + j];
            b.bsums[g] = int16_t(sum);
        }
        b.d = 1.0f / iscale;
    }
}

void quantize_activations(DType a, const float *src, void *dst, int64_t n) {
    switch (a) {
    case DType::Q8_0: quantize_row_q8_0(src, static_cast<BlockQ8_0 *>(dst), n); return;
    case DType::Q8_1: quantize_row_q8_1(src, static_cast<BlockQ8_1 *>(dst), n); return;
    case DType::Q8_K: quantize_row_q8_K(src, static_cast<BlockQ8_K *>(dst), n); return;
    default: break;
    }
    PRESCOPE_ASSERT(false);
}

} // namespace prescope
