// The glue the runtime calls per layer: turns a LayerDecision and prefetch requests into slot grants and
// copy requests, and makes the compute stream wait on the copies it needs (docs/style R5 call order:
// plan -> submit -> compute waits on the ticket).
#pragma once

#include "backend/backend.h"
#include "offload/copy-engine.h"
#include "offload/expert-cache.h"
#include "offload/placement.h"
#include "offload/predictor.h"

#include <cstdint>
#include <span>
#include <vector>

namespace prescope {

/// One step through a layer, on the runtime thread:
///   decide_layer(...)          -> LayerDecision d
///   loader.begin_layer(d)      -> slots acquired and pinned, demand loads queued
///   (launch the CPU experts, then) loader.wait_experts(d, compute) -> compute waits for the bytes
///   (launch the GPU experts on `compute`)
///   loader.end_layer(l, compute) -> slots unpinned; later loads into them wait for this compute
///   predictor->predict(...); loader.prefetch(list.items(), ...)
class ExpertLoader {
  public:
    /// backend, cache (with a backend-allocated pool), engine and plan must outlive the loader.
    /// host_experts: [n_layers * n_experts] host address of each expert's contiguous bytes (pinned or
    /// registered; pageable works at pageable speed), valid for the loader's life. Creates one event per layer.
    ExpertLoader(Backend &backend, ExpertCache &cache, CopyEngine &engine, const PlacementPlan &plan,
                 std::vector<const void *> host_experts);
    /// Waits for the engine to drain (queued copies may wait on this loader's events), then frees them.
    ~ExpertLoader();
    ExpertLoader(const ExpertLoader &) = delete;
    ExpertLoader &operator=(const ExpertLoader &) = delete;

    /// Puts the plan's home-GPU experts into fixed slots and queues their loads (layers without experts are
    /// skipped: their row of the plan places nothing). Call once, before the first step. Throws
    /// prescope::Error when a layer has more of them than slots.
    void load_fixed();
    /// Acquires slots for d's HIT entries, then its FETCH entries (so a fetch never evicts a hit), queues
    /// the demand loads, promotes pending prefetches now needed, sets each GPU entry's slot, and counts the
    /// CPU entries. STREAM entries are left alone: the runtime hands them over later, as the FETCH entries
    /// of a decision per wave, each after end_layer of the wave before. Throws prescope::Error when the
    /// layer has fewer slots than GPU experts.
    void begin_layer(LayerDecision &d);
    /// Makes `compute` wait (on the device) for the HIT (if hits) and FETCH (if fetches) experts of d. The host
    /// blocks only until their copies are issued; that time is added to the layer's stall counter. Returns it,
    /// microseconds.
    double wait_experts(const LayerDecision &d, Stream compute, bool hits = true, bool fetches = true);
    /// Records the layer's compute event on `compute` and unpins the layer's slots.
    void end_layer(int32_t layer, Stream compute);
    /// Starts a prefetch round and queues loads for `wanted` in order (sort by score first), at most
    /// max_per_layer new loads per layer, skipping resident experts and those the plan runs on the CPU. The
    /// resident experts in `keep` are not evicted for them in this round. slots (empty, or wanted.size()):
    /// the slot each request got, -1 for none. Returns the loads queued.
    int32_t prefetch(std::span<const PrefetchRequest> wanted, int32_t max_per_layer,
                     std::span<const PrefetchRequest> keep = {}, std::span<int32_t> slots = {});

    /// Device address of the expert's bytes in its slot (after begin_layer set d's slots).
    const void *slot_data(int32_t slot) const { return cache_.slot_data(slot); }

  private:
    void load(int32_t layer, int32_t expert, const SlotGrant &g, CopyPriority priority);

    Backend &backend_;
    ExpertCache &cache_;
    CopyEngine &engine_;
    const PlacementPlan &plan_;
    std::vector<const void *> host_;      // [n_layers * n_experts]
    std::vector<Event> layer_done_;       // [n_layers] last compute that read the layer's slots
    std::vector<int32_t> prefetched_;     // [n_layers] scratch: loads queued this round
};

} // namespace prescope
