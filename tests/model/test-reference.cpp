// Model tests against independent references (tests/data/models/*/*.ref.json, made by
// tools/py/make_tiny_models.py with HF transformers on the same weights, docs/references.md):
// logits at every position within the stated tolerance, and identical greedy tokens.
#include "arch/arch.h"
#include "runtime/context.h"
#include "runtime/sampler.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::vector<fs::path> reference_files() {
    std::vector<fs::path> out;
    for (const auto &e : fs::recursive_directory_iterator(fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models")) {
        const std::string name = e.path().filename().string();
        if (name.size() > 9 && name.ends_with(".ref.json")) out.push_back(e.path());
    }
    std::sort(out.begin(), out.end());
    return out;
}

json read_json(const fs::path &p) {
    std::ifstream in(p);
    return json::parse(in);
}

std::vector<float> read_f32(const fs::path &p) {
    std::ifstream in(p, std::ios::binary);
    std::vector<float> v(fs::file_size(p) / 4);
    in.read(reinterpret_cast<char *>(v.data()), std::streamsize(v.size() * 4));
    return v;
}

class Reference : public ::testing::TestWithParam<fs::path> {};

std::string param_name(const ::testing::TestParamInfo<fs::path> &info) {
    std::string s = info.param.parent_path().filename().string() + "_" + info.param.filename().string();
    for (char &c : s) {
        if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
    }
    return s;
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
    prescope::Context ctx(*model, {int64_t(prompt.size() + greedy.size()) + 1, 512});
    ctx.eval(prompt);
    std::vector<int32_t> got;
    for (size_t i = 0; i < greedy.size(); ++i) {
        const int32_t next = prescope::argmax(ctx.logits().data(), model->hp().n_vocab);
        got.push_back(next);
        ctx.eval({&next, 1});
    }
    EXPECT_EQ(got, greedy) << GetParam();
    if (ref.contains("llama_cpp_greedy")) {
        const auto lc = ref["llama_cpp_greedy"]["tokens"].get<std::vector<int32_t>>();
        EXPECT_EQ(std::vector<int32_t>(got.begin(), got.begin() + long(std::min(lc.size(), got.size()))),
                  std::vector<int32_t>(lc.begin(), lc.begin() + long(std::min(lc.size(), got.size()))))
            << "llama.cpp greedy tokens differ: " << GetParam();
    }
}

INSTANTIATE_TEST_SUITE_P(Models, Reference, ::testing::ValuesIn(reference_files()), param_name);
