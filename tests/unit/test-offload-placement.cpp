// Placement plan (JSON round trip, errors, llama.cpp --n-cpu-moe form) and the hybrid HIT/FETCH/CPU rule.
#include "../common/error-of.h"
#include "core/error.h"
#include "offload/expert-cache.h"
#include "offload/placement.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <random>

using namespace prescope;
using prescope::test::error_of;

namespace {

ExpertCacheConfig cache_config(int32_t n_layers, int32_t n_experts, int32_t top_k, int32_t slots_per_layer) {
    ExpertCacheConfig c;
    c.n_layers = n_layers;
    c.n_experts = n_experts;
    c.top_k = top_k;
    c.expert_bytes = {256};
    c.budget_bytes = uint64_t(n_layers) * uint64_t(slots_per_layer) * 256;
    return c;
}

const RoutedExpert &entry(const LayerDecision &d, int32_t expert) {
    for (const RoutedExpert &r : d.experts) {
        if (r.expert == expert) return r;
    }
    throw std::runtime_error("expert not in decision");
}

} // namespace

TEST(PlacementPlan, JsonRoundTripKeepsEveryExpert) {
    PlacementPlan plan = PlacementPlan::uniform(3, 5);
    std::mt19937 rng(1);
    for (auto &p : plan.experts) p = {HomeTier(rng() % 3), ExecSite(rng() % 3)};
    PlacementPlan back = PlacementPlan::from_json(plan.to_json(), "test");
    EXPECT_EQ(back.experts, plan.experts);

    std::string path = ::testing::TempDir() + "/plan.json";
    plan.save(path);
    EXPECT_EQ(PlacementPlan::load(path).experts, plan.experts);
    std::remove(path.c_str());
}

TEST(PlacementPlan, BadPlansFailNamingTheField) {
    nlohmann::json j = PlacementPlan::uniform(2, 4).to_json();
    nlohmann::json short_exec = j;
    short_exec["layers"][1]["exec"] = "AAA";
    EXPECT_NE(error_of([&] { PlacementPlan::from_json(short_exec, "p.json"); })
                  .find("p.json: layers[1].exec has 3 characters, expected 4 (n_experts)"),
              std::string::npos);
    nlohmann::json bad_char = j;
    bad_char["layers"][0]["home"] = "PPXP";
    EXPECT_NE(error_of([&] { PlacementPlan::from_json(bad_char, "p.json"); }).find("layers[0].home[2] is 'X'"),
              std::string::npos);
    nlohmann::json missing = j;
    missing.erase("n_experts");
    EXPECT_NE(error_of([&] { PlacementPlan::from_json(missing, "p.json"); }).find("'n_experts'"), std::string::npos);
    nlohmann::json layers = j;
    layers["layers"].erase(1);
    EXPECT_NE(error_of([&] { PlacementPlan::from_json(layers, "p.json"); }).find("array of 2 entries"),
              std::string::npos);

    std::string path = ::testing::TempDir() + "/broken.json";
    std::ofstream(path) << "{\"format\": ";
    EXPECT_NE(error_of([&] { PlacementPlan::load(path); }).find("not valid JSON"), std::string::npos);
    std::remove(path.c_str());
    EXPECT_NE(error_of([] { PlacementPlan::uniform(2, 4).check_shape(48, 128, "p.json"); })
                  .find("for 2 layers x 4 experts, the model has 48 x 128"),
              std::string::npos);
}

TEST(PlacementPlan, CpuLayersIsLlamaCppNCpuMoe) {
    PlacementPlan plan = PlacementPlan::cpu_layers(4, 3, 2);
    for (int32_t e = 0; e < 3; ++e) {
        EXPECT_EQ(plan.at(1, e), (ExpertPlacement{HomeTier::MMAP, ExecSite::CPU}));
        EXPECT_EQ(plan.at(2, e), (ExpertPlacement{HomeTier::GPU, ExecSite::GPU}));
    }
    std::string s = plan.summary();
    EXPECT_NE(s.find("layers 0-1:"), std::string::npos) << s;
    EXPECT_NE(s.find("layers 2-3:"), std::string::npos) << s;
}

TEST(HybridDecision, ResidentExpertsHitOthersFollowTheTokenThreshold) {
    ExpertCache cache(cache_config(2, 8, 2, 4));
    cache.acquire(1, 5);
    cache.release_layer(1);
    PlacementPlan plan = PlacementPlan::uniform(2, 8);
    LayerDecision d;
    d.reserve(8);
    // 4 tokens, top-2: expert 5 x1 (resident), expert 2 x4, expert 3 x2, expert 6 x1.
    std::vector<int32_t> routed = {2, 5, 2, 3, 2, 6, 3, 2};
    decide_layer(1, routed, plan, &cache, HybridRule{3}, d);
    EXPECT_EQ(d.experts.size(), 4u);
    EXPECT_EQ(entry(d, 5).action, ExpertAction::HIT);
    EXPECT_EQ(entry(d, 2).action, ExpertAction::FETCH);  // 4 tokens >= 3
    EXPECT_EQ(entry(d, 3).action, ExpertAction::CPU);    // 2 tokens < 3
    EXPECT_EQ(entry(d, 6).action, ExpertAction::CPU);
    EXPECT_EQ(entry(d, 2).n_tokens, 4);
    EXPECT_EQ(d.n_hit + d.n_fetch + d.n_cpu, 4);
    EXPECT_EQ(d.describe(), "layer 1: hit 1 [5:1] fetch 1 [2:4] cpu 2 [3:2 6:1]");

    decide_layer(1, routed, plan, &cache, HybridRule{0}, d);  // threshold 0: never the CPU
    EXPECT_EQ(d.n_cpu, 0);
    decide_layer(1, routed, plan, nullptr, HybridRule{0}, d);  // no GPU cache: everything on the CPU
    EXPECT_EQ(d.n_cpu, 4);
}

TEST(HybridDecision, PlanSitesOverrideTheRule) {
    ExpertCache cache(cache_config(1, 8, 2, 4));
    cache.acquire(0, 1);
    cache.release_layer(0);
    PlacementPlan plan = PlacementPlan::uniform(1, 8);
    plan.at(0, 1).exec = ExecSite::CPU;  // resident, but the plan says CPU
    plan.at(0, 4).exec = ExecSite::GPU;  // one token, but the plan says GPU
    LayerDecision d;
    d.reserve(8);
    std::vector<int32_t> routed = {1, 4};
    decide_layer(0, routed, plan, &cache, HybridRule{16}, d);
    EXPECT_EQ(entry(d, 1).action, ExpertAction::CPU);
    EXPECT_EQ(entry(d, 4).action, ExpertAction::FETCH);
}

TEST(HybridDecision, FetchesBeyondFreeSlotsGoToTheCpuFewestTokensFirst) {
    // 4 slots per layer, one fixed and one hit: room for 2 fetches among 4 candidates.
    ExpertCache cache(cache_config(1, 16, 2, 4));
    cache.fix(0, 15);
    cache.acquire(0, 0);
    cache.release_layer(0);
    PlacementPlan plan = PlacementPlan::uniform(1, 16);
    plan.at(0, 9).exec = ExecSite::GPU;  // forced: keeps its fetch whatever its token count
    LayerDecision d;
    d.reserve(16);
    std::vector<int32_t> routed = {0, 3, 3, 3, 7, 7, 8, 9};
    decide_layer(0, routed, plan, &cache, HybridRule{0}, d);
    EXPECT_EQ(entry(d, 0).action, ExpertAction::HIT);
    EXPECT_EQ(entry(d, 9).action, ExpertAction::FETCH);
    EXPECT_EQ(entry(d, 3).action, ExpertAction::FETCH);  // 3 tokens
    EXPECT_EQ(entry(d, 7).action, ExpertAction::CPU);    // 2 tokens: demoted
    EXPECT_EQ(entry(d, 8).action, ExpertAction::CPU);    // 1 token: demoted
    EXPECT_EQ(d.n_demoted, 2);
    EXPECT_EQ(d.n_hit + d.n_fetch, cache.layer_slots(0) - cache.layer_fixed(0));
}

TEST(HybridDecision, LargeBatchesStreamTheFetchesThatFindNoFreeSlot) {
    // As above: room for 2 fetches among 4 candidates; the batch has 4 tokens (8 picks, top-2).
    for (const int32_t min_batch : {4, 5, 0}) {
        SCOPED_TRACE(min_batch);
        ExpertCache cache(cache_config(1, 16, 2, 4));
        cache.fix(0, 15);
        cache.acquire(0, 0);
        cache.release_layer(0);
        const PlacementPlan plan = PlacementPlan::uniform(1, 16);
        LayerDecision d;
        d.reserve(16);
        const std::vector<int32_t> routed = {0, 3, 3, 3, 7, 7, 8, 9};
        decide_layer(0, routed, plan, &cache, HybridRule{0, min_batch}, d);
        const bool stream = min_batch == 4;  // 5 tokens needed: too few; 0: never
        EXPECT_EQ(entry(d, 0).action, ExpertAction::HIT);
        EXPECT_EQ(entry(d, 3).action, ExpertAction::FETCH);  // 3 tokens
        EXPECT_EQ(entry(d, 7).action, ExpertAction::FETCH);  // 2 tokens, expert id below 8 and 9
        for (int32_t e : {8, 9}) EXPECT_EQ(entry(d, e).action, stream ? ExpertAction::STREAM : ExpertAction::CPU);
        EXPECT_EQ(d.n_stream, stream ? 2 : 0);
        EXPECT_EQ(d.n_cpu, stream ? 0 : 2);
        EXPECT_EQ(d.n_demoted, stream ? 0 : 2);
    }
}

TEST(HybridDecision, NoStreamingInALayerWhoseSlotsAreAllFixed) {
    ExpertCache cache(cache_config(1, 16, 2, 4));
    for (int32_t e : {12, 13, 14, 15}) cache.fix(0, e);
    const PlacementPlan plan = PlacementPlan::uniform(1, 16);
    LayerDecision d;
    d.reserve(16);
    const std::vector<int32_t> routed = {0, 3, 3, 3, 7, 7, 8, 9};
    decide_layer(0, routed, plan, &cache, HybridRule{0, 1}, d);
    EXPECT_EQ(d.n_stream, 0);
    EXPECT_EQ(d.n_cpu, 5);  // 0, 3, 7, 8, 9: no slot to fetch or stream into
}
