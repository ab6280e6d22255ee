// Prediction cost per layer on the CPU at the topo shape (48 layers, 128 experts, top-8, router input 64, window 3):
// one ScoringPredictor::predict call (scores + prefetch list) for one decode token, layers cycled in order.
// Target (issue 5): at most 50 us per layer, so that prediction hides under one layer's attention.
//
//   ninja -C build bench-predictor
//   build/bin/bench-predictor --benchmark_min_time=0.5 [--benchmark_out=pred.json --benchmark_out_format=json]
//
// Rows: none-equivalent cost is zero; frequency and fate are the training-free baselines the LLaPor rows are read
// against (ratio = LLaPor time / fate time, printed at the end). Weights are random: the cost does not depend on
// their values. One thread, as on the runtime thread. llapor-mlp-prior runs in its decode form (the previous
// token's router inputs known, drift "previous"), alone and with the MLP correction (deep form everywhere).
#include "backend/cpu/ops.h"
#include "offload/predictor-baselines.h"
#include "offload/predictor-llapor.h"

#include <benchmark/benchmark.h>

#include <array>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>

using namespace prescope;

namespace {

constexpr int32_t L = 48, E = 128, K = 8, D = 64, W = 3;
const PredictorShape kShape{L, E, K};

LlaporConfig llapor_config(const char *kind, std::vector<int32_t> groups, bool correction = true) {
    LlaporConfig c;
    c.kind = kind;
    c.shape = kShape;
    c.window = W;
    c.group_start = std::move(groups);
    c.hidden = std::string(kind) == "llapor-lstm" ? 64 : 128;
    c.dim = D;
    c.pca_dim = 64;
    c.drift = "previous";
    c.correction = correction;
    return c;
}

void run(benchmark::State &state, ScoringPredictor &p, const std::string &name) {
    cpu::set_threads(1);
    std::mt19937 rng(1);
    std::vector<int32_t> routed(size_t(L) * K);
    for (auto &e : routed) e = int32_t(rng() % E);
    std::vector<float> hidden(size_t(L) * D);
    std::normal_distribution<float> nd;
    for (auto &v : hidden) v = nd(rng);
    PrefetchList list(size_t(W) * E);
    int32_t layer = 0;
    for (auto _ : state) {
        list.clear();
        const PredictorInput in{layer, L, W, std::span<const int32_t>(routed.data() + size_t(layer) * K, K), 1, K,
                                hidden.data() + size_t(layer) * D, D};
        p.predict(in, list);
        benchmark::DoNotOptimize(list.size());
        layer = layer + 1 == L ? 0 : layer + 1;
    }
    state.SetLabel(name);
}

void BM_frequency(benchmark::State &state) {
    FrequencyPredictor p(kShape, 1.0);
    run(state, p, "frequency");
}

void BM_fate(benchmark::State &state) {
    std::vector<std::vector<float>> routers(size_t(L), std::vector<float>(size_t(E) * D, 0.01f));
    FatePredictor p(kShape, D, routers);
    run(state, p, "fate");
}

void BM_llapor_lstm(benchmark::State &state) {
    LlaporLstmPredictor p(std::make_shared<LlaporLstmNet>(llapor_config("llapor-lstm", {0, 8, 40}), 1));
    run(state, p, "llapor-lstm");
}

void BM_llapor_mlp(benchmark::State &state) {
    // One group for all layers takes the deep form (gated residual block) everywhere: the worst case.
    LlaporMlpPredictor p(std::make_shared<LlaporMlpNet>(llapor_config("llapor-mlp", {0}), 1));
    run(state, p, "llapor-mlp");
}

void BM_llapor_mlp_prior(benchmark::State &state) {
    LlaporMlpPredictor p(std::make_shared<LlaporMlpNet>(llapor_config("llapor-mlp-prior", {0, 22, 39}, false), 1));
    run(state, p, "llapor-mlp-prior");
}

// Args: MLP width, number of layer groups (1: the deep form everywhere; 3: the topo groups 0-21, 22-38, 39-47).
void BM_llapor_mlp_prior_mlp(benchmark::State &state) {
    const auto width = int32_t(state.range(0)), groups = int32_t(state.range(1));
    LlaporConfig c = llapor_config("llapor-mlp-prior", groups == 1 ? std::vector<int32_t>{0}
                                                                   : std::vector<int32_t>{0, 22, 39});
    c.hidden = width;
    LlaporMlpPredictor p(std::make_shared<LlaporMlpNet>(c, 1));
    run(state, p, "mlp-prior+mlp w" + std::to_string(width) + " g" + std::to_string(groups));
}

} // namespace

BENCHMARK(BM_frequency)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_fate)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_llapor_lstm)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_llapor_mlp)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_llapor_mlp_prior)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_llapor_mlp_prior_mlp)->Args({128, 3})->Args({128, 1})->Args({64, 3})->Unit(benchmark::kMicrosecond);

// The console table, then each row's time against fate's (the training-free baseline) and the 50 us target.
// CPU time is the one to read on a shared machine (real time includes waiting for a core).
class RatioReporter : public benchmark::ConsoleReporter {
  public:
    void ReportRuns(const std::vector<Run> &runs) override {
        ConsoleReporter::ReportRuns(runs);
        for (const Run &r : runs) {
            if (r.run_type == Run::RT_Iteration && r.iterations > 0) {
                us_[r.report_label] = {r.GetAdjustedRealTime(), r.GetAdjustedCPUTime()};  // microseconds
            }
        }
    }
    void Finalize() override {
        ConsoleReporter::Finalize();
        const double fate = us_.count("fate") ? us_["fate"][1] : 0.0;
        std::printf("\n%-21s %14s %14s %12s %10s\n", "predictor", "real us/layer", "CPU us/layer", "CPU vs fate",
                    "CPU <= 50");
        for (const auto &[name, us] : us_) {
            std::printf("%-21s %14.2f %14.2f %12.2f %10s\n", name.c_str(), us[0], us[1], fate > 0 ? us[1] / fate : 0.0,
                        us[1] <= 50.0 ? "yes" : "NO");
        }
    }

  private:
    std::map<std::string, std::array<double, 2>> us_;  // real, CPU
};

int main(int argc, char **argv) {
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    RatioReporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
    benchmark::Shutdown();
    return 0;
}
