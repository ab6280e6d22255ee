// PreSched: the timing model of one layer (evaluate_plan), the online heuristic (Scheduler), the threshold
// rule on the same state, and the state's JSON form (layer-state dumps for `prescope schedule-check`).
#include "offload/scheduler.h"

#include "core/error.h"
#include "offload/cost-model.h"
#include "offload/expert-cache.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

namespace prescope {

// ---------------------------------------------------------------------------------------------------------------
// timing model

bool plan_splits(const LayerDecision &d) { return d.n_cpu > 0 && d.n_fetch > 0 && d.n_stream == 0; }

namespace {

/// The hits' wave: its end when it runs alone, and the latest arrival among them.
struct HitWave {
    bool any = false;
    double arrival_us = 0;
    double gpu_us = 0;  // sum of the hits' compute
};

HitWave hit_wave(const LayerState &s, const LayerDecision *d) {
    HitWave h;
    for (size_t i = 0; i < s.routed.size(); ++i) {
        const SchedExpert &x = s.routed[i];
        const bool hit = d ? d->experts[i].action == ExpertAction::HIT
                           : x.where != SchedResidency::MISSING && x.site != ExecSite::CPU;
        if (!hit) continue;
        h.any = true;
        h.gpu_us += x.gpu_us;
        if (x.where == SchedResidency::ARRIVING) h.arrival_us = std::max(h.arrival_us, x.arrival_us);
    }
    return h;
}

} // namespace

double prefetch_deadline_us(const LayerState &s, int32_t distance) {
    const HitWave h = hit_wave(s, nullptr);
    const double end = h.any ? h.arrival_us + s.wave_us + h.gpu_us : 0.0;
    return end + double(distance) * s.next_layer_us + double(std::max(distance - 1, 0)) * s.moe_estimate_us;
}

PlanTimes evaluate_plan(const LayerState &s, const LayerDecision &d, bool split,
                        const std::vector<PlannedPrefetch> &prefetch) {
    PRESCOPE_ASSERT(d.experts.size() == s.routed.size());
    const HitWave h = hit_wave(s, &d);
    double fetch_link = 0, fetch_gpu = 0, cpu = 0;
    bool any_fetch = false, any_cpu = false, any_stream = false;
    for (size_t i = 0; i < s.routed.size(); ++i) {
        const SchedExpert &x = s.routed[i];
        switch (d.experts[i].action) {
        case ExpertAction::FETCH:
            any_fetch = true;
            fetch_link += x.fetch_us;
            fetch_gpu += x.gpu_us;
            break;
        case ExpertAction::CPU:
            any_cpu = true;
            cpu += x.cpu_us;
            break;
        case ExpertAction::STREAM: any_stream = true; break;
        case ExpertAction::HIT: break;
        }
    }
    split = split && any_fetch && any_cpu && !any_stream;

    PlanTimes t;
    // The loads of the layer take slots in ascending id (FETCH, then the streamed waves), each evicting the
    // least recently used: the last wave_slots of them stay resident (all of them when nothing streams).
    int32_t after = 0;
    for (size_t i = s.routed.size(); i-- > 0;) {
        const ExpertAction a = d.experts[i].action;
        if (a != ExpertAction::FETCH && a != ExpertAction::STREAM) continue;
        if (after++ < std::max(s.wave_slots, 1)) t.residency_us += s.routed[i].install_us;
    }
    const double link0 = s.link_free_us + fetch_link;  // the wave-0 copies land
    // Host: blocked until the wave-0 copies are issued, then the predictor, then the CPU experts.
    double block = h.any ? h.arrival_us - s.issue_slack_us : 0.0;
    if (any_fetch && !split) block = std::max(block, link0 - s.issue_slack_us);
    const double cpu_start = std::max(block, 0.0) + s.host_us;
    t.cpu_end_us = cpu_start + (any_cpu ? s.cpu_layer_us + cpu : 0.0);

    double gpu_end = 0;
    if (split) {
        const double hits_end = h.any ? h.arrival_us + s.wave_us + h.gpu_us : 0.0;
        gpu_end = std::max({hits_end, link0, t.cpu_end_us}) + s.wave_us + fetch_gpu;
    } else if (h.any || any_fetch) {
        gpu_end = std::max(h.arrival_us, any_fetch ? link0 : 0.0) + s.wave_us + h.gpu_us + fetch_gpu;
    }
    double link_end = any_fetch ? link0 : s.link_free_us;
    if (any_stream) {
        PRESCOPE_ASSERT(s.wave_slots > 0);
        // Streamed experts in ascending id, wave_slots per wave; each wave's copies wait for the wave before.
        // Each wave takes every slot that is not fixed: only the last wave's experts stay resident.
        int32_t in_wave = 0;
        double wave_link = 0, wave_gpu = 0;
        auto close_wave = [&] {
            const double start = std::max(link_end, gpu_end);
            link_end = start + wave_link;
            gpu_end = std::max({link_end, gpu_end, t.cpu_end_us}) + s.wave_us + wave_gpu;
            in_wave = 0;
            wave_link = wave_gpu = 0;
        };
        for (size_t i = 0; i < s.routed.size(); ++i) {
            if (d.experts[i].action != ExpertAction::STREAM) continue;
            wave_link += s.routed[i].fetch_us;
            wave_gpu += s.routed[i].gpu_us;
            if (++in_wave == s.wave_slots) close_wave();
        }
        if (in_wave > 0) close_wave();
    }
    t.gpu_end_us = gpu_end;
    t.link_end_us = link_end;
    t.critical_us = std::max(gpu_end, t.cpu_end_us);

    // Expected stall of the next layers: every candidate's prob x miss, less those prefetched in time.
    double stall = 0;
    for (const SchedCandidate &c : s.candidates) stall += c.prob * c.miss_us;
    double link = link_end + s.prefetch_backlog_us;
    double speculative_us = 0;  // link time of the prefetches and installs
    const double hits_end = h.any ? h.arrival_us + s.wave_us + h.gpu_us : 0.0;
    for (const PlannedPrefetch &p : prefetch) {
        if (p.routed >= 0) {
            PRESCOPE_ASSERT(size_t(p.routed) < s.routed.size() && d.experts[size_t(p.routed)].action == ExpertAction::CPU);
            link += s.routed[size_t(p.routed)].fetch_us;
            speculative_us += s.routed[size_t(p.routed)].fetch_us;
            if (!any_stream) t.residency_us += s.routed[size_t(p.routed)].install_us;
            continue;
        }
        PRESCOPE_ASSERT(p.candidate >= 0 && size_t(p.candidate) < s.candidates.size());
        const SchedCandidate &c = s.candidates[size_t(p.candidate)];
        link += c.fetch_us;
        speculative_us += c.fetch_us;
        const double deadline = hits_end + double(c.distance) * s.next_layer_us +
                                double(std::max(c.distance - 1, 0)) * s.moe_estimate_us;
        if (link <= deadline) stall -= c.prob * c.miss_us;
        t.residency_us += c.install_us;
    }
    t.next_stall_us = std::max(stall, 0.0);
    t.link_cost_us = s.link_price * speculative_us;
    return t;
}

// ---------------------------------------------------------------------------------------------------------------
// decisions from choices; the threshold rule

namespace {

void count_actions(LayerDecision &d) {
    d.n_hit = d.n_fetch = d.n_cpu = d.n_stream = 0;
    for (const RoutedExpert &r : d.experts) {
        switch (r.action) {
        case ExpertAction::HIT: ++d.n_hit; break;
        case ExpertAction::FETCH: ++d.n_fetch; break;
        case ExpertAction::STREAM: ++d.n_stream; break;
        case ExpertAction::CPU: ++d.n_cpu; break;
        }
    }
}

void start_decision(const LayerState &s, LayerDecision &d) {
    d.layer = s.layer;
    d.experts.clear();
    d.n_demoted = 0;
    for (const SchedExpert &x : s.routed) d.experts.push_back({x.expert, x.n_tokens, ExpertAction::CPU, -1});
}

bool can_stream(const LayerState &s) { return s.stream && s.wave_slots > 0; }

} // namespace

void decision_from_choice(const LayerState &s, const std::vector<uint8_t> &gpu, LayerDecision &d) {
    start_decision(s, d);
    int32_t room = s.free_slots;
    for (size_t i = 0; i < s.routed.size(); ++i) {
        const SchedExpert &x = s.routed[i];
        ExpertAction &a = d.experts[i].action;
        if (x.site == ExecSite::CPU) a = ExpertAction::CPU;
        else if (x.where != SchedResidency::MISSING) a = ExpertAction::HIT;
        else if (!gpu[i]) a = ExpertAction::CPU;
        else if (room > 0 || !can_stream(s)) {
            a = ExpertAction::FETCH;  // beyond the free slots only forced-GPU experts (the loader then fails)
            --room;
        } else {
            a = ExpertAction::STREAM;
        }
    }
    count_actions(d);
}

void threshold_decision(const LayerState &s, int32_t cpu_threshold, LayerDecision &d) {
    start_decision(s, d);
    std::vector<int32_t> cand;
    for (size_t i = 0; i < s.routed.size(); ++i) {
        const SchedExpert &x = s.routed[i];
        ExpertAction &a = d.experts[i].action;
        if (x.site == ExecSite::CPU) a = ExpertAction::CPU;
        else if (x.where != SchedResidency::MISSING) a = ExpertAction::HIT;
        else if (x.site == ExecSite::GPU || x.n_tokens >= cpu_threshold) {
            a = ExpertAction::FETCH;
            cand.push_back(int32_t(i));
        }
    }
    // As decide_layer: forced-GPU first, then the most tokens; beyond the free slots STREAM or CPU.
    std::sort(cand.begin(), cand.end(), [&](int32_t a, int32_t b) {
        const SchedExpert &x = s.routed[size_t(a)], &y = s.routed[size_t(b)];
        if ((x.site == ExecSite::GPU) != (y.site == ExecSite::GPU)) return x.site == ExecSite::GPU;
        return x.n_tokens != y.n_tokens ? x.n_tokens > y.n_tokens : x.expert < y.expert;
    });
    for (size_t i = size_t(std::max(s.free_slots, 0)); i < cand.size(); ++i) {
        const auto idx = size_t(cand[i]);
        if (s.routed[idx].site == ExecSite::GPU) continue;
        d.experts[idx].action = can_stream(s) ? ExpertAction::STREAM : ExpertAction::CPU;
        if (!can_stream(s)) ++d.n_demoted;
    }
    count_actions(d);
}

// ---------------------------------------------------------------------------------------------------------------
// the heuristic

void candidate_priority_order(const LayerState &s, std::vector<int32_t> &order) {
    order.clear();
    for (size_t i = 0; i < s.candidates.size(); ++i) order.push_back(int32_t(i));
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        const SchedCandidate &x = s.candidates[size_t(a)], &y = s.candidates[size_t(b)];
        const double vx = x.prob * x.miss_us + x.install_us, vy = y.prob * y.miss_us + y.install_us;
        if (vx != vy) return vx > vy;
        return x.layer != y.layer ? x.layer < y.layer : x.expert < y.expert;
    });
}

void LayerPlan::reserve(int32_t n_experts, int32_t max_prefetch) {
    decision.reserve(n_experts);
    prefetch.reserve(size_t(std::max(max_prefetch, 0)) + size_t(n_experts));  // candidates, then installs
}

std::string LayerPlan::describe() const {
    std::string out = decision.describe();
    if (split) out += " (split)";
    if (!prefetch.empty()) {
        out += fmt::format(" prefetch {} [", prefetch.size());
        for (size_t i = 0; i < prefetch.size(); ++i) {
            out += fmt::format("{}{}:{}", i ? " " : "", prefetch[i].layer, prefetch[i].expert);
        }
        out += "]";
    }
    out += fmt::format(" | predicted gpu {:.0f} cpu {:.0f} link {:.0f} critical {:.0f} stall {:.0f} residency {:.0f} "
                       "link cost {:.0f} us ({})",
                       predicted.gpu_end_us, predicted.cpu_end_us, predicted.link_end_us, predicted.critical_us,
                       predicted.next_stall_us, predicted.residency_us, predicted.link_cost_us, rule);
    return out;
}

void Scheduler::reserve(int32_t n_experts, int32_t max_candidates) {
    order_.reserve(size_t(n_experts));
    installs_.reserve(size_t(n_experts));
    gains_.reserve(size_t(max_candidates + n_experts));
    gpu_.reserve(size_t(n_experts));
    cand_order_.reserve(size_t(max_candidates));
    best_.reserve(n_experts, max_candidates);
    trial_.reserve(n_experts, max_candidates);
}

void Scheduler::add_prefetches(const LayerState &s, LayerPlan &p, double link_end_us) {
    // Candidates in priority order (each whose gain is positive at its arrival), then the installs; when they
    // exceed the room, the smallest gains go (dropping a candidate only brings the later ones forward).
    p.prefetch.clear();
    const int32_t room = std::min(s.prefetch_room, config_.max_prefetch_in_flight);
    if (room <= 0) return;
    std::vector<int32_t> &per_layer_left = left_;
    per_layer_left.assign(s.next_free.begin(), s.next_free.end());
    gains_.clear();
    double link = link_end_us + s.prefetch_backlog_us;
    for (int32_t ci : cand_order_) {
        const SchedCandidate &c = s.candidates[size_t(ci)];
        if (c.prob * c.miss_us + c.install_us <= 0) break;  // sorted: nothing after this helps
        const auto d = size_t(c.distance - 1);
        if (d >= per_layer_left.size() || per_layer_left[d] <= 0) continue;
        const double deadline = prefetch_deadline_us(s, c.distance);
        const bool in_time = link + c.fetch_us <= deadline;
        // Worth its link time: in time, the stall it saves, and what its residency saves later.
        const double gain = (in_time ? c.prob * c.miss_us : 0.0) + c.install_us - s.link_price * c.fetch_us;
        if (gain <= 0) continue;
        link += c.fetch_us;
        --per_layer_left[d];
        p.prefetch.push_back({c.layer, c.expert, c.prob, link, deadline, -1, ci, -1});
        gains_.push_back(gain);
    }
    add_installs(s, p);
    while (int32_t(p.prefetch.size()) > room) {
        const auto worst = size_t(std::min_element(gains_.begin(), gains_.end()) - gains_.begin());
        p.prefetch.erase(p.prefetch.begin() + ptrdiff_t(worst));
        gains_.erase(gains_.begin() + ptrdiff_t(worst));
    }
}

void Scheduler::add_installs(const LayerState &s, LayerPlan &p) {
    // CPU-run misses worth keeping, copied behind everything else into the layer's slots the plan leaves free;
    // never in a layer that streams (its waves take every slot).
    if (p.decision.n_stream > 0) return;
    int32_t slots = s.free_slots - p.decision.n_fetch;
    installs_.clear();
    for (size_t i = 0; i < s.routed.size(); ++i) {
        const SchedExpert &x = s.routed[i];
        if (p.decision.experts[i].action == ExpertAction::CPU && x.where == SchedResidency::MISSING &&
            x.site == ExecSite::AUTO && x.install_us > s.link_price * x.fetch_us) {
            installs_.push_back(int32_t(i));
        }
    }
    std::sort(installs_.begin(), installs_.end(), [&](int32_t a, int32_t b) {
        const SchedExpert &x = s.routed[size_t(a)], &y = s.routed[size_t(b)];
        return x.install_us != y.install_us ? x.install_us > y.install_us : x.expert < y.expert;
    });
    for (int32_t i : installs_) {
        if (slots <= 0) break;
        p.prefetch.push_back({s.layer, s.routed[size_t(i)].expert, 1.0, 0, 0, -1, -1, i});
        gains_.push_back(s.routed[size_t(i)].install_us - s.link_price * s.routed[size_t(i)].fetch_us);
        --slots;
    }
}

double Scheduler::evaluate(const LayerState &s, LayerPlan &p) {
    decision_from_choice(s, gpu_, p.decision);
    p.split = plan_splits(p.decision);
    const PlanTimes demand = evaluate_plan(s, p.decision, p.split, {});
    add_prefetches(s, p, demand.link_end_us);
    p.predicted = evaluate_plan(s, p.decision, p.split, p.prefetch);
    return p.predicted.objective();
}

void Scheduler::plan_prefetch(const LayerState &s, LayerPlan &p) {
    candidate_priority_order(s, cand_order_);
    const PlanTimes demand = evaluate_plan(s, p.decision, p.split, {});
    add_prefetches(s, p, demand.link_end_us);
    p.predicted = evaluate_plan(s, p.decision, p.split, p.prefetch);
}

void Scheduler::plan(const LayerState &s, LayerPlan &out) {
    const size_t n = s.routed.size();
    order_.clear();
    gpu_.assign(n, 0);
    int32_t forced = 0;
    for (size_t i = 0; i < n; ++i) {
        const SchedExpert &x = s.routed[i];
        if (x.where != SchedResidency::MISSING || x.site == ExecSite::CPU) continue;
        if (x.site == ExecSite::GPU) {
            gpu_[i] = 1;
            ++forced;
        } else if (s.wave_slots > 0) {
            order_.push_back(int32_t(i));
        }
    }
    // The link costs the same per expert of a layer, so the GPU should take the experts the CPU would spend
    // longest on: most CPU time first (most tokens, for the model's costs).
    std::sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
        const SchedExpert &x = s.routed[size_t(a)], &y = s.routed[size_t(b)];
        if (x.cpu_us != y.cpu_us) return x.cpu_us > y.cpu_us;
        return x.n_tokens != y.n_tokens ? x.n_tokens > y.n_tokens : x.expert < y.expert;
    });
    candidate_priority_order(s, cand_order_);

    // Without streaming, AUTO experts on the GPU are limited to the free slots the forced ones leave.
    const auto max_gpu = int32_t(can_stream(s) ? order_.size()
                                                : std::clamp<int64_t>(s.free_slots - forced, 0, int64_t(order_.size())));
    double best = INFINITY;
    for (int32_t m = 0; m <= max_gpu; ++m) {
        if (m > 0) gpu_[size_t(order_[size_t(m - 1)])] = 1;
        const double j = evaluate(s, trial_);
        if (j < best) {
            best = j;
            std::swap(best_, trial_);
        }
    }
    // Local improvement while it helps: move one AUTO miss between the CPU and the GPU, or (small layers)
    // exchange a GPU one with a CPU one.
    if (!order_.empty()) {
        for (size_t i = 0; i < n; ++i) gpu_[i] = best_.decision.experts[i].action == ExpertAction::FETCH ||
                                                 best_.decision.experts[i].action == ExpertAction::STREAM;
        auto fits = [&] {
            int32_t on_gpu = forced;
            for (int32_t o : order_) on_gpu += gpu_[size_t(o)];
            return can_stream(s) || on_gpu <= std::max(s.free_slots, forced);
        };
        auto try_current = [&] {
            if (!fits()) return false;
            const double j = evaluate(s, trial_);
            if (j >= best - 1e-9) return false;
            best = j;
            std::swap(best_, trial_);
            return true;
        };
        const bool swaps = order_.size() <= 16;
        for (int pass = 0; pass < 4; ++pass) {
            bool improved = false;
            for (int32_t a : order_) {
                gpu_[size_t(a)] ^= 1;
                if (try_current()) improved = true;
                else gpu_[size_t(a)] ^= 1;
            }
            for (size_t ia = 0; swaps && ia < order_.size(); ++ia) {
                for (size_t ib = ia + 1; ib < order_.size(); ++ib) {
                    const auto a = size_t(order_[ia]), b = size_t(order_[ib]);
                    if (gpu_[a] == gpu_[b]) continue;
                    std::swap(gpu_[a], gpu_[b]);
                    if (try_current()) improved = true;
                    else std::swap(gpu_[a], gpu_[b]);
                }
            }
            if (!improved) break;
        }
    }
    out.decision.layer = best_.decision.layer;
    out.decision.experts.assign(best_.decision.experts.begin(), best_.decision.experts.end());
    out.decision.n_hit = best_.decision.n_hit;
    out.decision.n_fetch = best_.decision.n_fetch;
    out.decision.n_cpu = best_.decision.n_cpu;
    out.decision.n_stream = best_.decision.n_stream;
    out.decision.n_demoted = 0;
    out.split = best_.split;
    out.prefetch.assign(best_.prefetch.begin(), best_.prefetch.end());
    out.predicted = best_.predicted;
    out.rule = "cost";
}

// ---------------------------------------------------------------------------------------------------------------
// the state from the runtime

void layer_state_from_cache(int32_t layer, int32_t n_tokens, const LayerDecision &counted, const ExpertCache &cache,
                            const PlacementPlan &placement, const CostModel &cost, int32_t stream_min_batch,
                            LayerState &s) {
    s.layer = layer;
    s.n_tokens = n_tokens;
    s.wave_slots = cache.layer_slots(layer) - cache.layer_fixed(layer);
    s.stream = stream_min_batch > 0 && n_tokens >= stream_min_batch && s.wave_slots > 0;
    s.wave_us = cost.gpu_wave_us();
    s.cpu_layer_us = cost.cpu_layer_us();
    s.next_layer_us = cost.layer_us(n_tokens);
    s.routed.clear();
    int32_t room = s.wave_slots;
    const double fetch = cost.fetch_us();
    for (const RoutedExpert &r : counted.experts) {
        SchedExpert x;
        x.expert = r.expert;
        x.n_tokens = r.n_tokens;
        x.site = placement.at(layer, r.expert).exec;
        const int32_t slot = cache.find(layer, r.expert);
        if (slot >= 0) {
            x.where = SchedResidency::RESIDENT;  // the caller marks copies still in flight ARRIVING
            if (!cache.slot_fixed(slot) && x.site != ExecSite::CPU) --room;
        }
        x.gpu_us = cost.gpu_us(r.n_tokens);
        x.cpu_us = cost.cpu_us(r.n_tokens);
        x.fetch_us = fetch;
        s.routed.push_back(x);
    }
    s.free_slots = std::max(room, 0);
}

// ---------------------------------------------------------------------------------------------------------------
// JSON

namespace {

const char *residency_name(SchedResidency r) {
    return r == SchedResidency::RESIDENT ? "resident" : r == SchedResidency::ARRIVING ? "arriving" : "missing";
}

const char *site_name(ExecSite s) { return s == ExecSite::GPU ? "gpu" : s == ExecSite::CPU ? "cpu" : "auto"; }

double num(const nlohmann::json &j, const char *key, const std::string &src) {
    if (!j.contains(key) || !j[key].is_number() || !std::isfinite(j[key].get<double>())) {
        fail("{}: layer state: '{}' must be a finite number", src, key);
    }
    return j[key].get<double>();
}

int32_t count(const nlohmann::json &j, const char *key, const std::string &src) {
    const double v = num(j, key, src);
    if (v < 0 || v > double(1 << 30) || v != std::floor(v)) fail("{}: layer state: '{}' must be a count", src, key);
    return int32_t(v);
}

} // namespace

nlohmann::json LayerState::to_json() const {
    nlohmann::json r = nlohmann::json::array(), c = nlohmann::json::array();
    for (const SchedExpert &x : routed) {
        r.push_back({{"expert", x.expert}, {"tokens", x.n_tokens}, {"where", residency_name(x.where)},
                     {"site", site_name(x.site)}, {"gpu_us", x.gpu_us}, {"cpu_us", x.cpu_us},
                     {"fetch_us", x.fetch_us}, {"arrival_us", x.arrival_us}, {"install_us", x.install_us}});
    }
    for (const SchedCandidate &x : candidates) {
        c.push_back({{"layer", x.layer}, {"expert", x.expert}, {"distance", x.distance}, {"prob", x.prob},
                     {"fetch_us", x.fetch_us}, {"miss_us", x.miss_us}, {"install_us", x.install_us}});
    }
    return {{"layer", layer},
            {"tokens", n_tokens},
            {"free_slots", free_slots},
            {"wave_slots", wave_slots},
            {"stream", stream},
            {"link_free_us", link_free_us},
            {"issue_slack_us", issue_slack_us},
            {"host_us", host_us},
            {"wave_us", wave_us},
            {"cpu_layer_us", cpu_layer_us},
            {"prefetch_backlog_us", prefetch_backlog_us},
            {"next_layer_us", next_layer_us},
            {"moe_estimate_us", moe_estimate_us},
            {"prefetch_room", prefetch_room},
            {"link_price", link_price},
            {"next_free", next_free},
            {"routed", std::move(r)},
            {"candidates", std::move(c)}};
}

LayerState LayerState::from_json(const nlohmann::json &j, const std::string &src) {
    if (!j.is_object()) fail("{}: a layer state must be a JSON object", src);
    LayerState s;
    s.layer = count(j, "layer", src);
    s.n_tokens = count(j, "tokens", src);
    s.free_slots = count(j, "free_slots", src);
    s.wave_slots = count(j, "wave_slots", src);
    if (!j.contains("stream") || !j["stream"].is_boolean()) fail("{}: layer state: 'stream' must be true or false", src);
    s.stream = j["stream"].get<bool>();
    for (auto [key, field] : {std::pair{"link_free_us", &s.link_free_us}, {"issue_slack_us", &s.issue_slack_us},
                              {"host_us", &s.host_us}, {"wave_us", &s.wave_us}, {"cpu_layer_us", &s.cpu_layer_us},
                              {"prefetch_backlog_us", &s.prefetch_backlog_us}, {"next_layer_us", &s.next_layer_us},
                              {"moe_estimate_us", &s.moe_estimate_us}}) {
        *field = num(j, key, src);
        if (*field < 0) fail("{}: layer state: '{}' must be >= 0", src, key);
    }
    s.prefetch_room = count(j, "prefetch_room", src);
    // Dumps made before decision 0147 have no link price: the link was free then.
    s.link_price = j.contains("link_price") ? num(j, "link_price", src) : 0.0;
    if (!(s.link_price >= 0 && s.link_price <= 1)) fail("{}: layer state: 'link_price' must be in [0, 1]", src);
    if (!j.contains("next_free") || !j["next_free"].is_array()) fail("{}: layer state: 'next_free' must be an array", src);
    for (const nlohmann::json &v : j["next_free"]) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0) fail("{}: layer state: 'next_free' must hold counts", src);
        s.next_free.push_back(int32_t(v.get<int64_t>()));
    }
    if (!j.contains("routed") || !j["routed"].is_array()) fail("{}: layer state: 'routed' must be an array", src);
    for (const nlohmann::json &r : j["routed"]) {
        SchedExpert x;
        x.expert = count(r, "expert", src);
        x.n_tokens = count(r, "tokens", src);
        const std::string w = r.contains("where") && r["where"].is_string() ? r["where"].get<std::string>() : "";
        if (w == "resident") x.where = SchedResidency::RESIDENT;
        else if (w == "arriving") x.where = SchedResidency::ARRIVING;
        else if (w == "missing") x.where = SchedResidency::MISSING;
        else fail("{}: layer state: routed 'where' must be resident, arriving or missing", src);
        const std::string site = r.contains("site") && r["site"].is_string() ? r["site"].get<std::string>() : "";
        if (site == "gpu") x.site = ExecSite::GPU;
        else if (site == "cpu") x.site = ExecSite::CPU;
        else if (site == "auto") x.site = ExecSite::AUTO;
        else fail("{}: layer state: routed 'site' must be gpu, cpu or auto", src);
        x.gpu_us = num(r, "gpu_us", src);
        x.cpu_us = num(r, "cpu_us", src);
        x.fetch_us = num(r, "fetch_us", src);
        x.arrival_us = num(r, "arrival_us", src);
        x.install_us = r.contains("install_us") ? num(r, "install_us", src) : 0.0;
        if (!s.routed.empty() && x.expert <= s.routed.back().expert) {
            fail("{}: layer state: routed experts must be in ascending id", src);
        }
        s.routed.push_back(x);
    }
    if (!j.contains("candidates") || !j["candidates"].is_array()) {
        fail("{}: layer state: 'candidates' must be an array", src);
    }
    for (const nlohmann::json &c : j["candidates"]) {
        SchedCandidate x;
        x.layer = count(c, "layer", src);
        x.expert = count(c, "expert", src);
        x.distance = count(c, "distance", src);
        x.prob = num(c, "prob", src);
        x.fetch_us = num(c, "fetch_us", src);
        x.miss_us = num(c, "miss_us", src);
        x.install_us = c.contains("install_us") ? num(c, "install_us", src) : 0.0;
        if (x.distance < 1 || size_t(x.distance) > s.next_free.size()) {
            fail("{}: layer state: candidate distance {} outside 1..{}", src, x.distance, s.next_free.size());
        }
        s.candidates.push_back(x);
    }
    return s;
}

} // namespace prescope
