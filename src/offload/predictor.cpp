// ScoringPredictor: per-token expert scores -> prefetch requests for the runtime (offload/predictor.h).
#include "offload/predictor.h"

#include "core/error.h"

#include <numeric>

namespace prescope {

ScoringPredictor::ScoringPredictor(PredictorShape shape, int32_t max_tokens, int32_t max_window)
    : shape_(shape), scratch_(size_t(std::max(max_window, 1)) * size_t(std::max(max_tokens, 1)) * size_t(shape.n_experts)),
      order_(size_t(shape.n_experts)), sums_(size_t(shape.n_experts)) {
    if (shape.n_layers < 1 || shape.n_experts < 1 || shape.top_k < 1 || shape.top_k > shape.n_experts) {
        fail("predictor: bad model shape ({} layers, {} experts, top-{})", shape.n_layers, shape.n_experts, shape.top_k);
    }
}

void ScoringPredictor::predict(const PredictorInput &in, PrefetchList &out) {
    const int32_t E = shape_.n_experts;
    if (size_t(in.window) * size_t(in.n_tokens) * size_t(E) > scratch_.size()) {
        fail("predictor {}: {} tokens x window {} exceed the sizes it was built for", name(), in.n_tokens, in.window);
    }
    score(in, scratch_);
    const int32_t per_layer = std::min(E, std::max(shape_.top_k, in.n_tokens * shape_.top_k));
    for (int32_t d = 1; d <= in.window && in.layer + d < shape_.n_layers; ++d) {
        std::fill(sums_.begin(), sums_.end(), 0.0f);
        for (int32_t t = 0; t < in.n_tokens; ++t) {
            const float *row = scratch_.data() + (size_t(d - 1) * size_t(in.n_tokens) + size_t(t)) * size_t(E);
            for (int32_t e = 0; e < E; ++e) sums_[size_t(e)] += row[e];
        }
        std::iota(order_.begin(), order_.end(), 0);
        std::partial_sort(order_.begin(), order_.begin() + per_layer, order_.end(), [&](int32_t a, int32_t b) {
            return sums_[size_t(a)] != sums_[size_t(b)] ? sums_[size_t(a)] > sums_[size_t(b)] : a < b;
        });
        for (int32_t i = 0; i < per_layer; ++i) {
            const int32_t e = order_[size_t(i)];
            if (sums_[size_t(e)] <= 0.0f) break;  // no opinion: do not ask for bytes
            if (!out.push({in.layer + d, e, sums_[size_t(e)]})) return;
        }
    }
}

} // namespace prescope
