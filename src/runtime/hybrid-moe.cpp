// HybridMoe: plan (LayerPlanner) then execute: slots and copies, wave 0, prefetch, CPU experts, the split FETCH
// wave or the streamed waves, combine, measurements. The step order is LayerStep's.
#include "runtime/hybrid-moe.h"

#include "core/error.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace prescope {

namespace {

double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

} // namespace

const char *layer_step_name(LayerStep s) {
    switch (s) {
    case LayerStep::PREDICT_FIRST: return "predict-first";
    case LayerStep::PLAN: return "plan";
    case LayerStep::SLOTS_AND_COPIES: return "slots-and-copies";
    case LayerStep::WAIT_WAVE0: return "wait-wave0";
    case LayerStep::LAUNCH_WAVE0: return "launch-wave0";
    case LayerStep::PREDICT_AFTER_LAUNCH: return "predict-after-launch";
    case LayerStep::RELEASE_WAVE0: return "release-wave0";
    case LayerStep::QUEUE_STREAM_WAVE: return "queue-stream-wave";
    case LayerStep::PREFETCH: return "prefetch";
    case LayerStep::CPU_EXPERTS: return "cpu-experts";
    case LayerStep::LAUNCH_FETCH_WAVE: return "launch-fetch-wave";
    case LayerStep::STREAM_WAVES: return "stream-waves";
    case LayerStep::COMBINE: return "combine";
    case LayerStep::MEASURE: return "measure";
    }
    return "?";
}

void MoeDevice::launch_device_hits(int32_t, int64_t, std::span<const int32_t>, std::span<const void *const>) {
    PRESCOPE_ASSERT(!"launch_device_hits on a device whose device_hits_max_tokens() is 0");
}

void MoeDevice::launch_device_layer(int32_t, int64_t, std::span<const int32_t>, std::span<const void *const>) {
    PRESCOPE_ASSERT(!"launch_device_layer on a device whose device_hits_max_tokens() is 0");
}

// ---------------------------------------------------------------------------------------------------------------
// the host device (all-CPU plan)

HostMoeDevice::HostMoeDevice(int64_t n_embd, int64_t max_pairs) : n_embd_(n_embd), rows_(size_t(max_pairs * n_embd)) {}

void HostMoeDevice::launch_gpu(const MoeStep &s) {
    PRESCOPE_ASSERT(s.wave_begin == s.wave_end && s.k_comb == s.k);  // nothing runs on a GPU here
}

void HostMoeDevice::combine(const MoeStep &s) {
    PRESCOPE_ASSERT(out_ && s.k_comb == s.k && s.n_gpu_pairs == 0);
    for (int64_t t = 0; t < s.n_tok; ++t) {
        combine_top_k(s.k, &s.pair_ids[size_t(t * s.k)], &s.weights[size_t(t * s.k)], rows_.data(), n_embd_,
                      out_ + t * n_embd_);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// construction

HybridMoe::HybridMoe(const Model &model, const ExpertStore &store, const PlacementPlan &placement, ExpertCache *cache,
                     ExpertLoader *loader, CopyEngine *engine, Predictor *predictor, MoeDevice &device,
                     Backend *backend, const CostModel &cost, const HybridMoeConfig &config, int64_t max_tokens,
                     bool shared_on_device)
    : model_(model), store_(store), placement_(placement), cache_(cache), loader_(loader), engine_(engine),
      predictor_(predictor), device_(device), backend_(backend), config_(config), shared_on_device_(shared_on_device),
      shared_gated_(shared_on_device && model.hp().shared_expert_gate), max_tokens_(max_tokens) {
    const HParams &hp = model.hp();
    PRESCOPE_ASSERT((cache == nullptr) == (loader == nullptr) && (loader == nullptr) == (engine == nullptr));
    PRESCOPE_ASSERT(max_tokens > 0);
    PRESCOPE_ASSERT(!shared_on_device || hp.shared_expert);
    PRESCOPE_ASSERT(!cache || (cache->n_layers() == hp.n_layer && cache->n_moe_layers() == hp.n_layer_moe()));
    placement.check_shape(int32_t(hp.n_layer), int32_t(hp.n_expert), "placement plan");
    const auto E = size_t(hp.n_expert), k = size_t(hp.n_expert_used), pairs = size_t(max_tokens) * k;
    const auto window = size_t(std::max(config_.planner.prefetch_window, 0));
    if (cache_) {
        planner_ = std::make_unique<LayerPlanner>(placement, cache, cost, config_.planner, int32_t(k));
    }
    plan_.reserve(int32_t(E), int32_t(window * E));
    wave_.reserve(int32_t(E));
    gpu_index_.resize(E);
    step_.gpu_expert.resize(E);
    step_.gpu_offsets.resize(E + 1);
    step_.gpu_rows.resize(pairs);
    step_.cpu_expert.resize(E);
    step_.cpu_offsets.resize(E + 1);
    step_.cpu_rows.resize(pairs);
    step_.pair_ids.resize(size_t(max_tokens) * (k + 1));
    step_.weights.resize(size_t(max_tokens) * (k + 1));
    site_.resize(E);
    index_.resize(E);
    fill_.resize(E);
    int64_t n_ff = 0;
    for (int32_t l = 0; l < store.n_layers(); ++l) n_ff = std::max(n_ff, store.layout(l).n_ff);
    cpu_runner_ = CpuExpertRunner(hp.n_embd, n_ff, int64_t(pairs), hp.expert_act);
    predicted_.reserve(window * E);
    prefetch_list_.reserve(window * E);
    prefetch_slots_.reserve(window * E);

    if (backend_ && loader_) {
        for (auto *events : {&stall_begin_, &stall_end_, &gpu_done_, &routing_copied_}) {
            events->resize(size_t(hp.n_layer));
            for (Event &e : *events) e = backend_->event_create();
        }
        timing_pending_.assign(size_t(hp.n_layer), 0);
        routing_marked_.assign(size_t(hp.n_layer), 0);
        pending_simple_.assign(size_t(hp.n_layer), 0);
        pending_cpu_end_us_.assign(size_t(hp.n_layer), -1);
        pending_gpu_predicted_us_.assign(size_t(hp.n_layer), -1);
    }
    if (engine_) link_meter_ = LinkMeter(kLinkWindowUs, link_reading());
    if (cache_) {
        table_slot_.assign(size_t(hp.n_layer) * E, -1);
        done_ticket_.assign(size_t(cache_->n_slots()), Ticket{});
        device_layer_.assign(size_t(hp.n_layer), 0);
        update_index_.reserve(E);
        update_data_.reserve(E);
    }
}

HybridMoe::~HybridMoe() {
    for (auto *events : {&stall_begin_, &stall_end_, &gpu_done_, &routing_copied_}) {
        for (Event e : *events) backend_->event_destroy(e);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// the layer step

void HybridMoe::step(LayerStep s) {
    // The order is LayerStep's: a step never comes back, none runs twice.
    PRESCOPE_ASSERT(int(s) > last_step_);
    last_step_ = int(s);
    if (on_step) on_step(step_layer_, s);
}

void HybridMoe::predict(int32_t layer, const float *h, const Routing &r) {
    const HParams &hp = model_.hp();
    const int32_t n_layers = int32_t(hp.n_layer), dense = int32_t(hp.n_layer_dense);
    const int64_t nt = std::min(r.n_tok, config_.predict_max_tokens), first = r.n_tok - nt;
    predicted_.clear();
    if (predictor_ && config_.planner.prefetch_window > 0 && layer + 1 < n_layers && !window_resident(layer)) {
        const double t0 = now_us();
        // The predictor numbers the MoE layers from 0 (as traces do), so it never sees the dense ones.
        PredictorInput in;
        in.layer = layer - dense;
        in.n_layers = n_layers - dense;
        in.window = config_.planner.prefetch_window;
        in.routed = std::span<const int32_t>(r.ids).subspan(size_t(first * r.k), size_t(nt * r.k));
        in.n_tokens = int32_t(nt);
        in.top_k = int32_t(r.k);
        in.hidden = h + first * model_.hp().n_embd;
        in.n_embd = model_.hp().n_embd;
        predictor_->predict(in, predicted_);
        predicted_.offset_layers(dense);
        for (const PrefetchRequest &p : predicted_.items()) PRESCOPE_ASSERT(p.layer > layer && p.layer < n_layers);
        predicted_.sort_by_score();
        const double us = now_us() - t0;
        if (LayerStats *st = stats(layer)) st->predict_us += us;
        host_us_estimate_ += 0.1 * (us - host_us_estimate_);
        planner_->set_host_us(host_us_estimate_);
    }
    planner_->set_candidates(predicted_.items(), int32_t(nt));
}

bool HybridMoe::window_resident(int32_t layer) const {
    if (!cache_) return false;
    const HParams &hp = model_.hp();
    const int32_t last = std::min(layer + config_.planner.prefetch_window, int32_t(hp.n_layer) - 1);
    for (int32_t l = layer + 1; l <= last; ++l) {
        if (cache_->layer_fixed(l) != int32_t(hp.n_expert)) return false;
    }
    return true;
}

void HybridMoe::build_step(const Routing &r, std::span<const float> shared_gate) {
    MoeStep &s = step_;
    const LayerDecision &d = plan_.decision;
    const int64_t k = r.k, kc = k + (shared_on_device_ ? 1 : 0);
    s.n_tok = r.n_tok;
    s.k = k;
    s.k_comb = kc;
    s.n_gpu = s.n_cpu = 0;
    s.gpu_offsets[0] = s.cpu_offsets[0] = 0;
    // GPU experts in wave order, each group in ascending id (the decision's order): wave 0 (the hits the device
    // already ran, then the other hits and the fetches), the FETCH wave (split), the STREAM experts; so every
    // wave is a contiguous run of experts and pairs, and the device's hits the layout launch_device_hits made.
    auto group = [&](const RoutedExpert &x) {
        switch (x.action) {
        case ExpertAction::HIT: return device_hit(x) ? 0 : 1;
        case ExpertAction::FETCH: return plan_.split ? 2 : 1;
        case ExpertAction::STREAM: return 3;
        case ExpertAction::CPU: return -1;
        }
        return -1;
    };
    for (int g = 0; g < 4; ++g) {
        for (const RoutedExpert &x : d.experts) {
            if (group(x) != g) continue;
            const auto e = size_t(x.expert);
            PRESCOPE_ASSERT(loader_ && (g == 3 || x.slot >= 0));
            site_[e] = 1;
            index_[e] = s.n_gpu;
            s.gpu_expert[size_t(s.n_gpu)] = g == 3 ? nullptr : loader_->slot_data(x.slot);
            gpu_index_[size_t(s.n_gpu)] = int32_t(&x - d.experts.data());
            s.gpu_offsets[size_t(s.n_gpu) + 1] = s.gpu_offsets[size_t(s.n_gpu)] + x.n_tokens;
            ++s.n_gpu;
        }
        if (g == 0) n_device_ = s.n_gpu;
        if (g == 1) n_wave0_ = s.n_gpu;
        if (g == 2) n_fetch_wave_ = s.n_gpu - n_wave0_;
    }
    for (const RoutedExpert &x : d.experts) {
        if (x.action != ExpertAction::CPU) continue;
        const auto e = size_t(x.expert);
        site_[e] = 2;
        index_[e] = s.n_cpu;
        s.cpu_expert[size_t(s.n_cpu)] = x.expert;
        s.cpu_offsets[size_t(s.n_cpu) + 1] = s.cpu_offsets[size_t(s.n_cpu)] + x.n_tokens;
        ++s.n_cpu;
    }
    s.n_gpu_pairs = s.gpu_offsets[size_t(s.n_gpu)];
    s.n_cpu_pairs = s.cpu_offsets[size_t(s.n_cpu)];
    for (const RoutedExpert &x : d.experts) {
        const auto e = size_t(x.expert);
        fill_[e] = site_[e] == 1 ? s.gpu_offsets[size_t(index_[e])]
                                 : int32_t(s.n_gpu_pairs) + s.cpu_offsets[size_t(index_[e])];
    }
    // Pairs in (token, slot) order within each expert, as the CPU runner gathers them.
    for (int64_t t = 0; t < r.n_tok; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            const auto e = size_t(r.ids[size_t(t * k + j)]);
            const int32_t p = fill_[e]++;
            s.pair_ids[size_t(t * kc + j)] = p;
            s.weights[size_t(t * kc + j)] = r.weights[size_t(t * k + j)];
            if (site_[e] == 1) {
                s.gpu_rows[size_t(p)] = int32_t(t);
            } else {
                s.cpu_rows[size_t(p - s.n_gpu_pairs)] = int32_t(t);
            }
        }
        if (shared_on_device_) {
            // Added last. HF Qwen2MoeSparseMoeBlock scales it by sigmoid(shared_expert_gate(x)); DeepseekV3MoE adds
            // it unscaled, and 1.0f * y == y, so the column changes no bit against an unweighted add.
            s.pair_ids[size_t(t * kc + k)] = int32_t(s.n_gpu_pairs + s.n_cpu_pairs + t);
            s.weights[size_t(t * kc + k)] = shared_gated_ ? 1.0f / (1.0f + std::exp(-shared_gate[size_t(t)])) : 1.0f;
        }
    }
}

bool HybridMoe::device_hit(const RoutedExpert &x) const {
    if (!step_on_device_ && device_hits_layer_ != step_.layer) return false;
    const int32_t slot = table_slot_[size_t(step_.layer) * size_t(model_.hp().n_expert) + size_t(x.expert)];
    if (slot < 0) return false;
    // The device ran it from this slot; the plan must agree (a resident expert is always a hit).
    PRESCOPE_ASSERT(x.action == ExpertAction::HIT && x.slot == slot);
    return true;
}

int32_t HybridMoe::update_table(int32_t layer) {
    const auto E = size_t(model_.hp().n_expert);
    update_index_.clear();
    update_data_.clear();
    int32_t held = 0;
    for (size_t e = 0; e < E; ++e) {
        int32_t slot = cache_->find(layer, int32_t(e));
        if (slot >= 0) {
            // Set only once its copy is done (the current occupant's load is never cancelled: a cancel comes
            // with an eviction), so the device never reads a slot still being written.
            const Ticket t = cache_->ticket(slot);
            if (t.valid() && !(t == done_ticket_[size_t(slot)])) {
                const TicketState st = engine_->state(t);
                if (st == TicketState::DONE || st == TicketState::RETIRED) done_ticket_[size_t(slot)] = t;
                else slot = -1;
            }
        }
        held += slot >= 0;
        const size_t i = size_t(layer) * E + e;
        if (slot == table_slot_[i]) continue;
        table_slot_[i] = slot;
        update_index_.push_back(int32_t(i));
        update_data_.push_back(slot >= 0 ? cache_->slot_data(slot) : nullptr);
    }
    return held;
}

DeviceLaunch HybridMoe::launch_device(int32_t layer, int64_t n_tok, bool whole_steps) {
    PRESCOPE_ASSERT(model_.hp().has_experts(layer));  // dense layers have no routing, slots or table row
    PRESCOPE_ASSERT(device_layer_.empty() || !device_layer_[size_t(layer)]);  // its last step was accounted
    device_hits_layer_ = -1;
    if (!cache_ || n_tok <= 0 || n_tok > std::min(max_tokens_, device_.device_hits_max_tokens())) {
        return DeviceLaunch::NONE;
    }
    const int32_t held = update_table(layer);
    if (whole_steps && !shared_gated_ && held == int32_t(model_.hp().n_expert)) {
        device_.launch_device_layer(layer, n_tok, update_index_, update_data_);
        device_layer_[size_t(layer)] = 1;
        return DeviceLaunch::LAYER;
    }
    device_.launch_device_hits(layer, n_tok, update_index_, update_data_);
    device_hits_layer_ = layer;
    return DeviceLaunch::HITS;
}

bool HybridMoe::device_resident() const {
    if (!cache_ || shared_gated_ || device_.device_hits_max_tokens() < 1) return false;
    const HParams &hp = model_.hp();
    const auto E = size_t(hp.n_expert);
    for (int32_t il = int32_t(hp.n_layer_dense); il < int32_t(hp.n_layer); ++il) {
        if (cache_->layer_fixed(il) != int32_t(E)) return false;
        const auto row = table_slot_.begin() + ptrdiff_t(size_t(il) * E);
        if (std::any_of(row, row + ptrdiff_t(E), [](int32_t slot) { return slot < 0; })) return false;
    }
    return true;
}

void HybridMoe::replayed_device_layer(int32_t layer) {
    PRESCOPE_ASSERT(model_.hp().has_experts(layer) && !device_layer_[size_t(layer)]);
    device_hits_layer_ = -1;
    device_layer_[size_t(layer)] = 1;
}

void HybridMoe::account_device_layer(int32_t layer, const float *h, const Routing &r) {
    PRESCOPE_ASSERT(device_layer_[size_t(layer)]);
    device_layer_[size_t(layer)] = 0;
    run_step(layer, h, r, {}, true);
}

void HybridMoe::launch(int32_t wave, int32_t begin, int32_t end) {
    step_.wave = wave;
    step_.wave_begin = begin;
    step_.wave_end = end;
    device_.launch_gpu(step_);
}

void HybridMoe::begin_wave(int32_t first) {
    // All of the layer's slots but the fixed ones are free once the wave before was queued (end_layer); the
    // copies into them wait on the device for that wave's compute.
    const int32_t room = cache_->layer_slots(step_.layer) - cache_->layer_fixed(step_.layer);
    PRESCOPE_ASSERT(room > 0 && first >= n_wave0_);
    const int32_t last = std::min(step_.n_gpu, first + room);
    wave_.layer = step_.layer;
    wave_.experts.clear();
    for (int32_t i = first; i < last; ++i) {
        RoutedExpert x = plan_.decision.experts[size_t(gpu_index_[size_t(i)])];
        x.action = ExpertAction::FETCH;
        wave_.experts.push_back(x);
    }
    wave_.n_hit = wave_.n_cpu = wave_.n_stream = wave_.n_demoted = 0;
    wave_.n_fetch = last - first;
    loader_->begin_layer(wave_);
    for (int32_t i = first; i < last; ++i) {
        step_.gpu_expert[size_t(i)] = loader_->slot_data(wave_.experts[size_t(i - first)].slot);
    }
    step_.wave_begin = first;
    step_.wave_end = last;
}

void HybridMoe::prefetch() {
    if (plan_.prefetch.empty()) return;
    const double t0 = now_us();
    prefetch_list_.clear();
    for (const PlannedPrefetch &p : plan_.prefetch) prefetch_list_.push_back({p.layer, p.expert, float(p.prob)});
    prefetch_slots_.resize(prefetch_list_.size());
    // The cost rule chose each prefetch; the threshold rule hands the predictor's list to the loader's limits.
    const int32_t per_layer = planner_->cost_rule() ? INT32_MAX : planner_->config().prefetch_max_per_layer;
    loader_->prefetch(prefetch_list_, per_layer, planner_->keep(), prefetch_slots_);
    for (size_t i = 0; i < plan_.prefetch.size(); ++i) plan_.prefetch[i].slot = prefetch_slots_[i];
    if (LayerStats *st = stats(step_.layer)) {
        st->predict_us += now_us() - t0;
        st->prefetch_planned += planner_->cost_rule() ? plan_.prefetch.size() : 0;
    }
}

void HybridMoe::run_cpu_experts(const float *h) {
    const MoeStep &s = step_;
    const double t0 = now_us();
    cpu_runner_.run(store_, s.layer, s.n_cpu, s.cpu_expert.data(), s.cpu_offsets.data(), s.cpu_rows.data(), h,
                    device_.cpu_out());
    const double t1 = now_us();
    cpu_end_us_ = t1 - layer_t0_us_;
    if (LayerStats *st = stats(s.layer)) st->cpu_expert_us += t1 - t0;
    if (planner_) {
        // The CPU experts' time against the plan's, for the load balancer.
        double predicted = planner_->state().cpu_layer_us;
        for (size_t i = 0; i < plan_.decision.experts.size(); ++i) {
            if (plan_.decision.experts[i].action == ExpertAction::CPU) predicted += planner_->state().routed[i].cpu_us;
        }
        LayerMeasurement m;
        m.cpu_work_us = t1 - t0;
        m.cpu_predicted_us = predicted;
        planner_->observe(m, *stats(s.layer));
    }
}

void HybridMoe::collect_timings() {
    for (size_t l = 0; l < timing_pending_.size(); ++l) {
        if (!timing_pending_[l] || !backend_->event_query(gpu_done_[l])) continue;
        timing_pending_[l] = 0;
        LayerStats &st = cache_->layer_stats(int32_t(l));
        if (routing_marked_[l]) {
            const double idle = backend_->event_elapsed_us(routing_copied_[l], stall_begin_[l]);
            if (idle > 0) st.gpu_idle_us += idle;
            routing_marked_[l] = 0;
        }
        const double stall = backend_->event_elapsed_us(stall_begin_[l], stall_end_[l]);
        if (stall > 0) {
            cache_->record_stall(int32_t(l), stall);
            st.device_stall_us += stall;
        }
        LayerMeasurement m;
        const double gpu_end = backend_->event_elapsed_us(stall_begin_[l], gpu_done_[l]);
        if (gpu_end >= 0) {
            m.gpu_end_us = gpu_end;
            m.cpu_end_us = pending_cpu_end_us_[l];
            if (m.cpu_end_us < 0) m.gpu_end_us = -1;  // no CPU experts: no gap
        }
        if (pending_simple_[l]) {
            m.gpu_work_us = backend_->event_elapsed_us(stall_end_[l], gpu_done_[l]);
            m.gpu_predicted_us = pending_gpu_predicted_us_[l];
        }
        planner_->observe(m, st);
    }
    LayerMeasurement m;
    if (engine_ && link_meter_.measure(link_reading(), planner_->cost(), m)) {
        planner_->observe(m, cache_->layer_stats(cache_->n_layers() - 1));
    }
}

LinkMeter::Reading HybridMoe::link_reading() const {
    const CopyStats s = engine_->stats();
    return {s.busy_us, s.bytes_done, s.requests_done, now_us()};
}

void HybridMoe::mark_routing_copied(int32_t layer, Stream stream) {
    if (timing_pending_.empty()) return;
    const auto l = size_t(layer);
    if (timing_pending_[l]) collect_timings();
    // Only a step that will be timed (its previous timings collected) marks: run_layer records its events then.
    if (!timing_pending_[l]) {
        backend_->event_record(routing_copied_[l], stream);
        routing_marked_[l] = 1;
    }
}

void HybridMoe::run_layer(int32_t layer, const float *h, const Routing &r, std::span<const float> shared_gate) {
    PRESCOPE_ASSERT(device_layer_.empty() || !device_layer_[size_t(layer)]);
    run_step(layer, h, r, shared_gate, false);
}

void HybridMoe::run_step(int32_t layer, const float *h, const Routing &r, std::span<const float> shared_gate,
                         bool on_device) {
    PRESCOPE_ASSERT(model_.hp().has_experts(layer));
    PRESCOPE_ASSERT(r.n_tok > 0 && r.n_tok <= max_tokens_ && r.k == model_.hp().n_expert_used);
    PRESCOPE_ASSERT(!shared_gated_ || shared_gate.size() >= size_t(r.n_tok));
    // An accounted device step comes between another layer's launch_device and its run_layer.
    PRESCOPE_ASSERT(on_device || device_hits_layer_ < 0 || device_hits_layer_ == layer);
    step_on_device_ = on_device;
    step_layer_ = layer;
    last_step_ = -1;
    layer_t0_us_ = now_us();
    cpu_end_us_ = -1;
    step_.layer = layer;
    if (!timing_pending_.empty() && timing_pending_[size_t(layer)]) collect_timings();
    const std::span<const int32_t> routed(r.ids.data(), size_t(r.n_tok * r.k));

    bool predicted = false;
    if (!planner_) {
        step(LayerStep::PLAN);
        count_routed(layer, routed, int32_t(model_.hp().n_expert), plan_.decision);  // the all-CPU plan
        plan_.split = false;
        plan_.prefetch.clear();
    } else {
        const bool misses = planner_->begin(layer, routed, int32_t(r.n_tok));
        apply_link_state(planner_->state(), *cache_, *engine_, planner_->cost(), planner_->config().max_prefetch_in_flight);
        if (misses) {
            step(LayerStep::PREDICT_FIRST);
            predict(layer, h, r);
            predicted = true;
        }
        step(LayerStep::PLAN);
        planner_->plan_routed(plan_);
    }
    LayerDecision &d = plan_.decision;
    if (loader_) {
        step(LayerStep::SLOTS_AND_COPIES);
        loader_->begin_layer(d);
    }
    build_step(r, shared_gate);

    const Stream cs = device_.compute_stream();
    // A step the device ran whole: every routed expert a hit it computed (a resident expert is always a HIT).
    PRESCOPE_ASSERT(!on_device || (n_device_ == step_.n_gpu && step_.n_cpu == 0));
    const bool timed = !on_device && !timing_pending_.empty() && !timing_pending_[size_t(layer)];
    if (timed) backend_->event_record(stall_begin_[size_t(layer)], cs);
    if (loader_ && n_wave0_ > 0 && !on_device) {
        step(LayerStep::WAIT_WAVE0);
        stats(layer)->wait_issue_us += loader_->wait_experts(d, cs, true, !plan_.split);
    }
    if (timed) backend_->event_record(stall_end_[size_t(layer)], cs);
    if (!on_device) {
        step(LayerStep::LAUNCH_WAVE0);
        launch(0, n_device_, n_wave0_);
    }
    if (planner_ && !predicted) {
        step(LayerStep::PREDICT_AFTER_LAUNCH);
        predict(layer, h, r);
        planner_->plan_prefetch(plan_);
    }
    if (loader_ && !plan_.split) {
        // The slots are read by the work just queued: later loads into them wait for this point.
        step(LayerStep::RELEASE_WAVE0);
        loader_->end_layer(layer, cs);
    }
    const int32_t first_stream = n_wave0_ + n_fetch_wave_;
    bool streaming = step_.n_gpu > first_stream;
    if (streaming) {
        // The first streamed wave's copies run while the host prefetches and runs the CPU experts.
        step(LayerStep::QUEUE_STREAM_WAVE);
        begin_wave(first_stream);
    }
    if (loader_) {
        step(LayerStep::PREFETCH);
        prefetch();
    }
    if (step_.n_cpu > 0) {
        step(LayerStep::CPU_EXPERTS);
        run_cpu_experts(h);
    }
    int32_t wave = 1;
    if (plan_.split) {
        // The FETCH copies travelled while the CPU worked; their wave goes now.
        step(LayerStep::LAUNCH_FETCH_WAVE);
        stats(layer)->wait_issue_us += loader_->wait_experts(d, cs, false, true);
        launch(wave++, n_wave0_, n_wave0_ + n_fetch_wave_);
        loader_->end_layer(layer, cs);
    }
    if (streaming) step(LayerStep::STREAM_WAVES);
    while (streaming) {
        stats(layer)->wait_issue_us += loader_->wait_experts(wave_, cs);
        launch(wave++, step_.wave_begin, step_.wave_end);
        loader_->end_layer(layer, cs);
        stats(layer)->streamed += uint64_t(step_.wave_end - step_.wave_begin);
        ++stats(layer)->stream_waves;
        streaming = step_.wave_end < step_.n_gpu;
        if (streaming) begin_wave(step_.wave_end);
    }
    if (timed) backend_->event_record(gpu_done_[size_t(layer)], cs);
    if (!on_device) {
        step(LayerStep::COMBINE);
        device_.combine(step_);
    }

    step(LayerStep::MEASURE);
    if (!on_device) device_hits_layer_ = -1;
    step_on_device_ = false;
    if (LayerStats *st = stats(layer)) {
        ++st->steps;
        st->device_layers += on_device;
        st->device_hits += uint64_t(n_device_);
        st->host_us += now_us() - layer_t0_us_;
        st->split_steps += plan_.split;
        st->predicted_us += plan_.predicted.critical_us;
        LayerMeasurement m;
        m.layer_us = plan_.predicted.critical_us;
        planner_->observe(m, *st);
    }
    if (timed) {
        timing_pending_[size_t(layer)] = 1;
        pending_cpu_end_us_[size_t(layer)] = cpu_end_us_;
        // Device hits ran before stall_begin_: the events would time only the rest.
        pending_simple_[size_t(layer)] = !plan_.split && step_.n_gpu == n_wave0_ && n_wave0_ > 0 && n_device_ == 0;
        double gpu = planner_->state().wave_us;
        for (size_t i = 0; i < d.experts.size(); ++i) {
            if (d.experts[i].action != ExpertAction::CPU) gpu += planner_->state().routed[i].gpu_us;
        }
        pending_gpu_predicted_us_[size_t(layer)] = gpu;
    }
}

} // namespace prescope
