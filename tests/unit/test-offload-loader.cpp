// Cache + copy engine + fake backend together through ExpertLoader: the bytes compute sees in a slot are
// always the expert it asked for, with eviction, prefetch, cancellation and asynchronous copies in play.
#include "core/error.h"
#include "offload/copy-engine.h"
#include "offload/expert-cache.h"
#include "offload/expert-loader.h"
#include "offload/fake-backend.h"
#include "offload/placement.h"
#include "offload/predictor.h"

#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <thread>

using namespace prescope;

namespace {

std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
    std::vector<uint8_t> v(n);
    std::mt19937 rng(seed);
    for (auto &x : v) x = uint8_t(rng());
    return v;
}

// A model's experts in host memory plus the offload machinery over a fake device.
struct Rig {
    Rig(int32_t n_layers, int32_t n_experts, int32_t top_k, int32_t slots_per_layer, FakeBackend::Mode mode,
        PlacementPlan plan_in, EvictionPolicyKind policy = EvictionPolicyKind::LRU)
        : backend(make_fake(mode)), plan(std::move(plan_in)) {
        ExpertCacheConfig c;
        c.n_layers = n_layers;
        c.n_experts = n_experts;
        c.top_k = top_k;
        c.policy = policy;
        for (int32_t l = 0; l < n_layers; ++l) {
            for (int32_t e = 0; e < n_experts; ++e) {
                host.push_back(pattern(3000 + 97 * size_t(e), uint32_t(l * 1000 + e)));
                c.expert_bytes.push_back(host.back().size());
                host_ptrs.push_back(host.back().data());
            }
        }
        c.budget_bytes = uint64_t(n_layers) * uint64_t(slots_per_layer) * ExpertCache::slot_bytes_for(c);
        cache = std::make_unique<ExpertCache>(c, &backend);
        CopyEngineConfig ec;
        ec.chunk_bytes = 1024;  // several chunks per expert
        ec.queue_depth = 2;
        engine = std::make_unique<CopyEngine>(backend, ec);
        compute = backend.stream_create();  // after the engine's stream: its copies win the worker's ties
        loader = std::make_unique<ExpertLoader>(backend, *cache, *engine, plan, host_ptrs);
    }
    ~Rig() {
        backend.stream_synchronize(compute);
        loader.reset();
        engine.reset();
        backend.stream_destroy(compute);
    }
    static FakeBackend::Config make_fake(FakeBackend::Mode mode) {
        FakeBackend::Config f;
        f.mode = mode;
        return f;
    }
    const std::vector<uint8_t> &expert(int32_t layer, int32_t e) const {
        return host[size_t(layer) * size_t(plan.n_experts) + size_t(e)];
    }
    // Queues a read of the expert's slot on the compute stream (after whatever it waits for).
    void read_slot_async(const RoutedExpert &r, int32_t layer, std::vector<uint8_t> &out) {
        out.assign(expert(layer, r.expert).size(), 0);
        backend.copy_d2h_async(out.data(), cache->slot_data(r.slot), out.size(), compute);
    }

    FakeBackend backend;
    PlacementPlan plan;
    std::vector<std::vector<uint8_t>> host;  // [n_layers * n_experts] expert bytes
    std::vector<const void *> host_ptrs;
    std::unique_ptr<ExpertCache> cache;
    std::unique_ptr<CopyEngine> engine;
    std::unique_ptr<ExpertLoader> loader;
    Stream compute = nullptr;
};

// Knows the future: for layer l of step t, asks for the experts layers l+1..l+w route to at step t.
class TracePredictor final : public Predictor {
  public:
    explicit TracePredictor(const std::vector<std::vector<std::vector<int32_t>>> &trace) : trace_(trace) {}
    const char *name() const override { return "trace"; }
    void predict(const PredictorInput &in, PrefetchList &out) override {
        for (int32_t l = in.layer + 1; l <= std::min(in.layer + in.window, in.n_layers - 1); ++l) {
            for (int32_t e : trace_[size_t(step)][size_t(l)]) out.push({l, e, 1.0f / float(l - in.layer)});
        }
    }
    int step = 0;

  private:
    const std::vector<std::vector<std::vector<int32_t>>> &trace_;  // [step][layer][top_k]
};

} // namespace

TEST(ExpertLoader, ReusedSlotHoldsTheNewExpertsBytes) {
    Rig rig(1, 4, 1, 2, FakeBackend::Mode::THREADED, PlacementPlan::uniform(1, 4));
    LayerDecision d;
    d.reserve(4);
    int32_t first_slot = -1;
    for (int32_t e : {0, 1, 2}) {
        std::vector<int32_t> routed = {e};
        decide_layer(0, routed, rig.plan, rig.cache.get(), HybridRule{0}, d);
        ASSERT_EQ(d.n_fetch, 1);
        rig.loader->begin_layer(d);
        if (e == 0) first_slot = d.experts[0].slot;
        rig.loader->wait_experts(d, rig.compute);
        std::vector<uint8_t> seen;
        rig.read_slot_async(d.experts[0], 0, seen);
        rig.loader->end_layer(0, rig.compute);
        rig.backend.stream_synchronize(rig.compute);
        EXPECT_EQ(seen, rig.expert(0, e)) << "expert " << e;
    }
    EXPECT_EQ(d.experts[0].slot, first_slot);  // expert 2 took expert 0's slot (LRU)
    EXPECT_LT(rig.cache->find(0, 0), 0);
}

TEST(ExpertLoader, DecodeLoopAlwaysHandsComputeTheRightBytes) {
    const int32_t L = 3, E = 8, K = 2, steps = 60, window = 2;
    for (EvictionPolicyKind policy : {EvictionPolicyKind::LRU, EvictionPolicyKind::ARC}) {
        Rig rig(L, E, K, 3, FakeBackend::Mode::THREADED, PlacementPlan::uniform(L, E), policy);
        std::mt19937 rng(17);
        std::vector<std::vector<std::vector<int32_t>>> trace(steps, std::vector<std::vector<int32_t>>(L));
        for (auto &step : trace) {
            for (auto &ids : step) {
                int32_t a = int32_t(rng() % E), b = int32_t((a + 1 + rng() % (E - 1)) % E);
                ids = {a, b};
            }
        }
        TracePredictor predictor(trace);
        PrefetchList wanted(size_t(window * K));
        LayerDecision d;
        d.reserve(E);
        // Reads are checked every 4 steps, so later loads into the same slots are queued while earlier
        // reads are still pending: a load that did not wait for the layer's compute would corrupt them.
        std::vector<std::pair<std::vector<uint8_t>, const std::vector<uint8_t> *>> reads;
        for (int t = 0; t < steps; ++t) {
            predictor.step = t;
            for (int32_t l = 0; l < L; ++l) {
                decide_layer(l, trace[size_t(t)][size_t(l)], rig.plan, rig.cache.get(), HybridRule{0}, d);
                rig.loader->begin_layer(d);
                rig.loader->wait_experts(d, rig.compute);
                for (const RoutedExpert &r : d.experts) {
                    reads.emplace_back();
                    rig.read_slot_async(r, l, reads.back().first);
                    reads.back().second = &rig.expert(l, r.expert);
                }
                rig.loader->end_layer(l, rig.compute);
                wanted.clear();
                predictor.predict({l, L, window, trace[size_t(t)][size_t(l)], 1, K, nullptr, 0}, wanted);
                wanted.sort_by_score();
                rig.loader->prefetch(wanted.items(), K);
            }
            if (t % 4 == 3) {
                rig.backend.stream_synchronize(rig.compute);
                for (auto &[seen, want] : reads) ASSERT_EQ(seen, *want) << eviction_policy_name(policy);
                reads.clear();
            }
        }
        LayerStats s = rig.cache->total_stats();
        EXPECT_EQ(s.accesses(), uint64_t(steps * L * K));
        EXPECT_GT(s.prefetch_hits, 0u);
        rig.engine->drain();
        EXPECT_EQ(rig.engine->stats().requests_submitted, s.demand_misses + s.prefetch_loads);
    }
}

namespace {

// MANUAL mode: runs copies until the engine has nothing queued or in flight.
void pump_until_idle(Rig &rig) {
    for (int i = 0; i < 200000 && !(rig.engine->idle() && rig.backend.copies_pending() == 0); ++i) {
        rig.backend.run_all();
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    ASSERT_TRUE(rig.engine->idle());
}

} // namespace

TEST(ExpertLoader, LoadIntoASlotWaitsForTheComputeThatLastReadIt) {
    // One slot. Step 1 reads expert 0 from it on the compute stream but the read does not run yet; step 2
    // loads expert 1 into the same slot. The engine's stream is older, so the fake would run its copy first
    // if the load did not wait for the layer's compute event.
    Rig rig(1, 2, 1, 1, FakeBackend::Mode::MANUAL, PlacementPlan::uniform(1, 2));
    LayerDecision d;
    d.reserve(2);
    std::vector<int32_t> step1 = {0}, step2 = {1};
    decide_layer(0, step1, rig.plan, rig.cache.get(), HybridRule{0}, d);
    rig.loader->begin_layer(d);
    pump_until_idle(rig);
    rig.loader->wait_experts(d, rig.compute);
    std::vector<uint8_t> seen;
    rig.read_slot_async(d.experts[0], 0, seen);
    rig.loader->end_layer(0, rig.compute);
    size_t issued = rig.backend.copies_issued();

    decide_layer(0, step2, rig.plan, rig.cache.get(), HybridRule{0}, d);
    rig.loader->begin_layer(d);
    ASSERT_TRUE(rig.backend.wait_copies_issued(issued + 1));  // the new load's first chunk is queued
    EXPECT_EQ(rig.backend.run_copies(1), 1);
    EXPECT_EQ(rig.backend.completion_log().back().dst, seen.data());  // the read ran first
    pump_until_idle(rig);
    rig.backend.run_all();
    EXPECT_EQ(seen, rig.expert(0, 0));
}

TEST(ExpertLoader, EvictedPrefetchStillQueuedIsCancelledBeforeTheSlotIsReloaded) {
    // Layer 1's prefetch fills the queue depth, so layer 0's prefetch of expert 1 is still queued when a
    // demand for expert 2 evicts it. Left in the queue it would land after the demand load, on its slot.
    Rig rig(2, 4, 1, 1, FakeBackend::Mode::MANUAL, PlacementPlan::uniform(2, 4));
    std::vector<PrefetchRequest> wanted = {{1, 0, 1.0f}, {0, 1, 0.5f}};
    EXPECT_EQ(rig.loader->prefetch(wanted, 1), 2);
    int32_t slot = rig.cache->find(0, 1);
    Ticket stale = rig.cache->ticket(slot);
    EXPECT_EQ(rig.engine->state(stale), TicketState::QUEUED);

    LayerDecision d;
    d.reserve(4);
    std::vector<int32_t> routed = {2};
    decide_layer(0, routed, rig.plan, rig.cache.get(), HybridRule{0}, d);
    rig.loader->begin_layer(d);
    EXPECT_EQ(d.experts[0].slot, slot);
    EXPECT_EQ(rig.engine->state(stale), TicketState::CANCELLED);
    pump_until_idle(rig);
    rig.loader->wait_experts(d, rig.compute);
    std::vector<uint8_t> seen;
    rig.read_slot_async(d.experts[0], 0, seen);
    rig.loader->end_layer(0, rig.compute);
    rig.backend.run_all();
    EXPECT_EQ(seen, rig.expert(0, 2));
}

TEST(ExpertLoader, HomeGpuExpertsStayInTheirFixedSlots) {
    PlacementPlan plan = PlacementPlan::uniform(2, 6);
    for (int32_t l = 0; l < 2; ++l) plan.at(l, 0) = {HomeTier::GPU, ExecSite::GPU};
    Rig rig(2, 6, 2, 2, FakeBackend::Mode::IMMEDIATE, plan);
    rig.loader->load_fixed();
    int32_t fixed_slot = rig.cache->find(1, 0);
    ASSERT_GE(fixed_slot, 0);
    LayerDecision d;
    d.reserve(6);
    for (int32_t e = 1; e < 6; ++e) {
        std::vector<int32_t> routed = {0, e};
        decide_layer(1, routed, rig.plan, rig.cache.get(), HybridRule{0}, d);
        EXPECT_EQ(d.experts[0].action, ExpertAction::HIT);
        rig.loader->begin_layer(d);
        EXPECT_EQ(d.experts[0].slot, fixed_slot);
        rig.loader->wait_experts(d, rig.compute);
        std::vector<uint8_t> seen;
        rig.read_slot_async(d.experts[0], 1, seen);
        rig.loader->end_layer(1, rig.compute);
        EXPECT_EQ(seen, rig.expert(1, 0));
    }
}

TEST(ExpertLoader, MoreForcedGpuExpertsThanSlotsFailLoudly) {
    Rig rig(1, 8, 2, 2, FakeBackend::Mode::IMMEDIATE,
            PlacementPlan::uniform(1, 8, {HomeTier::PINNED, ExecSite::GPU}));
    LayerDecision d;
    d.reserve(8);
    std::vector<int32_t> routed = {0, 1, 2, 3, 4, 5};
    decide_layer(0, routed, rig.plan, rig.cache.get(), HybridRule{16}, d);
    EXPECT_EQ(d.n_fetch, 6);
    EXPECT_THROW(rig.loader->begin_layer(d), Error);
    rig.cache->release_layer(0);
    rig.engine->drain();
}
