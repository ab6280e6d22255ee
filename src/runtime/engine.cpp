// Engine selection, the CPU engine, and the predictor factory of the offloading runtime.
#include "runtime/engine.h"

#include "core/error.h"
#include "offload/predictor-baselines.h"
#include "offload/predictor-llapor.h"
#include "runtime/expert-parallel.h"
#include "runtime/routing-replay.h"
#ifdef PRESCOPE_USE_CUDA
#include "runtime/gpu-context.h"
#endif

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>

namespace prescope {

namespace {

std::unique_ptr<ExpertParallelExecutor> make_expert_parallel(const Model &model, const ContextParams &params,
                                                             const OffloadConfig &config, FakeAllToAll *all_to_all) {
    if (!all_to_all) return nullptr;
    const HParams &hp = model.hp();
    ExpertParallelConfig ep;
    ExpertGroups groups;
    if (config.expert_groups.empty()) {
        if (config.gpus > hp.n_expert) {
            fail("--gpus {}: the model has {} experts a layer, fewer than the GPUs that would hold them", config.gpus,
                 hp.n_expert);
        }
        groups = ExpertGroups::contiguous(int32_t(hp.n_layer_moe()), int32_t(hp.n_expert), config.gpus);
    } else {
        groups = ExpertGroups::load(config.expert_groups);
        groups.check_shape(int32_t(hp.n_layer_moe()), int32_t(hp.n_expert), config.gpus, config.expert_groups);
        ep.groups_source = config.expert_groups;
    }
    // Context checks n_batch after this (a clear error for <= 0); the buffers only need a valid size here.
    return std::make_unique<ExpertParallelExecutor>(model, std::move(groups), *all_to_all,
                                                    std::max<int64_t>(params.n_batch, 1), ep);
}

} // namespace

CpuEngine::CpuEngine(const Model &model, ContextParams params, const OffloadConfig &config)
    : all_to_all_(config.gpus > 1 || !config.expert_groups.empty() ? std::make_unique<FakeAllToAll>(config.gpus)
                                                                    : nullptr),
      expert_(make_expert_parallel(model, params, config, all_to_all_.get())), ctx_(model, params, expert_.get()) {
    if (!config.routing_trace.empty()) {
        replay_ = std::make_unique<RoutingReplay>(config.routing_trace, model.hp());
        ctx_.routing_override = [r = replay_.get()](int64_t layer, Routing &routing) { r->apply(layer, routing); };
    }
}

CpuEngine::~CpuEngine() = default;

std::string CpuEngine::startup_text() const {
    return (replay_ ? replay_->describe() + "\n" : std::string()) + (expert_ ? expert_->describe() : std::string());
}

std::string CpuEngine::stats_text() const {
    return (replay_ ? fmt::format("routing: {} tokens replayed from {}\n", replay_->tokens_replayed(), replay_->path())
                    : std::string()) +
           (expert_ ? expert_->stats_text() : std::string());
}

nlohmann::json CpuEngine::stats_json() const { return {{"routing", routing_source(replay_.get())}}; }

std::string routing_source(const RoutingReplay *replay) {
    return replay ? "replayed:" + std::filesystem::path(replay->path()).filename().string() : "router";
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
    if (config.gpus > 1) {
        fail("--gpus {} with --gpu-expert-budget: the GPU runtime's expert-parallel layer step is not built yet (it "
             "needs a GpuContext per GPU, each with its hot-expert table and copy engine, and the dispatch and combine "
             "of runtime/expert-parallel.h over NcclAllToAll; no multi-GPU machine is available to test it, "
             "docs/expert-parallel.md); leave --gpu-expert-budget out to run the {} expert groups on the CPU",
             config.gpus, config.gpus);
    }
#ifdef PRESCOPE_USE_CUDA
    warn_beyond_training_context(model.hp(), params.n_ctx > 0 ? params.n_ctx : model.hp().n_ctx_train);
    return std::make_unique<GpuContext>(model, params, config);
#else
    fail("--gpu-expert-budget (gpu_cache) needs the CUDA backend, but this prescope was built without it "
         "(-DPRESCOPE_CUDA=OFF); rebuild with CUDA or leave the flag out to run on the CPU");
#endif
}

} // namespace prescope
