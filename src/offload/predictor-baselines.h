// Training-free expert predictors: frequency/recency (per-layer popularity), Fate-style (the next layers'
// routers applied to the current router input) and the oracle (the future, read from a trace).
#pragma once

#include "offload/predictor.h"
#include "offload/trace.h"

#include <string>
#include <vector>

namespace prescope {

class Model;

/// Per-token decay of `recency`'s popularity counts: the runtime's `--predictor recency` and eval-predictor's
/// default (its --decay overrides it there).
inline constexpr double kRecencyDecay = 0.99;

/// `--predictor frequency` (decay 1) and `recency` (decay < 1): per-layer popularity counts c[l][e] over every
/// token seen so far, each count multiplied by `decay` per token; score = c / max_e c. Counts survive reset()
/// (popularity is a property of the model, not of one sequence). Before any token: all scores 0.
class FrequencyPredictor final : public ScoringPredictor {
  public:
    FrequencyPredictor(PredictorShape shape, double decay, int32_t max_tokens = 1, int32_t max_window = 8);
    const char *name() const override { return decay_ < 1.0 ? "recency" : "frequency"; }
    void score(const PredictorInput &in, std::span<float> scores) override;

  private:
    double decay_;
    std::vector<double> counts_;  // [n_layers][n_experts]
    std::vector<double> maxc_;    // [n_layers] largest count of the layer
};

/// `--predictor fate`: Fate (arXiv 2502.12224) predicts layer l+d's experts by applying layer l+d's router
/// (ffn_gate_inp) to layer l's router input; score = the softmax probability. Needs PredictorInput::hidden.
class FatePredictor final : public ScoringPredictor {
  public:
    /// routers: [n_layers][n_experts * dim] F32 router matrices of the MoE layers, row e = expert e's gate
    /// vector.
    FatePredictor(PredictorShape shape, int64_t dim, std::vector<std::vector<float>> routers,
                  int32_t max_tokens = 1, int32_t max_window = 8);
    /// The router matrices of a loaded model: ffn_gate_inp (any supported dtype, as F32) of its MoE layers
    /// hp.n_layer_dense .. n_layer-1, [n_layer_moe], the predictors' layer numbering (docs/decisions/0134).
    static std::vector<std::vector<float>> read_routers(const Model &model);
    /// The router matrices from an HF safetensors file: tensors [model.]layers.{first_layer + l}.mlp.gate.weight
    /// for l < n_layers, of shape [n_experts][dim] in F32, F16 or BF16 (as traces/topo-routers.safetensors holds
    /// them); first_layer: the model layer of the first MoE layer (RoutingTrace::first_moe_layer). Throws
    /// prescope::Error naming the file and tensor on a missing tensor, wrong shape or dtype, or bad offsets.
    static std::vector<std::vector<float>> read_routers_safetensors(const std::string &path, int32_t first_layer,
                                                                     int32_t n_layers, int32_t n_experts, int64_t dim);
    const char *name() const override { return "fate"; }
    bool needs_hidden() const override { return true; }
    void score(const PredictorInput &in, std::span<float> scores) override;

  private:
    int64_t dim_;
    std::vector<std::vector<float>> routers_;
};

/// `--predictor oracle`: the upper bound. Reads the routing of the token at the cursor from a trace: score 1
/// for the experts the token really uses at layer l+d, 0 otherwise. Only for n_tokens == 1 (trace order).
class OraclePredictor final : public ScoringPredictor {
  public:
    explicit OraclePredictor(const RoutingTrace &trace, int32_t max_window = 8);
    const char *name() const override { return "oracle"; }
    /// The flat trace index of the token the next score() calls are about.
    void set_token(int64_t token) { token_ = token; }
    void score(const PredictorInput &in, std::span<float> scores) override;

  private:
    const RoutingTrace &trace_;
    int64_t token_ = 0;
};

} // namespace prescope
