// Evaluation of expert predictors on a routing trace: recall@k, precision@k and exact top-k match per distance
// and layer group, and the hot-expert table's hit rate when the predictions drive prefetching.
#pragma once

#include "offload/eviction-policy.h"
#include "offload/predictor.h"
#include "offload/trace.h"

#include <nlohmann/json.hpp>

#include <span>
#include <string>
#include <vector>

namespace prescope {

struct EvalOptions {
    int32_t window = 3;                // distances 1..window
    int32_t k_pred = 0;                // size of the predicted set (0: the trace's top_k)
    std::vector<int32_t> group_start;  // layer groups for the report ([0, a, b]: input, middle, output)
    int32_t cache_slots = 0;           // hot-expert table slots per layer for the replay (0: no replay)
    EvictionPolicyKind policy = EvictionPolicyKind::LRU;
    int32_t prefetch_per_layer = 0;    // experts prefetched per predicted layer (0: the trace's top_k)
};

/// Sums over (token, source layer) for one (distance, target layer) cell.
struct EvalCell {
    double recall = 0;      // sum of |P ∩ A| / |A|
    double precision = 0;   // sum of |P ∩ A| / |P| over predictions with |P| > 0
    int64_t exact = 0;      // predictions with P == A (as sets)
    int64_t n = 0;          // predictions scored
    int64_t n_nonempty = 0; // of those, with |P| > 0
};

struct EvalResult {
    std::string predictor, trace;
    int32_t n_layers = 0, window = 0, k_pred = 0, top_k = 0;
    std::vector<int32_t> group_start;
    int64_t n_tokens = 0;                // tokens scored
    std::vector<EvalCell> cells;         // [window][n_layers] by distance d-1 and target layer
    // Cache replay (when cache_slots > 0).
    int32_t cache_slots = 0;
    std::string policy;
    double hit_rate = -1, prefetch_hit_share = 0;
    double belady_hit_rate = -1;         // offline optimum of a demand-only cache of the same slots (belady_hit_rate())
    uint64_t prefetch_loads = 0, demand_misses = 0, accesses = 0;

    /// Aggregate of distance d over target layers in [first, last).
    EvalCell sum(int32_t d, int32_t first, int32_t last) const;
    /// Rows {predictor, trace, distance, layer_group (all/input/middle/output), recall_at_k, precision_at_k,
    /// exact_match, n}, per-layer recall, and the cache block.
    nlohmann::json to_json() const;
    /// A table: one row per distance and layer group, then the cache line.
    std::string table() const;
};

/// Replays `t` token by token (decode order; reset() at each sequence start), calling `p` after each layer
/// routes with that token's routing (and router input from `hidden`, when given), and scores the top k_pred
/// experts of each layer l+d (d <= window) against the experts the token really used there. With a sidecar,
/// only the tokens it covers are replayed (so every predictor is judged on the same tokens; a sequence's
/// history then starts at its first covered token).
/// p == nullptr evaluates `none` (no predictions). An OraclePredictor is pointed at each token first.
/// With cache_slots, an ExpertCache (bookkeeping only) is replayed alongside: each layer acquires its routed
/// experts as the runtime does (ExpertLoader::begin_layer: ascending ids, the resident ones before any load), then
/// the predictor's top prefetch_per_layer experts of each predicted layer are prefetched; the offline optimum of the
/// same replay (belady_hit_rate) is reported beside it.
EvalResult evaluate_predictor(ScoringPredictor *p, const RoutingTrace &t, const HiddenTrace *hidden,
                              const EvalOptions &opt, const std::string &trace_name);

/// Hit rate of the offline optimum (Belady's MIN, 1966) for per-layer caches of slots_per_layer experts replaying
/// the given trace tokens (indices into t, in replay order) with demand loads only: on a miss with a full layer, the
/// resident expert whose next use is farthest away (never used again first) is evicted; experts of the running token
/// are never evicted. No prefetching, so it bounds every demand-only policy (LRU, LFU, ARC) on the same replay.
/// PRECONDITION: slots_per_layer in [t.top_k, t.n_expert].
double belady_hit_rate(const RoutingTrace &t, std::span<const int64_t> tokens, int32_t slots_per_layer);

} // namespace prescope
