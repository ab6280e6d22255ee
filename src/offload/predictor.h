// The prefetch hook: after a layer routes, a predictor scores experts of layers l+1..l+w (prefetch_window)
// and the runtime hands the best to the hot-expert table and copy engine (ExpertLoader::prefetch).
// Predictors (frequency, Fate-style, LLaPor) live behind this interface; ScoringPredictor is the dense form
// they share with evaluation (offload/predictor-*.h, docs/predictors.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace prescope {

/// One expert a predictor wants on the GPU soon.
struct PrefetchRequest {
    int32_t layer = 0;  // a predictor's MoE layer (from 0); the model layer (+ n_layer_dense) once HybridMoe hands
                        // it to the planner and the loader (docs/decisions/0134)
    int32_t expert = 0;
    float score = 0;  // higher = more wanted; comparable within one predict() call (e.g. a probability)
};

/// A fixed-capacity list of requests, sized once; push() never allocates.
class PrefetchList {
  public:
    explicit PrefetchList(size_t capacity = 0) { items_.reserve(capacity); }
    void reserve(size_t capacity) { items_.reserve(capacity); }
    void clear() { items_.clear(); }
    /// Appends a request; false (and nothing stored) when the list is full.
    bool push(const PrefetchRequest &r) {
        if (items_.size() == items_.capacity()) return false;
        items_.push_back(r);
        return true;
    }
    /// Highest score first; ties by layer, then expert, so the order is deterministic.
    void sort_by_score() {
        std::sort(items_.begin(), items_.end(), [](const PrefetchRequest &a, const PrefetchRequest &b) {
            if (a.score != b.score) return a.score > b.score;
            return a.layer != b.layer ? a.layer < b.layer : a.expert < b.expert;
        });
    }
    std::span<const PrefetchRequest> items() const { return items_; }
    /// Adds `offset` to every request's layer (a predictor's MoE layers -> model layers).
    void offset_layers(int32_t offset) {
        for (PrefetchRequest &r : items_) r.layer += offset;
    }
    size_t size() const { return items_.size(); }
    size_t capacity() const { return items_.capacity(); }

  private:
    std::vector<PrefetchRequest> items_;
};

/// What a predictor sees after layer `layer` has routed its tokens. Predictors number the MoE layers from 0, as
/// traces do: a model's leading dense layers (no router) are not among them (docs/decisions/0134).
struct PredictorInput {
    int32_t layer = 0;                 // the MoE layer that just routed (model layer - n_layer_dense)
    int32_t n_layers = 0;              // MoE layers in the model
    int32_t window = 1;                // prefetch_window w: predict layers layer+1 .. min(layer+w, n_layers-1)
    std::span<const int32_t> routed;   // [n_tokens * top_k] expert ids this layer routed to
    int32_t n_tokens = 0;
    int32_t top_k = 0;
    const float *hidden = nullptr;     // [n_tokens][n_embd] F32 input of this layer's router, or null
    int64_t n_embd = 0;
};

/// PRECONDITIONS: called on the runtime thread, once per layer per step, layers in increasing order within
/// a step. predict() must not allocate and should take well under one layer's attention time (issue 5
/// targets 50 us per layer).
class Predictor {
  public:
    virtual ~Predictor() = default;
    virtual const char *name() const = 0;
    /// Appends scored experts of layers in.layer+1 .. in.layer+in.window to `out` (stopping when it is
    /// full). Experts already on the GPU may be included; the loader skips them.
    virtual void predict(const PredictorInput &in, PrefetchList &out) = 0;
    /// A new sequence starts: forget history.
    virtual void reset() {}
};

/// `--predictor none`: never prefetches (demand loads and the CPU only).
class NoPredictor final : public Predictor {
  public:
    const char *name() const override { return "none"; }
    void predict(const PredictorInput &, PrefetchList &) override {}
};

/// Shape of the model a predictor serves.
struct PredictorShape {
    int32_t n_layers = 0;   // MoE layers
    int32_t n_experts = 0;  // routed experts per layer
    int32_t top_k = 0;      // experts per token
};

/// A predictor that scores every expert of every predicted layer for every token (the dense form that
/// evaluation reads, docs/predictors.md); predict() turns the scores into prefetch requests.
class ScoringPredictor : public Predictor {
  public:
    /// max_tokens: the most tokens one call carries; max_window: the largest prefetch_window. Sizes the
    /// scratch used by predict() once.
    ScoringPredictor(PredictorShape shape, int32_t max_tokens, int32_t max_window);
    const PredictorShape &shape() const { return shape_; }
    /// True when score() reads PredictorInput::hidden (and fails without it).
    virtual bool needs_hidden() const { return false; }
    /// Writes scores[d-1][t][e] for d = 1..in.window, token t < in.n_tokens, expert e < n_experts: how likely
    /// token t routes to expert e at layer in.layer + d (probability-like, in [0, 1]; only the order within
    /// one (d, t) row matters to the metrics). Rows of layers past the last are left untouched. Must be called
    /// once per layer in increasing layer order within a step (predictors with history update it here).
    /// scores.size() >= in.window * in.n_tokens * n_experts.
    virtual void score(const PredictorInput &in, std::span<float> scores) = 0;
    /// Sums the scores over the tokens of each predicted layer and appends, per layer, the experts with the
    /// highest sums (at most max(top_k, n_tokens * top_k) of them, never more than n_experts), score = sum.
    void predict(const PredictorInput &in, PrefetchList &out) override;

  protected:
    PredictorShape shape_;

  private:
    std::vector<float> scratch_;   // [max_window][max_tokens][n_experts]
    std::vector<int32_t> order_;   // [n_experts]
    std::vector<float> sums_;      // [n_experts]
};

} // namespace prescope
