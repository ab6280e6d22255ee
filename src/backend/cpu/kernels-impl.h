// Generic inner loops of the CPU kernels, written once over a small vector interface S and
// instantiated per ISA (kernels-scalar.cpp, kernels-avx2.cpp, kernels-avx512.cpp). Include it only
// from those files, after defining S, inside the ISA's target region.
//
// S provides: type V of N F32 lanes; zero, set1, load, store, add, mul, fmadd, reduce (horizontal
// sum); load_f16 / load_bf16 / load_q8 (N elements converted to F32); f16 (one scalar half);
// q8_scales (the F16 scales of consecutive Q8_0 blocks as F32); transpose8 (an 8 x 8 tile);
// max_tokens (tokens computed together per weight row by the GEMV); gemm_vecs (vectors of N tokens
// per GEMM register block), gemm_rows[v - 1] (weight rows of a block of v vectors) and gemm_row_pad
// (a multiple of every gemm_rows), all bounded by the register file; Quant, the integer dot products of
// the quantized weight types and the activation quantizers (vec-dot-scalar.h, vec-dot-x86.h).
#pragma once

#include "backend/cpu/kernels.h"
#include "core/dtype.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using prescope::BlockQ8_0;
using prescope::DType;
using prescope::QK8_0;

/// N weights of row w starting at element i, as F32 (D != Q8_0).
template <class S, DType D>
inline typename S::V load_weights(const uint8_t *w, int64_t i) {
    if constexpr (D == DType::F32) return S::load(reinterpret_cast<const float *>(w) + i);
    if constexpr (D == DType::F16) return S::load_f16(reinterpret_cast<const uint16_t *>(w) + i);
    if constexpr (D == DType::BF16) return S::load_bf16(reinterpret_cast<const uint16_t *>(w) + i);
}

/// One weight of row w as F32 (D != Q8_0), for row tails shorter than N.
template <class S, DType D>
inline float weight_at(const uint8_t *w, int64_t i) {
    float f;
    if constexpr (D == DType::F32) {
        std::memcpy(&f, w + 4 * i, 4);
    } else {
        uint16_t h;
        std::memcpy(&h, w + 2 * i, 2);
        f = D == DType::F16 ? S::f16(h) : prescope::bf16_to_fp32(h);
    }
    return f;
}

/// Independent accumulators per token: enough FMA chains in flight to hide the FMA latency.
template <int T>
constexpr int accumulators_per_token() {
    return T == 1 ? 4 : T == 2 ? 2 : 1;
}

/// out[t] = dot(row w, x + t * ldx) for t < T; n elements of dtype D (F32, F16 or BF16).
template <class S, DType D, int T>
void dot_row(const uint8_t *w, int64_t n, const float *x, int64_t ldx, float *out) {
    using V = typename S::V;
    constexpr int N = S::N, U = accumulators_per_token<T>();
    V acc[T][U];
    for (int t = 0; t < T; ++t)
        for (int u = 0; u < U; ++u) acc[t][u] = S::zero();
    int64_t i = 0;
    for (; i + U * N <= n; i += U * N) {
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
            const V wv = load_weights<S, D>(w, i + u * N);
#pragma GCC unroll 8
            for (int t = 0; t < T; ++t) acc[t][u] = S::fmadd(wv, S::load(x + t * ldx + i + u * N), acc[t][u]);
        }
    }
    for (; i + N <= n; i += N) {
        const V wv = load_weights<S, D>(w, i);
        for (int t = 0; t < T; ++t) acc[t][0] = S::fmadd(wv, S::load(x + t * ldx + i), acc[t][0]);
    }
    for (int t = 0; t < T; ++t) {
        V s = acc[t][0];
        for (int u = 1; u < U; ++u) s = S::add(s, acc[t][u]);
        float r = S::reduce(s);
        for (int64_t j = i; j < n; ++j) r += weight_at<S, D>(w, j) * x[t * ldx + j];
        out[t] = r;
    }
}

/// out[t] = dot(Q8_0 row w, x + t * ldx) for t < T; n % 32 == 0. Each 32-block is converted to F32
/// and scaled once, then used for all T tokens (activations are never quantized). The blocks' F16
/// scales are converted ahead, a chunk at a time, so the inner loop only broadcasts them from L1.
template <class S, int T>
void dot_row_q8_0(const uint8_t *w, int64_t n, const float *x, int64_t ldx, float *out) {
    using V = typename S::V;
    constexpr int N = S::N, VB = QK8_0 / N, U = accumulators_per_token<T>();
    // Blocks per iteration, so that all U chains are used (one token: one chain per block).
    constexpr int B = T == 1 ? U : U > VB ? U / VB : 1;
    constexpr int64_t kChunk = 64;          // blocks whose scales are converted together
    static_assert(QK8_0 % N == 0 && (T == 1 || (VB * B) % U == 0));
    const auto *blk = reinterpret_cast<const BlockQ8_0 *>(w);
    const int64_t nb = n / QK8_0;
    alignas(64) float scale[kChunk];
    V acc[T][U];
    for (int t = 0; t < T; ++t)
        for (int u = 0; u < U; ++u) acc[t][u] = S::zero();
    for (int64_t c0 = 0; c0 < nb; c0 += kChunk) {
        const int64_t nc = std::min(kChunk, nb - c0);
        S::q8_scales(blk + c0, nc, scale);
        auto step = [&](int64_t b, int k0) __attribute__((always_inline)) {
            const V d = S::set1(scale[b]);
            const int8_t *qs = blk[c0 + b].qs;
            const float *xb = x + (c0 + b) * QK8_0;
            if constexpr (T == 1) {
                // One token: sum the block unscaled, then one FMA with the scale (one multiply fewer).
                V h = S::mul(S::load_q8(qs), S::load(xb));
#pragma GCC unroll 4
                for (int j = 1; j < VB; ++j) h = S::fmadd(S::load_q8(qs + j * N), S::load(xb + j * N), h);
                acc[0][k0 / VB % U] = S::fmadd(d, h, acc[0][k0 / VB % U]);
            } else {
#pragma GCC unroll 4
                for (int j = 0; j < VB; ++j) {
                    const V wv = S::mul(S::load_q8(qs + j * N), d);
                    const int k = (k0 + j) % U;
#pragma GCC unroll 8
                    for (int t = 0; t < T; ++t) acc[t][k] = S::fmadd(wv, S::load(xb + t * ldx + j * N), acc[t][k]);
                }
            }
        };
        int64_t b = 0;
        for (; b + B <= nc; b += B) {
#pragma GCC unroll 4
            for (int bb = 0; bb < B; ++bb) step(b + bb, bb * VB);
        }
        for (; b < nc; ++b) step(b, 0);
    }
    for (int t = 0; t < T; ++t) {
        V s = acc[t][0];
        for (int u = 1; u < U; ++u) s = S::add(s, acc[t][u]);
        out[t] = S::reduce(s);
    }
}

template <class S, DType D, int T>
void dot_row_any(const uint8_t *w, int64_t n, const float *x, int64_t ldx, float *out) {
    if constexpr (D == DType::Q8_0) {
        dot_row_q8_0<S, T>(w, n, x, ldx, out);
    } else {
        dot_row<S, D, T>(w, n, x, ldx, out);
    }
}

using DotRowFn = void (*)(const uint8_t *, int64_t, const float *, int64_t, float *);

template <class S, DType D, int... Ts>
constexpr std::array<DotRowFn, sizeof...(Ts)> dot_row_table(std::integer_sequence<int, Ts...>) {
    return {&dot_row_any<S, D, Ts + 1>...};
}

/// KernelTable::GemvFn for dtype D: rows outer, tokens in groups of up to S::max_tokens inner, so a
/// weight row is read from memory once and from L1 for the following groups. With several tokens the
/// rows are walked in chunks of columns whose slice of x (all tokens) fits in L1; otherwise every row
/// would stream all of x from L2 again.
template <class S, DType D>
void gemv(const uint8_t *w, size_t w_stride, int64_t n_rows, int64_t n, const float *x, int64_t ldx,
          int64_t n_tok, float *y, int64_t ldy) {
    constexpr int TM = S::max_tokens;
    constexpr int64_t kXSliceBytes = 24 << 10;  // half of a 48 KiB L1: the weights stream through the rest
    constexpr int64_t kXWholeBytes = 32 << 10;  // x this small stays in L1 without chunks
    static constexpr auto dots = dot_row_table<S, D>(std::make_integer_sequence<int, TM>());
    const int64_t chunk = 4 * n_tok * n <= kXWholeBytes
                              ? n
                              : std::max<int64_t>(256, kXSliceBytes / (4 * n_tok) / QK8_0 * QK8_0);
    float out[TM];
    for (int64_t k0 = 0; k0 < n; k0 += chunk) {
        const int64_t nk = std::min(chunk, n - k0);
        const size_t offset = prescope::dtype_row_bytes(D, k0);  // k0 is a multiple of 32
        for (int64_t r = 0; r < n_rows; ++r) {
            const uint8_t *wr = w + size_t(r) * w_stride + offset;
            for (int64_t t0 = 0; t0 < n_tok; t0 += TM) {
                const int64_t nt = std::min<int64_t>(TM, n_tok - t0);
                dots[nt - 1](wr, nk, x + t0 * ldx + k0, ldx, out);
                float *yr = y + t0 * ldy + r;
                for (int64_t t = 0; t < nt; ++t) yr[t * ldy] = k0 == 0 ? out[t] : yr[t * ldy] + out[t];
            }
        }
    }
}

using QDotFn = void (*)(int64_t, const void *, const void *const *, float *);

template <class S, DType D, int... Ts>
constexpr std::array<QDotFn, sizeof...(Ts)> qdot_table(std::integer_sequence<int, Ts...>) {
    return {&S::Quant::template dot<D, Ts + 1>...};
}

/// KernelTable::QGemvFn for quantized dtype D: rows outer, tokens inner in groups of up to
/// S::Quant::kMaxTokens that share each block's unpacking (a row is read from memory once, from L1 after).
template <class S, DType D>
void qgemv(const uint8_t *w, size_t w_stride, int64_t n_rows, int64_t n, const uint8_t *xq, size_t xq_stride,
           int64_t n_tok, float *y, int64_t ldy) {
    constexpr int TM = S::Quant::kMaxTokens;
    static constexpr auto dots = qdot_table<S, D>(std::make_integer_sequence<int, TM>());
    const void *a[TM];
    float out[TM];
    for (int64_t r = 0; r < n_rows; ++r) {
        const uint8_t *wr = w + size_t(r) * w_stride;
        for (int64_t t0 = 0; t0 < n_tok; t0 += TM) {
            const int64_t nt = std::min<int64_t>(TM, n_tok - t0);
            for (int64_t t = 0; t < nt; ++t) a[t] = xq + size_t(t0 + t) * xq_stride;
            dots[nt - 1](n, wr, a, out);
            for (int64_t t = 0; t < nt; ++t) y[(t0 + t) * ldy + r] = out[t];
        }
    }
}

/// KernelTable::GemvFn for quantized dtypes other than Q8_0 (F32 activations): each row dequantized
/// into an L1 buffer, then the F32 GEMV on it.
template <class S, DType D>
void gemv_dequant(const uint8_t *w, size_t w_stride, int64_t n_rows, int64_t n, const float *x, int64_t ldx,
                  int64_t n_tok, float *y, int64_t ldy) {
    thread_local std::vector<float> row;
    row.resize(size_t(n));
    for (int64_t r = 0; r < n_rows; ++r) {
        S::Quant::template dequant_row<D>(w + size_t(r) * w_stride, row.data(), n);
        gemv<S, DType::F32>(reinterpret_cast<const uint8_t *>(row.data()), 0, 1, n, x, ldx, n_tok, y + r, ldy);
    }
}

/// KernelTable::ConvertFn for dtype D.
template <class S, DType D>
void convert(const uint8_t *w, size_t w_stride, int64_t n_rows, int64_t n, float *dst) {
    constexpr int N = S::N;
    for (int64_t r = 0; r < n_rows; ++r) {
        const uint8_t *src = w + size_t(r) * w_stride;
        float *d = dst + r * n;
        if constexpr (D != DType::F32 && D != DType::F16 && D != DType::BF16 && D != DType::Q8_0) {
            S::Quant::template dequant_row<D>(src, d, n);
        } else if constexpr (D == DType::Q8_0) {
            const auto *blk = reinterpret_cast<const BlockQ8_0 *>(src);
            for (int64_t b = 0; b < n / QK8_0; ++b) {
                const typename S::V scale = S::set1(S::f16(blk[b].d));
                for (int j = 0; j < QK8_0 / N; ++j)
                    S::store(d + b * QK8_0 + j * N, S::mul(S::load_q8(blk[b].qs + j * N), scale));
            }
        } else {
            int64_t i = 0;
            for (; i + N <= n; i += N) S::store(d + i, load_weights<S, D>(src, i));
            for (; i < n; ++i) d[i] = weight_at<S, D>(src, i);
        }
    }
}

/// KernelTable::weighted_row_sum: columns in blocks of C vectors held in registers, rows inner.
template <class S>
void weighted_row_sum(const float *p, const float *v, int64_t v_stride, int64_t n_rows, int64_t n, float *out) {
    using V = typename S::V;
    constexpr int N = S::N, C = 8;
    int64_t i = 0;
    for (; i + C * N <= n; i += C * N) {
        V acc[C];
        for (int c = 0; c < C; ++c) acc[c] = S::load(out + i + c * N);
        for (int64_t j = 0; j < n_rows; ++j) {
            const V pj = S::set1(p[j]);
            const float *vj = v + j * v_stride + i;
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) acc[c] = S::fmadd(pj, S::load(vj + c * N), acc[c]);
        }
        for (int c = 0; c < C; ++c) S::store(out + i + c * N, acc[c]);
    }
    for (; i + N <= n; i += N) {
        V acc = S::load(out + i);
        for (int64_t j = 0; j < n_rows; ++j) acc = S::fmadd(S::set1(p[j]), S::load(v + j * v_stride + i), acc);
        S::store(out + i, acc);
    }
    for (; i < n; ++i) {
        float acc = out[i];
        for (int64_t j = 0; j < n_rows; ++j) acc += p[j] * v[j * v_stride + i];
        out[i] = acc;
    }
}

/// KernelTable::pack: rows [k0, k1) of x's transpose in blocks of TB tokens, 8 x 8 tiles at a time.
template <class S>
void pack(const float *x, int64_t n, int64_t n_tok, int64_t k0, int64_t k1, float *xt) {
    constexpr int64_t TB = S::gemm_vecs * S::N;
    for (int64_t b = 0; b * TB < n_tok; ++b) {
        const int64_t nt = std::min(TB, n_tok - b * TB);
        const float *xb = x + b * TB * n;
        float *xtb = xt + b * n * TB;
        int64_t j = 0;
        for (; j + 8 <= nt; j += 8) {
            int64_t k = k0;
            for (; k + 8 <= k1; k += 8) S::transpose8(xb + j * n + k, n, xtb + k * TB + j, TB);
            for (; k < k1; ++k)
                for (int64_t jj = j; jj < j + 8; ++jj) xtb[k * TB + jj] = xb[jj * n + k];
        }
        for (; j < nt; ++j)
            for (int64_t k = k0; k < k1; ++k) xtb[k * TB + j] = xb[j * n + k];
        for (int64_t k = k0; k < k1; ++k) std::fill(xtb + k * TB + nt, xtb + (k + 1) * TB, 0.0f);
    }
}

/// R x TV register block of a GEMM, outer-product form: out[r][v*N + l] = sum_k w[r][k] * xt[k][v*N + l].
/// w: R F32 rows (stride ldw), xt: the activations transposed, [n][ldxt] (token index fastest), so
/// each k costs TV vector loads, R broadcasts and R*TV FMAs, all accumulators in registers.
template <class S, int R, int TV>
void gemm_block(const float *w, int64_t ldw, const float *xt, int64_t ldxt, int64_t n, float *out) {
    using V = typename S::V;
    constexpr int N = S::N;
    V acc[R][TV];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < TV; ++v) acc[r][v] = S::zero();
    for (int64_t k = 0; k < n; ++k) {
        V xv[TV];
#pragma GCC unroll 4
        for (int v = 0; v < TV; ++v) xv[v] = S::load(xt + k * ldxt + v * N);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const V wb = S::set1(w[r * ldw + k]);
#pragma GCC unroll 4
            for (int v = 0; v < TV; ++v) acc[r][v] = S::fmadd(wb, xv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < TV; ++v) S::store(out + (r * TV + v) * N, acc[r][v]);
}

using GemmBlockFn = void (*)(const float *, int64_t, const float *, int64_t, int64_t, float *);

template <class S, int... Vs>
constexpr std::array<GemmBlockFn, sizeof...(Vs)> gemm_block_table(std::integer_sequence<int, Vs...>) {
    return {&gemm_block<S, S::gemm_rows[Vs], Vs + 1>...};
}

/// KernelTable::gemm: token blocks of gemm_vecs * N outer (each a contiguous [n][block] slice of xt,
/// read from L2), row blocks inner (the F32 weight tile stays in L2 too). A block of v token vectors
/// takes gemm_rows[v - 1] rows: enough accumulators to hide the FMA latency when v is small.
template <class S>
void gemm(const float *w, int64_t n_rows, int64_t n, const float *xt, int64_t n_tok, float *y, int64_t ldy) {
    constexpr int N = S::N, TVM = S::gemm_vecs, TB = TVM * N;
    static_assert(std::size(S::gemm_rows) == TVM);
    static constexpr auto blocks = gemm_block_table<S>(std::make_integer_sequence<int, TVM>());
    alignas(64) float out[S::gemm_row_pad * TB];
    for (int64_t t0 = 0; t0 < n_tok; t0 += TB) {
        const int64_t nt = std::min<int64_t>(TB, n_tok - t0);
        const int64_t tv = (nt + N - 1) / N;
        const int64_t R = S::gemm_rows[tv - 1];
        const float *xb = xt + t0 * n;  // block t0 / TB: [n][TB]
        for (int64_t r0 = 0; r0 < n_rows; r0 += R) {
            blocks[tv - 1](w + r0 * n, n, xb, TB, n, out);
            const int64_t nr = std::min<int64_t>(R, n_rows - r0);
            // Token-major, so each token's nr outputs go to consecutive addresses of y.
            for (int64_t t = 0; t < nt; ++t) {
                float *yt = y + (t0 + t) * ldy + r0;
                for (int64_t r = 0; r < nr; ++r) yt[r] = out[r * tv * N + t];
            }
        }
    }
}

/// Fills the per-dtype slots of k for weight dtype D.
template <class S, DType D>
void set_dtype_kernels(prescope::cpu::KernelTable &k) {
    const int i = prescope::cpu::dtype_index(D);
    k.convert[i] = &convert<S, D>;
    if constexpr (D == DType::F32 || D == DType::F16 || D == DType::BF16) {
        k.gemv[i] = &gemv<S, D>;
    } else {
        if constexpr (D == DType::Q8_0) {
            k.gemv[i] = &gemv<S, D>;
        } else {
            k.gemv[i] = &gemv_dequant<S, D>;
        }
        k.qgemv[i] = &qgemv<S, D>;
    }
}

template <class S, DType... Ds>
void set_all_dtype_kernels(prescope::cpu::KernelTable &k) {
    (set_dtype_kernels<S, Ds>(k), ...);
}

template <class S>
prescope::cpu::KernelTable make_kernel_table() {
    prescope::cpu::KernelTable k{};
    set_all_dtype_kernels<S, DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0,
                          DType::Q5_1, DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL,
                          DType::IQ4_XS, DType::MXFP4>(k);
    k.quantize[0] = &S::Quant::quantize_q8_0;
    k.quantize[1] = &S::Quant::quantize_q8_1;
    k.quantize[2] = &S::Quant::quantize_q8_K;
    k.weighted_row_sum = &weighted_row_sum<S>;
    k.gemm = &gemm<S>;
    k.gemm_row_pad = S::gemm_row_pad;
    k.pack = &pack<S>;
    k.gemm_tokens = S::gemm_vecs * S::N;
    return k;
}

} // namespace
