// One interface over the two forward passes: the CPU Context and the GPU offloading runtime
// (runtime/gpu-context.h, built with CUDA). The CLI picks one from the offload settings.
#pragma once

#include "offload/offload-config.h"
#include "offload/predictor.h"
#include "runtime/context.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace prescope {

class ExpertParallelExecutor;
class FakeAllToAll;
class OraclePredictor;
class RoutingReplay;

/// The forward pass of n_seq() sequences, each with its own KV cache of n_ctx() tokens. eval, eval_batch,
/// logits, n_past, n_ctx and clear mean what they mean on Context: eval() runs sequence 0.
class Engine {
  public:
    virtual ~Engine() = default;
    virtual void eval(std::span<const int32_t> tokens, bool all_logits = false) = 0;
    /// One forward pass over every entry's tokens together (the MoE block sees all of them).
    /// logits(): one [n_vocab] row per entry with logits == true, in entry order.
    /// Throws prescope::Error: seq out of range or listed twice, empty tokens, a token outside the
    /// vocabulary, an entry not fitting its sequence's context. Total tokens may exceed n_batch (split).
    virtual void eval_batch(std::span<const SeqTokens> batch) = 0;
    virtual const std::vector<float> &logits() const = 0;
    virtual int64_t n_seq() const = 0;
    /// n_past() == n_past(0); n_past(seq) throws prescope::Error when seq is outside [0, n_seq()).
    virtual int64_t n_past() const = 0;
    virtual int64_t n_past(int32_t seq) const = 0;
    virtual int64_t n_ctx() const = 0;
    /// clear() forgets every sequence; clear(seq) only `seq` (throws as n_past(seq)).
    virtual void clear() = 0;
    virtual void clear(int32_t seq) = 0;
    /// "cpu" or "cuda".
    virtual const char *backend_name() const = 0;
    /// Lines printed at start-up: device, expert store, cache, placement, routing source.
    virtual std::string startup_text() const = 0;
    /// The counters since the last reset_stats() (printed at exit): per-layer cache table, hit rate, PCIe
    /// GB/s, bytes per token, stall time; empty when there is nothing to count.
    virtual std::string stats_text() const = 0;
    /// The same as JSON (bench rows): at least "routing" ("router" or "replayed:<trace>").
    virtual nlohmann::json stats_json() const = 0;
    virtual void reset_stats() = 0;
};

/// The CPU Context as an Engine, with routing replay when config.routing_trace is set, and its MoE block run by the
/// expert-parallel executor over config.gpus GPUs simulated in process (runtime/expert-parallel.h) when config.gpus
/// > 1 or config.expert_groups is set. Throws prescope::Error when the groups file is unreadable or does not fit
/// the model and config.gpus.
class CpuEngine final : public Engine {
  public:
    CpuEngine(const Model &model, ContextParams params, const OffloadConfig &config);
    ~CpuEngine() override;
    void eval(std::span<const int32_t> tokens, bool all_logits = false) override { ctx_.eval(tokens, all_logits); }
    void eval_batch(std::span<const SeqTokens> batch) override { ctx_.eval_batch(batch); }
    const std::vector<float> &logits() const override { return ctx_.logits(); }
    int64_t n_seq() const override { return ctx_.n_seq(); }
    int64_t n_past() const override { return ctx_.n_past(); }
    int64_t n_past(int32_t seq) const override { return ctx_.n_past(seq); }
    int64_t n_ctx() const override { return ctx_.n_ctx(); }
    void clear() override { ctx_.clear(); }
    void clear(int32_t seq) override { ctx_.clear(seq); }
    const char *backend_name() const override { return "cpu"; }
    std::string startup_text() const override;
    std::string stats_text() const override;
    nlohmann::json stats_json() const override;
    void reset_stats() override {}
    Context &context() { return ctx_; }

  private:
    std::unique_ptr<FakeAllToAll> all_to_all_;        // the transport of expert_
    std::unique_ptr<ExpertParallelExecutor> expert_;  // null: the Context's own CPU executor
    Context ctx_;
    std::unique_ptr<RoutingReplay> replay_;
};

/// The engine the settings ask for: CpuEngine, or the GPU runtime when config.gpu. Throws prescope::Error
/// when config.gpu is set in a build without CUDA or on a machine without a CUDA device, or together with
/// config.gpus > 1 (the GPU runtime's expert-parallel layer step is not built: docs/expert-parallel.md).
std::unique_ptr<Engine> make_engine(const Model &model, ContextParams params, const OffloadConfig &config);

/// The predictor config.predictor names, for up to max_tokens tokens per call and config.prefetch_window, over
/// the model's MoE layers numbered from 0 (hp.n_layer_moe(); dense layers have no router to predict):
/// nullptr for "none"; "oracle" needs `replay` (it reads the future from the replayed trace) and is returned
/// in *oracle too. Throws prescope::Error on an unknown name, an unreadable predictor file, or one trained for
/// another shape (MoE layers, experts, top-k).
std::unique_ptr<Predictor> make_predictor(const OffloadConfig &config, const Model &model, int32_t max_tokens,
                                          const RoutingReplay *replay, OraclePredictor **oracle);

/// "replayed:<trace file name>" or "router".
std::string routing_source(const RoutingReplay *replay);

} // namespace prescope
