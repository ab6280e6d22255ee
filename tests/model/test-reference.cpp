// Model tests against independent references (tests/data/models/*/*.ref.json, made by
// tools/py/make_tiny_models.py with HF transformers on the same weights, docs/references.md):
// logits at every position within the stated tolerance, and identical greedy tokens.
#include "../common/reference-files.h"
#include "arch/arch.h"
#include "runtime/context.h"
#include "runtime/perplexity.h"
#include "runtime/sampler.h"
#include "runtime/tokenizer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;
using nlohmann::json;
using prescope::test::read_f32;
using prescope::test::read_json;
using prescope::test::reference_files;
using prescope::test::reference_name;

namespace {

/// Length of the valid UTF-8 sequence starting at s[i], or 0 (Unicode 15 Table 3-7 well-formed sequences).
size_t utf8_valid_len(const std::string &s, size_t i) {
    const auto b = [&](size_t k) { return k < s.size() ? static_cast<unsigned char>(s[k]) : 0x100u; };
    const unsigned c = b(i);
    auto cont = [&](size_t k, unsigned lo, unsigned hi) { return b(k) >= lo && b(k) <= hi; };
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return cont(i + 1, 0x80, 0xBF) ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        const unsigned lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        return cont(i + 1, lo, hi) && cont(i + 2, 0x80, 0xBF) ? 3 : 0;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        const unsigned lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        return cont(i + 1, lo, hi) && cont(i + 2, 0x80, 0xBF) && cont(i + 3, 0x80, 0xBF) ? 4 : 0;
    }
    return 0;
}

/// Python's bytes.decode("utf-8", errors="backslashreplace"), which tools/py/llama_cpp_check.py used to
/// store llama.cpp's stdout in JSON: each byte that is not part of a valid sequence becomes "\\xNN".
std::string backslash_replace(const std::string &s) {
    std::string out;
    for (size_t i = 0; i < s.size();) {
        const size_t n = utf8_valid_len(s, i);
        if (n > 0) {
            out.append(s, i, n);
            i += n;
        } else {
            out += fmt::format("\\x{:02x}", static_cast<unsigned char>(s[i]));
            ++i;
        }
    }
    return out;
}

/// The HF references multiply F32 activations: these tests run with ActivationQuant::NONE (decision 0060);
/// the llama.cpp comparisons run with the default, INT8, as llama.cpp quantizes activations too.
class Reference : public ::testing::TestWithParam<fs::path> {
  protected:
    void SetUp() override { prescope::set_activation_quant(prescope::ActivationQuant::NONE); }
    void TearDown() override { prescope::set_activation_quant(prescope::ActivationQuant::INT8); }
};

/// Greedy ids for n steps after the prompt.
std::vector<int32_t> greedy_ids(const prescope::Model &model, const std::vector<int32_t> &prompt, size_t n) {
    prescope::Context ctx(model, {int64_t(prompt.size() + n) + 1, 512});
    ctx.eval(prompt);
    std::vector<int32_t> got;
    for (size_t i = 0; i < n; ++i) {
        const int32_t next = prescope::argmax(ctx.logits().data(), model.hp().n_vocab);
        got.push_back(next);
        ctx.eval({&next, 1});
    }
    return got;
}

/// llama-completion's stdout as recorded (backslash-replaced), without its closing blank line.
std::string llama_cpp_text(const json &ref, const std::string &ours) {
    std::string theirs = ref["llama_cpp_greedy"]["stdout"].get<std::string>();
    while (!theirs.empty() && theirs.back() == '\n' && (ours.empty() || ours.back() != '\n')) theirs.pop_back();
    return theirs;
}


} // namespace

TEST_P(Reference, LogitsAtEveryPositionWithinTolerance) {
    const json ref = read_json(GetParam());
    const auto model = prescope::Model::load((GetParam().parent_path() / ref["model"].get<std::string>()).string());
    const auto ids = ref["sequence_ids"].get<std::vector<int32_t>>();
    const std::vector<float> expected = read_f32(GetParam().parent_path() / ref["logits_file"].get<std::string>());
    const int64_t n_vocab = model->hp().n_vocab;
    ASSERT_EQ(ref["logits_shape"][1].get<int64_t>(), n_vocab);
    const auto rows = ref["logits_shape"][0].get<size_t>();
    ASSERT_EQ(expected.size(), rows * size_t(n_vocab));

    // Batches of 7 exercise prefill in pieces over a filled KV cache.
    prescope::Context ctx(*model, {int64_t(ids.size()) + 1, 7});
    ctx.eval({ids.data(), rows}, /*all_logits=*/true);
    const std::vector<float> &got = ctx.logits();
    const double tol = ref["tolerance"]["max_abs_logit_error"].get<double>();
    double max_err = 0.0;
    for (size_t i = 0; i < expected.size(); ++i) {
        ASSERT_FALSE(std::isnan(got[i])) << "NaN at " << i;
        max_err = std::max(max_err, std::fabs(double(got[i]) - double(expected[i])));
    }
    EXPECT_LE(max_err, tol) << GetParam();
    RecordProperty("max_abs_logit_error", std::to_string(max_err));
}

TEST_P(Reference, GreedyTokensIdentical) {
    const json ref = read_json(GetParam());
    const auto model = prescope::Model::load((GetParam().parent_path() / ref["model"].get<std::string>()).string());
    const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
    const auto greedy = ref["greedy"].get<std::vector<int32_t>>();
    EXPECT_EQ(greedy_ids(*model, prompt, greedy.size()), greedy) << GetParam();
}

// The prompt's text, through the tokenizer the GGUF carries (byte-level BPE with the file's pre-tokenizer, or
// SentencePiece with its BOS), gives the ids HF's tokenizer gave (make_tiny_models.py RefTokenizer).
TEST_P(Reference, PromptTextTokenizesToThePromptIds) {
    const json ref = read_json(GetParam());
    const auto model = prescope::Model::load((GetParam().parent_path() / ref["model"].get<std::string>()).string());
    const prescope::Tokenizer tok = prescope::Tokenizer::from_gguf(model->file());
    const bool bos = ref["tokenizer"].get<std::string>() == "spm";
    EXPECT_EQ(tok.encode(ref["prompt_text"].get<std::string>(), bos, false), ref["prompt_ids"].get<std::vector<int32_t>>());
}

// llama.cpp (tools/py/llama_cpp_check.py: llama-completion --temp 0 on the same GGUF) printed the text of its
// greedy tokens; with activations quantized as llama.cpp quantizes them, our text must be byte-identical,
// also on the Q8_0 files where both leave HF's path.
TEST_P(Reference, GreedyTextIdenticalToLlamaCpp) {
    const json ref = read_json(GetParam());
    if (!ref.contains("llama_cpp_greedy")) GTEST_SKIP() << "no llama.cpp run recorded";
    prescope::set_activation_quant(prescope::ActivationQuant::INT8);
    const auto model = prescope::Model::load((GetParam().parent_path() / ref["model"].get<std::string>()).string());
    const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
    const prescope::Tokenizer tok = prescope::Tokenizer::from_gguf(model->file());
    std::string ours;
    for (int32_t t : greedy_ids(*model, prompt, ref["greedy"].size())) ours += tok.token_to_piece(t);
    EXPECT_EQ(backslash_replace(ours), llama_cpp_text(ref, ours)) << "llama.cpp greedy text differs: " << GetParam();
}

TEST_P(Reference, PerplexityWithinHalfPercentOfLlamaCpp) {
    const json ref = read_json(GetParam());
    if (!ref.contains("llama_cpp_perplexity")) GTEST_SKIP() << "no llama.cpp perplexity recorded";
    prescope::set_activation_quant(prescope::ActivationQuant::INT8);
    const json &lc = ref["llama_cpp_perplexity"];
    const auto model = prescope::Model::load((GetParam().parent_path() / ref["model"].get<std::string>()).string());
    const prescope::Tokenizer tok = prescope::Tokenizer::from_gguf(model->file());
    std::ifstream in(fs::path(PRESCOPE_SOURCE_DIR) / lc["text"].get<std::string>(), std::ios::binary);
    const std::string text{std::istreambuf_iterator<char>(in), {}};
    const int64_t n_ctx = lc["n_ctx"].get<int64_t>();
    prescope::Context ctx(*model, {n_ctx, n_ctx});
    const auto r = prescope::perplexity(ctx, tok.encode(text, true, false), n_ctx, tok.add_bos() ? tok.bos() : -1);
    EXPECT_EQ(r.n_chunks, lc["n_chunks"].get<int64_t>());
    const double theirs = lc["ppl"].get<double>();
    EXPECT_LE(std::fabs(r.ppl - theirs) / theirs, 0.005) << "ours " << r.ppl << ", llama.cpp " << theirs;
}

INSTANTIATE_TEST_SUITE_P(Models, Reference, ::testing::ValuesIn(reference_files()), reference_name);
