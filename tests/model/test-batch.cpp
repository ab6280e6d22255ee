// Several sequences in one forward pass (Context::eval_batch, decision 0110): requests served as a server
// would, slots of a 3-sequence context reused (clear), prefill in chunks next to running decodes, entries split
// across passes. Checked against each sequence run alone in a context of its own (bit for bit with
// ContextParams::deterministic, within a stated tolerance by default, decision 0111) and against HF
// transformers' greedy tokens (tests/data/demo/reference.json, tests/data/models/*/*.ref.json).
#include "../common/reference-files.h"
#include "arch/arch.h"
#include "core/error.h"
#include "runtime/context.h"
#include "runtime/engine.h"
#include "runtime/sampler.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using nlohmann::json;
using prescope::Context;
using prescope::ContextParams;
using prescope::SeqTokens;

namespace {

const fs::path kRoot = PRESCOPE_SOURCE_DIR;

const prescope::Model &demo_model() {
    static const auto model = prescope::Model::load((kRoot / "models/demo/demo-q8_0.gguf").string());
    return *model;
}

struct Request {
    std::vector<int32_t> prompt;
    size_t n_gen = 0;
};

/// What one request saw: the tokens of each step it took part in, the logits returned after each, and its
/// greedy tokens.
struct Served {
    std::vector<std::vector<int32_t>> pieces;
    std::vector<std::vector<float>> logits;
    std::vector<int32_t> generated;
};

/// Serves the requests in order through ctx's sequences as a continuous-batching server does: a request takes
/// a free sequence (cleared) at the start of a step, feeds its prompt `chunk` tokens per step, then one greedy
/// token per step, and frees the sequence after n_gen tokens. Every step is one eval_batch over all busy
/// sequences; odd steps list them in reverse order.
std::vector<Served> serve(Context &ctx, const std::vector<Request> &requests, size_t chunk) {
    const int64_t n_vocab = ctx.model().hp().n_vocab;
    std::vector<Served> out(requests.size());
    std::vector<int> slot(size_t(ctx.n_seq()), -1);  // request in each sequence
    std::vector<size_t> fed(requests.size(), 0);
    size_t next = 0, done = 0;
    for (int step = 0; done < requests.size(); ++step) {
        for (size_t s = 0; s < slot.size(); ++s) {
            if (slot[s] < 0 && next < requests.size()) {
                ctx.clear(int32_t(s));
                slot[s] = int(next++);
            }
        }
        std::vector<std::vector<int32_t>> pieces;
        std::vector<int> order;
        for (size_t s = 0; s < slot.size(); ++s) {
            if (slot[s] < 0) continue;
            const auto r = size_t(slot[s]);
            const std::vector<int32_t> &p = requests[r].prompt;
            if (fed[r] < p.size()) {
                const size_t m = std::min(chunk, p.size() - fed[r]);
                pieces.emplace_back(p.begin() + long(fed[r]), p.begin() + long(fed[r] + m));
            } else {
                pieces.push_back({out[r].generated.back()});
            }
            order.push_back(int(s));
        }
        if (step % 2 == 1) {
            std::reverse(pieces.begin(), pieces.end());
            std::reverse(order.begin(), order.end());
        }
        std::vector<SeqTokens> batch;
        for (size_t i = 0; i < pieces.size(); ++i) batch.push_back({order[i], pieces[i], true});
        ctx.eval_batch(batch);
        EXPECT_EQ(ctx.logits().size(), batch.size() * size_t(n_vocab));
        for (size_t i = 0; i < batch.size(); ++i) {
            const auto s = size_t(order[i]);
            const auto r = size_t(slot[s]);
            const float *row = ctx.logits().data() + i * size_t(n_vocab);
            out[r].pieces.push_back(pieces[i]);
            out[r].logits.emplace_back(row, row + n_vocab);
            fed[r] = std::min(fed[r] + pieces[i].size(), requests[r].prompt.size());
            if (fed[r] == requests[r].prompt.size()) out[r].generated.push_back(prescope::argmax(row, n_vocab));
            if (out[r].generated.size() == requests[r].n_gen) {
                slot[s] = -1;
                ++done;
            }
        }
    }
    return out;
}

/// The logits after each piece when the pieces are fed to a context of their own (one sequence, eval()).
std::vector<std::vector<float>> alone(const prescope::Model &model, ContextParams params,
                                      const std::vector<std::vector<int32_t>> &pieces) {
    params.n_seq = 1;
    Context ctx(model, params);
    std::vector<std::vector<float>> out;
    for (const auto &p : pieces) {
        ctx.eval(p);
        out.push_back(ctx.logits());
    }
    return out;
}

double max_abs_diff(const std::vector<float> &a, const std::vector<float> &b) {
    if (a.size() != b.size()) return INFINITY;
    double m = 0.0;
    for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
    return m;
}

bool bitwise_equal(const std::vector<float> &a, const std::vector<float> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// The demo's five held-out prompts (45, 31, 4, 45 and 33 tokens) with HF's 64 greedy tokens each.
std::vector<Request> demo_requests(std::vector<std::vector<int32_t>> *greedy) {
    std::ifstream in(kRoot / "tests/data/demo/reference.json");
    const json ref = json::parse(in);
    std::vector<Request> reqs;
    for (const auto &p : ref["prompts"]) {
        greedy->push_back(p["greedy"].get<std::vector<int32_t>>());
        reqs.push_back({p["prompt_ids"].get<std::vector<int32_t>>(), greedy->back().size()});
    }
    return reqs;
}

// Default kernels (decision 0111): in a batch a token's products may take another path (GEMV or GEMM) or another
// GEMV grouping than alone, which changes them in the last bits. With F32 activations that stays in the last
// bits of the logits (measured maximum 7e-6 over the 327 steps below); with the default INT8 activations an
// activation on a rounding boundary of its Q8 block moves by a whole step, and the demo's logits move by up to
// 1.06 (median 0.083; |logits| up to about 15): the greedy tokens must stay HF's, the logits within about twice the measured
// maximum (RecordProperty max_abs_logit_difference_*).
constexpr double kDemoDefaultTolF32 = 1e-4, kDemoDefaultTolInt8 = 2.0;

} // namespace

TEST(Batch, DemoRequestsServedTogetherGiveHfGreedyTokensAndTheirAloneLogits) {
    std::vector<std::vector<int32_t>> greedy;
    const std::vector<Request> reqs = demo_requests(&greedy);
    ASSERT_EQ(reqs.size(), 5u);
    struct Mode {
        const char *name;
        bool deterministic;
        prescope::ActivationQuant act;
        double tol;
    };
    for (const Mode &mode : {Mode{"deterministic", true, prescope::ActivationQuant::INT8, 0.0},
                             Mode{"int8", false, prescope::ActivationQuant::INT8, kDemoDefaultTolInt8},
                             Mode{"f32", false, prescope::ActivationQuant::NONE, kDemoDefaultTolF32}}) {
        SCOPED_TRACE(mode.name);
        prescope::set_activation_quant(mode.act);
        // 3 sequences for 5 requests: two requests reuse a cleared sequence while the others decode. 16-token
        // prefill chunks next to decodes, passes of at most 24 tokens, so entries are split across passes.
        const ContextParams params{128, 24, 3, mode.deterministic};
        Context ctx(demo_model(), params);
        const std::vector<Served> got = serve(ctx, reqs, 16);
        std::vector<double> diffs;
        for (size_t r = 0; r < reqs.size(); ++r) {
            EXPECT_EQ(got[r].generated, greedy[r]) << "request " << r;
            const auto ref = alone(demo_model(), params, got[r].pieces);
            ASSERT_EQ(ref.size(), got[r].logits.size());
            for (size_t i = 0; i < ref.size(); ++i) {
                if (mode.deterministic) {
                    ASSERT_TRUE(bitwise_equal(got[r].logits[i], ref[i])) << "request " << r << ", step " << i;
                }
                diffs.push_back(max_abs_diff(got[r].logits[i], ref[i]));
            }
        }
        std::sort(diffs.begin(), diffs.end());
        EXPECT_LE(diffs.back(), mode.tol);
        RecordProperty(std::string("max_abs_logit_difference_") + mode.name, std::to_string(diffs.back()));
        RecordProperty(std::string("median_abs_logit_difference_") + mode.name, std::to_string(diffs[diffs.size() / 2]));
    }
    prescope::set_activation_quant(prescope::ActivationQuant::INT8);
}

/// Every tiny test model (each architecture, F32 and Q8_0): three requests cut from the reference prompt
/// and the full one, served together; bit for bit as alone with deterministic kernels, and the full prompt's
/// greedy tokens are HF's (F32 activations, as HF multiplies them).
class BatchReference : public ::testing::TestWithParam<fs::path> {
  protected:
    void SetUp() override { prescope::set_activation_quant(prescope::ActivationQuant::NONE); }
    void TearDown() override { prescope::set_activation_quant(prescope::ActivationQuant::INT8); }
};

TEST_P(BatchReference, DeterministicBatchEqualsAloneBitForBitAndGreedyIsHfs) {
    const json ref = prescope::test::read_json(GetParam());
    const auto model = prescope::Model::load((GetParam().parent_path() / ref["model"].get<std::string>()).string());
    const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
    const auto greedy = ref["greedy"].get<std::vector<int32_t>>();
    ASSERT_GE(prompt.size(), 6u);
    std::vector<Request> reqs = {{{prompt.begin(), prompt.begin() + 3}, 6},
                                 {prompt, greedy.size()},
                                 {{prompt.begin() + 2, prompt.end()}, 9},
                                 {{prompt.begin(), prompt.begin() + 1}, 4}};
    const ContextParams params{int64_t(prompt.size() + greedy.size()) + 2, 7, 3, true};
    Context ctx(*model, params);
    const std::vector<Served> got = serve(ctx, reqs, 5);
    EXPECT_EQ(got[1].generated, greedy);
    for (size_t r = 0; r < reqs.size(); ++r) {
        const auto ref_logits = alone(*model, params, got[r].pieces);
        for (size_t i = 0; i < ref_logits.size(); ++i) {
            ASSERT_TRUE(bitwise_equal(got[r].logits[i], ref_logits[i])) << "request " << r << ", step " << i;
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Models, BatchReference, ::testing::ValuesIn(prescope::test::reference_files()),
                         prescope::test::reference_name);

TEST(Batch, ClearingOneSequenceLeavesTheOthersIntact) {
    const prescope::Model &m = demo_model();
    const std::vector<int32_t> a = {19, 21, 16, 25, 16, 513}, b = {449, 551, 368, 87}, c = {2798, 276, 2778};
    Context ctx(m, {64, 512, 3, true});
    const SeqTokens first[] = {{0, a}, {1, b}, {2, c}};
    ctx.eval_batch(first);
    ctx.clear(1);
    EXPECT_EQ(ctx.n_past(0), 6);
    EXPECT_EQ(ctx.n_past(1), 0);
    EXPECT_EQ(ctx.n_past(2), 3);
    // Sequence 1 starts again with c; 0 and 2 go on as if nothing happened.
    const int32_t next0 = 551, next2 = 2965;
    const SeqTokens second[] = {{2, {&next2, 1}}, {1, c}, {0, {&next0, 1}}};
    ctx.eval_batch(second);
    EXPECT_EQ(ctx.n_past(1), 3);

    std::vector<int32_t> a2 = a, c2 = c;
    a2.push_back(next0);
    c2.push_back(next2);
    const auto ref0 = alone(m, {64, 512, 1, true}, {a2}), ref1 = alone(m, {64, 512, 1, true}, {c}),
               ref2 = alone(m, {64, 512, 1, true}, {c2});
    const int64_t V = m.hp().n_vocab;
    const std::vector<float> &l = ctx.logits();
    ASSERT_EQ(l.size(), size_t(3 * V));
    EXPECT_TRUE(bitwise_equal({l.begin(), l.begin() + V}, ref2[0]));
    EXPECT_TRUE(bitwise_equal({l.begin() + V, l.begin() + 2 * V}, ref1[0]));
    EXPECT_TRUE(bitwise_equal({l.begin() + 2 * V, l.end()}, ref0[0]));

    ctx.clear();
    for (int32_t s = 0; s < 3; ++s) EXPECT_EQ(ctx.n_past(s), 0);
}

TEST(Batch, LogitsRowsOnlyForEntriesThatAskAndEvalIsSequenceZero) {
    const prescope::Model &m = demo_model();
    const int64_t V = m.hp().n_vocab;
    const std::vector<int32_t> a = {19, 21, 16}, b = {449, 551};
    Context ctx(m, {32, 512, 2, true});
    const SeqTokens batch[] = {{1, b, false}, {0, a, true}};
    ctx.eval_batch(batch);
    EXPECT_EQ(ctx.logits().size(), size_t(V));
    EXPECT_TRUE(bitwise_equal(ctx.logits(), alone(m, {32, 512, 1, true}, {a})[0]));
    const SeqTokens none[] = {{1, a, false}};
    ctx.eval_batch(none);
    EXPECT_TRUE(ctx.logits().empty());
    EXPECT_EQ(ctx.n_past(1), 5);
    // eval() continues sequence 0 and leaves sequence 1 alone.
    ctx.eval(b);
    EXPECT_EQ(ctx.n_past(), 5);
    EXPECT_EQ(ctx.n_past(1), 5);
    std::vector<int32_t> ab = a;
    ab.insert(ab.end(), b.begin(), b.end());
    EXPECT_TRUE(bitwise_equal(ctx.logits(), alone(m, {32, 512, 1, true}, {ab})[0]));
}

TEST(Batch, BadBatchesAreRefusedBeforeAnythingRuns) {
    const prescope::Model &m = demo_model();
    const auto V = int32_t(m.hp().n_vocab);
    Context ctx(m, {8, 512, 2});
    const std::vector<int32_t> ok = {1, 2, 3}, empty, bad_low = {5, -1}, bad_high = {V}, long_one(9, 7);
    const auto error_of = [&](std::vector<SeqTokens> batch) -> std::string {
        try {
            ctx.eval_batch(batch);
        } catch (const prescope::Error &e) {
            return e.what();
        }
        return "no error";
    };
    EXPECT_EQ(error_of({}), "eval_batch: no entries to evaluate");
    EXPECT_EQ(error_of({{0, ok}, {2, ok}}),
              "eval_batch entry 1: sequence 2 is outside [0, 2) (the context holds 2 sequences)");
    EXPECT_EQ(error_of({{-1, ok}}), "eval_batch entry 0: sequence -1 is outside [0, 2) (the context holds 2 sequences)");
    EXPECT_EQ(error_of({{1, ok}, {0, ok}, {1, ok}}), "eval_batch: sequence 1 is listed twice (entries 0 and 2)");
    EXPECT_EQ(error_of({{0, ok}, {1, empty}}), "eval_batch entry 1 (sequence 1): eval: no tokens to evaluate");
    EXPECT_EQ(error_of({{1, bad_low}}),
              fmt::format("eval_batch entry 0 (sequence 1): token id -1 is outside the vocabulary [0, {})", V));
    EXPECT_EQ(error_of({{0, bad_high}}),
              fmt::format("eval_batch entry 0 (sequence 0): token id {} is outside the vocabulary [0, {})", V, V));
    EXPECT_EQ(error_of({{0, ok}, {1, long_one}}),
              "eval_batch entry 1 (sequence 1): 9 tokens at position 0 do not fit the context of 8 tokens (use a "
              "larger -c)");
    // Nothing ran: no sequence moved.
    EXPECT_EQ(ctx.n_past(0), 0);
    EXPECT_EQ(ctx.n_past(1), 0);
    // Fitting is per sequence: 6 more tokens do not fit sequence 0 after 3, but do fit sequence 1.
    const std::vector<int32_t> six(6, 4);
    EXPECT_EQ(error_of({{0, ok}}), "no error");
    EXPECT_EQ(error_of({{1, six}, {0, six}}),
              "eval_batch entry 1 (sequence 0): 6 tokens at position 3 do not fit the context of 8 tokens (use a "
              "larger -c)");
    EXPECT_EQ(ctx.n_past(1), 0);
    EXPECT_EQ(error_of({{1, six}}), "no error");

    EXPECT_THROW(ctx.n_past(2), prescope::Error);
    EXPECT_THROW(ctx.clear(-1), prescope::Error);
    EXPECT_THROW(Context(m, {8, 512, 0}), prescope::Error);
}

TEST(Batch, TheMemoryCheckCountsEverySequencesCache) {
    // One sequence of 4096 tokens fits; 2^20 of them (48 TiB of KV cache) are refused before allocating.
    EXPECT_NO_THROW(Context(demo_model(), {4096, 64, 1}));
    try {
        Context ctx(demo_model(), {4096, 64, int64_t(1) << 20});
        FAIL() << "no error";
    } catch (const prescope::Error &e) {
        EXPECT_NE(std::string(e.what()).find("out of memory: the KV caches and activations for -c 4096 -b 64 and "
                                             "1048576 sequences"),
                  std::string::npos)
            << e.what();
    }
}

TEST(Batch, TheEngineInterfaceRunsSeveralSequencesAndTheHooksSeeTheWholePass) {
    const prescope::Model &m = demo_model();
    const std::unique_ptr<prescope::Engine> engine = prescope::make_engine(m, {32, 512, 2, true}, {});
    ASSERT_EQ(engine->n_seq(), 2);
    auto &cpu = dynamic_cast<prescope::CpuEngine &>(*engine);
    std::vector<int64_t> routed;
    cpu.context().on_routing = [&](int64_t layer, const prescope::Routing &r) {
        if (layer == 0) routed.push_back(r.n_tok);
    };
    const std::vector<int32_t> a = {19, 21, 16}, b = {449, 551};
    const SeqTokens batch[] = {{0, a}, {1, b}};
    engine->eval_batch(batch);
    EXPECT_EQ(routed, std::vector<int64_t>{5});
    EXPECT_EQ(engine->n_past(0), 3);
    EXPECT_EQ(engine->n_past(1), 2);
    EXPECT_EQ(engine->n_past(), 3);
    const int64_t V = m.hp().n_vocab;
    ASSERT_EQ(engine->logits().size(), size_t(2 * V));
    EXPECT_TRUE(bitwise_equal({engine->logits().begin() + V, engine->logits().end()},
                              alone(m, {32, 512, 1, true}, {b})[0]));
    engine->clear(0);
    EXPECT_EQ(engine->n_past(0), 0);
    EXPECT_EQ(engine->n_past(1), 2);
    engine->clear();
    EXPECT_EQ(engine->n_past(1), 0);
}
