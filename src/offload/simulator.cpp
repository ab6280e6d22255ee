// The simulator: a byte-level link queue (SimLink), the cache bookkeeping the loader does, the layer planner,
// and evaluate_plan with the machine's true costs for each layer's times.
#include "offload/simulator.h"

#include "core/error.h"
#include "offload/byte-size.h"
#include "offload/expert-cache.h"
#include "offload/layer-planner.h"
#include "offload/predictor-baselines.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>

namespace prescope {

namespace {

/// The copy engine as bytes over time: one request at a time, demand before prefetch at window boundaries (the
/// queue depth x chunk bytes already handed to the driver finish first), a fixed cost per request.
class SimLink {
  public:
    SimLink(int32_t n_layers, int32_t n_experts, double bytes_per_us, double request_us, uint64_t window_bytes)
        : n_experts_(n_experts), bytes_per_us_(bytes_per_us), request_us_(request_us), window_(window_bytes),
          pending_(size_t(n_layers) * size_t(n_experts), 0) {}

    struct Copy {
        int32_t layer = 0, expert = 0;
        uint64_t left = 0;
        bool started = false;
    };

    void push(int32_t layer, int32_t expert, uint64_t bytes, bool prefetch) {
        (prefetch ? prefetch_ : demand_).push_back({layer, expert, bytes, false});
        ++pending_[key(layer, expert)];
    }
    bool pending(int32_t layer, int32_t expert) const { return pending_[key(layer, expert)] > 0; }
    /// Drops a copy's bytes not yet handed out (the in-flight window still lands).
    void cancel(int32_t layer, int32_t expert) {
        for (auto *q : {&demand_, &prefetch_}) {
            for (size_t i = 0; i < q->size(); ++i) {
                Copy &c = (*q)[i];
                if (c.layer != layer || c.expert != expert) continue;
                if (q == current_ && i == 0 && committed_ > 0) {
                    c.left = committed_;
                } else {
                    q->erase(q->begin() + ptrdiff_t(i));
                    --pending_[key(layer, expert)];
                }
                return;
            }
        }
    }
    /// A queued prefetch becomes demand (the loader promotes prefetches of experts now routed).
    void promote(int32_t layer, int32_t expert) {
        for (size_t i = 0; i < prefetch_.size(); ++i) {
            Copy &c = prefetch_[i];
            if (c.layer != layer || c.expert != expert) continue;
            if (current_ == &prefetch_ && i == 0 && committed_ > 0) return;  // in flight: it lands first anyway
            demand_.push_back(c);
            prefetch_.erase(prefetch_.begin() + ptrdiff_t(i));
            return;
        }
    }
    void advance(double t) {
        while (clock_ < t) {
            if (committed_ == 0) {
                current_ = !demand_.empty() ? &demand_ : !prefetch_.empty() ? &prefetch_ : nullptr;
                if (!current_) {
                    clock_ = t;
                    return;
                }
                Copy &c = current_->front();
                if (!c.started) {
                    c.started = true;
                    clock_ += request_us_;  // the request's fixed cost
                    busy_us_ += request_us_;
                    ++requests_;
                    continue;
                }
                committed_ = std::min(c.left, window_);
            }
            const double need = double(committed_) / bytes_per_us_;
            const double dt = std::min(need, t - clock_);
            const auto moved = uint64_t(std::min(double(committed_), std::ceil(dt * bytes_per_us_)));
            clock_ += dt;
            busy_us_ += dt;
            committed_ -= moved;
            Copy &c = current_->front();
            c.left -= moved;
            bytes_moved_ += moved;
            if (committed_ == 0 && c.left == 0) {
                --pending_[key(c.layer, c.expert)];
                current_->pop_front();
            }
        }
    }
    /// Bytes waiting, and the planner-visible terms of a state at bytes_per_us (the planner's belief or the truth).
    void fill_state(LayerState &s, double bytes_per_us, double request_us, int32_t max_in_flight) const {
        double t = double(committed_) / bytes_per_us;
        // Demand copies (those of earlier layers still going) first; then the routed experts still loading.
        for (size_t i = 0; i < demand_.size(); ++i) {
            if (current_ == &demand_ && i == 0 && committed_ > 0) continue;  // counted above
            t += double(demand_[i].left) / bytes_per_us + (demand_[i].started ? 0 : request_us);
        }
        double prefetch_left = 0;
        int32_t prefetch_requests = 0;
        for (size_t i = 0; i < prefetch_.size(); ++i) {
            if (current_ == &prefetch_ && i == 0 && committed_ > 0) continue;
            prefetch_left += double(prefetch_[i].left) / bytes_per_us + (prefetch_[i].started ? 0 : request_us);
            ++prefetch_requests;
        }
        for (SchedExpert &x : s.routed) {
            if (x.where != SchedResidency::RESIDENT || !pending(s.layer, x.expert)) continue;
            x.where = SchedResidency::ARRIVING;
            const Copy *c = find(prefetch_, s.layer, x.expert);
            if (current_ && committed_ > 0 && current_->front().layer == s.layer && current_->front().expert == x.expert) {
                x.arrival_us = double(committed_) / bytes_per_us + double(current_->front().left - committed_) / bytes_per_us;
            } else if (c) {
                const double d = double(c->left) / bytes_per_us + (c->started ? 0 : request_us);
                t += d;
                prefetch_left -= d;
                --prefetch_requests;
                x.arrival_us = t;
            } else {
                x.arrival_us = t;  // a demand copy of an earlier step: within the demand above
            }
        }
        s.link_free_us = t;
        s.prefetch_backlog_us = std::max(prefetch_left, 0.0);
        s.prefetch_room = std::max(max_in_flight - prefetch_requests, 0);
        s.issue_slack_us = double(window_) / bytes_per_us;
    }
    uint64_t bytes_moved() const { return bytes_moved_; }
    /// Time the link spent on requests and bytes up to its clock (CopyStats::busy_us's counterpart).
    double busy_us() const { return busy_us_; }
    uint64_t requests() const { return requests_; }

  private:
    size_t key(int32_t layer, int32_t expert) const { return size_t(layer) * size_t(n_experts_) + size_t(expert); }
    static const Copy *find(const std::deque<Copy> &q, int32_t layer, int32_t expert) {
        for (const Copy &c : q) {
            if (c.layer == layer && c.expert == expert) return &c;
        }
        return nullptr;
    }

    int32_t n_experts_;
    double bytes_per_us_, request_us_;
    uint64_t window_;
    std::deque<Copy> demand_, prefetch_;
    std::deque<Copy> *current_ = nullptr;  // queue whose head is being transferred
    uint64_t committed_ = 0;               // bytes of the head handed to the "driver", not yet moved
    double clock_ = 0;
    uint64_t bytes_moved_ = 0;
    double busy_us_ = 0;
    uint64_t requests_ = 0;  // requests started
    std::vector<int32_t> pending_;         // [n_layers * n_experts] copies not complete
};

/// The layer's costs under another cost model (the machine's truth instead of the planner's belief).
void recost(LayerState &s, const CostModel &m) {
    for (SchedExpert &x : s.routed) {
        x.gpu_us = m.gpu_us(x.n_tokens);
        x.cpu_us = m.cpu_us(x.n_tokens);
        x.fetch_us = m.fetch_us();
    }
    for (SchedCandidate &c : s.candidates) c.fetch_us = m.fetch_us();
    s.wave_us = m.gpu_wave_us();
    s.cpu_layer_us = m.cpu_layer_us();
}

/// The bound of one layer: its non-expert time, then the hits on the GPU against the misses split between the
/// link and the CPU so that both finish together (no fixed costs, no waits).
double layer_bound_us(const LayerState &s, const LayerDecision &d, const CostModel &truth) {
    double hits = 0;
    std::vector<double> cpu;
    for (size_t i = 0; i < s.routed.size(); ++i) {
        if (d.experts[i].action == ExpertAction::HIT) hits += s.routed[i].gpu_us;
        else cpu.push_back(s.routed[i].cpu_us);
    }
    std::sort(cpu.begin(), cpu.end(), std::greater<>());
    double rest = 0;
    for (double c : cpu) rest += c;
    double best = rest;
    const double f = double(truth.shape().bytes) / (truth.link_gb_s() * 1e3);
    for (size_t k = 1; k <= cpu.size(); ++k) {
        rest -= cpu[k - 1];
        best = std::min(best, std::max(double(k) * f, rest));
    }
    return truth.layer_us(s.n_tokens) + std::max(hits, best);
}

} // namespace

SimResult simulate(const RoutingTrace &trace, const ExpertShape &shape, const CostProfile &profile,
                   const SimConfig &cfg) {
    const int32_t L = trace.n_layer, E = trace.n_expert, k = trace.top_k;
    if (trace.n_tokens() == 0) fail("simulate: the trace has no tokens");
    ExpertCacheConfig cc;
    cc.n_layers = L;
    cc.n_experts = E;
    cc.top_k = k;
    cc.expert_bytes = {shape.bytes};
    cc.budget_bytes = cfg.budget_bytes;
    cc.policy = cfg.policy;
    ExpertCache cache(cc);
    if (cache.n_slots() == 0) fail("simulate: a budget of {} holds no expert slot", format_byte_size(cfg.budget_bytes));
    const PlacementPlan placement = PlacementPlan::uniform(L, E);

    CostModel planner_cost(profile, shape, cfg.threads, cfg.chunk_bytes);
    CostModel truth(profile, shape, cfg.threads, cfg.chunk_bytes);
    truth.corrections = cfg.truth;
    PlannerConfig pc;
    pc.cpu_threshold = cfg.cpu_threshold;
    pc.stream_min_batch = cfg.stream_min_batch;
    pc.prefetch_window = cfg.predictor == "none" ? 0 : cfg.prefetch_window;
    pc.prefetch_max_per_layer = cfg.prefetch_max_per_layer;
    pc.max_prefetch_in_flight = cfg.prefetch_in_flight;
    pc.residency_horizon = cfg.residency_horizon;
    pc.balance = cfg.balance;
    pc.link_price = cfg.link_price;
    pc.dump_path = cfg.dump_path;
    LayerPlanner planner(placement, &cache, planner_cost, pc, k);

    const PredictorShape ps{L, E, k};
    const int32_t window = std::max(pc.prefetch_window, 1);
    std::unique_ptr<ScoringPredictor> predictor;
    OraclePredictor *oracle = nullptr;
    if (cfg.predictor == "frequency" || cfg.predictor == "recency") {
        predictor = std::make_unique<FrequencyPredictor>(ps, cfg.predictor == "recency" ? kRecencyDecay : 1.0, 4, window);
    } else if (cfg.predictor == "oracle") {
        auto o = std::make_unique<OraclePredictor>(trace, window);
        oracle = o.get();
        predictor = std::move(o);
    } else if (cfg.predictor != "none") {
        fail("simulate: predictor '{}' (expected none, frequency, recency or oracle: a trace holds no hidden states)",
             cfg.predictor);
    }

    const double truth_bpus = truth.link_gb_s() * 1e3;
    SimLink link(L, E, truth_bpus, profile.h2d_request_us * truth.corrections.link,
                 uint64_t(cfg.queue_depth) * cfg.chunk_bytes);
    SimResult result;
    result.cost_model = planner.cost().describe();

    std::vector<int32_t> routed;
    PrefetchList predicted(size_t(window) * size_t(E));
    LayerPlan plan;
    plan.reserve(E, window * E);
    LayerDecision wave;
    wave.reserve(E);
    double now = 0;
    LinkMeter link_meter;  // every step: the runtime's 200 us windows are shorter than a simulated layer
    int64_t cursor = cfg.first_token;

    auto run_batch = [&](int64_t n, SimPhase &phase) {
        for (int32_t l = 0; l < L; ++l) {
            routed.clear();
            for (int64_t t = 0; t < n; ++t) {
                const uint8_t *ids = trace.ids((cursor + t) % trace.n_tokens(), l);
                routed.insert(routed.end(), ids, ids + k);
            }
            const double t_route = now + truth.layer_us(n);
            link.advance(t_route);
            const bool misses = planner.begin(l, routed, int32_t(n));
            link.fill_state(planner.state(), planner.cost().link_gb_s() * 1e3,
                            profile.h2d_request_us * planner.cost().corrections.link, pc.max_prefetch_in_flight);
            auto predict = [&] {
                predicted.clear();
                const int64_t nt = oracle ? 1 : std::min<int64_t>(n, 4);
                if (predictor && pc.prefetch_window > 0 && l + 1 < L) {
                    if (oracle) oracle->set_token((cursor + n - 1) % trace.n_tokens());
                    PredictorInput in;
                    in.layer = l;
                    in.n_layers = L;
                    in.window = pc.prefetch_window;
                    in.routed = std::span<const int32_t>(routed).subspan(size_t((n - nt) * k), size_t(nt * k));
                    in.n_tokens = int32_t(nt);
                    in.top_k = k;
                    predictor->predict(in, predicted);
                    predicted.sort_by_score();
                }
                planner.set_candidates(predicted.items(), int32_t(nt));
            };
            if (misses) predict();
            planner.plan_routed(plan);
            if (!misses) {
                predict();
                planner.plan_prefetch(plan);
            }
            LayerState actual = planner.state();
            recost(actual, truth);
            link.fill_state(actual, truth_bpus, profile.h2d_request_us * truth.corrections.link, pc.max_prefetch_in_flight);

            // The loader's bookkeeping: hits then fetches pinned, copies queued, prefetches of hits promoted.
            LayerDecision &d = plan.decision;
            for (ExpertAction pass : {ExpertAction::HIT, ExpertAction::FETCH}) {
                for (RoutedExpert &r : d.experts) {
                    if (r.action != pass) continue;
                    const SlotGrant g = cache.acquire(l, r.expert);
                    if (g.load) {
                        if (g.evicted_expert >= 0) link.cancel(l, g.evicted_expert);
                        link.push(l, r.expert, shape.bytes, false);
                    } else if (link.pending(l, r.expert)) {
                        link.promote(l, r.expert);
                    }
                }
            }
            if (d.n_cpu > 0) cache.record_cpu(l, uint64_t(d.n_cpu));
            cache.release_layer(l);
            LayerStats &st = cache.layer_stats(l);
            if (d.n_stream > 0) {
                const int32_t room = cache.layer_slots(l) - cache.layer_fixed(l);
                int32_t in_wave = 0;
                for (const RoutedExpert &r : d.experts) {
                    if (r.action != ExpertAction::STREAM) continue;
                    const SlotGrant g = cache.acquire(l, r.expert);
                    if (g.load) {
                        if (g.evicted_expert >= 0) link.cancel(l, g.evicted_expert);
                        link.push(l, r.expert, shape.bytes, false);
                    }
                    if (++in_wave == room) {
                        cache.release_layer(l);
                        in_wave = 0;
                        ++st.stream_waves;
                    }
                }
                if (in_wave > 0) ++st.stream_waves;
                cache.release_layer(l);
                st.streamed += uint64_t(d.n_stream);
            }
            const PlanTimes times = evaluate_plan(actual, d, plan.split, {});
            phase.bound_us += layer_bound_us(actual, d, truth);

            // Prefetches behind the demand copies (the cost rule's choices; the threshold rule's list with the
            // per-layer limit), never evicting a predicted resident expert.
            cache.begin_prefetch_round();
            for (const PrefetchRequest &r : planner.keep()) cache.protect(r.layer, r.expert);
            std::vector<int32_t> per_layer(size_t(L), 0);
            const int32_t limit = planner.cost_rule() ? INT32_MAX : planner.config().prefetch_max_per_layer;
            for (PlannedPrefetch &p : plan.prefetch) {
                if (cache.find(p.layer, p.expert) >= 0 || per_layer[size_t(p.layer)] >= limit) continue;
                const SlotGrant g = cache.prefetch(p.layer, p.expert);
                if (!g.load) continue;
                if (g.evicted_expert >= 0) link.cancel(p.layer, g.evicted_expert);
                link.push(p.layer, p.expert, shape.bytes, true);
                p.slot = g.slot;
                ++per_layer[size_t(p.layer)];
            }
            st.prefetch_planned += planner.cost_rule() ? plan.prefetch.size() : 0;

            // What the runtime measures, for the load balancer.
            ++st.steps;
            st.split_steps += plan.split;
            st.predicted_us += plan.predicted.critical_us;
            LayerMeasurement m;
            double cpu_true = 0, cpu_pred = 0, gpu_true = 0, gpu_pred = 0;
            for (size_t i = 0; i < d.experts.size(); ++i) {
                if (d.experts[i].action == ExpertAction::CPU) {
                    cpu_true += actual.routed[i].cpu_us;
                    cpu_pred += planner.state().routed[i].cpu_us;
                } else {
                    gpu_true += actual.routed[i].gpu_us;
                    gpu_pred += planner.state().routed[i].gpu_us;
                }
            }
            if (d.n_cpu > 0) {
                m.cpu_work_us = cpu_true + actual.cpu_layer_us;
                m.cpu_predicted_us = cpu_pred + planner.state().cpu_layer_us;
                st.cpu_expert_us += m.cpu_work_us;
                m.cpu_end_us = times.cpu_end_us;
                m.gpu_end_us = times.gpu_end_us;
            }
            if (!plan.split && d.n_stream == 0 && d.n_hit + d.n_fetch > 0) {
                m.gpu_work_us = gpu_true + actual.wave_us;
                m.gpu_predicted_us = gpu_pred + planner.state().wave_us;
            }
            // The link as the runtime sees it (HybridMoe::collect_timings): busy time and bytes of every copy since
            // the last step, over the time passed.
            link_meter.measure({link.busy_us(), link.bytes_moved(), link.requests(), t_route}, planner.cost(), m);
            m.layer_us = plan.predicted.critical_us;
            planner.observe(m, st);
            now = t_route + times.critical_us;
        }
        cursor += n;
    };

    auto run_phase = [&](int64_t tokens, int64_t batch, SimPhase &phase) {
        if (tokens <= 0) return;
        cache.reset_stats();
        const uint64_t bytes0 = link.bytes_moved();
        const double t0 = now;
        for (int64_t done = 0; done < tokens; done += batch) run_batch(std::min(batch, tokens - done), phase);
        // The copies a phase queued belong to it: let them land.
        phase.tokens = tokens;
        phase.time_us = now - t0;
        phase.pcie_bytes = link.bytes_moved() - bytes0;
        phase.totals = cache.total_stats();
    };
    run_phase(cfg.prefill_tokens, std::max<int64_t>(cfg.prefill_tokens, 1), result.prefill);
    run_phase(cfg.decode_tokens, 1, result.decode);
    result.corrections = planner.balancer().corrections();
    planner.finish_dump();
    return result;
}

nlohmann::json SimResult::to_json() const {
    auto phase = [](const SimPhase &p) {
        const LayerStats &t = p.totals;
        return nlohmann::json{{"tokens", p.tokens},
                              {"tok_s", p.tok_s()},
                              {"ms_per_token", p.tokens ? p.time_us * 1e-3 / double(p.tokens) : 0.0},
                              {"bound_tok_s", p.bound_tok_s()},
                              {"share_of_bound", p.bound_us > 0 ? p.bound_us / p.time_us : 0.0},
                              {"hit_rate", t.hit_rate()},
                              {"pcie_bytes_per_token", p.tokens ? double(p.pcie_bytes) / double(p.tokens) : 0.0},
                              {"cpu_experts_per_token", p.tokens ? double(t.cpu_runs) / double(p.tokens) : 0.0},
                              {"fetches_per_token", p.tokens ? double(t.demand_misses) / double(p.tokens) : 0.0},
                              {"prefetch_loads", t.prefetch_loads},
                              {"prefetch_hits", t.prefetch_hits},
                              {"split_layers", t.split_steps},
                              {"streamed", t.streamed},
                              {"corrections", t.corrections},
                              {"finish_gap_abs_ms", t.finish_gap_abs_us * 1e-3}};
    };
    return {{"prefill", phase(prefill)},
            {"decode", phase(decode)},
            {"corrections", {{"cpu", corrections.cpu}, {"gpu", corrections.gpu}, {"link", corrections.link}}}};
}

} // namespace prescope
