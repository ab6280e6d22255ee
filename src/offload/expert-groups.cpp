// Expert groups: routing statistics, the grouping heuristic, balance and dispatch measures, JSON.
#include "offload/expert-groups.h"

#include "core/error.h"
#include "core/json-file.h"
#include "core/output-file.h"
#include "offload/trace.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <numeric>

namespace prescope {

namespace {

constexpr int kSwapPasses = 8;  // each pass tries every pair once; the tiny and real shapes settle in 2-4

void check_gpus(int32_t n_gpus, int32_t n_experts, std::string_view source) {
    if (n_gpus < 1 || n_gpus > ExpertGroups::MAX_GPUS || n_gpus > n_experts) {
        fail("{}: expected 1 to {} GPUs and no more GPUs than the {} experts of a layer, got {}", source,
             std::min(ExpertGroups::MAX_GPUS, n_experts), n_experts, n_gpus);
    }
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------
// ExpertGroups

ExpertGroups ExpertGroups::contiguous(int32_t n_layers, int32_t n_experts, int32_t n_gpus) {
    PRESCOPE_ASSERT(n_layers >= 1 && n_gpus >= 1 && n_gpus <= std::min(MAX_GPUS, n_experts));
    ExpertGroups g;
    g.n_gpus = n_gpus;
    g.n_layers = n_layers;
    g.n_experts = n_experts;
    g.gpu.resize(size_t(n_layers) * size_t(n_experts));
    for (int32_t l = 0; l < n_layers; ++l) {
        int32_t e = 0;
        for (int32_t i = 0; i < n_gpus; ++i) {
            for (int32_t c = g.capacity(i); c > 0; --c) g.gpu[size_t(l) * size_t(n_experts) + size_t(e++)] = int8_t(i);
        }
    }
    return g;
}

void ExpertGroups::check_shape(int32_t model_moe_layers, int32_t model_experts, int32_t gpus,
                               std::string_view source) const {
    if (n_layers != model_moe_layers || n_experts != model_experts) {
        fail("{}: expert groups for {} MoE layers x {} experts, the model has {} x {}", source, n_layers, n_experts,
             model_moe_layers, model_experts);
    }
    if (n_gpus != gpus) fail("{}: expert groups for {} GPUs, --gpus is {}", source, n_gpus, gpus);
}

nlohmann::json ExpertGroups::to_json() const {
    nlohmann::json layers = nlohmann::json::array();
    for (int32_t l = 0; l < n_layers; ++l) {
        std::string s(size_t(n_experts), '0');
        for (int32_t e = 0; e < n_experts; ++e) s[size_t(e)] = char('0' + gpu_of(l, e));
        layers.push_back(std::move(s));
    }
    return {{"format", "prescope-expert-groups"},
            {"version", 1},
            {"n_gpus", n_gpus},
            {"n_layers", n_layers},
            {"n_experts", n_experts},
            {"tolerance", tolerance},
            {"legend", "one string per MoE layer (numbered from 0 as in routing traces), one digit per expert: the GPU "
                       "that holds it"},
            {"layers", std::move(layers)}};
}

ExpertGroups ExpertGroups::from_json(const nlohmann::json &j, std::string_view source) {
    check_json_header(j, source, "prescope-expert-groups", "expert groups");
    auto count = [&](const char *key, int64_t hi) {
        if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() < 1 ||
            j[key].get<int64_t>() > hi) {
            fail("{}: '{}' must be an integer in [1, {}]", source, key, hi);
        }
        return int32_t(j[key].get<int64_t>());
    };
    ExpertGroups g;
    g.n_layers = count("n_layers", 1 << 12);
    g.n_experts = count("n_experts", 1 << 12);
    g.n_gpus = count("n_gpus", MAX_GPUS);
    check_gpus(g.n_gpus, g.n_experts, fmt::format("{}: n_gpus", source));
    if (j.contains("tolerance")) {
        if (!j["tolerance"].is_number() || !(j["tolerance"].get<double>() >= 0 && j["tolerance"].get<double>() <= 10)) {
            fail("{}: 'tolerance' must be a number in [0, 10]", source);
        }
        g.tolerance = j["tolerance"].get<double>();
    }
    if (!j.contains("layers") || !j["layers"].is_array() || j["layers"].size() != size_t(g.n_layers)) {
        fail("{}: 'layers' must be an array of {} strings (n_layers)", source, g.n_layers);
    }
    g.gpu.resize(size_t(g.n_layers) * size_t(g.n_experts));
    std::vector<int32_t> held(size_t(g.n_gpus));
    for (int32_t l = 0; l < g.n_layers; ++l) {
        const nlohmann::json &row = j["layers"][size_t(l)];
        if (!row.is_string()) fail("{}: layers[{}] must be a string", source, l);
        const std::string &s = row.get_ref<const std::string &>();
        if (s.size() != size_t(g.n_experts)) {
            fail("{}: layers[{}] has {} characters, expected {} (n_experts)", source, l, s.size(), g.n_experts);
        }
        std::fill(held.begin(), held.end(), 0);
        for (int32_t e = 0; e < g.n_experts; ++e) {
            const char c = s[size_t(e)];
            if (c < '0' || c >= char('0' + g.n_gpus)) {
                fail("{}: layers[{}][{}] is '{}', expected a GPU from 0 to {}", source, l, e, c, g.n_gpus - 1);
            }
            g.gpu[size_t(l) * size_t(g.n_experts) + size_t(e)] = int8_t(c - '0');
            ++held[size_t(c - '0')];
        }
        for (int32_t i = 0; i < g.n_gpus; ++i) {
            if (held[size_t(i)] != g.capacity(i)) {
                fail("{}: layers[{}] gives GPU {} {} experts, expected {} (every GPU holds its share of the {} "
                     "experts)", source, l, i, held[size_t(i)], g.capacity(i), g.n_experts);
            }
        }
    }
    return g;
}

ExpertGroups ExpertGroups::load(const std::string &path) {
    return from_json(read_json_file(path, "expert groups"), path);
}

void ExpertGroups::save(const std::string &path) const { write_file_atomic(path, to_json().dump(2) + "\n"); }

// ---------------------------------------------------------------------------------------------------------------
// RoutingStats

RoutingStats::RoutingStats(int32_t n_layers_, int32_t n_experts_)
    : n_layers(n_layers_), n_experts(n_experts_), tokens(size_t(n_layers_)),
      load(size_t(n_layers_) * size_t(n_experts_)),
      coact(size_t(n_layers_) * size_t(n_experts_) * size_t(n_experts_)) {}

void RoutingStats::add(int32_t layer, std::span<const int32_t> ids, int64_t k) {
    PRESCOPE_ASSERT(layer >= 0 && layer < n_layers && k > 0 && ids.size() % size_t(k) == 0);
    const auto E = size_t(n_experts);
    uint32_t *ld = load.data() + size_t(layer) * E;
    uint32_t *co = coact.data() + size_t(layer) * E * E;
    const int64_t n_tok = int64_t(ids.size()) / k;
    tokens[size_t(layer)] += uint64_t(n_tok);
    for (int64_t t = 0; t < n_tok; ++t) {
        const int32_t *x = ids.data() + t * k;
        for (int64_t j = 0; j < k; ++j) {
            PRESCOPE_ASSERT(x[j] >= 0 && x[j] < n_experts);
            ++ld[x[j]];
            for (int64_t i = 0; i < j; ++i) {
                if (x[i] == x[j]) continue;  // a repeated id (a damaged trace) is no pair
                ++co[size_t(x[i]) * E + size_t(x[j])];
                ++co[size_t(x[j]) * E + size_t(x[i])];
            }
        }
    }
}

RoutingStats RoutingStats::of_trace(const RoutingTrace &t) {
    RoutingStats s(t.n_layer, t.n_expert);
    std::vector<int32_t> ids(size_t(t.top_k));
    for (int64_t tok = 0; tok < t.n_tokens(); ++tok) {
        for (int32_t l = 0; l < t.n_layer; ++l) {
            std::copy_n(t.ids(tok, l), t.top_k, ids.begin());
            s.add(l, ids, t.top_k);
        }
    }
    return s;
}

void RoutingStats::decay(int32_t layer) {
    const auto E = size_t(n_experts);
    tokens[size_t(layer)] /= 2;
    for (size_t e = 0; e < E; ++e) load[size_t(layer) * E + e] /= 2;
    for (size_t i = 0; i < E * E; ++i) coact[size_t(layer) * E * E + i] /= 2;
}

// ---------------------------------------------------------------------------------------------------------------
// balance and planning

GroupBalance group_balance(const ExpertGroups &groups, const RoutingStats &stats, int32_t layer) {
    PRESCOPE_ASSERT(groups.n_layers == stats.n_layers && groups.n_experts == stats.n_experts);
    const int32_t E = groups.n_experts;
    std::vector<double> gload(size_t(groups.n_gpus), 0.0);
    double total = 0;
    for (int32_t e = 0; e < E; ++e) {
        const double x = stats.load[size_t(layer) * size_t(E) + size_t(e)];
        gload[size_t(groups.gpu_of(layer, e))] += x;
        total += x;
    }
    GroupBalance b;
    if (total > 0) b.imbalance = *std::max_element(gload.begin(), gload.end()) / (total / groups.n_gpus);
    double pairs = 0, together = 0;
    for (int32_t a = 0; a < E; ++a) {
        for (int32_t c = a + 1; c < E; ++c) {
            const double n = stats.coact_at(layer, a, c);
            pairs += n;
            if (groups.gpu_of(layer, a) == groups.gpu_of(layer, c)) together += n;
        }
    }
    b.co_located = pairs > 0 ? together / pairs : 1.0;
    return b;
}

void plan_layer_groups(const RoutingStats &stats, int32_t layer, ExpertGroups &groups) {
    PRESCOPE_ASSERT(groups.n_layers == stats.n_layers && groups.n_experts == stats.n_experts);
    const int32_t E = groups.n_experts, G = groups.n_gpus;
    const uint32_t *load = stats.load.data() + size_t(layer) * size_t(E);
    const auto co = [&](int32_t a, int32_t b) { return int64_t(stats.coact_at(layer, a, b)); };
    const double cap = (1.0 + groups.tolerance) * double(std::accumulate(load, load + E, uint64_t(0))) / G;
    int8_t *row = groups.gpu.data() + size_t(layer) * size_t(E);

    // Greedy: heaviest expert first, onto the GPU with room it shares most co-activations with, within the cap.
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return load[a] > load[b]; });
    std::vector<int64_t> gload(size_t(G), 0);
    std::vector<int32_t> held(size_t(G), 0);
    std::vector<int64_t> aff(size_t(E) * size_t(G), 0);  // [E][G]: co-activations of e with GPU g's experts
    const auto affinity = [&](int32_t e, int32_t g) -> int64_t & { return aff[size_t(e) * size_t(G) + size_t(g)]; };
    for (const int32_t e : order) {
        int32_t best = -1;
        bool best_fits = false;
        for (int32_t g = 0; g < G; ++g) {
            if (held[size_t(g)] >= groups.capacity(g)) continue;
            const bool fits = double(gload[size_t(g)] + load[e]) <= cap;
            if (best < 0 || (fits && !best_fits)) {
                best = g, best_fits = fits;
                continue;
            }
            if (fits != best_fits) continue;
            const int64_t da = affinity(e, g) - affinity(e, best);
            const int64_t dl = gload[size_t(g)] - gload[size_t(best)];
            if ((fits && (da > 0 || (da == 0 && dl < 0))) || (!fits && dl < 0)) best = g;
        }
        row[e] = int8_t(best);
        gload[size_t(best)] += load[e];
        ++held[size_t(best)];
        for (int32_t f = 0; f < E; ++f) affinity(f, best) += co(e, f);
    }

    // Swaps: first lower the load above the cap, then raise the co-activation within GPUs.
    const auto excess = [&](double x) { return std::max(0.0, x - cap); };
    for (int pass = 0; pass < kSwapPasses; ++pass) {
        bool swapped = false;
        for (int32_t a = 0; a < E; ++a) {
            for (int32_t b = a + 1; b < E; ++b) {
                const int32_t p = row[a], q = row[b];
                if (p == q) continue;
                const int64_t np = gload[size_t(p)] - load[a] + load[b], nq = gload[size_t(q)] - load[b] + load[a];
                const double before = excess(double(gload[size_t(p)])) + excess(double(gload[size_t(q)]));
                const double after = excess(double(np)) + excess(double(nq));
                const int64_t gain =
                    affinity(a, q) - co(a, b) - affinity(a, p) + affinity(b, p) - co(a, b) - affinity(b, q);
                if (!(after < before || (after == before && gain > 0))) continue;
                row[a] = int8_t(q), row[b] = int8_t(p);
                gload[size_t(p)] = np, gload[size_t(q)] = nq;
                for (int32_t f = 0; f < E; ++f) {
                    affinity(f, p) += co(f, b) - co(f, a);
                    affinity(f, q) += co(f, a) - co(f, b);
                }
                swapped = true;
            }
        }
        if (!swapped) break;
    }
}

ExpertGroups plan_expert_groups(const RoutingStats &stats, int32_t n_gpus, double tolerance) {
    check_gpus(n_gpus, stats.n_experts, "expert groups");
    if (!(tolerance >= 0 && tolerance <= 10)) fail("expert groups: the tolerance must be in [0, 10], got {}", tolerance);
    ExpertGroups g = ExpertGroups::contiguous(stats.n_layers, stats.n_experts, n_gpus);
    g.tolerance = tolerance;
    for (int32_t l = 0; l < stats.n_layers; ++l) plan_layer_groups(stats, l, g);
    return g;
}

std::vector<double> gpus_per_token(const ExpertGroups &groups, const RoutingTrace &t, std::string_view source) {
    if (t.n_layer != groups.n_layers || t.n_expert != groups.n_experts) {
        fail("{}: a trace of {} MoE layers x {} experts, the expert groups are for {} x {}", source, t.n_layer,
             t.n_expert, groups.n_layers, groups.n_experts);
    }
    std::vector<double> out(size_t(t.n_layer), 0.0);
    if (t.n_tokens() == 0) return out;
    for (int32_t l = 0; l < t.n_layer; ++l) {
        uint64_t sum = 0;
        for (int64_t tok = 0; tok < t.n_tokens(); ++tok) {
            unsigned mask = 0;
            for (int32_t j = 0; j < t.top_k; ++j) mask |= 1u << groups.gpu_of(l, t.ids(tok, l)[j]);
            sum += uint64_t(std::popcount(mask));
        }
        out[size_t(l)] = double(sum) / double(t.n_tokens());
    }
    return out;
}

} // namespace prescope
