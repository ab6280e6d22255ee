// Matrix products on the GPU: y = W x for weights of any core/dtype.h weight type and F32 activations,
// one matrix (matmul) or the active experts of a layer in one call (expert_matmul). Quantized weights are
// dequantized inside the kernels, from the bytes as stored (so slots and copies hold the file's bytes).
// Kernel choice and its reasons: docs/decisions/0040-cuda-matmul.md, 0062-cuda-weight-types.md.
#pragma once

#include "backend/cuda/common.cuh"
#include "core/dtype.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

namespace prescope::cuda {

/// Which kernel runs a product. With quantized weights under ActivationQuant::INT8 (core/dtype.h, the
/// default) both first replace the activations by their quantization to vec_dot_type(type) and back
/// (quantize_activations), the values the CPU's integer dot products multiply.
/// GEMV: own kernel, weights streamed once per 8 tokens, converted to F32 exactly, F32 accumulation
///   (same numerics as cpu::matmul up to summation order). Best up to a few tokens (decode).
/// CUBLAS: activations converted to the weights' 16-bit type (BF16; F16 for F16 weights; none for
///   F32), block-quantized weights dequantized to BF16 in the workspace, then cublasGemmEx / cublasSgemm
///   with F32 accumulation. Best for many tokens (prefill); costs 16-bit rounding of the activations.
/// AUTO: GEMV when a matrix sees at most matmul_gemv_max_tokens(type) tokens, else CUBLAS. The
///   environment variable PRESCOPE_CUDA_MATMUL=gemv|cublas turns AUTO into one of them (debugging).
enum class MatmulPath { AUTO, GEMV, CUBLAS };

/// The AUTO threshold: most tokens per matrix for which GEMV is chosen (block-quantized: 32, others: 8).
int matmul_gemv_max_tokens(DType type);

/// out row r = x row (rows ? rows[r] : r) quantized to vec_dot_type(type) (Q8_0, Q8_1 or Q8_K) and
/// dequantized, bit for bit as core/dtype.h's quantize_row_q8_* then dequantize_row, for r < n_rows.
/// type: a block-quantized weight type; x: [..][n] F32, n a multiple of the activation block (32 or 256);
/// out: [n_rows][n] F32 (must not overlap x). Device pointers; async on `stream`.
void quantize_activations(DType type, const float *x, const int32_t *rows, int64_t n, int64_t n_rows, float *out,
                          cudaStream_t stream);

/// Workspace bytes matmul needs for these sizes and path (0 for GEMV).
size_t matmul_workspace_bytes(DType type, int64_t n_in, int64_t n_out, int64_t n_tok,
                              MatmulPath path = MatmulPath::AUTO);

/// The CUDA twin of cpu::matmul: y[t][o] = sum_i W[o][i] * x[t][i] for t < n_tok, o < n_out.
/// w: n_out packed rows of n_in elements of `type` on the device (ggml order: ne[0] = n_in fastest;
/// block types as core/dtype.h / ggml-common.h lay them out), aligned to weight_alignment(type) (16 for
/// F32, F16, BF16; 2 for block types, 1 for MXFP4: such rows are read in whole aligned 16-byte pieces,
/// which never leave the allocation's pages); n_in a multiple of 8 and of the block size. x:
/// [n_tok][n_in] F32, y: [n_tok][n_out] F32 (overwritten, must not overlap x), both device, 16-byte
/// aligned. ws: at least matmul_workspace_bytes(...) bytes.
/// Asynchronous on `stream` (which also orders the use of ws); no host synchronization.
void matmul(DType type, const void *w, int64_t n_in, int64_t n_out, const float *x, int64_t n_tok, float *y,
            Workspace ws, cudaStream_t stream, MatmulPath path = MatmulPath::AUTO);

/// One matrix of a matmul_parts call: n_out rows of the shared n_in of `type`, written to y ([n_tok][n_out] F32
/// on the device, 16-byte aligned, overwritten). With `residual` ([n_tok][n_out] F32 on the device; y itself for
/// the sum in place), y = residual + W x (at most one part of a call): on the GEMV path the sum rounded once as
/// cuda::add rounds it, on the cuBLAS path by cuBLAS's beta = 1 epilogue.
struct MatmulPart {
    DType type = DType::F32;
    const void *w = nullptr;
    int64_t n_out = 0;
    float *y = nullptr;
    const float *residual = nullptr;
};

/// matmul for up to 3 matrices over the same activations (the q, k and v projections; a shared expert's gate
/// and up). Parts of one type share the activations' quantization (and, on the cuBLAS path, their conversion)
/// and, on the GEMV path, one launch; parts of different types (a Q4_K_M file's Q6_K wv) run as separate
/// matmuls. Each part's y equals a matmul of that part alone bit for bit. Rules for w, x and ws as for matmul;
/// ws must hold matmul_workspace_bytes of every part. One token on the GEMV path quantizes its activations in the
/// kernel (quantize_activations's values), and Q8_0 weights then multiply in integers (decision 0143).
///
/// With `norm`, x is the row before an RMSNorm (weights norm->w, [n_in] F32, 16-byte aligned): the products see
/// rms_norm(x, norm->w, norm->eps) (norm.cuh), the same floats as that kernel writes, normalised in the GEMV's own
/// launch (decision 0149). Only where matmul_parts_fuse_norm(parts, n_tok, path) holds.
struct RowNorm {
    const float *w = nullptr;
    float eps = 0.0f;
};
void matmul_parts(std::span<const MatmulPart> parts, int64_t n_in, const float *x, int64_t n_tok, Workspace ws,
                  cudaStream_t stream, MatmulPath path = MatmulPath::AUTO, const RowNorm *norm = nullptr);

/// Whether matmul_parts takes a RowNorm for these parts and tokens: one token on the GEMV path, weights whose
/// products quantize the activations (the kernel reads the row itself; decision 0149).
bool matmul_parts_fuse_norm(std::span<const MatmulPart> parts, int64_t n_tok, MatmulPath path = MatmulPath::AUTO);

/// One grouped product: the active experts of a layer, each with the (token, slot) pairs routed to it.
/// Pairs are numbered expert by expert: the pairs of expert e are [offsets[e], offsets[e + 1]); pair p
/// reads row rows[p] of x (or row p when rows == nullptr, e.g. for the down projection whose input is
/// already in pair order) and writes row p of y. The device arrays and their host copies must hold
/// the same values (the host copies size the launch and drive the cuBLAS path; the kernels read the
/// device ones, so no copy back is needed).
struct ExpertMatmul {
    DType type = DType::Q8_0;
    int64_t n_in = 0, n_out = 0;        // every expert matrix: n_out rows of n_in elements
    int32_t n_expert = 0;               // experts in this call (<= 65535)
    const void *const *w_dev = nullptr;  // device [n_expert]: each expert's matrix (e.g. a GPU slot)
    const void *const *w_host = nullptr; // host [n_expert]: the same pointers
    const int32_t *offsets_dev = nullptr;  // device [n_expert + 1]: 0 = offsets[0] <= ... = n_pairs
    const int32_t *offsets_host = nullptr; // host copy
    const int32_t *rows_dev = nullptr;     // device [n_pairs] row of x for each pair, or nullptr
    // Optional second matrix of each expert over the same pairs and of the same shape (its up matrix next to
    // the gate), of type type2: device and host lists as for w_*, or both nullptr. expert_matmul writes its
    // products to y2.
    DType type2 = DType::Q8_0;
    const void *const *w2_dev = nullptr;
    const void *const *w2_host = nullptr;
    // Device-resolved groups (offsets_host, w_host and w2_host all nullptr; issue 14): the offsets and matrices
    // exist only on the device (resolve_device_hits in moe.cuh wrote them), so the call covers at most
    // n_pairs_max pairs, no group has more than max_group_pairs (1..device_resolved_max_pairs(type)), and it
    // takes the GEMV path; groups past the last are empty.
    int64_t n_pairs_max = 0;
    int32_t max_group_pairs = 0;
    // With the second list (gate and up of the same experts): y = silu(W x) * W2 x, with
    // cuda::swiglu's arithmetic, in the GEMV kernel's epilogue when every group takes the GEMV path; y2 is then
    // scratch (written only when the product and the SwiGLU run apart).
    bool glu = false;
};

/// Most pairs a group of a device-resolved ExpertMatmul may have for weights of `type`: the GEMV path's
/// limit (matmul_gemv_max_tokens), or 0 when PRESCOPE_CUDA_MATMUL=cublas forces the cuBLAS path.
int device_resolved_max_pairs(DType type);

/// Pairs in the call (offsets_host[n_expert]; n_pairs_max for device-resolved groups).
int64_t expert_matmul_pairs(const ExpertMatmul &g);

/// Workspace bytes expert_matmul needs for g (0 when every expert takes the GEMV path and activations
/// stay F32). With MatmulPath::CUBLAS and every pair on one expert it is the most any call of that many
/// pairs can need: n_pairs * n_in * 2 bytes (+ a dequantization buffer of <= 32 MiB for block types,
/// + n_pairs * n_in * 4 for quantized activations), each part rounded to 256.
size_t expert_matmul_workspace_bytes(const ExpertMatmul &g, MatmulPath path = MatmulPath::AUTO);

/// y[p] = W_e x[rows[p]] for every pair p of every expert e in g: one GEMV launch for the experts
/// with few pairs (all of them at decode) plus, under AUTO, one cuBLAS product per expert with more
/// than matmul_gemv_max_tokens(type) pairs. x: [>= max row + 1][n_in] F32; y: [n_pairs][n_out] F32
/// (overwritten); alignment and dtype rules as for matmul. Experts with no pairs cost nothing.
/// With g.w2_*: also y2[p] = W2_e x[rows[p]] ([n_pairs][n_out], required then, nullptr otherwise); when
/// type2 == type in the same launches with the activations quantized once, else as a second call. y and y2
/// each equal a call with that list alone bit for bit; with g.glu, y = swiglu(y, y2) of those.
/// Pairs of at most one token per expert on the GEMV path (decode) quantize and gather their activations in
/// the GEMV kernel, with quantize_activations's arithmetic.
/// Asynchronous on `stream`.
void expert_matmul(const ExpertMatmul &g, const float *x, float *y, Workspace ws, cudaStream_t stream,
                   MatmulPath path = MatmulPath::AUTO, float *y2 = nullptr);

} // namespace prescope::cuda
