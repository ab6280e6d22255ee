// The hybrid CPU/GPU MoE block (runtime/hybrid-moe.h) on a fake device: the tiny test models run through
// the whole offload path (expert store, hot-expert table, copy engine, loader, decisions, prefetch, combine)
// with "GPU" experts computed on the host from the bytes that reached their slots. Offloading must not
// change the numbers: the logits equal the plain CPU executor's bit for bit, whatever the budget.
#include "../common/bitwise.h"
#include "../common/greedy-logits.h"
#include "../common/tiny-model.h"
#include "arch/arch.h"
#include "core/error.h"
#include "offload/copy-engine.h"
#include "offload/expert-cache.h"
#include "offload/expert-loader.h"
#include "offload/expert-store.h"
#include "offload/fake-backend.h"
#include "offload/placement.h"
#include "offload/predictor-baselines.h"
#include "runtime/context.h"
#include "runtime/hybrid-moe.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>

using namespace prescope;
namespace fs = std::filesystem;

namespace {

fs::path model_path(const std::string &arch, const std::string &file) {
    return fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models" / arch / file;
}

// The device half on the fake backend: GPU experts read their slots through the compute stream (so they
// see exactly the bytes the copies delivered, after the waits the loader queued) and run on the host. With a
// shared expert on the device (MoeStep::k_comb = k + 1) wave 0 runs it too and the combine adds its column with
// the step's weight, so that weight must be the one Context gives it (sigmoid of its gate, or 1 ungated).
class FakeMoeDevice final : public MoeDevice {
  public:
    FakeMoeDevice(FakeBackend &backend, const ExpertStore &store, const Model &model, int64_t max_tokens)
        : backend_(backend), store_(store), model_(model), n_embd_(model.hp().n_embd), n_expert_(model.hp().n_expert),
          k_(model.hp().n_expert_used) {
        compute_ = backend.stream_create();
        const size_t pairs = size_t(max_tokens * model.hp().n_expert_used);
        gpu_out_.resize(pairs * size_t(n_embd_));
        cpu_out_.resize(pairs * size_t(n_embd_));
        shared_out_.resize(size_t(max_tokens * n_embd_));
        shared_scratch_.resize(size_t(max_tokens * 2 * model.hp().n_ff_shexp));
        table_.assign(size_t(model.hp().n_layer * n_expert_), nullptr);
    }
    ~FakeMoeDevice() override {
        backend_.stream_synchronize(compute_);
        backend_.stream_destroy(compute_);
    }
    void set_io(const float *x, float *out, const int32_t *ids, const float *weights = nullptr) {
        x_ = x;
        out_ = out;
        ids_ = ids;
        weights_ = weights;
    }
    Stream compute_stream() override { return compute_; }
    void launch_gpu(const MoeStep &s) override {
        if (log) log->push_back("launch " + std::to_string(s.wave));
        for (int32_t i = s.wave_begin; i < s.wave_end; ++i) {
            const int32_t first = s.gpu_offsets[size_t(i)];
            run_expert(s.layer, s.gpu_expert[size_t(i)], &s.gpu_rows[size_t(first)], s.gpu_offsets[size_t(i) + 1] - first,
                       first);
        }
        if (s.wave == 0 && s.k_comb > s.k) {
            // The shared expert over every token, as Context computes it (runtime/context.cpp moe_block).
            const LayerWeights &l = model_.weights().layers[size_t(s.layer)];
            cpu_expert_ffn(l.gate_shexp, l.up_shexp, l.down_shexp, 0, x_, s.n_tok, shared_scratch_.data(),
                           shared_out_.data());
            ++shared_runs_;
        }
        ++launches_;
        waves_ = std::max(waves_, s.wave + 1);
    }
    int64_t device_hits_max_tokens() const override { return device_hits_tokens; }
    // The device's side of the hit path, computed from its own table and routing, in MoeDevice's layout.
    void launch_device_hits(int32_t layer, int64_t n_tok, std::span<const int32_t> index,
                            std::span<const void *const> data) override {
        if (log) log->push_back("device-hits");
        ASSERT_EQ(index.size(), data.size());
        ASSERT_LE(n_tok, device_hits_tokens);
        for (size_t i = 0; i < index.size(); ++i) table_[size_t(index[i])] = data[i];
        int32_t pair = 0;
        std::vector<int32_t> rows;
        for (int64_t e = 0; e < n_expert_; ++e) {
            const void *slot = table_[size_t(layer * n_expert_ + e)];
            rows.clear();
            for (int64_t p = 0; slot != nullptr && p < n_tok * k_; ++p) {
                if (ids_[p] == e) rows.push_back(int32_t(p / k_));
            }
            if (rows.empty()) continue;
            run_expert(layer, slot, rows.data(), int64_t(rows.size()), pair);
            pair += int32_t(rows.size());
        }
        device_pairs_ += pair;
    }
    // A whole step from the device's own table, routing and weights: the products in launch_device_hits' layout,
    // the ungated shared expert at weight 1, the combine in top-k order. An expert missing from the table fails.
    void launch_device_layer(int32_t layer, int64_t n_tok, std::span<const int32_t> index,
                             std::span<const void *const> data) override {
        if (log) log->push_back("device-layer");
        ASSERT_TRUE(n_tok >= 1 && n_tok <= device_hits_tokens && weights_ != nullptr);
        ASSERT_FALSE(model_.hp().shared_expert_gate);
        for (size_t i = 0; i < index.size(); ++i) table_[size_t(index[i])] = data[i];
        std::vector<int32_t> rows, pair_of(size_t(n_tok * k_), -1);
        int32_t pair = 0;
        for (int64_t e = 0; e < n_expert_; ++e) {
            rows.clear();
            for (int64_t p = 0; p < n_tok * k_; ++p) {
                if (ids_[p] != e) continue;
                pair_of[size_t(p)] = pair + int32_t(rows.size());
                rows.push_back(int32_t(p / k_));
            }
            if (rows.empty()) continue;
            const void *slot = table_[size_t(layer * n_expert_ + e)];
            ASSERT_NE(slot, nullptr) << "layer " << layer << " expert " << e << " is not in the device's table";
            run_expert(layer, slot, rows.data(), int64_t(rows.size()), pair);
            pair += int32_t(rows.size());
        }
        const bool shared = model_.hp().shared_expert;
        if (shared) {
            const LayerWeights &l = model_.weights().layers[size_t(layer)];
            cpu_expert_ffn(l.gate_shexp, l.up_shexp, l.down_shexp, 0, x_, n_tok, shared_scratch_.data(),
                           shared_out_.data());
        }
        for (int64_t t = 0; t < n_tok; ++t) {
            float *o = out_ + t * n_embd_;
            std::fill_n(o, n_embd_, 0.0f);
            for (int64_t j = 0; j < k_; ++j) {
                const float w = weights_[t * k_ + j];
                const float *y = &gpu_out_[size_t(pair_of[size_t(t * k_ + j)]) * size_t(n_embd_)];
                for (int64_t c = 0; c < n_embd_; ++c) o[c] += w * y[c];
            }
            for (int64_t c = 0; shared && c < n_embd_; ++c) o[c] += 1.0f * shared_out_[size_t(t * n_embd_ + c)];
        }
        device_pairs_ += pair;
        ++device_layers_;
    }
    float *cpu_out() override { return cpu_out_.data(); }
    void combine(const MoeStep &s) override {
        if (log) log->push_back("combine");
        const int64_t routed_pairs = s.n_gpu_pairs + s.n_cpu_pairs;
        for (int64_t t = 0; t < s.n_tok; ++t) {
            float *o = out_ + t * n_embd_;
            std::fill_n(o, n_embd_, 0.0f);
            for (int64_t j = 0; j < s.k_comb; ++j) {
                const int64_t p = s.pair_ids[size_t(t * s.k_comb + j)];
                const float w = s.weights[size_t(t * s.k_comb + j)];
                const float *y = p < s.n_gpu_pairs  ? &gpu_out_[size_t(p * n_embd_)]
                                 : p < routed_pairs ? &cpu_out_[size_t((p - s.n_gpu_pairs) * n_embd_)]
                                                    : &shared_out_[size_t((p - routed_pairs) * n_embd_)];
                for (int64_t c = 0; c < n_embd_; ++c) o[c] += w * y[c];
            }
        }
    }
    int launches() const { return launches_; }
    int shared_runs() const { return shared_runs_; }
    int64_t device_pairs() const { return device_pairs_; }
    int device_layers() const { return device_layers_; }
    int64_t device_hits_tokens = 0;             // device_hits_max_tokens()
    int most_waves() const { return waves_; }  // most launches of one layer
    std::vector<std::string> *log = nullptr;    // device calls, when a test records them

  private:
    // Pair rows [first, first + m) of gpu_out_ = the expert in `slot` (read through the compute stream, so after
    // the waits queued on it) applied to x_ rows rows[0..m).
    void run_expert(int32_t layer, const void *slot, const int32_t *rows, int64_t m, int64_t first) {
        const ExpertLayout &layout = store_.layout(layer);
        slot_copy_.assign(layout.bytes, 0);
        backend_.copy_d2h_async(slot_copy_.data(), slot, layout.bytes, compute_);
        backend_.stream_synchronize(compute_);
        xg_.resize(size_t(m * n_embd_));
        scratch_.resize(size_t(m * 2 * layout.n_ff));
        for (int64_t p = 0; p < m; ++p) std::memcpy(&xg_[size_t(p * n_embd_)], x_ + rows[p] * n_embd_, size_t(n_embd_) * 4);
        const ExpertViews v = ExpertStore::canonical_views(layout, slot_copy_.data());
        cpu_expert_ffn(v.gate, v.up, v.down, 0, xg_.data(), m, scratch_.data(), &gpu_out_[size_t(first * n_embd_)]);
    }

    FakeBackend &backend_;
    const ExpertStore &store_;
    const Model &model_;
    int64_t n_embd_, n_expert_, k_;
    Stream compute_ = nullptr;
    const float *x_ = nullptr;
    float *out_ = nullptr;
    const int32_t *ids_ = nullptr;
    const float *weights_ = nullptr;
    std::vector<const void *> table_;  // [n_layers * n_experts] the device slot table
    std::vector<uint8_t> slot_copy_;
    std::vector<float> gpu_out_, cpu_out_, xg_, scratch_;
    std::vector<float> shared_out_, shared_scratch_;  // [max_tokens][n_embd], [max_tokens][2 * n_ff_shexp]
    int launches_ = 0, waves_ = 0, shared_runs_ = 0, device_layers_ = 0;
    int64_t device_pairs_ = 0;
};

// The CPU Context's expert executor, routed through HybridMoe and the fake device. With shared_on_device the
// device adds the shared expert (Context leaves it out); a gated one's logits are computed here as Context would.
class HybridExecutor final : public ExpertExecutor {
  public:
    HybridExecutor(const Model &model, HybridMoe &moe, FakeMoeDevice &device, bool shared_on_device, int64_t max_tokens)
        : model_(model), moe_(moe), device_(device), shared_(shared_on_device), gate_(size_t(max_tokens)) {}
    bool adds_shared_expert() const override { return shared_; }
    /// As GpuContext: a whole device step's accounting waits (with a copy of its input and routing) until
    /// another layer's launch, and a new pass, or finish(), settles what is pending.
    void run(int64_t layer, const float *x, const Routing &r, float *out) override {
        if (!pending_.empty() && layer <= pending_.back().layer) finish();  // a new pass
        device_.set_io(x, out, r.ids.data(), r.weights.data());
        bool whole = false;
        if (replay && moe_.device_resident() && r.n_tok <= device_.device_hits_max_tokens()) {
            // As GpuContext's decode graph (decision 0142): the launches of a captured step again, without the
            // host's launch_device, which then only records the step.
            device_.launch_device_layer(int32_t(layer), r.n_tok, {}, {});
            moe_.replayed_device_layer(int32_t(layer));
            ++replayed;
            whole = true;
        } else {
            whole = moe_.launch_device(int32_t(layer), r.n_tok, whole_steps) == DeviceLaunch::LAYER;
        }
        if (whole) {
            const auto n = size_t(r.n_tok * model_.hp().n_embd);
            pending_.push_back({int32_t(layer), std::vector<float>(x, x + n), r});
            return;
        }
        finish();
        std::span<const float> gate;
        const HParams &hp = model_.hp();
        if (shared_ && hp.shared_expert_gate) {
            const float *g = model_.weights().layers[size_t(layer)].gate_inp_shexp;
            for (int64_t t = 0; t < r.n_tok; ++t) {
                float dot = 0.0f;
                for (int64_t c = 0; c < hp.n_embd; ++c) dot += g[c] * x[t * hp.n_embd + c];
                gate_[size_t(t)] = dot;
            }
            gate = std::span<const float>(gate_.data(), size_t(r.n_tok));
        }
        moe_.run_layer(int32_t(layer), x, r, gate);
    }
    /// Accounts the pending device steps, in layer order.
    void finish() {
        for (const Pending &p : pending_) moe_.account_device_layer(p.layer, p.x.data(), p.routing);
        pending_.clear();
    }
    bool whole_steps = true;  // launch_device's whole_steps
    bool replay = false;      // replay the device's launches while HybridMoe::device_resident() holds
    int64_t replayed = 0;     // steps replayed

  private:
    struct Pending {
        int32_t layer;
        std::vector<float> x;
        Routing routing;
    };
    const Model &model_;
    HybridMoe &moe_;
    FakeMoeDevice &device_;
    bool shared_;
    std::vector<float> gate_;  // [max_tokens] shared-expert gate logits
    std::vector<Pending> pending_;
};

struct Options {
    int32_t slots_per_layer = 0;  // 0: every expert fits
    int32_t cpu_threshold = 0;  // -1: the cost-model scheduler
    int32_t prefetch_window = 0;
    bool threaded = false;
    bool allow_pin = true;
    EvictionPolicyKind policy = EvictionPolicyKind::LRU;
    int32_t stream_min_batch = 32;  // never reached by kBatch unless lowered
    const CostProfile *profile = nullptr;  // null: the H200 reference
    LoadBalance balance = LoadBalance::ON;
    int64_t device_hits_tokens = 0;  // the fake device's device_hits_max_tokens()
    Predictor *predictor = nullptr;  // instead of the frequency predictor (prefetch_window > 0)
    bool all_fixed = false;  // every expert's home is a fixed GPU slot, loaded before the first step
};

// Everything the offloaded run needs, in construction order.
struct Rig {
    Rig(const Model &model, const Options &o, int64_t max_tokens)
        : backend(fake_config(o)),
          store(model, &backend),
          plan(PlacementPlan::uniform(int32_t(model.hp().n_layer), int32_t(model.hp().n_expert),
                                      o.all_fixed ? ExpertPlacement{HomeTier::GPU, ExecSite::GPU} : ExpertPlacement{})) {
        const HParams &hp = model.hp();
        ExpertCacheConfig c;
        c.n_layers = int32_t(hp.n_layer);
        c.n_experts = int32_t(hp.n_expert);
        c.top_k = int32_t(hp.n_expert_used);
        c.expert_bytes = store.expert_bytes();
        c.policy = o.policy;
        const int32_t per_layer = o.slots_per_layer > 0 ? o.slots_per_layer : c.n_experts;
        c.budget_bytes = uint64_t(per_layer) * uint64_t(hp.n_layer_moe()) * ExpertCache::slot_bytes_for(c);
        cache = std::make_unique<ExpertCache>(c, &backend);
        CopyEngineConfig ec;
        ec.chunk_bytes = 4096;  // several chunks per expert
        engine = std::make_unique<CopyEngine>(backend, ec);
        loader = std::make_unique<ExpertLoader>(backend, *cache, *engine, plan, store.host_experts());
        if (o.all_fixed) {
            loader->load_fixed();
            engine->drain();
        }
        if (o.prefetch_window > 0 && !o.predictor) {
            const PredictorShape shape{int32_t(hp.n_layer_moe()), c.n_experts, c.top_k};  // MoE layers from 0
            predictor = std::make_unique<FrequencyPredictor>(shape, 1.0, int32_t(max_tokens), o.prefetch_window);
        }
        device = std::make_unique<FakeMoeDevice>(backend, store, model, max_tokens);
        device->device_hits_tokens = o.device_hits_tokens;
        HybridMoeConfig hc;
        hc.planner.cpu_threshold = o.cpu_threshold;
        hc.planner.stream_min_batch = o.stream_min_batch;
        hc.planner.prefetch_window = o.prefetch_window;
        hc.planner.balance = o.balance;
        const ExpertShape shape = ExpertShape::of(store.layout(int32_t(hp.n_layer_dense)));
        const CostModel cost(o.profile ? *o.profile : CostProfile::h200_reference(), shape, 1, ec.chunk_bytes);
        // Models with a shared expert run it on the device, as GpuContext does.
        moe = std::make_unique<HybridMoe>(model, store, plan, cache.get(), loader.get(), engine.get(),
                                          o.predictor ? o.predictor : predictor.get(), *device, &backend, cost, hc,
                                          max_tokens, hp.shared_expert);
        executor = std::make_unique<HybridExecutor>(model, *moe, *device, hp.shared_expert, max_tokens);
    }
    ~Rig() {
        moe.reset();
        device.reset();
        loader.reset();
        engine.reset();
    }
    static FakeBackend::Config fake_config(const Options &o) {
        FakeBackend::Config f;
        f.mode = o.threaded ? FakeBackend::Mode::THREADED : FakeBackend::Mode::IMMEDIATE;
        f.allow_host_register = o.allow_pin;
        return f;
    }

    FakeBackend backend;
    ExpertStore store;
    PlacementPlan plan;
    std::unique_ptr<ExpertCache> cache;
    std::unique_ptr<CopyEngine> engine;
    std::unique_ptr<ExpertLoader> loader;
    std::unique_ptr<ScoringPredictor> predictor;
    std::unique_ptr<FakeMoeDevice> device;
    std::unique_ptr<HybridMoe> moe;
    std::unique_ptr<HybridExecutor> executor;
};

constexpr int64_t kBatch = 5;  // prefill in pieces of 5 tokens

// Prefill of a fixed prompt (all logits) followed by greedy decode steps; every logit of every step.
std::vector<float> run_tokens(const Model &model, ExpertExecutor *executor, int n_decode) {
    return test::greedy_logits(model, executor, 64, kBatch, 11, n_decode);
}

void expect_bitwise_equal(const std::vector<float> &a, const std::vector<float> &b) {
    ASSERT_EQ(a.size(), b.size());
    const size_t diff = test::bits_differing(a, b);
    EXPECT_EQ(diff, 0u) << "logits differ from the CPU executor's at " << diff << " of " << a.size();
}

class HybridModels : public ::testing::TestWithParam<std::string> {};

} // namespace

TEST_P(HybridModels, OffloadedLogitsEqualTheCpuExecutorAtEveryBudget) {
    const auto model = Model::load(model_path(GetParam(), "tiny-f32.gguf").string());
    const std::vector<float> ref = run_tokens(*model, nullptr, 6);
    const int32_t k = int32_t(model->hp().n_expert_used);
    // cpu_threshold >= 0: the threshold rule; -1: the cost-model scheduler (split FETCH waves, planned prefetches).
    for (const Options &o : {Options{}, Options{k, 0, 0}, Options{k, 2, 0}, Options{k + 1, 0, 2},
                             Options{k, 0, 3, true}, Options{k + 2, 1, 1, true, false, EvictionPolicyKind::ARC},
                             Options{k, -1, 0}, Options{k + 1, -1, 2, true}, Options{0, -1, 1, true},
                             Options{k + 2, -1, 3, true, false, EvictionPolicyKind::ARC}}) {
        SCOPED_TRACE(testing::Message() << "slots/layer " << o.slots_per_layer << ", cpu_threshold "
                                        << o.cpu_threshold << ", window " << o.prefetch_window << ", threaded "
                                        << o.threaded << ", pinned " << o.allow_pin);
        Rig rig(*model, o, kBatch);
        expect_bitwise_equal(run_tokens(*model, rig.executor.get(), 6), ref);
        EXPECT_GT(rig.device->launches(), 0);
        EXPECT_EQ(rig.store.pin_refused(), !o.allow_pin);
        EXPECT_EQ(rig.device->shared_runs() > 0, model->hp().shared_expert);
        for (int32_t l = 0; l < int32_t(model->hp().n_layer_dense); ++l) {
            EXPECT_EQ(rig.cache->layer_slots(l), 0);
            EXPECT_EQ(rig.cache->stats(l).accesses() + rig.cache->stats(l).prefetch_loads, 0u);
        }
    }
}

TEST_P(HybridModels, DeviceResolvedHitsEqualTheCpuExecutorAtEveryBudget) {
    // Issue 14: the device runs the routed experts its slot table holds before the host plans the rest. The
    // fake device computes them from its own table and routing in MoeDevice's layout, so a table entry set too
    // early, left stale after an eviction, or a layout the host's MoeStep does not share changes the logits.
    const auto model = Model::load(model_path(GetParam(), "tiny-f32.gguf").string());
    const std::vector<float> ref = run_tokens(*model, nullptr, 6);
    const int32_t k = int32_t(model->hp().n_expert_used);
    for (int64_t tokens : {int64_t(1), kBatch}) {
        Options fixed{};
        fixed.all_fixed = true;
        for (Options o : {Options{}, Options{k, 0, 0}, Options{k + 1, 0, 2, true}, Options{k, -1, 1, true},
                          Options{k + 2, -1, 3, true, false, EvictionPolicyKind::ARC}, fixed}) {
            o.device_hits_tokens = tokens;
            SCOPED_TRACE(testing::Message() << "device tokens " << tokens << ", slots/layer " << o.slots_per_layer
                                            << ", cpu_threshold " << o.cpu_threshold << ", window " << o.prefetch_window);
            uint64_t accesses = 0;  // of the run without whole steps
            for (int mode = 0; mode < 3; ++mode) {
                const bool whole = mode > 0, replay = mode == 2;
                SCOPED_TRACE(replay ? "whole device steps, replayed" : whole ? "whole device steps" : "device hits only");
                Rig rig(*model, o, kBatch);
                rig.executor->whole_steps = whole;
                rig.executor->replay = replay;
                expect_bitwise_equal(run_tokens(*model, rig.executor.get(), 6), ref);
                rig.executor->finish();
                const LayerStats t = rig.cache->total_stats();
                EXPECT_LE(t.device_hits, t.hits);
                EXPECT_GT(rig.device->device_pairs(), 0);
                EXPECT_EQ(t.device_layers, uint64_t(rig.device->device_layers()));
                // A whole step is counted as the host-planned one would be: same routing, same accesses.
                if (whole) EXPECT_EQ(t.accesses(), accesses);
                accesses = t.accesses();
                // Replays only from fixed homes, once launch_device has set the device's table (the first step).
                const bool resident = o.all_fixed && !model->hp().shared_expert_gate;
                EXPECT_EQ(rig.moe->device_resident(), resident);
                if (replay) {
                    EXPECT_EQ(rig.executor->replayed > 0, resident);
                    EXPECT_LT(rig.executor->replayed, int64_t(t.steps));
                }
                const bool full = o.slots_per_layer == 0 || o.slots_per_layer >= model->hp().n_expert;
                // Whole steps need every expert of the layer resident (from the start with fixed homes: every
                // step after the prefill's), and no gated shared expert.
                if (!whole || !full || model->hp().shared_expert_gate) {
                    EXPECT_EQ(t.device_layers, 0u);
                } else if (o.all_fixed && tokens == kBatch) {
                    EXPECT_EQ(t.device_layers, t.steps);
                } else if (o.all_fixed) {
                    EXPECT_GT(t.device_layers, 0u);
                }
                if (o.slots_per_layer == 0) {
                    // Every expert fits: after its first use each one is the device's.
                    EXPECT_GT(t.device_hits, t.hits / 2) << t.device_hits << " of " << t.hits;
                }
            }
        }
    }
}

// deepseekv3 / deepseekv2lite (deepseek2): a leading dense layer and an ungated shared expert (decision 0134).
INSTANTIATE_TEST_SUITE_P(TinyModels, HybridModels,
                         ::testing::Values("qwen3moe", "mixtral", "olmoe", "qwen2moe", "deepseekv3", "deepseekv2lite"),
                         test::string_param_name);

namespace {

// Asks for every expert of every layer its window reaches, and records the layer numbering it is given.
class GreedyPredictor final : public Predictor {
  public:
    explicit GreedyPredictor(int32_t n_experts) : n_experts_(n_experts) {}
    const char *name() const override { return "greedy"; }
    void predict(const PredictorInput &in, PrefetchList &out) override {
        seen.emplace_back(in.layer, in.n_layers);
        for (int32_t l = in.layer + 1; l <= std::min(in.layer + in.window, in.n_layers - 1); ++l) {
            for (int32_t e = 0; e < n_experts_; ++e) out.push({l, e, 1.0f / float(l - in.layer)});
        }
    }
    std::vector<std::pair<int32_t, int32_t>> seen;  // (layer, n_layers) of each call

  private:
    int32_t n_experts_;
};

} // namespace

// Predictors number the MoE layers from 0, as traces do (decision 0134): on deepseek2 (1 dense + 2 MoE layers) the
// predictor sees MoE layer il - 1 of 2, and its requests reach the cache as model layers with experts (the cache
// asserts that no prefetch names the dense layer).
TEST(HybridMoe, PredictorsSeeTheMoeLayersOfAModelWithLeadingDenseLayers) {
    const auto model = Model::load(model_path("deepseekv3", "tiny-f32.gguf").string());
    const HParams &hp = model->hp();
    const std::vector<float> ref = run_tokens(*model, nullptr, 6);
    GreedyPredictor p(int32_t(hp.n_expert));
    Options o{int32_t(hp.n_expert_used) + 1, 0, 3};
    o.predictor = &p;
    Rig rig(*model, o, kBatch);
    expect_bitwise_equal(run_tokens(*model, rig.executor.get(), 6), ref);
    ASSERT_FALSE(p.seen.empty());
    for (const auto &[layer, n_layers] : p.seen) {
        EXPECT_EQ(n_layers, hp.n_layer_moe());
        EXPECT_GE(layer, 0);
        EXPECT_LT(layer, n_layers - 1);  // the last MoE layer has nothing after it to predict
    }
    EXPECT_GT(rig.cache->stats(int32_t(hp.n_layer) - 1).prefetch_loads, 0u);
    EXPECT_EQ(rig.cache->stats(0).prefetch_loads, 0u);
}

TEST(HybridMoe, Q8ExpertsThroughSlotsEqualTheCpuExecutor) {
    const auto model = Model::load(model_path("qwen3moe", "tiny-q8_0.gguf").string());
    Rig rig(*model, Options{int32_t(model->hp().n_expert_used), 0, 2, true}, kBatch);
    expect_bitwise_equal(run_tokens(*model, rig.executor.get(), 4), run_tokens(*model, nullptr, 4));
}

TEST(HybridMoe, LlamaQuantizeFilesThroughSlotsEqualTheCpuExecutor) {
    // The committed llama-quantize files (tests/data/quant, decision 0071): experts in Q4_0, Q5_0 / Q5_1 /
    // Q8_0 (the tiny Q4_K_M, whose Q4_K and Q6_K fall back), Q5_1 and IQ4_NL, with the per-tensor mixes
    // llama-quantize writes; offloaded at several budgets, the logits are the CPU executor's bit for bit.
    for (const std::string name :
         {"tiny-qwen3moe-q4_0", "tiny-olmoe-q4_k_m", "tiny-qwen2moe-q5_k_m", "tiny-mixtral-iq4_xs"}) {
        SCOPED_TRACE(name);
        const auto model =
            Model::load((fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/quant" / (name + ".gguf")).string());
        EXPECT_NE(model->weights().layers[0].gate_exps.type, DType::F32);
        const std::vector<float> ref = run_tokens(*model, nullptr, 6);
        const int32_t k = int32_t(model->hp().n_expert_used);
        for (const Options &o : {Options{}, Options{k, 0, 2, true}, Options{k + 1, -1, 1, true}}) {
            SCOPED_TRACE(testing::Message() << "slots/layer " << o.slots_per_layer << ", cpu_threshold "
                                            << o.cpu_threshold);
            Rig rig(*model, o, kBatch);
            expect_bitwise_equal(run_tokens(*model, rig.executor.get(), 6), ref);
            EXPECT_GT(rig.engine->stats().bytes_done, 0u);
        }
    }
}

TEST(HybridMoe, MixedTypeExpertsThroughSlotsOfEachLayersSizeEqualTheCpuExecutor) {
    // Layer 0's experts are Q4_K / Q5_K / Q6_K, layer 1's IQ4_XS / Q4_K / Q4_K: two expert sizes, so the
    // slots of the two layers differ in size; the quantized bytes travel as stored.
    const std::string path =
        (fs::temp_directory_path() / ("prescope-hybrid-mixed-" + std::to_string(getpid()) + ".gguf")).string();
    test::write_tiny_model(path, test::mixed_type_spec(false));
    const auto model = Model::load(path);
    const int32_t k = int32_t(model->hp().n_expert_used);
    for (const Options &o : {Options{k, 0, 0}, Options{k, 1, 1, true}}) {
        Rig rig(*model, o, kBatch);
        EXPECT_EQ(rig.store.layout(0).bytes, 256u * (144 + 176 + 210));
        EXPECT_EQ(rig.store.layout(1).bytes, 256u * (136 + 144 + 144));
        EXPECT_EQ(rig.cache->slot_bytes(0), rig.store.layout(0).bytes);
        EXPECT_EQ(rig.cache->slot_bytes(1), rig.store.layout(1).bytes);
        EXPECT_NE(rig.store.describe().find("(q4_K/q5_K/q6_K) in 1 layers"), std::string::npos) << rig.store.describe();
        expect_bitwise_equal(run_tokens(*model, rig.executor.get(), 4), run_tokens(*model, nullptr, 4));
        EXPECT_GT(rig.engine->stats().bytes_done, 0u);
    }
    std::filesystem::remove(path);
}

TEST(HybridMoe, CostSchedulerSplitsAndStreamsAndStillEqualsTheCpuExecutor) {
    // A profile where a fetch and a CPU expert cost the same (100 us): two missed experts of a decode token go
    // one to each side (split), and prefill batches stream through few slots.
    CostProfile p = CostProfile::h200_reference();
    p.h2d_request_us = 100;
    p.cpu_expert_us = 100;
    p.cpu_layer_us = 0;
    p.gpu_wave_us = 1;
    for (const std::string arch : {"mixtral", "qwen3moe"}) {
        SCOPED_TRACE(arch);
        const auto model = Model::load(model_path(arch, "tiny-q8_0.gguf").string());
        Options o;
        o.slots_per_layer = int32_t(model->hp().n_expert_used);
        o.cpu_threshold = -1;
        o.prefetch_window = 2;
        o.threaded = true;
        o.stream_min_batch = 3;
        o.profile = &p;
        o.balance = LoadBalance::OFF;
        Rig rig(*model, o, kBatch);
        expect_bitwise_equal(run_tokens(*model, rig.executor.get(), 6), run_tokens(*model, nullptr, 6));
        const LayerStats t = rig.cache->total_stats();
        EXPECT_GT(t.split_steps, 0u);
        EXPECT_GT(t.streamed, 0u);
        EXPECT_GT(t.cpu_runs, 0u);
        EXPECT_EQ(t.steps, uint64_t(model->hp().n_layer) * (3 + 6));  // batches of 5, 5, 1, then 6 decode steps
    }
}

namespace {

// The steps and device calls of one run_layer, in order.
std::vector<std::string> steps_of(Rig &rig, int32_t layer, const Routing &r, int n_embd) {
    std::vector<std::string> log;
    rig.moe->on_step = [&](int32_t, LayerStep s) { log.push_back(layer_step_name(s)); };
    rig.device->log = &log;
    std::vector<float> h(size_t(r.n_tok * n_embd), 0.25f), out(h.size());
    rig.device->set_io(h.data(), out.data(), nullptr);
    rig.moe->run_layer(layer, h.data(), r, {});
    rig.device->log = nullptr;
    rig.moe->on_step = nullptr;
    return log;
}

Routing routing_of(std::vector<std::vector<int32_t>> tokens) {
    Routing r;
    r.n_tok = int64_t(tokens.size());
    r.k = int64_t(tokens[0].size());
    for (const auto &t : tokens) {
        for (int32_t id : t) {
            r.ids.push_back(id);
            r.weights.push_back(1.0f / float(r.k));
        }
    }
    return r;
}

} // namespace

TEST(HybridMoe, TheLayerStepsComeInTheOneOrderWithTheDeviceCallsWhereTheyBelong) {
    const auto model = Model::load(model_path("mixtral", "tiny-f32.gguf").string());  // 8 experts, top-2
    CostProfile p = CostProfile::h200_reference();
    p.h2d_request_us = 100;
    p.cpu_expert_us = 100;
    p.cpu_layer_us = 0;
    p.gpu_wave_us = 1;
    Options o;
    o.slots_per_layer = 2;
    o.cpu_threshold = -1;
    o.prefetch_window = 1;
    o.stream_min_batch = 3;
    o.profile = &p;
    o.balance = LoadBalance::OFF;
    Rig rig(*model, o, kBatch);
    const int n_embd = int(model->hp().n_embd);
    using V = std::vector<std::string>;
    // Decode, both experts missing: predictor first, one expert to the CPU while the other's copy travels.
    EXPECT_EQ(steps_of(rig, 1, routing_of({{3, 5}}), n_embd),
              (V{"predict-first", "plan", "slots-and-copies", "launch-wave0", "launch 0", "prefetch", "cpu-experts",
                 "launch-fetch-wave", "launch 1", "combine", "combine", "measure"}));
    const LayerDecision &d = rig.moe->last_plan().decision;
    EXPECT_EQ(d.n_fetch, 1);
    EXPECT_EQ(d.n_cpu, 1);
    // The fetched one again, now resident, with a new miss: the hit waits in wave 0, the miss is decided.
    const int32_t resident = d.experts[0].action == ExpertAction::FETCH ? d.experts[0].expert : d.experts[1].expert;
    const V hit_and_miss = steps_of(rig, 1, routing_of({{resident, 7}}), n_embd);
    EXPECT_EQ(hit_and_miss[0], "predict-first");
    EXPECT_EQ(hit_and_miss[3], "wait-wave0");
    // With the CPU ten times dearer the GPU takes everything. Everything resident: the predictor runs after the
    // launch, off the GPU's path, and the slots are released after it.
    CostProfile dear = p;
    dear.cpu_expert_us = 1000;
    o.profile = &dear;
    Rig rig2(*model, o, kBatch);
    steps_of(rig2, 0, routing_of({{0, 1}}), n_embd);
    EXPECT_EQ(rig2.moe->last_plan().decision.n_fetch, 2);
    EXPECT_EQ(steps_of(rig2, 0, routing_of({{0, 1}}), n_embd),
              (V{"plan", "slots-and-copies", "wait-wave0", "launch-wave0", "launch 0", "predict-after-launch",
                 "release-wave0", "prefetch", "combine", "combine", "measure"}));
    // A prefill batch of 4 tokens over 6 experts and 2 slots: wave 0, then two streamed waves.
    EXPECT_EQ(steps_of(rig2, 1, routing_of({{0, 1}, {2, 3}, {4, 5}, {0, 2}}), n_embd),
              (V{"predict-first", "plan", "slots-and-copies", "wait-wave0", "launch-wave0", "launch 0",
                 "release-wave0", "queue-stream-wave", "prefetch", "stream-waves", "launch 1", "launch 2", "combine",
                 "combine", "measure"}));
    EXPECT_EQ(rig2.moe->last_plan().decision.n_stream, 4);
}

TEST(HybridMoe, ExpertsStreamedInWavesThroughFewSlotsEqualTheCpuExecutor) {
    // Batches of 2+ tokens stream what does not fit: top-k slots per layer give several waves per layer.
    int most_waves = 0;
    for (const std::string arch : {"qwen3moe", "mixtral"}) {
        SCOPED_TRACE(arch);
        const auto model = Model::load(model_path(arch, "tiny-q8_0.gguf").string());
        const int32_t k = int32_t(model->hp().n_expert_used);
        for (const int32_t cpu_threshold : {0, 2}) {
            Options o;
            o.slots_per_layer = k;
            o.cpu_threshold = cpu_threshold;
            o.prefetch_window = 1;
            o.threaded = true;
            o.stream_min_batch = 2;
            Rig rig(*model, o, kBatch);
            expect_bitwise_equal(run_tokens(*model, rig.executor.get(), 4), run_tokens(*model, nullptr, 4));
            EXPECT_GT(rig.cache->total_stats().streamed, 0u);
            EXPECT_GE(rig.device->most_waves(), 2);
            most_waves = std::max(most_waves, rig.device->most_waves());
            EXPECT_LE(rig.cache->total_stats().streamed, rig.cache->total_stats().demand_misses);  // never resident
        }
    }
    EXPECT_GE(most_waves, 3);  // streamed waves reuse the slots of the streamed wave before
}

TEST(HybridMoe, EveryRoutedExpertIsCountedOnceAsHitMissOrCpu) {
    const auto model = Model::load(model_path("qwen3moe", "tiny-f32.gguf").string());
    Rig rig(*model, Options{int32_t(model->hp().n_expert_used), 2, 0}, kBatch);
    Context ctx(*model, {64, kBatch}, rig.executor.get());
    uint64_t unique = 0;
    ctx.on_routing = [&](int64_t, const Routing &r) {
        std::vector<int> seen(size_t(model->hp().n_expert), 0);
        for (int32_t id : r.ids) unique += seen[size_t(id)]++ == 0;
    };
    std::vector<int32_t> prompt{3, 9, 27, 81, 243 % 1000, 7, 1};
    ctx.eval(prompt);
    for (int i = 0; i < 5; ++i) {
        const int32_t t = int32_t(i * 13 + 2);
        ctx.eval({&t, 1});
    }
    const LayerStats s = rig.cache->total_stats();
    EXPECT_EQ(s.accesses(), unique);
    EXPECT_GT(s.cpu_runs, 0u);       // prefill batches route more experts than a layer's slots hold
    EXPECT_GT(s.demand_misses, 0u);  // the cold cache
    EXPECT_GT(s.hits, 0u);           // experts reused from one step to the next
}

TEST(HybridMoe, TheCopyEnginesBusyShareReachesThePlannerUnlessTheBalancerIsOff) {
    // Decision 0147: the planner prices link time by the copy engine's busy share, which the executor measures
    // between layers; under load_balance off it stays 0 (the old plans, for comparisons).
    const auto model = Model::load(model_path("qwen3moe", "tiny-f32.gguf").string());
    for (const LoadBalance mode : {LoadBalance::LINK, LoadBalance::OFF}) {
        SCOPED_TRACE(load_balance_name(mode));
        Options o{int32_t(model->hp().n_expert_used), 2, 0};
        o.cpu_threshold = -1;
        o.balance = mode;
        o.threaded = true;  // a copy thread: the link is busy while the host goes on
        Rig rig(*model, o, kBatch);
        run_tokens(*model, rig.executor.get(), 8);
        ASSERT_GT(rig.cache->total_stats().bytes_loaded, 0u);
        const double share = rig.moe->planner()->balancer().link_busy_share();
        if (mode == LoadBalance::OFF) {
            EXPECT_EQ(share, 0.0);
        } else {
            EXPECT_GT(share, 0.0);
            EXPECT_LE(share, 1.0);
        }
    }
}

TEST(HybridMoe, StepPairsCoverEveryTokenSlotOnceGpuPairsFirst) {
    const auto model = Model::load(model_path("mixtral", "tiny-f32.gguf").string());
    Rig rig(*model, Options{int32_t(model->hp().n_expert_used), 3, 0}, kBatch);
    const int64_t E = model->hp().n_expert, k = model->hp().n_expert_used, n_tok = 4;
    Routing r;
    r.n_tok = n_tok;
    r.k = k;
    // Expert 0 gets 4 tokens (>= cpu_threshold 3: fetched), the others 1 each (CPU).
    for (int64_t t = 0; t < n_tok; ++t) {
        r.ids.push_back(0);
        for (int64_t j = 1; j < k; ++j) r.ids.push_back(int32_t(1 + (t * (k - 1) + j - 1) % (E - 1)));
        for (int64_t j = 0; j < k; ++j) r.weights.push_back(0.1f * float(j + 1));
    }
    std::vector<float> h(size_t(n_tok * model->hp().n_embd), 0.25f), out(h.size());
    rig.device->set_io(h.data(), out.data(), nullptr);
    rig.moe->run_layer(1, h.data(), r, {});
    const MoeStep &s = rig.moe->last_step();
    EXPECT_EQ(s.n_gpu, 1);
    EXPECT_EQ(s.n_gpu_pairs, n_tok);
    EXPECT_EQ(s.n_gpu_pairs + s.n_cpu_pairs, n_tok * k);
    std::vector<int> seen(size_t(n_tok * k), 0);
    for (int64_t t = 0; t < n_tok; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            const int32_t p = s.pair_ids[size_t(t * k + j)];
            ASSERT_GE(p, 0);
            ASSERT_LT(p, n_tok * k);
            ++seen[size_t(p)];
            EXPECT_EQ(s.weights[size_t(t * k + j)], r.weights[size_t(t * k + j)]);
            const bool gpu = r.ids[size_t(t * k + j)] == 0;
            EXPECT_EQ(p < s.n_gpu_pairs, gpu);
            EXPECT_EQ(gpu ? s.gpu_rows[size_t(p)] : s.cpu_rows[size_t(p - s.n_gpu_pairs)], t);
        }
    }
    for (int c : seen) EXPECT_EQ(c, 1);
    EXPECT_EQ(rig.moe->last_plan().decision.n_fetch, 1);
    EXPECT_EQ(rig.moe->last_plan().decision.n_cpu, s.n_cpu);
}

TEST(ExpertStore, CanonicalBytesAreTheFileExpertsBackToBack) {
    const auto model = Model::load(model_path("olmoe", "tiny-q8_0.gguf").string());
    FakeBackend backend;
    ExpertStore store(*model, &backend);
    EXPECT_FALSE(store.pin_refused());
    EXPECT_GT(store.pinned_bytes(), 0u);
    for (int32_t l = 0; l < store.n_layers(); ++l) {
        const ExpertLayout &x = store.layout(l);
        EXPECT_EQ(x.up_offset % 256, 0u);
        EXPECT_EQ(x.down_offset % 256, 0u);
        EXPECT_EQ(x.bytes % 256, 0u);
        const LayerWeights &w = model->weights().layers[size_t(l)];
        for (int32_t e = 0; e < store.n_experts(); ++e) {
            const auto *p = static_cast<const uint8_t *>(store.host_expert(l, e));
            ASSERT_NE(p, nullptr);
            EXPECT_EQ(std::memcmp(p, w.gate_exps.matrix(e), x.gate_bytes), 0);
            EXPECT_EQ(std::memcmp(p + x.up_offset, w.up_exps.matrix(e), x.up_bytes), 0);
            EXPECT_EQ(std::memcmp(p + x.down_offset, w.down_exps.matrix(e), x.down_bytes), 0);
        }
    }
}

TEST(ExpertStore, CpuOnlyExpertsStayInTheMappingAndRefusedPinningKeepsOnePageableCopy) {
    const auto model = Model::load(model_path("qwen3moe", "tiny-f32.gguf").string());
    FakeBackend::Config fc;
    fc.allow_host_register = false;
    FakeBackend backend(fc);
    const size_t n = size_t(model->hp().n_layer * model->hp().n_expert);
    ExpertStoreConfig c;
    c.fetchable.assign(n, 1);
    c.fetchable[0] = 0;  // layer 0, expert 0 runs on the CPU only
    ExpertStore store(*model, &backend, c);
    EXPECT_TRUE(store.pin_refused());
    EXPECT_EQ(store.pinned_bytes(), 0u);
    EXPECT_EQ(store.pageable_bytes(), uint64_t(n - 1) * store.layout(0).bytes);
    EXPECT_EQ(store.host_expert(0, 0), nullptr);
    const ExpertViews v = store.cpu_views(0, 0);
    EXPECT_EQ(v.gate.matrix(v.index), model->weights().layers[0].gate_exps.matrix(0));
    EXPECT_FALSE(backend.is_host_registered(store.host_expert(0, 1)));
}

// deepseek2's leading dense layers (decision 0134): layout of 0 bytes, nothing repacked or page-locked whatever the
// masks say; the loader leaves their row of an all-GPU placement alone.
TEST(ExpertStore, LayersWithoutExpertsAreNeitherRepackedNorPinned) {
    const auto model = Model::load(model_path("deepseekv3", "tiny-f32.gguf").string());
    const HParams &hp = model->hp();
    ASSERT_GT(hp.n_layer_dense, 0);
    FakeBackend backend;
    ExpertStore store(*model, &backend);
    const ExpertLayout &moe = store.layout(int32_t(hp.n_layer_dense));
    EXPECT_GT(moe.bytes, 0u);
    for (int32_t l = 0; l < int32_t(hp.n_layer_dense); ++l) {
        EXPECT_EQ(store.layout(l).bytes, 0u);
        EXPECT_EQ(store.layout(l).n_ff, 0);
        for (int32_t e = 0; e < store.n_experts(); ++e) EXPECT_EQ(store.host_expert(l, e), nullptr);
    }
    EXPECT_EQ(store.pinned_bytes(), uint64_t(hp.n_layer_moe() * hp.n_expert) * moe.bytes);
    const std::string moe_layers = fmt::format("{} layers x {} experts", hp.n_layer_moe(), hp.n_expert);
    EXPECT_NE(store.describe().find(moe_layers), std::string::npos) << store.describe();
    EXPECT_NE(store.describe().find("(and 1 dense layer without experts)"), std::string::npos) << store.describe();

    ExpertCacheConfig c;
    c.n_layers = int32_t(hp.n_layer);
    c.n_experts = int32_t(hp.n_expert);
    c.top_k = int32_t(hp.n_expert_used);
    c.expert_bytes = store.expert_bytes();
    c.budget_bytes = uint64_t(hp.n_layer_moe() * hp.n_expert) * ExpertCache::slot_bytes_for(c);
    ExpertCache cache(c, &backend);
    EXPECT_EQ(cache.layer_slots(0), 0);
    EXPECT_EQ(cache.n_slots(), int32_t(hp.n_layer_moe() * hp.n_expert));
    const PlacementPlan plan = PlacementPlan::cpu_layers(c.n_layers, c.n_experts, 0);  // every expert home GPU
    CopyEngine engine(backend, {});
    ExpertLoader loader(backend, cache, engine, plan, store.host_experts());
    loader.load_fixed();
    engine.drain();
    for (int32_t l = 0; l < c.n_layers; ++l) EXPECT_EQ(cache.layer_fixed(l), l < hp.n_layer_dense ? 0 : c.n_experts);
}

TEST(HybridMoe, BudgetBelowOneLayersTopKFailsWithTheMinimum) {
    const auto model = Model::load(model_path("qwen3moe", "tiny-f32.gguf").string());
    FakeBackend backend;
    ExpertStore store(*model, &backend);
    ExpertCacheConfig c;
    c.n_layers = int32_t(model->hp().n_layer);
    c.n_experts = int32_t(model->hp().n_expert);
    c.top_k = int32_t(model->hp().n_expert_used);
    c.expert_bytes = store.expert_bytes();
    c.budget_bytes = ExpertCache::min_budget_bytes(c) - 1;
    try {
        ExpertCache cache(c, &backend);
        FAIL() << "no error";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find(std::to_string(ExpertCache::min_budget_bytes(c)) + " bytes"),
                  std::string::npos)
            << e.what();
    }
}
