// The planning half of the MoE layer step, shared by the runtime (runtime/hybrid-moe.h) and the simulator
// (offload/simulator.h): routed experts -> LayerState (cache, placement, cost model, link) -> LayerPlan, by the
// cost-model scheduler (default) or by decide_layer's threshold rule (--cpu-threshold), with the load
// balancer's corrections and the optional layer-state dump.
#pragma once

#include "core/output-file.h"
#include "offload/copy-engine.h"
#include "offload/cost-model.h"
#include "offload/load-balancer.h"
#include "offload/placement.h"
#include "offload/predictor.h"
#include "offload/scheduler.h"

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace prescope {

class ExpertCache;
struct LayerStats;

struct PlannerConfig {
    int32_t cpu_threshold = -1;          // >= 0: decide_layer's threshold rule (the manual override); -1: cost
    int32_t stream_min_batch = 32;       // batches this large may stream (docs/decisions/0036)
    int32_t prefetch_window = 0;         // layers ahead the predictor scores
    int32_t prefetch_max_per_layer = 0;  // prefetches per predicted layer and step; 0 = top_k
    int32_t max_prefetch_in_flight = 8;  // prefetch requests outstanding at most (cost rule)
    int32_t residency_horizon = 256;     // most steps of a layer over which keeping an expert resident is valued
                                         // (fewer when the layer's slots turn over faster)
    LoadBalance balance = LoadBalance::LINK;  // which of the load balancer's corrections the cost model takes
    bool link_price = true;              // price speculative copies by the link's busy share (decision 0147)
    std::string dump_path;               // write every planned layer's state here (JSON lines), "" = off
};

/// PRECONDITIONS: one thread; placement and cache outlive the planner. Per layer: begin() -> (the caller
/// fills the link terms of state(): apply_link_state) -> [set_candidates()] -> plan_routed() ->
/// [set_candidates() -> plan_prefetch()] -> observe(). Allocates nothing per layer after the constructor
/// (the dump buffers its lines).
class LayerPlanner {
  public:
    /// cache may be null: no GPU cache, every expert on the CPU (the all-CPU plan).
    LayerPlanner(const PlacementPlan &placement, const ExpertCache *cache, const CostModel &cost,
                 const PlannerConfig &config, int32_t top_k);
    ~LayerPlanner();
    LayerPlanner(const LayerPlanner &) = delete;
    LayerPlanner &operator=(const LayerPlanner &) = delete;

    /// Writes the rest of the layer-state dump (PlannerConfig::dump_path) and renames it into place: the dump
    /// is an output file like any other, under a temporary name until complete (decision 0103). The destructor
    /// does this too unless an exception is unwinding (then no dump is left behind). Errors: prescope::Error
    /// naming the file on a failed write. Does nothing without a dump or a second time.
    void finish_dump();

    /// Counts the routed experts (routed: [n_tokens * top_k] ids) and builds the layer's state. Returns true
    /// when some routed expert is not on the GPU: a decision to make, so the caller predicts first.
    bool begin(int32_t layer, std::span<const int32_t> routed, int32_t n_tokens);
    LayerState &state() { return state_; }
    const LayerState &state() const { return state_; }
    /// The predictor's requests for layers l+1..l+w, scores summed over n_pred_tokens tokens (ScoringPredictor:
    /// probability per token): candidates with prob = score / n_pred_tokens (at most 1). Resident experts and
    /// CPU-only ones are left out of the state (resident ones are kept: LayerPlan protects them).
    void set_candidates(std::span<const PrefetchRequest> predicted, int32_t n_pred_tokens);
    /// Decides every routed expert (and, if candidates are set, the prefetches). Fills plan.
    void plan_routed(LayerPlan &plan);
    /// Adds the prefetches to a plan made before the candidates were known.
    void plan_prefetch(LayerPlan &plan);
    /// The plan's prediction against what happened; corrections go into the cost model.
    void observe(const LayerMeasurement &m, LayerStats &stats);

    const CostModel &cost() const { return cost_; }
    const LoadBalancer &balancer() const { return balancer_; }
    const PlannerConfig &config() const { return config_; }
    bool cost_rule() const { return config_.cpu_threshold < 0; }
    /// Predicted experts already resident: the executor keeps prefetches from evicting them.
    std::span<const PrefetchRequest> keep() const { return keep_; }
    /// The host's predictor and prefetch time per layer (a moving average the executor measures).
    void set_host_us(double us) { host_us_ = us; }

  private:
    void dump();
    /// Routing frequency of the expert the cache would give up in `layer` for a new one: 0 with a free slot,
    /// else the lowest among the resident experts not routed now.
    double victim_frequency(int32_t layer) const;
    /// What keeping one more expert of `layer` resident saves: running it elsewhere now only delays its load to
    /// its next use, so one miss, if that use comes within its expected stay (slots / experts loaded per step, at
    /// most residency_horizon steps; next step with probability `next`, later ones at its routing frequency),
    /// less the same for the victim; one miss = what it adds to a step with the layer's usual misses, the CPU
    /// and the link sharing them (min(CPU, fetch) when misses are rare, about c f / (c + f) when many).
    double install_us(int32_t layer, double next, double frequency) const;

    const PlacementPlan &placement_;
    const ExpertCache *cache_;
    CostModel cost_;
    PlannerConfig config_;
    int32_t top_k_;
    Scheduler scheduler_;
    LoadBalancer balancer_;
    LayerState state_;
    LayerDecision counted_;               // the routed experts and token counts (decide_layer's scratch too)
    std::span<const int32_t> routed_;     // the layer's ids (valid until plan_routed)
    std::vector<PrefetchRequest> threshold_prefetch_;  // the predictor's list (threshold rule)
    std::vector<PrefetchRequest> keep_;
    std::vector<float> frequency_;      // [n_layers * n_experts] moving average of "routed in a step"
    std::vector<float> reuse_;          // [n_layers] moving average of the share of last step's experts routed again
    std::vector<float> misses_;         // [n_layers] moving average of the routed experts missing per step
    std::vector<uint8_t> last_routed_;  // [n_layers * n_experts] routed in the layer's last step
    bool candidates_set_ = false;
    double host_us_ = 0;
    std::unique_ptr<OutputFile> dump_;  // the layer-state dump in the making, null when off or finished
    std::string dump_buffer_;           // its lines not yet written
    int uncaught_at_start_ = 0;         // std::uncaught_exceptions() when constructed
};

/// Fills the link terms of a state from the copy engine: chunks in flight and queued demand ahead of this
/// layer's copies, the routed experts whose copies have not landed (ARRIVING, with an arrival estimate in
/// queue order), the prefetch backlog and room, and the host's blocking slack (queue depth x chunk).
void apply_link_state(LayerState &s, const ExpertCache &cache, const CopyEngine &engine, const CostModel &cost,
                      int32_t max_prefetch_in_flight);

} // namespace prescope
