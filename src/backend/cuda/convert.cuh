// Row conversion between dtypes on the GPU: gathers rows of a matrix (weights of any dtype, or F32
// activations) and writes them as F32, F16 or BF16; get_rows (the embedding lookup) is one use.
#pragma once

#include "core/dtype.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prescope::cuda {

/// out row r = source row (ids ? ids[r] : r) converted to `to`, for r < n_rows.
/// src: n_src_rows packed rows of n elements of `type` (any weight type; row stride row_bytes(type, n),
/// dequantized bit for bit as core/dtype.h's dequantize_row); n a multiple of 8 and of the block size.
/// to: F32, F16 (saturating at +-65504) or BF16 (round to nearest even); out: [n_rows][n] of `to`,
/// 16-byte aligned; src aligned to weight_alignment(type). An id outside [0, n_src_rows) gives a row of
/// NaN (callers validate ids; NaN makes a slip visible instead of reading out of bounds). Async on `stream`.
void convert_rows(DType type, const void *src, int64_t n, const int32_t *ids, int64_t n_src_rows,
                  int64_t n_rows, DType to, void *out, cudaStream_t stream);

/// Embedding lookup, the CUDA twin of cpu::get_rows: out[t] = row ids[t] of `table` as F32.
/// table: n_vocab rows of n_embd elements of `type` on the device; ids: [n_tok] int32 on the device,
/// each < n_vocab (out-of-range ids give NaN rows); out: [n_tok][n_embd] F32. Async on `stream`.
void get_rows(DType type, const void *table, int64_t n_embd, int64_t n_vocab, const int32_t *ids, int64_t n_tok,
              float *out, cudaStream_t stream);

/// The inverse gather: dst row rows[r] = src row r for r < n_rows (a pass's new keys and values into their
/// sequences' KV cache rows). src: [n_rows][n] F32; rows: [n_rows] int32 on the device, distinct, each a row of
/// dst; n a multiple of 4, src and dst 16-byte aligned. Async on `stream`.
void scatter_rows(const float *src, int64_t n_rows, int64_t n, const int32_t *rows, float *dst, cudaStream_t stream);

/// Element strides (in floats) of a [n_tok][n_head] grid of vectors: vector (t, h) starts at t * tok + h * head.
struct HeadLayout {
    int64_t tok = 0, head = 0;
};
/// dst vector (t, h) = the first n floats of src vector (t, h), t < n_tok, h < n_head: reorders per-head vectors
/// between token-major and head-major layouts, or takes a part of longer rows (DeepSeek's MLA takes the no-rope
/// part of each query head, and interleaves the heads of its per-head products). src and dst F32 on the device,
/// must not overlap. Async on `stream`.
void copy_heads(const float *src, HeadLayout src_layout, float *dst, HeadLayout dst_layout, int64_t n_tok,
                int64_t n_head, int64_t n, cudaStream_t stream);

} // namespace prescope::cuda
