// Engine selection, the CPU engine, and the predictor factory of the offloading runtime.
#include "runtime/engine.h"

#include "core/error.h"
#include "offload/predictor-baselines.h"
#include "offload/predictor-llapor.h"
#include "runtime/routing-replay.h"
#ifdef PRESCOPE_USE_CUDA
#include "runtime/gpu-context.h"
#endif

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <filesystem>

namespace prescope {

CpuEngine::CpuEngine(const Model &model, ContextParams params, const OffloadConfig &config) : ctx_(model, params) {
    if (!config.routing_trace.empty()) {
        replay_ = std::make_unique<RoutingReplay>(config.routing_trace, model.hp());
        ctx_.routing_override = [r = replay_.get()](int64_t layer, Routing &routing) { r->apply(layer, routing); };
    }
}

CpuEngine::~CpuEngine() = default;

std::string CpuEngine::startup_text() const {
    return replay_ ? replay_->describe() + "\n" : std::string();
}

std::string CpuEngine::stats_text() const {
    return replay_ ? fmt::format("routing: {} tokens replayed from {}\n", replay_->tokens_replayed(), replay_->path())
                   : std::string();
}

nlohmann::json CpuEngine::stats_json() const { return {{"routing", routing_source(replay_.get())}}; }

std::string routing_source(const RoutingReplay *replay) {
    return replay ? "replayed:" + std::filesystem::path(replay->path()).filename().string() : "router";
}

std::vector<std::string> gpu_missing_features(const HParams &hp) {
    // The GPU layer step runs plain GQA attention (q/k/v biases, q/k norms) with unscaled RoPE and an MoE block
    // of softmax routing and SwiGLU experts, with a sigmoid-gated shared expert, in every layer.
    std::vector<std::string> missing;
    if (hp.mla) missing.emplace_back("MLA attention");
    if (hp.attn_sinks) missing.emplace_back("attention sinks");
    if (hp.n_swa > 0) missing.emplace_back("sliding-window attention");
    if (hp.rope_yarn) missing.emplace_back("YaRN RoPE");
    if (hp.attn_out_bias) missing.emplace_back("the attention output bias");
    if (hp.n_layer_dense > 0) missing.emplace_back("dense layers");
    if (hp.expert_gating == ExpertGating::SIGMOID) missing.emplace_back("sigmoid routing");
    if (hp.expert_gating == ExpertGating::SOFTMAX_WEIGHT) missing.emplace_back("softmax over the top-k logits");
    if (hp.n_expert_group > 1) missing.emplace_back("group-limited routing");
    if (hp.shared_expert && !hp.shared_expert_gate) missing.emplace_back("ungated shared experts");
    if (hp.moe_bias) missing.emplace_back("router and expert biases");
    if (hp.expert_act == ExpertAct::SWIGLU_OAI) missing.emplace_back("the clamped SwiGLU (swiglu_oai)");
    return missing;
}

void check_gpu_runs(const Model &model) {
    const std::vector<std::string> missing = gpu_missing_features(model.hp());
    if (!missing.empty()) {
        fail("{}: the GPU runtime does not run architecture '{}' yet ({}); leave --gpu-expert-budget (gpu_cache) out "
             "to run it on the CPU", model.file().path(), model.hp().arch, fmt::join(missing, ", "));
    }
}

std::unique_ptr<Predictor> make_predictor(const OffloadConfig &config, const Model &model, int32_t max_tokens,
                                          const RoutingReplay *replay, OraclePredictor **oracle) {
    const HParams &hp = model.hp();
    const PredictorShape shape{int32_t(hp.n_layer_moe()), int32_t(hp.n_expert), int32_t(hp.n_expert_used)};
    const int32_t window = std::max(config.prefetch_window, 1);
    const std::string &name = config.predictor;
    if (oracle) *oracle = nullptr;
    if (name == "none") return nullptr;
    if (name == "frequency" || name == "recency") {
        return std::make_unique<FrequencyPredictor>(shape, name == "recency" ? kRecencyDecay : 1.0, max_tokens, window);
    }
    if (name == "fate") {
        return std::make_unique<FatePredictor>(shape, hp.n_embd, FatePredictor::read_routers(model), max_tokens,
                                               window);
    }
    if (name == "oracle") {
        if (!replay) fail("--predictor oracle reads the future from the replayed trace: pass --routing-trace FILE");
        auto p = std::make_unique<OraclePredictor>(replay->trace(), window);
        if (oracle) *oracle = p.get();
        return p;
    }
    if (!std::filesystem::exists(name)) {
        fail("--predictor {}: expected none, frequency, recency, fate, oracle or a predictor file", name);
    }
    std::unique_ptr<ScoringPredictor> p = load_llapor(name, max_tokens);
    const PredictorShape &s = p->shape();
    if (s.n_layers != shape.n_layers || s.n_experts != shape.n_experts || s.top_k != shape.top_k) {
        fail("--predictor {}: trained for {} MoE layers x {} experts, top-{}; the model has {} x {}, top-{}", name,
             s.n_layers, s.n_experts, s.top_k, shape.n_layers, shape.n_experts, shape.top_k);
    }
    return p;
}

std::unique_ptr<Engine> make_engine(const Model &model, ContextParams params, const OffloadConfig &config) {
    if (!config.gpu) return std::make_unique<CpuEngine>(model, params, config);
#ifdef PRESCOPE_USE_CUDA
    warn_beyond_training_context(model.hp(), params.n_ctx > 0 ? params.n_ctx : model.hp().n_ctx_train);
    return std::make_unique<GpuContext>(model, params, config);
#else
    fail("--gpu-expert-budget (gpu_cache) needs the CUDA backend, but this prescope was built without it "
         "(-DPRESCOPE_CUDA=OFF); rebuild with CUDA or leave the flag out to run on the CPU");
#endif
}

} // namespace prescope
