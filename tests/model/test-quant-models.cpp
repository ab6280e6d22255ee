// The quantised files of issue 11 against llama.cpp on the same files (tests/data/quant: llama-quantize's
// Q4_0 / Q4_K_M / Q5_K_M / Q6_K / IQ4_XS files of the demo and the tiny models, and llama.cpp d32676d77's
// outputs on each; README there, decision 0071). One parameter per JSON; a file that is not committed is
// looked for in $PRESCOPE_QUANT_WORK (default /tmp/prescope-quant, where the JSON's quantize_command
// writes it) and the test skips, naming that command, when it is absent or not the file the numbers
// belong to (size and tensor types). Activations are quantised (the default, INT8) as llama.cpp quantises them.
//
// - Perplexity: runtime/perplexity.h (llama-perplexity's protocol) on the recorded text and n_ctx, within
//   0.5% of llama-perplexity's final estimate (issue 11).
// - Logits after each prompt (decision 0064), relative to the largest |logit| of llama.cpp's: every logit
//   of the tiny files within 1e-4 of it, the 16 largest of the demo's within 5% of their top logit (an
//   expert swapped at a routing near-tie of the trained model moves them by up to 4.5%).
// - Greedy, the margin rule (decision 0071): the first step where our token differs from llama.cpp's must
//   be a near-tie, a step whose recorded top-1 margin is below 3% of the top logit after the prompt; the
//   steps after it are not compared, equal tokens at a near-tie keep the comparison going.
#include "../common/reference-files.h"
#include "arch/arch.h"
#include "runtime/context.h"
#include "runtime/perplexity.h"
#include "runtime/sampler.h"
#include "runtime/tokenizer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

namespace fs = std::filesystem;
using nlohmann::json;
using prescope::test::read_f32;
using prescope::test::read_json;

namespace {

const fs::path kQuantDir = fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/quant";

// Decision 0064, in units of llama.cpp's largest |logit|. Tiny files (every logit after the prompt):
// measured within 1.5e-7 on every ISA and thread count, F32 rounding; a Q4_1 / Q5_1 min term without ggml's
// F16 block sums (decision 0065) moved them by 0.8-2.5%. Demo files (the 16 largest logits): up to 1.2%,
// and 4.5% where rounding flips the 4th and 5th expert of a late layer at the last token (llama.cpp
// against itself, weight repacking on and off: 2.3%); a garbled type moves them by ~100%.
constexpr double kEveryLogitTolerance = 1e-4;
constexpr double kTopLogitTolerance = 0.05;
constexpr double kNearTie = 0.03;  // decision 0071: a margin below 3% of the top logit is a near-tie
constexpr double kPerplexityTolerance = 0.005;

/// Every tests/data/quant/*.json, sorted.
std::vector<fs::path> quant_files() {
    std::vector<fs::path> out;
    for (const auto &e : fs::directory_iterator(kQuantDir)) {
        if (e.path().extension() == ".json") out.push_back(e.path());
    }
    std::sort(out.begin(), out.end());
    return out;
}

std::string quant_name(const ::testing::TestParamInfo<fs::path> &info) {
    return prescope::test::case_name(info.param.stem().string());
}

fs::path work_dir() {
    const char *w = std::getenv("PRESCOPE_QUANT_WORK");
    return w && *w ? fs::path(w) : fs::path("/tmp/prescope-quant");
}

/// Why the file at p is not the one the expectations belong to, or "" if it is: the recorded byte size and the
/// recorded type of every tensor (the sha256 of the committed files is checked with hashlib by
/// tests/py/test_quant_files.py; a rebuilt file of the same size and types is taken as the same file).
std::string identity_mismatch(const fs::path &p, const json &doc, const prescope::GgufFile &f) {
    if (fs::file_size(p) != doc["bytes"].get<uintmax_t>()) {
        return fmt::format("{} bytes, expected {}", fs::file_size(p), doc["bytes"].get<uintmax_t>());
    }
    const json &types = doc["tensor_types"];
    if (f.tensors().size() != types.size()) return fmt::format("{} tensors, expected {}", f.tensors().size(), types.size());
    for (const auto &t : f.tensors()) {
        std::string have = t.dtype ? prescope::dtype_name(*t.dtype) : fmt::format("ggml type {}", t.ggml_type);
        std::transform(have.begin(), have.end(), have.begin(), [](unsigned char c) { return char(std::toupper(c)); });
        if (!types.contains(t.name) || types[t.name].get<std::string>() != have) {
            return fmt::format("tensor {} is {}, expected {}", t.name, have,
                               types.contains(t.name) ? types[t.name].get<std::string>() : "no such tensor");
        }
    }
    return "";
}

double max_abs(const std::vector<float> &v) {
    double m = 0.0;
    for (float x : v) m = std::max(m, double(std::fabs(x)));
    return m;
}

class QuantModel : public ::testing::TestWithParam<fs::path> {
  protected:
    void SetUp() override {
        doc_ = read_json(GetParam());
        const std::string file = doc_["file"].get<std::string>();
        const bool committed = doc_["committed"].get<bool>();
        const fs::path path = committed ? fs::path(PRESCOPE_SOURCE_DIR) / file : work_dir() / file;
        const std::string rebuild = fmt::format(
            "rebuild it with `{}` (llama.cpp {}, build flags in tests/data/quant/README.md) or set "
            "PRESCOPE_QUANT_WORK",
            doc_["quantize_command"].get<std::string>(), doc_["llama_cpp_commit"].get<std::string>());
        if (committed) {
            ASSERT_TRUE(fs::exists(path)) << path << " is committed but missing";
        } else if (!fs::exists(path)) {
            GTEST_SKIP() << file << " is not committed (decision 0071) and not in " << work_dir() << ": " << rebuild;
        }
        prescope::set_activation_quant(prescope::ActivationQuant::INT8);
        model_ = prescope::Model::load(path.string());
        const std::string mismatch = identity_mismatch(path, doc_, model_->file());
        if (committed) {
            ASSERT_EQ(mismatch, "") << path;
        } else if (!mismatch.empty()) {
            GTEST_SKIP() << path << " is not the file these expectations belong to (" << mismatch << "): " << rebuild;
        }
    }

    json doc_;
    std::unique_ptr<prescope::Model> model_;
};

} // namespace

TEST_P(QuantModel, PerplexityWithinHalfPercentOfLlamaCpp) {
    const json &lc = doc_["perplexity"];
    const prescope::Tokenizer tok = prescope::Tokenizer::from_gguf(model_->file());
    std::ifstream in(fs::path(PRESCOPE_SOURCE_DIR) / lc["text"].get<std::string>(), std::ios::binary);
    const std::string text{std::istreambuf_iterator<char>(in), {}};
    const int64_t n_ctx = lc["n_ctx"].get<int64_t>();
    prescope::Context ctx(*model_, {n_ctx, n_ctx});  // llama-perplexity -b n_ctx: one batch per chunk
    const auto r = prescope::perplexity(ctx, tok.encode(text, true, false), n_ctx, tok.add_bos() ? tok.bos() : -1);
    EXPECT_EQ(r.n_chunks, lc["n_chunks"].get<int64_t>());
    const double theirs = lc["ppl"].get<double>(), rel = std::fabs(r.ppl - theirs) / theirs;
    EXPECT_LE(rel, kPerplexityTolerance) << "ours " << r.ppl << ", llama.cpp " << theirs << " (" << lc["command"] << ")";
    RecordProperty("ppl", fmt::format("{:.4f}", r.ppl));
    RecordProperty("llama_cpp_ppl", fmt::format("{:.4f}", theirs));
    RecordProperty("rel_diff", fmt::format("{:.6f}", rel));
}

TEST_P(QuantModel, LogitsAfterEachPromptCloseToLlamaCpp) {
    const int64_t n_vocab = model_->hp().n_vocab;
    const int64_t n_ctx = doc_["logits"]["n_ctx"].get<int64_t>();
    prescope::Context ctx(*model_, {n_ctx, n_ctx});
    double worst = 0.0;  // largest |ours - llama.cpp| / scale over the prompts
    const json &prompts = doc_["prompts"];
    for (size_t p = 0; p < prompts.size(); ++p) {
        ctx.clear();
        ctx.eval(prompts[p]["prompt_ids"].get<std::vector<int32_t>>());  // one batch, as llama.cpp's run
        const std::vector<float> &got = ctx.logits();
        ASSERT_EQ(got.size(), size_t(n_vocab));
        const auto top_ids = prompts[p]["top_ids"].get<std::vector<int32_t>>();
        const auto top_logits = prompts[p]["top_logits"].get<std::vector<float>>();
        std::vector<float> theirs(top_logits);
        std::vector<int32_t> ids(top_ids);
        double tolerance = kTopLogitTolerance;
        const json &lf = doc_["logits"]["first_logits_file"];
        if (p == 0 && lf.is_string()) {  // every logit after prompts[0] (the tiny files)
            theirs = read_f32(kQuantDir / lf.get<std::string>());
            ASSERT_EQ(theirs.size(), size_t(n_vocab));
            ids.resize(size_t(n_vocab));
            for (int64_t v = 0; v < n_vocab; ++v) ids[size_t(v)] = int32_t(v);
            tolerance = kEveryLogitTolerance;
        }
        const double scale = max_abs(theirs);
        double err = 0.0;
        for (size_t i = 0; i < ids.size(); ++i) {
            ASSERT_TRUE(std::isfinite(got[size_t(ids[i])])) << "logit " << ids[i];
            err = std::max(err, std::fabs(double(got[size_t(ids[i])]) - double(theirs[i])));
        }
        EXPECT_LE(err, tolerance * scale)
            << "prompt " << p << ": max |ours - llama.cpp| over " << ids.size() << " logits, scale " << scale;
        worst = std::max(worst, err / scale);
    }
    RecordProperty("max_logit_diff_over_scale", fmt::format("{:.3g}", worst));
}

TEST_P(QuantModel, GreedyIdenticalToLlamaCppUpToTheFirstNearTie) {
    const int64_t n_vocab = model_->hp().n_vocab;
    const int64_t n_ctx = doc_["logits"]["n_ctx"].get<int64_t>();
    prescope::Context ctx(*model_, {n_ctx, n_ctx});
    int64_t identical = 0, total = 0;  // steps equal before the first difference, steps recorded
    const json &prompts = doc_["prompts"];
    for (size_t p = 0; p < prompts.size(); ++p) {
        const auto greedy = prompts[p]["greedy"].get<std::vector<int32_t>>();
        const auto margin = prompts[p]["greedy_top1_margin"].get<std::vector<double>>();
        ASSERT_EQ(margin.size(), greedy.size());
        const double near_tie = kNearTie * prompts[p]["top_logits"][0].get<double>();
        ctx.clear();
        ctx.eval(prompts[p]["prompt_ids"].get<std::vector<int32_t>>());
        size_t step = 0;
        for (; step < greedy.size(); ++step) {
            const int32_t next = prescope::argmax(ctx.logits().data(), n_vocab);
            if (next != greedy[step]) {
                EXPECT_LT(margin[step], near_tie)
                    << "prompt " << p << ", step " << step << ": ours " << next << ", llama.cpp " << greedy[step]
                    << " whose top-1 margin " << margin[step] << " is not a near-tie (below " << near_tie << ")";
                break;
            }
            ctx.eval({&next, 1});
        }
        identical += int64_t(step);
        total += int64_t(greedy.size());
    }
    RecordProperty("identical_steps", fmt::format("{} of {}", identical, total));
}

INSTANTIATE_TEST_SUITE_P(LlamaQuantizeFiles, QuantModel, ::testing::ValuesIn(quant_files()), quant_name);
