// Routing-trace replay (--routing-trace FILE): each layer takes its experts and gate weights from a recorded
// trace (docs/trace-format.md) instead of the router, so a random-weight model of a real shape routes like a
// trained one in benchmarks. Works as a routing_override hook of either engine.
#pragma once

#include "offload/trace.h"
#include "runtime/moe.h"

#include <cstdint>
#include <string>

namespace prescope {

/// Layers are model layers: MoE layer il (hp.has_experts) replays trace layer il - hp.n_layer_dense, so a trace
/// of MoE layers only fits any model with as many MoE layers, experts and top-k, whatever its dense layers
/// (docs/decisions/0134). PRECONDITIONS: apply() is called for every MoE layer of every forward pass, layers in
/// increasing order.
class RoutingReplay {
  public:
    /// Reads the trace (offload/trace.h read_trace) and checks it fits the model: trace layers = the model's
    /// MoE layers (hp.n_layer_moe()), same experts and top-k. Throws prescope::Error naming the file, the
    /// trace's counts and the model's.
    RoutingReplay(const std::string &path, const HParams &hp);

    /// Replaces r's ids and weights (r.n_tok tokens) with those of the trace tokens at the cursor at model layer
    /// `layer` (a MoE layer, asserted), wrapping around at the trace's end; weights are the trace's 8-bit gate
    /// weights q / 255. The cursor moves past the batch after the last layer. Never allocates (r's vectors
    /// already hold n_tok x k entries).
    void apply(int64_t layer, Routing &r);
    /// The ids apply(layer, r) gives a batch of n_tok tokens now at model layer `layer` (a MoE layer, asserted):
    /// ids [n_tok][top_k] (the cursor stays).
    void peek_ids(int64_t layer, int64_t n_tok, int32_t *ids) const;
    /// The weights apply(layer, r) gives that batch: [n_tok][top_k] F32 (the cursor stays).
    void peek_weights(int64_t layer, int64_t n_tok, float *weights) const;
    /// Flat trace index of the first token of the batch being replayed.
    int64_t cursor() const { return cursor_; }
    int64_t tokens_replayed() const { return replayed_; }
    const RoutingTrace &trace() const { return trace_; }
    const std::string &path() const { return path_; }
    /// "routing: REPLAYED from FILE (T tokens of S sequences, model M; the router's choices are ignored)".
    std::string describe() const;

  private:
    std::string path_;
    RoutingTrace trace_;
    int64_t n_layer_ = 0;      // model layers
    int64_t first_layer_ = 0;  // model layer of trace layer 0 (hp.n_layer_dense)
    int64_t cursor_ = 0;
    int64_t replayed_ = 0;
};

} // namespace prescope
