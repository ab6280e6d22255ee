// A non-owning view of a weight tensor (usually inside a mapped GGUF file).
#pragma once

#include "core/dtype.h"

#include <array>
#include <cstdint>
#include <string>

namespace prescope {

/// Dimensions follow ggml: ne[0] is the fastest-varying (row length), ne[1] the number of rows,
/// ne[2] the matrix index (e.g. the expert for *_exps tensors). Rows are contiguous and packed:
/// row r of matrix m starts at data + (m * ne[1] + r) * row_bytes().
struct TensorView {
    std::string name;                  // GGUF tensor name, for error messages
    DType type = DType::F32;
    std::array<int64_t, 4> ne{1, 1, 1, 1};
    const void *data = nullptr;        // owned by the mapping; valid while the model lives

    int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
    size_t row_bytes() const { return dtype_row_bytes(type, ne[0]); }
    size_t matrix_bytes() const { return row_bytes() * size_t(ne[1]); }
    size_t n_bytes() const { return matrix_bytes() * size_t(ne[2] * ne[3]); }
    bool empty() const { return data == nullptr; }
    /// Start of matrix m (for 3-D tensors such as ffn_gate_exps: the m-th expert).
    const uint8_t *matrix(int64_t m) const {
        return static_cast<const uint8_t *>(data) + size_t(m) * matrix_bytes();
    }
    const uint8_t *row(int64_t r, int64_t m = 0) const {
        return matrix(m) + size_t(r) * row_bytes();
    }
};

} // namespace prescope
