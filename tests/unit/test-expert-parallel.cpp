// Expert parallelism on the CPU (issue 16): expert groups (planning, balance, JSON), the dispatch plan, the
// in-process all-to-all, and the expert-parallel executor against the one-GPU MoE block, bit for bit.
#include "../common/error-of.h"
#include "../common/bitwise.h"
#include "../common/greedy-logits.h"
#include "../common/random-trace.h"
#include "arch/arch.h"
#include "offload/all-to-all.h"
#include "offload/expert-dispatch.h"
#include "offload/expert-groups.h"
#include "offload/offload-config.h"
#include "offload/placement.h"
#include "offload/trace.h"
#include "runtime/context.h"
#include "runtime/engine.h"
#include "runtime/expert-parallel.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

using namespace prescope;
using prescope::test::error_of;
namespace fs = std::filesystem;

namespace {

fs::path source_path(const std::string &rel) { return fs::path(PRESCOPE_SOURCE_DIR) / rel; }

std::string tmp_path(const std::string &name) {
    return (fs::temp_directory_path() / ("prescope-ep-" + std::to_string(getpid()) + "-" + name)).string();
}

// Random top-k routing of n_tok tokens over E experts (distinct ids per token).
std::vector<int32_t> random_ids(int64_t n_tok, int32_t E, int32_t k, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> perm(static_cast<size_t>(E)), ids;
    for (int64_t t = 0; t < n_tok; ++t) {
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        ids.insert(ids.end(), perm.begin(), perm.begin() + k);
    }
    return ids;
}

// Groups with every GPU's share of experts but the experts shuffled among GPUs.
ExpertGroups shuffled_groups(int32_t n_layers, int32_t E, int32_t G, uint32_t seed) {
    ExpertGroups g = ExpertGroups::contiguous(n_layers, E, G);
    std::mt19937 rng(seed);
    for (int32_t l = 0; l < n_layers; ++l) {
        std::shuffle(g.gpu.begin() + ptrdiff_t(l) * E, g.gpu.begin() + ptrdiff_t(l + 1) * E, rng);
    }
    return g;
}

// Each token picks one of `pairs` expert pairs {a, b} (top-2), uniformly: experts a and b always come together.
RoutingTrace paired_trace(const std::vector<std::array<int32_t, 2>> &pairs, int32_t E, int64_t n_tok) {
    RoutingTrace t;
    t.model = "test", t.arch = "qwen3moe", t.created_by = "test";
    t.n_layer = 1, t.n_expert = E, t.top_k = 2;
    t.sequences.push_back({"s0", "test-split", n_tok});
    for (int64_t i = 0; i < n_tok; ++i) {
        const auto &p = pairs[size_t(i) % pairs.size()];
        t.append_token(uint32_t(i), std::vector<int32_t>{p[0], p[1]}, std::vector<float>{0.6f, 0.4f});
    }
    return t;
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------
// expert groups

TEST(ExpertGroups, ContiguousGroupsGiveEveryGpuItsShareInRanges) {
    const ExpertGroups g = ExpertGroups::contiguous(2, 10, 4);
    EXPECT_EQ(std::vector<int8_t>(g.layer(0).begin(), g.layer(0).end()),
              (std::vector<int8_t>{0, 0, 0, 1, 1, 1, 2, 2, 3, 3}));
    EXPECT_EQ(g.capacity(0), 3);
    EXPECT_EQ(g.capacity(3), 2);
}

TEST(ExpertGroups, JsonRoundTripsThroughAFile) {
    ExpertGroups g = shuffled_groups(3, 8, 3, 7);
    g.tolerance = 0.25;
    const std::string p = tmp_path("groups.json");
    g.save(p);
    const ExpertGroups back = ExpertGroups::load(p);
    EXPECT_EQ(back.gpu, g.gpu);
    EXPECT_EQ(back.n_gpus, 3);
    EXPECT_EQ(back.tolerance, 0.25);
    EXPECT_EQ(g.to_json()["layers"][0].get<std::string>().size(), 8u);
    fs::remove(p);
}

TEST(ExpertGroups, BadFilesNameTheFileAndTheField) {
    const nlohmann::json good = ExpertGroups::contiguous(2, 4, 2).to_json();
    const auto error_with = [&](const std::function<void(nlohmann::json &)> &edit) {
        nlohmann::json j = good;
        edit(j);
        return error_of([&] { ExpertGroups::from_json(j, "g.json"); });
    };
    EXPECT_NE(error_with([](auto &j) { j["format"] = "prescope-placement"; }).find("g.json: 'format'"), std::string::npos);
    EXPECT_NE(error_with([](auto &j) { j["version"] = 2; }).find("'version' must be 1"), std::string::npos);
    EXPECT_NE(error_with([](auto &j) { j["n_gpus"] = 9; }).find("'n_gpus' must be an integer in [1, 8]"), std::string::npos);
    EXPECT_NE(error_with([](auto &j) { j["n_gpus"] = 5; }).find("no more GPUs than the 4 experts"), std::string::npos);
    EXPECT_NE(error_with([](auto &j) { j["n_layers"] = "2"; }).find("'n_layers'"), std::string::npos);
    EXPECT_NE(error_with([](auto &j) { j["tolerance"] = -1; }).find("'tolerance'"), std::string::npos);
    EXPECT_NE(error_with([](auto &j) { j["layers"].erase(1); }).find("array of 2 strings"), std::string::npos);
    EXPECT_NE(error_with([](auto &j) { j["layers"][1] = 3; }).find("layers[1] must be a string"), std::string::npos);
    EXPECT_NE(error_with([](auto &j) { j["layers"][0] = "001"; }).find("layers[0] has 3 characters, expected 4"),
              std::string::npos);
    EXPECT_NE(error_with([](auto &j) { j["layers"][0] = "0012"; }).find("layers[0][3] is '2', expected a GPU from 0 to 1"),
              std::string::npos);
    EXPECT_NE(error_with([](auto &j) { j["layers"][1] = "0001"; }).find("layers[1] gives GPU 0 3 experts, expected 2"),
              std::string::npos);
    EXPECT_EQ(error_with([](auto &j) { j["layers"][1] = "1010"; }), "");  // any experts, as long as the shares hold

    const std::string p = tmp_path("broken.json");
    std::ofstream(p) << "{\"format\": ";
    EXPECT_NE(error_of([&] { ExpertGroups::load(p); }).find(p + ": not valid JSON"), std::string::npos);
    fs::remove(p);
    EXPECT_NE(error_of([&] { ExpertGroups::load(p); }).find(p + ": cannot open"), std::string::npos);

    const ExpertGroups g = ExpertGroups::contiguous(2, 4, 2);
    EXPECT_NE(error_of([&] { g.check_shape(3, 4, 2, "g.json"); }).find("g.json: expert groups for 2 MoE layers x 4 experts, "
                                                                    "the model has 3 x 4"),
              std::string::npos);
    EXPECT_NE(error_of([&] { g.check_shape(2, 4, 4, "g.json"); }).find("expert groups for 2 GPUs, --gpus is 4"),
              std::string::npos);
}

TEST(RoutingStats, CountsLoadsAndCoActivationsSymmetrically) {
    RoutingStats s(2, 4);
    s.add(1, std::vector<int32_t>{0, 2, 2, 3, 0, 2}, 2);  // tokens {0,2} {2,3} {0,2}
    EXPECT_EQ(s.tokens[1], 3u);
    EXPECT_EQ(s.tokens[0], 0u);
    EXPECT_EQ(std::vector<uint32_t>(s.load.begin() + 4, s.load.end()), (std::vector<uint32_t>{2, 0, 3, 1}));
    EXPECT_EQ(s.coact_at(1, 0, 2), 2u);
    EXPECT_EQ(s.coact_at(1, 2, 0), 2u);
    EXPECT_EQ(s.coact_at(1, 2, 3), 1u);
    EXPECT_EQ(s.coact_at(1, 0, 3), 0u);
    EXPECT_EQ(s.coact_at(1, 2, 2), 0u);
    s.decay(1);
    EXPECT_EQ(s.tokens[1], 1u);
    EXPECT_EQ(s.coact_at(1, 0, 2), 1u);
    EXPECT_EQ(s.load[4 + 3], 0u);

    const RoutingTrace t = test::random_trace(3, 6, 2, {5, 4}, 3, [](int32_t) { return 0.5f; });
    const RoutingStats from_trace = RoutingStats::of_trace(t);
    RoutingStats by_hand(3, 6);
    for (int64_t tok = 0; tok < t.n_tokens(); ++tok) {
        for (int32_t l = 0; l < 3; ++l) by_hand.add(l, std::vector<int32_t>(t.ids(tok, l), t.ids(tok, l) + 2), 2);
    }
    EXPECT_EQ(from_trace.load, by_hand.load);
    EXPECT_EQ(from_trace.coact, by_hand.coact);
}

TEST(ExpertGroups, PlannedGroupsPutCoActivatedExpertsOnOneGpu) {
    // Experts come in fixed pairs that contiguous ranges split: a plan that keeps each pair together sends every
    // token to one GPU instead of two.
    const RoutingTrace t = paired_trace({{0, 5}, {1, 6}, {2, 7}, {3, 4}}, 8, 400);
    const RoutingStats s = RoutingStats::of_trace(t);
    const ExpertGroups plan = plan_expert_groups(s, 4, 0.1);
    for (const auto &p : std::vector<std::array<int32_t, 2>>{{0, 5}, {1, 6}, {2, 7}, {3, 4}}) {
        EXPECT_EQ(plan.gpu_of(0, p[0]), plan.gpu_of(0, p[1])) << p[0] << " " << p[1];
    }
    EXPECT_DOUBLE_EQ(gpus_per_token(plan, t, "t")[0], 1.0);
    EXPECT_DOUBLE_EQ(gpus_per_token(ExpertGroups::contiguous(1, 8, 4), t, "t")[0], 2.0);
    const GroupBalance b = group_balance(plan, s, 0);
    EXPECT_DOUBLE_EQ(b.co_located, 1.0);
    EXPECT_DOUBLE_EQ(b.imbalance, 1.0);
}

TEST(ExpertGroups, PlannedGroupsBalanceTheLoadWithinTheTolerance) {
    // Four hot experts first: contiguous ranges put them all on GPU 0. Each GPU must still hold 4 experts.
    RoutingStats s(1, 8);
    std::vector<int32_t> ids;
    for (int32_t e = 0; e < 8; ++e) ids.insert(ids.end(), size_t(e < 4 ? 10 : 1), e);
    s.add(0, ids, 1);
    EXPECT_GT(group_balance(ExpertGroups::contiguous(1, 8, 2), s, 0).imbalance, 1.8);
    const ExpertGroups plan = plan_expert_groups(s, 2, 0.1);
    EXPECT_LE(group_balance(plan, s, 0).imbalance, 1.1);
    EXPECT_EQ(std::count(plan.gpu.begin(), plan.gpu.end(), 0), 4);
    // Co-activation never buys an overload: the pair {0, 1} is co-activated most, but together with two more
    // experts on one GPU it would carry 2/3 of the load.
    RoutingStats c(1, 6);
    c.add(0, std::vector<int32_t>{0, 1, 0, 1, 0, 1, 2, 3, 4, 5}, 2);
    const ExpertGroups pc = plan_expert_groups(c, 2, 0.0);
    EXPECT_LE(group_balance(pc, c, 0).imbalance, 1.0 + 1e-9);
}

TEST(ExpertGroups, PlanOfTheBalancedMixtralTraceSendsTokensToFewerGpusThanRanges) {
    const RoutingTrace t = read_trace(source_path("traces/topo-mixtral-test.pstrace").string());
    const RoutingStats s = RoutingStats::of_trace(t);
    for (int32_t G : {2, 4}) {
        const ExpertGroups plan = plan_expert_groups(s, G, 0.1);
        EXPECT_EQ(plan.gpu, plan_expert_groups(s, G, 0.1).gpu);  // deterministic
        const std::vector<double> planned = gpus_per_token(plan, t, "t");
        const std::vector<double> ranges = gpus_per_token(ExpertGroups::contiguous(t.n_layer, t.n_expert, G), t, "t");
        const double p = std::accumulate(planned.begin(), planned.end(), 0.0) / t.n_layer;
        const double r = std::accumulate(ranges.begin(), ranges.end(), 0.0) / t.n_layer;
        EXPECT_LT(p, r) << G << " GPUs";
        for (int32_t l = 0; l < t.n_layer; ++l) {
            const double contiguous = group_balance(ExpertGroups::contiguous(t.n_layer, t.n_expert, G), s, l).imbalance;
            EXPECT_LE(group_balance(plan, s, l).imbalance, std::max(1.1, contiguous) + 1e-9) << "layer " << l;
        }
    }
}

TEST(ExpertGroups, PlanningRefusesImpossibleGpuCounts) {
    const RoutingStats s(1, 4);
    EXPECT_NE(error_of([&] { plan_expert_groups(s, 0, 0.1); }).find("expected 1 to 4 GPUs"), std::string::npos);
    EXPECT_NE(error_of([&] { plan_expert_groups(s, 5, 0.1); }).find("got 5"), std::string::npos);
    EXPECT_NE(error_of([&] { plan_expert_groups(s, 2, -0.5); }).find("tolerance"), std::string::npos);
    const RoutingTrace t = test::random_trace(2, 4, 2, {3}, 1, [](int32_t) { return 0.5f; });
    EXPECT_NE(error_of([&] { gpus_per_token(ExpertGroups::contiguous(3, 4, 2), t, "x.pstrace"); })
                  .find("x.pstrace: a trace of 2 MoE layers x 4 experts, the expert groups are for 3 x 4"),
              std::string::npos);
}

// ---------------------------------------------------------------------------------------------------------------
// all-to-all and dispatch plan

TEST(FakeAllToAll, SegmentsLandAfterTheEarlierSendersAndEmptyOnesAreNotTouched) {
    FakeAllToAll a2a(3);
    // rows[s][d]; GPU 1 sends nothing to GPU 2, GPU 2 nothing at all.
    const std::vector<int64_t> rows = {1, 2, 0, 2, 0, 0, 0, 0, 0};
    std::vector<std::vector<int32_t>> send = {{100, 101, 102}, {110, 111}, {}};
    std::vector<std::vector<int32_t>> recv = {{-1, -1, -1, -1}, {-1, -1, -1}, {-1}};
    std::vector<const void *> sp;
    std::vector<void *> rp;
    for (auto &v : send) sp.push_back(v.data());
    for (auto &v : recv) rp.push_back(v.data());
    a2a.exchange(sp, rp, rows, sizeof(int32_t));
    EXPECT_EQ(recv[0], (std::vector<int32_t>{100, 110, 111, -1}));
    EXPECT_EQ(recv[1], (std::vector<int32_t>{101, 102, -1}));
    EXPECT_EQ(recv[2], (std::vector<int32_t>{-1}));
    EXPECT_EQ(a2a.bytes_between_gpus(), 4 * sizeof(int32_t));
    EXPECT_EQ(a2a.exchanges(), 1);
}

namespace {

// Runs a plan's two all-to-alls on FakeAllToAll with rows of one int: the dispatch moves token ids, each GPU
// "computes" the code t * k + j of each pair from the token id it reads, the combine brings the codes home.
// Returns, per (t, j), the code found at pair_row in home[t]'s combine receive buffer.
std::vector<int32_t> run_plan_with_codes(const DispatchPlan &p, std::span<const int32_t> ids) {
    const int32_t G = p.n_gpus;
    FakeAllToAll a2a(G);
    const auto n = static_cast<size_t>(G);
    std::vector<std::vector<int32_t>> dsend(n), drecv(n), csend(n), crecv(n);
    size_t at = 0;
    for (int32_t g = 0; g < G; ++g) {
        for (int64_t i = 0; i < p.dispatch_sent(g); ++i) dsend[size_t(g)].push_back(p.dispatch_tokens[at++]);
        drecv[size_t(g)].assign(size_t(p.dispatch_received(g)), -1);
        crecv[size_t(g)].assign(size_t(p.combine_received(g)), -1);
    }
    std::vector<const void *> sp;
    std::vector<void *> rp;
    for (int32_t g = 0; g < G; ++g) sp.push_back(dsend[size_t(g)].data()), rp.push_back(drecv[size_t(g)].data());
    a2a.exchange(sp, rp, p.dispatch_rows, sizeof(int32_t));
    for (int32_t g = 0; g < G; ++g) {
        const GpuWork &w = p.work[size_t(g)];
        std::vector<int32_t> out(size_t(w.pairs()));
        for (int32_t i = 0; i < w.n(); ++i) {
            for (int32_t q = w.offsets[size_t(i)]; q < w.offsets[size_t(i) + 1]; ++q) {
                const int32_t t = drecv[size_t(g)][size_t(w.rows[size_t(q)])];
                const int32_t *x = ids.data() + t * p.k;
                const auto j = int32_t(std::find(x, x + p.k, w.experts[size_t(i)]) - x);
                EXPECT_LT(j, p.k) << "GPU " << g << " got token " << t << " for expert " << w.experts[size_t(i)];
                out[size_t(q)] = int32_t(t * p.k + j);
            }
        }
        for (int32_t q : w.send) csend[size_t(g)].push_back(out[size_t(q)]);
    }
    sp.clear(), rp.clear();
    for (int32_t g = 0; g < G; ++g) sp.push_back(csend[size_t(g)].data()), rp.push_back(crecv[size_t(g)].data());
    a2a.exchange(sp, rp, p.combine_rows, sizeof(int32_t));
    std::vector<int32_t> found(size_t(p.n_tok * p.k));
    for (int64_t t = 0; t < p.n_tok; ++t) {
        for (int64_t j = 0; j < p.k; ++j) {
            found[size_t(t * p.k + j)] = crecv[size_t(p.home[size_t(t)])][size_t(p.pair_row[size_t(t * p.k + j)])];
        }
    }
    return found;
}

} // namespace

TEST(DispatchPlan, EveryPairReadsItsTokenAndItsOutputComesHomeToItsSlot) {
    for (int32_t G : {1, 2, 3, 5, 8}) {
        for (bool contiguous : {true, false}) {
            SCOPED_TRACE(testing::Message() << G << " GPUs, " << (contiguous ? "contiguous" : "random") << " homes");
            const int32_t E = 16, k = 4;
            const int64_t n_tok = 37;
            const std::vector<int32_t> ids = random_ids(n_tok, E, k, uint32_t(G));
            const ExpertGroups groups = shuffled_groups(1, E, G, uint32_t(G + 1));
            std::vector<int32_t> home(static_cast<size_t>(n_tok));
            if (contiguous) {
                contiguous_homes(G, home);
                EXPECT_TRUE(std::is_sorted(home.begin(), home.end()));
                EXPECT_EQ(home.back(), G - 1);
            } else {
                std::mt19937 rng(9);
                for (int32_t &h : home) h = int32_t(rng() % uint32_t(G));
            }
            DispatchPlan p;
            p.reserve(G, 64, k, E);
            build_dispatch_plan(ids, k, groups.layer(0), home, p);
            // Every pair's code arrives where pair_row says.
            const std::vector<int32_t> found = run_plan_with_codes(p, ids);
            for (int64_t i = 0; i < n_tok * k; ++i) ASSERT_EQ(found[size_t(i)], i);
            // One dispatch row per token and GPU holding one of its experts; per GPU, its own experts in
            // ascending id, each expert's pairs in token order (the one-GPU block's layout).
            int64_t rows = 0;
            for (int64_t t = 0; t < n_tok; ++t) {
                unsigned mask = 0;
                for (int32_t j = 0; j < k; ++j) mask |= 1u << groups.gpu_of(0, ids[size_t(t * k + j)]);
                rows += std::popcount(mask);
            }
            EXPECT_EQ(int64_t(p.dispatch_tokens.size()), rows);
            int64_t pairs = 0;
            for (int32_t g = 0; g < G; ++g) {
                const GpuWork &w = p.work[size_t(g)];
                EXPECT_TRUE(std::is_sorted(w.experts.begin(), w.experts.end()));
                for (int32_t e : w.experts) EXPECT_EQ(groups.gpu_of(0, e), g);
                pairs += w.pairs();
                EXPECT_EQ(p.combine_sent(g), w.pairs());
            }
            EXPECT_EQ(pairs, n_tok * k);
        }
    }
}

TEST(DispatchPlan, OneGpuRunsTheRoutedExpertsOfTheOneGpuBlock) {
    const int32_t E = 8, k = 2;
    const std::vector<int32_t> ids = random_ids(9, E, k, 4);
    std::vector<int32_t> home(9, 0);
    DispatchPlan p;
    p.reserve(1, 9, k, E);
    build_dispatch_plan(ids, k, ExpertGroups::contiguous(1, E, 1).layer(0), home, p);
    LayerDecision d;
    d.reserve(E);
    count_routed(0, ids, E, d);
    ASSERT_EQ(p.work[0].n(), int32_t(d.experts.size()));
    for (size_t i = 0; i < d.experts.size(); ++i) {
        EXPECT_EQ(p.work[0].experts[i], d.experts[i].expert);
        EXPECT_EQ(p.work[0].offsets[i + 1] - p.work[0].offsets[i], d.experts[i].n_tokens);
    }
    EXPECT_EQ(p.dispatch_rows[0], 9);
}

// ---------------------------------------------------------------------------------------------------------------
// the executor against the one-GPU block

namespace {

// Prefill of a fixed prompt in passes of n_batch tokens (all logits), then greedy decode; every logit.
std::vector<float> run_tokens(const Model &model, ExpertExecutor *executor, int64_t n_batch, int n_prompt, int n_decode) {
    return test::greedy_logits(model, executor, 128, n_batch, n_prompt, n_decode);
}

class ExpertParallelModels : public ::testing::TestWithParam<std::string> {};

} // namespace

TEST_P(ExpertParallelModels, LogitsEqualTheOneGpuBlockForOneToEightGpus) {
    const auto model = Model::load(source_path("tests/data/models/" + GetParam()).string());
    const HParams &hp = model->hp();
    const int32_t L = int32_t(hp.n_layer_moe()), E = int32_t(hp.n_expert);
    // Passes of 5 tokens (decode-sized products) and of 40 (the GEMM paths).
    for (int64_t n_batch : {int64_t(5), int64_t(40)}) {
        const std::vector<float> ref = run_tokens(*model, nullptr, n_batch, 41, 4);
        for (int32_t G = 1; G <= std::min(8, E); ++G) {
            SCOPED_TRACE(testing::Message() << G << " GPUs, passes of " << n_batch << " tokens");
            FakeAllToAll a2a(G);
            ExpertParallelExecutor ep(*model, shuffled_groups(L, E, G, uint32_t(G)), a2a, n_batch);
            EXPECT_EQ(test::bits_differing(run_tokens(*model, &ep, n_batch, 41, 4), ref), 0u);
            EXPECT_EQ(ep.stats().steps, a2a.exchanges() / 2);
            EXPECT_EQ(ep.stats().remote_rows > 0, G > 1);
            EXPECT_NE(ep.stats_text().find(std::to_string(G) + " GPUs"), std::string::npos);
        }
    }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, ExpertParallelModels,
                         ::testing::Values("qwen3moe/tiny-f32.gguf", "qwen3moe/tiny-q8_0.gguf", "mixtral/tiny-f32.gguf",
                                           "mixtral/tiny-q8_0.gguf", "olmoe/tiny-q8_0.gguf", "qwen2moe/tiny-f32.gguf",
                                           "qwen2moe/tiny-q8_0.gguf", "deepseekv3/tiny-q8_0.gguf",
                                           "deepseekv2lite/tiny-f32.gguf", "gptoss/tiny-f32.gguf",
                                           "gptoss/tiny-mxfp4.gguf"),
                         test::string_param_name);

TEST(ExpertParallel, GroupsReplannedAfterDriftChangeNoLogit) {
    // A drift window of 3 tokens and no tolerance: nearly every check finds a GPU above the mean and re-plans.
    const auto model = Model::load(source_path("tests/data/models/qwen3moe/tiny-f32.gguf").string());
    const std::vector<float> ref = run_tokens(*model, nullptr, 5, 23, 6);
    ExpertGroups groups = ExpertGroups::contiguous(int32_t(model->hp().n_layer_moe()), int32_t(model->hp().n_expert), 4);
    groups.tolerance = 0.0;
    const ExpertGroups before = groups;
    FakeAllToAll a2a(4);
    ExpertParallelConfig config;
    config.drift_window = 3;
    ExpertParallelExecutor ep(*model, groups, a2a, 5, config);
    EXPECT_EQ(test::bits_differing(run_tokens(*model, &ep, 5, 23, 6), ref), 0u);
    EXPECT_GT(ep.stats().replans, 0);
    EXPECT_NE(ep.groups().gpu, before.gpu);
    for (int32_t l = 0; l < ep.groups().n_layers; ++l) {
        for (int32_t g = 0; g < 4; ++g) {
            EXPECT_EQ(std::count(ep.groups().layer(l).begin(), ep.groups().layer(l).end(), int8_t(g)), 2);
        }
    }
}

TEST(ExpertParallel, SeveralSequencesInOnePassEqualTheOneGpuBlock) {
    const auto model = Model::load(source_path("tests/data/models/mixtral/tiny-q8_0.gguf").string());
    const auto run = [&](ExpertExecutor *executor) {
        Context ctx(*model, {64, 16, 3}, executor);
        const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7}, b = {9, 8}, c = {20, 21, 22, 23, 24};
        ctx.eval_batch(std::vector<SeqTokens>{{0, a}, {1, b}, {2, c}});
        std::vector<float> out = ctx.logits();
        const int32_t n[3] = {3, 4, 5};
        ctx.eval_batch(std::vector<SeqTokens>{{0, {&n[0], 1}}, {1, {&n[1], 1}}, {2, {&n[2], 1}}});
        out.insert(out.end(), ctx.logits().begin(), ctx.logits().end());
        return out;
    };
    const std::vector<float> ref = run(nullptr);
    FakeAllToAll a2a(3);
    ExpertParallelExecutor ep(*model, shuffled_groups(int32_t(model->hp().n_layer_moe()), 8, 3, 5), a2a, 16);
    EXPECT_EQ(test::bits_differing(run(&ep), ref), 0u);
}

TEST(ExpertParallel, TheCpuEngineRunsGpusFromTheConfigAndTheGpuRuntimeRefusesSeveral) {
    const std::string path = source_path("tests/data/models/qwen3moe/tiny-f32.gguf").string();
    const auto model = Model::load(path);
    const auto logits = [&](const OffloadConfig &c) {
        const std::unique_ptr<Engine> e = make_engine(*model, {64, 8}, c);
        const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3};
        e->eval(prompt, true);
        return std::make_pair(e->logits(), e->startup_text() + e->stats_text());
    };
    const auto [ref, ref_text] = logits({});
    OffloadConfig c;
    c.set("gpus", "3", "test");
    const auto [three, text] = logits(c);
    EXPECT_EQ(test::bits_differing(three, ref), 0u);
    EXPECT_NE(text.find("expert parallel: 3 GPUs simulated on the CPU"), std::string::npos) << text;
    EXPECT_NE(text.find("GPUs per token and layer"), std::string::npos) << text;
    EXPECT_EQ(ref_text.find("expert parallel"), std::string::npos);

    // A groups file from the trace planner, shape-checked against the model and --gpus.
    RoutingStats s(int32_t(model->hp().n_layer_moe()), 8);
    s.add(0, random_ids(50, 8, 2, 1), 2);
    const std::string groups = tmp_path("engine-groups.json");
    plan_expert_groups(s, 2, 0.1).save(groups);
    c.set("expert_groups", groups, "test");
    EXPECT_NE(error_of([&] { logits(c); }).find(groups + ": expert groups for 2 GPUs, --gpus is 3"), std::string::npos);
    c.set("gpus", "2", "test");
    EXPECT_EQ(test::bits_differing(logits(c).first, ref), 0u);
    EXPECT_NE(logits(c).second.find("groups from " + groups), std::string::npos);
    fs::remove(groups);

    OffloadConfig gpu;
    gpu.set("gpu_cache", "1GiB", "test");
    gpu.set("gpus", "2", "--gpus");
    const std::string e = error_of([&] { make_engine(*model, {64, 8}, gpu); });
    EXPECT_NE(e.find("--gpus 2"), std::string::npos) << e;
    EXPECT_NE(e.find("not built yet"), std::string::npos) << e;
}
