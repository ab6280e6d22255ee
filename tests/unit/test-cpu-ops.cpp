// CPU kernels (backend/cpu/ops.h) against plain double-precision references on random inputs of odd
// sizes, for every instruction set this CPU supports and 1 and 2 threads. Outputs are poisoned with
// NaN before each run and every comparison fails on NaN.
//
// Thresholds (all derived from F32 rounding, stated per test):
// - matmul: |y - ref| <= 2e-5 * sum_i |w_i x_i| against the weights as stored and the activations as
//   multiplied (F32 accumulation of up to 4096 products); for Q8_0 under ActivationQuant::INT8 (the
//   default) those are x quantized to Q8_0 and back (tests/unit/test-quant.cpp covers the other
//   quantized types). Against the original F32 weights and activations the bound grows by the dtype's
//   rounding: F16 1e-3, BF16 8e-3, Q8_0 1.6e-2 (half a quantization step per weight), plus 1e-2 for
//   quantized activations.
// - rms_norm, softmax, swiglu: relative 1e-5 per element.
// - rope: |err| <= 5e-7 * (1 + theta) * |pair| (the angle is an F32 product pos * inv_freq, as in HF).
// - attention: |err| <= 2e-5 * sum_j p_j |v_j| per output element.
// - get_rows, add_bias, top_k: exact.
#include "../common/random-blocks.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/ops.h"
#include "core/dtype.h"
#include "core/error.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

using namespace prescope;
using namespace prescope::cpu;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> random_floats(size_t n, std::mt19937 &rng, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float &e : v) e = dist(rng);
    return v;
}

/// |got[i] - ref[i]| <= tol * scale[i] for every i; NaN or infinity in got fails.
::testing::AssertionResult all_close(const std::vector<float> &got, const std::vector<double> &ref,
                                     const std::vector<double> &scale, double tol) {
    if (got.size() != ref.size() || ref.size() != scale.size()) return ::testing::AssertionFailure() << "size mismatch";
    double worst = 0.0;
    size_t worst_i = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        const double err = std::fabs(double(got[i]) - ref[i]);
        if (!(err <= tol * scale[i]))  // also catches NaN
            return ::testing::AssertionFailure() << "element " << i << ": got " << got[i] << ", expected " << ref[i]
                                                 << " (error " << err << " > " << tol << " * " << scale[i] << ")";
        const double rel = scale[i] > 0 ? err / scale[i] : 0.0;
        if (rel > worst) worst = rel, worst_i = i;
    }
    return ::testing::AssertionSuccess() << "worst relative error " << worst << " at " << worst_i;
}

/// Relative comparison: scale[i] = |ref[i]| (plus a floor for exact zeros).
::testing::AssertionResult rel_close(const std::vector<float> &got, const std::vector<double> &ref, double tol) {
    std::vector<double> scale(ref.size());
    for (size_t i = 0; i < ref.size(); ++i) scale[i] = std::fabs(ref[i]) + 1e-30;
    return all_close(got, ref, scale, tol);
}

bool bitwise_equal(const std::vector<float> &a, const std::vector<float> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<CpuIsa> supported_isas() {
    std::vector<CpuIsa> v;
    for (CpuIsa i : {CpuIsa::SCALAR, CpuIsa::AVX2, CpuIsa::AVX512})
        if (i <= cpu_isa_supported()) v.push_back(i);
    return v;
}

/// Runs body once per (supported ISA, thread count in {1, 2}), then restores the defaults.
template <class F>
void for_each_config(F body) {
    for (CpuIsa isa : supported_isas()) {
        for (int threads : {1, 2}) {
            SCOPED_TRACE(std::string("isa ") + cpu_isa_name(isa) + ", threads " + std::to_string(threads));
            set_cpu_isa(isa);
            set_threads(threads);
            body();
        }
    }
    set_cpu_isa(cpu_isa_supported());
    set_threads(0);
}

/// A weight matrix converted to dtype `type` with core/dtype.h, with the values it holds exactly
/// (dequantized, as double) and the F32 values it was made from.
struct Weights {
    DType type;
    int64_t n_in, n_out;
    std::vector<uint8_t> bytes;
    std::vector<double> stored;    // [n_out][n_in]
    std::vector<float> original;   // [n_out][n_in]
};

Weights make_weights(DType type, int64_t n_in, int64_t n_out, std::mt19937 &rng) {
    Weights w{type, n_in, n_out, {}, {}, random_floats(size_t(n_in * n_out), rng)};
    const size_t row_bytes = dtype_row_bytes(type, n_in);
    w.bytes.resize(row_bytes * size_t(n_out));
    for (int64_t r = 0; r < n_out; ++r)
        convert_row_from_f32(type, w.original.data() + r * n_in, w.bytes.data() + size_t(r) * row_bytes, n_in);
    std::vector<float> row(static_cast<size_t>(n_in));
    for (int64_t r = 0; r < n_out; ++r) {
        dequantize_row(type, w.bytes.data() + size_t(r) * row_bytes, row.data(), n_in);
        w.stored.insert(w.stored.end(), row.begin(), row.end());
    }
    return w;
}

/// Reference y = W x in double over the given weight values; scale[t][o] = sum_i |w_oi x_ti|.
template <class T>
void reference_matmul(const std::vector<T> &w, int64_t n_in, int64_t n_out, const std::vector<float> &x,
                      int64_t n_tok, std::vector<double> &y, std::vector<double> &scale) {
    y.assign(size_t(n_tok * n_out), 0.0);
    scale.assign(size_t(n_tok * n_out), 0.0);
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t o = 0; o < n_out; ++o) {
            double s = 0.0, a = 0.0;
            for (int64_t i = 0; i < n_in; ++i) {
                const double p = double(w[size_t(o * n_in + i)]) * double(x[size_t(t * n_in + i)]);
                s += p;
                a += std::fabs(p);
            }
            y[size_t(t * n_out + o)] = s;
            scale[size_t(t * n_out + o)] = a;
        }
}

/// The activations a product with weights of `type` multiplies now: x, or (ActivationQuant::INT8,
/// quantized weights) each token's x quantized to vec_dot_type(type) and back.
std::vector<float> multiplied(DType type, const std::vector<float> &x, int64_t n_in) {
    if (!quantizes_activations(type)) return x;
    const DType a = vec_dot_type(type);
    std::vector<uint8_t> q(dtype_row_bytes(a, n_in));
    std::vector<float> out(x.size());
    for (size_t t = 0; t < x.size() / size_t(n_in); ++t) {
        quantize_activations(a, x.data() + t * size_t(n_in), q.data(), n_in);
        dequantize_row(a, q.data(), out.data() + t * size_t(n_in), n_in);
    }
    return out;
}

double quantization_tolerance(DType t) {
    const double act = quantizes_activations(t) ? 1e-2 : 0.0;
    switch (t) {
    case DType::F32: return 2e-5;
    case DType::F16: return 1e-3;
    case DType::BF16: return 8e-3;
    case DType::Q8_0: return 1.6e-2 + act;
    default: break;
    }
    return 0.0;
}

/// Runs body under each activation mode, then restores the default.
template <class F>
void for_each_activation_mode(F body) {
    for (ActivationQuant a : {ActivationQuant::INT8, ActivationQuant::NONE}) {
        SCOPED_TRACE(a == ActivationQuant::INT8 ? "int8 activations" : "f32 activations");
        set_activation_quant(a);
        body();
    }
    set_activation_quant(ActivationQuant::INT8);
}

constexpr double kMatmulTol = 2e-5;
const DType kWeightTypes[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0};

} // namespace

// ---------------------------------------------------------------------------------------------
// threads and ISA

TEST(CpuOps, ThreadCountDefaultsToPhysicalCores) {
    const int cores = physical_cores();
    EXPECT_GE(cores, 1);
    set_threads(0);
    EXPECT_EQ(get_threads(), cores);
    set_threads(3);
    EXPECT_EQ(get_threads(), 3);
    set_threads(0);
    EXPECT_EQ(get_threads(), cores);
}

TEST(CpuOps, IsaSelection) {
    const CpuIsa best = cpu_isa_supported();
    EXPECT_EQ(get_cpu_isa(), best);  // the tests run without PRESCOPE_CPU_ISA
    if (best < CpuIsa::AVX512) EXPECT_THROW(set_cpu_isa(CpuIsa::AVX512), Error);
    set_cpu_isa(CpuIsa::SCALAR);
    EXPECT_EQ(get_cpu_isa(), CpuIsa::SCALAR);
    set_cpu_isa(best);
    EXPECT_STREQ(cpu_isa_name(CpuIsa::AVX2), "avx2");
}

// ---------------------------------------------------------------------------------------------
// matmul

TEST(CpuOps, MatmulMatchesReference) {
    std::mt19937 rng(1234);
    for (DType type : kWeightTypes) {
        std::vector<int64_t> n_ins = {32, 96, 768, 4096};
        // Row tails shorter than a vector; 2085 also splits into column chunks with a tail in the last.
        if (type != DType::Q8_0) n_ins.insert(n_ins.end(), {37, 129, 2085});
        for (int64_t n_in : n_ins) {
            for (int64_t n_out : {5, 67}) {
                const Weights w = make_weights(type, n_in, n_out, rng);
                // 1: decode GEMV; 3, 9: token groups (9 = 8 + 1); 17, 40: tile + sgemm path.
                for (int64_t n_tok : {1, 3, 9, 17, 40}) {
                    SCOPED_TRACE(std::string(dtype_name(type)) + " n_in " + std::to_string(n_in) + " n_out " +
                                 std::to_string(n_out) + " n_tok " + std::to_string(n_tok));
                    const std::vector<float> x = random_floats(size_t(n_tok * n_in), rng);
                    std::vector<double> ref_orig, scale_orig;
                    reference_matmul(w.original, n_in, n_out, x, n_tok, ref_orig, scale_orig);
                    for_each_activation_mode([&] {
                        std::vector<double> ref, scale;
                        reference_matmul(w.stored, n_in, n_out, multiplied(type, x, n_in), n_tok, ref, scale);
                        for_each_config([&] {
                            std::vector<float> y(size_t(n_tok * n_out), kNaN);
                            matmul(type, w.bytes.data(), n_in, n_out, x.data(), n_tok, y.data());
                            EXPECT_TRUE(all_close(y, ref, scale, kMatmulTol));
                            EXPECT_TRUE(all_close(y, ref_orig, scale_orig, quantization_tolerance(type)));
                        });
                    });
                }
            }
        }
    }
}

TEST(CpuOps, MatmulTensorViewUsesMatrixM) {
    std::mt19937 rng(7);
    const int64_t n_in = 64, n_out = 9, n_mat = 3;
    const Weights w = make_weights(DType::Q8_0, n_in, n_out * n_mat, rng);
    TensorView view;
    view.name = "blk.0.ffn_up_exps.weight";
    view.type = DType::Q8_0;
    view.ne = {n_in, n_out, n_mat, 1};
    view.data = w.bytes.data();
    const std::vector<float> x = random_floats(size_t(n_in), rng);
    std::vector<double> ref, scale;
    reference_matmul(w.stored, n_in, n_out * n_mat, multiplied(DType::Q8_0, x, n_in), 1, ref, scale);
    std::vector<float> y(size_t(n_out), kNaN);
    matmul(view, x.data(), 1, y.data(), 2);
    EXPECT_TRUE(all_close(y, std::vector<double>(ref.begin() + 2 * n_out, ref.end()),
                          std::vector<double>(scale.begin() + 2 * n_out, scale.end()), kMatmulTol));
}

TEST(CpuOps, MatmulSingleTokenMatchesRowOfBatch) {
    std::mt19937 rng(99);
    const int64_t n_in = 768, n_out = 70, n_tok = 17;  // the batch takes the sgemm path
    for (DType type : kWeightTypes) {
        SCOPED_TRACE(dtype_name(type));
        const Weights w = make_weights(type, n_in, n_out, rng);
        const std::vector<float> x = random_floats(size_t(n_tok * n_in), rng);
        std::vector<double> ref, scale;
        reference_matmul(w.stored, n_in, n_out, multiplied(type, x, n_in), n_tok, ref, scale);
        for_each_config([&] {
            std::vector<float> batch(size_t(n_tok * n_out), kNaN), single(size_t(n_tok * n_out), kNaN);
            matmul(type, w.bytes.data(), n_in, n_out, x.data(), n_tok, batch.data());
            for (int64_t t = 0; t < n_tok; ++t)
                matmul(type, w.bytes.data(), n_in, n_out, x.data() + t * n_in, 1, single.data() + t * n_out);
            // Both against the reference, and against each other within the sum of the two bounds.
            EXPECT_TRUE(all_close(batch, ref, scale, kMatmulTol));
            EXPECT_TRUE(all_close(single, ref, scale, kMatmulTol));
            EXPECT_TRUE(all_close(single, std::vector<double>(batch.begin(), batch.end()), scale, 2 * kMatmulTol));
        });
    }
}

TEST(CpuOps, MatmulInsideParallelRegion) {
    std::mt19937 rng(5);
    const int64_t n_in = 256, n_out = 48, n_tok = 6;
    for (DType type : kWeightTypes) {
        SCOPED_TRACE(dtype_name(type));
        const Weights w = make_weights(type, n_in, n_out, rng);
        const std::vector<float> x = random_floats(size_t(n_tok * n_in), rng);
        std::vector<double> ref, scale;
        reference_matmul(w.stored, n_in, n_out, multiplied(type, x, n_in), n_tok, ref, scale);
        set_threads(2);
        std::vector<float> outside(size_t(n_tok * n_out), kNaN), inside(size_t(n_tok * n_out), kNaN);
        for (int64_t t = 0; t < n_tok; ++t)
            matmul(type, w.bytes.data(), n_in, n_out, x.data() + t * n_in, 1, outside.data() + t * n_out);
        // Each OpenMP thread multiplies its own tokens; the kernel must run serially in it.
#pragma omp parallel num_threads(2)
        {
            for (int64_t t = omp_get_thread_num(); t < n_tok; t += omp_get_num_threads())
                matmul(type, w.bytes.data(), n_in, n_out, x.data() + t * n_in, 1, inside.data() + t * n_out);
        }
        EXPECT_TRUE(all_close(inside, ref, scale, kMatmulTol));
        // Same call (one token, GEMV), same per-row arithmetic: the thread split must not change a bit.
        EXPECT_TRUE(bitwise_equal(inside, outside));
        set_threads(0);
    }
}

TEST(CpuOps, MatmulBatchMatchesReference) {
    std::mt19937 rng(11);
    const int64_t n_in = 96, n_out = 40;
    const int64_t toks[] = {0, 1, 3, 20, 2, 33, 70};  // empty, GEMV and GEMM jobs (70: two token blocks)
    for (DType type : kWeightTypes) {
        SCOPED_TRACE(dtype_name(type));
        std::vector<Weights> ws;
        std::vector<std::vector<float>> xs, ys;
        std::vector<std::vector<double>> refs, scales;
        for (int64_t nt : toks) {
            ws.push_back(make_weights(type, n_in, n_out, rng));
            xs.push_back(random_floats(size_t(nt * n_in), rng));
            refs.emplace_back();
            scales.emplace_back();
            reference_matmul(ws.back().stored, n_in, n_out, multiplied(type, xs.back(), n_in), nt, refs.back(),
                             scales.back());
        }
        for (GemmBackend backend : {GemmBackend::OWN, GemmBackend::OPENBLAS}) {
            SCOPED_TRACE(backend == GemmBackend::OWN ? "own gemm" : "openblas");
            set_gemm_backend(backend);
            for_each_config([&] {
                std::vector<MatmulJob> jobs;
                ys.assign(std::size(toks), {});
                for (size_t j = 0; j < std::size(toks); ++j) {
                    ys[j].assign(size_t(toks[j] * n_out), kNaN);
                    jobs.push_back({ws[j].bytes.data(), xs[j].data(), toks[j], ys[j].data()});
                }
                matmul_batch(type, n_in, n_out, jobs.data(), int64_t(jobs.size()));
                for (size_t j = 0; j < std::size(toks); ++j)
                    EXPECT_TRUE(all_close(ys[j], refs[j], scales[j], kMatmulTol));
            });
        }
        set_gemm_backend(GemmBackend::OWN);
    }
}

// ---------------------------------------------------------------------------------------------
// embeddings, bias, norms, activations, top-k

TEST(CpuOps, GetRowsIsExact) {
    std::mt19937 rng(3);
    const int64_t n_embd = 96, n_vocab = 50;
    const int32_t ids[] = {0, 49, 7, 7, 31};
    for (DType type : kWeightTypes) {
        SCOPED_TRACE(dtype_name(type));
        const Weights w = make_weights(type, n_embd, n_vocab, rng);
        TensorView table;
        table.name = "token_embd.weight";
        table.type = type;
        table.ne = {n_embd, n_vocab, 1, 1};
        table.data = w.bytes.data();
        for_each_config([&] {
            std::vector<float> out(std::size(ids) * size_t(n_embd), kNaN);
            get_rows(table, ids, int64_t(std::size(ids)), out.data());
            std::vector<float> expected;
            for (int32_t id : ids)
                for (int64_t i = 0; i < n_embd; ++i) expected.push_back(float(w.stored[size_t(id * n_embd + i)]));
            EXPECT_TRUE(bitwise_equal(out, expected));
        });
    }
}

TEST(CpuOps, AddBias) {
    std::mt19937 rng(4);
    const int64_t n_tok = 3, n_out = 37;
    const std::vector<float> y0 = random_floats(size_t(n_tok * n_out), rng), b = random_floats(size_t(n_out), rng);
    std::vector<float> y = y0, expected(y0.size());
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t o = 0; o < n_out; ++o) expected[size_t(t * n_out + o)] = y0[size_t(t * n_out + o)] + b[size_t(o)];
    add_bias(y.data(), b.data(), n_tok, n_out);
    EXPECT_TRUE(bitwise_equal(y, expected));
}

TEST(CpuOps, RmsNormMatchesReference) {
    std::mt19937 rng(21);
    for (int64_t n : {32, 37, 2048, 4096}) {
        for (int64_t n_rows : {1, 3, 17}) {
            SCOPED_TRACE("n " + std::to_string(n) + " rows " + std::to_string(n_rows));
            const std::vector<float> x = random_floats(size_t(n * n_rows), rng, -3.0f, 3.0f);
            const std::vector<float> w = random_floats(size_t(n), rng, 0.5f, 1.5f);
            const float eps = 1e-6f;
            std::vector<double> ref(x.size());
            for (int64_t r = 0; r < n_rows; ++r) {
                double ss = 0.0;
                for (int64_t i = 0; i < n; ++i) ss += double(x[size_t(r * n + i)]) * x[size_t(r * n + i)];
                const double s = 1.0 / std::sqrt(ss / double(n) + double(eps));
                for (int64_t i = 0; i < n; ++i) ref[size_t(r * n + i)] = double(w[size_t(i)]) * x[size_t(r * n + i)] * s;
            }
            for_each_config([&] {
                std::vector<float> y(x.size(), kNaN);
                rms_norm(x.data(), w.data(), n_rows, n, eps, y.data());
                EXPECT_TRUE(rel_close(y, ref, 1e-5));
                std::vector<float> inplace = x;  // y may alias x
                rms_norm(inplace.data(), w.data(), n_rows, n, eps, inplace.data());
                EXPECT_TRUE(rel_close(inplace, ref, 1e-5));
            });
        }
    }
}

TEST(CpuOps, RopeMatchesReference) {
    std::mt19937 rng(31);
    const float base = 1e6f;  // Qwen3's rope_theta
    for (RopeMode mode : {RopeMode::NORM, RopeMode::NEOX}) {
        for (int64_t head_dim : {64, 128}) {
            for (int64_t n_tok : {1, 3, 17}) {
                SCOPED_TRACE(std::string(mode == RopeMode::NORM ? "norm" : "neox") + " head_dim " +
                             std::to_string(head_dim) + " n_tok " + std::to_string(n_tok));
                const int64_t n_head = 3, half = head_dim / 2;
                const std::vector<float> x = random_floats(size_t(n_tok * n_head * head_dim), rng);
                std::vector<int32_t> pos(static_cast<size_t>(n_tok));
                std::uniform_int_distribution<int32_t> pos_dist(1, 5000);
                for (int32_t &p : pos) p = pos_dist(rng);
                std::vector<double> ref(x.size()), scale(x.size());
                for (int64_t t = 0; t < n_tok; ++t)
                    for (int64_t h = 0; h < n_head; ++h)
                        for (int64_t i = 0; i < half; ++i) {
                            const double theta = pos[size_t(t)] * std::pow(double(base), -2.0 * double(i) / double(head_dim));
                            const int64_t i0 = (t * n_head + h) * head_dim + (mode == RopeMode::NORM ? 2 * i : i);
                            const int64_t i1 = i0 + (mode == RopeMode::NORM ? 1 : half);
                            const double a = x[size_t(i0)], b = x[size_t(i1)];
                            ref[size_t(i0)] = a * std::cos(theta) - b * std::sin(theta);
                            ref[size_t(i1)] = a * std::sin(theta) + b * std::cos(theta);
                            scale[size_t(i0)] = scale[size_t(i1)] = (1.0 + theta) * std::hypot(a, b);
                        }
                for_each_config([&] {
                    std::vector<float> y = x;
                    rope(y.data(), n_tok, n_head, head_dim, pos.data(), base, mode);
                    EXPECT_TRUE(all_close(y, ref, scale, 5e-7));
                });
            }
        }
    }
}

TEST(CpuOps, SoftmaxMatchesReference) {
    std::mt19937 rng(41);
    for (int64_t n : {1, 8, 128, 1000}) {
        for (int64_t n_rows : {1, 3, 17}) {
            SCOPED_TRACE("n " + std::to_string(n) + " rows " + std::to_string(n_rows));
            const std::vector<float> x = random_floats(size_t(n * n_rows), rng, -50.0f, 50.0f);
            std::vector<double> ref(x.size());
            for (int64_t r = 0; r < n_rows; ++r) {
                const float *v = x.data() + r * n;
                const double mx = *std::max_element(v, v + n);
                double sum = 0.0;
                for (int64_t i = 0; i < n; ++i) sum += std::exp(double(v[i]) - mx);
                for (int64_t i = 0; i < n; ++i) ref[size_t(r * n + i)] = std::exp(double(v[i]) - mx) / sum;
            }
            for_each_config([&] {
                std::vector<float> y = x;
                softmax(y.data(), n_rows, n);
                EXPECT_TRUE(rel_close(y, ref, 1e-5));
            });
        }
    }
}

TEST(CpuOps, SwigluMatchesReference) {
    std::mt19937 rng(51);
    for (int64_t n : {1, 37, 768, 100000}) {
        SCOPED_TRACE("n " + std::to_string(n));
        const std::vector<float> gate = random_floats(size_t(n), rng, -20.0f, 20.0f);
        const std::vector<float> up = random_floats(size_t(n), rng, -3.0f, 3.0f);
        std::vector<double> ref(static_cast<size_t>(n));
        for (size_t i = 0; i < ref.size(); ++i) ref[i] = double(gate[i]) / (1.0 + std::exp(-double(gate[i]))) * up[i];
        for_each_config([&] {
            std::vector<float> out(size_t(n), kNaN);
            swiglu(gate.data(), up.data(), out.data(), n);
            EXPECT_TRUE(rel_close(out, ref, 1e-5));
            std::vector<float> inplace = gate;  // out may alias gate
            swiglu(inplace.data(), up.data(), inplace.data(), n);
            EXPECT_TRUE(rel_close(inplace, ref, 1e-5));
        });
    }
}

// gpt-oss's clamped SwiGLU against HF GptOssExperts._apply_gate in double, over inputs on both sides of both clamps.
TEST(CpuOps, SwigluOaiMatchesReference) {
    std::mt19937 rng(52);
    const double alpha = kSwigluOaiAlpha, limit = kSwigluOaiLimit;
    for (int64_t n : {1, 37, 100000}) {
        SCOPED_TRACE("n " + std::to_string(n));
        const std::vector<float> gate = random_floats(size_t(n), rng, -20.0f, 20.0f);
        const std::vector<float> up = random_floats(size_t(n), rng, -12.0f, 12.0f);
        std::vector<double> ref(static_cast<size_t>(n));
        for (size_t i = 0; i < ref.size(); ++i) {
            const double g = std::min(double(gate[i]), limit), u = std::clamp(double(up[i]), -limit, limit);
            ref[i] = g / (1.0 + std::exp(-alpha * g)) * (u + 1.0);
        }
        for_each_config([&] {
            std::vector<float> out(size_t(n), kNaN);
            swiglu_oai(gate.data(), up.data(), out.data(), n, kSwigluOaiAlpha, kSwigluOaiLimit);
            EXPECT_TRUE(rel_close(out, ref, 1e-5));
            std::vector<float> inplace = gate;  // out may alias gate
            swiglu_oai(inplace.data(), up.data(), inplace.data(), n, kSwigluOaiAlpha, kSwigluOaiLimit);
            EXPECT_TRUE(rel_close(inplace, ref, 1e-5));
        });
    }
    // By hand: gate 9 clamps to 7, up -9 to -7; gate -3 is not clamped from below, up 2 not at all.
    float g[2] = {9.0f, -3.0f};
    const float u[2] = {-9.0f, 2.0f};
    swiglu_oai(g, u, g, 2, kSwigluOaiAlpha, kSwigluOaiLimit);
    EXPECT_NEAR(g[0], 7.0 / (1.0 + std::exp(-1.702 * 7.0)) * -6.0, 1e-5);
    EXPECT_NEAR(g[1], -3.0 / (1.0 + std::exp(1.702 * 3.0)) * 3.0, 1e-6);
}

TEST(CpuOps, TopKOrdersDescendingWithTiesToLowerIndex) {
    std::mt19937 rng(61);
    std::vector<float> scores = random_floats(128, rng);
    scores[10] = scores[90] = scores[50] = 2.0f;  // a three-way tie at the top
    scores[3] = kNaN;                              // NaN ranks last
    for (int64_t k : {1, 4, 8, 128}) {
        std::vector<int32_t> ids(size_t(k), -1);
        std::vector<float> values(size_t(k), kNaN);
        top_k(scores.data(), 128, k, ids.data(), values.data());
        std::vector<int32_t> expected(128);
        std::iota(expected.begin(), expected.end(), 0);
        std::stable_sort(expected.begin(), expected.end(), [&](int32_t a, int32_t b) {
            const bool na = std::isnan(scores[size_t(a)]), nb = std::isnan(scores[size_t(b)]);
            if (na != nb) return nb;
            return !na && scores[size_t(a)] > scores[size_t(b)];
        });
        for (int64_t i = 0; i < k; ++i) {
            EXPECT_EQ(ids[size_t(i)], expected[size_t(i)]) << "rank " << i;
            const float want = scores[size_t(expected[size_t(i)])];
            if (std::isnan(want)) EXPECT_TRUE(std::isnan(values[size_t(i)]));
            else EXPECT_EQ(values[size_t(i)], want);
        }
        if (k >= 3) EXPECT_EQ((std::vector<int32_t>{ids[0], ids[1], ids[2]}), (std::vector<int32_t>{10, 50, 90}));
    }
}

// ---------------------------------------------------------------------------------------------
// attention

namespace {

/// Double-precision causal GQA attention; bound[i] = sum_j p_j |v_j| of each output element. With `sinks`
/// ([n_head]) and `window` as cpu::attention takes them, written as HF GptOss's eager_attention_forward computes
/// them: the sink appended to each row's scores, softmax over all, the sink's column dropped; positions at or
/// beyond `window` behind the query masked (HF's sliding-window mask).
void reference_attention(const std::vector<float> &q, const std::vector<float> &k, const std::vector<float> &v,
                         int64_t n_tok, int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale,
                         std::vector<double> &ref, std::vector<double> &bound, const float *sinks = nullptr,
                         int64_t window = 0) {
    const int64_t ratio = n_head / n_head_kv;
    ref.assign(q.size(), 0.0);
    bound.assign(q.size(), 0.0);
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t h = 0; h < n_head; ++h) {
            const int64_t kvh = h / ratio, n_kv = pos0 + t + 1;
            std::vector<double> p(static_cast<size_t>(n_kv) + 1, -INFINITY);  // the last one: the sink
            for (int64_t j = 0; j < n_kv; ++j) {
                if (window > 0 && pos0 + t - j >= window) continue;
                double s = 0.0;
                for (int64_t d = 0; d < head_dim; ++d)
                    s += double(q[size_t((t * n_head + h) * head_dim + d)]) * k[size_t((j * n_head_kv + kvh) * head_dim + d)];
                p[size_t(j)] = s * scale;
            }
            if (sinks) p.back() = sinks[h];
            const double mx = *std::max_element(p.begin(), p.end());
            double sum = 0.0;
            for (double &e : p) sum += (e = std::exp(e - mx));
            for (int64_t d = 0; d < head_dim; ++d) {
                double o = 0.0, b = 0.0;
                for (int64_t j = 0; j < n_kv; ++j) {
                    const double vj = v[size_t((j * n_head_kv + kvh) * head_dim + d)];
                    o += p[size_t(j)] / sum * vj;
                    b += p[size_t(j)] / sum * std::fabs(vj);
                }
                ref[size_t((t * n_head + h) * head_dim + d)] = o;
                bound[size_t((t * n_head + h) * head_dim + d)] = b;
            }
        }
}

} // namespace

TEST(CpuOps, AttentionMatchesReference) {
    std::mt19937 rng(71);
    const int64_t n_head = 8;
    for (int64_t ratio : {1, 2, 4}) {
        for (int64_t head_dim : {64, 128}) {
            for (int64_t n_tok : {1, 3, 17}) {
                for (int64_t pos0 : {0, 5, 300}) {
                    SCOPED_TRACE("gqa " + std::to_string(ratio) + " head_dim " + std::to_string(head_dim) + " n_tok " +
                                 std::to_string(n_tok) + " pos0 " + std::to_string(pos0));
                    const int64_t n_head_kv = n_head / ratio, n_pos = pos0 + n_tok;
                    // q, k in [-2, 2]: scaled scores spread with a standard deviation above 1, so softmax is far from uniform.
                    const std::vector<float> q = random_floats(size_t(n_tok * n_head * head_dim), rng, -2.0f, 2.0f);
                    const std::vector<float> k = random_floats(size_t(n_pos * n_head_kv * head_dim), rng, -2.0f, 2.0f);
                    const std::vector<float> v = random_floats(size_t(n_pos * n_head_kv * head_dim), rng);
                    const float scale = 1.0f / std::sqrt(float(head_dim));
                    std::vector<double> ref, bound;
                    reference_attention(q, k, v, n_tok, pos0, n_head, n_head_kv, head_dim, scale, ref, bound);
                    for_each_config([&] {
                        std::vector<float> out(q.size(), kNaN);
                        attention(q.data(), k.data(), v.data(), n_tok, pos0, n_head, n_head_kv, head_dim, scale,
                                  out.data());
                        EXPECT_TRUE(all_close(out, ref, bound, 2e-5));
                    });
                }
            }
        }
    }
}

// Windows shorter and longer than the cache and than one block of the online softmax (64 positions), with sinks
// small, comparable to the scores and dominant (a row that attends mostly to nothing).
TEST(CpuOps, AttentionWithSinksAndSlidingWindowMatchesReference) {
    std::mt19937 rng(74);
    const int64_t n_head = 4, n_head_kv = 2, head_dim = 64;
    for (float sink_size : {0.0f, 3.0f, 30.0f}) {
        for (int64_t window : {0, 1, 5, 64, 100}) {
            for (const auto &[n_tok, pos0] : {std::pair<int64_t, int64_t>{1, 0}, {7, 0}, {3, 130}, {17, 60}}) {
                SCOPED_TRACE("sinks " + std::to_string(sink_size) + " window " + std::to_string(window) + " n_tok " +
                             std::to_string(n_tok) + " pos0 " + std::to_string(pos0));
                const int64_t n_pos = pos0 + n_tok;
                const std::vector<float> q = random_floats(size_t(n_tok * n_head * head_dim), rng, -2.0f, 2.0f);
                const std::vector<float> k = random_floats(size_t(n_pos * n_head_kv * head_dim), rng, -2.0f, 2.0f);
                const std::vector<float> v = random_floats(size_t(n_pos * n_head_kv * head_dim), rng);
                std::vector<float> sinks = random_floats(size_t(n_head), rng, -1.0f, 1.0f);
                for (float &s : sinks) s *= sink_size;
                const float *sk = sink_size > 0.0f ? sinks.data() : nullptr;
                const float scale = 1.0f / std::sqrt(float(head_dim));
                std::vector<double> ref, bound;
                reference_attention(q, k, v, n_tok, pos0, n_head, n_head_kv, head_dim, scale, ref, bound, sk, window);
                for_each_config([&] {
                    std::vector<float> out(q.size(), kNaN);
                    attention(q.data(), k.data(), v.data(), n_tok, pos0, n_head, n_head_kv, head_dim, scale,
                              out.data(), sk, window);
                    EXPECT_TRUE(all_close(out, ref, bound, 2e-5));
                });
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// batch invariance (BatchInvariantScope, decision 0111)

TEST(CpuOps, BatchInvariantMatmulRowsDoNotDependOnTheOtherTokens) {
    const int64_t n_in = 512, n_out = 70, n_all = 40;
    std::mt19937 rng(17);
    const std::vector<float> x = random_floats(size_t(n_all * n_in), rng);
    // Tokens [first, first + n) multiplied alone, in one call and as one of several jobs: 1 to 13 tokens would
    // take the GEMV (each grouping its own accumulator chains), 14 and more the GEMM, without the scope.
    const std::pair<int64_t, int64_t> slices[] = {{0, 1}, {7, 1}, {3, 2}, {5, 3}, {10, 8}, {1, 13}, {20, 14}, {4, 17}, {0, 33}};
    for (DType type : {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_1, DType::Q4_K, DType::Q6_K}) {
        SCOPED_TRACE(dtype_name(type));
        const std::vector<uint8_t> w = test::random_weights(type, n_out, n_in, 40 + uint32_t(type));
        std::vector<float> wf(size_t(n_out * n_in));
        for (int64_t r = 0; r < n_out; ++r)
            dequantize_row(type, w.data() + size_t(r) * dtype_row_bytes(type, n_in), wf.data() + r * n_in, n_in);
        for_each_activation_mode([&] {
            std::vector<double> ref, scale;
            reference_matmul(wf, n_in, n_out, multiplied(type, x, n_in), n_all, ref, scale);
            for_each_config([&] {
                const BatchInvariantScope invariant;
                ASSERT_TRUE(batch_invariant());
                std::vector<float> all(size_t(n_all * n_out), kNaN);
                matmul(type, w.data(), n_in, n_out, x.data(), n_all, all.data());
                // Against the reference where its tolerance holds (the Q8_1 min term and K-quants are checked
                // in test-quant).
                if (std::find(std::begin(kWeightTypes), std::end(kWeightTypes), type) != std::end(kWeightTypes)) {
                    EXPECT_TRUE(all_close(all, ref, scale, kMatmulTol));
                }
                std::vector<MatmulJob> jobs;
                std::vector<std::vector<float>> job_out;
                for (const auto &[first, n] : slices) job_out.emplace_back(size_t(n * n_out), kNaN);
                for (size_t i = 0; i < std::size(slices); ++i) {
                    const auto [first, n] = slices[i];
                    const std::vector<float> want(all.begin() + first * n_out, all.begin() + (first + n) * n_out);
                    std::vector<float> one(size_t(n * n_out), kNaN);
                    matmul(type, w.data(), n_in, n_out, x.data() + first * n_in, n, one.data());
                    EXPECT_TRUE(bitwise_equal(one, want)) << n << " tokens from " << first;
                    jobs.push_back({w.data(), x.data() + first * n_in, n, job_out[i].data()});
                }
                matmul_batch(type, n_in, n_out, jobs.data(), int64_t(jobs.size()));
                for (size_t i = 0; i < std::size(slices); ++i) {
                    const auto [first, n] = slices[i];
                    EXPECT_TRUE(bitwise_equal(job_out[i], {all.begin() + first * n_out, all.begin() + (first + n) * n_out}))
                        << "job of " << n << " tokens from " << first;
                }
            });
        });
    }
    EXPECT_FALSE(batch_invariant());
}

// Without the scope the GEMM path is batch-invariant on its own: a token's row is the same in every call of 14
// tokens and more (decision 0111 lists what may differ below that).
TEST(CpuOps, DefaultGemmPathRowsDoNotDependOnTheOtherTokens) {
    const int64_t n_in = 512, n_out = 70, n_all = 40;
    std::mt19937 rng(18);
    const std::vector<float> x = random_floats(size_t(n_all * n_in), rng);
    for (DType type : {DType::F32, DType::Q8_0, DType::Q4_K}) {
        SCOPED_TRACE(dtype_name(type));
        const std::vector<uint8_t> w = test::random_weights(type, n_out, n_in, 50 + uint32_t(type));
        for_each_config([&] {
            std::vector<float> all(size_t(n_all * n_out), kNaN);
            matmul(type, w.data(), n_in, n_out, x.data(), n_all, all.data());
            for (const auto &[first, n] : {std::pair<int64_t, int64_t>{0, 14}, {3, 17}, {26, 14}, {1, 33}}) {
                std::vector<float> part(size_t(n * n_out), kNaN);
                matmul(type, w.data(), n_in, n_out, x.data() + first * n_in, n, part.data());
                EXPECT_TRUE(bitwise_equal(part, {all.begin() + first * n_out, all.begin() + (first + n) * n_out}))
                    << n << " tokens from " << first;
            }
        });
    }
}

TEST(CpuOps, BatchInvariantAttentionRowsDoNotDependOnTheOtherQueriesOrThreads) {
    std::mt19937 rng(73);
    const int64_t n_head = 8, head_dim = 64, n_tok = 5, pos0 = 70, n_pos = pos0 + n_tok;
    for (int64_t n_head_kv : {1, 2}) {
        SCOPED_TRACE("n_head_kv " + std::to_string(n_head_kv));
        const std::vector<float> q = random_floats(size_t(n_tok * n_head * head_dim), rng, -2.0f, 2.0f);
        const std::vector<float> k = random_floats(size_t(n_pos * n_head_kv * head_dim), rng, -2.0f, 2.0f);
        const std::vector<float> v = random_floats(size_t(n_pos * n_head_kv * head_dim), rng);
        const float scale = 1.0f / std::sqrt(float(head_dim));
        const int64_t row = n_head * head_dim;
        for (CpuIsa isa : supported_isas()) {
            SCOPED_TRACE(cpu_isa_name(isa));
            set_cpu_isa(isa);
            const BatchInvariantScope invariant;
            std::vector<float> first;  // all queries at once, one thread
            // More threads than (token, KV head) pairs: without the scope the heads of a KV head would be split.
            for (int threads : {1, 2, 4, 8}) {
                set_threads(threads);
                std::vector<float> all(q.size(), kNaN), single(q.size(), kNaN);
                attention(q.data(), k.data(), v.data(), n_tok, pos0, n_head, n_head_kv, head_dim, scale, all.data());
                for (int64_t t = 0; t < n_tok; ++t) {
                    attention(q.data() + t * row, k.data(), v.data(), 1, pos0 + t, n_head, n_head_kv, head_dim, scale,
                              single.data() + t * row);
                }
                if (first.empty()) first = all;
                EXPECT_TRUE(bitwise_equal(all, single)) << threads << " threads";
                EXPECT_TRUE(bitwise_equal(all, first)) << threads << " threads";
            }
        }
    }
    set_cpu_isa(cpu_isa_supported());
    set_threads(0);
}

TEST(CpuOps, AttentionWithScoresGrowingAlongTheCache) {
    // Scores rise with the position, so the running maximum of the online softmax grows in every
    // block of positions and what came before is rescaled each time.
    std::mt19937 rng(72);
    const int64_t n_head = 4, n_head_kv = 2, head_dim = 64, n_tok = 2, pos0 = 500, n_pos = pos0 + n_tok;
    const std::vector<float> q = random_floats(size_t(n_tok * n_head * head_dim), rng, 0.5f, 1.0f);
    std::vector<float> k = random_floats(size_t(n_pos * n_head_kv * head_dim), rng, 0.5f, 1.0f);
    for (int64_t j = 0; j < n_pos; ++j)
        for (int64_t i = 0; i < n_head_kv * head_dim; ++i) k[size_t(j * n_head_kv * head_dim + i)] *= float(j) / 100.0f;
    const std::vector<float> v = random_floats(size_t(n_pos * n_head_kv * head_dim), rng);
    const float scale = 1.0f / std::sqrt(float(head_dim));
    std::vector<double> ref, bound;
    reference_attention(q, k, v, n_tok, pos0, n_head, n_head_kv, head_dim, scale, ref, bound);
    for_each_config([&] {
        std::vector<float> out(q.size(), kNaN);
        attention(q.data(), k.data(), v.data(), n_tok, pos0, n_head, n_head_kv, head_dim, scale, out.data());
        EXPECT_TRUE(all_close(out, ref, bound, 2e-5));
    });
}
