// Element types of weights and activations, numbered as ggml numbers them (ggml.h enum ggml_type),
// so that a GGUF tensor's type field maps straight onto DType. Block layouts are ggml's
// (ggml-common.h), the reference dequantization is ggml-quants.c's dequantize_row_*, and the 8-bit
// activation types are the ones ggml-cpu quantizes activations to for its integer dot products.
// Decision: docs/decisions/0060-weight-types.md.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>

namespace prescope {

enum class DType : uint32_t {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,    // activations only (vec-dot type of Q4_1, Q5_1)
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,   // activations only (vec-dot type of the K-quants and IQ4_XS)
    IQ4_NL = 20,
    IQ4_XS = 23,
    BF16 = 30,
    MXFP4 = 39,
};

// ---------------------------------------------------------------------------------------------
// blocks (ggml-common.h); F16 fields hold IEEE half bits

constexpr int64_t QK4_0 = 32, QK4_1 = 32, QK5_0 = 32, QK5_1 = 32, QK8_0 = 32, QK8_1 = 32;
constexpr int64_t QK4_NL = 32, QK_MXFP4 = 32;
constexpr int64_t QK_K = 256;  // super-block of the K-quants and IQ4_XS

/// 32 weights = d * (q - 8), q 4-bit: qs[j] holds weights j (low nibble) and j + 16 (high nibble).
struct BlockQ4_0 {
    uint16_t d;
    uint8_t qs[16];
};
/// 32 weights = d * q + m, q 4-bit, nibbles as Q4_0.
struct BlockQ4_1 {
    uint16_t d, m;
    uint8_t qs[16];
};
/// 32 weights = d * (q - 16), q 5-bit: low nibbles as Q4_0, bit j of qh (little-endian u32) = bit 4 of weight j.
struct BlockQ5_0 {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[16];
};
/// 32 weights = d * q + m, q 5-bit, bits as Q5_0.
struct BlockQ5_1 {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[16];
};
/// 32 weights = d * qs[i].
struct BlockQ8_0 {
    uint16_t d;
    int8_t qs[32];
};
/// Q8_0 plus s = d * sum(qs) (F16): the activation blocks of Q4_1 / Q5_1 products.
struct BlockQ8_1 {
    uint16_t d, s;
    int8_t qs[32];
};
/// 256 weights in 16 groups of 16: d * (scales[g] & 15) * q - dmin * (scales[g] >> 4), q 2-bit.
/// Group g of each 128-half: qs[32 * half + 16 * (g & 1) + l] >> (2 * ((g % 8) / 2)).
struct BlockQ2_K {
    uint8_t scales[16];
    uint8_t qs[64];
    uint16_t d, dmin;
};
/// 256 weights in 16 groups of 16: d * (s - 32) * (q - 4 * !hbit), q 2-bit, s 6-bit packed in 12 bytes.
struct BlockQ3_K {
    uint8_t hmask[32];
    uint8_t qs[64];
    uint8_t scales[12];
    uint16_t d;
};
/// 256 weights in 8 groups of 32: d * sc * q - dmin * m, q 4-bit, sc and m 6-bit packed in 12 bytes.
struct BlockQ4_K {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[128];
};
/// Q4_K with a fifth bit per weight in qh.
struct BlockQ5_K {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[32];
    uint8_t qs[128];
};
/// 256 weights in 16 groups of 16: d * scales[g] * (q - 32), q 6-bit (4 bits in ql, 2 in qh).
struct BlockQ6_K {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    uint16_t d;
};
/// 256 activations = d * qs[i] (F32 scale); bsums[g] = sum of qs over group g of 16.
struct BlockQ8_K {
    float d;
    int8_t qs[256];
    int16_t bsums[16];
};
/// 32 weights = d * kIq4nlValues[q], q 4-bit, nibbles as Q4_0.
struct BlockIQ4_NL {
    uint16_t d;
    uint8_t qs[16];
};
/// 256 weights in 8 groups of 32: d * (ls - 32) * kIq4nlValues[q], ls 6-bit (scales_l nibble + 2 bits of
/// scales_h); nibbles of each group as Q4_0.
struct BlockIQ4_XS {
    uint16_t d;
    uint16_t scales_h;
    uint8_t scales_l[4];
    uint8_t qs[128];
};
/// 32 weights = 2^(e - 128) * kMxfp4Values[q] (E8M0 scale, halved: the values are doubled E2M1).
struct BlockMXFP4 {
    uint8_t e;
    uint8_t qs[16];
};
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 &&
              sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_0) == 34 && sizeof(BlockQ8_1) == 36 &&
              sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 &&
              sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210 && sizeof(BlockQ8_K) == 292 &&
              sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136 && sizeof(BlockMXFP4) == 17,
              "block sizes as ggml-common.h");

/// IQ4_NL / IQ4_XS code book (ggml-common.h kvalues_iq4nl).
constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/// MXFP4 code book: E2M1 values doubled (ggml-common.h kvalues_mxfp4).
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/// Scale and min of group j (0..7) of a Q4_K / Q5_K block's 12 packed scale bytes (ggml get_scale_min_k4).
inline void k4_scale_min(int j, const uint8_t *q, uint8_t &sc, uint8_t &m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/// The 16 signed 6-bit scales (s - 32) of a Q3_K block's 12 packed scale bytes, in group order.
void q3k_scales(const uint8_t packed[12], int8_t out[16]);

/// 2^(e - 128) as F32 (ggml_e8m0_to_fp32_half): the MXFP4 block scale.
inline float e8m0_to_fp32_half(uint8_t e) {
    const uint32_t bits = e < 2 ? uint32_t(0x00200000) << e : uint32_t(e - 1) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// ---------------------------------------------------------------------------------------------
// type traits

/// The dtype for a ggml type id when PreScope computes with it as a weight, or nullopt (other ids, and
/// the activation-only Q8_1 / Q8_K).
std::optional<DType> dtype_from_ggml(uint32_t ggml_type);
/// The weight types, as the error message of an unsupported tensor lists them ("f32, f16, ...").
const char *supported_weight_types();
/// Short lowercase name as ggml prints it ("f32", "q4_K"); for unsupported ggml ids use ggml_type_name().
const char *dtype_name(DType t);
/// Name of any ggml type id (also the unsupported ones), for error messages.
const char *ggml_type_name(uint32_t ggml_type);
/// Elements per block (32 or 256; 1 for F32, F16, BF16).
int64_t dtype_block_elems(DType t);
/// Bytes per block (element size for F32, F16, BF16).
size_t dtype_block_bytes(DType t);
/// Bytes of a row of n elements; n must be a multiple of the block size (checked by callers).
size_t dtype_row_bytes(DType t, int64_t n);
/// True for the block types (every type but F32, F16, BF16).
bool dtype_is_quantized(DType t);
/// The 8-bit type activations are quantized to for integer dot products with weights of type t, as
/// ggml-cpu's type_traits_cpu[t].vec_dot_type: Q8_0 for Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4; Q8_1 for Q4_1,
/// Q5_1; Q8_K for the K-quants and IQ4_XS. F32 for F32, F16, BF16 (never quantized).
DType vec_dot_type(DType t);

// IEEE half and bfloat16 conversions (round to nearest even, as ggml_compute_fp32_to_fp16 / to_bf16).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
inline float bf16_to_fp32(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
uint16_t fp32_to_bf16(float f);

/// Converts n elements of a row of type t (any DType) to F32, bit for bit as ggml's dequantize_row_*
/// (and gguf-py's gguf.quants.dequantize). src holds dtype_row_bytes(t, n) bytes.
void dequantize_row(DType t, const void *src, float *dst, int64_t n);
/// Quantizes n F32 values (n % 32 == 0) into n/32 Q8_0 blocks, as ggml quantize_row_q8_0_ref.
void quantize_row_q8_0(const float *src, BlockQ8_0 *dst, int64_t n);
/// Quantizes n F32 values (n % 32 == 0) into Q8_1 blocks, as ggml quantize_row_q8_1_ref.
void quantize_row_q8_1(const float *src, BlockQ8_1 *dst, int64_t n);
/// Quantizes n F32 values (n % 256 == 0) into Q8_K blocks, as ggml quantize_row_q8_K_ref (scale
/// -max/127 of the element of largest magnitude; round half to even; bsums of 16).
void quantize_row_q8_K(const float *src, BlockQ8_K *dst, int64_t n);
/// quantize_row_q8_0 / _q8_1 / _q8_K by activation type a (Q8_0, Q8_1 or Q8_K); dst holds
/// dtype_row_bytes(a, n) bytes.
void quantize_activations(DType a, const float *src, void *dst, int64_t n);

// ---------------------------------------------------------------------------------------------
// how activations meet quantized weights

/// Activations of a product with quantized weights (both backends, every path; decision 0060).
enum class ActivationQuant {
    INT8,  // quantized to vec_dot_type(weights), as llama.cpp does: integer dot products (default)
    NONE,  // kept F32, the weights dequantized: the products the F32 HF references are checked with
};

namespace detail {
inline std::atomic<int> g_activation_quant{int(ActivationQuant::INT8)};
} // namespace detail

/// The process-wide choice (a knob for reference comparisons; set it before a run, not during one).
inline ActivationQuant activation_quant() { return ActivationQuant(detail::g_activation_quant.load()); }
inline void set_activation_quant(ActivationQuant a) { detail::g_activation_quant.store(int(a)); }
/// True when a product with weights of type t quantizes its activations now.
inline bool quantizes_activations(DType t) {
    return activation_quant() == ActivationQuant::INT8 && t != DType::F32 && t != DType::F16 && t != DType::BF16;
}

} // namespace prescope
