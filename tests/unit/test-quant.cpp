// Quantized weight types (core/dtype.h, decision 0060) and their CPU kernels:
// - dequantization bit for bit equal to gguf-py's gguf.quants.dequantize (tests/data/quant/blocks.gguf,
//   tools/py/make_quant_fixtures.py), for the reference and every ISA's tile conversion;
// - the activation quantizers of every ISA bit for bit equal to the references, which round as ggml's
//   (q8_0 / q8_1 half away from zero, q8_K half to even);
// - integer dot products (every type, ISA, 1 and 2 threads, GEMV and GEMM paths) against double sums of
//   the dequantized weights times the dequantized activations: |err| <= 1e-5 * sum |w_i xq_i| (F32
//   accumulation over blocks); against the F32 activations within 1e-2 * sum |w_i x_i| (each activation
//   moves by at most half a step, amax / 254, and random signs cancel most of it).
#include "../common/random-blocks.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/ops.h"
#include "core/dtype.h"
#include "format/gguf.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

using namespace prescope;
using namespace prescope::cpu;

namespace {

const DType kQuantTypes[] = {DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q2_K,
                             DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS,
                             DType::MXFP4};

std::vector<CpuIsa> supported_isas() {
    std::vector<CpuIsa> v;
    for (CpuIsa i : {CpuIsa::SCALAR, CpuIsa::AVX2, CpuIsa::AVX512})
        if (i <= cpu_isa_supported()) v.push_back(i);
    return v;
}

/// Restores the default ISA, threads and activation mode when a test ends.
struct Defaults {
    ~Defaults() {
        set_cpu_isa(cpu_isa_supported());
        set_threads(0);
        set_activation_quant(ActivationQuant::INT8);
    }
};

std::vector<float> random_floats(size_t n, std::mt19937 &rng) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (float &e : v) e = u(rng);
    return v;
}

std::vector<float> dequantized(DType t, const std::vector<uint8_t> &bytes, int64_t n_rows, int64_t n) {
    std::vector<float> out(size_t(n_rows * n));
    for (int64_t r = 0; r < n_rows; ++r)
        dequantize_row(t, bytes.data() + size_t(r) * dtype_row_bytes(t, n), out.data() + r * n, n);
    return out;
}

/// x quantized to activation type a and back, token by token (the values the integer kernels multiply).
std::vector<float> through_activations(DType a, const std::vector<float> &x, int64_t n_tok, int64_t n) {
    std::vector<uint8_t> q(dtype_row_bytes(a, n));
    std::vector<float> out(x.size());
    for (int64_t t = 0; t < n_tok; ++t) {
        quantize_activations(a, x.data() + t * n, q.data(), n);
        dequantize_row(a, q.data(), out.data() + t * n, n);
    }
    return out;
}

/// max over (t, o) of |got - want| / sum_i |w x| (double sums), want = sum_i w x unless given; NaN when got
/// has a NaN.
double max_rel_error(const std::vector<float> &got, const std::vector<float> &w, const std::vector<float> &x,
                     int64_t n_in, int64_t n_out, int64_t n_tok, const std::vector<float> *want = nullptr) {
    double worst = 0.0;
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t o = 0; o < n_out; ++o) {
            double s = 0.0, a = 0.0;
            for (int64_t i = 0; i < n_in; ++i) {
                const double p = double(w[size_t(o * n_in + i)]) * double(x[size_t(t * n_in + i)]);
                s += p;
                a += std::fabs(p);
            }
            const double g = got[size_t(t * n_out + o)];
            if (std::isnan(g)) return NAN;
            if (want) s = (*want)[size_t(t * n_out + o)];
            worst = std::max(worst, std::fabs(g - s) / std::max(a, 1e-30));
        }
    return worst;
}

bool same_bits(const float *a, const float *b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

} // namespace

TEST(Quant, TypeTraitsMatchGgml) {
    for (DType t : kQuantTypes) {
        SCOPED_TRACE(dtype_name(t));
        const auto block = ggml_type_block(uint32_t(t));
        ASSERT_TRUE(block.has_value());
        EXPECT_EQ(block->first, dtype_block_elems(t));
        EXPECT_EQ(block->second, dtype_block_bytes(t));
        EXPECT_EQ(dtype_from_ggml(uint32_t(t)), t);
        EXPECT_TRUE(dtype_is_quantized(t));
        EXPECT_NE(std::string(supported_weight_types()).find(dtype_name(t)), std::string::npos);
        EXPECT_EQ(dtype_block_elems(vec_dot_type(t)), dtype_block_elems(t));
    }
    // ggml-cpu type_traits_cpu vec_dot_type, and the types that are not weights.
    EXPECT_EQ(vec_dot_type(DType::Q4_1), DType::Q8_1);
    EXPECT_EQ(vec_dot_type(DType::Q5_1), DType::Q8_1);
    EXPECT_EQ(vec_dot_type(DType::MXFP4), DType::Q8_0);
    EXPECT_EQ(vec_dot_type(DType::IQ4_NL), DType::Q8_0);
    EXPECT_EQ(vec_dot_type(DType::IQ4_XS), DType::Q8_K);
    EXPECT_EQ(vec_dot_type(DType::Q6_K), DType::Q8_K);
    EXPECT_EQ(vec_dot_type(DType::BF16), DType::F32);
    EXPECT_FALSE(dtype_from_ggml(9).has_value());   // q8_1
    EXPECT_FALSE(dtype_from_ggml(15).has_value());  // q8_K
    EXPECT_FALSE(dtype_from_ggml(16).has_value());  // iq2_xxs
    EXPECT_STREQ(ggml_type_name(40), "nvfp4");
}

TEST(Quant, DequantizationMatchesGgufPyBitForBit) {
    Defaults restore;
    const GgufFile f((std::filesystem::path(PRESCOPE_SOURCE_DIR) / "tests/data/quant/blocks.gguf").string());
    int checked = 0;
    for (const GgufTensorInfo &t : f.tensors()) {
        if (t.name.ends_with(".f32")) continue;
        SCOPED_TRACE(t.name);
        ASSERT_TRUE(t.dtype.has_value());
        const GgufTensorInfo *ref = f.find_tensor(t.name + ".f32");
        ASSERT_NE(ref, nullptr);
        const int64_t n = t.ne[0];
        const auto *want = reinterpret_cast<const float *>(ref->data);
        std::vector<float> got(size_t(n), NAN);
        dequantize_row(*t.dtype, t.data, got.data(), n);
        EXPECT_TRUE(same_bits(got.data(), want, size_t(n)));
        for (CpuIsa isa : supported_isas()) {
            SCOPED_TRACE(cpu_isa_name(isa));
            set_cpu_isa(isa);
            // Two rows of half the length each: the tile conversion's row stride is exercised too.
            std::fill(got.begin(), got.end(), NAN);
            const int64_t half = n / 2;
            kernels().convert[dtype_index(*t.dtype)](t.data, dtype_row_bytes(*t.dtype, half), 2, half, got.data());
            EXPECT_TRUE(same_bits(got.data(), want, size_t(n)));
        }
        ++checked;
    }
    EXPECT_EQ(checked, 13);
}

TEST(Quant, ActivationQuantizersRoundAsGgml) {
    // amax 127 gives scale 1, so the quants are the inputs rounded: q8_0 / q8_1 round half away from zero
    // (roundf), q8_K half to even (nearest_int) with the scale -max / 127 of the element of largest
    // magnitude (here -127, so the scale is exactly 1 again).
    std::vector<float> x(256, 0.0f);
    x[0] = 127.0f;
    x[1] = 2.5f, x[2] = -2.5f, x[3] = 3.5f, x[4] = 0.5f, x[5] = -0.49999997f;
    x[32] = -127.0f, x[33] = 2.5f, x[34] = -3.5f;
    BlockQ8_0 q0[8];
    quantize_row_q8_0(x.data(), q0, 256);
    EXPECT_EQ(fp16_to_fp32(q0[0].d), 1.0f);
    EXPECT_EQ(q0[0].qs[1], 3);
    EXPECT_EQ(q0[0].qs[2], -3);
    EXPECT_EQ(q0[0].qs[3], 4);
    EXPECT_EQ(q0[0].qs[4], 1);
    EXPECT_EQ(q0[0].qs[5], 0);
    BlockQ8_1 q1[8];
    quantize_row_q8_1(x.data(), q1, 256);
    EXPECT_EQ(fp16_to_fp32(q1[0].s), 127.0f + 3 - 3 + 4 + 1);
    std::vector<float> xk(x.begin(), x.end());
    xk[0] = 1.0f;  // the largest magnitude is now x[32] = -127
    BlockQ8_K qk;
    quantize_row_q8_K(xk.data(), &qk, 256);
    EXPECT_EQ(qk.d, 1.0f);
    EXPECT_EQ(qk.qs[32], -127);
    EXPECT_EQ(qk.qs[33], 2);
    EXPECT_EQ(qk.qs[34], -4);
    EXPECT_EQ(qk.qs[1], 2);
    EXPECT_EQ(qk.bsums[2], -127 + 2 - 4);
}

TEST(Quant, ActivationQuantizersOfEveryIsaMatchTheReference) {
    Defaults restore;
    std::mt19937 rng(3);
    const int64_t n = 1024;
    std::vector<float> x = random_floats(size_t(n), rng);
    for (int64_t i = 0; i < n; i += 7) x[size_t(i)] = float(int(i % 19) - 9) * 0.5f;  // ties at some scale
    std::fill(x.begin() + 256, x.begin() + 512, 0.0f);                             // an all-zero block
    x[600] = -3.0f;                                                                // negative maximum
    for (DType a : {DType::Q8_0, DType::Q8_1, DType::Q8_K}) {
        SCOPED_TRACE(dtype_name(a));
        std::vector<uint8_t> want(dtype_row_bytes(a, n)), got(want.size());
        quantize_activations(a, x.data(), want.data(), n);
        for (CpuIsa isa : supported_isas()) {
            SCOPED_TRACE(cpu_isa_name(isa));
            set_cpu_isa(isa);
            std::fill(got.begin(), got.end(), 0xAB);
            kernels().quantize[act_index(a)](x.data(), got.data(), n);
            EXPECT_EQ(got, want);
        }
    }
}

TEST(Quant, IntegerDotProductsMatchTheDequantizedProducts) {
    Defaults restore;
    std::mt19937 rng(17);
    const int64_t n_out = 19;
    for (DType t : kQuantTypes) {
        const int64_t n_in = dtype_block_elems(t) == 256 ? 1024 : 320;
        const std::vector<uint8_t> w = test::random_weights(t, n_out, n_in, 100 + uint32_t(t));
        const std::vector<float> wf = dequantized(t, w, n_out, n_in);
        // 1, 5: GEMV; 21: tiles + GEMM on the activations quantized and back.
        for (int64_t n_tok : {1, 5, 21}) {
            SCOPED_TRACE(std::string(dtype_name(t)) + " n_tok " + std::to_string(n_tok));
            const std::vector<float> x = random_floats(size_t(n_tok * n_in), rng);
            const std::vector<float> xq = through_activations(vec_dot_type(t), x, n_tok, n_in);
            for (CpuIsa isa : supported_isas()) {
                for (int threads : {1, 2}) {
                    SCOPED_TRACE(std::string(cpu_isa_name(isa)) + " threads " + std::to_string(threads));
                    set_cpu_isa(isa);
                    set_threads(threads);
                    std::vector<float> y(size_t(n_tok * n_out), NAN);
                    set_activation_quant(ActivationQuant::INT8);
                    matmul(t, w.data(), n_in, n_out, x.data(), n_tok, y.data());
                    EXPECT_LE(max_rel_error(y, wf, xq, n_in, n_out, n_tok), 1e-5);
                    EXPECT_LE(max_rel_error(y, wf, x, n_in, n_out, n_tok), 1e-2);
                    // F32 activations: the dequantized weights times x itself.
                    std::fill(y.begin(), y.end(), NAN);
                    set_activation_quant(ActivationQuant::NONE);
                    matmul(t, w.data(), n_in, n_out, x.data(), n_tok, y.data());
                    EXPECT_LE(max_rel_error(y, wf, x, n_in, n_out, n_tok), 1e-5);
                }
            }
        }
    }
}

TEST(Quant, GemmAndGemvPathsComputeTheSameProducts) {
    // A token's result does not depend on how many tokens share the product (decision 0060): the GEMM path
    // (F32 tiles, activations quantized and back) against the integer GEMV, on the tiny models' 32- and
    // 64-wide rows too. Q4_1 / Q5_1 need the F16 block sums s of their Q8_1 activations in the min term, as
    // the integer kernels and ggml use them (decision 0065). Measured, in units of sum |w xq|: every type
    // within 6e-7 (F32 rounding); Q4_1 / Q5_1 with the F32 sum of the activations instead, 7.6e-6 to 5.3e-5.
    Defaults restore;
    const int64_t gemm_min = gemm_min_tokens();
    std::mt19937 rng(29);
    const int64_t n_out = 24, n_tok = 16;
    for (DType t : kQuantTypes) {
        for (int64_t n_in : dtype_block_elems(t) == 256 ? std::vector<int64_t>{256, 1024}
                                                         : std::vector<int64_t>{32, 64, 320}) {
            SCOPED_TRACE(std::string(dtype_name(t)) + " n_in " + std::to_string(n_in));
            const std::vector<uint8_t> w = test::random_weights(t, n_out, n_in, 300 + uint32_t(t));
            const std::vector<float> wf = dequantized(t, w, n_out, n_in);
            const std::vector<float> x = random_floats(size_t(n_tok * n_in), rng);
            const std::vector<float> xq = through_activations(vec_dot_type(t), x, n_tok, n_in);
            std::vector<float> gemv(size_t(n_tok * n_out), NAN), gemm(gemv.size(), NAN);
            set_gemm_min_tokens(n_tok + 1);
            matmul(t, w.data(), n_in, n_out, x.data(), n_tok, gemv.data());
            set_gemm_min_tokens(1);
            matmul(t, w.data(), n_in, n_out, x.data(), n_tok, gemm.data());
            EXPECT_LE(max_rel_error(gemm, wf, xq, n_in, n_out, n_tok, &gemv), 2e-6);
        }
    }
    set_gemm_min_tokens(gemm_min);
}

TEST(Quant, BatchedJobsSharingInputsMatchSingleProducts) {
    Defaults restore;
    std::mt19937 rng(23);
    const int64_t n_in = 512, n_out = 24;
    for (DType t : {DType::Q4_K, DType::Q8_0, DType::Q5_1}) {
        SCOPED_TRACE(dtype_name(t));
        // Pairs of jobs on one input (an expert's gate and up), GEMV and GEMM sizes, an empty job.
        const int64_t toks[] = {1, 1, 0, 3, 3, 20, 20};
        const bool shares_previous[] = {false, true, false, false, true, false, true};
        std::vector<std::vector<uint8_t>> ws;
        std::vector<std::vector<float>> xs(std::size(toks)), ys(std::size(toks)), want(std::size(toks));
        std::vector<MatmulJob> jobs;
        for (size_t j = 0; j < std::size(toks); ++j) {
            ws.push_back(test::random_weights(t, n_out, n_in, uint32_t(j)));
            if (!shares_previous[j]) xs[j] = random_floats(size_t(toks[j] * n_in), rng);
            const std::vector<float> &x = shares_previous[j] ? xs[j - 1] : xs[j];
            ys[j].assign(size_t(toks[j] * n_out), NAN);
            want[j].assign(size_t(toks[j] * n_out), NAN);
            // Shared inputs by the same pointer, as the CPU executor passes an expert's gate and up.
            jobs.push_back({ws[j].data(), x.data(), toks[j], ys[j].data()});
            matmul(t, ws[j].data(), n_in, n_out, x.data(), toks[j], want[j].data());
        }
        matmul_batch(t, n_in, n_out, jobs.data(), int64_t(jobs.size()));
        for (size_t j = 0; j < std::size(toks); ++j) EXPECT_EQ(ys[j], want[j]) << "job " << j;
    }
}
