// Internal interface between the CPU ops and their per-ISA inner loops (scalar, AVX2, AVX-512).
// One table of function pointers per ISA; ops.cpp picks one at run time from the CPU's features.
#pragma once

#include "backend/cpu/ops.h"
#include "core/dtype.h"

#include <cstddef>
#include <cstdint>

namespace prescope::cpu {

/// Index of a weight dtype in KernelTable's per-dtype arrays.
inline int dtype_index(DType t) {
    switch (t) {
    case DType::F32: return 0;
    case DType::F16: return 1;
    case DType::BF16: return 2;
    case DType::Q8_0: return 3;
    }
    return -1;
}
constexpr int kNumWeightTypes = 4;

struct KernelTable {
    /// y[t * ldy + r] = dot(W row r, x + t * ldx) for r < n_rows, t < n_tok: F32 accumulation.
    /// W row r starts at w + r * w_stride bytes and holds n elements of the table slot's dtype
    /// (Q8_0: n % 32 == 0). x: F32.
    using GemvFn = void (*)(const uint8_t *w, size_t w_stride, int64_t n_rows, int64_t n, const float *x,
                            int64_t ldx, int64_t n_tok, float *y, int64_t ldy);
    /// dst[r * n + i] = W[r][i] as F32, for n_rows rows (stride w_stride bytes) of n elements.
    using ConvertFn = void (*)(const uint8_t *w, size_t w_stride, int64_t n_rows, int64_t n, float *dst);

    GemvFn gemv[kNumWeightTypes];        // by dtype_index
    ConvertFn convert[kNumWeightTypes];  // by dtype_index
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
