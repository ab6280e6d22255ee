// Hot-expert table: hits and misses, eviction policies, pins, budgets, counters (bookkeeping only, no backend).
#include "../common/error-of.h"
#include "core/error.h"
#include "offload/byte-size.h"
#include "offload/expert-cache.h"
#include "offload/fake-backend.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <random>
#include <set>

using namespace prescope;
using prescope::test::error_of;

namespace {

constexpr uint64_t kExpertBytes = 1000;  // slot = 1024 with the default 256-byte alignment

ExpertCacheConfig config(int32_t n_layers, int32_t n_experts, int32_t top_k, int32_t slots_per_layer,
                         EvictionPolicyKind policy = EvictionPolicyKind::LRU) {
    ExpertCacheConfig c;
    c.n_layers = n_layers;
    c.n_experts = n_experts;
    c.top_k = top_k;
    c.expert_bytes = {kExpertBytes};
    c.budget_bytes = uint64_t(n_layers) * uint64_t(slots_per_layer) * 1024;
    c.policy = policy;
    return c;
}

// One step of one layer: demand-acquire each expert, then release the layer.
void step(ExpertCache &cache, int32_t layer, std::initializer_list<int32_t> experts) {
    for (int32_t e : experts) cache.acquire(layer, e);
    cache.release_layer(layer);
}

const EvictionPolicyKind kPolicies[] = {EvictionPolicyKind::LRU, EvictionPolicyKind::LFU, EvictionPolicyKind::ARC};

} // namespace

TEST(ExpertCache, ColdAccessMissesAndRepeatHits) {
    ExpertCache cache(config(1, 8, 2, 4));
    SlotGrant first = cache.acquire(0, 3);
    EXPECT_TRUE(first.load);
    EXPECT_FALSE(first.hit);
    cache.release_layer(0);
    SlotGrant again = cache.acquire(0, 3);
    EXPECT_TRUE(again.hit);
    EXPECT_FALSE(again.load);
    EXPECT_EQ(again.slot, first.slot);
    EXPECT_EQ(cache.stats(0).demand_misses, 1u);
    EXPECT_EQ(cache.stats(0).hits, 1u);
}

TEST(ExpertCache, CapacityEqualToExpertCountEvictsNothing) {
    for (EvictionPolicyKind policy : kPolicies) {
        ExpertCache cache(config(2, 8, 2, 8, policy));
        std::mt19937 rng(7);
        std::set<std::pair<int, int>> seen;
        for (int t = 0; t < 500; ++t) {
            int32_t layer = int32_t(rng() % 2), a = int32_t(rng() % 8), b = int32_t((a + 1 + rng() % 7) % 8);
            step(cache, layer, {a, b});
            seen.insert({layer, a});
            seen.insert({layer, b});
        }
        LayerStats s = cache.total_stats();
        EXPECT_EQ(s.evictions, 0u) << eviction_policy_name(policy);
        EXPECT_EQ(s.demand_misses, seen.size()) << eviction_policy_name(policy);
    }
}

TEST(ExpertCache, LruEvictsTheLeastRecentlyUsed) {
    ExpertCache cache(config(1, 8, 1, 2, EvictionPolicyKind::LRU));
    step(cache, 0, {0});
    step(cache, 0, {1});
    step(cache, 0, {0});
    SlotGrant g = cache.acquire(0, 2);
    EXPECT_EQ(g.evicted_expert, 1);
    EXPECT_GE(cache.find(0, 0), 0);
    EXPECT_LT(cache.find(0, 1), 0);
}

// A used 5 times long ago, B once just now; a new expert must replace one of them.
TEST(ExpertCache, FrequentExpertOutlivesAStaleOneUnderLfuAndArcButNotLru) {
    const std::pair<EvictionPolicyKind, int32_t> expected_victim[] = {
        {EvictionPolicyKind::LRU, 0}, {EvictionPolicyKind::LFU, 1}, {EvictionPolicyKind::ARC, 1}};
    for (auto [policy, victim] : expected_victim) {
        ExpertCache cache(config(1, 8, 1, 2, policy));
        for (int i = 0; i < 5; ++i) step(cache, 0, {0});
        step(cache, 0, {1});
        SlotGrant g = cache.acquire(0, 2);
        EXPECT_EQ(g.evicted_expert, victim) << eviction_policy_name(policy);
    }
}

TEST(ExpertCache, OneTimeScanDoesNotFlushFrequentExpertsUnderLfuAndArc) {
    for (EvictionPolicyKind policy : kPolicies) {
        ExpertCache cache(config(1, 16, 1, 4, policy));
        for (int i = 0; i < 3; ++i) step(cache, 0, {0, 1});
        for (int32_t e = 2; e < 10; ++e) step(cache, 0, {e});  // each used once
        bool kept = cache.find(0, 0) >= 0 && cache.find(0, 1) >= 0;
        EXPECT_EQ(kept, policy != EvictionPolicyKind::LRU) << eviction_policy_name(policy);
    }
}

TEST(ExpertCache, WhenTheWorkingSetMovesLruAndArcAdaptButLfuKeepsStaleExperts) {
    // Capacity 4: experts 0 and 1 are used often, then the layer cycles over 2..5 for good. ARC learns the new
    // set through its ghost lists; LFU keeps 0 and 1 (high counts) and misses forever on a 4-cycle in 2 slots.
    for (EvictionPolicyKind policy : kPolicies) {
        ExpertCache cache(config(1, 8, 1, 4, policy));
        for (int i = 0; i < 3; ++i) step(cache, 0, {0, 1});
        for (int round = 0; round < 2; ++round) {
            for (int32_t e = 2; e < 6; ++e) step(cache, 0, {e});
        }
        uint64_t misses_before = cache.stats(0).demand_misses;
        for (int round = 0; round < 3; ++round) {
            for (int32_t e = 2; e < 6; ++e) step(cache, 0, {e});
        }
        uint64_t late_misses = cache.stats(0).demand_misses - misses_before;
        if (policy == EvictionPolicyKind::LFU) EXPECT_EQ(late_misses, 12u);
        else EXPECT_EQ(late_misses, 0u) << eviction_policy_name(policy);
    }
}

TEST(ExpertCache, PinnedExpertIsNeverEvicted) {
    // Under LFU expert 1 (1 use) is the natural victim; pinned by the running layer, expert 0 goes instead.
    ExpertCache cache(config(1, 8, 2, 2, EvictionPolicyKind::LFU));
    for (int i = 0; i < 3; ++i) step(cache, 0, {0});
    step(cache, 0, {1});
    cache.acquire(0, 1);  // pinned until release_layer
    SlotGrant g = cache.acquire(0, 2);
    EXPECT_EQ(g.evicted_expert, 0);
    EXPECT_GE(cache.find(0, 1), 0);
    // Both slots pinned now: a prefetch finds no slot instead of evicting.
    EXPECT_EQ(cache.prefetch(0, 3).slot, -1);
}

TEST(ExpertCache, MoreUniqueExpertsThanCapacityInOneLayerFailsLoudly) {
    ExpertCache cache(config(2, 8, 2, 2));
    cache.acquire(1, 0);
    cache.acquire(1, 1);
    std::string msg = error_of([&] { cache.acquire(1, 2); });
    EXPECT_NE(msg.find("layer 1 has 2 GPU slots"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expert 2"), std::string::npos) << msg;
}

TEST(ExpertCache, BudgetBelowOneLayersTopKFailsStatingTheMinimum) {
    ExpertCacheConfig c = config(48, 128, 8, 8);
    uint64_t min = ExpertCache::min_budget_bytes(c);
    EXPECT_EQ(min, 48u * 8u * 1024u);
    c.budget_bytes = min - 1;
    std::string msg = error_of([&] { ExpertCache cache(c); });
    EXPECT_NE(msg.find(format_byte_size(min)), std::string::npos) << msg;
    EXPECT_NE(msg.find("--gpu-expert-budget"), std::string::npos) << msg;
    c.budget_bytes = min;
    ExpertCache cache(c);
    EXPECT_EQ(cache.n_slots(), 48 * 8);
}

TEST(ExpertCache, ZeroBudgetHasNoSlots) {
    ExpertCacheConfig c = config(4, 8, 2, 0);
    ExpertCache cache(c);
    EXPECT_EQ(cache.n_slots(), 0);
    EXPECT_EQ(cache.layer_slots(3), 0);
}

TEST(ExpertCache, BudgetSplitsEvenlyWithTheRemainderToTheFirstLayers) {
    ExpertCacheConfig c = config(3, 8, 2, 0);
    c.budget_bytes = 8 * 1024 + 1000;  // 8 whole slots
    ExpertCache cache(c);
    EXPECT_EQ(cache.layer_slots(0), 3);
    EXPECT_EQ(cache.layer_slots(1), 3);
    EXPECT_EQ(cache.layer_slots(2), 2);
    c.budget_bytes = 1000 * 1024;  // more than every expert: capped at n_experts per layer
    ExpertCache big(c);
    EXPECT_EQ(big.n_slots(), 3 * 8);
}

TEST(ExpertCache, SlotIsTheLargestExpertRoundedToTheAlignment) {
    ExpertCacheConfig c = config(2, 2, 1, 2);
    c.expert_bytes = {100, 300, 200, 257};
    c.budget_bytes = 4 * 512;
    EXPECT_EQ(ExpertCache::slot_bytes_for(c), 512u);
    ExpertCache cache(c);
    EXPECT_EQ(cache.expert_bytes(1, 1), 257u);
}

TEST(ExpertCache, EachLayerBuysSlotsOfItsOwnSize) {
    // A mixed-type file: layer 1's experts are larger (a Q6_K down projection next to Q4_K ones).
    ExpertCacheConfig c = config(3, 8, 2, 0);
    c.expert_bytes.clear();
    for (uint64_t b : {1000u, 1700u, 1000u}) c.expert_bytes.insert(c.expert_bytes.end(), 8, b);
    EXPECT_EQ(ExpertCache::layer_slot_bytes_for(c), (std::vector<uint64_t>{1024, 1792, 1024}));
    EXPECT_EQ(ExpertCache::slot_bytes_for(c), 1792u);
    EXPECT_EQ(ExpertCache::min_budget_bytes(c), 2u * (1024 + 1792 + 1024));
    // 3 slots in every layer (3 x 3840) plus 2000 left: one more slot for layer 0 (1024), not for layer 1.
    c.budget_bytes = 3 * 3840 + 2000;
    FakeBackend backend;
    ExpertCache cache(c, &backend);
    EXPECT_EQ(cache.layer_slots(0), 4);
    EXPECT_EQ(cache.layer_slots(1), 3);
    EXPECT_EQ(cache.layer_slots(2), 3);
    EXPECT_EQ(cache.slot_bytes(1), 1792u);
    EXPECT_EQ(cache.pool_bytes(), 4u * 1024 + 3 * 1792 + 3 * 1024);
    EXPECT_EQ(ExpertCache::pool_bytes_for(c), cache.pool_bytes());
    // Slots of a layer are its own size apart and never overlap another's bytes.
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
    for (int32_t s = 0; s < cache.n_slots(); ++s) {
        const auto begin = reinterpret_cast<uintptr_t>(cache.slot_data(s));
        ranges.emplace_back(begin, begin + cache.slot_bytes(cache.slot_layer(s)));
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].second, ranges[i].first);
    EXPECT_EQ(ranges.back().second - ranges.front().first, cache.pool_bytes());
    // The minimum names the per-layer sizes.
    c.budget_bytes = ExpertCache::min_budget_bytes(c) - 1;
    const std::string msg = error_of([&] { ExpertCache too_small(c); });
    EXPECT_NE(msg.find("slots of 1.00 KiB to 1.75 KiB"), std::string::npos) << msg;
}

TEST(ExpertCache, LayersAreSeparateEvictionGroups) {
    ExpertCache cache(config(2, 8, 1, 2));
    step(cache, 0, {0});
    step(cache, 0, {1});
    for (int32_t e = 0; e < 8; ++e) step(cache, 1, {e});
    EXPECT_GE(cache.find(0, 0), 0);
    EXPECT_GE(cache.find(0, 1), 0);
    EXPECT_EQ(cache.stats(0).evictions, 0u);
    EXPECT_EQ(cache.stats(1).evictions, 6u);
}

TEST(ExpertCache, PrefetchHitIsCountedOnceAndUnusedPrefetchIsWasted) {
    ExpertCache cache(config(1, 8, 1, 2));
    EXPECT_TRUE(cache.prefetch(0, 5).load);
    EXPECT_TRUE(cache.prefetch(0, 5).hit);  // already resident: no second load
    step(cache, 0, {5});
    step(cache, 0, {5});
    EXPECT_EQ(cache.stats(0).hits, 2u);
    EXPECT_EQ(cache.stats(0).prefetch_hits, 1u);
    EXPECT_EQ(cache.stats(0).wasted_prefetch_bytes, 0u);

    cache.begin_prefetch_round();
    cache.prefetch(0, 6);  // never used
    step(cache, 0, {5});
    step(cache, 0, {7});   // evicts 6 (least recent)
    EXPECT_LT(cache.find(0, 6), 0);
    EXPECT_EQ(cache.stats(0).wasted_prefetch_bytes, kExpertBytes);
}

TEST(ExpertCache, PrefetchesOfOneRoundDoNotEvictEachOther) {
    ExpertCache cache(config(1, 8, 1, 2));
    cache.begin_prefetch_round();
    EXPECT_TRUE(cache.prefetch(0, 0).load);
    EXPECT_TRUE(cache.prefetch(0, 1).load);
    EXPECT_EQ(cache.prefetch(0, 2).slot, -1);
    cache.begin_prefetch_round();
    EXPECT_TRUE(cache.prefetch(0, 2).load);
}

TEST(ExpertCache, FixedExpertsAreNeverEvicted) {
    for (EvictionPolicyKind policy : kPolicies) {
        ExpertCache cache(config(1, 16, 1, 3, policy));
        EXPECT_TRUE(cache.fix(0, 9).load);
        EXPECT_EQ(cache.layer_fixed(0), 1);
        for (int32_t e = 0; e < 16; ++e) step(cache, 0, {e});
        EXPECT_GE(cache.find(0, 9), 0) << eviction_policy_name(policy);
    }
}

TEST(ExpertCache, CountersAddUp) {
    for (EvictionPolicyKind policy : kPolicies) {
        ExpertCache cache(config(3, 16, 2, 4, policy));
        std::mt19937 rng(11);
        uint64_t routed = 0;
        for (int t = 0; t < 2000; ++t) {
            int32_t layer = int32_t(rng() % 3);
            int32_t a = int32_t(rng() % 16), b = int32_t(rng() % 16);
            if (b == a) b = (a + 1) % 16;
            step(cache, layer, {a, b});
            cache.record_cpu(layer, 1);  // a third routed expert ran on the CPU
            routed += 3;
            cache.begin_prefetch_round();
            cache.prefetch(int32_t(rng() % 3), int32_t(rng() % 16));
        }
        LayerStats s = cache.total_stats();
        const char *name = eviction_policy_name(policy);
        EXPECT_EQ(s.accesses(), routed) << name;
        EXPECT_EQ(s.bytes_loaded, (s.demand_misses + s.prefetch_loads) * kExpertBytes) << name;
        EXPECT_LE(s.prefetch_hits, s.prefetch_loads) << name;
        EXPECT_LE(s.wasted_prefetch_bytes, s.prefetch_loads * kExpertBytes) << name;
        int32_t resident = 0;
        for (int32_t l = 0; l < 3; ++l) {
            for (int32_t e = 0; e < 16; ++e) resident += cache.find(l, e) >= 0;
        }
        EXPECT_EQ(s.evictions, s.demand_misses + s.prefetch_loads - uint64_t(resident)) << name;
        LayerStats sum;
        for (int32_t l = 0; l < 3; ++l) sum += cache.stats(l);
        EXPECT_EQ(sum.hits, s.hits);
    }
}

TEST(ExpertCache, StatsJsonAndTableCarryEveryLayerAndTheTotal) {
    ExpertCache cache(config(2, 8, 1, 2));
    step(cache, 0, {1});
    step(cache, 0, {1});
    step(cache, 1, {2});
    cache.record_cpu(1, 2);
    nlohmann::json j = cache.stats_json();
    ASSERT_EQ(j["layers"].size(), 2u);
    EXPECT_EQ(j["layers"][0]["hits"], 1);
    EXPECT_EQ(j["layers"][1]["cpu_runs"], 2);
    EXPECT_EQ(j["total"]["demand_misses"], 2);
    EXPECT_DOUBLE_EQ(j["total"]["hit_rate"].get<double>(), 1.0 / 5.0);
    std::string table = cache.stats_table();
    EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 4);  // header, 2 layers, total
    EXPECT_NE(table.find("  all "), std::string::npos) << table;
}

// A deepseek2 model's leading dense layers (decision 0134): experts of 0 bytes, so no slots, no share of the
// budget or of its minimum, no row in the stats; the cache still numbers layers as the model does.
TEST(ExpertCache, LayersWithoutExpertsTakeNoSlotsNoBudgetAndNoStatsRows) {
    ExpertCacheConfig c = config(3, 8, 2, 0);
    c.expert_bytes.assign(3 * 8, kExpertBytes);
    std::fill_n(c.expert_bytes.begin(), 8, 0);  // layer 0 is dense
    EXPECT_EQ(ExpertCache::min_budget_bytes(c), 2u * 2u * 1024u);
    c.budget_bytes = 2 * 4 * 1024 + 1024;  // 4 slots for each MoE layer and one more
    ExpertCache cache(c);
    EXPECT_FALSE(cache.has_experts(0));
    EXPECT_TRUE(cache.has_experts(1));
    EXPECT_EQ(cache.n_moe_layers(), 2);
    EXPECT_EQ(cache.layer_slots(0), 0);
    EXPECT_EQ(cache.slot_bytes(0), 0u);
    EXPECT_EQ(cache.layer_slots(1), 5);  // the remainder goes to the first layer with experts
    EXPECT_EQ(cache.layer_slots(2), 4);
    EXPECT_EQ(ExpertCache::pool_bytes_for(c), 9u * 1024u);
    const std::string d = cache.describe();
    EXPECT_NE(d.find("(4 to 5 per layer, 2 layers x 8 experts; 1 dense layer without slots)"), std::string::npos) << d;

    step(cache, 1, {3});
    step(cache, 2, {4});
    const nlohmann::json j = cache.stats_json();
    ASSERT_EQ(j["layers"].size(), 2u);
    EXPECT_EQ(j["layers"][0]["layer"], 1);
    EXPECT_EQ(j["layers"][1]["slot_bytes"], 1024);
    const std::string table = cache.stats_table();
    EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 4) << table;  // header, layers 1 and 2, total
    EXPECT_EQ(table.find("\n    0 "), std::string::npos) << table;
    testing::GTEST_FLAG(death_test_style) = "threadsafe";  // the process may hold OpenMP threads already
    EXPECT_DEATH(cache.prefetch(0, 1), "has_experts");      // no predictor may name a dense layer

    c.budget_bytes = ExpertCache::min_budget_bytes(c) - 1;
    const std::string small = error_of([&] { ExpertCache x(c); });
    EXPECT_NE(small.find("2 MoE layers x top-2 experts in slots of 1.00 KiB to 1.00 KiB"), std::string::npos) << small;
    c.budget_bytes = 1 << 20;
    c.slots_per_layer = {0, 2, 3};
    EXPECT_EQ(ExpertCache(c).n_slots(), 5);
    c.slots_per_layer = {2, 2, 3};
    EXPECT_NE(error_of([&] { ExpertCache x(c); }).find("layer 0 has no experts but is given 2 slots, expected 0"),
              std::string::npos);
    c.slots_per_layer.clear();
    c.expert_bytes[8] = 0;  // one expert of layer 1 without bytes
    EXPECT_NE(error_of([&] { ExpertCache x(c); }).find("layer 1 has 1 experts of 0 bytes among 8"), std::string::npos);
    std::fill(c.expert_bytes.begin(), c.expert_bytes.end(), 0);
    EXPECT_NE(error_of([&] { ExpertCache x(c); }).find("none of the 3 layers has experts"), std::string::npos);
}

TEST(EvictionPolicy, NamesParseAndUnknownNamesFail) {
    EXPECT_EQ(parse_eviction_policy("ARC"), EvictionPolicyKind::ARC);
    EXPECT_EQ(parse_eviction_policy("lfu"), EvictionPolicyKind::LFU);
    std::string msg = error_of([] { parse_eviction_policy("fifo"); });
    EXPECT_NE(msg.find("expected lru, lfu or arc"), std::string::npos) << msg;
}

TEST(ByteSize, ParsesDecimalAndBinaryUnits) {
    EXPECT_EQ(parse_byte_size("12GiB", "x"), 12ull << 30);
    EXPECT_EQ(parse_byte_size("512MiB", "x"), 512ull << 20);
    EXPECT_EQ(parse_byte_size("1.5GB", "x"), 1500000000ull);
    EXPECT_EQ(parse_byte_size("12G", "x"), 12ull << 30);
    EXPECT_EQ(parse_byte_size("4 kb", "x"), 4000ull);
    EXPECT_EQ(parse_byte_size("1024", "x"), 1024ull);
    EXPECT_EQ(parse_byte_size("0", "x"), 0ull);
    EXPECT_EQ(parse_byte_size("0.5KiB", "x"), 512ull);
}

TEST(ByteSize, RejectsAnythingElseNamingTheOption) {
    for (const char *bad : {"", "GiB", "-1GiB", "12XB", "1.2.3G", "12 GiB extra", "1e3"}) {
        std::string msg = error_of([&] { parse_byte_size(bad, "--gpu-expert-budget"); });
        EXPECT_NE(msg.find("--gpu-expert-budget"), std::string::npos) << "'" << bad << "': " << msg;
    }
    EXPECT_EQ(format_byte_size(12ull << 30), "12.00 GiB");
    EXPECT_EQ(format_byte_size(512), "512 B");
}
