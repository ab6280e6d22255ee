// PreSched, the per-layer planner: from the routed experts with their token counts and costs, the cache
// state, the copies in flight and the predictor's scores for layers l+1..l+w, a LayerPlan (plain data):
// HIT / FETCH / STREAM / CPU for each routed expert and which predicted experts to PREFETCH, in what order.
// It minimises the layer's critical path (the GPU chain with the arrivals of its copies against the CPU
// chain) plus the expected stall of the next layers. The same problem, solved exactly, is
// offload/schedule-ilp.h; the timing model both use is evaluate_plan(). Decision: docs/decisions/0080.
#pragma once

#include "offload/placement.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace prescope {

class CostModel;
class ExpertCache;

/// Where a routed expert's bytes are when the layer starts.
enum class SchedResidency : uint8_t {
    RESIDENT,  // in a GPU slot, landed
    ARRIVING,  // in a GPU slot, its copy queued or in flight (promoted to demand by the loader)
    MISSING,   // not on the GPU
};

/// One routed expert of the running layer. Times are the cost model's, microseconds.
struct SchedExpert {
    int32_t expert = 0;
    int32_t n_tokens = 0;
    SchedResidency where = SchedResidency::MISSING;
    ExecSite site = ExecSite::AUTO;  // placement: GPU never runs on the CPU, CPU is never fetched
    double gpu_us = 0;               // compute on the GPU (inside a grouped launch)
    double cpu_us = 0;               // compute on the CPU
    double fetch_us = 0;             // copy to a slot
    double arrival_us = 0;           // ARRIVING: when its bytes land, from the layer's start
    double install_us = 0;           // MISSING: what leaving it resident saves later steps, if it runs on the GPU
};

/// An expert the predictor expects at layer `layer` = running layer + distance, not on the GPU.
struct SchedCandidate {
    int32_t layer = 0;
    int32_t expert = 0;
    int32_t distance = 1;  // 1..window
    double prob = 0;       // chance it is routed there, in [0, 1]
    double fetch_us = 0;   // copy to a slot
    double miss_us = 0;    // what a miss would add to that layer: min(CPU, fetch + GPU) - GPU
    double install_us = 0; // what having it resident saves later steps (whether or not it lands in time)
};

/// Everything the planner reads for one layer and batch: plain numbers (dumped and replayed by
/// `prescope schedule-check`). Times are microseconds from the moment the layer's routing is known.
struct LayerState {
    int32_t layer = 0;
    int32_t n_tokens = 0;           // tokens in the batch
    int32_t free_slots = 0;         // slots a FETCH may take now (layer slots - fixed - routed resident/arriving)
    int32_t wave_slots = 0;         // slots a streamed wave may use (layer slots - fixed); 0 = no GPU cache
    bool stream = false;            // the batch is large enough to stream (stream_min_batch)
    double link_free_us = 0;        // when new demand copies can start (chunks in flight, promoted copies ahead)
    double issue_slack_us = 0;      // the host stops blocking on a copy this long before it lands (queue depth)
    double host_us = 0;             // host work before the CPU experts start (predictor, prefetch submission)
    double wave_us = 0;             // one grouped GPU launch
    double cpu_layer_us = 0;        // fixed CPU cost of a layer with CPU experts
    double prefetch_backlog_us = 0; // queued prefetch copies a new prefetch waits behind
    double next_layer_us = 0;       // from one layer's experts to the next layer's (attention, router)
    double moe_estimate_us = 0;     // a layer's expert part, as measured recently (deadlines beyond l+1)
    int32_t prefetch_room = 0;      // new prefetch requests allowed (copies in flight cap)
    double link_price = 0;          // critical-path us one us of link time costs, in [0, 1]: the square of the
                                    // link's recent busy share (0 = idle: copies delay nothing; 1 = saturated)
    std::vector<int32_t> next_free; // [window] slots of layer l+d a prefetch may take (evictable, not wanted)
    std::vector<SchedExpert> routed;        // ascending expert id
    std::vector<SchedCandidate> candidates; // any order

    nlohmann::json to_json() const;
    /// Throws prescope::Error naming `source` on a malformed state.
    static LayerState from_json(const nlohmann::json &j, const std::string &source);
};

/// A prefetch of the plan, in priority order.
struct PlannedPrefetch {
    int32_t layer = 0;
    int32_t expert = 0;
    double prob = 0;
    double arrival_us = 0;  // predicted, from the layer's start
    double needed_us = 0;   // deadline: when layer `layer` is expected to need it
    int32_t slot = -1;      // filled when executed (the cache's victim among unprotected slots)
    int32_t candidate = -1; // index into LayerState::candidates, or -1 for an install
    int32_t routed = -1;    // an install: index into LayerState::routed of a CPU-run expert copied behind the
                            // layer's work, so that it is resident for later steps
};

/// Predicted times of a plan (evaluate_plan), microseconds from the layer's start.
struct PlanTimes {
    double gpu_end_us = 0;     // last GPU wave done
    double cpu_end_us = 0;     // last CPU expert done
    double link_end_us = 0;    // last demand copy landed
    double critical_us = 0;    // max(gpu_end, cpu_end): the layer's critical path
    double next_stall_us = 0;  // expected stall of layers l+1..l+w (sum over candidates of prob x miss)
    double residency_us = 0;   // what the experts this plan leaves resident save later steps (install_us)
    double link_cost_us = 0;   // link_price x the link time of the plan's speculative copies (prefetches and
                               // installs): what they take from the token's other copies (decision 0147)
    double objective() const { return critical_us + next_stall_us - residency_us + link_cost_us; }
};

/// What the executor does for one layer: the routed experts' actions (as the loader reads them), the split
/// mode, the prefetches and what the model predicts.
struct LayerPlan {
    LayerDecision decision;                // per routed expert: HIT / FETCH / STREAM / CPU
    bool split = false;                    // CPU experts run before the FETCH wave launches (see evaluate_plan)
    std::vector<PlannedPrefetch> prefetch; // issue in this order
    PlanTimes predicted;
    const char *rule = "cost";             // "cost" (the scheduler) or "threshold" (--cpu-threshold)

    void reserve(int32_t n_experts, int32_t max_prefetch);
    /// decision.describe() plus the prefetches and the predicted times.
    std::string describe() const;
};

/// The timing model of one layer under the executor's step order (runtime/moe-executor.h):
///  - HIT experts and, unless the plan splits, the FETCH experts form wave 0; its launch waits for their
///    copies. The host blocks until the last of them is issued, i.e. until issue_slack_us before it lands.
///  - split (CPU and FETCH experts, no STREAM): wave 0 holds only the hits; the CPU experts run while the
///    FETCH copies travel; the FETCH wave launches after both.
///  - STREAM experts go in waves of wave_slots, in ascending id; each wave's copies wait for the wave before
///    to finish (its slots), each launch waits for its copies and for the CPU experts (host order).
///  - copies: ARRIVING ones land at their arrival_us, then the FETCH copies in ascending id from
///    link_free_us, then the streamed waves'.
///  - CPU chain: from host_us (or from when the host stops blocking), cpu_layer_us + the CPU experts.
///  - prefetches: in plan order after the last demand copy and the backlog; a candidate not in the plan
///    (or one arriving after its deadline) counts prob x miss_us as expected stall.
///  - link cost: link_price x the fetch_us of every prefetch and install. Demand copies are not priced: their
///    queueing is in link_free_us and their time in the critical path already.
///  - residency: the last wave_slots of the layer's loads in ascending id (FETCH then STREAM: all of them when
///    nothing streams; each load evicts the least recent), every planned prefetch, and every install (a CPU-run expert copied
///    at prefetch priority after the candidates, in a layer that does not stream) stay resident for later
///    steps: their install_us are credited (objective = critical + stall - residency).
/// Requires s.routed and d.experts to list the same experts in the same order.
PlanTimes evaluate_plan(const LayerState &s, const LayerDecision &d, bool split,
                        const std::vector<PlannedPrefetch> &prefetch);

/// The deadline of a candidate at `distance`: a decision-independent lower bound of this layer's end (the
/// hits' wave) + distance x next_layer_us + (distance - 1) x moe_estimate_us.
double prefetch_deadline_us(const LayerState &s, int32_t distance);

/// The executor's mode for a decision: CPU and FETCH experts and no STREAM ones.
bool plan_splits(const LayerDecision &d);

/// Candidates in the order prefetches are considered and issued (the heuristic's and the ILP's): prob x
/// miss_us + install_us descending, then layer, then expert. Fills `order` with indices into s.candidates.
void candidate_priority_order(const LayerState &s, std::vector<int32_t> &order);

struct SchedulerConfig {
    int32_t max_prefetch_in_flight = 8;  // prefetch requests outstanding at most (4-8 keeps the link busy)
};

/// The online heuristic. For m = 0, 1, ... it sends the m missed experts with the most CPU time to the GPU
/// (FETCH while free slots last, then STREAM in large batches) and the rest to the CPU, adds prefetches
/// greedily in priority order (each one whose gain is positive: prob x miss_us if it lands before its deadline,
/// plus install_us, less link_price x fetch_us), evaluates each with evaluate_plan and keeps the best objective; a last pass tries moving
/// single experts between the CPU and the GPU, and exchanges in small layers. O(n^2) evaluations for n missed
/// experts. Allocates nothing after reserve().
class Scheduler {
  public:
    explicit Scheduler(SchedulerConfig config = {}) : config_(config) {}
    /// Sizes the scratch for up to n_experts routed experts and max_candidates predictions.
    void reserve(int32_t n_experts, int32_t max_candidates);
    /// Fills `out` (out.reserve() called) for the state.
    void plan(const LayerState &s, LayerPlan &out);
    /// Replaces p's prefetches by the greedy choice for its decision (candidates known after p was made).
    void plan_prefetch(const LayerState &s, LayerPlan &p);
    const SchedulerConfig &config() const { return config_; }

  private:
    void add_prefetches(const LayerState &s, LayerPlan &p, double link_end_us);
    void add_installs(const LayerState &s, LayerPlan &p);
    double evaluate(const LayerState &s, LayerPlan &p);

    SchedulerConfig config_;
    std::vector<int32_t> order_;       // routed indices of the missed AUTO experts, most tokens first
    std::vector<uint8_t> gpu_;         // [routed] scratch: 1 = runs on the GPU
    std::vector<int32_t> cand_order_;  // candidate indices by priority
    std::vector<int32_t> left_;        // [window] scratch: slots left per predicted layer
    std::vector<int32_t> installs_;    // scratch: CPU-run missed experts by install value
    std::vector<double> gains_;        // scratch: gain of each entry of the plan's prefetch list
    LayerPlan best_, trial_;
};

/// Fills a LayerDecision (the loader's input) from per-routed-expert GPU/CPU choices: RESIDENT and ARRIVING
/// experts are HIT; the GPU-run missed ones are FETCH up to free_slots in ascending id, then STREAM.
void decision_from_choice(const LayerState &s, const std::vector<uint8_t> &gpu, LayerDecision &d);

/// The decision decide_layer's threshold rule makes for the same state (STREAM when the batch streams,
/// else CPU for those beyond the free slots), for comparisons.
void threshold_decision(const LayerState &s, int32_t cpu_threshold, LayerDecision &d);

/// Builds the state of the running layer from the runtime: the routed experts' token counts (decision
/// d's experts and tokens, as decide_layer counted them), the cache, the placement and the cost model.
/// Link and host terms (link_free_us, arrivals, backlog, host_us, moe_estimate_us) are the caller's.
void layer_state_from_cache(int32_t layer, int32_t n_tokens, const LayerDecision &counted, const ExpertCache &cache,
                            const PlacementPlan &placement, const CostModel &cost, int32_t stream_min_batch,
                            LayerState &s);

} // namespace prescope
