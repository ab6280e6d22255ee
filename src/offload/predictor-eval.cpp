// Predictor evaluation by trace replay: set metrics per (distance, target layer) and a hot-expert table replay.
#include "offload/predictor-eval.h"

#include "core/error.h"
#include "offload/expert-cache.h"
#include "offload/predictor-baselines.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <numeric>

namespace prescope {

EvalCell EvalResult::sum(int32_t d, int32_t first, int32_t last) const {
    EvalCell s;
    for (int32_t l = first; l < last; ++l) {
        const EvalCell &c = cells[size_t(d - 1) * size_t(n_layers) + size_t(l)];
        s.recall += c.recall, s.precision += c.precision, s.exact += c.exact, s.n += c.n;
        s.n_nonempty += c.n_nonempty;
    }
    return s;
}

namespace {

struct GroupRange {
    const char *name;
    int32_t first, last;
};

std::vector<GroupRange> group_ranges(const std::vector<int32_t> &g, int32_t L) {
    std::vector<GroupRange> out{{"all", 0, L}};
    if (g.size() == 3) {
        out.push_back({"input", g[0], g[1]});
        out.push_back({"middle", g[1], g[2]});
        out.push_back({"output", g[2], L});
    }
    return out;
}

double ratio(double a, int64_t b) { return b ? a / double(b) : 0.0; }

/// One token's demand accesses to layer l in the runtime's order (ExpertLoader::begin_layer over decide_layer's
/// ascending ids): the resident experts first, then the misses, so that a load never evicts an expert the same
/// token is about to use. ids: the token's top-k; sorted: scratch of the same size.
void acquire_like_runtime(ExpertCache &cache, int32_t l, const std::vector<int32_t> &ids, std::vector<int32_t> &sorted) {
    sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    for (int pass = 0; pass < 2; ++pass) {
        for (const int32_t e : sorted) {
            if ((cache.find(l, e) >= 0) == (pass == 0)) cache.acquire(l, e);
        }
    }
    cache.release_layer(l);
}

} // namespace

nlohmann::json EvalResult::to_json() const {
    nlohmann::json rows = nlohmann::json::array(), per_layer = nlohmann::json::array();
    for (int32_t d = 1; d <= window; ++d) {
        for (const GroupRange &g : group_ranges(group_start, n_layers)) {
            const EvalCell c = sum(d, std::max(g.first, d), g.last);
            if (c.n == 0) continue;  // no layer of the group is d layers after another
            rows.push_back({{"predictor", predictor}, {"trace", trace}, {"distance", d}, {"layer_group", g.name},
                            {"layers", {g.first, g.last}}, {"recall_at_k", ratio(c.recall, c.n)},
                            {"precision_at_k", ratio(c.precision, c.n_nonempty)},
                            {"exact_match", ratio(double(c.exact), c.n)}, {"n", c.n}});
        }
        for (int32_t l = d; l < n_layers; ++l) {
            const EvalCell c = sum(d, l, l + 1);
            per_layer.push_back({{"distance", d}, {"layer", l}, {"recall_at_k", ratio(c.recall, c.n)}});
        }
    }
    nlohmann::json j = {{"predictor", predictor}, {"trace", trace}, {"n_tokens", n_tokens}, {"window", window},
                        {"k_pred", k_pred}, {"top_k", top_k}, {"group_start", group_start}, {"rows", rows},
                        {"per_layer", per_layer}};
    if (cache_slots > 0) {
        j["cache"] = {{"slots_per_layer", cache_slots}, {"policy", policy}, {"hit_rate", hit_rate},
                      {"prefetch_hit_share", prefetch_hit_share}, {"prefetch_loads", prefetch_loads},
                      {"demand_misses", demand_misses}, {"accesses", accesses},
                      {"belady_hit_rate", belady_hit_rate}};
    }
    return j;
}

std::string EvalResult::table() const {
    std::string s = fmt::format("predictor {} on {}: {} tokens, top-{} predicted sets of {} experts\n", predictor,
                                trace, n_tokens, top_k, k_pred);
    s += fmt::format("{:>8} {:>8} {:>9} {:>11} {:>12} {:>10}\n", "distance", "group", "layers", "recall@k",
                     "precision@k", "exact");
    for (int32_t d = 1; d <= window; ++d) {
        for (const GroupRange &g : group_ranges(group_start, n_layers)) {
            const EvalCell c = sum(d, std::max(g.first, d), g.last);
            if (c.n == 0) continue;
            s += fmt::format("{:>8} {:>8} {:>9} {:>11.4f} {:>12.4f} {:>10.4f}\n", d, g.name,
                             fmt::format("{}-{}", g.first, g.last - 1), ratio(c.recall, c.n),
                             ratio(c.precision, c.n_nonempty), ratio(double(c.exact), c.n));
        }
    }
    if (cache_slots > 0) {
        s += fmt::format("cache replay: {} slots per layer ({}), hit rate {:.4f} ({} accesses, {} demand misses, "
                         "{} prefetch loads, {:.4f} of hits from prefetches); offline optimum without prefetching "
                         "(Belady) {:.4f}\n",
                         cache_slots, policy, hit_rate, accesses, demand_misses, prefetch_loads, prefetch_hit_share,
                         belady_hit_rate);
    }
    return s;
}

EvalResult evaluate_predictor(ScoringPredictor *p, const RoutingTrace &t, const HiddenTrace *hidden,
                              const EvalOptions &opt, const std::string &trace_name) {
    const int32_t L = t.n_layer, E = t.n_expert, K = t.top_k, W = opt.window;
    const int32_t kp = opt.k_pred > 0 ? opt.k_pred : K, pf = opt.prefetch_per_layer > 0 ? opt.prefetch_per_layer : K;
    if (W < 1 || kp > E || pf > E) fail("eval: window {} must be >= 1 and k_pred {}, prefetch {} at most {}", W, kp, pf, E);
    if (p && (p->shape().n_layers != L || p->shape().n_experts != E || p->shape().top_k != K)) {
        fail("eval: predictor {} was made for {} layers, {} experts, top-{}; the trace has {}, {}, top-{}", p->name(),
             p->shape().n_layers, p->shape().n_experts, p->shape().top_k, L, E, K);
    }
    if (hidden && hidden->n_layer != L) fail("eval: sidecar has {} layers, the trace {}", hidden->n_layer, L);
    if (!hidden && p && p->needs_hidden()) {
        fail("predictor {} needs hidden states: pass --hidden (the trace's .hidden.zst sidecar)", p->name());
    }
    EvalResult r;
    r.predictor = p ? p->name() : "none";
    r.trace = trace_name;
    r.n_layers = L, r.window = W, r.k_pred = kp, r.top_k = K;
    r.group_start = opt.group_start;
    r.cells.assign(size_t(W) * size_t(L), {});

    std::vector<int64_t> row_of(size_t(t.n_tokens()), -1);
    if (hidden) {
        const std::vector<int64_t> flat = hidden->flat_token_indices(t);
        for (size_t i = 0; i < flat.size(); ++i) row_of[size_t(flat[i])] = int64_t(i);
    }
    std::unique_ptr<ExpertCache> cache;
    if (opt.cache_slots > 0) {
        if (opt.cache_slots < K || opt.cache_slots > E) {
            fail("eval: --cache-slots {} must be in [top_k {}, n_experts {}]", opt.cache_slots, K, E);
        }
        ExpertCacheConfig cc;
        cc.n_layers = L, cc.n_experts = E, cc.top_k = K;
        cc.expert_bytes = {256};
        cc.budget_bytes = 256ull * uint64_t(opt.cache_slots) * uint64_t(L);
        cc.policy = opt.policy;
        cache = std::make_unique<ExpertCache>(cc);
        r.cache_slots = opt.cache_slots;
        r.policy = eviction_policy_name(opt.policy);
    }
    auto *oracle = dynamic_cast<OraclePredictor *>(p);
    const int64_t D = hidden ? hidden->dim : 0;
    std::vector<float> x(size_t(L) * size_t(D)), scores(size_t(W) * size_t(E), 0.0f);
    std::vector<int32_t> ids(static_cast<size_t>(K)), sorted, order(static_cast<size_t>(E));
    std::vector<int64_t> replayed;  // trace token indices in replay order (for the offline optimum)
    const int32_t n_top = std::max(kp, pf);

    for (const auto &b : t.sequence_bounds()) {
        if (p) p->reset();
        for (int64_t i = b[0]; i < b[1]; ++i) {
            const bool covered = !hidden || row_of[size_t(i)] >= 0;
            if (!covered) continue;  // with a sidecar, only its tokens are replayed (every predictor alike)
            const bool show = p != nullptr;
            if (hidden) {
                for (int32_t l = 0; l < L; ++l) hidden->dequantize(row_of[size_t(i)], l, x.data() + size_t(l) * size_t(D));
            }
            if (oracle) oracle->set_token(i);
            for (int32_t l = 0; l < L; ++l) {
                const uint8_t *routed = t.ids(i, l);
                for (int32_t j = 0; j < K; ++j) ids[size_t(j)] = routed[j];
                if (cache) acquire_like_runtime(*cache, l, ids, sorted);
                if (show) {
                    const PredictorInput in{l, L, W, ids, 1, K, hidden ? x.data() + size_t(l) * size_t(D) : nullptr, D};
                    p->score(in, scores);
                }
                if (cache && show) cache->begin_prefetch_round();
                for (int32_t d = 1; d <= W && l + d < L; ++d) {
                    const float *row = scores.data() + size_t(d - 1) * size_t(E);
                    int32_t n_pred = 0;
                    if (show) {
                        std::iota(order.begin(), order.end(), 0);
                        std::partial_sort(order.begin(), order.begin() + n_top, order.end(), [&](int32_t a, int32_t c) {
                            return row[a] != row[c] ? row[a] > row[c] : a < c;
                        });
                        while (n_pred < n_top && row[order[size_t(n_pred)]] > 0.0f) ++n_pred;
                    }
                    if (cache && show) {
                        for (int32_t j = 0; j < std::min(n_pred, pf); ++j) cache->prefetch(l + d, order[size_t(j)]);
                    }
                    const int32_t np = std::min(n_pred, kp);
                    const uint8_t *actual = t.ids(i, l + d);
                    int32_t hits = 0;
                    for (int32_t j = 0; j < np; ++j) {
                        for (int32_t a = 0; a < K; ++a) hits += order[size_t(j)] == actual[a];
                    }
                    EvalCell &c = r.cells[size_t(d - 1) * size_t(L) + size_t(l + d)];
                    c.recall += double(hits) / K;
                    if (np > 0) c.precision += double(hits) / np, ++c.n_nonempty;
                    c.exact += (hits == K && np == K);
                    ++c.n;
                }
            }
            ++r.n_tokens;
            replayed.push_back(i);
        }
    }
    if (cache) {
        const LayerStats s = cache->total_stats();
        r.hit_rate = s.hit_rate();
        r.prefetch_hit_share = s.hits ? double(s.prefetch_hits) / double(s.hits) : 0.0;
        r.prefetch_loads = s.prefetch_loads;
        r.demand_misses = s.demand_misses;
        r.accesses = s.accesses();
        r.belady_hit_rate = belady_hit_rate(t, replayed, opt.cache_slots);
    }
    return r;
}

double belady_hit_rate(const RoutingTrace &t, std::span<const int64_t> tokens, int32_t slots_per_layer) {
    const int32_t L = t.n_layer, E = t.n_expert, K = t.top_k;
    PRESCOPE_ASSERT(slots_per_layer >= K && slots_per_layer <= E);
    const auto n = int64_t(tokens.size());
    constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
    uint64_t hits = 0, accesses = 0;
    std::vector<int64_t> next_use(static_cast<size_t>(n) * static_cast<size_t>(K));  // [n][K]: next position using it
    const auto n_exp = static_cast<size_t>(E);
    std::vector<int64_t> upcoming(n_exp);
    std::vector<int64_t> resident_next(n_exp);  // next use of each resident expert, -1 = not resident
    std::vector<uint8_t> wanted(n_exp);
    for (int32_t l = 0; l < L; ++l) {
        std::fill(upcoming.begin(), upcoming.end(), kNever);
        for (int64_t p = n - 1; p >= 0; --p) {
            const uint8_t *ids = t.ids(tokens[size_t(p)], l);
            for (int32_t j = 0; j < K; ++j) {
                next_use[size_t(p) * size_t(K) + size_t(j)] = upcoming[ids[j]];
                upcoming[ids[j]] = p;
            }
        }
        std::fill(resident_next.begin(), resident_next.end(), -1);
        int32_t n_resident = 0;
        for (int64_t p = 0; p < n; ++p) {
            const uint8_t *ids = t.ids(tokens[size_t(p)], l);
            for (int32_t j = 0; j < K; ++j) wanted[ids[j]] = 1;
            for (int32_t j = 0; j < K; ++j) {
                const int32_t e = ids[j];
                ++accesses;
                if (resident_next[size_t(e)] >= 0) {
                    ++hits;
                } else if (n_resident == slots_per_layer) {
                    // Evict the resident expert, not used by this token, whose next use is farthest away.
                    int32_t victim = -1;
                    for (int32_t c = 0; c < E; ++c) {
                        if (resident_next[size_t(c)] < 0 || wanted[size_t(c)]) continue;
                        if (victim < 0 || resident_next[size_t(c)] > resident_next[size_t(victim)]) victim = c;
                    }
                    PRESCOPE_ASSERT(victim >= 0);
                    resident_next[size_t(victim)] = -1;
                    --n_resident;
                }
                if (resident_next[size_t(e)] < 0) ++n_resident;
                resident_next[size_t(e)] = next_use[size_t(p) * size_t(K) + size_t(j)];
            }
            for (int32_t j = 0; j < K; ++j) wanted[ids[j]] = 0;
        }
    }
    return accesses ? double(hits) / double(accesses) : 0.0;
}

} // namespace prescope
