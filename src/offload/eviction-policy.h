// Eviction policies of the hot-expert table: LRU, LFU and ARC, one eviction group per layer.
// Policies only rank; the cache owns slots, pins and counters (offload/expert-cache.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace prescope {

enum class EvictionPolicyKind : uint8_t {
    LRU,  // least recently used
    LFU,  // least frequently used since insertion; ties go to the least recent
    ARC,  // adaptive replacement cache (Megiddo & Modha, FAST 2003): recency and frequency lists with ghosts
};

/// "lru", "lfu" or "arc" (case-insensitive); throws prescope::Error naming the accepted values otherwise.
EvictionPolicyKind parse_eviction_policy(std::string_view name);
const char *eviction_policy_name(EvictionPolicyKind kind);

/// Slots of layer l are [first_slot[l], first_slot[l] + n_slots[l]) of a global slot array.
struct SlotLayout {
    int32_t n_layers = 0;
    int32_t n_experts = 0;           // per layer
    std::vector<int32_t> first_slot; // [n_layers]
    std::vector<int32_t> n_slots;    // [n_layers]
    int32_t total_slots() const { return n_layers ? first_slot.back() + n_slots.back() : 0; }
};

/// Ranks the resident experts of each layer. Calls come from the cache only, in this order per miss:
/// on_miss (demand only) -> choose_victim (when the layer has no free slot) -> on_evict -> on_insert.
/// All state is sized in make_eviction_policy(); no call allocates.
class EvictionPolicy {
  public:
    virtual ~EvictionPolicy() = default;
    /// A demand access found `expert` resident in `slot`.
    virtual void on_hit(int32_t layer, int32_t expert, int32_t slot) = 0;
    /// A demand access missed `expert` (before any eviction). ARC adapts its target here.
    virtual void on_miss(int32_t layer, int32_t expert) {}
    /// `expert` now occupies `slot`. prefetch: loaded speculatively, not referenced yet.
    virtual void on_insert(int32_t layer, int32_t expert, int32_t slot, bool prefetch) = 0;
    /// `expert` left `slot`.
    virtual void on_evict(int32_t layer, int32_t expert, int32_t slot) = 0;
    /// The slot of layer `layer` to free for `incoming`, among slots with evictable[slot] != 0
    /// (evictable is indexed by global slot); -1 if there is none.
    virtual int32_t choose_victim(int32_t layer, int32_t incoming, std::span<const uint8_t> evictable) = 0;
};

std::unique_ptr<EvictionPolicy> make_eviction_policy(EvictionPolicyKind kind, const SlotLayout &layout);

} // namespace prescope
