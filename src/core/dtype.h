// Element types of weights and activations, numbered as ggml numbers them (ggml.h enum ggml_type),
// so that a GGUF tensor's type field maps straight onto DType.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace prescope {

enum class DType : uint32_t {
    F32 = 0,
    F16 = 1,
    Q8_0 = 8,
    BF16 = 30,
};

/// Q8_0 block (ggml-common.h block_q8_0): 32 int8 weights sharing one F16 scale; value = d * qs[i].
struct BlockQ8_0 {
    uint16_t d;      // scale, IEEE F16 bits
    int8_t qs[32];   // quants
};
static_assert(sizeof(BlockQ8_0) == 34);
constexpr int64_t QK8_0 = 32;

/// The supported dtype for a ggml type id, or nullopt for any other id (K-quants etc. come later).
std::optional<DType> dtype_from_ggml(uint32_t ggml_type);
/// Short lowercase name ("f32", "q8_0"); for unsupported ggml ids use ggml_type_name().
const char *dtype_name(DType t);
/// Name of any ggml type id (also the unsupported ones), for error messages.
const char *ggml_type_name(uint32_t ggml_type);
/// Elements per block (32 for Q8_0, 1 otherwise).
int64_t dtype_block_elems(DType t);
/// Bytes per block (34 for Q8_0, element size otherwise).
size_t dtype_block_bytes(DType t);
/// Bytes of a row of n elements; n must be a multiple of the block size (checked by callers).
size_t dtype_row_bytes(DType t, int64_t n);

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

/// Converts n elements of a row of type t to F32. src holds dtype_row_bytes(t, n) bytes.
void dequantize_row(DType t, const void *src, float *dst, int64_t n);
/// Quantizes n F32 values (n % 32 == 0) into n/32 Q8_0 blocks, as ggml quantize_row_q8_0_ref.
void quantize_row_q8_0(const float *src, BlockQ8_0 *dst, int64_t n);

} // namespace prescope
