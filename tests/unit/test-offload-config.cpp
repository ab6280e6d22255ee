// Offloading settings (offload/offload-config.h: YAML file, then flags), routing-trace replay
// (runtime/routing-replay.h) through the CPU engine, and the engine and predictor factories (runtime/engine.h).
#include "../common/random-trace.h"
#include "../common/error-of.h"
#include "../common/tiny-model.h"
#include "arch/arch.h"
#include "core/error.h"
#include "offload/offload-config.h"
#include "offload/predictor-baselines.h"
#include "offload/predictor-llapor.h"
#include "offload/trace.h"
#include "runtime/engine.h"
#include "runtime/routing-replay.h"
#ifdef PRESCOPE_USE_CUDA
#include "backend/cuda/cuda-backend.h"
#endif

#include <unistd.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>

using namespace prescope;
using prescope::test::error_of;
namespace fs = std::filesystem;

namespace {

fs::path write_file(const std::string &name, const std::string &text) {
    const fs::path p = fs::temp_directory_path() / (std::to_string(getpid()) + "-" + name);
    std::ofstream(p) << text;
    return p;
}

std::unique_ptr<Model> tiny(const std::string &arch = "qwen3moe") {
    return Model::load((fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models" / arch / "tiny-f32.gguf").string());
}

} // namespace

TEST(OffloadConfig, TextValuesParseAndPrintBack) {
    OffloadConfig c;
    EXPECT_FALSE(c.gpu);
    c.set("gpu_cache", "12GiB", "test");
    c.set("cache_policy", "ARC", "test");
    c.set("cpu_threshold", "16", "test");
    c.set("stream_min_batch", "0", "test");
    c.set("prefetch_window", "3", "test");
    c.set("copy_chunk", "1MiB", "test");
    c.set("copy_bandwidth_cap", "20GB", "test");
    EXPECT_TRUE(c.gpu);
    EXPECT_EQ(c.gpu_cache_bytes, uint64_t(12) << 30);
    EXPECT_EQ(c.cache_policy, EvictionPolicyKind::ARC);
    EXPECT_EQ(c.cpu_threshold, 16);
    EXPECT_EQ(c.stream_min_batch, 0);
    EXPECT_EQ(c.prefetch_window, 3);
    EXPECT_EQ(c.copy.chunk_bytes, size_t(1) << 20);
    EXPECT_EQ(c.copy.bandwidth_cap_bytes_per_s, 20e9);
    EXPECT_EQ(c.get("gpu_cache"), "12.00 GiB");
    for (const std::string &k : OffloadConfig::keys()) EXPECT_NE(c.describe().find(k + ":"), std::string::npos) << k;
}

TEST(OffloadConfig, BadValuesNameTheSourceAndTheKey) {
    OffloadConfig c;
    EXPECT_NE(error_of([&] { c.set("cpu_threshold", "-1", "--cpu-threshold"); }).find("--cpu-threshold: cpu_threshold"),
              std::string::npos);
    EXPECT_NE(error_of([&] { c.set("gpu_cache", "12 parsecs", "x.yaml"); }).find("x.yaml"), std::string::npos);
    EXPECT_NE(error_of([&] { c.set("cache_policy", "fifo", "x.yaml"); }).find("lru"), std::string::npos);
    EXPECT_NE(error_of([&] { c.set("copy_queue_depth", "0", "f"); }).find("[1, 1024]"), std::string::npos);
    EXPECT_NE(error_of([&] { c.set("prefetch", "1", "f"); }).find("unknown key 'prefetch'"), std::string::npos);
}

TEST(OffloadConfig, YamlFileThenFlagsOverride) {
    const fs::path p = write_file("prescope-offload.yaml", "prefetch_window: 3\ncpu_threshold: 16\ngpu_cache: 12GB\n");
    OffloadConfig c;
    c.load_yaml(p.string());
    EXPECT_EQ(c.prefetch_window, 3);
    EXPECT_EQ(c.cpu_threshold, 16);
    EXPECT_EQ(c.gpu_cache_bytes, 12000000000u);
    c.set("cpu_threshold", "2", "--cpu-threshold");  // what the CLI does with flags after the file
    EXPECT_EQ(c.cpu_threshold, 2);
    EXPECT_EQ(c.prefetch_window, 3);
    const fs::path bad = write_file("prescope-offload-bad.yaml", "prefetch_window: [1, 2]\n");
    EXPECT_NE(error_of([&] { c.load_yaml(bad.string()); }).find("prefetch_window: expected a single value"),
              std::string::npos);
    const fs::path unknown = write_file("prescope-offload-unknown.yaml", "gpu_cahce: 1GiB\n");
    EXPECT_NE(error_of([&] { c.load_yaml(unknown.string()); }).find("unknown key 'gpu_cahce'"), std::string::npos);
    fs::remove(p);
    fs::remove(bad);
    fs::remove(unknown);
}

TEST(OffloadConfig, SeedStyleSectionsAndKeysWithoutEffect) {
    const fs::path p = write_file("prescope-offload-nested.yaml",
                                  "optimization: {prefetch_window: 3, cpu_threshold: 16, gpu_cache: 12GB}\npredictor: none\n");
    OffloadConfig c;
    c.load_yaml(p.string());
    EXPECT_EQ(c.prefetch_window, 3);
    EXPECT_EQ(c.cpu_threshold, 16);
    EXPECT_EQ(c.gpu_cache_bytes, 12000000000u);
    EXPECT_EQ(c.predictor, "none");
    // prefetch_window does nothing without a predictor; cpu_threshold does (the threshold rule).
    const auto w = c.no_effect_warnings();
    ASSERT_EQ(w.size(), 1u);
    EXPECT_NE(w[0].find("(optimization): prefetch_window has no effect: predictor is none"), std::string::npos) << w[0];
    // Without a GPU every offload key is without effect, the routing trace is not.
    OffloadConfig cpu;
    cpu.set("cpu_threshold", "4", "--cpu-threshold");
    cpu.set("routing_trace", "x.pstrace", "--routing-trace");
    const auto wc = cpu.no_effect_warnings();
    ASSERT_EQ(wc.size(), 1u);
    EXPECT_NE(wc[0].find("--cpu-threshold: cpu_threshold has no effect: no GPU"), std::string::npos) << wc[0];
    // cpu_threshold: auto = the cost-model scheduler; the cost keys are without effect under the threshold rule.
    OffloadConfig g;
    g.set("gpu_cache", "1GiB", "f");
    g.set("cpu_threshold", "auto", "f");
    EXPECT_EQ(g.cpu_threshold, -1);
    EXPECT_TRUE(g.no_effect_warnings().empty());
    EXPECT_EQ(g.load_balance, LoadBalance::LINK);  // the default: the copy speed only (decision 0146)
    EXPECT_EQ(g.get("load_balance"), "link");
    g.set("load_balance", "on", "f");
    EXPECT_EQ(g.load_balance, LoadBalance::ON);
    EXPECT_NE(error_of([&] { g.set("load_balance", "cpu", "f"); }).find("f: load_balance: expected off, link or on, got 'cpu'"),
              std::string::npos);
    EXPECT_TRUE(g.link_price);  // decision 0147
    g.set("link_price", "off", "f");
    EXPECT_FALSE(g.link_price);
    EXPECT_EQ(g.get("link_price"), "off");
    g.set("load_balance", "off", "f");
    EXPECT_EQ(g.load_balance, LoadBalance::OFF);
    g.set("cpu_threshold", "2", "f");
    EXPECT_NE(g.no_effect("load_balance").find("threshold rule"), std::string::npos);
    const fs::path deep = write_file("prescope-offload-deep.yaml", "optimization: {copy: {chunk: 1MiB}}\n");
    EXPECT_NE(error_of([&] { OffloadConfig d; d.load_yaml(deep.string()); }).find("optimization.copy: expected a single value"),
              std::string::npos);
    const fs::path typo = write_file("prescope-offload-typo.yaml", "optimization: {prefetch_windw: 3}\n");
    EXPECT_NE(error_of([&] { OffloadConfig d; d.load_yaml(typo.string()); }).find("unknown key 'prefetch_windw'"),
              std::string::npos);
    EXPECT_NE(error_of([&] { OffloadConfig d; d.set("numa", "everywhere", "--numa"); }).find("distribute"),
              std::string::npos);
    for (const fs::path &f : {p, deep, typo}) fs::remove(f);
}

TEST(RoutingReplay, LayersRunTheTracesExpertsInTokenOrderAndWrap) {
    const auto model = tiny("mixtral");
    const HParams &hp = model->hp();
    const int n_tok = 6;
    RoutingTrace t = test::random_trace(int32_t(hp.n_layer), int32_t(hp.n_expert), int32_t(hp.n_expert_used), {n_tok},
                                        5, [](int32_t) { return 0.5f; });
    t.arch = hp.arch;
    const fs::path path = fs::temp_directory_path() / ("prescope-unit-replay-" + std::to_string(getpid()) + ".pstrace");
    write_trace(path.string(), t);

    OffloadConfig c;
    c.routing_trace = path.string();
    CpuEngine engine(*model, {32, 4}, c);
    std::vector<int32_t> seen;
    std::vector<float> weights;
    engine.context().on_routing = [&](int64_t, const Routing &r) {
        seen.insert(seen.end(), r.ids.begin(), r.ids.end());
        weights.insert(weights.end(), r.weights.begin(), r.weights.end());
    };
    const std::vector<int32_t> prompt{1, 2, 3, 4, 5};
    engine.eval(prompt);  // batches of 4 and 1: trace tokens 0-3, 4
    for (int32_t tok : {6, 7}) engine.eval({&tok, 1});  // trace tokens 5, then 0 (wrapped)
    std::vector<int32_t> want;
    for (auto [first, n] : {std::pair{0, 4}, {4, 1}, {5, 1}, {0, 1}}) {
        for (int64_t l = 0; l < hp.n_layer; ++l) {
            for (int i = first; i < first + n; ++i) {
                want.insert(want.end(), t.ids(i, int32_t(l)), t.ids(i, int32_t(l)) + hp.n_expert_used);
            }
        }
    }
    EXPECT_EQ(seen, want);
    for (float w : weights) EXPECT_FLOAT_EQ(w, 128.0f / 255.0f);  // round(0.5 * 255) / 255
    EXPECT_NE(engine.startup_text().find("REPLAYED"), std::string::npos);
    EXPECT_EQ(engine.stats_json()["routing"], "replayed:" + path.filename().string());

    HParams wrong = hp;
    wrong.n_layer += 1;
    EXPECT_NE(error_of([&] { RoutingReplay r(path.string(), wrong); }).find("the model has"), std::string::npos);
    fs::remove(path);
}

// A trace holds MoE layers only (decision 0134), so one recorded from a 26-layer qwen3moe-shaped model (64 experts,
// top-6) replays into a deepseek2 model of 1 dense + 26 MoE layers with those experts: model layer il takes trace
// layer il - 1, and the dense layer routes nothing. A trace of any other layer count is refused, naming the file
// and both counts.
TEST(RoutingReplay, ATraceOfMoeLayersFitsAModelWithLeadingDenseLayers) {
    test::TinyModelSpec spec;
    spec.arch = "deepseek2";
    spec.n_layer = 27;
    spec.n_layer_dense = 1;
    spec.n_expert = 64;
    spec.n_expert_used = 6;
    spec.n_embd = 16;
    spec.n_ff = 16;
    const fs::path gguf = fs::temp_directory_path() / ("prescope-unit-replay-ds-" + std::to_string(getpid()) + ".gguf");
    test::write_tiny_model(gguf.string(), spec);
    const auto model = Model::load(gguf.string());
    const HParams &hp = model->hp();
    ASSERT_EQ(hp.n_layer_moe(), 26);
    const int n_tok = 5;
    const RoutingTrace t = test::random_trace(26, 64, 6, {n_tok}, 9, [](int32_t) { return 0.5f; });
    const fs::path path =
        fs::temp_directory_path() / ("prescope-unit-replay-26-" + std::to_string(getpid()) + ".pstrace");
    write_trace(path.string(), t);

    OffloadConfig c;
    c.routing_trace = path.string();
    CpuEngine engine(*model, {32, 8}, c);
    std::vector<std::vector<int32_t>> seen(size_t(hp.n_layer));
    engine.context().on_routing = [&](int64_t l, const Routing &r) {
        seen[size_t(l)].assign(r.ids.begin(), r.ids.begin() + r.n_tok * r.k);
    };
    const std::vector<int32_t> prompt{1, 2, 3, 4, 5};
    engine.eval(prompt);
    EXPECT_TRUE(seen[0].empty());
    for (int64_t il = 1; il < hp.n_layer; ++il) {
        std::vector<int32_t> want;
        for (int i = 0; i < n_tok; ++i) {
            const uint8_t *ids = t.ids(i, int32_t(il - 1));
            want.insert(want.end(), ids, ids + 6);
        }
        EXPECT_EQ(seen[size_t(il)], want) << "layer " << il;
    }
    EXPECT_EQ(engine.context().n_past(), n_tok);

    const RoutingTrace all = test::random_trace(27, 64, 6, {2}, 9, [](int32_t) { return 0.5f; });
    write_trace(path.string(), all);
    const std::string msg = error_of([&] { RoutingReplay r(path.string(), hp); });
    for (const std::string &part : {path.string(), std::string("the trace routes 27 MoE layers x 64 experts, top-6"),
                                    std::string("the model has 26 MoE layers (of 27 layers; the first 1 dense)")}) {
        EXPECT_NE(msg.find(part), std::string::npos) << msg;
    }
    fs::remove(path);
    fs::remove(gguf);
}

TEST(Engine, GpuSettingsWithoutAUsableGpuAreAClearError) {
    const auto model = tiny();
    OffloadConfig c;
    c.set("gpu_cache", "1GiB", "--gpu-expert-budget");
    // Either this build has no CUDA backend, or this machine no GPU (the CPU-only CI); on a GPU machine the
    // GPU tests cover the other case.
#ifdef PRESCOPE_USE_CUDA
    if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
#endif
    const std::string e = error_of([&] { make_engine(*model, {32, 4}, c); });
    EXPECT_NE(e.find("--gpu-expert-budget"), std::string::npos) << e;
    EXPECT_NE(e.find("CPU"), std::string::npos) << e;  // says how to run without it
}

TEST(Engine, PredictorsByName) {
    const auto model = tiny();
    OffloadConfig c;
    OraclePredictor *oracle = nullptr;
    c.predictor = "none";
    EXPECT_EQ(make_predictor(c, *model, 4, nullptr, &oracle), nullptr);
    for (const char *name : {"frequency", "recency", "fate"}) {
        c.predictor = name;
        const auto p = make_predictor(c, *model, 4, nullptr, &oracle);
        ASSERT_NE(p, nullptr);
        EXPECT_STREQ(p->name(), name);
        EXPECT_EQ(oracle, nullptr);
    }
    c.predictor = "oracle";
    EXPECT_NE(error_of([&] { make_predictor(c, *model, 1, nullptr, &oracle); }).find("--routing-trace"),
              std::string::npos);
    c.predictor = "/no/such/predictor.bin";
    EXPECT_NE(error_of([&] { make_predictor(c, *model, 1, nullptr, &oracle); }).find("expected none, frequency"),
              std::string::npos);
}

// Predictors number the MoE layers from 0 (decision 0134): on deepseek2 their shape has n_layer_moe layers, fate reads
// the routers of the MoE layers only, and a predictor file trained for another shape is refused.
TEST(Engine, PredictorsNumberTheMoeLayers) {
    const auto model = tiny("deepseekv3");
    const HParams &hp = model->hp();
    ASSERT_GT(hp.n_layer_dense, 0);
    OffloadConfig c;
    c.predictor = "frequency";
    const auto p = make_predictor(c, *model, 4, nullptr, nullptr);
    const auto *scoring = dynamic_cast<const ScoringPredictor *>(p.get());
    ASSERT_NE(scoring, nullptr);
    EXPECT_EQ(scoring->shape().n_layers, hp.n_layer_moe());
    const auto routers = FatePredictor::read_routers(*model);
    ASSERT_EQ(int64_t(routers.size()), hp.n_layer_moe());
    const TensorView &g = model->weights().layers[size_t(hp.n_layer_dense)].gate_inp;
    ASSERT_EQ(g.type, DType::F32);
    EXPECT_EQ(std::memcmp(routers[0].data(), g.data, routers[0].size() * 4), 0);
    c.predictor = "fate";
    EXPECT_NE(make_predictor(c, *model, 4, nullptr, nullptr), nullptr);

    LlaporConfig lc;
    lc.kind = "llapor-lstm";
    lc.shape = {int32_t(hp.n_layer), int32_t(hp.n_expert), int32_t(hp.n_expert_used)};  // every layer: one too many
    lc.group_start = {0};
    lc.hidden = 4;
    const fs::path f = fs::temp_directory_path() / ("prescope-unit-shape-" + std::to_string(getpid()) + ".pred");
    save_llapor(f.string(), lc, LlaporLstmNet(lc, 1).params());
    c.predictor = f.string();
    const std::string msg = error_of([&] { make_predictor(c, *model, 1, nullptr, nullptr); });
    EXPECT_NE(msg.find(fmt::format("trained for {} MoE layers x {} experts, top-{}; the model has {} x", hp.n_layer,
                                   hp.n_expert, hp.n_expert_used, hp.n_layer_moe())),
              std::string::npos)
        << msg;
    fs::remove(f);
}
