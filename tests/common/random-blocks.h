// Random weights of any weight dtype for tests and benchmarks: every quant bit random, the block scales
// finite F16 values (MXFP4: E8M0 exponents) chosen so that typical weights are of order 0.1 to 1.
#pragma once

#include "core/dtype.h"

#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <vector>

namespace prescope::test {

/// Where a block type keeps its F16 scale fields and the log2 range of their magnitudes.
struct ScaleFields {
    size_t offsets[2];
    int n_fields;
    float lo, hi;  // log2 of the magnitude range
};

inline ScaleFields scale_fields(DType t) {
    switch (t) {
    case DType::Q4_0: return {{0, 0}, 1, -5, -3};
    case DType::Q4_1: return {{0, 2}, 2, -5, -3};
    case DType::Q5_0: return {{0, 0}, 1, -6, -4};
    case DType::Q5_1: return {{0, 2}, 2, -6, -4};
    case DType::Q8_0: return {{0, 0}, 1, -9, -7};
    case DType::Q2_K: return {{offsetof(BlockQ2_K, d), offsetof(BlockQ2_K, dmin)}, 2, -7, -5};
    case DType::Q3_K: return {{offsetof(BlockQ3_K, d), 0}, 1, -9, -7};
    case DType::Q4_K: return {{0, 2}, 2, -10, -8};
    case DType::Q5_K: return {{0, 2}, 2, -11, -9};
    case DType::Q6_K: return {{offsetof(BlockQ6_K, d), 0}, 1, -13, -11};
    case DType::IQ4_NL: return {{0, 0}, 1, -9, -7};
    case DType::IQ4_XS: return {{0, 0}, 1, -13, -11};
    default: return {{0, 0}, 0, 0, 0};
    }
}

/// n_rows rows of n elements (a multiple of the block size) of dtype t, packed. F32 / F16 / BF16 rows
/// hold uniform values in [-1, 1].
inline std::vector<uint8_t> random_weights(DType t, int64_t n_rows, int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    const size_t row_bytes = dtype_row_bytes(t, n), total = row_bytes * size_t(n_rows);
    std::vector<uint8_t> out(total);
    if (!dtype_is_quantized(t)) {
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (size_t i = 0; i < total / dtype_block_bytes(t); ++i) {
            const float v = u(rng);
            if (t == DType::F32) std::memcpy(out.data() + 4 * i, &v, 4);
            const uint16_t h = t == DType::F16 ? fp32_to_fp16(v) : fp32_to_bf16(v);
            if (t != DType::F32) std::memcpy(out.data() + 2 * i, &h, 2);
        }
        return out;
    }
    std::uniform_int_distribution<int> byte(0, 255);
    for (uint8_t &b : out) b = uint8_t(byte(rng));
    const size_t bb = dtype_block_bytes(t);
    const ScaleFields f = scale_fields(t);
    std::uniform_real_distribution<float> exp2(f.lo, f.hi);
    std::uniform_int_distribution<int> e8m0(122, 126);
    for (size_t b = 0; b < total / bb; ++b) {
        uint8_t *blk = out.data() + b * bb;
        if (t == DType::MXFP4) blk[0] = uint8_t(e8m0(rng));
        for (int k = 0; k < f.n_fields; ++k) {
            const float v = std::exp2(exp2(rng)) * (byte(rng) & 1 ? 1.0f : -1.0f);
            const uint16_t h = fp32_to_fp16(v);
            std::memcpy(blk + f.offsets[k], &h, 2);
        }
    }
    return out;
}

} // namespace prescope::test
