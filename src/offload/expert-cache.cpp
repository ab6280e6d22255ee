// ExpertCache: slot pool sizing, lookups, demand and prefetch grants, pins, counters.
#include "offload/expert-cache.h"

#include "core/error.h"
#include "offload/byte-size.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <numeric>

namespace prescope {


namespace {

void validate(const ExpertCacheConfig &c) {
    if (c.n_layers <= 0 || c.n_experts <= 0) {
        fail("expert cache: need n_layers > 0 and n_experts > 0, got {} and {}", c.n_layers, c.n_experts);
    }
    if (c.top_k <= 0 || c.top_k > c.n_experts) {
        fail("expert cache: top_k must be in [1, {}] (n_experts), got {}", c.n_experts, c.top_k);
    }
    size_t want = size_t(c.n_layers) * size_t(c.n_experts);
    if (c.expert_bytes.size() != 1 && c.expert_bytes.size() != want) {
        fail("expert cache: expert_bytes has {} entries, expected 1 or {} (n_layers x n_experts)",
             c.expert_bytes.size(), want);
    }
    if (c.expert_bytes.size() == 1) {
        if (c.expert_bytes[0] == 0) fail("expert cache: an expert of 0 bytes");
    } else {
        // A layer has experts (each of > 0 bytes) or none at all (a leading dense layer: all 0).
        int32_t with_experts = 0;
        for (int32_t l = 0; l < c.n_layers; ++l) {
            const auto first = c.expert_bytes.begin() + ptrdiff_t(size_t(l) * size_t(c.n_experts));
            const auto zeros = std::count(first, first + c.n_experts, uint64_t(0));
            if (zeros != 0 && zeros != c.n_experts) {
                fail("expert cache: layer {} has {} experts of 0 bytes among {}; a layer's experts are all > 0 bytes, "
                     "or all 0 for a layer without experts",
                     l, zeros, c.n_experts);
            }
            with_experts += zeros == 0;
        }
        if (with_experts == 0) fail("expert cache: none of the {} layers has experts (all are 0 bytes)", c.n_layers);
    }
    if (c.slot_alignment == 0) fail("expert cache: slot alignment must be > 0");
}

} // namespace

std::vector<uint64_t> ExpertCache::layer_slot_bytes_for(const ExpertCacheConfig &config) {
    validate(config);
    std::vector<uint64_t> out(size_t(config.n_layers));
    for (int32_t l = 0; l < config.n_layers; ++l) {
        uint64_t largest = config.expert_bytes[0];
        if (config.expert_bytes.size() > 1) {
            const auto first = config.expert_bytes.begin() + ptrdiff_t(size_t(l) * size_t(config.n_experts));
            largest = *std::max_element(first, first + config.n_experts);
        }
        out[size_t(l)] = (largest + config.slot_alignment - 1) / config.slot_alignment * config.slot_alignment;
    }
    return out;
}

uint64_t ExpertCache::slot_bytes_for(const ExpertCacheConfig &config) {
    const std::vector<uint64_t> b = layer_slot_bytes_for(config);
    return *std::max_element(b.begin(), b.end());
}

uint64_t ExpertCache::min_budget_bytes(const ExpertCacheConfig &config) {
    const std::vector<uint64_t> b = layer_slot_bytes_for(config);
    return uint64_t(config.top_k) * std::accumulate(b.begin(), b.end(), uint64_t(0));
}

uint64_t ExpertCache::pool_bytes_for(const ExpertCacheConfig &config) {
    const std::vector<uint64_t> b = layer_slot_bytes_for(config);
    const std::vector<int32_t> n = split_slots(config, b);
    uint64_t total = 0;
    for (size_t l = 0; l < b.size(); ++l) total += uint64_t(n[l]) * b[l];
    return total;
}

std::vector<int32_t> ExpertCache::split_slots(const ExpertCacheConfig &c, const std::vector<uint64_t> &b) {
    const int32_t L = c.n_layers, E = c.n_experts;
    std::vector<int32_t> n(size_t(L), 0);
    const uint64_t per_round = std::accumulate(b.begin(), b.end(), uint64_t(0));  // one slot in every layer
    if (!c.slots_per_layer.empty()) {
        if (c.slots_per_layer.size() != size_t(L)) {
            fail("expert cache: slots_per_layer has {} entries, expected {} (n_layers)", c.slots_per_layer.size(), L);
        }
        uint64_t total = 0, bytes = 0;
        for (int32_t l = 0; l < L; ++l) {
            const int32_t k = c.slots_per_layer[size_t(l)];
            if (b[size_t(l)] == 0) {
                if (k != 0) fail("expert cache: layer {} has no experts but is given {} slots, expected 0", l, k);
                continue;
            }
            if (k < c.top_k || k > E) {
                fail("expert cache: layer {} is given {} slots, expected {} (top_k) to {} (n_experts)", l, k, c.top_k,
                     E);
            }
            n[size_t(l)] = k;
            total += uint64_t(k);
            bytes += uint64_t(k) * b[size_t(l)];
        }
        if (bytes > c.budget_bytes) {
            fail("expert cache: slots_per_layer asks for {} slots = {}, more than the budget of {}", total,
                 format_byte_size(bytes), format_byte_size(c.budget_bytes));
        }
    } else if (c.budget_bytes > 0) {
        const uint64_t min_budget = uint64_t(c.top_k) * per_round;
        if (c.budget_bytes < min_budget) {
            uint64_t lo = UINT64_MAX, hi = 0;
            int32_t moe = 0;
            for (uint64_t x : b) {
                if (x == 0) continue;  // no experts
                lo = std::min(lo, x);
                hi = std::max(hi, x);
                ++moe;
            }
            fail("GPU expert budget (--gpu-expert-budget / gpu_cache) of {} is too small: {} MoE layers x top-{} "
                 "experts in slots of {} to {} need at least {} ({} bytes); use 0 to run every expert on the CPU",
                 format_byte_size(c.budget_bytes), moe, c.top_k, format_byte_size(lo), format_byte_size(hi),
                 format_byte_size(min_budget), min_budget);
        }
        // Even split in slots of each layer's size; what is left buys one slot each for the first layers it
        // covers (docs/decisions/0031, 0063).
        const int32_t base = int32_t(std::min<uint64_t>(uint64_t(E), c.budget_bytes / per_round));
        uint64_t rest = c.budget_bytes - uint64_t(base) * per_round;
        for (int32_t l = 0; l < L; ++l) {
            if (b[size_t(l)] == 0) continue;  // no experts: no slots
            const bool extra = base < E && rest >= b[size_t(l)];
            if (extra) rest -= b[size_t(l)];
            n[size_t(l)] = base + (extra ? 1 : 0);
        }
    }
    return n;
}

ExpertCache::ExpertCache(const ExpertCacheConfig &config, Backend *backend)
    : config_(config), backend_(backend) {
    layer_slot_bytes_ = layer_slot_bytes_for(config_);
    slot_bytes_ = *std::max_element(layer_slot_bytes_.begin(), layer_slot_bytes_.end());
    n_moe_layers_ = int32_t(layer_slot_bytes_.size()) -
                    int32_t(std::count(layer_slot_bytes_.begin(), layer_slot_bytes_.end(), uint64_t(0)));
    const int32_t L = config_.n_layers, E = config_.n_experts;
    layout_.n_layers = L;
    layout_.n_experts = E;
    layout_.n_slots = split_slots(config_, layer_slot_bytes_);
    layout_.first_slot.assign(size_t(L), 0);
    for (int32_t l = 1; l < L; ++l) {
        layout_.first_slot[size_t(l)] = layout_.first_slot[size_t(l - 1)] + layout_.n_slots[size_t(l - 1)];
    }

    const int32_t n = layout_.total_slots();
    slots_.resize(size_t(n));
    evictable_.assign(size_t(n), 0);
    prefetch_mask_.assign(size_t(n), 0);
    map_.assign(size_t(L) * size_t(E), -1);
    free_.resize(size_t(L));
    pinned_.resize(size_t(L));
    std::vector<uint8_t> no_experts(static_cast<size_t>(L));
    for (int32_t l = 0; l < L; ++l) no_experts[size_t(l)] = !has_experts(l);
    stats_ = LayerStatsTable(layout_.n_slots, std::move(no_experts));
    fixed_count_.assign(size_t(L), 0);
    for (int32_t l = 0; l < L; ++l) {
        int32_t first = layout_.first_slot[size_t(l)], count = layout_.n_slots[size_t(l)];
        pinned_[size_t(l)].reserve(size_t(count));
        free_[size_t(l)].reserve(size_t(count));
        // Pushed in reverse so that slots are handed out in increasing order.
        for (int32_t s = first + count - 1; s >= first; --s) {
            slots_[size_t(s)].layer = l;
            free_[size_t(l)].push_back(s);
        }
    }
    slot_offset_.resize(size_t(n));
    for (int32_t s = 0; s < n; ++s) {
        slot_offset_[size_t(s)] = pool_bytes_;
        pool_bytes_ += layer_slot_bytes_[size_t(slots_[size_t(s)].layer)];
    }
    policy_ = make_eviction_policy(config_.policy, layout_);
    if (backend_ && n > 0) pool_ = static_cast<uint8_t *>(backend_->alloc(MemoryKind::DEVICE, size_t(pool_bytes_)));
    spdlog::debug("{}", describe());
}

ExpertCache::~ExpertCache() {
    if (backend_ && pool_) backend_->free(MemoryKind::DEVICE, pool_);
}

uint64_t ExpertCache::expert_bytes(int32_t layer, int32_t expert) const {
    return config_.expert_bytes.size() == 1 ? config_.expert_bytes[0] : config_.expert_bytes[key(layer, expert)];
}

void *ExpertCache::slot_data(int32_t slot) const {
    return pool_ ? pool_ + size_t(slot_offset_[size_t(slot)]) : nullptr;
}

int32_t ExpertCache::find(int32_t layer, int32_t expert) const {
    PRESCOPE_ASSERT(layer >= 0 && layer < layout_.n_layers && expert >= 0 && expert < layout_.n_experts);
    return map_[key(layer, expert)];
}

void ExpertCache::update_evictable(int32_t slot) {
    const Slot &s = slots_[size_t(slot)];
    evictable_[size_t(slot)] = s.expert >= 0 && s.pins == 0 && !s.fixed;
}

void ExpertCache::pin(int32_t slot) {
    Slot &s = slots_[size_t(slot)];
    if (s.pins++ == 0) pinned_[size_t(s.layer)].push_back(slot);
    update_evictable(slot);
}

int32_t ExpertCache::take_slot(int32_t layer, int32_t incoming, std::span<const uint8_t> mask, SlotGrant *grant) {
    std::vector<int32_t> &free = free_[size_t(layer)];
    if (!free.empty()) {
        int32_t slot = free.back();
        free.pop_back();
        return slot;
    }
    int32_t slot = policy_->choose_victim(layer, incoming, mask);
    if (slot < 0) return -1;
    Slot &s = slots_[size_t(slot)];
    PRESCOPE_ASSERT(s.layer == layer && s.expert >= 0 && s.pins == 0 && !s.fixed);
    LayerStats &st = stats_.at(layer);
    ++st.evictions;
    if (s.prefetched) st.wasted_prefetch_bytes += s.bytes;
    grant->evicted_expert = s.expert;
    grant->evicted_ticket = s.ticket;
    policy_->on_evict(layer, s.expert, slot);
    map_[key(layer, s.expert)] = -1;
    s.expert = -1;
    s.ticket = {};
    update_evictable(slot);
    return slot;
}

void ExpertCache::install(int32_t slot, int32_t layer, int32_t expert, bool prefetch) {
    Slot &s = slots_[size_t(slot)];
    s.expert = expert;
    s.prefetched = prefetch;
    s.round = prefetch_round_;
    s.bytes = expert_bytes(layer, expert);
    s.ticket = {};
    map_[key(layer, expert)] = slot;
    policy_->on_insert(layer, expert, slot, prefetch);
    update_evictable(slot);
}

SlotGrant ExpertCache::acquire(int32_t layer, int32_t expert) {
    PRESCOPE_ASSERT(has_experts(layer));
    SlotGrant g;
    LayerStats &st = stats_.at(layer);
    int32_t slot = find(layer, expert);
    if (slot >= 0) {
        Slot &s = slots_[size_t(slot)];
        ++st.hits;
        if (s.prefetched) {
            ++st.prefetch_hits;
            s.prefetched = false;
        }
        policy_->on_hit(layer, expert, slot);
        pin(slot);
        g.slot = slot;
        g.hit = true;
        return g;
    }
    ++st.demand_misses;
    policy_->on_miss(layer, expert);
    slot = take_slot(layer, expert, evictable_, &g);
    if (slot < 0) {
        fail("expert cache: layer {} has {} GPU slots and the running layer holds all of them; cannot load "
             "expert {} (more unique GPU experts than slots: run some on the CPU or raise "
             "--gpu-expert-budget)",
             layer, layout_.n_slots[size_t(layer)], expert);
    }
    install(slot, layer, expert, false);
    st.bytes_loaded += slots_[size_t(slot)].bytes;
    pin(slot);
    g.slot = slot;
    g.load = true;
    return g;
}

SlotGrant ExpertCache::prefetch(int32_t layer, int32_t expert) {
    PRESCOPE_ASSERT(has_experts(layer));  // predictors never name a dense layer (docs/decisions/0134)
    SlotGrant g;
    int32_t slot = find(layer, expert);
    if (slot >= 0) {
        g.slot = slot;
        g.hit = true;
        return g;
    }
    int32_t first = layout_.first_slot[size_t(layer)], end = first + layout_.n_slots[size_t(layer)];
    for (int32_t s = first; s < end; ++s) {
        const Slot &x = slots_[size_t(s)];
        prefetch_mask_[size_t(s)] = evictable_[size_t(s)] && !(x.prefetched && x.round == prefetch_round_) &&
                                    x.protect_round != prefetch_round_;
    }
    slot = take_slot(layer, expert, prefetch_mask_, &g);
    if (slot < 0) return g;
    install(slot, layer, expert, true);
    ++stats_.at(layer).prefetch_loads;
    stats_.at(layer).bytes_loaded += slots_[size_t(slot)].bytes;
    g.slot = slot;
    g.load = true;
    return g;
}

void ExpertCache::protect(int32_t layer, int32_t expert) {
    const int32_t slot = find(layer, expert);
    if (slot >= 0) slots_[size_t(slot)].protect_round = prefetch_round_;
}

SlotGrant ExpertCache::fix(int32_t layer, int32_t expert) {
    PRESCOPE_ASSERT(has_experts(layer));
    SlotGrant g;
    int32_t slot = find(layer, expert);
    if (slot < 0) {
        slot = take_slot(layer, expert, evictable_, &g);
        if (slot < 0) {
            fail("expert cache: cannot keep expert {} of layer {} on the GPU: all {} slots of the layer are "
                 "fixed or in use",
                 expert, layer, layout_.n_slots[size_t(layer)]);
        }
        install(slot, layer, expert, false);
        g.load = true;
    } else {
        g.hit = true;
    }
    if (!slots_[size_t(slot)].fixed) ++fixed_count_[size_t(layer)];
    slots_[size_t(slot)].fixed = true;
    slots_[size_t(slot)].prefetched = false;
    update_evictable(slot);
    g.slot = slot;
    return g;
}

void ExpertCache::release_layer(int32_t layer) {
    for (int32_t slot : pinned_[size_t(layer)]) {
        slots_[size_t(slot)].pins = 0;
        update_evictable(slot);
    }
    pinned_[size_t(layer)].clear();
}

std::string ExpertCache::describe() const {
    // Over the layers with experts; the dense ones are only counted.
    int32_t lo = INT32_MAX, hi = 0;
    uint64_t small = slot_bytes_;
    for (int32_t l = 0; l < layout_.n_layers; ++l) {
        if (!has_experts(l)) continue;
        lo = std::min(lo, layout_.n_slots[size_t(l)]);
        hi = std::max(hi, layout_.n_slots[size_t(l)]);
        small = std::min(small, layer_slot_bytes_[size_t(l)]);
    }
    const std::string sizes = small == slot_bytes_ ? format_byte_size(slot_bytes_)
                                                   : format_byte_size(small) + " to " + format_byte_size(slot_bytes_);
    const int32_t dense = layout_.n_layers - n_moe_layers_;
    return fmt::format("expert cache: budget {}, {} slots of {} ({} to {} per layer, {} layers x {} experts{}), "
                       "policy {}, pool {}",
                       format_byte_size(config_.budget_bytes), n_slots(), sizes, lo, hi, n_moe_layers_,
                       layout_.n_experts,
                       dense > 0 ? fmt::format("; {} dense layer{} without slots", dense, dense == 1 ? "" : "s") : "",
                       eviction_policy_name(config_.policy), format_byte_size(pool_bytes_));
}

nlohmann::json ExpertCache::stats_json() const {
    nlohmann::json j = stats_.json();
    for (auto &row : j["layers"]) row["slot_bytes"] = layer_slot_bytes_[row["layer"].get<size_t>()];
    j["policy"] = eviction_policy_name(config_.policy);
    j["slot_bytes"] = slot_bytes_;
    j["pool_bytes"] = pool_bytes_;
    j["budget_bytes"] = config_.budget_bytes;
    return j;
}

} // namespace prescope
