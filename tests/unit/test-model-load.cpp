// Model loading: a valid tiny model loads and runs; each kind of broken model gives one clear
// prescope::Error naming the file, the tensor and what was expected.
#include "arch/arch.h"
#include "core/error.h"
#include "runtime/context.h"
#include "../common/tiny-model.h"

#include <unistd.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <filesystem>

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

} // namespace

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
    s.n_embd = 256;  // q4_K rows need multiples of 256
    s.edit = [](std::string &name, auto &, uint32_t &type) {
        if (name == "blk.0.ffn_gate_exps.weight") type = 12;
    };
    expect_load_error("dtype", s, {"tensor 'blk.0.ffn_gate_exps.weight' has unsupported dtype q4_K"});
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
