// A trace-driven simulator of the offloaded MoE block: a routing trace replayed through the hot-expert table,
// a predictor, the layer planner (the runtime's, offload/layer-planner.h) and a timing model of the GPU, the CPU
// and the PCIe link from a cost profile (a byte-level link queue with demand before prefetch, and
// evaluate_plan's per-layer timeline). For comparing rules on shapes and machines not at hand; its numbers are
// simulated, never measured. Decision: docs/decisions/0083.
#pragma once

#include "offload/cost-model.h"
#include "offload/load-balancer.h"
#include "offload/eviction-policy.h"
#include "offload/layer-stats.h"
#include "offload/trace.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>

namespace prescope {

struct SimConfig {
    uint64_t budget_bytes = uint64_t(12) << 30;  // GPU memory for expert slots
    int32_t cpu_threshold = -1;                  // -1: the cost-model scheduler; >= 0: the threshold rule
    EvictionPolicyKind policy = EvictionPolicyKind::LRU;
    std::string predictor = "recency";           // none | frequency | recency | oracle (reads the trace)
    int32_t prefetch_window = 1;
    int32_t prefetch_max_per_layer = 0;          // 0 = top_k
    int32_t prefetch_in_flight = 8;
    int32_t stream_min_batch = 32;
    int32_t residency_horizon = 256;              // PlannerConfig::residency_horizon
    int64_t prefill_tokens = 512;                // one prefill batch of this many trace tokens (0 = none)
    int64_t decode_tokens = 128;                 // then this many decode steps of one token
    int64_t first_token = 0;                     // flat trace index the run starts at (wraps around)
    int32_t threads = 16;                        // CPU threads of the cost model
    uint64_t chunk_bytes = uint64_t(4) << 20;
    int32_t queue_depth = 4;
    CostCorrections truth;                       // the machine is this far from the profile (the balancer's job)
    LoadBalance balance = LoadBalance::LINK;  // the runtime's default (decision 0146)
    bool link_price = true;                    // the runtime's default (decision 0147)
    std::string dump_path;                       // layer states of every planned layer (JSON lines)
};

/// What one phase (prefill or decode) of a simulated run did.
struct SimPhase {
    int64_t tokens = 0;
    double time_us = 0;        // simulated wall time
    double bound_us = 0;       // the bound: per layer, hits on the GPU and the misses split ideally between the
                               // link and the CPU at the profile's speeds, plus the layer's non-expert time
    uint64_t pcie_bytes = 0;   // demand + prefetch bytes over the link
    LayerStats totals;         // the cache's and the scheduler's counters over the phase
    double tok_s() const { return time_us > 0 ? double(tokens) * 1e6 / time_us : 0; }
    double bound_tok_s() const { return bound_us > 0 ? double(tokens) * 1e6 / bound_us : 0; }
};

struct SimResult {
    SimPhase prefill, decode;
    CostCorrections corrections;  // the load balancer's at the end
    std::string cost_model;       // CostModel::describe() of the planner's model at the start
    nlohmann::json to_json() const;
};

/// Replays `trace` (its n_layer x n_expert x top_k) with experts of `shape` under `profile`. Throws
/// prescope::Error on a budget below the cache's minimum or an oracle predictor without the trace's future.
SimResult simulate(const RoutingTrace &trace, const ExpertShape &shape, const CostProfile &profile,
                   const SimConfig &config);

} // namespace prescope
