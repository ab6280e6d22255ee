// LRU, LFU and ARC over per-layer eviction groups. Victim search scans the layer's slots (tens to a few
// hundred), which costs less than keeping heaps ordered on every hit.
#include "offload/eviction-policy.h"

#include "core/error.h"

#include <algorithm>
#include <cctype>
#include <string>

namespace prescope {

EvictionPolicyKind parse_eviction_policy(std::string_view name) {
    std::string lower;
    for (char c : name) lower += char(std::tolower(static_cast<unsigned char>(c)));
    if (lower == "lru") return EvictionPolicyKind::LRU;
    if (lower == "lfu") return EvictionPolicyKind::LFU;
    if (lower == "arc") return EvictionPolicyKind::ARC;
    fail("unknown eviction policy '{}': expected lru, lfu or arc", name);
}

const char *eviction_policy_name(EvictionPolicyKind kind) {
    switch (kind) {
    case EvictionPolicyKind::LRU: return "lru";
    case EvictionPolicyKind::LFU: return "lfu";
    case EvictionPolicyKind::ARC: return "arc";
    }
    return "?";
}

namespace {

// --- LRU and LFU ------------------------------------------------------------------------------------------

/// LRU ranks by last use; LFU by uses since insertion, then last use. A prefetch counts as a use for
/// recency (it was just wanted) but not for frequency (nobody has run the expert yet).
class CountingPolicy final : public EvictionPolicy {
  public:
    CountingPolicy(const SlotLayout &layout, bool by_frequency)
        : layout_(layout), by_frequency_(by_frequency), last_use_(size_t(layout.total_slots()), 0),
          uses_(size_t(layout.total_slots()), 0) {}

    void on_hit(int32_t, int32_t, int32_t slot) override {
        last_use_[size_t(slot)] = ++clock_;
        ++uses_[size_t(slot)];
    }
    void on_insert(int32_t, int32_t, int32_t slot, bool prefetch) override {
        last_use_[size_t(slot)] = ++clock_;
        uses_[size_t(slot)] = prefetch ? 0 : 1;
    }
    void on_evict(int32_t, int32_t, int32_t slot) override { uses_[size_t(slot)] = 0; }

    int32_t choose_victim(int32_t layer, int32_t, std::span<const uint8_t> evictable) override {
        int32_t best = -1;
        int32_t begin = layout_.first_slot[size_t(layer)];
        int32_t end = begin + layout_.n_slots[size_t(layer)];
        for (int32_t s = begin; s < end; ++s) {
            if (!evictable[size_t(s)]) continue;
            if (best < 0 || before(s, best)) best = s;
        }
        return best;
    }

  private:
    // True if slot a should go before slot b.
    bool before(int32_t a, int32_t b) const {
        if (by_frequency_ && uses_[size_t(a)] != uses_[size_t(b)]) return uses_[size_t(a)] < uses_[size_t(b)];
        return last_use_[size_t(a)] < last_use_[size_t(b)];
    }

    const SlotLayout layout_;
    const bool by_frequency_;
    uint64_t clock_ = 0;
    std::vector<uint64_t> last_use_;  // [total slots] logical time of the last use
    std::vector<uint64_t> uses_;      // [total slots] uses since insertion
};

// --- ARC --------------------------------------------------------------------------------------------------

/// ARC per layer with c = the layer's slot count: T1 (seen once recently) and T2 (seen at least twice)
/// hold resident experts, B1 and B2 remember experts evicted from them; p, the target size of T1, grows
/// on B1 hits and shrinks on B2 hits (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement
/// Cache", FAST 2003, Fig. 4). Additions for this cache: pinned slots are skipped (the next entry toward
/// MRU is taken, then the other list); a prefetched expert enters T1 unreferenced and leaves ARC's
/// adaptation alone; its first demand use is handled as ARC would have handled that request as a miss
/// (ghost hits adapt p and go to T2); evicted unused, it returns to the ghost list it came from.
class ArcPolicy final : public EvictionPolicy {
  public:
    explicit ArcPolicy(const SlotLayout &layout)
        : layout_(layout), p_(size_t(layout.n_layers), 0), lists_(size_t(layout.n_layers)) {
        size_t n = size_t(layout.n_layers) * size_t(layout.n_experts);
        where_.assign(n, NONE);
        origin_.assign(n, NONE);
        referenced_.assign(n, 0);
        prev_.assign(n, -1);
        next_.assign(n, -1);
        slot_.assign(n, -1);
    }

    void on_hit(int32_t layer, int32_t expert, int32_t) override {
        int32_t g = global(layer, expert);
        PRESCOPE_ASSERT(where_[size_t(g)] == T1 || where_[size_t(g)] == T2);
        remove(layer, g);
        if (!referenced_[size_t(g)]) {
            referenced_[size_t(g)] = 1;
            uint8_t origin = origin_[size_t(g)];
            origin_[size_t(g)] = NONE;
            if (origin != NONE) adapt(layer, origin);
            push_mru(layer, origin == NONE ? T1 : T2, g);
        } else {
            push_mru(layer, T2, g);
        }
    }

    void on_miss(int32_t layer, int32_t expert) override {
        uint8_t w = where_[size_t(global(layer, expert))];
        if (w == B1 || w == B2) adapt(layer, w);
    }

    void on_insert(int32_t layer, int32_t expert, int32_t slot, bool prefetch) override {
        int32_t g = global(layer, expert);
        uint8_t w = where_[size_t(g)];
        PRESCOPE_ASSERT(w != T1 && w != T2);
        if (w != NONE) remove(layer, g);
        slot_[size_t(g)] = slot;
        referenced_[size_t(g)] = prefetch ? 0 : 1;
        origin_[size_t(g)] = prefetch ? w : NONE;
        push_mru(layer, !prefetch && w != NONE ? T2 : T1, g);
        trim(layer);
    }

    void on_evict(int32_t layer, int32_t expert, int32_t) override {
        int32_t g = global(layer, expert);
        uint8_t w = where_[size_t(g)];
        PRESCOPE_ASSERT(w == T1 || w == T2);
        remove(layer, g);
        slot_[size_t(g)] = -1;
        uint8_t ghost = w == T1 ? B1 : B2;
        if (!referenced_[size_t(g)]) ghost = origin_[size_t(g)];  // an unused prefetch leaves no new trace
        origin_[size_t(g)] = NONE;
        referenced_[size_t(g)] = 0;
        if (ghost != NONE) push_mru(layer, ghost, g);
        trim(layer);
    }

    int32_t choose_victim(int32_t layer, int32_t incoming, std::span<const uint8_t> evictable) override {
        const Lists &L = lists_[size_t(layer)];
        int32_t t1 = L.list[T1].size;
        int32_t p = p_[size_t(layer)];
        bool in_b2 = where_[size_t(global(layer, incoming))] == B2;
        bool from_t1 = t1 >= 1 && (t1 > p || (in_b2 && t1 == p));  // ARC's REPLACE(x, p)
        int32_t s = lru_evictable(layer, from_t1 ? T1 : T2, evictable);
        return s >= 0 ? s : lru_evictable(layer, from_t1 ? T2 : T1, evictable);
    }

  private:
    static constexpr uint8_t T1 = 0, T2 = 1, B1 = 2, B2 = 3, NONE = 4;
    struct List {
        int32_t lru = -1, mru = -1, size = 0;
    };
    struct Lists {
        List list[4];
    };

    int32_t global(int32_t layer, int32_t expert) const { return layer * layout_.n_experts + expert; }
    int32_t capacity(int32_t layer) const { return layout_.n_slots[size_t(layer)]; }

    void adapt(int32_t layer, uint8_t ghost) {
        const Lists &L = lists_[size_t(layer)];
        int32_t b1 = std::max(L.list[B1].size, 1), b2 = std::max(L.list[B2].size, 1);
        int32_t &p = p_[size_t(layer)];
        if (ghost == B1) p = std::min(capacity(layer), p + std::max(L.list[B2].size / b1, 1));
        else p = std::max(0, p - std::max(L.list[B1].size / b2, 1));
    }

    void push_mru(int32_t layer, uint8_t which, int32_t g) {
        List &l = lists_[size_t(layer)].list[which];
        prev_[size_t(g)] = l.mru;
        next_[size_t(g)] = -1;
        if (l.mru >= 0) next_[size_t(l.mru)] = g;
        else l.lru = g;
        l.mru = g;
        ++l.size;
        where_[size_t(g)] = which;
    }

    void remove(int32_t layer, int32_t g) {
        List &l = lists_[size_t(layer)].list[where_[size_t(g)]];
        int32_t p = prev_[size_t(g)], n = next_[size_t(g)];
        if (p >= 0) next_[size_t(p)] = n;
        else l.lru = n;
        if (n >= 0) prev_[size_t(n)] = p;
        else l.mru = p;
        --l.size;
        prev_[size_t(g)] = next_[size_t(g)] = -1;
        where_[size_t(g)] = NONE;
    }

    // Keeps |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c by forgetting the oldest ghosts, which
    // deletes what ARC's case IV deletes.
    void trim(int32_t layer) {
        Lists &L = lists_[size_t(layer)];
        int32_t c = capacity(layer);
        while (L.list[T1].size + L.list[B1].size > c && L.list[B1].size > 0) remove(layer, L.list[B1].lru);
        auto total = [&] { return L.list[T1].size + L.list[T2].size + L.list[B1].size + L.list[B2].size; };
        while (total() > 2 * c && L.list[B2].size > 0) remove(layer, L.list[B2].lru);
    }

    int32_t lru_evictable(int32_t layer, uint8_t which, std::span<const uint8_t> evictable) const {
        for (int32_t g = lists_[size_t(layer)].list[which].lru; g >= 0; g = next_[size_t(g)]) {
            if (evictable[size_t(slot_[size_t(g)])]) return slot_[size_t(g)];
        }
        return -1;
    }

    const SlotLayout layout_;
    std::vector<int32_t> p_;        // [n_layers] target size of T1
    std::vector<Lists> lists_;      // [n_layers]
    std::vector<uint8_t> where_;    // [n_layers * n_experts] list holding the expert, or NONE
    std::vector<uint8_t> origin_;   // [n_layers * n_experts] ghost list a prefetched expert came from
    std::vector<uint8_t> referenced_;  // [n_layers * n_experts] 0 while a prefetched expert awaits use
    std::vector<int32_t> prev_, next_; // [n_layers * n_experts] links toward LRU / MRU
    std::vector<int32_t> slot_;        // [n_layers * n_experts] slot of a resident expert
};

} // namespace

std::unique_ptr<EvictionPolicy> make_eviction_policy(EvictionPolicyKind kind, const SlotLayout &layout) {
    switch (kind) {
    case EvictionPolicyKind::LRU: return std::make_unique<CountingPolicy>(layout, false);
    case EvictionPolicyKind::LFU: return std::make_unique<CountingPolicy>(layout, true);
    case EvictionPolicyKind::ARC: return std::make_unique<ArcPolicy>(layout);
    }
    PRESCOPE_ASSERT(false);
    return nullptr;
}

} // namespace prescope
