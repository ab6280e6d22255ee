// PreSched (offload/scheduler.h, schedule-ilp.h, cost-model.h, load-balancer.h): the timing model on layers
// small enough to work out by hand, the heuristic and the GLPK form against each other and against brute force,
// the threshold rule against decide_layer, the cost model against the fake backend's link clock, the load
// balancer's corrections.
#include "../common/error-of.h"
#include "core/error.h"
#include "offload/copy-engine.h"
#include "offload/cost-model.h"
#include "offload/expert-cache.h"
#include "offload/fake-backend.h"
#include "offload/layer-stats.h"
#include "offload/load-balancer.h"
#include "offload/schedule-ilp.h"
#include "offload/scheduler.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <random>

using namespace prescope;

namespace {

SchedExpert miss(int32_t id, int32_t tokens, double gpu, double cpu, double fetch) {
    SchedExpert x;
    x.expert = id;
    x.n_tokens = tokens;
    x.gpu_us = gpu;
    x.cpu_us = cpu;
    x.fetch_us = fetch;
    return x;
}

SchedExpert hit(int32_t id, double gpu, double arrival = -1) {
    SchedExpert x = miss(id, 1, gpu, 1e6, 0);
    x.where = arrival < 0 ? SchedResidency::RESIDENT : SchedResidency::ARRIVING;
    x.arrival_us = std::max(arrival, 0.0);
    return x;
}

// A decode layer of the Mixtral shape (H200 reference numbers, rounded): fetch 3500 us, CPU 2800 us, GPU 100 us.
LayerState mixtral_two_misses() {
    LayerState s;
    s.layer = 3;
    s.n_tokens = 1;
    s.free_slots = 2;
    s.wave_slots = 2;
    s.wave_us = 20;
    s.cpu_layer_us = 10;
    s.next_layer_us = 140;
    s.routed = {miss(1, 1, 100, 2800, 3500), miss(5, 1, 100, 2800, 3500)};
    return s;
}

LayerDecision with_actions(const LayerState &s, std::initializer_list<ExpertAction> actions) {
    LayerDecision d;
    d.reserve(16);
    d.layer = s.layer;
    size_t i = 0;
    for (ExpertAction a : actions) {
        d.experts.push_back({s.routed[i].expert, s.routed[i].n_tokens, a, -1});
        ++i;
        switch (a) {
        case ExpertAction::HIT: ++d.n_hit; break;
        case ExpertAction::FETCH: ++d.n_fetch; break;
        case ExpertAction::STREAM: ++d.n_stream; break;
        case ExpertAction::CPU: ++d.n_cpu; break;
        }
    }
    return d;
}

LayerPlan plan_of(const LayerState &s) {
    Scheduler sched;
    sched.reserve(64, 64);
    LayerPlan p;
    p.reserve(64, 64);
    sched.plan(s, p);
    return p;
}

// The best objective over every GPU/CPU choice and every prefetch subset (small states only).
double brute_force(const LayerState &s, int32_t max_in_flight = 8) {
    std::vector<int32_t> order;
    candidate_priority_order(s, order);
    std::vector<int32_t> free_idx;
    for (size_t i = 0; i < s.routed.size(); ++i) {
        const SchedExpert &x = s.routed[i];
        if (x.where == SchedResidency::MISSING && x.site == ExecSite::AUTO && s.wave_slots > 0) free_idx.push_back(int32_t(i));
    }
    double best = INFINITY;
    LayerDecision d;
    d.reserve(64);
    for (uint32_t mask = 0; mask < (1u << free_idx.size()); ++mask) {
        std::vector<uint8_t> gpu(s.routed.size(), 0);
        int32_t n_gpu = 0, forced = 0;
        for (size_t i = 0; i < s.routed.size(); ++i) {
            if (s.routed[i].where == SchedResidency::MISSING && s.routed[i].site == ExecSite::GPU) gpu[i] = 1, ++forced;
        }
        n_gpu = forced;
        for (size_t b = 0; b < free_idx.size(); ++b) {
            if (mask >> b & 1) gpu[size_t(free_idx[b])] = 1, ++n_gpu;
        }
        if (!(s.stream && s.wave_slots > 0) && n_gpu > std::max(s.free_slots, forced)) continue;
        decision_from_choice(s, gpu, d);
        const bool split = plan_splits(d);
        for (uint32_t pm = 0; pm < (1u << order.size()); ++pm) {
            std::vector<PlannedPrefetch> pf;
            std::vector<int32_t> per(s.next_free.size(), 0);
            bool ok = true;
            for (size_t k = 0; k < order.size(); ++k) {
                if (!(pm >> k & 1)) continue;
                const SchedCandidate &c = s.candidates[size_t(order[k])];
                if (++per[size_t(c.distance - 1)] > s.next_free[size_t(c.distance - 1)]) ok = false;
                pf.push_back({c.layer, c.expert, c.prob, 0, 0, -1, order[k], -1});
            }
            if (!ok) continue;
            // Installs: any subset of the CPU-run misses with a credit, within the free slots and the room.
            std::vector<int32_t> cpu_idx;
            for (size_t i = 0; i < s.routed.size(); ++i) {
                if (d.experts[i].action == ExpertAction::CPU && s.routed[i].where == SchedResidency::MISSING &&
                    s.routed[i].site == ExecSite::AUTO && s.routed[i].install_us > 0) {
                    cpu_idx.push_back(int32_t(i));
                }
            }
            for (uint32_t im = 0; im < (1u << cpu_idx.size()); ++im) {
                std::vector<PlannedPrefetch> all = pf;
                int32_t n_inst = 0;
                for (size_t b = 0; b < cpu_idx.size(); ++b) {
                    if (!(im >> b & 1)) continue;
                    all.push_back({s.layer, s.routed[size_t(cpu_idx[b])].expert, 1, 0, 0, -1, -1, cpu_idx[b]});
                    ++n_inst;
                }
                if (n_inst > 0 && (d.n_stream > 0 || n_inst + d.n_fetch > std::max(s.free_slots, forced))) continue;
                if (int32_t(all.size()) > std::min(s.prefetch_room, max_in_flight)) continue;
                best = std::min(best, evaluate_plan(s, d, split, all).objective());
            }
        }
    }
    return best;
}

LayerState random_state(std::mt19937 &rng, bool stream) {
    std::uniform_real_distribution<double> u(0, 1);
    LayerState s;
    s.layer = 2;
    s.n_tokens = stream ? 64 : 1;
    const int n = 1 + int(rng() % (stream ? 7 : 6));
    s.wave_slots = 1 + int(rng() % 4);
    s.stream = stream;
    s.wave_us = 5 + 30 * u(rng);
    s.cpu_layer_us = 20 * u(rng);
    s.host_us = 10 * u(rng);
    s.issue_slack_us = 100 * u(rng);
    s.link_free_us = u(rng) < 0.5 ? 0 : 300 * u(rng);
    s.next_layer_us = 100 + 100 * u(rng);
    s.moe_estimate_us = 300 * u(rng);
    const double fetch = 100 + 3000 * u(rng);
    int32_t resident = 0;
    for (int i = 0; i < n; ++i) {
        const int32_t tokens = stream ? 1 + int(rng() % 64) : 1;
        if (u(rng) < 0.3 && resident < s.wave_slots) {
            s.routed.push_back(hit(i * 3, 20 + 50 * u(rng), u(rng) < 0.3 ? 500 * u(rng) : -1));
            ++resident;
        } else {
            SchedExpert x = miss(i * 3, tokens, 10 + 20 * u(rng) + tokens, 50 + 30 * tokens + 2000 * u(rng), fetch);
            if (u(rng) < 0.1) x.site = ExecSite::GPU;
            if (u(rng) < 0.5) x.install_us = 400 * u(rng);
            s.routed.push_back(x);
        }
    }
    s.free_slots = s.wave_slots - resident;
    const int window = 1 + int(rng() % 2);
    s.next_free.assign(size_t(window), 1 + int(rng() % 2));
    s.prefetch_room = 1 + int(rng() % 3);
    const int nc = int(rng() % 5);
    for (int i = 0; i < nc; ++i) {
        SchedCandidate c;
        c.distance = 1 + int(rng() % window);
        c.layer = s.layer + c.distance;
        c.expert = i;
        c.prob = u(rng);
        c.fetch_us = fetch;
        c.miss_us = 500 * u(rng);
        if (u(rng) < 0.5) c.install_us = 300 * u(rng);
        s.candidates.push_back(c);
    }
    s.link_price = u(rng) < 0.5 ? 0.0 : u(rng);
    return s;
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------
// the timing model by hand

TEST(SchedulerModel, TwoMissedMixtralExpertsOneOnTheCpuOneOverTheLinkFinishTogether) {
    const LayerState s = mixtral_two_misses();
    // Both on the CPU: 10 + 2 x 2800.
    EXPECT_DOUBLE_EQ(evaluate_plan(s, with_actions(s, {ExpertAction::CPU, ExpertAction::CPU}), false, {}).critical_us,
                     5610);
    // Both fetched: the wave waits for 2 x 3500 of copies, then 20 + 2 x 100.
    EXPECT_DOUBLE_EQ(
        evaluate_plan(s, with_actions(s, {ExpertAction::FETCH, ExpertAction::FETCH}), false, {}).critical_us, 7220);
    // One each, split: the CPU ends at 2810 while the copy lands at 3500; the FETCH wave then takes 120.
    const LayerDecision one = with_actions(s, {ExpertAction::FETCH, ExpertAction::CPU});
    const PlanTimes t = evaluate_plan(s, one, true, {});
    EXPECT_DOUBLE_EQ(t.cpu_end_us, 2810);
    EXPECT_DOUBLE_EQ(t.link_end_us, 3500);
    EXPECT_DOUBLE_EQ(t.critical_us, 3620);
    // Not split (the old order): the host blocks until the copy is issued, so the CPU starts at 3500.
    EXPECT_DOUBLE_EQ(evaluate_plan(s, one, false, {}).critical_us, 3500 + 2810);

    const LayerPlan p = plan_of(s);
    EXPECT_EQ(p.decision.n_fetch, 1);
    EXPECT_EQ(p.decision.n_cpu, 1);
    EXPECT_TRUE(p.split);
    EXPECT_DOUBLE_EQ(p.predicted.critical_us, 3620);
}

TEST(SchedulerModel, SmallExpertsGoToWhicheverSideIsCheaper) {
    // Qwen3-shape decode: 8 misses of one token; the link is a little slower than the CPU per expert.
    LayerState s;
    s.n_tokens = 1;
    s.free_slots = s.wave_slots = 8;
    s.wave_us = 22;
    for (int i = 0; i < 8; ++i) s.routed.push_back(miss(i, 1, 3, 100, 104));
    const LayerPlan p = plan_of(s);
    // Split: 22 + 3 m after max(104 m, 100 (8 - m)); m = 4 gives max(416, 400) + 34 = 450, the best.
    EXPECT_EQ(p.decision.n_fetch, 4);
    EXPECT_DOUBLE_EQ(p.predicted.critical_us, 416 + 22 + 12);
    // The link's price is for speculative copies only (decision 0147): the misses' split does not move with it.
    s.link_price = 1;
    EXPECT_EQ(plan_of(s).decision.n_fetch, 4);
    EXPECT_DOUBLE_EQ(plan_of(s).predicted.link_cost_us, 0);
    s.link_price = 0;
    // A CPU twice as slow sends more over the link.
    for (SchedExpert &x : s.routed) x.cpu_us = 200;
    EXPECT_EQ(plan_of(s).decision.n_fetch, 5);  // max(520, 600) vs max(624, 400): 5 -> 600 + 37, 6 -> 624 + 40
}

TEST(SchedulerModel, HitsRunFirstAndFetchesJoinTheirWaveWhenNothingRunsOnTheCpu) {
    LayerState s;
    s.free_slots = 1;
    s.wave_slots = 2;
    s.wave_us = 20;
    s.routed = {hit(0, 30), miss(4, 1, 40, 1e6, 500)};
    // Fused: one wave after the copy, 20 + 30 + 40.
    EXPECT_DOUBLE_EQ(evaluate_plan(s, with_actions(s, {ExpertAction::HIT, ExpertAction::FETCH}), false, {}).critical_us,
                     590);
    // A hit still arriving holds the wave back, and the host until it is issued (slack before it lands).
    s.routed[0] = hit(0, 30, 700);
    s.issue_slack_us = 100;
    s.host_us = 5;
    const PlanTimes t = evaluate_plan(s, with_actions(s, {ExpertAction::HIT, ExpertAction::FETCH}), false, {});
    EXPECT_DOUBLE_EQ(t.gpu_end_us, 790);
    EXPECT_DOUBLE_EQ(t.cpu_end_us, 605);  // no CPU experts: the host is free after max(600, 400) + 5
}

TEST(SchedulerModel, StreamedWavesWaitForTheWaveBeforeAndTheLink) {
    LayerState s;
    s.n_tokens = 64;
    s.free_slots = 1;
    s.wave_slots = 1;
    s.stream = true;
    s.wave_us = 2;
    s.routed = {miss(0, 9, 5, 1000, 10), miss(1, 9, 5, 1000, 10), miss(2, 9, 5, 1000, 10)};
    const LayerDecision d = with_actions(s, {ExpertAction::FETCH, ExpertAction::STREAM, ExpertAction::STREAM});
    // wave 0: copy 10, compute 2 + 5 -> 17; wave 1: copy 17..27, compute -> 34; wave 2: copy 34..44 -> 51.
    const PlanTimes t = evaluate_plan(s, d, false, {});
    EXPECT_DOUBLE_EQ(t.critical_us, 51);
    EXPECT_DOUBLE_EQ(t.link_end_us, 44);
    std::vector<uint8_t> all(3, 1);
    LayerDecision from;
    from.reserve(8);
    decision_from_choice(s, all, from);
    EXPECT_EQ(from.n_fetch, 1);
    EXPECT_EQ(from.n_stream, 2);
}

TEST(SchedulerModel, APrefetchIsPlannedOnlyIfItLandsBeforeItIsNeeded) {
    LayerState s;
    s.layer = 0;
    s.free_slots = s.wave_slots = 2;
    s.next_layer_us = 300;
    s.next_free = {1};
    s.prefetch_room = 4;
    s.routed = {hit(2, 10)};
    s.wave_us = 0;
    SchedCandidate c;
    c.layer = 1;
    c.expert = 7;
    c.distance = 1;
    c.prob = 0.5;
    c.fetch_us = 100;
    c.miss_us = 200;
    s.candidates = {c};
    // Deadline: the hits' wave (10) + one layer (300) = 310; the copy lands at 100.
    LayerPlan p = plan_of(s);
    ASSERT_EQ(p.prefetch.size(), 1u);
    EXPECT_DOUBLE_EQ(p.prefetch[0].arrival_us, 100);
    EXPECT_DOUBLE_EQ(p.prefetch[0].needed_us, 310);
    EXPECT_DOUBLE_EQ(p.predicted.next_stall_us, 0);
    // Behind 250 us of other copies it would land at 350: not planned, and its prob x miss counts as stall.
    s.link_free_us = 250;
    p = plan_of(s);
    EXPECT_TRUE(p.prefetch.empty());
    EXPECT_DOUBLE_EQ(p.predicted.next_stall_us, 100);
    // Its link time at a price: worth it while prob x miss (100) exceeds price x fetch (100 x price).
    s.link_free_us = 0;
    s.link_price = 0.5;
    EXPECT_EQ(plan_of(s).prefetch.size(), 1u);
    s.link_price = 1;
    EXPECT_TRUE(plan_of(s).prefetch.empty());
    s.link_price = 0;
    // An install (a CPU-run miss copied behind the layer) pays the same price: credited 60 against a 100 us copy,
    // planned while the price is under 0.6, and its price counted in the objective.
    LayerState inst;
    inst.free_slots = inst.wave_slots = 2;
    inst.prefetch_room = 4;
    inst.routed = {miss(4, 1, 3, 10, 100)};  // the CPU (10 us) beats the link (100 + 3): it runs there
    inst.routed[0].install_us = 60;
    inst.link_price = 0.5;
    LayerPlan ip = plan_of(inst);
    ASSERT_EQ(ip.decision.n_cpu, 1);
    ASSERT_EQ(ip.prefetch.size(), 1u);
    EXPECT_EQ(ip.prefetch[0].routed, 0);
    EXPECT_DOUBLE_EQ(ip.predicted.link_cost_us, 50);
    inst.link_price = 0.7;
    EXPECT_TRUE(plan_of(inst).prefetch.empty());
    // No slot to take in layer 1: nothing planned either.
    s.next_free = {0};
    EXPECT_TRUE(plan_of(s).prefetch.empty());
}

TEST(SchedulerModel, PlacementSitesAreObeyed) {
    LayerState s = mixtral_two_misses();
    s.routed[0].site = ExecSite::CPU;
    s.routed[1].site = ExecSite::GPU;
    const LayerPlan p = plan_of(s);
    EXPECT_EQ(p.decision.experts[0].action, ExpertAction::CPU);
    EXPECT_EQ(p.decision.experts[1].action, ExpertAction::FETCH);
}

// ---------------------------------------------------------------------------------------------------------------
// heuristic, ILP and brute force

TEST(ScheduleIlp, HandSolvedLayersHaveTheOptimaWorkedOutAbove) {
    const IlpResult r = solve_layer_ilp(mixtral_two_misses());
    ASSERT_TRUE(r.optimal) << r.status;
    EXPECT_NEAR(r.objective_us, 3620, 1e-6);
    EXPECT_NEAR(r.plan.predicted.objective(), r.objective_us, 1e-6);
    EXPECT_EQ(r.plan.decision.n_fetch, 1);
    EXPECT_TRUE(r.plan.split);
}

TEST(ScheduleIlp, IlpEqualsBruteForceAndTheEvaluationOfItsOwnPlanOnRandomSmallLayers) {
    std::mt19937 rng(7);
    int checked = 0;
    for (int i = 0; i < 300; ++i) {
        const LayerState s = random_state(rng, i % 3 == 0);
        const IlpResult r = solve_layer_ilp(s);
        SCOPED_TRACE(s.to_json().dump());
        ASSERT_TRUE(r.optimal) << r.status << " " << r.n_binaries << " binaries";
        const double bf = brute_force(s);
        SCOPED_TRACE(testing::Message() << "ilp " << r.objective_us << " eval " << r.plan.predicted.objective() << " bf "
                                        << bf << " plan " << r.plan.describe());
        EXPECT_NEAR(r.objective_us, bf, 1e-6 * std::max(1.0, bf));
        EXPECT_NEAR(r.plan.predicted.objective(), r.objective_us, 1e-6 * std::max(1.0, bf));
        const double h = plan_of(s).predicted.objective();
        EXPECT_GE(h, bf - 1e-6 * std::max(1.0, bf));  // the heuristic never beats the optimum
        ++checked;
    }
    EXPECT_EQ(checked, 300);
}

TEST(ScheduleIlp, HeuristicIsOptimalOnDecodeLayersWithoutPrefetchChoices) {
    // Decode layers of one token, no candidates: the prefix rule plus single moves finds the optimum.
    std::mt19937 rng(3);
    for (int i = 0; i < 200; ++i) {
        LayerState s = random_state(rng, false);
        s.candidates.clear();
        const double bf = brute_force(s);
        EXPECT_NEAR(plan_of(s).predicted.objective(), bf, 1e-6 * std::max(1.0, bf)) << s.to_json().dump();
    }
}

TEST(ScheduleIlp, LayerStatesRoundTripThroughJson) {
    std::mt19937 rng(5);
    LayerState s = random_state(rng, true);
    s.link_price = 0.375;
    const LayerState back = LayerState::from_json(nlohmann::json::parse(s.to_json().dump()), "test");
    EXPECT_EQ(back.to_json(), s.to_json());
    // A dump from before the link price reads as a free link; a price outside [0, 1] is refused.
    nlohmann::json old = s.to_json();
    old.erase("link_price");
    EXPECT_EQ(LayerState::from_json(old, "old.jsonl:1").link_price, 0.0);
    old["link_price"] = 1.5;
    EXPECT_NE(test::error_of([&] { LayerState::from_json(old, "old.jsonl:2"); }).find("old.jsonl:2: layer state: 'link_price'"),
              std::string::npos);
    nlohmann::json bad = s.to_json();
    bad["routed"][0]["where"] = "somewhere";
    try {
        LayerState::from_json(bad, "states.jsonl:3");
        FAIL() << "no error";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("states.jsonl:3"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("where"), std::string::npos) << e.what();
    }
}

// ---------------------------------------------------------------------------------------------------------------
// the threshold rule on the same state

TEST(SchedulerModel, ThresholdDecisionIsDecideLayersRule) {
    ExpertCacheConfig c;
    c.n_layers = 2;
    c.n_experts = 8;
    c.top_k = 2;
    c.expert_bytes = {1000};
    c.slots_per_layer = {3, 3};
    c.budget_bytes = 6 * ExpertCache::slot_bytes_for(c);
    ExpertCache cache(c);
    cache.acquire(1, 2);
    cache.release_layer(1);
    const PlacementPlan plan = PlacementPlan::uniform(2, 8);
    const CostModel cost(CostProfile::h200_reference(), ExpertShape::named("qwen3-30b-a3b"), 16, 4 << 20);
    // Tokens: expert 2 (resident) 1, 3 -> 5, 4 -> 1, 5 -> 3, 6 -> 2 (a batch of 6 tokens, top-2).
    const std::vector<int32_t> routed = {2, 3, 3, 4, 3, 5, 3, 5, 3, 6, 5, 6};
    for (int32_t threshold : {0, 2, 4}) {
        for (int32_t stream_min : {0, 4}) {
            LayerDecision want, counted, got;
            want.reserve(8);
            counted.reserve(8);
            got.reserve(8);
            decide_layer(1, routed, plan, &cache, HybridRule{threshold, stream_min}, want);
            count_routed(1, routed, 8, counted);
            LayerState s;
            layer_state_from_cache(1, 6, counted, cache, plan, cost, stream_min, s);
            threshold_decision(s, threshold, got);
            EXPECT_EQ(got.describe(), want.describe()) << "threshold " << threshold << " stream " << stream_min;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// cost model and load balancer

TEST(CostModel, CopyTimeIsTheFakeLinkClocksAtTheProfilesBandwidth) {
    // The profile's bandwidth at the chunk size drives the fake link; the model's copy time (less the fixed
    // per-request cost) must be the virtual time the copies took.
    CostProfile p = CostProfile::h200_reference();
    const uint64_t chunk = 1 << 20;
    const ExpertShape shape = ExpertShape::named("qwen3-30b-a3b");
    const CostModel model(p, shape, 16, chunk);
    FakeBackend::Config fc;
    fc.link_bytes_per_s = model.link_gb_s() * 1e9;
    FakeBackend backend(fc);
    CopyEngineConfig ec;
    ec.chunk_bytes = chunk;
    std::vector<uint8_t> host(shape.bytes, 1);
    void *dev = backend.alloc(MemoryKind::DEVICE, shape.bytes);
    {
        CopyEngine engine(backend, ec);
        for (int i = 0; i < 3; ++i) {
            CopyRequest r;
            r.dst = dev;
            r.src = host.data();
            r.n_bytes = shape.bytes;
            engine.wait_host(engine.submit(r));
        }
    }
    EXPECT_NEAR(backend.virtual_time_us(), 3 * (model.fetch_us() - p.h2d_request_us), 1e-6 * backend.virtual_time_us());
    backend.free(MemoryKind::DEVICE, dev);
    // The load balancer's prediction of the busy time of those copies: their bytes plus each request's fixed cost,
    // i.e. three fetches, corrected alike (decision 0146).
    EXPECT_NEAR(model.link_us(3 * shape.bytes, 3), 3 * model.fetch_us(), 1e-9 * model.fetch_us());
    CostModel slow = model;
    slow.corrections.link = 2.5;
    EXPECT_NEAR(slow.link_us(3 * shape.bytes, 3), 2.5 * 3 * model.fetch_us(), 1e-9 * model.fetch_us());
}

TEST(CostModel, ReferenceTermsAndMeasuredPointsAndProfileRoundTrip) {
    CostProfile p = CostProfile::h200_reference();
    const ExpertShape mixtral = ExpertShape::named("mixtral-8x7b");
    EXPECT_EQ(mixtral.bytes, 3u * ((uint64_t(4096) * 14336 / 32 * 34 + 255) / 256 * 256));
    const CostModel m(p, mixtral, 16, 4 << 20);
    // 187 MB at 53.6 GB/s plus 10 us; the CPU reads it at 92 x 0.73 GB/s plus 25 us.
    EXPECT_NEAR(m.fetch_us(), 10 + double(mixtral.bytes) / 53.6e3, 1e-6);
    EXPECT_NEAR(m.cpu_us(1), 25 + double(mixtral.bytes) / (92 * 0.73 * 1e3), 1e-6);  // bandwidth-bound
    EXPECT_NEAR(m.cpu_us(64), 25 + 64 * mixtral.flops_per_token() / 450e3, 1e-6);   // FLOP-bound
    // Measured points win over the formula for their shape, interpolated in tokens.
    ShapeTimings &t = p.shape_entry(mixtral.key());
    t.cpu_us = {{1, 3000}, {4, 3600}};
    const CostModel measured(p, mixtral, 16, 4 << 20);
    EXPECT_DOUBLE_EQ(measured.cpu_us(2), 3200);
    EXPECT_DOUBLE_EQ(measured.cpu_us(8), 4400);  // the last segment extended
    // A measured fixed part of a layer's CPU share wins over the profile's (10 us) at the measured threads only.
    EXPECT_DOUBLE_EQ(measured.cpu_layer_us(), 10);
    t.cpu_layer_us = 120;
    EXPECT_DOUBLE_EQ(CostModel(p, mixtral, 16, 4 << 20).cpu_layer_us(), 120);
    EXPECT_DOUBLE_EQ(CostModel(p, mixtral, 8, 4 << 20).cpu_layer_us(), 10);
    const CostProfile back = CostProfile::from_json(nlohmann::json::parse(p.to_json().dump()), "x");
    EXPECT_EQ(back.to_json(), p.to_json());
    EXPECT_DOUBLE_EQ(back.find_shape(mixtral.key())->cpu_layer_us, 120);
    nlohmann::json bad_layer = p.to_json();
    for (nlohmann::json &s : bad_layer["shapes"]) s["cpu_layer_us"] = "fast";
    try {
        CostProfile::from_json(bad_layer, "prof.json");
        FAIL() << "no error";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find(mixtral.key() + ".cpu_layer_us"), std::string::npos) << e.what();
    }
    nlohmann::json bad = p.to_json();
    bad["link"]["h2d_gb_s_by_chunk_bytes"] = nlohmann::json::array({nlohmann::json::array({1, -2})});
    try {
        CostProfile::from_json(bad, "prof.json");
        FAIL() << "no error";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("prof.json"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("h2d_gb_s_by_chunk_bytes"), std::string::npos) << e.what();
    }
    EXPECT_NE(m.describe().find("reference"), std::string::npos);
}

TEST(LoadBalancer, CorrectionsConvergeToTheMeasuredRatioAndAreCounted) {
    LoadBalancer lb;
    LayerStats st;
    for (int i = 0; i < 60; ++i) {
        LayerMeasurement m;
        m.cpu_predicted_us = 1000 * lb.corrections().cpu;  // the planner predicts with the current factor
        m.cpu_work_us = 2000;                              // the CPU is twice as slow as the profile says
        m.link_predicted_us = 500 * lb.corrections().link;
        m.link_work_us = 400;
        m.cpu_end_us = 2100;
        m.gpu_end_us = 1900;
        lb.observe(m, st, LoadBalance::ON);
    }
    EXPECT_NEAR(lb.corrections().cpu, 2.0, 0.02);
    EXPECT_NEAR(lb.corrections().link, 0.8, 0.01);
    EXPECT_DOUBLE_EQ(lb.corrections().gpu, 1.0);  // never measured
    EXPECT_GT(st.corrections, 5u);
    EXPECT_LT(st.corrections, 120u);  // they stop once converged
    EXPECT_DOUBLE_EQ(st.finish_gap_us, 60 * 200.0);
    LayerMeasurement wild;
    wild.cpu_predicted_us = 1000;
    wild.cpu_work_us = 1e9;
    for (int i = 0; i < 100; ++i) lb.observe(wild, st, LoadBalance::ON);
    EXPECT_DOUBLE_EQ(lb.corrections().cpu, 4.0);  // bounded
}

TEST(LoadBalancer, TheLinkModeLearnsOnlyTheCopySpeed) {
    // The default (decision 0146): the copy engine's achieved speed corrects the link; the CPU and GPU times, which
    // mix batch sizes and waits (0087), leave their terms alone; off learns nothing but still sums the finish gap.
    for (const LoadBalance mode : {LoadBalance::LINK, LoadBalance::OFF}) {
        LoadBalancer lb;
        LayerStats st;
        for (int i = 0; i < 60; ++i) {
            LayerMeasurement m;
            m.cpu_predicted_us = 1000 * lb.corrections().cpu;
            m.cpu_work_us = 2000;
            m.gpu_predicted_us = 100 * lb.corrections().gpu;
            m.gpu_work_us = 50;
            m.link_predicted_us = 500 * lb.corrections().link;
            m.link_work_us = 2000;  // the link runs at a quarter of the profile's speed
            m.link_busy_us = 2000;
            m.link_wall_us = 5000;  // and is busy 40% of the time
            m.cpu_end_us = 2100;
            m.gpu_end_us = 1900;
            lb.observe(m, st, mode);
        }
        EXPECT_DOUBLE_EQ(lb.corrections().cpu, 1.0) << load_balance_name(mode);
        EXPECT_DOUBLE_EQ(lb.corrections().gpu, 1.0) << load_balance_name(mode);
        EXPECT_NEAR(lb.corrections().link, mode == LoadBalance::LINK ? 4.0 : 1.0, 0.01) << load_balance_name(mode);
        EXPECT_NEAR(lb.link_busy_share(), mode == LoadBalance::LINK ? 0.4 : 0.0, 1e-6) << load_balance_name(mode);
        EXPECT_EQ(st.corrections > 0, mode == LoadBalance::LINK);
        EXPECT_DOUBLE_EQ(st.finish_gap_us, 60 * 200.0);
    }
    // An idle link (no bytes, nothing to correct) brings the busy share back down.
    LoadBalancer lb;
    LayerStats st;
    LayerMeasurement busy;
    busy.link_busy_us = busy.link_wall_us = 1000;
    for (int i = 0; i < 40; ++i) lb.observe(busy, st, LoadBalance::LINK);
    EXPECT_NEAR(lb.link_busy_share(), 1.0, 1e-4);
    LayerMeasurement idle;
    idle.link_busy_us = 0;
    idle.link_wall_us = 1000;
    for (int i = 0; i < 40; ++i) lb.observe(idle, st, LoadBalance::LINK);
    EXPECT_NEAR(lb.link_busy_share(), 0.0, 1e-4);
    EXPECT_DOUBLE_EQ(lb.corrections().link, 1.0);
}

TEST(CostModel, TheCommittedReferenceProfileIsTheBuiltInOne) {
    // profiles/h200-reference.json is CostProfile::h200_reference() written out, for reading and for --cost-profile;
    // after changing the reference, rewrite it with the JSON this test prints.
    const std::string path = std::string(PRESCOPE_SOURCE_DIR) + "/profiles/h200-reference.json";
    const CostProfile file = CostProfile::load(path);
    EXPECT_EQ(file.to_json(), CostProfile::h200_reference().to_json()) << CostProfile::h200_reference().to_json().dump(1);
}
