#include "core/dtype.h"

#include "core/error.h"

#include <cmath>

namespace prescope {

std::optional<DType> dtype_from_ggml(uint32_t ggml_type) {
    switch (ggml_type) {
    case 0: return DType::F32;
    case 1: return DType::F16;
    case 8: return DType::Q8_0;
    case 30: return DType::BF16;
    default: return std::nullopt;
    }
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
                                  "iq4_nl_8_8", "mxfp4"};
    if (ggml_type < sizeof(names) / sizeof(names[0])) return names[ggml_type];
    return "unknown";
}

int64_t dtype_block_elems(DType t) {
    return t == DType::Q8_0 ? QK8_0 : 1;
}

size_t dtype_block_bytes(DType t) {
    switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::Q8_0: return sizeof(BlockQ8_0);
    }
    PRESCOPE_ASSERT(false);
}

size_t dtype_row_bytes(DType t, int64_t n) {
    return size_t(n / dtype_block_elems(t)) * dtype_block_bytes(t);
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

void dequantize_row(DType t, const void *src, float *dst, int64_t n) {
    switch (t) {
    case DType::F32:
        std::memcpy(dst, src, size_t(n) * 4);
        return;
    case DType::F16: {
        auto *s = static_cast<const uint16_t *>(src);
        for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(s[i]);
        return;
    }
    case DType::BF16: {
        auto *s = static_cast<const uint16_t *>(src);
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(s[i]);
        return;
    }
    case DType::Q8_0: {
        auto *b = static_cast<const BlockQ8_0 *>(src);
        for (int64_t i = 0; i < n / QK8_0; ++i) {
            const float d = fp16_to_fp32(b[i].d);
            for (int j = 0; j < QK8_0; ++j) dst[i * QK8_0 + j] = d * float(b[i].qs[j]);
        }
        return;
    }
    }
    PRESCOPE_ASSERT(false);
}

void quantize_row_q8_0(const float *src, BlockQ8_0 *dst, int64_t n) {
    PRESCOPE_ASSERT(n % QK8_0 == 0);
    for (int64_t i = 0; i < n / QK8_0; ++i) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; ++j) amax = std::max(amax, std::fabs(src[i * QK8_0 + j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        dst[i].d = fp32_to_fp16(d);
        for (int j = 0; j < QK8_0; ++j) dst[i].qs[j] = int8_t(std::lround(src[i * QK8_0 + j] * id));
    }
}

} // namespace prescope
