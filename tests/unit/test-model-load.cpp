// Model loading: a valid tiny model loads and runs; each kind of broken model gives one clear
// prescope::Error naming the file, the tensor and what was expected.
#include "arch/arch.h"
#include "core/error.h"
#include "runtime/context.h"
#include "runtime/engine.h"
#include "../common/error-of.h"
#include "../common/tiny-model.h"

#include <unistd.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <filesystem>
#include <fstream>

using prescope::Error;
using prescope::Model;
using prescope::test::TinyModelSpec;

namespace {

std::string write(const std::string &name, const TinyModelSpec &spec) {
    const std::string p = (std::filesystem::temp_directory_path() / ("prescope-model-" + std::to_string(getpid()) + "-" + name + ".gguf")).string();
    prescope::test::write_tiny_model(p, spec);
    return p;
}

void expect_load_error(const std::string &name, const TinyModelSpec &spec, std::vector<std::string> needles) {
    const std::string p = write(name, spec);
    try {
        Model::load(p);
        FAIL() << name << ": expected an error";
    } catch (const Error &e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(p), std::string::npos) << msg;
        for (const auto &n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
        EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
    }
}

/// max |a - b| over the logits of the same tokens.
double max_logit_diff(const Model &a, const Model &b) {
    const std::vector<int32_t> toks = {1, 2, 3, 4, 5, 6, 7};
    prescope::Context ca(a, {64, 4}), cb(b, {64, 4});
    ca.eval(toks, true);
    cb.eval(toks, true);
    double d = 0.0;
    for (size_t i = 0; i < ca.logits().size(); ++i) {
        if (!std::isfinite(ca.logits()[i])) return INFINITY;
        d = std::max(d, double(std::fabs(ca.logits()[i] - cb.logits()[i])));
    }
    return d;
}

double max_abs(const std::vector<float> &v) {
    double m = 0.0;
    for (float x : v) m = std::max(m, double(std::fabs(x)));
    return m;
}

} // namespace

TEST(ModelLoad, MixedTypesPerTensorFollowEachTensorsType) {
    const auto m = Model::load(write("mixed", prescope::test::mixed_type_spec(false)));
    const auto f32 = Model::load(write("mixed-f32", prescope::test::mixed_type_spec(true)));
    const auto &l0 = m->weights().layers[0];
    EXPECT_EQ(l0.gate_exps.type, prescope::DType::Q4_K);
    EXPECT_EQ(l0.up_exps.type, prescope::DType::Q5_K);
    EXPECT_EQ(l0.down_exps.type, prescope::DType::Q6_K);
    // An expert's bytes are its three matrices in their own types: 256 rows of 144, 176 and 210 bytes.
    EXPECT_EQ(m->expert_bytes(0), size_t(256) * (144 + 176 + 210));
    EXPECT_EQ(m->expert_bytes(1), size_t(256) * (136 + 144 + 144));
    prescope::Context c(*f32, {64, 4});
    c.eval(std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7}, true);
    const double scale = max_abs(c.logits());
    // F32 activations: the quantized kernels multiply exactly the dequantized weights (F32 rounding only).
    prescope::set_activation_quant(prescope::ActivationQuant::NONE);
    EXPECT_LE(max_logit_diff(*m, *f32), 1e-4 * scale);
    // Quantized activations (the default): llama.cpp's numerics. On this random model (weights of order
    // 0.5 over 256 inputs) the rounding of activations moves logits by about 6% of the largest (measured
    // 0.058), also through router choices it flips; a kernel that garbled a type would move them by ~100%.
    prescope::set_activation_quant(prescope::ActivationQuant::INT8);
    EXPECT_LE(max_logit_diff(*m, *f32), 0.1 * scale);
}

TEST(ModelLoad, ValidTinyModelLoadsAndGivesFiniteLogits) {
    const std::string p = write("valid", {});
    const auto m = Model::load(p);
    EXPECT_EQ(m->hp().n_layer, 2);
    EXPECT_EQ(m->hp().n_expert, 4);
    EXPECT_TRUE(m->hp().norm_topk_prob);
    prescope::Context ctx(*m, {64, 16});
    const std::vector<int32_t> toks = {1, 2, 3, 4, 5};
    ctx.eval(toks);
    ASSERT_EQ(ctx.logits().size(), size_t(m->hp().n_vocab));
    for (float x : ctx.logits()) ASSERT_TRUE(std::isfinite(x));
}

TEST(ModelLoad, Deepseek2LoadsAndGivesFiniteLogits) {
    for (uint32_t q_lora_rank : {16u, 0u}) {  // V3 layout and V2-Lite's plain attn_q
        TinyModelSpec s;
        s.arch = "deepseek2";
        s.q_lora_rank = q_lora_rank;
        const auto m = Model::load(write("ds2-ok", s));
        EXPECT_TRUE(m->hp().mla);
        EXPECT_EQ(m->hp().head_dim, 16 + 8);  // one cached latent row: kv_lora_rank + rope
        prescope::Context ctx(*m, {16, 4});
        const std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6};
        ctx.eval(ids, /*all_logits=*/true);
        for (float x : ctx.logits()) ASSERT_TRUE(std::isfinite(x));
    }
}

// Files from before llama.cpp split attn_kv_b: the loader splits it, so the same weights give the same logits.
TEST(ModelLoad, Deepseek2LegacyKvBGivesTheLogitsOfTheSplitLayout) {
    for (uint32_t q_lora_rank : {16u, 0u}) {
        TinyModelSpec s;
        s.arch = "deepseek2";
        s.q_lora_rank = q_lora_rank;
        const auto split = Model::load(write("ds2-split", s));
        s.legacy_kv_b = true;
        const auto legacy = Model::load(write("ds2-legacy", s));
        EXPECT_EQ(legacy->hp().head_dim, split->hp().head_dim);
        EXPECT_EQ(max_logit_diff(*legacy, *split), 0.0);
    }
}

// Kimi-K2 has the deepseek2 layout with 384 experts, top-8, one group.
TEST(ModelLoad, Deepseek2WithKimiK2ExpertCountRuns) {
    TinyModelSpec s;
    s.arch = "deepseek2";
    s.n_expert = 384, s.n_expert_used = 8, s.n_expert_group = 1, s.n_ff = 8;
    const auto m = Model::load(write("ds2-kimi", s));
    EXPECT_EQ(m->hp().n_expert, 384);
    prescope::Context ctx(*m, {16, 4});
    const std::vector<int32_t> ids = {1, 2, 3, 4, 5};
    ctx.eval(ids, /*all_logits=*/true);
    for (float x : ctx.logits()) ASSERT_TRUE(std::isfinite(x));
}

TEST(ModelLoad, Deepseek2MissingMlaTensor) {
    TinyModelSpec s;
    s.arch = "deepseek2";
    s.edit = [](std::string &name, auto &, auto &) {
        if (name == "blk.1.attn_kv_a_mqa.weight") name.clear();
    };
    expect_load_error("ds2-missing", s, {"missing tensor 'blk.1.attn_kv_a_mqa.weight'", "expected shape [32, 24]"});
}

TEST(ModelLoad, Deepseek2KvLoraRankDisagreesWithTheTensor) {
    TinyModelSpec s;
    s.arch = "deepseek2";
    s.edit = [](std::string &name, std::vector<uint64_t> &ne, auto &) {
        if (name == "blk.0.attn_kv_a_mqa.weight") ne = {32, 40};
    };
    expect_load_error("ds2-rank", s, {"tensor 'blk.0.attn_kv_a_mqa.weight' has 40 rows",
                                      "'deepseek2.attention.kv_lora_rank' 16 + 'deepseek2.rope.dimension_count' 8"});
}

TEST(ModelLoad, Deepseek2GroupsMustDivideTheExperts) {
    TinyModelSpec s;
    s.arch = "deepseek2";
    s.n_expert_group = 3;  // 4 experts
    expect_load_error("ds2-groups", s, {"'deepseek2.expert_group_count' 3", "expert_count 4",
                                        "expected groups dividing the experts"});
    s.n_expert_group = 2;
    s.n_expert_group_used = 3;
    expect_load_error("ds2-groups-used", s, {"'deepseek2.expert_group_used_count' 3"});
}

TEST(ModelLoad, GptOssLoadsAndGivesFiniteLogits) {
    TinyModelSpec s;
    s.arch = "gpt-oss";
    const auto m = Model::load(write("oss-ok", s));
    EXPECT_EQ(m->hp().window(0), 3);  // even layers slide, odd ones see everything
    EXPECT_EQ(m->hp().window(1), 0);
    EXPECT_EQ(m->hp().expert_gating, prescope::ExpertGating::SOFTMAX_WEIGHT);
    ASSERT_NE(m->weights().layers[1].attn_sinks, nullptr);
    ASSERT_NE(m->weights().layers[1].down_exps_b, nullptr);
    prescope::Context ctx(*m, {16, 4});
    const std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6};
    ctx.eval(ids, /*all_logits=*/true);
    for (float x : ctx.logits()) ASSERT_TRUE(std::isfinite(x));
}

TEST(ModelLoad, GptOssMissingSinks) {
    TinyModelSpec s;
    s.arch = "gpt-oss";
    s.edit = [](std::string &name, auto &, auto &) {
        if (name == "blk.1.attn_sinks.weight") name.clear();
    };
    expect_load_error("oss-sinks", s, {"missing tensor 'blk.1.attn_sinks.weight'", "expected shape [4]"});
}

// A NaN or +inf sink would make every attention row of its head NaN; -inf (a sink that takes nothing) is fine.
TEST(ModelLoad, GptOssSinkValuesMustBeFiniteOrMinusInfinity) {
    TinyModelSpec s;
    s.arch = "gpt-oss";
    const std::string p = write("oss-sink-values", s);
    size_t at = 0;  // byte offset of blk.0's sinks in the file
    {
        const prescope::GgufFile f(p);
        for (const auto &t : f.tensors())
            if (t.name == "blk.0.attn_sinks.weight") at = size_t(f.data_offset() + t.offset);
    }
    ASSERT_GT(at, 0u);
    const auto put = [&](float v) {
        std::fstream io(p, std::ios::in | std::ios::out | std::ios::binary);
        io.seekp(std::streamoff(at + 4));  // head 1
        io.write(reinterpret_cast<const char *>(&v), 4);
    };
    for (float bad : {std::nanf(""), INFINITY}) {
        put(bad);
        EXPECT_EQ(prescope::test::error_of([&] { Model::load(p); }).find(p + ": tensor 'blk.0.attn_sinks.weight' holds"), 0u);
    }
    put(-INFINITY);
    EXPECT_NO_THROW(Model::load(p));
}

TEST(ModelLoad, GptOssSlidingWindowOfTheWrongType) {
    TinyModelSpec s;
    s.arch = "gpt-oss";
    s.keys_as_string = {"gpt-oss.attention.sliding_window"};
    expect_load_error("oss-swa-type", s, {"metadata 'gpt-oss.attention.sliding_window' has type string", "expected"});
    s.keys_as_string.clear();
    s.sliding_window = 0;
    expect_load_error("oss-swa-zero", s, {"'gpt-oss.attention.sliding_window' is 0, expected a positive window"});
}

TEST(ModelLoad, GptOssExpertBiasOfTheWrongShape) {
    TinyModelSpec s;
    s.arch = "gpt-oss";
    s.edit = [](std::string &name, std::vector<uint64_t> &ne, auto &) {
        if (name == "blk.0.ffn_up_exps.bias") ne = {32, 3};
    };
    expect_load_error("oss-bias", s, {"tensor 'blk.0.ffn_up_exps.bias' has shape [32, 3], expected [32, 4]"});
}

// A NaN or non-positive frequency base or epsilon would only show as NaN logits at the first token.
TEST(ModelLoad, NonFiniteOrNegativeRopeAndNormValues) {
    TinyModelSpec s;
    s.arch = "gpt-oss";
    s.f32_values = {{"gpt-oss.rope.freq_base", 0.0f}};
    expect_load_error("oss-freq0", s, {"metadata 'gpt-oss.rope.freq_base' is 0, expected a finite value > 0"});
    s.f32_values = {{"gpt-oss.rope.freq_base", std::nanf("")}};
    expect_load_error("oss-freqnan", s, {"'gpt-oss.rope.freq_base' is nan"});
    s.arch = "qwen3moe";
    s.f32_values = {{"qwen3moe.attention.layer_norm_rms_epsilon", -1.0f}};
    expect_load_error("q3-eps", s, {"'qwen3moe.attention.layer_norm_rms_epsilon' is -1, expected a finite value >= 0"});
}

TEST(ModelLoad, MissingTensor) {
    TinyModelSpec s;
    s.edit = [](std::string &name, auto &, auto &) {
        if (name == "blk.1.ffn_up_exps.weight") name.clear();
    };
    expect_load_error("missing", s, {"missing tensor 'blk.1.ffn_up_exps.weight'", "expected shape [32, 32, 4]"});
}

TEST(ModelLoad, WrongShape) {
    TinyModelSpec s;
    s.edit = [](std::string &name, std::vector<uint64_t> &ne, auto &) {
        if (name == "blk.0.attn_k.weight") ne = {32, 24};
    };
    expect_load_error("shape", s, {"tensor 'blk.0.attn_k.weight' has shape [32, 24], expected [32, 16]"});
}

TEST(ModelLoad, UnsupportedDtype) {
    TinyModelSpec s;
    s.n_embd = 256;  // iq2_xxs rows need multiples of 256
    s.edit = [](std::string &name, auto &, uint32_t &type) {
        if (name == "blk.0.ffn_gate_exps.weight") type = 16;
    };
    expect_load_error("dtype", s,
                      {"tensor 'blk.0.ffn_gate_exps.weight' has unsupported dtype iq2_xxs",
                       "supported: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, "
                       "iq4_xs, mxfp4"});
}

TEST(ModelLoad, TruncatedQuantizedDataNamesTheTensorItsTypeAndItsSize) {
    // A llama-quantize file (tests/data/quant, decision 0071) cut one byte short of the end of its last
    // quantized tensor: the size check, from the type's block size, names that tensor.
    const std::filesystem::path src =
        std::filesystem::path(PRESCOPE_SOURCE_DIR) / "tests/data/quant/tiny-olmoe-q4_k_m.gguf";
    const prescope::GgufFile f(src.string());
    const prescope::GgufTensorInfo *last = nullptr;
    for (const auto &t : f.tensors()) {
        if (t.dtype && prescope::dtype_is_quantized(*t.dtype) && (!last || t.offset > last->offset)) last = &t;
    }
    ASSERT_NE(last, nullptr);
    const uint64_t end = f.data_offset() + last->offset + last->n_bytes;
    std::vector<uint8_t> bytes(end - 1);
    std::ifstream(src, std::ios::binary).read(reinterpret_cast<char *>(bytes.data()), std::streamsize(bytes.size()));
    const std::string p = (std::filesystem::temp_directory_path() /
                           ("prescope-model-" + std::to_string(getpid()) + "-truncated-quant.gguf"))
                              .string();
    prescope::test::GgufWriter::write_bytes(p, bytes);
    const std::string msg = prescope::test::error_of([&] { Model::load(p); });
    std::filesystem::remove(p);
    for (const std::string &n :
         {p, "tensor '" + last->name + "' data", fmt::format("{} bytes of {}", last->n_bytes,
                                                             prescope::dtype_name(*last->dtype)),
          fmt::format("lies past the end of the file ({} bytes)", end - 1)}) {
        EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    }
}

TEST(ModelLoad, UnsupportedArchitecture) {
    TinyModelSpec s;
    s.arch = "gpt2";
    expect_load_error("arch", s, {"unsupported architecture 'gpt2'", "qwen3moe"});
}

TEST(ModelLoad, DenseLlamaIsRejected) {
    TinyModelSpec s;
    s.arch = "llama";
    s.n_expert = 0;
    s.edit = [](std::string &name, std::vector<uint64_t> &ne, auto &) {
        for (uint64_t d : ne) {
            if (d == 0) name.clear();  // no expert tensors in a dense model
        }
    };
    expect_load_error("dense", s, {"dense model"});
}

TEST(ModelLoad, TooManyExpertsUsed) {
    TinyModelSpec s;
    s.n_expert_used = 5;
    expect_load_error("topk", s, {"expert_used_count 5"});
}

TEST(ModelLoad, EvalRejectsOverflowAndBadTokens) {
    const auto m = Model::load(write("ctx", {}));
    prescope::Context ctx(*m, {8, 8});
    const std::vector<int32_t> nine(9, 1);
    EXPECT_THROW(ctx.eval(nine), Error);
    const std::vector<int32_t> bad = {int32_t(m->hp().n_vocab)};
    EXPECT_THROW(ctx.eval(bad), Error);
}

// llama.cpp refuses files with tensors its architecture does not create ("wrong number of tensors"); so do
// we, naming them: a shared expert in a qwen3moe file would otherwise be ignored in silence.
TEST(ModelLoad, UnusedTensorsAreRefusedByName) {
    TinyModelSpec s;
    s.extra = {{"blk.0.ffn_gate_shexp.weight", {32, 16}}, {"blk.0.ffn_up_shexp.weight", {32, 16}},
               {"made_up.weight", {4}}};
    expect_load_error("unused", s, {"3 tensors that a qwen3moe model does not have", "'blk.0.ffn_gate_shexp.weight'",
                                    "'blk.0.ffn_up_shexp.weight'", "'made_up.weight'"});
    TinyModelSpec many;
    for (int i = 0; i < 7; ++i) many.extra.push_back({"x" + std::to_string(i), {2}});
    expect_load_error("unused-many", many, {"7 tensors", "'x0'", "and 2 more"});
}

// A block count the file cannot hold is corrupt metadata, not a request to allocate 2^32 layers.
TEST(ModelLoad, ImplausibleBlockCountIsRefused) {
    // write_tiny_model writes n_layer blocks: write two and patch the count.
    const std::string p = write("blocks", {});
    std::vector<char> b;
    {
        std::ifstream in(p, std::ios::binary);
        b.assign(std::istreambuf_iterator<char>(in), {});
    }
    const std::string key = "qwen3moe.block_count";
    const auto it = std::search(b.begin(), b.end(), key.begin(), key.end());
    ASSERT_NE(it, b.end());
    const size_t value = size_t(it - b.begin()) + key.size() + 4;  // after the key and its uint32 type
    const uint32_t huge = 4294967295u;
    std::memcpy(b.data() + value, &huge, 4);
    std::ofstream(p, std::ios::binary | std::ios::trunc).write(b.data(), std::streamsize(b.size()));
    try {
        Model::load(p);
        FAIL() << "accepted block_count 2^32-1";
    } catch (const Error &e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("'qwen3moe.block_count' is 4294967295"), std::string::npos) << msg;
        EXPECT_NE(msg.find("tensors"), std::string::npos) << msg;
    }
}
