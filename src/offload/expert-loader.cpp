// ExpertLoader: slot grants -> copy requests, with cancellation of stale loads and per-layer WAR events.
#include "offload/expert-loader.h"

#include "core/error.h"

#include <algorithm>

namespace prescope {

ExpertLoader::ExpertLoader(Backend &backend, ExpertCache &cache, CopyEngine &engine, const PlacementPlan &plan,
                           std::vector<const void *> host_experts)
    : backend_(backend), cache_(cache), engine_(engine), plan_(plan), host_(std::move(host_experts)) {
    plan_.check_shape(cache_.n_layers(), cache_.n_experts(), "placement plan");
    PRESCOPE_ASSERT(host_.size() == size_t(cache_.n_layers()) * size_t(cache_.n_experts()));
    PRESCOPE_ASSERT(cache_.n_slots() == 0 || cache_.slot_data(0) != nullptr);
    layer_done_.resize(size_t(cache_.n_layers()));
    for (Event &e : layer_done_) e = backend_.event_create();
    prefetched_.assign(size_t(cache_.n_layers()), 0);
}

ExpertLoader::~ExpertLoader() {
    // Copies still queued may wait on the layer events; let them finish before the events go.
    try {
        engine_.drain();
    } catch (const Error &) {
        // The copy thread failed; its error was reported to the caller that saw it.
    }
    for (Event e : layer_done_) backend_.event_destroy(e);
}

void ExpertLoader::load(int32_t layer, int32_t expert, const SlotGrant &g, CopyPriority priority) {
    // A queued load of the evicted expert would land on top of ours if left (demand overtakes prefetch);
    // chunks of it already issued land first, since they sit earlier on the same stream.
    if (g.evicted_ticket.valid()) engine_.cancel(g.evicted_ticket);
    CopyRequest r;
    r.dst = cache_.slot_data(g.slot);
    r.src = host_[size_t(layer) * size_t(cache_.n_experts()) + size_t(expert)];
    r.n_bytes = cache_.expert_bytes(layer, expert);
    r.priority = priority;
    r.after = layer_done_[size_t(layer)];
    cache_.set_ticket(g.slot, engine_.submit(r));
}

void ExpertLoader::load_fixed() {
    for (int32_t l = 0; l < plan_.n_layers; ++l) {
        if (!cache_.has_experts(l)) continue;  // a dense layer's row of the plan places nothing
        for (int32_t e = 0; e < plan_.n_experts; ++e) {
            if (plan_.at(l, e).home != HomeTier::GPU) continue;
            SlotGrant g = cache_.fix(l, e);
            if (g.load) load(l, e, g, CopyPriority::DEMAND);
        }
    }
}

void ExpertLoader::begin_layer(LayerDecision &d) {
    for (ExpertAction pass : {ExpertAction::HIT, ExpertAction::FETCH}) {
        for (RoutedExpert &r : d.experts) {
            if (r.action != pass) continue;
            SlotGrant g = cache_.acquire(d.layer, r.expert);
            r.slot = g.slot;
            if (g.load) load(d.layer, r.expert, g, CopyPriority::DEMAND);
            else if (cache_.ticket(g.slot).valid()) engine_.promote(cache_.ticket(g.slot));
        }
    }
    if (d.n_cpu > 0) cache_.record_cpu(d.layer, uint64_t(d.n_cpu));
}

double ExpertLoader::wait_experts(const LayerDecision &d, Stream compute, bool hits, bool fetches) {
    double blocked_us = 0;
    for (const RoutedExpert &r : d.experts) {
        if (!(r.action == ExpertAction::HIT && hits) && !(r.action == ExpertAction::FETCH && fetches)) continue;
        PRESCOPE_ASSERT(r.slot >= 0);
        Ticket t = cache_.ticket(r.slot);
        if (t.valid()) blocked_us += engine_.stream_wait(t, compute);
    }
    cache_.record_stall(d.layer, blocked_us);
    return blocked_us;
}

void ExpertLoader::end_layer(int32_t layer, Stream compute) {
    backend_.event_record(layer_done_[size_t(layer)], compute);
    cache_.release_layer(layer);
}

int32_t ExpertLoader::prefetch(std::span<const PrefetchRequest> wanted, int32_t max_per_layer,
                               std::span<const PrefetchRequest> keep, std::span<int32_t> slots) {
    PRESCOPE_ASSERT(slots.empty() || slots.size() == wanted.size());
    cache_.begin_prefetch_round();
    for (const PrefetchRequest &k : keep) cache_.protect(k.layer, k.expert);
    std::fill(prefetched_.begin(), prefetched_.end(), 0);
    std::fill(slots.begin(), slots.end(), -1);
    int32_t queued = 0;
    for (size_t i = 0; i < wanted.size(); ++i) {
        const PrefetchRequest &w = wanted[i];
        PRESCOPE_ASSERT(w.layer >= 0 && w.layer < cache_.n_layers() && w.expert >= 0 && w.expert < cache_.n_experts());
        if (plan_.at(w.layer, w.expert).exec == ExecSite::CPU || cache_.find(w.layer, w.expert) >= 0) continue;
        if (prefetched_[size_t(w.layer)] >= max_per_layer) continue;
        SlotGrant g = cache_.prefetch(w.layer, w.expert);
        if (!g.load) continue;
        if (!slots.empty()) slots[i] = g.slot;
        load(w.layer, w.expert, g, CopyPriority::PREFETCH);
        ++prefetched_[size_t(w.layer)];
        ++queued;
    }
    return queued;
}

} // namespace prescope
