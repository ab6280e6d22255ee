// RoutingReplay: trace tokens in order, wrapping, as the routing of each layer.
#include "runtime/routing-replay.h"

#include "core/error.h"

#include <fmt/format.h>

namespace prescope {

RoutingReplay::RoutingReplay(const std::string &path, const HParams &hp) : path_(path), trace_(read_trace(path)) {
    if (trace_.n_layer != hp.n_layer_moe() || trace_.n_expert != hp.n_expert || trace_.top_k != hp.n_expert_used) {
        const std::string dense = hp.n_layer_dense > 0
                                      ? fmt::format(" (of {} layers; the first {} dense)", hp.n_layer, hp.n_layer_dense)
                                      : "";
        fail("{}: the trace routes {} MoE layers x {} experts, top-{}; the model has {} MoE layers{} x {}, top-{}",
             path, trace_.n_layer, trace_.n_expert, trace_.top_k, hp.n_layer_moe(), dense, hp.n_expert,
             hp.n_expert_used);
    }
    if (trace_.n_tokens() == 0) fail("{}: the trace holds no tokens", path);
    n_layer_ = hp.n_layer;
    first_layer_ = hp.n_layer_dense;
}

void RoutingReplay::apply(int64_t layer, Routing &r) {
    const int64_t k = trace_.top_k;
    PRESCOPE_ASSERT(r.k == k && r.ids.size() >= size_t(r.n_tok * k) && r.weights.size() >= size_t(r.n_tok * k));
    peek_ids(layer, r.n_tok, r.ids.data());
    peek_weights(layer, r.n_tok, r.weights.data());
    if (layer == n_layer_ - 1) {
        cursor_ = (cursor_ + r.n_tok) % trace_.n_tokens();
        replayed_ += r.n_tok;
    }
}

void RoutingReplay::peek_ids(int64_t layer, int64_t n_tok, int32_t *ids) const {
    PRESCOPE_ASSERT(layer >= first_layer_ && layer < n_layer_);
    const int64_t k = trace_.top_k, n = trace_.n_tokens();
    for (int64_t t = 0; t < n_tok; ++t) {
        const uint8_t *src = trace_.ids((cursor_ + t) % n, int32_t(layer - first_layer_));
        for (int64_t j = 0; j < k; ++j) ids[t * k + j] = src[j];
    }
}

void RoutingReplay::peek_weights(int64_t layer, int64_t n_tok, float *weights) const {
    PRESCOPE_ASSERT(layer >= first_layer_ && layer < n_layer_);
    const int64_t k = trace_.top_k, n = trace_.n_tokens();
    for (int64_t t = 0; t < n_tok; ++t) {
        const uint8_t *q = trace_.gates((cursor_ + t) % n, int32_t(layer - first_layer_));
        for (int64_t j = 0; j < k; ++j) weights[t * k + j] = float(q[j]) / float(RoutingTrace::GATE_WEIGHT_SCALE);
    }
}

std::string RoutingReplay::describe() const {
    return fmt::format("routing: REPLAYED from {} ({} tokens of {} sequences, model '{}'; the router's choices are "
                       "ignored)",
                       path_, trace_.n_tokens(), trace_.sequences.size(), trace_.model);
}

} // namespace prescope
