// LayerPlanner: state building, the two rules, candidates, corrections, dumps; apply_link_state.
#include "offload/layer-planner.h"

#include "core/error.h"
#include "offload/expert-cache.h"
#include "offload/layer-stats.h"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <exception>

namespace prescope {

namespace {

constexpr float kHistoryRate = 0.02f;  // weight of the newest step in the routing history (about 50 steps)

} // namespace

LayerPlanner::LayerPlanner(const PlacementPlan &placement, const ExpertCache *cache, const CostModel &cost,
                           const PlannerConfig &config, int32_t top_k)
    : placement_(placement), cache_(cache), cost_(cost), config_(config), top_k_(top_k),
      scheduler_(SchedulerConfig{config.max_prefetch_in_flight}) {
    const int32_t E = placement.n_experts, w = std::max(config_.prefetch_window, 0);
    if (config_.prefetch_max_per_layer <= 0) config_.prefetch_max_per_layer = top_k;
    const int32_t max_candidates = w * E;
    counted_.reserve(E);
    state_.routed.reserve(size_t(E));
    state_.candidates.reserve(size_t(max_candidates));
    state_.next_free.reserve(size_t(w));
    threshold_prefetch_.reserve(size_t(max_candidates));
    keep_.reserve(size_t(max_candidates));
    scheduler_.reserve(E, max_candidates);
    // Before any history every expert is as likely as any other: top_k of n_experts per step.
    const float prior = float(top_k) / float(std::max(E, 1));
    frequency_.assign(size_t(placement.n_layers) * size_t(E), prior);
    reuse_.assign(size_t(placement.n_layers), prior);
    misses_.assign(size_t(placement.n_layers), 0.0f);
    last_routed_.assign(size_t(placement.n_layers) * size_t(E), 0);
    if (!config_.dump_path.empty()) {
        dump_ = std::make_unique<OutputFile>(config_.dump_path);
        uncaught_at_start_ = std::uncaught_exceptions();
    }
}

LayerPlanner::~LayerPlanner() {
    // A planner destroyed by an exception leaves no dump; otherwise the dump is complete.
    if (!dump_ || std::uncaught_exceptions() > uncaught_at_start_) return;
    try {
        finish_dump();
    } catch (const Error &e) {
        spdlog::error("{}", e.what());
    }
}

void LayerPlanner::finish_dump() {
    if (!dump_) return;
    const std::unique_ptr<OutputFile> out = std::move(dump_);
    out->write(dump_buffer_);
    dump_buffer_.clear();
    out->commit();
}

bool LayerPlanner::begin(int32_t layer, std::span<const int32_t> routed, int32_t n_tokens) {
    routed_ = routed;
    candidates_set_ = false;
    keep_.clear();
    threshold_prefetch_.clear();
    count_routed(layer, routed, placement_.n_experts, counted_);
    LayerState &s = state_;
    if (cache_) {
        layer_state_from_cache(layer, n_tokens, counted_, *cache_, placement_, cost_, config_.stream_min_batch, s);
    } else {
        s.layer = layer;
        s.n_tokens = n_tokens;
        s.free_slots = s.wave_slots = 0;
        s.stream = false;
        s.routed.clear();
        for (const RoutedExpert &r : counted_.experts) {
            SchedExpert x;
            x.expert = r.expert;
            x.n_tokens = r.n_tokens;
            x.site = ExecSite::CPU;  // no GPU cache: the all-CPU plan
            x.cpu_us = cost_.cpu_us(r.n_tokens);
            s.routed.push_back(x);
        }
        s.wave_us = 0;
        s.cpu_layer_us = cost_.cpu_layer_us();
        s.next_layer_us = cost_.layer_us(n_tokens);
    }
    s.link_free_us = s.issue_slack_us = s.prefetch_backlog_us = 0;
    s.host_us = host_us_;
    s.moe_estimate_us = balancer_.layer_estimate_us();
    // Link time's price: the busy share squared, gentle while the link has room and 1 when it is saturated (queueing
    // delay grows faster than the load). In the simulator it beat the share itself at every budget (decision 0147).
    const double busy = config_.link_price ? balancer_.link_busy_share() : 0.0;
    s.link_price = busy * busy;
    s.prefetch_room = config_.max_prefetch_in_flight;
    const int32_t window = cache_ ? std::min(config_.prefetch_window, placement_.n_layers - 1 - layer) : 0;
    s.next_free.assign(size_t(std::max(window, 0)), 0);
    s.candidates.clear();
    if (!cache_) return false;

    // Residency: what fetching a missed expert saves the layer's later steps (it stays resident), from how
    // often the layer's experts come back; then the history moves on by this step.
    const int32_t E = placement_.n_experts;
    const size_t base = size_t(layer) * size_t(E);
    int32_t misses = 0;
    for (SchedExpert &x : s.routed) {
        if (x.where != SchedResidency::MISSING || x.site == ExecSite::CPU) continue;
        ++misses;
        x.install_us = install_us(layer, reuse_[size_t(layer)], frequency_[base + size_t(x.expert)]);
    }
    if (!s.stream) misses_[size_t(layer)] += kHistoryRate * (float(misses) - misses_[size_t(layer)]);
    int32_t again = 0, before = 0;
    for (int32_t e = 0; e < E; ++e) {
        const bool now = counted_.tokens[size_t(e)] > 0;
        before += last_routed_[base + size_t(e)];
        again += now && last_routed_[base + size_t(e)];
        last_routed_[base + size_t(e)] = now;
        frequency_[base + size_t(e)] += kHistoryRate * (float(now) - frequency_[base + size_t(e)]);
    }
    if (before > 0) reuse_[size_t(layer)] += kHistoryRate * (float(again) / float(before) - reuse_[size_t(layer)]);
    return misses > 0;
}

double LayerPlanner::victim_frequency(int32_t layer) const {
    const int32_t E = placement_.n_experts;
    int32_t resident = 0;
    double low = 1.0;
    for (int32_t e = 0; e < E; ++e) {
        const int32_t slot = cache_->find(layer, e);
        if (slot < 0) continue;
        ++resident;
        if (cache_->slot_fixed(slot) || (layer == state_.layer && counted_.tokens[size_t(e)] > 0)) continue;
        low = std::min(low, double(frequency_[size_t(layer) * size_t(E) + size_t(e)]));
    }
    return resident < cache_->layer_slots(layer) ? 0.0 : low;
}

double LayerPlanner::install_us(int32_t layer, double next, double frequency) const {
    // m misses shared ideally take T(m) = min over k of max(k f, (m - k) c); one more adds T(m + 1) - T(m):
    // min(c, f) for the first, about c f / (c + f) when there are many.
    const double c = cost_.cpu_us(1), f = cost_.fetch_us();
    const auto shared = [&](int32_t m) {
        double t = double(m) * c;
        for (int32_t k = 1; k <= m; ++k) t = std::min(t, std::max(double(k) * f, double(m - k) * c));
        return t;
    };
    const auto m = int32_t(std::lround(misses_[size_t(layer)]));
    // An expert stays about slots / (experts loaded per step) steps (LRU turnover), up to the horizon.
    const double turnover = double(cache_->layer_slots(layer)) / std::max(double(misses_[size_t(layer)]), 1.0 / 64);
    const double h = std::min(double(std::max(config_.residency_horizon, 0)), std::max(turnover, 1.0));
    if (h == 0) return 0.0;
    const double uses = next + (h - 1) * frequency - h * victim_frequency(layer);
    return std::max(uses, 0.0) * (shared(m + 1) - shared(m));
}

void LayerPlanner::set_candidates(std::span<const PrefetchRequest> predicted, int32_t n_pred_tokens) {
    candidates_set_ = true;
    LayerState &s = state_;
    if (!cost_rule()) {
        threshold_prefetch_.assign(predicted.begin(), predicted.end());
        return;
    }
    if (!cache_ || s.next_free.empty()) return;
    const double n_pred = double(std::max(n_pred_tokens, 1));
    const double fetch = cost_.fetch_us();
    std::fill(s.next_free.begin(), s.next_free.end(), 0);
    for (const PrefetchRequest &r : predicted) {
        const int32_t d = r.layer - s.layer;
        if (d < 1 || size_t(d) > s.next_free.size()) continue;
        if (placement_.at(r.layer, r.expert).exec == ExecSite::CPU) continue;
        if (cache_->find(r.layer, r.expert) >= 0) {
            keep_.push_back(r);
            continue;
        }
        SchedCandidate c;
        c.layer = r.layer;
        c.expert = r.expert;
        c.distance = d;
        c.prob = std::clamp(double(r.score) / n_pred, 0.0, 1.0);
        const auto tokens = int64_t(std::max(1.0, std::round(c.prob * double(s.n_tokens))));
        const double gpu = cost_.gpu_us(tokens);
        c.fetch_us = fetch;
        c.miss_us = std::max(std::min(cost_.cpu_us(tokens), fetch + gpu) - gpu, 0.0);
        // Routed there now (prob) -> likely again next step; later steps as often as it has been.
        const double f = frequency_[size_t(r.layer) * size_t(placement_.n_experts) + size_t(r.expert)];
        c.install_us = install_us(r.layer, c.prob * reuse_[size_t(r.layer)] + (1 - c.prob) * f, f);
        s.candidates.push_back(c);
    }
    // Slots a prefetch may take in layer l+d: those not fixed and not holding a predicted resident expert,
    // at most prefetch_max_per_layer.
    for (size_t d = 0; d < s.next_free.size(); ++d) {
        const int32_t l = s.layer + int32_t(d) + 1;
        int32_t kept = 0;
        for (const PrefetchRequest &k : keep_) kept += k.layer == l;
        s.next_free[d] = std::clamp(cache_->layer_slots(l) - cache_->layer_fixed(l) - kept, 0,
                                    config_.prefetch_max_per_layer);
    }
}

void LayerPlanner::plan_routed(LayerPlan &plan) {
    const LayerState &s = state_;
    if (cost_rule()) {
        scheduler_.plan(s, plan);
        if (!candidates_set_) plan.prefetch.clear();
    } else {
        // The manual override: decide_layer's rule as before the scheduler, and every prediction prefetched.
        decide_layer(s.layer, routed_, placement_, cache_, HybridRule{config_.cpu_threshold, config_.stream_min_batch},
                     plan.decision);
        plan.split = false;
        plan.rule = "threshold";
        plan.prefetch.clear();
        plan.predicted = evaluate_plan(s, plan.decision, false, {});
        if (candidates_set_) plan_prefetch(plan);
    }
    if (candidates_set_ && cost_rule()) dump();
}

void LayerPlanner::plan_prefetch(LayerPlan &plan) {
    const LayerState &s = state_;
    plan.prefetch.clear();
    if (!cost_rule()) {
        for (const PrefetchRequest &r : threshold_prefetch_) {
            plan.prefetch.push_back({r.layer, r.expert, double(r.score), 0, 0, -1, -1});
        }
        return;
    }
    scheduler_.plan_prefetch(s, plan);
    dump();
}

void LayerPlanner::observe(const LayerMeasurement &m, LayerStats &stats) {
    balancer_.observe(m, stats, config_.balance);
    cost_.corrections = balancer_.corrections();
}

void LayerPlanner::dump() {
    if (!dump_) return;
    dump_buffer_ += state_.to_json().dump();
    dump_buffer_ += '\n';
    if (dump_buffer_.size() >= (size_t(1) << 16)) {
        dump_->write(dump_buffer_);
        dump_buffer_.clear();
    }
}

void apply_link_state(LayerState &s, const ExpertCache &cache, const CopyEngine &engine, const CostModel &cost,
                      int32_t max_prefetch_in_flight) {
    const CopyBacklog b = engine.backlog();
    const double bytes_per_us = cost.link_gb_s() * 1e3;
    const CopyEngineConfig &ec = engine.config();
    s.issue_slack_us = double(uint64_t(ec.queue_depth) * ec.chunk_bytes) / bytes_per_us;
    double t = double(b.in_flight_bytes + b.demand_bytes) / bytes_per_us;
    double prefetch_bytes = double(b.prefetch_bytes);
    // Routed experts whose copy has not landed: the loader promotes them ahead of this layer's new demand.
    for (SchedExpert &x : s.routed) {
        if (x.where != SchedResidency::RESIDENT) continue;
        const int32_t slot = cache.find(s.layer, x.expert);
        const TicketState st = engine.state(cache.ticket(slot));
        if (st != TicketState::QUEUED && st != TicketState::ISSUING && st != TicketState::IN_FLIGHT) continue;
        x.where = SchedResidency::ARRIVING;
        if (st == TicketState::IN_FLIGHT) {
            x.arrival_us = double(b.in_flight_bytes) / bytes_per_us;
        } else {
            t += x.fetch_us;
            x.arrival_us = t;
            prefetch_bytes = std::max(prefetch_bytes - double(cache.expert_bytes(s.layer, x.expert)), 0.0);
        }
    }
    s.link_free_us = t;
    s.prefetch_backlog_us = prefetch_bytes / bytes_per_us;
    s.prefetch_room = std::max(max_prefetch_in_flight - b.prefetch_requests, 0);
}

} // namespace prescope
