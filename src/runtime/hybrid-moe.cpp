// HybridMoe: per-layer decision -> slots and copies -> GPU launch (wave 0) -> prefetch -> CPU experts ->
// streamed waves (large batches) -> combine.
#include "runtime/hybrid-moe.h"

#include "core/error.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>

namespace prescope {

namespace {

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); }

} // namespace

HybridMoe::HybridMoe(const Model &model, const ExpertStore &store, const PlacementPlan &plan, ExpertCache *cache,
                     ExpertLoader *loader, Predictor *predictor, MoeDevice &device, Backend *backend,
                     const HybridMoeConfig &config, int64_t max_tokens, bool shared_on_device)
    : model_(model), store_(store), plan_(plan), cache_(cache), loader_(loader), predictor_(predictor),
      device_(device), backend_(backend), config_(config), shared_on_device_(shared_on_device),
      max_tokens_(max_tokens) {
    const HParams &hp = model.hp();
    PRESCOPE_ASSERT((cache == nullptr) == (loader == nullptr));
    PRESCOPE_ASSERT(max_tokens > 0);
    plan.check_shape(int32_t(hp.n_layer), int32_t(hp.n_expert), "placement plan");
    const auto E = size_t(hp.n_expert), k = size_t(hp.n_expert_used), pairs = size_t(max_tokens) * k;
    if (config_.prefetch_max_per_layer <= 0) config_.prefetch_max_per_layer = int32_t(k);

    decision_.reserve(int32_t(E));
    wave_.reserve(int32_t(E));
    stream_index_.resize(E);
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
    // Per thread: gathered rows [m][n_embd], gate and up [m][2 n_ff]; m <= max_tokens (one pair per token).
    scratch_.resize(size_t(omp_get_max_threads()));
    for (auto &s : scratch_) s.resize(size_t(max_tokens) * size_t(hp.n_embd + 2 * n_ff));
    prefetch_list_.reserve(size_t(std::max(config_.prefetch_window, 0)) * E);

    if (backend_ && loader_) {
        stall_begin_.resize(size_t(hp.n_layer));
        stall_end_.resize(size_t(hp.n_layer));
        for (Event &e : stall_begin_) e = backend_->event_create();
        for (Event &e : stall_end_) e = backend_->event_create();
        stall_pending_.assign(size_t(hp.n_layer), 0);
    }
}

HybridMoe::~HybridMoe() {
    for (Event e : stall_begin_) backend_->event_destroy(e);
    for (Event e : stall_end_) backend_->event_destroy(e);
}

void HybridMoe::build_step(int32_t layer, const Routing &r, std::span<const float> shared_gate) {
    MoeStep &s = step_;
    const int64_t k = r.k, kc = k + (shared_on_device_ ? 1 : 0);
    s.layer = layer;
    s.n_tok = r.n_tok;
    s.k = k;
    s.k_comb = kc;
    s.n_gpu = s.n_cpu = 0;
    s.gpu_offsets[0] = s.cpu_offsets[0] = 0;
    // Experts in ascending id (decide_layer's order), GPU ones first in the pair buffer: wave 0 (HIT, FETCH)
    // before the STREAM experts, so that every wave is a contiguous run of experts and pairs.
    for (const bool streamed : {false, true}) {
        for (const RoutedExpert &x : decision_.experts) {
            if (x.action == ExpertAction::CPU || (x.action == ExpertAction::STREAM) != streamed) continue;
            const auto e = size_t(x.expert);
            PRESCOPE_ASSERT(loader_ && (streamed || x.slot >= 0));
            site_[e] = 1;
            index_[e] = s.n_gpu;
            s.gpu_expert[size_t(s.n_gpu)] = streamed ? nullptr : loader_->slot_data(x.slot);
            if (streamed) stream_index_[size_t(s.n_gpu - n_wave0_)] = int32_t(&x - decision_.experts.data());
            s.gpu_offsets[size_t(s.n_gpu) + 1] = s.gpu_offsets[size_t(s.n_gpu)] + x.n_tokens;
            ++s.n_gpu;
        }
        if (!streamed) n_wave0_ = s.n_gpu;
    }
    for (const RoutedExpert &x : decision_.experts) {
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
    for (const RoutedExpert &x : decision_.experts) {
        const auto e = size_t(x.expert);
        fill_[e] = site_[e] == 1 ? s.gpu_offsets[size_t(index_[e])]
                                 : int32_t(s.n_gpu_pairs) + s.cpu_offsets[size_t(index_[e])];
    }
    // Pairs in (token, slot) order within each expert, as CpuExpertExecutor gathers them.
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
            // HF Qwen2MoeSparseMoeBlock: sigmoid(shared_expert_gate(x)) scales the shared expert, added last.
            s.pair_ids[size_t(t * kc + k)] = int32_t(s.n_gpu_pairs + s.n_cpu_pairs + t);
            s.weights[size_t(t * kc + k)] = 1.0f / (1.0f + std::exp(-shared_gate[size_t(t)]));
        }
    }
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
        RoutedExpert x = decision_.experts[size_t(stream_index_[size_t(i - n_wave0_)])];
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

void HybridMoe::run_cpu_experts(const float *h) {
    const MoeStep &s = step_;
    if (s.n_cpu == 0) return;
    const auto t0 = Clock::now();
    const int64_t n_embd = model_.hp().n_embd;
    float *out = device_.cpu_out();
    auto run = [&](int32_t i, std::vector<float> &buf) {
        const int64_t first = s.cpu_offsets[size_t(i)], m = s.cpu_offsets[size_t(i) + 1] - first;
        float *xg = buf.data(), *scratch = xg + m * n_embd;
        for (int64_t p = 0; p < m; ++p) {
            std::copy_n(h + int64_t(s.cpu_rows[size_t(first + p)]) * n_embd, n_embd, xg + p * n_embd);
        }
        const ExpertViews v = store_.cpu_views(s.layer, s.cpu_expert[size_t(i)]);
        cpu_expert_ffn(v.gate, v.up, v.down, v.index, xg, m, scratch, out + first * n_embd);
    };
    // Many experts: one per thread. Few: one after another, each product threaded (as CpuExpertExecutor).
    if (s.n_cpu >= omp_get_max_threads()) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int32_t i = 0; i < s.n_cpu; ++i) run(i, scratch_[size_t(omp_get_thread_num())]);
    } else {
        for (int32_t i = 0; i < s.n_cpu; ++i) run(i, scratch_[0]);
    }
    stats_.cpu_expert_us += us_since(t0);
}

void HybridMoe::prefetch(int32_t layer, const float *h, const Routing &r) {
    const int32_t n_layers = int32_t(model_.hp().n_layer);
    if (!predictor_ || !loader_ || config_.prefetch_window <= 0 || layer + 1 >= n_layers) return;
    const auto t0 = Clock::now();
    const int64_t nt = std::min(r.n_tok, config_.predict_max_tokens), first = r.n_tok - nt;
    PredictorInput in;
    in.layer = layer;
    in.n_layers = n_layers;
    in.window = config_.prefetch_window;
    in.routed = std::span<const int32_t>(r.ids).subspan(size_t(first * r.k), size_t(nt * r.k));
    in.n_tokens = int32_t(nt);
    in.top_k = int32_t(r.k);
    in.hidden = h + first * model_.hp().n_embd;
    in.n_embd = model_.hp().n_embd;
    prefetch_list_.clear();
    predictor_->predict(in, prefetch_list_);
    prefetch_list_.sort_by_score();
    loader_->prefetch(prefetch_list_.items(), config_.prefetch_max_per_layer);
    stats_.predict_us += us_since(t0);
}

void HybridMoe::collect_timings() {
    for (size_t l = 0; l < stall_pending_.size(); ++l) {
        if (!stall_pending_[l] || !backend_->event_query(stall_end_[l])) continue;
        stall_pending_[l] = 0;
        const double us = backend_->event_elapsed_us(stall_begin_[l], stall_end_[l]);
        if (us <= 0) continue;
        cache_->record_stall(int32_t(l), us);
        stats_.device_stall_us += us;
    }
}

void HybridMoe::run_layer(int32_t layer, const float *h, const Routing &r, std::span<const float> shared_gate) {
    PRESCOPE_ASSERT(r.n_tok > 0 && r.n_tok <= max_tokens_ && r.k == model_.hp().n_expert_used);
    PRESCOPE_ASSERT(!shared_on_device_ || shared_gate.size() >= size_t(r.n_tok));
    if (!stall_pending_.empty() && stall_pending_[size_t(layer)]) collect_timings();
    const std::span<const int32_t> routed(r.ids.data(), size_t(r.n_tok * r.k));
    decide_layer(layer, routed, plan_, cache_, config_.rule, decision_);
    if (loader_) loader_->begin_layer(decision_);
    build_step(layer, r, shared_gate);

    const Stream cs = device_.compute_stream();
    if (loader_ && n_wave0_ > 0) {
        const bool timed = !stall_begin_.empty() && !stall_pending_[size_t(layer)];
        if (timed) backend_->event_record(stall_begin_[size_t(layer)], cs);
        stats_.wait_issue_us += loader_->wait_experts(decision_, cs);
        if (timed) {
            backend_->event_record(stall_end_[size_t(layer)], cs);
            stall_pending_[size_t(layer)] = 1;
        }
    }
    step_.wave = 0;
    step_.wave_begin = 0;
    step_.wave_end = n_wave0_;
    device_.launch_gpu(step_);
    // The slots are read by the work just queued: later loads into them wait for this point.
    if (loader_) loader_->end_layer(layer, cs);
    // The first streamed wave's copies run while the host predicts and runs the CPU experts.
    bool pending = step_.n_gpu > n_wave0_;
    if (pending) begin_wave(n_wave0_);
    prefetch(layer, h, r);
    run_cpu_experts(h);
    while (pending) {
        stats_.wait_issue_us += loader_->wait_experts(wave_, cs);
        ++step_.wave;
        device_.launch_gpu(step_);
        loader_->end_layer(layer, cs);
        stats_.streamed += uint64_t(step_.wave_end - step_.wave_begin);
        ++stats_.stream_waves;
        pending = step_.wave_end < step_.n_gpu;
        if (pending) begin_wave(step_.wave_end);
    }
    device_.combine(step_);
    ++stats_.layers;
}

} // namespace prescope
