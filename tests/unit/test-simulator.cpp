// The simulator (offload/simulator.h), the layer planner's dump, NUMA start-up facts and the CPU calibration, on
// small inputs: counters that must add up, the load balancer finding a machine that differs from its profile,
// and the ordering the timing model implies (more budget never slows a fetch-everything run).
#include "../common/random-trace.h"
#include "arch/arch.h"
#include "core/error.h"
#include "offload/expert-store.h"
#include "offload/scheduler.h"
#include "offload/simulator.h"
#include "runtime/calibrate.h"
#include "runtime/numa.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>

using namespace prescope;
namespace fs = std::filesystem;

namespace {

RoutingTrace small_trace() {
    return test::random_trace(6, 16, 2, {300, 200}, 3, [](int32_t j) { return j == 0 ? 0.7f : 0.3f; });
}

SimConfig small_config() {
    SimConfig c;
    c.budget_bytes = uint64_t(30) * ExpertShape::named("mixtral-8x7b").bytes;  // 5 slots per layer
    c.prefill_tokens = 64;
    c.decode_tokens = 80;
    c.stream_min_batch = 32;
    return c;
}

} // namespace

TEST(Simulator, EveryRoutedExpertIsCountedOnceAndTheBoundIsABound) {
    const RoutingTrace t = small_trace();
    const ExpertShape shape = ExpertShape::named("mixtral-8x7b");
    for (int32_t rule : {-1, 0, 2}) {
        SimConfig c = small_config();
        c.cpu_threshold = rule;
        const SimResult r = simulate(t, shape, CostProfile::h200_reference(), c);
        SCOPED_TRACE(rule);
        // Decode: one token x 6 layers x top-2 distinct experts per step.
        EXPECT_EQ(r.decode.totals.accesses(), uint64_t(80 * 6 * 2));
        EXPECT_EQ(r.decode.totals.steps, uint64_t(80 * 6));
        EXPECT_GT(r.decode.tok_s(), 0);
        EXPECT_GT(r.prefill.tok_s(), 0);
        EXPECT_LE(r.decode.bound_us, r.decode.time_us * (1 + 1e-9));  // the bound never exceeds the time taken
        EXPECT_LE(r.prefill.bound_us, r.prefill.time_us * (1 + 1e-9));
        if (rule == 0) EXPECT_EQ(r.decode.totals.cpu_runs, 0u);  // the old default fetches every miss
    }
}

TEST(Simulator, TheLoadBalancerFindsAMachineSlowerThanItsProfile) {
    const RoutingTrace t = small_trace();
    SimConfig c = small_config();
    c.decode_tokens = 300;
    c.truth.cpu = 1.6;
    c.truth.link = 1.3;
    c.balance = LoadBalance::ON;
    const SimResult r = simulate(t, ExpertShape::named("mixtral-8x7b"), CostProfile::h200_reference(), c);
    EXPECT_NEAR(r.corrections.cpu, 1.6, 0.08);
    EXPECT_NEAR(r.corrections.link, 1.3, 0.07);
    EXPECT_GT(r.decode.totals.corrections, 0u);
    c.balance = LoadBalance::LINK;  // the default: the link alone
    const SimResult link = simulate(t, ExpertShape::named("mixtral-8x7b"), CostProfile::h200_reference(), c);
    EXPECT_DOUBLE_EQ(link.corrections.cpu, 1.0);
    EXPECT_NEAR(link.corrections.link, 1.3, 0.07);
    c.balance = LoadBalance::OFF;
    const SimResult frozen = simulate(t, ExpertShape::named("mixtral-8x7b"), CostProfile::h200_reference(), c);
    EXPECT_DOUBLE_EQ(frozen.corrections.cpu, 1.0);
    EXPECT_DOUBLE_EQ(frozen.corrections.link, 1.0);
}

TEST(Simulator, MoreBudgetNeverSlowsFetchingEverything) {
    const RoutingTrace t = small_trace();
    double last = 0;
    for (int slots : {2, 3, 5, 8, 16}) {
        SimConfig c = small_config();
        c.cpu_threshold = 0;
        c.predictor = "none";
        c.budget_bytes = uint64_t(slots * 6) * ExpertShape::named("qwen3-30b-a3b").bytes;
        const SimResult r = simulate(t, ExpertShape::named("qwen3-30b-a3b"), CostProfile::h200_reference(), c);
        EXPECT_GE(r.decode.tok_s(), last * (1 - 1e-9)) << slots;
        last = r.decode.tok_s();
    }
}

TEST(Simulator, DumpedStatesReadBackAndReplanToThePlansOfTheRun) {
    const fs::path dump = fs::temp_directory_path() / ("prescope-unit-states-" + std::to_string(getpid()) + ".jsonl");
    SimConfig c = small_config();
    c.dump_path = dump.string();
    c.decode_tokens = 20;
    simulate(small_trace(), ExpertShape::named("mixtral-8x7b"), CostProfile::h200_reference(), c);
    std::ifstream in(dump);
    std::string line;
    int n = 0;
    Scheduler s;
    s.reserve(64, 256);
    LayerPlan p;
    p.reserve(64, 256);
    while (std::getline(in, line)) {
        const LayerState st = LayerState::from_json(nlohmann::json::parse(line), "dump");
        s.plan(st, p);
        EXPECT_EQ(p.decision.experts.size(), st.routed.size());
        ++n;
    }
    EXPECT_EQ(n, 6 * (1 + 20));  // every layer of the prefill batch and of each decode step
    fs::remove(dump);
}

TEST(Numa, SingleNodeHostsSayThereIsNothingToPlaceAndBadModesFail) {
    const std::string line = apply_numa("isolate", -1);
    EXPECT_NE(line.find("NUMA"), std::string::npos) << line;
    EXPECT_THROW(apply_numa("everywhere", -1), Error);
    EXPECT_EQ(pci_numa_node("0000:ff:ff.9"), -1);  // no such device
}

TEST(Calibrate, CpuTermsAreMeasuredAndLabelled) {
    const auto model = Model::load((fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models/mixtral/tiny-q8_0.gguf").string());
    CostProfile p = CostProfile::h200_reference();
    calibrate_cpu(p, *model, 1, 0.2);
    EXPECT_EQ(p.cpu_threads, 1);
    ASSERT_FALSE(p.host_read_gb_s.empty());
    EXPECT_GT(p.host_read_gb_s[0].value, 0);
    const ExpertShape shape = ExpertShape::of(ExpertLayout::of(*model, 0));
    const ShapeTimings *t = p.find_shape(shape.key());
    ASSERT_NE(t, nullptr);
    ASSERT_FALSE(t->cpu_us.empty());
    EXPECT_EQ(t->cpu_us[0].x, 1);
    EXPECT_NE(t->cpu_source.find("measured"), std::string::npos);
    // The model now uses the measured points for this shape.
    const CostModel m(p, shape, 1, 4 << 20);
    EXPECT_DOUBLE_EQ(m.cpu_us(1), t->cpu_us[0].value);
}

TEST(Calibrate, TheRuntimeMeasuresTheCpuOncePerProcessAndKeepsTheProfilesOtherTerms) {
    const auto model = Model::load((fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models/qwen3moe/tiny-q8_0.gguf").string());
    OffloadConfig c;
    std::string notes;
    const CostModel a = runtime_cost_model(*model, c, 1, 0.2, &notes);
    EXPECT_NE(notes.find("built-in H200 reference"), std::string::npos) << notes;
    EXPECT_NE(notes.find("CPU terms measured at start-up"), std::string::npos) << notes;
    const CostModel b = runtime_cost_model(*model, c, 1, 0.2, nullptr);
    EXPECT_EQ(a.cpu_us(1), b.cpu_us(1));  // the same measurement, not a second one
    EXPECT_EQ(a.fetch_us(), CostModel(CostProfile::h200_reference(), a.shape(), 1, c.copy.chunk_bytes).fetch_us());
    EXPECT_NE(a.describe().find("measured"), std::string::npos);
}
