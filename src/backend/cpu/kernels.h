// Internal interface between the CPU ops and their per-ISA inner loops (scalar, AVX2, AVX-512).
// One table of function pointers per ISA; ops.cpp picks one at run time from the CPU's features.
#pragma once

#include "backend/cpu/ops.h"
#include "core/dtype.h"

#include <cstddef>
#include <cstdint>

namespace prescope::cpu {

/// Index of a weight dtype in KernelTable's per-dtype arrays; -1 for the activation-only Q8_1 / Q8_K.
inline int dtype_index(DType t) {
    switch (t) {
    case DType::F32: return 0;
    case DType::F16: return 1;
    case DType::BF16: return 2;
    case DType::Q8_0: return 3;
    case DType::Q4_0: return 4;
    case DType::Q4_1: return 5;
    case DType::Q5_0: return 6;
    case DType::Q5_1: return 7;
    case DType::Q2_K: return 8;
    case DType::Q3_K: return 9;
    case DType::Q4_K: return 10;
    case DType::Q5_K: return 11;
    case DType::Q6_K: return 12;
    case DType::IQ4_NL: return 13;
    case DType::IQ4_XS: return 14;
    case DType::MXFP4: return 15;
    case DType::Q8_1:
    case DType::Q8_K: break;
    }
    return -1;
}
constexpr int kNumWeightTypes = 16;

/// Index of an activation type (Q8_0, Q8_1, Q8_K) in KernelTable::quantize.
inline int act_index(DType a) { return a == DType::Q8_0 ? 0 : a == DType::Q8_1 ? 1 : 2; }

struct KernelTable {
    /// y[t * ldy + r] = dot(W row r, x + t * ldx) for r < n_rows, t < n_tok: F32 accumulation.
    /// W row r starts at w + r * w_stride bytes and holds n elements of the table slot's dtype
    /// (n a multiple of its block size). x: F32 (quantized weights are dequantized, not the activations).
    using GemvFn = void (*)(const uint8_t *w, size_t w_stride, int64_t n_rows, int64_t n, const float *x,
                            int64_t ldx, int64_t n_tok, float *y, int64_t ldy);
    /// The same product with the activations quantized: xq holds n_tok rows (stride xq_stride bytes) of
    /// x quantized to vec_dot_type(dtype) (quantize[]); integer dot products per block, F32 across blocks
    /// (ggml-cpu's ggml_vec_dot_<type>_<vec_dot_type>). Quantized dtypes only.
    using QGemvFn = void (*)(const uint8_t *w, size_t w_stride, int64_t n_rows, int64_t n, const uint8_t *xq,
                             size_t xq_stride, int64_t n_tok, float *y, int64_t ldy);
    /// dst[r * n + i] = W[r][i] as F32, for n_rows rows (stride w_stride bytes) of n elements; bit for bit
    /// dequantize_row (core/dtype.h).
    using ConvertFn = void (*)(const uint8_t *w, size_t w_stride, int64_t n_rows, int64_t n, float *dst);
    /// n F32 values (a multiple of the block size) into activation blocks at dst, bit for bit as
    /// core/dtype.h's quantize_row_q8_0 / _q8_1 / _q8_K.
    using QuantizeFn = void (*)(const float *x, void *dst, int64_t n);

    GemvFn gemv[kNumWeightTypes];        // by dtype_index
    QGemvFn qgemv[kNumWeightTypes];      // by dtype_index; nullptr for F32, F16, BF16
    ConvertFn convert[kNumWeightTypes];  // by dtype_index
    QuantizeFn quantize[3];              // by act_index
    /// out[i] += sum_j p[j] * v[j * v_stride + i] for i < n, j < n_rows (attention's P.V); F32.
    void (*weighted_row_sum)(const float *p, const float *v, int64_t v_stride, int64_t n_rows, int64_t n,
                             float *out);
    /// y[t * ldy + r] = sum_k w[r * n + k] * x[t][k] for r < n_rows, t < n_tok: F32 weight rows times
    /// activations packed transposed in blocks of gemm_tokens: xt[b][k][j] = x[b * gemm_tokens + j][k]
    /// (zero past n_tok). w holds round_up(n_rows, gemm_row_pad) rows (the extra ones are read, their
    /// results dropped).
    void (*gemm)(const float *w, int64_t n_rows, int64_t n, const float *xt, int64_t n_tok, float *y, int64_t ldy);
    /// Packs rows [k0, k1) of the transpose of x ([n_tok][n] F32) in gemm's layout: xt[b][k][j] =
    /// x[b * gemm_tokens + j][k], zero for b * gemm_tokens + j >= n_tok.
    void (*pack)(const float *x, int64_t n, int64_t n_tok, int64_t k0, int64_t k1, float *xt);
    int gemm_row_pad;  // weight rows of gemm's tiles are padded to a multiple of this
    int gemm_tokens;   // tokens per block of gemm's packed activations
};

/// Tables of each ISA. The AVX2 and AVX-512 ones may only be used when the CPU supports them.
const KernelTable &kernels_scalar();
const KernelTable &kernels_avx2();
const KernelTable &kernels_avx512();

/// The table of the ISA selected now (get_cpu_isa()).
const KernelTable &kernels();

/// Tokens from which matmul takes the tile + sgemm path instead of GEMV (a tuning knob: the
/// benchmark sweeps it; the default is the measured crossover).
int64_t gemm_min_tokens();
void set_gemm_min_tokens(int64_t n);

/// How the GEMM path multiplies an F32 weight tile (a knob for the benchmark; OWN is the default).
enum class GemmBackend {
    OWN,       // KernelTable::gemm on transposed activations
    OPENBLAS,  // cblas_sgemm, single-threaded inside our threads
};
GemmBackend gemm_backend();
void set_gemm_backend(GemmBackend b);

/// Threads a kernel should use when called from here: 1 inside an OpenMP parallel region,
/// get_threads() otherwise.
int threads_here();

} // namespace prescope::cpu
