// PlacementPlan (factories, summary, JSON) and the hybrid HIT / FETCH / CPU decision of one layer.
#include "offload/placement.h"

#include "core/error.h"
#include "core/json-file.h"
#include "core/output-file.h"
#include "offload/expert-cache.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>

namespace prescope {

namespace {

constexpr char kHomeChars[] = {'G', 'P', 'M'};  // by HomeTier
constexpr char kExecChars[] = {'G', 'C', 'A'};  // by ExecSite

} // namespace

PlacementPlan PlacementPlan::uniform(int32_t n_layers, int32_t n_experts, ExpertPlacement p) {
    PRESCOPE_ASSERT(n_layers > 0 && n_experts > 0);
    PlacementPlan plan;
    plan.n_layers = n_layers;
    plan.n_experts = n_experts;
    plan.experts.assign(size_t(n_layers) * size_t(n_experts), p);
    return plan;
}

PlacementPlan PlacementPlan::cpu_layers(int32_t n_layers, int32_t n_experts, int32_t n_cpu_layers) {
    PlacementPlan plan = uniform(n_layers, n_experts, {HomeTier::GPU, ExecSite::GPU});
    for (int32_t l = 0; l < std::min(n_cpu_layers, n_layers); ++l) {
        for (int32_t e = 0; e < n_experts; ++e) plan.at(l, e) = {HomeTier::MMAP, ExecSite::CPU};
    }
    return plan;
}

void PlacementPlan::check_shape(int32_t model_layers, int32_t model_experts, std::string_view source) const {
    if (n_layers != model_layers || n_experts != model_experts) {
        fail("{}: placement plan is for {} layers x {} experts, the model has {} x {}", source, n_layers, n_experts,
             model_layers, model_experts);
    }
}

std::string PlacementPlan::summary() const {
    auto line = [&](int32_t l) {
        int home[3] = {0, 0, 0}, exec[3] = {0, 0, 0};
        for (int32_t e = 0; e < n_experts; ++e) {
            ++home[int(at(l, e).home)];
            ++exec[int(at(l, e).exec)];
        }
        return fmt::format("home gpu {} pinned {} mmap {}; exec gpu {} cpu {} auto {}", home[0], home[1], home[2],
                           exec[0], exec[1], exec[2]);
    };
    std::string out = fmt::format("placement: {} layers x {} experts\n", n_layers, n_experts);
    int32_t start = 0;
    std::string current = n_layers ? line(0) : "";
    for (int32_t l = 1; l <= n_layers; ++l) {
        std::string next = l < n_layers ? line(l) : "";
        if (l < n_layers && next == current) continue;
        std::string range = start == l - 1 ? fmt::format("layer {}", start) : fmt::format("layers {}-{}", start, l - 1);
        out += fmt::format("  {:<14} {}\n", range + ":", current);
        start = l;
        current = next;
    }
    return out;
}

nlohmann::json PlacementPlan::to_json() const {
    nlohmann::json layers = nlohmann::json::array();
    for (int32_t l = 0; l < n_layers; ++l) {
        std::string home(size_t(n_experts), ' '), exec(size_t(n_experts), ' ');
        for (int32_t e = 0; e < n_experts; ++e) {
            home[size_t(e)] = kHomeChars[int(at(l, e).home)];
            exec[size_t(e)] = kExecChars[int(at(l, e).exec)];
        }
        layers.push_back({{"home", home}, {"exec", exec}});
    }
    return {{"format", "prescope-placement"},
            {"version", 1},
            {"n_layers", n_layers},
            {"n_experts", n_experts},
            {"legend",
             {{"home", "one character per expert: G = fixed GPU slot, P = pinned host memory, M = mapped file"},
              {"exec", "one character per expert: G = GPU, C = CPU, A = per step by the hybrid rule"}}},
            {"layers", std::move(layers)}};
}

PlacementPlan PlacementPlan::from_json(const nlohmann::json &j, std::string_view source) {
    check_json_header(j, source, "prescope-placement", "a placement plan");
    auto get_count = [&](const char *key) {
        if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() <= 0 ||
            j[key].get<int64_t>() > (1 << 20)) {
            fail("{}: '{}' must be a positive integer", source, key);
        }
        return int32_t(j[key].get<int64_t>());
    };
    PlacementPlan plan = uniform(get_count("n_layers"), get_count("n_experts"));
    if (!j.contains("layers") || !j["layers"].is_array() || j["layers"].size() != size_t(plan.n_layers)) {
        fail("{}: 'layers' must be an array of {} entries (n_layers)", source, plan.n_layers);
    }
    for (int32_t l = 0; l < plan.n_layers; ++l) {
        const nlohmann::json &layer = j["layers"][size_t(l)];
        for (const char *field : {"home", "exec"}) {
            bool is_home = field[0] == 'h';
            if (!layer.is_object() || !layer.contains(field) || !layer[field].is_string()) {
                fail("{}: layers[{}].{} must be a string", source, l, field);
            }
            const std::string &s = layer[field].get_ref<const std::string &>();
            if (s.size() != size_t(plan.n_experts)) {
                fail("{}: layers[{}].{} has {} characters, expected {} (n_experts)", source, l, field, s.size(),
                     plan.n_experts);
            }
            const char *chars = is_home ? kHomeChars : kExecChars;
            for (int32_t e = 0; e < plan.n_experts; ++e) {
                const char *hit = std::find(chars, chars + 3, s[size_t(e)]);
                if (hit == chars + 3) {
                    fail("{}: layers[{}].{}[{}] is '{}', expected one of {}", source, l, field, e, s[size_t(e)],
                         is_home ? "G P M" : "G C A");
                }
                if (is_home) plan.at(l, e).home = HomeTier(hit - chars);
                else plan.at(l, e).exec = ExecSite(hit - chars);
            }
        }
    }
    return plan;
}

PlacementPlan PlacementPlan::load(const std::string &path) {
    return from_json(read_json_file(path, "placement plan"), path);
}

void PlacementPlan::save(const std::string &path) const {
    write_file_atomic(path, to_json().dump(2) + "\n");
}

// --- hybrid decision ----------------------------------------------------------------------------------------

const char *expert_action_name(ExpertAction a) {
    switch (a) {
    case ExpertAction::HIT: return "hit";
    case ExpertAction::FETCH: return "fetch";
    case ExpertAction::CPU: return "cpu";
    case ExpertAction::STREAM: return "stream";
    }
    return "?";
}

void LayerDecision::reserve(int32_t n_experts) {
    experts.reserve(size_t(n_experts));
    tokens.assign(size_t(n_experts), 0);
    order.assign(size_t(n_experts), 0);
}

std::string LayerDecision::describe() const {
    std::string out = fmt::format("layer {}:", layer);
    for (ExpertAction a : {ExpertAction::HIT, ExpertAction::FETCH, ExpertAction::STREAM, ExpertAction::CPU}) {
        const int32_t n = a == ExpertAction::HIT     ? n_hit
                          : a == ExpertAction::FETCH  ? n_fetch
                          : a == ExpertAction::STREAM ? n_stream
                                                      : n_cpu;
        if (a == ExpertAction::STREAM && n == 0) continue;
        out += fmt::format(" {} {} [", expert_action_name(a), n);
        bool first = true;
        for (const RoutedExpert &r : experts) {
            if (r.action != a) continue;
            out += fmt::format("{}{}:{}", first ? "" : " ", r.expert, r.n_tokens);
            first = false;
        }
        out += "]";
    }
    return out;
}

void count_routed(int32_t layer, std::span<const int32_t> routed, int32_t n_experts, LayerDecision &out) {
    PRESCOPE_ASSERT(out.tokens.size() == size_t(n_experts));
    out.layer = layer;
    out.experts.clear();
    out.n_hit = out.n_fetch = out.n_cpu = out.n_stream = out.n_demoted = 0;
    std::fill(out.tokens.begin(), out.tokens.end(), 0);
    for (int32_t id : routed) {
        PRESCOPE_ASSERT(id >= 0 && id < n_experts);
        ++out.tokens[size_t(id)];
    }
    for (int32_t e = 0; e < n_experts; ++e) {
        if (out.tokens[size_t(e)] > 0) out.experts.push_back({e, out.tokens[size_t(e)], ExpertAction::CPU, -1});
    }
    out.n_cpu = int32_t(out.experts.size());
}

void decide_layer(int32_t layer, std::span<const int32_t> routed, const PlacementPlan &plan,
                  const ExpertCache *cache, const HybridRule &rule, LayerDecision &out) {
    const int32_t E = plan.n_experts;
    PRESCOPE_ASSERT(layer >= 0 && layer < plan.n_layers && out.tokens.size() == size_t(E));
    PRESCOPE_ASSERT(!cache || (cache->n_layers() == plan.n_layers && cache->n_experts() == E));
    count_routed(layer, routed, E, out);
    out.experts.clear();
    out.n_cpu = 0;

    int32_t room = cache ? cache->layer_slots(layer) - cache->layer_fixed(layer) : 0;
    int32_t n_candidates = 0;
    for (int32_t e = 0; e < E; ++e) {
        int32_t n = out.tokens[size_t(e)];
        if (n == 0) continue;
        const ExpertPlacement &p = plan.at(layer, e);
        RoutedExpert r{e, n, ExpertAction::CPU, -1};
        int32_t slot = cache ? cache->find(layer, e) : -1;
        if (p.exec == ExecSite::CPU || !cache) {
            r.action = ExpertAction::CPU;
        } else if (slot >= 0) {
            r.action = ExpertAction::HIT;
            if (!cache->slot_fixed(slot)) --room;
        } else if (p.exec == ExecSite::GPU || n >= rule.cpu_threshold) {
            r.action = ExpertAction::FETCH;
            out.order[size_t(n_candidates++)] = int32_t(out.experts.size());
        }
        out.experts.push_back(r);
    }

    // Fetches compete for the slots the hits leave: forced-GPU experts first, then the most tokens.
    auto forced = [&](int32_t i) { return plan.at(layer, out.experts[size_t(i)].expert).exec == ExecSite::GPU; };
    std::sort(out.order.begin(), out.order.begin() + n_candidates, [&](int32_t a, int32_t b) {
        if (forced(a) != forced(b)) return forced(a);
        const RoutedExpert &x = out.experts[size_t(a)], &y = out.experts[size_t(b)];
        return x.n_tokens != y.n_tokens ? x.n_tokens > y.n_tokens : x.expert < y.expert;
    });
    // A big batch streams the rest through slots that earlier waves free (if the layer has slots that are not
    // fixed); a small one runs it on the CPU.
    const bool stream = cache && rule.stream_min_batch > 0 && cache->top_k() > 0 &&
                        cache->layer_slots(layer) > cache->layer_fixed(layer) &&
                        int64_t(routed.size()) >= int64_t(rule.stream_min_batch) * cache->top_k();
    for (int32_t i = std::max(room, 0); i < n_candidates; ++i) {
        int32_t idx = out.order[size_t(i)];
        if (forced(idx)) continue;
        out.experts[size_t(idx)].action = stream ? ExpertAction::STREAM : ExpertAction::CPU;
        if (!stream) ++out.n_demoted;
    }
    for (const RoutedExpert &r : out.experts) {
        switch (r.action) {
        case ExpertAction::HIT: ++out.n_hit; break;
        case ExpertAction::FETCH: ++out.n_fetch; break;
        case ExpertAction::STREAM: ++out.n_stream; break;
        case ExpertAction::CPU: ++out.n_cpu; break;
        }
    }
}

} // namespace prescope
