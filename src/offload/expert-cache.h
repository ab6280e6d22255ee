// The hot-expert table: a fixed pool of GPU slots allocated once from a byte budget, (layer, expert) ->
// slot, one eviction group per layer, pins for the running layer, and per-layer counters (docs/style R5).
#pragma once

#include "backend/backend.h"
#include "offload/copy-engine.h"
#include "offload/eviction-policy.h"
#include "offload/layer-stats.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace prescope {

struct ExpertCacheConfig {
    int32_t n_layers = 0;                // model layers, numbered 0..n_layers-1 as the cache sees them
    int32_t n_experts = 0;               // routed experts per layer
    int32_t top_k = 0;                   // experts per token: the fewest slots a MoE layer can run with
    std::vector<uint64_t> expert_bytes;  // [n_layers * n_experts] bytes of each expert's contiguous range
                                         // (docs/style R4), or [1]: the same for every expert. A layer whose
                                         // experts are all 0 bytes has none (a leading dense layer): no slots
    uint64_t budget_bytes = 0;           // GPU bytes for expert slots (--gpu-expert-budget, gpu_cache);
                                         // 0 = no GPU cache (every routed expert runs on the CPU)
    EvictionPolicyKind policy = EvictionPolicyKind::LRU;
    std::vector<int32_t> slots_per_layer;  // optional [n_layers] split, each in [top_k, n_experts] (0 for a
                                           // layer without experts); empty: even split (docs/decisions/0031)
    uint64_t slot_alignment = 256;         // slot size is rounded up to this many bytes
};

/// The outcome of acquire() or prefetch().
struct SlotGrant {
    int32_t slot = -1;            // -1: no slot (prefetch found no evictable slot)
    bool hit = false;             // the expert was resident already (or being loaded)
    bool load = false;            // the caller must copy the expert's bytes into the slot
    int32_t evicted_expert = -1;  // expert that lost the slot, -1 if the slot was free
    Ticket evicted_ticket;        // that expert's load; cancel it before queuing the new load, so that a
                                  // late prefetch chunk cannot land on top of the new bytes
};

/// PRECONDITIONS for acquire/prefetch/fix/release: one thread (the runtime's), layer in [0, n_layers) with
/// experts (has_experts, asserted), expert in [0, n_experts). Nothing after the constructor allocates.
/// Layers without experts (docs/decisions/0134) have 0 slots, take no budget and no row in the stats.
/// A slot's bytes may be overwritten only after the compute that last read them has finished: slots
/// belong to one layer for life, so the runtime makes each load wait for that layer's last compute event.
class ExpertCache {
  public:
    /// Sizes the slot pool from the budget and allocates it once from `backend` (DEVICE memory). Without a
    /// backend only the bookkeeping runs (simulation, trace replay), and slot_data() returns nullptr.
    /// Throws prescope::Error on a bad config or a budget in (0, min_budget_bytes()), naming the minimum.
    explicit ExpertCache(const ExpertCacheConfig &config, Backend *backend = nullptr);
    ~ExpertCache();
    ExpertCache(const ExpertCache &) = delete;
    ExpertCache &operator=(const ExpertCache &) = delete;

    /// Bytes of each layer's slots, [n_layers]: the layer's largest expert rounded up to slot_alignment; 0 for
    /// a layer without experts.
    /// Layers of a mixed-type file differ (Q4_K_M keeps some layers' down projections in Q6_K), so the
    /// budget buys slots of each layer's own size (docs/decisions/0063).
    static std::vector<uint64_t> layer_slot_bytes_for(const ExpertCacheConfig &config);
    /// The largest slot (of any layer).
    static uint64_t slot_bytes_for(const ExpertCacheConfig &config);
    /// The smallest non-zero budget: top_k slots in every layer with experts.
    static uint64_t min_budget_bytes(const ExpertCacheConfig &config);
    /// Device bytes the slot pool takes for the config's budget and split (<= budget_bytes).
    static uint64_t pool_bytes_for(const ExpertCacheConfig &config);

    int32_t n_layers() const { return layout_.n_layers; }
    int32_t n_experts() const { return layout_.n_experts; }
    int32_t n_slots() const { return layout_.total_slots(); }
    int32_t layer_slots(int32_t layer) const { return layout_.n_slots[size_t(layer)]; }
    /// False for a layer without experts (its expert bytes are 0): it has no slots and is never accessed.
    bool has_experts(int32_t layer) const { return layer_slot_bytes_[size_t(layer)] > 0; }
    /// Layers with experts.
    int32_t n_moe_layers() const { return n_moe_layers_; }
    /// The largest slot; slot_bytes(layer): the layer's slots.
    uint64_t slot_bytes() const { return slot_bytes_; }
    uint64_t slot_bytes(int32_t layer) const { return layer_slot_bytes_[size_t(layer)]; }
    /// Device bytes of all slots.
    uint64_t pool_bytes() const { return pool_bytes_; }
    uint64_t expert_bytes(int32_t layer, int32_t expert) const;
    EvictionPolicyKind policy() const { return config_.policy; }
    /// Experts each token routes to (ExpertCacheConfig::top_k).
    int32_t top_k() const { return config_.top_k; }

    /// The slot holding the expert (resident or being loaded), or -1. No counters, no policy update.
    int32_t find(int32_t layer, int32_t expert) const;
    /// Demand access by the running layer: counts a hit or a demand miss, updates the policy and pins the
    /// slot until release_layer(layer). On a miss the slot is taken from a free slot or the policy's victim
    /// and grant.load is set. Throws prescope::Error when every slot of the layer is pinned (more unique
    /// experts than the layer has slots).
    SlotGrant acquire(int32_t layer, int32_t expert);
    /// Speculative load for a later step: if the expert is resident, returns {slot, hit}; otherwise takes a
    /// free slot or a victim that is not pinned and not prefetched in this round (prefetches never evict
    /// each other within a round), or returns slot -1. Does not pin; counts prefetch_loads.
    SlotGrant prefetch(int32_t layer, int32_t expert);
    /// Starts a prefetch round (one per step and predictor call).
    void begin_prefetch_round() { ++prefetch_round_; }
    /// Keeps a resident expert from being evicted by prefetches of this round (the plan predicts it too).
    /// No effect when it is not resident.
    void protect(int32_t layer, int32_t expert);
    /// Unpins every slot acquired for `layer`.
    void release_layer(int32_t layer);
    /// Keeps the expert resident for good (home tier GPU in the placement plan); no counters. Returns the
    /// grant (load set when its bytes must be copied). Throws prescope::Error when the layer's slots are
    /// all fixed or pinned.
    SlotGrant fix(int32_t layer, int32_t expert);

    /// The copy engine ticket of the slot's last load (invalid if none).
    void set_ticket(int32_t slot, Ticket ticket) { slots_[size_t(slot)].ticket = ticket; }
    Ticket ticket(int32_t slot) const { return slots_[size_t(slot)].ticket; }
    /// Device address of the slot's slot_bytes(slot_layer(slot)) bytes (nullptr without a backend).
    void *slot_data(int32_t slot) const;
    int32_t slot_expert(int32_t slot) const { return slots_[size_t(slot)].expert; }
    int32_t slot_layer(int32_t slot) const { return slots_[size_t(slot)].layer; }
    bool slot_pinned(int32_t slot) const { return slots_[size_t(slot)].pins > 0; }
    bool slot_fixed(int32_t slot) const { return slots_[size_t(slot)].fixed; }
    /// Slots of the layer held by fixed experts.
    int32_t layer_fixed(int32_t layer) const { return fixed_count_[size_t(layer)]; }

    /// Counts n routed experts of the layer that ran on the CPU.
    void record_cpu(int32_t layer, uint64_t n = 1) { stats_.at(layer).cpu_runs += n; }
    /// Adds time the layer's compute waited for expert bytes, microseconds.
    void record_stall(int32_t layer, double us) { stats_.at(layer).stall_us += us; }
    /// The layer's counters: the table's own, and the executor's and scheduler's, which write them here
    /// (the cache holds the runtime's one per-layer table).
    const LayerStats &stats(int32_t layer) const { return stats_.at(layer); }
    LayerStats &layer_stats(int32_t layer) { return stats_.at(layer); }
    LayerStats total_stats() const { return stats_.total(); }
    /// Zeroes every counter of every layer.
    void reset_stats() { stats_.reset(); }

    /// One line: budget, slots, slot size, policy (the layers with experts; dense ones counted apart).
    std::string describe() const;
    /// A table with one row per layer with experts and a total row (printed at exit; LayerStatsTable::text).
    std::string stats_table() const { return stats_.text(); }
    /// {"policy", "slot_bytes", "budget_bytes", "layers": [{...per layer...}], "total": {...}} with the
    /// field names of LayerStats.
    nlohmann::json stats_json() const;

  private:
    struct Slot {
        int32_t layer = 0;        // eviction group, fixed for life
        int32_t expert = -1;      // resident expert, -1 = free
        int32_t pins = 0;         // acquires by the running layer
        bool fixed = false;       // never evicted (fix())
        bool prefetched = false;  // loaded by prefetch and not used since
        uint64_t round = 0;       // prefetch round of the load
        uint64_t protect_round = 0;  // prefetch round in which prefetches may not evict it (protect())
        uint64_t bytes = 0;       // bytes of the resident expert
        Ticket ticket;            // its load
    };

    size_t key(int32_t layer, int32_t expert) const {
        return size_t(layer) * size_t(layout_.n_experts) + size_t(expert);
    }
    void update_evictable(int32_t slot);
    // Frees a slot of the layer for a new expert (free list first, then the policy's victim among `mask`);
    // fills the grant's eviction fields. -1 if none.
    int32_t take_slot(int32_t layer, int32_t incoming, std::span<const uint8_t> mask, SlotGrant *grant);
    void install(int32_t slot, int32_t layer, int32_t expert, bool prefetch);
    void pin(int32_t slot);

    /// Slots per layer for the config's budget (slots_per_layer, or the even split of decision 0031 in
    /// slots of each layer's size); throws prescope::Error when they do not fit the budget.
    static std::vector<int32_t> split_slots(const ExpertCacheConfig &config, const std::vector<uint64_t> &slot_bytes);

    ExpertCacheConfig config_;
    SlotLayout layout_;
    uint64_t slot_bytes_ = 0;                 // the largest of layer_slot_bytes_
    std::vector<uint64_t> layer_slot_bytes_;  // [n_layers], 0 for a layer without experts
    int32_t n_moe_layers_ = 0;                // layers with experts
    std::vector<uint64_t> slot_offset_;       // [n_slots] byte offset of each slot in the pool
    uint64_t pool_bytes_ = 0;
    Backend *backend_ = nullptr;
    uint8_t *pool_ = nullptr;                 // [pool_bytes] device memory, owned
    std::vector<Slot> slots_;                 // [n_slots]
    std::vector<int32_t> map_;                // [n_layers * n_experts] -> slot or -1
    std::vector<uint8_t> evictable_;          // [n_slots] occupied, unpinned, not fixed
    std::vector<uint8_t> prefetch_mask_;      // [n_slots] scratch: evictable and not prefetched this round
    std::vector<std::vector<int32_t>> free_;  // [n_layers] free slots (capacity = layer slots)
    std::vector<std::vector<int32_t>> pinned_;// [n_layers] slots pinned by the running layer
    LayerStatsTable stats_;                   // [n_layers]
    std::vector<int32_t> fixed_count_;        // [n_layers] fixed slots
    std::unique_ptr<EvictionPolicy> policy_;
    uint64_t prefetch_round_ = 1;
};

} // namespace prescope
