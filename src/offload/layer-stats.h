// The per-layer counters of the offloading runtime in one struct (docs/style R5, R15): the hot-expert table's,
// the copies', the host's timings and the scheduler's, with one field table that feeds the text table printed
// at exit and the JSON of `prescope bench`, and one reset.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace prescope {

/// Counters of one layer, summed over steps. accesses() = hits + demand_misses + cpu_runs: every routed
/// expert of every step is counted once, in one of the three (decisions by kind: hits = HIT, demand_misses =
/// FETCH + STREAM (streamed of them STREAM), cpu_runs = CPU).
struct LayerStats {
    // hot-expert table (ExpertCache)
    uint64_t hits = 0;                   // demand accesses that found the expert resident (or loading)
    uint64_t demand_misses = 0;          // demand accesses that had to load the expert
    uint64_t cpu_runs = 0;               // routed experts run on the CPU from host memory
    uint64_t prefetch_hits = 0;          // of hits: first uses of a prefetched expert
    uint64_t prefetch_loads = 0;         // prefetches that took a slot and asked for a load
    uint64_t wasted_prefetch_bytes = 0;  // bytes of prefetched experts evicted before any use
    uint64_t bytes_loaded = 0;           // bytes asked to be loaded, demand and prefetch
    uint64_t evictions = 0;
    double stall_us = 0;                 // time the layer's compute waited for expert bytes
    // executor
    uint64_t steps = 0;                  // times the layer ran
    uint64_t streamed = 0;               // of demand_misses: STREAM experts, run in waves after wave 0
    uint64_t stream_waves = 0;
    uint64_t device_hits = 0;            // of hits: experts the device resolved from its slot table and ran before
                                         // the host read the routing (issue 14)
    uint64_t device_layers = 0;          // of steps: every routed expert resident, the device ran the whole step
                                         // (experts and combine) and the host read the routing later (0138)
    uint64_t split_steps = 0;            // steps whose CPU experts ran before the FETCH wave launched
    double cpu_expert_us = 0;            // host threads running the layer's CPU experts
    double predict_us = 0;               // predictor + prefetch submission
    double wait_issue_us = 0;            // host blocked until demand copies were issued (also in stall_us)
    double device_stall_us = 0;          // compute stream waiting for expert bytes (event-timed; in stall_us)
    double host_us = 0;                  // host wall time of the layer's MoE step (plan, copies, launches, CPU
                                         // experts, combine; HybridMoe::run_layer)
    double gpu_idle_us = 0;              // compute stream idle from the routing's copy to the host until the step's
                                         // first queued work: waiting for the host's plan (event-timed, timed steps)
    // scheduler and load balancer
    uint64_t prefetch_planned = 0;       // prefetches the plans asked for
    uint64_t corrections = 0;            // cost-model corrections made from this layer's measurements
    double predicted_us = 0;             // the plans' predicted critical paths
    double finish_gap_us = 0;            // measured CPU finish minus GPU finish (signed: > 0 the CPU was last)
    double finish_gap_abs_us = 0;        // |CPU finish - GPU finish|, steps with both

    uint64_t accesses() const { return hits + demand_misses + cpu_runs; }
    /// hits / accesses(), 0 with no accesses.
    double hit_rate() const { return accesses() ? double(hits) / double(accesses()) : 0.0; }
    LayerStats &operator+=(const LayerStats &o);
};

/// One counter of LayerStats: its JSON name, its text-table header and scale (0 = not in the text table).
struct LayerStatsField {
    const char *name;               // JSON key
    const char *header;             // text-table column, or nullptr
    uint64_t LayerStats::*count;    // exactly one of count / time is set
    double LayerStats::*time;
    double scale;                   // text table shows value x scale (bytes -> MiB, us -> ms)
};
/// Every field of LayerStats, in the order the table and the JSON list them.
std::span<const LayerStatsField> layer_stats_fields();

/// The counters of every layer, and the slots each layer has (shown in the table). Indexed by model layer;
/// layers without experts (leading dense layers) keep their zero counters but have no row in text() / json().
class LayerStatsTable {
  public:
    /// no_experts: [n_layers] 1 for a layer without experts, or empty (every layer has experts).
    explicit LayerStatsTable(std::vector<int32_t> slots_per_layer = {}, std::vector<uint8_t> no_experts = {});
    int32_t n_layers() const { return int32_t(layers_.size()); }
    LayerStats &at(int32_t layer) { return layers_[size_t(layer)]; }
    const LayerStats &at(int32_t layer) const { return layers_[size_t(layer)]; }
    LayerStats total() const;
    /// Zeroes every counter of every layer (the one reset).
    void reset();
    /// One row per layer with experts and a total row ("all"): the fields with a header, then the hit rate.
    std::string text() const;
    /// {"layers": [{"layer", "slots", every field, "hit_rate"}], "total": {...}}; "layer" is the model layer.
    nlohmann::json json() const;

  private:
    bool shown(size_t layer) const;  // a row in text() / json()

    std::vector<LayerStats> layers_;
    std::vector<int32_t> slots_;
    std::vector<uint8_t> no_experts_;  // [n_layers] or empty
};

} // namespace prescope
